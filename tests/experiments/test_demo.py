"""The demo's engine: a grid of losses × seeds in worker processes (resumable), the per-loss summary over
seeds, the regime statement, and the demo command on a tiny protocol."""

import json

import pytest
from typer.testing import CliRunner

from torchcal.experiments.cli import app
from torchcal.experiments.demo import PROTOCOLS, demo_jobs, regime, run_jobs, summary_rows
from torchcal.experiments.errors import UserError
from torchcal.experiments.evaluation.evaluate import collect_groups

TINY = ["data.name=digits", "data.ood.sets=[]", "data.val_size=260", "model.width=16", "train.epochs=2",
        "data.limit_train=0"]  # fmt: skip


def test_regime_follows_cross_entropys_temperature():
    assert regime(2.16).startswith("over-confident regime") and "2.16 > 1" in regime(2.16)
    assert regime(0.5).startswith("under-confident regime")
    assert regime(1.02).startswith("calibrated regime")


def test_protocols_and_jobs(tmp_path):
    assert set(PROTOCOLS) == {"overfit", "short"}
    assert "data.limit_train=3000" in PROTOCOLS["overfit"]["overrides"]
    jobs = demo_jobs(tmp_path, "overfit", ("ce", "fl-3"), (0, 1), ["train.epochs=2"])
    assert [j.run_dir.name for j in jobs] == ["ce-s0", "ce-s1", "fl-3-s0", "fl-3-s1"]
    assert (
        jobs[1].overrides[-2:] == ("loss.name=ce", "train.seed=1") and "train.epochs=2" in jobs[1].overrides
    )
    with pytest.raises(UserError, match="unknown protocol 'long'"):
        demo_jobs(tmp_path, "long")


@pytest.mark.parametrize("workers", [1, 2])
def test_grid_runs_in_workers_and_summarises_over_seeds(tmp_path, workers):
    jobs = demo_jobs(tmp_path, "short", ("ce", "fl-3"), (0, 1), TINY)
    done = []
    run_jobs(jobs, ("ts",), workers, on_done=done.append)
    assert sorted(j.run_dir.name for j in done) == ["ce-s0", "ce-s1", "fl-3-s0", "fl-3-s1"]
    runs = [j.run_dir for j in jobs]
    rows = summary_rows({"ts": collect_groups(runs, "ts")})
    assert [r["loss"] for r in rows] == ["ce", "fl-3"] and all(r["seeds"] == "0, 1" for r in rows)
    ece = [json.loads((r / "results.json").read_text())["uncalibrated"]["test"]["ece"] for r in runs[:2]]
    mean, std, n = rows[0]["ece pre"]
    assert n == 2 and abs(mean - 50 * sum(ece)) < 1e-9 and std > 0  # two seeds, two different runs
    before = {r: (r / "logits.pt").stat().st_mtime_ns for r in runs}
    run_jobs(jobs, ("ts",), workers)  # finished runs are kept
    assert {r: (r / "logits.pt").stat().st_mtime_ns for r in runs} == before


def test_demo_command_on_a_tiny_protocol(tmp_path, monkeypatch):
    monkeypatch.setitem(
        PROTOCOLS, "short", {"overrides": ["train.epochs=1", "model.width=8"], "text": "tiny"}
    )
    monkeypatch.setattr("torchcal.experiments.demo.DEMO_LOSSES", ("ce", "dfl"))
    monkeypatch.setenv("TORCHCAL_FASHION_MNIST", str(tmp_path / "no-fashion-mnist"))  # -> digits fallback
    result = CliRunner().invoke(app, ["demo", "--out", str(tmp_path / "d"), "--protocol", "short", "--seeds", "2",
                                      "--workers", "1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "falling back to scikit-learn digits" in result.output and "regime" in result.output
    for calibrator in ("ts", "fts"):
        md = (tmp_path / "d" / f"report-{calibrator}" / "report.md").read_text()
        assert "| digits · mlp · ce | 0, 1 |" in md and "regime" in md
        assert "<h2>Comparison</h2>" in (tmp_path / "d" / f"report-{calibrator}" / "report.html").read_text()
    result = CliRunner().invoke(app, ["demo", "--out", str(tmp_path / "e"), "--protocol", "long"])
    assert result.exit_code == 2 and "unknown protocol 'long'" in result.output


def test_report_names_the_regime_of_cross_entropy_runs(tmp_path):
    jobs = demo_jobs(tmp_path, "short", ("ce", "fl-3"), (0,), TINY)
    run_jobs(jobs, ("ts",), 1)
    result = CliRunner().invoke(
        app, ["report", *(str(j.run_dir) for j in jobs), "--out", str(tmp_path / "r")]
    )
    assert result.exit_code == 0, result.output
    t = json.loads((jobs[0].run_dir / "results.json").read_text())["ts"]["parameters"]["temperature_"]
    assert regime(t) in (tmp_path / "r" / "report.md").read_text()
    assert regime(t).split(":")[0] in (tmp_path / "r" / "report.html").read_text()
