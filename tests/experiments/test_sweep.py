"""Sweeps: grid expansion, the local backend (a pool of processes), resumability, failures, Ray locally."""

import json

import pytest

from torchcal.experiments.config import ConfigError
from torchcal.experiments.sweep import expand, load_sweep, run_sweep

TINY = ["data.name=digits", "data.ood.sets=[]", "data.val_size=260", "model.width=16", "train.epochs=1",
        "train.num_threads=1"]  # fmt: skip


def write_sweep(tmp_path, grid, name="sweep.yaml", **extra):
    import yaml

    spec = {"out": str(tmp_path / "out"), "grid": grid, "overrides": TINY, "evaluate": ["ts"], **extra}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_expand_names_and_validation(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path, {"loss.name": ["ce", "fl-3"], "train.seed": [0, 1]}))
    runs = expand(sweep)
    assert [r["name"] for r in runs] == [
        "name-ce_seed-0",
        "name-ce_seed-1",
        "name-fl-3_seed-0",
        "name-fl-3_seed-1",
    ]
    assert 'loss.name="fl-3"' in runs[2]["overrides"]
    with pytest.raises(ConfigError, match="unknown key optim.lrate"):
        load_sweep(write_sweep(tmp_path, {"optim.lrate": [0.1]}, "bad.yaml"))
    with pytest.raises(ConfigError, match="unknown sweep keys"):
        load_sweep(write_sweep(tmp_path, {}, "bad2.yaml", backend="ray"))
    with pytest.raises(ConfigError, match=r"`evaluate`: unknown calibrator 'tss'"):
        load_sweep(write_sweep(tmp_path, {"train.seed": [0]}, "bad3.yaml", evaluate=["tss"]))
    with pytest.raises(ConfigError, match=r"`arena`: unknown calibrator 'nope'"):
        load_sweep(write_sweep(tmp_path, {"train.seed": [0]}, "bad5.yaml", arena=["ts", "nope"]))
    from torchcal.calibrators import list_calibrators

    assert load_sweep(write_sweep(tmp_path, {}, "arena.yaml", arena="all")).arena == tuple(list_calibrators())
    with pytest.raises(ConfigError, match="train.epochs must be >= 1"):
        load_sweep(write_sweep(tmp_path, {"train.epochs": [2, 0]}, "bad4.yaml"))


def test_local_sweep_is_resumable_and_reports_failures(tmp_path):
    path = write_sweep(tmp_path, {"loss.name": ["ce", "dfl"], "data.name": ["digits", "cifar10"]},
                       arena=["ts", "histogram"])  # fmt: skip
    sweep = load_sweep(path)
    logs = []
    state = run_sweep(sweep, workers=2, log=logs.append)
    out = tmp_path / "out"
    assert {k: v["status"] for k, v in state.items()} == {
        "loss.name-ce_data.name-digits": "done", "loss.name-dfl_data.name-digits": "done",
        "loss.name-ce_data.name-cifar10": "failed", "loss.name-dfl_data.name-cifar10": "failed",
    }  # fmt: skip
    assert "CIFAR-10" in state["loss.name-ce_data.name-cifar10"]["log"]  # the missing-data message is kept
    assert (out / "report" / "report.md").exists() and (out / "report" / "report.html").exists()
    arena = json.loads((out / "report" / "arena.json").read_text())  # the arena over the two finished runs
    assert arena["summary"]["n_tasks"] == 2 and arena["calibrators"] == ["ts", "histogram"]
    saved = json.loads((out / "sweep_state.json").read_text())
    assert saved["loss.name-ce_data.name-digits"]["status"] == "done"
    mtime = (out / "loss.name-ce_data.name-digits" / "logits.pt").stat().st_mtime_ns
    logs.clear()
    run_sweep(sweep, log=logs.append)  # nothing finished is redone, failed runs are skipped
    assert (out / "loss.name-ce_data.name-digits" / "logits.pt").stat().st_mtime_ns == mtime
    assert any("4 runs: 4 finished or skipped, 0 to run" in line for line in logs)
    logs.clear()
    run_sweep(sweep, retry_failed=True, log=logs.append)
    assert any("2 to run" in line for line in logs)


def test_ray_backend_locally(tmp_path):
    ray = pytest.importorskip("ray")
    path = write_sweep(tmp_path, {"loss.name": ["ce", "fl-3"]})
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        state = run_sweep(load_sweep(path), backend="ray", log=lambda *_: None)
    finally:
        ray.shutdown()
    assert all(v["status"] == "done" for v in state.values()) and len(state) == 2


def test_paper_sweep_files_load():
    from pathlib import Path

    files = sorted(Path(__file__).resolve().parents[2].joinpath("sweeps").glob("*.yaml"))
    assert len(files) == 11
    sizes = {f.stem: len(expand(load_sweep(f))) for f in files}
    assert sizes == {
        "cifar10_table": 180,
        "cifar100_table": 180,
        "tinyimagenet_table": 45,
        "20newsgroups_table": 45,
        "agnews_table": 45,
        "finsen_table": 45,
        "sstbinary_table": 45,
        "20newsgroups_bert_table": 20,
        "imagenet_table": 15,
        "fcl_fig6_lambda": 18,  # FCL Fig. 6: λ ∈ {0, 0.5, 1, 1.5, 2, 3} × 3 seeds
        "fts_fig8_gammas": 40,  # focal TS Fig. 8: CE, FL γ ∈ {1, 2, 3, 5, 7}, FLSD-53, AdaFocal × 5 seeds
    }
