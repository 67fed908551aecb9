"""The training loop: files of a run, exact resume after a stop or a SIGKILL, clear checkpoint errors."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from torchcal.experiments.config import ConfigError, load_config
from torchcal.experiments.evaluation.evaluate import evaluate_run, report
from torchcal.experiments.training.loop import CheckpointError, RunError, train

TINY = ["data.name=digits", "data.ood.sets=[]", "data.val_size=260", "data.loader.batch_size=64", "model.width=16",
        "train.epochs=3", "train.num_threads=1"]  # fmt: skip


def tiny(*extra):
    return load_config(None, [*TINY, *extra])


def weights(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]


def test_run_folder_contents(tmp_path):
    rows = train(tiny(), tmp_path / "run")
    run = tmp_path / "run"
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["width"] == 16 and saved["meta"]["torchcal_version"]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [0, 1, 2]
    assert {"val_ece", "test_ece", "train_loss"} <= set(json.loads(lines[-1]))
    logits = torch.load(run / "logits.pt", weights_only=True)
    assert set(logits) == {"val", "test", "shift"} and logits["test"]["logits"].shape[1] == 10
    with pytest.raises(RunError, match="--resume"):
        train(tiny(), run)


def test_stop_and_resume_equals_uninterrupted(tmp_path):
    train(tiny("loss.name=adafocal"), tmp_path / "full")
    train(tiny("loss.name=adafocal"), tmp_path / "part", stop_after=1)
    assert len((tmp_path / "part" / "metrics.jsonl").read_text().splitlines()) == 1
    rows = train(None, tmp_path / "part", resume=True)  # the config comes from the checkpoint
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    full, part = weights(tmp_path / "full"), weights(tmp_path / "part")
    for name in full:
        assert torch.equal(full[name], part[name]), name
    full_rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert full_rows == rows  # AdaFocal's γ and every metric identical


@pytest.mark.parametrize("kill_after", [2.6, 3.3, 4.0])
def test_sigkill_at_any_moment_then_resume(tmp_path, kill_after):
    """Kill the training process with SIGKILL at some moment (import ~2 s, then 6 short epochs), resume
    (or restart when no checkpoint was written yet) and compare with an uninterrupted run bit for bit."""
    cfg_args = [*TINY, "train.epochs=6"]
    train(load_config(None, cfg_args), tmp_path / "reference")
    run = tmp_path / "killed"
    code = (
        "from torchcal.experiments.config import load_config; from torchcal.experiments.training.loop import train;"
        f"train(load_config(None, {cfg_args!r}), {str(run)!r})"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"})
    time.sleep(kill_after)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    leftovers = [p.name for p in run.glob("*.tmp")] if run.exists() else []
    if (run / "checkpoint.pt").exists():
        torch.load(run / "checkpoint.pt", weights_only=True)  # never half-written
    if (run / "config.yaml").exists():  # started: resume (from its config alone before the first checkpoint)
        train(load_config(None, cfg_args), run, resume=True)
    else:
        train(load_config(None, cfg_args), run)
    reference, resumed = weights(tmp_path / "reference"), weights(run)
    for name in reference:
        assert torch.equal(reference[name], resumed[name]), name
    ref_rows = (tmp_path / "reference" / "metrics.jsonl").read_text()
    assert (run / "metrics.jsonl").read_text() == ref_rows
    # a temporary file of an interrupted atomic write may remain, but never under a real name
    assert all(name.endswith(".tmp") for name in leftovers)


def test_corrupt_or_foreign_checkpoints(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt or not a torchcal checkpoint"):
        train(tiny(), run, resume=True)
    torch.save({"weights": torch.zeros(2)}, run / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="not a torchcal checkpoint"):
        train(tiny(), run, resume=True)
    with pytest.raises(RunError, match="does not exist"):
        train(tiny(), tmp_path / "empty", resume=True)


def test_evaluate_and_report(tmp_path):
    runs = []
    for loss in ("ce", "fl-3"):
        train(tiny(f"loss.name={loss}", "train.epochs=1"), tmp_path / loss)
        result = evaluate_run(tmp_path / loss, ("ts", "fts"))
        assert {"uncalibrated", "ts", "fts"} <= set(result)
        assert result["ts"]["parameters"]["temperature_"] > 0
        runs.append(tmp_path / loss)
    markdown, csv_text = report(runs, tmp_path / "report")
    assert "| digits · mlp · ce | 0 |" in markdown and "| digits · mlp · fl-3 | 0 |" in markdown
    assert (tmp_path / "report" / "report.md").exists() and len(csv_text.splitlines()) == 3


def test_parity_with_a_plain_pytorch_loop(tmp_path):
    """The runner's weights equal those of a plain 20-line loop on the same model, data order and seed."""
    from torchcal.experiments.data.readers import load_splits
    from torchcal.experiments.models.registry import create_model

    cfg = tiny("loss.name=fl-3", "optim.name=sgd", "optim.lr=0.05", "optim.milestones=[2]", "train.epochs=3")
    train(cfg, tmp_path / "run")

    splits = load_splits(cfg.data)
    x, y = splits["train"].inputs, splits["train"].targets
    torch.manual_seed(cfg.train.seed)
    model = create_model("mlp", 10, x.shape[1:], 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2], gamma=0.1)
    for epoch in range(3):
        model.train()
        order = torch.randperm(
            len(y), generator=torch.Generator().manual_seed(cfg.train.seed * 100_003 + epoch)
        )
        for idx in order.split(64):
            opt.zero_grad()
            p_t = torch.softmax(model(x[idx]), 1).gather(1, y[idx, None]).squeeze(1)
            (-((1 - p_t) ** 3) * torch.log(p_t)).mean().backward()
            opt.step()
        sched.step()
    runner = weights(tmp_path / "run")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(runner[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("amp", ["bfloat16", "float16"])
def test_autocast_and_channels_last_options_train_finitely(tmp_path, amp):
    cfg = tiny("model.name=small_cnn", "train.epochs=1", f"train.amp={amp}", "train.channels_last=true",
               "loss.name=flsd-53")  # fmt: skip
    rows = train(cfg, tmp_path / "run")
    assert all(map(lambda v: v == v, [rows[0]["train_loss"], rows[0]["val_ece"]]))  # not NaN
    with pytest.raises(ValueError, match="train.amp must be 'auto', 'bfloat16', 'float16' or 'off', got 'fp8'"):
        train(tiny("train.amp=fp8"), tmp_path / "bad")


def test_html_report_with_seeds_and_figures(tmp_path):
    from torchcal.experiments.reports.html import group_runs, html_report, summarise

    runs = []
    for seed in (0, 1):
        train(tiny("loss.name=adafocal", "train.epochs=2", f"train.seed={seed}"), tmp_path / f"ada-{seed}")
        runs.append(tmp_path / f"ada-{seed}")
    train(tiny("train.epochs=1"), tmp_path / "ce")
    runs.append(tmp_path / "ce")
    groups = group_runs(runs)
    assert sorted(len(v) for v in groups.values()) == [1, 2]
    stats = summarise(runs)
    ada = next(v for k, v in stats.items() if k.endswith("adafocal"))
    assert ada["ece pre"][2] == 2 and ada["ece pre"][1] >= 0
    page = html_report(runs, tmp_path / "report").read_text()
    # one figure set per group: 6 for AdaFocal (with γ and gap per bin), 4 for CE
    assert (
        page.count("data:image/png;base64,") == 12  # 2 comparison figures first
        and "AdaFocal validation gap per bin" in page
        and " ± " in page
    )


@pytest.mark.parametrize("loss", __import__("torchcal.losses", fromlist=["list_losses"]).list_losses())
def test_every_registered_loss_trains_in_the_runner(tmp_path, loss):
    rows = train(tiny(f"loss.name={loss}", "train.epochs=2", "data.limit_train=256"), tmp_path / "run")
    assert all(r["train_loss"] == r["train_loss"] for r in rows)  # finite, not NaN
    if loss in ("adafocal", "adadualfocal"):
        assert len(rows[-1]["gammas"]) == 15 and len(rows[-1]["gaps"]) == 15


def test_the_runner_gives_maxsup_its_epoch_count(tmp_path):
    """MaxSup's α ramps over the run's epochs (SPEC §8): the runner sets them from train.epochs, and the
    checkpoint keeps the epoch and the count."""
    train(tiny("loss.name=maxsup", "train.epochs=3", "data.limit_train=128"), tmp_path / "run")
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["loss"]["_extra_state"]
    assert state == {"epoch": 2, "epochs": 3}


def test_a_maxsup_run_with_a_ramp_is_not_extended_on_resume(tmp_path):
    """MaxSup's α ramps over train.epochs: a run resumed with more epochs would continue a ramp it did not
    follow (α_1 = 0.15 of a 3-epoch run, 0.1333 of a 4-epoch one), so resuming refuses the change and writes
    nothing; without a ramp (alpha_end = alpha) the run is extended."""
    from torchcal.experiments.errors import ConfigError

    base = ("loss.name=maxsup", "data.limit_train=128", "train.calibrators=[]")
    train(tiny(*base, "train.epochs=3"), tmp_path / "run", stop_after=1)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "run").iterdir())
    with pytest.raises(ConfigError, match=r"loss.name=maxsup ramps its α over train.epochs=3"):
        train(tiny(*base, "train.epochs=4"), tmp_path / "run", resume=True)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "run").iterdir()) == before
    flat = ("loss.name=maxsup", "loss.kwargs.alpha_end=0.1", "data.limit_train=128", "train.calibrators=[]")
    train(tiny(*flat, "train.epochs=2"), tmp_path / "flat", stop_after=1)
    rows = train(tiny(*flat, "train.epochs=3"), tmp_path / "flat", resume=True)
    assert [r["epoch"] for r in rows] == [0, 1, 2]


@pytest.mark.parametrize(
    "loss",
    [
        ("loss.name=maxsup",),
        ("loss.name=mbls", "loss.kwargs.schedule=add", "loss.kwargs.mu=0.1"),
        ("loss.name=fls-531",),
        ("loss.name=cals",),
        ("loss.name=avuc",),
    ],
    ids=["maxsup", "mbls-add", "fls-531", "cals", "avuc"],
)
def test_stateful_losses_resume_exactly(tmp_path, loss):
    """Every stateful or scheduled loss, stopped after epoch 0 and resumed, ends with the uninterrupted run's
    weights, loss state (MaxSup's epoch and count, MbLS's and FLS's epoch, CALS's multipliers and sums,
    AvUC's threshold and sums) and metric rows, bitwise: the same operations on the same data in the same
    order on CPU."""
    cfg = ("train.epochs=3", "data.limit_train=256", "train.calibrators=[]", *loss)
    train(tiny(*cfg), tmp_path / "full")
    train(tiny(*cfg), tmp_path / "part", stop_after=1)
    rows = train(None, tmp_path / "part", resume=True)
    full = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)
    part = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=True)
    for key in ("model", "loss"):
        for name, value in full[key].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(part[key][name], value), (key, name)
            else:
                assert part[key][name] == value, (key, name)
    assert rows == [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]


def test_best_validation_model_selection_is_exact_and_resumable(tmp_path):
    from torchcal.experiments.data.readers import load_splits
    from torchcal.experiments.models.registry import create_model
    from torchcal.experiments.training.loop import predict_logits

    # a learning rate high enough that the validation error does not fall every epoch
    cfg = tiny("train.epochs=4", "train.select=best_val_error", "optim.lr=0.05")
    rows = train(cfg, tmp_path / "full")
    errors = [r["val_error"] for r in rows]
    best = errors.index(min(errors))  # the earliest epoch with the lowest validation error
    selection = json.loads((tmp_path / "full" / "selection.json").read_text())
    assert selection == {"rule": "best_val_error", "epoch": best, "val_error": errors[best]}
    saved = torch.load(tmp_path / "full" / "best.pt", weights_only=True)
    assert saved["epoch"] == best
    model = create_model("mlp", 10, (1, 28, 28), 16)
    model.load_state_dict(saved["model"])
    splits = load_splits(cfg.data)
    logits = torch.load(tmp_path / "full" / "logits.pt", weights_only=True)
    torch.testing.assert_close(
        logits["test"]["logits"], predict_logits(model, splits["test"].inputs, 1000, "cpu")
    )
    if best != len(rows) - 1:  # (here the validation error rises in the last epoch) the last model differs
        last = create_model("mlp", 10, (1, 28, 28), 16)
        last.load_state_dict(weights(tmp_path / "full"))
        assert not torch.equal(
            logits["test"]["logits"], predict_logits(last, splits["test"].inputs, 1000, "cpu")
        )
    train(cfg, tmp_path / "part", stop_after=2)
    train(None, tmp_path / "part", resume=True)
    assert json.loads((tmp_path / "part" / "selection.json").read_text()) == selection
    part = torch.load(tmp_path / "part" / "logits.pt", weights_only=True)
    assert torch.equal(part["test"]["logits"], logits["test"]["logits"])
    last_rule = json.loads(
        (
            train(tiny("train.epochs=1"), tmp_path / "last") and tmp_path / "last" / "selection.json"
        ).read_text()
    )
    assert last_rule["rule"] == "last" and last_rule["epoch"] == 0
    with pytest.raises(ConfigError, match="train.select must be"):
        tiny("train.select=best")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradient_accumulation_is_the_same_update(tmp_path, reduction):
    """train.accumulate=k runs each batch as k micro-batches weighted by their share: the weights equal those
    of whole batches up to float rounding (64 = 22 + 21 + 21 samples, and the last batch of 36 = 12 · 3). SGD:
    Adam would turn rounding noise on near-zero gradients into full-size steps."""
    lr = "0.05" if reduction == "mean" else "0.001"
    extra = [
        "data.augment=false",
        f"loss.reduction={reduction}",
        "loss.name=fl-2",
        "optim.name=sgd",
        f"optim.lr={lr}",
    ]
    train(tiny(*extra), tmp_path / "whole")
    train(tiny(*extra, "train.accumulate=3"), tmp_path / "micro")
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "micro")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6)
    rows = [json.loads(x) for x in (tmp_path / "micro" / "metrics.jsonl").read_text().splitlines()]
    whole = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["train_loss"] == pytest.approx(whole[-1]["train_loss"], rel=1e-4)
    with pytest.raises(ConfigError, match="train.accumulate=65 splits a batch of data.loader.batch_size=64"):
        tiny("train.accumulate=65")


def test_optimizer_and_schedule_checks():
    with pytest.raises(ConfigError, match="optim.schedule must be 'multistep', 'linear' or 'plateau'"):
        tiny("optim.schedule=cosine")
    with pytest.raises(ConfigError, match="optim.warmup_epochs=1.0 applies to optim.schedule=linear only"):
        tiny("optim.warmup_epochs=1.0")
    with pytest.raises(ConfigError, match="apply to optim.schedule=multistep only"):
        tiny("optim.schedule=linear", "optim.milestones=[2]")
    for name in ("adamw", "adagrad"):
        assert tiny(f"optim.name={name}").optim.name == name
