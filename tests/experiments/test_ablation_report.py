"""The papers' ablations from the command line on tiny data: the loss options by config key, and the report's
columns on request (RBS, debiased ECE, the ECE sweeps)."""

import csv
import io
import json
import math

import pytest
from typer.testing import CliRunner

from torchcal.experiments.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One epoch of the dual focal loss's "mean" variant on digits (a config key), evaluated with TS."""
    run = tmp_path_factory.mktemp("abl") / "run"
    args = ["train", "--run-dir", str(run), "data.name=digits", "data.ood.sets=[]", "data.val_size=260",
            "model.width=16", "train.epochs=1", "loss.name=dfl", "loss.kwargs.dual_logit=mean"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["evaluate", str(run), "--calibrators", "ts"])
    assert result.exit_code == 0, result.output
    return run


def _csv_row(path):
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    assert len(rows) == 1
    return rows[0]


def test_report_columns_on_request(run, tmp_path):
    saved = json.loads((run / "results.json").read_text())
    test = saved["uncalibrated"]["test"]
    assert test["rbs"] == pytest.approx(math.sqrt(test["brier"]), rel=1e-12)
    out = tmp_path / "rep"
    result = runner.invoke(
        app, ["report", str(run), "--out", str(out), "--columns", "rbs,debiased_ece,ece_sweep,ece_sweep_ew"]
    )
    assert result.exit_code == 0, result.output
    md = (out / "report.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| method"))
    assert (
        "| S99 (% with conf ≥ 0.99) | RBS | debiased ECE | ECE sweep (equal mass) | ECE sweep (equal width) |"
        in header
    )
    assert "root Brier score" in md
    row = _csv_row(out / "report.csv")
    for name in ("rbs", "debiased_ece", "ece_sweep", "ece_sweep_ew"):
        assert float(row[f"{name}_pre_mean"]) == pytest.approx(100 * test[name], rel=1e-12)
        assert float(row[f"{name}_post_mean"]) == pytest.approx(100 * saved["ts"]["test"][name], rel=1e-12)
    assert "RBS (pre → post)" in (out / "report.html").read_text()
    # without --columns the table keeps its layout
    plain = tmp_path / "plain"
    assert runner.invoke(app, ["report", str(run), "--out", str(plain)]).exit_code == 0
    assert (
        "RBS" not in (plain / "report.md").read_text()
        and "rbs_pre_mean" not in (plain / "report.csv").read_text()
    )


def test_report_column_refusals_write_nothing(run, tmp_path):
    out = tmp_path / "bad"
    result = runner.invoke(app, ["report", str(run), "--out", str(out), "--columns", "rbs,kde"])
    assert result.exit_code == 2
    assert "unknown column 'kde'" in result.output and not out.exists()
    # a run evaluated before a column existed: RBS comes from its Brier score, the others name the fix
    old = tmp_path / "old"
    old.mkdir()
    for f in run.iterdir():
        if f.is_file():
            (old / f.name).write_bytes(f.read_bytes())
    saved = json.loads((old / "results.json").read_text())
    for key in ("uncalibrated", "ts"):
        del saved[key]["test"]["rbs"], saved[key]["test"]["debiased_ece"]
    (old / "results.json").write_text(json.dumps(saved))
    ok = tmp_path / "ok"
    assert runner.invoke(app, ["report", str(old), "--out", str(ok), "--columns", "rbs"]).exit_code == 0
    brier = saved["uncalibrated"]["test"]["brier"]
    assert float(_csv_row(ok / "report.csv")["rbs_pre_mean"]) == pytest.approx(
        100 * math.sqrt(brier), rel=1e-12
    )
    result = runner.invoke(
        app, ["report", str(old), "--out", str(tmp_path / "no"), "--columns", "debiased_ece"]
    )
    assert result.exit_code == 2
    assert "evaluated before it existed" in result.output and not (tmp_path / "no").exists()


def _gamma_history(run):
    import torch

    state = torch.load(run / "checkpoint.pt", weights_only=True)
    return state["loss"]["gamma_history"]


@pytest.mark.parametrize("every", [0, 3, 1])
def test_adafocal_update_frequency(tmp_path, every):
    """AdaFocal's update-frequency ablation (AdaFocal App. I, Figs. 16-17) and its unconstrained γ (App. N):
    γ updated after each epoch's validation pass (0), every n batches (n) and every batch (1), 2 epochs."""
    from torchcal.experiments.config import load_config
    from torchcal.experiments.data.readers import load_splits

    run = tmp_path / "run"
    overrides = ["data.name=digits", "data.ood.sets=[]", "data.val_size=260", "data.loader.batch_size=128", "model.width=8",
                 "train.epochs=2", "loss.name=adafocal", f"loss.update_every={every}",
                 "loss.kwargs.gamma_max=inf"]  # fmt: skip
    result = runner.invoke(app, ["train", "--run-dir", str(run), *overrides])
    assert result.exit_code == 0, result.output
    n_train = len(load_splits(load_config(None, overrides).data)["train"])
    n_batches = -(-n_train // 128)  # the runner's batches per epoch, the last one partial
    assert n_batches > 3  # so that every n batches differs from every batch and from every epoch
    history = _gamma_history(run)
    assert history.shape == (2 * (n_batches // every) if every else 2, 15)
    assert bool(history.isfinite().all())


def test_adafocal_update_schedule(tmp_path):
    """AdaFocal-schedule (AdaFocal Fig. 53): γ updated after the validation pass of epoch 0, every 3 batches in
    epoch 1 and every batch in epoch 2 (``loss.update_schedule=[[1, 3], [2, 1]]``), so γ's history holds
    1 + n_batches // 3 + n_batches rows."""
    from torchcal.experiments.config import load_config
    from torchcal.experiments.data.readers import load_splits

    run = tmp_path / "run"
    overrides = ["data.name=digits", "data.ood.sets=[]", "data.val_size=260", "data.loader.batch_size=128",
                 "model.width=8", "train.epochs=3", "loss.name=adafocal", "loss.update_schedule=[[1, 3], [2, 1]]"]  # fmt: skip
    result = runner.invoke(app, ["train", "--run-dir", str(run), *overrides])
    assert result.exit_code == 0, result.output
    n_train = len(load_splits(load_config(None, overrides).data)["train"])
    n_batches = -(-n_train // 128)
    assert n_batches > 3
    assert _gamma_history(run).shape == (1 + n_batches // 3 + n_batches, 15)


def test_update_schedule_picks_the_last_started_entry():
    from torchcal.experiments.config import LossConfig

    lo = LossConfig(name="adafocal", update_every=5, update_schedule=[[25, 100], [40, 1]])
    assert [lo.update_every_at(e) for e in (0, 24, 25, 39, 40, 49)] == [5, 5, 100, 100, 1, 1]
