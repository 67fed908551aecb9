"""The runner's commands refuse what they cannot do truthfully, before they write: a sweep whose file no
longer describes its run folders, a resume that would record settings that never ran, an output that cannot
be written, a damaged sweep file or state, a later run of `evaluate` that cannot be evaluated, a calibrator
argument `fit` would refuse. Each refusal is one line and exit status 2; a report row of one run has no
standard deviation."""

import csv
import io
import json
import math
import os
import shutil
import subprocess

import pytest
import yaml
from typer.testing import CliRunner

from torchcal.experiments.cli import app
from torchcal.experiments.config import RESUMABLE_KEYS, ConfigError, load_config
from torchcal.experiments.errors import RunError
from torchcal.experiments.run_files import atomic_write_bytes
from torchcal.experiments.sweep import load_sweep, run_sweep
from torchcal.experiments.training.loop import train

runner = CliRunner()
MOONS = ["data.name=moons", "data.n_train=200", "data.val_size=100", "data.n_test=200", "model.width=8",
         "train.epochs=1", "train.num_threads=1", "train.calibrators=[ts]"]  # fmt: skip


def snapshot(folder):
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_error_line(result, *parts):
    """The refusal is exit status 2 and one `torchcal: error:` line holding ``parts``."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("torchcal: error:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    for part in parts:
        assert part in lines[0], (part, lines[0])


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished moons run with ts fitted."""
    run = tmp_path_factory.mktemp("runs") / "run"
    train(load_config(None, MOONS), run)
    return run


def copy_of(finished, tmp_path, name="run"):
    shutil.copytree(finished, tmp_path / name)
    return tmp_path / name


# -- 1. a sweep's report holds the runs of the current grid, each made with the grid's config ----------------


def write_sweep(path, out, grid, overrides=MOONS):
    path.write_text(yaml.safe_dump({"out": str(out), "grid": grid, "overrides": list(overrides),
                                    "evaluate": ["ts"]}))  # fmt: skip
    return path


def test_sweep_refuses_a_run_folder_made_with_another_config(tmp_path):
    out = tmp_path / "out"
    train(load_config(None, [*MOONS, "train.seed=0"]), out / "seed-0")  # the run the grid asks for, finished
    path = write_sweep(tmp_path / "sweep.yaml", out, {"train.seed": [0]})
    state = run_sweep(load_sweep(path), log=lambda *_: None)
    assert state["seed-0"]["status"] == "done"
    write_sweep(path, out, {"train.seed": [0]}, [*MOONS, "model.width=16"])  # the file edited
    before = snapshot(out)
    with pytest.raises(ConfigError, match=r"run seed-0 .*model\.width: saved 8, grid 16"):
        run_sweep(load_sweep(path), log=lambda *_: None)
    assert snapshot(out) == before
    # execution settings may differ (they never change what a run computes)
    write_sweep(path, out, {"train.seed": [0]}, [*MOONS, "train.calibrators=[ts,fts]", "train.test_every=0"])
    assert run_sweep(load_sweep(path), log=lambda *_: None)["seed-0"]["status"] == "done"


def test_sweep_reports_only_the_runs_of_its_current_grid(tmp_path):
    out = tmp_path / "out"
    train(load_config(None, [*MOONS, "train.seed=0"]), out / "seed-0")
    path = write_sweep(tmp_path / "sweep.yaml", out, {"train.seed": [0]})
    run_sweep(load_sweep(path), log=lambda *_: None)
    train(load_config(None, [*MOONS, "train.seed=1"]), out / "seed-1")  # as the edited grid's run would be
    write_sweep(path, out, {"train.seed": [1]})
    with pytest.warns(UserWarning, match=r"earlier grid .* left out of the report: seed-0"):
        state = run_sweep(load_sweep(path), log=lambda *_: None)
    assert list(state) == ["seed-1"]
    rows = list(csv.DictReader(io.StringIO((out / "report" / "report.csv").read_text())))
    assert [r["seeds"] for r in rows] == ["1"] and "seed-0" not in rows[0]["runs"]


# -- 2. resuming a finished run records only what ran ----------------------------------------------------------


def test_resume_of_a_finished_run_keeps_the_config_true(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    before = snapshot(run)
    result = runner.invoke(app, ["train", "-o", str(run), "--resume", "train.test_every=0"])
    assert result.exit_code == 0, result.output
    assert "train.test_every would apply only to epochs still to train" in result.output
    assert snapshot(run) == before  # nothing ran: config.yaml and meta.resumes unchanged
    result = runner.invoke(app, ["train", "-o", str(run), "--resume", "train.calibrators=[ets]"])
    assert result.exit_code == 0, result.output
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["train"]["calibrators"] == ["ts", "ets"]  # ts fitted by the training, ets now
    assert saved["meta"]["resumes"] == [{"from_epoch": 1, "changed": {"train.calibrators": [["ts"], ["ts", "ets"]]}}]
    results = json.loads((run / "results.json").read_text())
    assert {"ts", "ets"} <= set(results) and (run / "calibrators" / "ets.pt").exists()


# -- 3. an output that cannot be written -----------------------------------------------------------------------


def test_unwritable_outputs_are_one_line_and_write_nothing(finished, tmp_path):
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    one_error_line(runner.invoke(app, ["train", "-o", str(a_file), *MOONS]), f"cannot write {a_file}")
    one_error_line(runner.invoke(app, ["train", "-o", str(a_file / "run"), *MOONS]), "cannot write")
    one_error_line(runner.invoke(app, ["report", str(finished), "--out", str(a_file)]), f"cannot write {a_file}")
    one_error_line(runner.invoke(app, ["arena", str(finished), "--out", str(a_file), "--calibrators", "ts",
                                       "--resamples", "10"]), f"cannot write {a_file}")  # fmt: skip
    assert a_file.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    with pytest.raises(RunError, match="cannot write .*: No such file or directory"):
        atomic_write_bytes(tmp_path / "missing" / "f.txt", lambda fh: fh.write(b"x"))


def test_a_read_only_output_folder_is_refused_before_training(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() == 0:  # root writes into a chmod-read-only folder: make it immutable
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode != 0:
            pytest.skip("chattr +i is not available here")
    else:
        folder.chmod(0o555)
    try:
        one_error_line(runner.invoke(app, ["train", "-o", str(folder / "run"), *MOONS]), "cannot write")
        assert list(folder.iterdir()) == []
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(folder)])
        folder.chmod(0o755)


# -- 4. a damaged sweep file or state --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, message",
    [
        ("out: sw\ngrid: [a\n", "is not valid YAML"),
        ("out: sw\ngrid: {loss.name: [ce]}\nresources: 5\n", "`resources` must be a mapping"),
        ("[1, 2]\n", "must be a mapping"),
    ],
)
def test_a_damaged_sweep_file_is_one_line(tmp_path, text, message):
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    one_error_line(runner.invoke(app, ["sweep", str(path)]), str(path), message)


def test_a_damaged_sweep_state_is_one_line_saying_to_delete_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "sweep_state.json").write_text('{"seed-0": {"status": "do')
    path = write_sweep(tmp_path / "sweep.yaml", out, {"train.seed": [0]})
    one_error_line(runner.invoke(app, ["sweep", str(path)]), "sweep_state.json is damaged", "delete it")
    assert sorted(p.name for p in out.iterdir()) == ["sweep_state.json"]


# -- 5. evaluate checks every run before it writes to the first --------------------------------------------------


def test_evaluate_checks_every_run_first(finished, tmp_path):
    first, second = copy_of(finished, tmp_path, "r1"), copy_of(finished, tmp_path, "r2")
    (second / "logits.pt").unlink()
    before = snapshot(first)
    result = runner.invoke(app, ["evaluate", str(first), str(second), "--calibrators", "ets"])
    one_error_line(result, f"{second / 'logits.pt'} not found")
    assert snapshot(first) == before


# -- 6. a calibrator argument fit would refuse fails when the spec is read ----------------------------------------


def test_a_wrong_calibrator_argument_fails_before_anything_is_written(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    before = snapshot(run)
    result = runner.invoke(app, ["evaluate", str(run), "--calibrators", "ets,ts:objective=foo"])
    one_error_line(result, "'ts:objective=foo'", "`objective`")
    assert snapshot(run) == before
    result = runner.invoke(app, ["train", "-o", str(tmp_path / "new"), *MOONS, "train.calibrators=[ts:objective=foo]"])
    one_error_line(result, "'ts:objective=foo'", "`objective`")
    assert not (tmp_path / "new").exists()
    result = runner.invoke(app, ["arena", str(run), "--out", str(tmp_path / "arena"), "--calibrators",
                                 "ts,ts:objective=foo", "--resamples", "10"])  # fmt: skip
    one_error_line(result, "'ts:objective=foo'", "`objective`")
    assert not (tmp_path / "arena").exists() and snapshot(run) == before
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"out": str(tmp_path / "sw"), "evaluate": ["fts:n_bins=0"]}))
    with pytest.raises(ConfigError, match=r"`evaluate`: calibrator spec 'fts:n_bins=0': `n_bins` must be >= 1"):
        load_sweep(sweep)


# -- 7. --resume documents every key it accepts ------------------------------------------------------------------


def test_resume_help_and_readme_list_every_resumable_key():
    from pathlib import Path

    import typer.main

    command = typer.main.get_command(app).commands["train"]  # type: ignore[attr-defined]
    help_text = next(p.help for p in command.params if p.name == "resume")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    paragraph = readme[readme.index("`--resume` continues a run") :].split("\n\n")[0]
    for key in RESUMABLE_KEYS:
        assert key in help_text, key
        assert f"`{key}" in paragraph, key


# -- 8. evaluate tells a folder without a run and a file apart ------------------------------------------------------


def test_evaluate_names_what_is_not_a_run(tmp_path):
    (tmp_path / "empty").mkdir()
    result = runner.invoke(app, ["evaluate", str(tmp_path / "empty")])
    one_error_line(result, "is not a run folder (no config.yaml and no logits.pt)")
    assert "--resume" not in result.output
    (tmp_path / "afile").write_text("x")
    one_error_line(runner.invoke(app, ["evaluate", str(tmp_path / "afile")]), "is not a folder")
    one_error_line(runner.invoke(app, ["evaluate", str(tmp_path / "nope")]), "does not exist")


# -- 9. a row of one run has no standard deviation ----------------------------------------------------------------


def test_a_single_run_row_has_no_std(finished, tmp_path):
    result = runner.invoke(app, ["report", str(finished), "--out", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    row = next(csv.DictReader(io.StringIO((tmp_path / "rep" / "report.csv").read_text())))
    assert row["n_runs"] == "1"
    for key in ("ece_pre", "nll_post", "error_pre"):
        assert math.isnan(float(row[f"{key}_std"])) and math.isnan(float(row[f"{key}_sem"])), key
    table = [line for line in (tmp_path / "rep" / "report.md").read_text().splitlines() if line.startswith("| ")]
    assert len(table) == 2 and " ± " not in table[1]  # the Markdown shows the mean alone, as the HTML does


def test_gradcam_names_a_missing_run_folder(tmp_path, finished):
    """A missing folder was read as a corrupt checkpoint ("[Errno 2] ..."); it is named as missing, before the
    first run's model is loaded and before the figure is written."""
    out = tmp_path / "cam.png"
    for args, part in (([str(tmp_path / "nope")], "does not exist"),
                       ([str(finished), str(tmp_path / "nope")], "does not exist"),
                       ([str(out.parent / "file.txt")], "is not a folder")):  # fmt: skip
        (out.parent / "file.txt").write_text("x")
        result = runner.invoke(app, ["gradcam", *args, "--target", "0", "--out", str(out)])
        one_error_line(result, part)
        assert not out.exists()


def test_figures_refuse_non_finite_gammas(tmp_path, finished):
    """`--gammas nan,inf` drew focal-fig4a's curves labelled "γ = nan" with status 0; it is refused in one
    line and no figure is written."""
    out = tmp_path / "figs"
    result = runner.invoke(app, ["figures", str(finished), "--gammas", "1,nan,inf", "--out", str(out)])
    one_error_line(result, "--gammas", "finite")
    assert not out.exists() or not any(out.iterdir())
