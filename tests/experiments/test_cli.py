import json

import pytest
from typer.testing import CliRunner

from torchcal.experiments.cli import app

runner = CliRunner()


def test_list():
    result = runner.invoke(app, ["list", "losses"])
    assert result.exit_code == 0 and "flsd-53: multiclass (softmax)" in result.output
    assert "binary-fcl: multilabel (sigmoid)" in result.output
    result = runner.invoke(app, ["list", "calibrators"])
    assert (
        "ts: multiclass (softmax), multilabel (sigmoid)" in result.output
        and "platt: multilabel" in result.output
    )
    assert runner.invoke(app, ["list", "things"]).exit_code != 0


def test_train_evaluate_report(tmp_path):
    run = tmp_path / "run"
    args = ["train", "--run-dir", str(run), "data.name=digits", "data.ood.sets=[]", "data.val_size=260",
            "model.width=16", "train.epochs=1", "loss.name=dfl"]  # fmt: skip
    result = runner.invoke(app, [*args[:-2], "train.epochs=2", "loss.name=dfl"])
    assert result.exit_code == 0, result.output
    assert (run / "logits.pt").exists()
    # one line per epoch: loss, validation ECE and error (×100) of the row written to metrics.jsonl
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        line = (
            f"epoch {row['epoch'] + 1}/2  loss {row['train_loss']:.4f}  val ECE {100 * row['val_ece']:.2f}  "
            f"val error {100 * row['val_error']:.2f}"
        )
        assert line in result.output
    result = runner.invoke(app, ["calibrate", str(run), "--method", "ets"])
    assert result.exit_code == 0, result.output
    saved = json.loads((run / "results.json").read_text())
    assert "{" not in result.output  # a table, the JSON stays in the run folder
    _assert_table(result.output, saved, ["ets"])
    result = runner.invoke(app, ["evaluate", str(run), "--calibrators", "ts"])
    assert result.exit_code == 0, result.output
    saved = json.loads((run / "results.json").read_text())
    _assert_table(result.output, saved, ["ts"])
    assert "ts: T = " in result.output and "results.json" in result.output
    result = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "rep")])
    assert result.exit_code == 0 and (tmp_path / "rep" / "report.csv").exists()


def _assert_table(output, saved, calibrators):
    """The before/after table shows the saved test ECE and error (×100) of each column."""
    lines = output.splitlines()
    for key, label in (("ece", "ECE"), ("error", "error")):
        row = next(line for line in lines if line.strip("│ ").startswith(label + " "))
        for column in ("uncalibrated", *calibrators):
            assert f"{100 * saved[column]['test'][key]:.2f}" in row, (label, column, row)


def test_unknown_override_key_fails_with_the_valid_keys(tmp_path):
    result = runner.invoke(app, ["train", "--run-dir", str(tmp_path / "r"), "optim.lrate=1"])
    assert result.exit_code != 0
    assert "unknown key optim.lrate" in result.output


def test_build_extension_reports_the_library_or_the_failure(monkeypatch, cpp_extension):
    import torchcal.functional as F

    result = runner.invoke(app, ["build-extension"])
    assert result.exit_code == 0, result.output
    assert "C++ operators (losses, metrics scan) ready" in result.output and ".so" in result.output

    def broken(verbose=False):
        raise RuntimeError("Error building extension 'torchcal_fused': c++ not found")

    monkeypatch.setattr(F, "build_cpu_extension", broken)
    result = runner.invoke(app, ["build-extension"])
    assert result.exit_code == 1
    assert "could not build the C++ operators" in result.output and "c++ not found" in result.output


@pytest.mark.parametrize(
    "argv, message",
    [
        (["evaluate"], "Missing argument 'run_dirs'"),
        (["train", "--bogus"], "No such option: --bogus"),
        (["nosuch"], "No such command 'nosuch'"),
    ],
)
def test_usage_errors_are_one_line_with_status_2(tmp_path, argv, message):
    """The console entry point: the parser's usage errors are one line on stderr and exit status 2, like every
    other user error (no boxed panel)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "torchcal", *argv], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("torchcal: error: ") and message in lines[0], proc.stderr
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []  # a refused command writes nothing


def test_entry_point_keeps_status_of_a_command(tmp_path):
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-m", "torchcal", "list", "losses"], capture_output=True, text=True,
                        timeout=120)  # fmt: skip
    assert ok.returncode == 0 and "focal" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "torchcal", "train", str(tmp_path / "nope.yaml")],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "does not exist" in bad.stderr
