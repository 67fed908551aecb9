"""The training loop: seeded, resumable at any moment, with a per-epoch validation pass that also feeds
AdaFocal. A run directory holds:

* ``config.yaml`` — the resolved config, the torchcal version and the git revision;
* ``metrics.jsonl`` — one JSON line per finished epoch (rewritten atomically, never half-written);
* ``checkpoint.pt`` — model, optimizer, scheduler, loss state (AdaFocal's bins and γ), RNG state, epoch,
  written atomically after every epoch and loadable with ``torch.load(weights_only=True)``;
* ``logits.pt`` — validation / test / shift / OOD logits and targets of the final model.

Batches are drawn from a permutation seeded by (seed, epoch), so an interrupted run resumed from its last
checkpoint repeats exactly what the uninterrupted run does.
"""

from __future__ import annotations

import contextlib
import copy
import json
import subprocess
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from ... import __version__
from ...adafocal import AdaFocalLoss
from ...losses import create as create_loss
from ...metrics import CalibrationMetrics, MultilabelCalibrationMetrics
from ..config import (
    ChestXray14DataConfig,
    RunConfig,
    config_to_dict,
    flatten_config,
    resume_config,
    validate_config,
)
from ..data import FIXED_VALIDATION, load_splits, random_crop_flip
from ..data.streaming import (
    DeferredCrops,
    EpochPlan,
    ImageFolderInputs,
    TrainBatches,
    crop_on_device,
    sequential_batches,
)
from ..data.text import load_tokenizer
from ..errors import CheckpointError, ConfigError, RunError
from ..models import TenCrop, create_model
from .checkpoints import drop_stale_results, load_best, load_checkpoint, saved_run, write_jsonl
from .distributed import barrier, init_distributed, resolve_device
from .dynamics import check_dynamics, epoch_dynamics

__all__ = [
    "train",
    "CheckpointError",
    "RunError",
    "read_metrics",
    "RUN_FILES",
    "atomic_write_bytes",
    "load_checkpoint",
    "predict_logits",
    "resolve_device",
]

from ..run_files import (  # noqa: F401  (the run folder's layout, re-exported for the runner's modules)
    BEST,
    CALIBRATORS,
    CHECKPOINT,
    CONFIG,
    LOGITS,
    METRICS,
    RESULTS,
    RUN_FILES,
    SELECTION,
    atomic_write_bytes,
    read_metrics,
)


def _git_revision() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def as_model_input(x: torch.Tensor | DeferredCrops, device=None) -> torch.Tensor:
    """A batch on ``device`` as the model takes it: uint8 images (the lazy image sets') scaled to [0, 1]
    float32 there (4× less host-to-device traffic than sending floats); crops deferred to the device
    (``data.augment_on=device``) taken there."""
    if isinstance(x, DeferredCrops):
        return crop_on_device(x, device if device is not None else "cpu")
    x = x.to(device, non_blocking=True) if device is not None else x
    return x.float().div_(255) if x.dtype == torch.uint8 else x


@torch.no_grad()
def predict_logits(
    model, inputs: torch.Tensor, batch_size: int, device, num_workers: int = 0
) -> torch.Tensor:
    model.eval()
    device = torch.device(device)
    batches = sequential_batches(inputs, batch_size, num_workers, pin_memory=device.type == "cuda")
    out = [model(as_model_input(x, device)).float().cpu() for x in batches]
    return torch.cat(out)


def _optimizer(cfg: RunConfig, model, steps_per_epoch: int):
    """(optimizer, scheduler, when it steps: "step" (per batch), "epoch", or "plateau" (per epoch on the
    validation NLL))."""
    o = cfg.optim
    if o.name == "sgd":
        opt = torch.optim.SGD(
            model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, foreach=True
        )
    elif o.name == "adam":
        # foreach: one multi-tensor update instead of a loop over parameters (torch's default on CUDA only);
        # the same arithmetic, ~30% less optimizer time for the demo's MLP on CPU
        opt = torch.optim.Adam(model.parameters(), lr=o.lr, weight_decay=o.weight_decay, foreach=True)
    elif o.name == "adamw":
        # BERT's recipe: no weight decay on biases and normalisation weights (the 1-D parameters; decision 75)
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.ndim > 1], "weight_decay": o.weight_decay},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=o.lr, foreach=True)
    elif o.name == "adagrad":
        opt = torch.optim.Adagrad(model.parameters(), lr=o.lr, weight_decay=o.weight_decay, foreach=True)
    else:
        raise ValueError(f"unknown optimizer {o.name!r}; available: ['adam', 'adamw', 'adagrad', 'sgd']")
    if o.schedule == "linear":  # linear warm-up, then linear decay to 0 at the last step (per step)
        total = cfg.train.epochs * steps_per_epoch
        warmup = round(o.warmup_epochs * steps_per_epoch)

        def factor(step: int) -> float:
            if step < warmup:
                return step / warmup
            return max(0.0, (total - step) / max(1, total - warmup))

        return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor), "step"
    if o.schedule == "plateau":  # CheXNet: × gamma when the validation loss stalls for `patience` epochs
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(
            opt, mode="min", factor=o.gamma, patience=o.patience
        )
        return opt, sched, "plateau"
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=list(o.milestones), gamma=o.gamma)
    return opt, sched, "epoch"


def _speed_options(cfg, device, is_image):
    """(autocast dtype or None, channels_last) from the config; "auto" means bf16 + channels_last on CUDA."""
    amp = cfg.train.amp
    choices = {"off": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if amp == "auto":
        amp_dtype = torch.bfloat16 if device.type == "cuda" else None
    elif amp in choices:
        amp_dtype = choices[amp]
    else:
        raise ValueError(f"train.amp must be one of ['auto', 'bfloat16', 'float16', 'off'], got {amp!r}")
    setting = cfg.train.channels_last
    if setting not in ("auto", True, False):
        raise ValueError(f"train.channels_last must be auto, true or false, got {setting!r}")
    channels_last = is_image and (setting is True or (setting == "auto" and device.type == "cuda"))
    return amp_dtype, channels_last


_SELECTION_KEYS = {"best_val_error": "val_error", "best_val_nll": "val_nll"}  # train.select -> its row key
_ROW_METRICS = (
    "ece",
    "adaece",
    "nll",
    "error",
)  # per epoch in metrics.jsonl (multi-label: macro over labels)


def _epoch_metrics(model, splits, cfg, device, names=("val", "test"), rank=0, world=1) -> dict:
    """Streaming metrics of each split; under data parallelism every rank scores its shard (rows rank,
    rank + world, ...) and ``sync`` all-reduces the bin sums, so every rank holds the global statistics."""
    out = {}
    for name in names:
        inputs, targets = splits[name].inputs[rank::world], splits[name].targets[rank::world]
        logits = predict_logits(
            model, inputs, cfg.data.loader.eval_batch_size, device, cfg.data.loader.num_workers
        )
        if targets.ndim == 2:  # multi-label: sigmoid outputs
            m = MultilabelCalibrationMetrics(num_labels=logits.shape[1], from_logits=True)
            m.update(logits, targets.to(logits.device))
            out[name] = m.sync() if world > 1 else m
            continue
        m = CalibrationMetrics(num_classes=logits.shape[1], from_logits=True)
        m.update(logits, targets.to(logits.device))
        out[name] = m.sync() if world > 1 else m
    return out


# the hooks a loss may have, called by the loop when it has them


@runtime_checkable
class _EpochAware(Protocol):
    def set_epoch(self, epoch: int) -> None: ...


@runtime_checkable
class _RunLengthAware(Protocol):  # a schedule that spans the run (MaxSup's α ramp)
    def set_total_epochs(self, epochs: int) -> None: ...


@runtime_checkable
class _ValidationUpdated(Protocol):  # a loss steered by validation statistics (AdaFocal's γ per bin)
    def update(self, *, metrics: Any) -> None: ...


@dataclass
class _Run:
    """What one training call works with: the checked config, where it runs, the data, the model and the
    optimisation state, and the epochs logged so far."""

    cfg: RunConfig
    run_dir: Path
    device: torch.device
    rank: int
    world: int
    splits: dict
    model: torch.nn.Module
    step_model: Callable[..., torch.Tensor]  # the model as stepped: DDP-wrapped and compiled when asked
    loss_fn: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    sched_mode: str  # "step", "epoch" or "plateau"
    amp_dtype: torch.dtype | None
    channels_last: bool
    batches: TrainBatches
    n_batches: int
    adjusted: dict
    start_epoch: int = 0
    rows: list = field(default_factory=list)
    best: dict | None = None
    ddp: torch.nn.parallel.DistributedDataParallel | None = None  # the DDP wrapper when world > 1


def train(
    cfg: RunConfig | None,
    run_dir: str | Path,
    *,
    resume: bool = False,
    progress=None,
    stop_after: int | None = None,
    on_epoch=None,
):
    """Trains (or resumes) the run in ``run_dir``; returns the list of per-epoch metric rows.

    Everything is checked before anything is written: the config (:func:`validate_config`), the run folder
    (a new run refuses a folder that holds one), the data files and that the model fits the data. Values
    the data forces (a validation split capped at a fifth of a small training set) are written as used,
    with the request in ``config.yaml``'s ``meta.adjusted``.

    With ``resume=True`` the saved config is used; ``cfg`` may be None or ask for the changes resuming
    allows (:data:`~torchcal.experiments.config.RESUMABLE_KEYS`, e.g. more ``train.epochs``); any other
    difference is refused. Training a finished run further replaces its logits and removes the results and
    calibrators of the earlier model.

    ``progress`` is an optional callable ``(epoch, batch, n_batches)``, ``on_epoch`` one called with each
    epoch's metric row once it is written (on rank 0). ``stop_after`` ends the call after that
    many epochs of this call (the run stays resumable), for tests and time-boxed jobs.
    """
    run = _set_up(cfg, Path(run_dir), resume)
    trained = 0
    for epoch in range(run.start_epoch, run.cfg.train.epochs):
        train_loss = _train_epoch(run, epoch, progress)
        metrics = _validate(run, epoch)
        _adapt(run, epoch, metrics)
        row = _log_epoch(run, epoch, train_loss, metrics)
        _checkpoint(run, epoch, row, on_epoch)
        trained += 1
        if stop_after is not None and trained >= stop_after and epoch + 1 < run.cfg.train.epochs:
            return run.rows
    if trained == 0 and (run.run_dir / LOGITS).exists():
        # a finished run resumed without more epochs: its logits are those of this model; calibrators newly
        # listed in train.calibrators are fitted on them, as torchcal evaluate does
        if run.rank == 0:
            _fit_new_calibrators(run.run_dir, run.cfg.train.calibrators)
        return run.rows
    if run.rank == 0:
        selection = _select(run)
        _save_logits(run, selection)
    barrier(run.world)
    return run.rows


def _set_up(cfg: RunConfig | None, run_dir: Path, resume: bool) -> _Run:
    """Checks the config, the run folder, the data and the model; only then writes ``config.yaml``, and
    restores the checkpoint of a resumed run."""
    state, adjusted, resumes, changes, done, finished = None, {}, [], {}, 0, False
    if resume:
        saved, adjusted, resumes, state = saved_run(run_dir)
        done = int(state["epoch"]) if state is not None else 0
        cfg = saved if cfg is None else resume_config(saved, cfg, done, adjusted)
        finished = state is not None and done >= cfg.train.epochs and (run_dir / LOGITS).exists()
        if finished:  # nothing to train: only the changes that take effect are kept
            cfg = _finished_run_config(run_dir, saved, cfg, done)
        old, new = flatten_config(saved), flatten_config(cfg)
        changes = {k: [old.get(k), new.get(k)] for k in old.keys() | new.keys() if old.get(k) != new.get(k)}
    else:
        if cfg is None:
            raise TypeError("train() needs a RunConfig unless resume=True")
        held = [f for f in RUN_FILES if (run_dir / f).exists()]
        if held:
            raise RunError(
                f"{run_dir} already holds a run ({', '.join(held)}); pass --resume to continue it or choose "
                "another folder"
            )
    cfg = validate_config(copy.deepcopy(cfg))  # the caller's object is never changed
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    device = resolve_device(cfg.train.device)
    rank, world = init_distributed(device)
    tokenizer = load_tokenizer(cfg.model.checkpoint) if cfg.model.name == "transformer" else None
    splits = load_splits(cfg.data, tokenizer)
    adjusted.update(_adjust_to_data(cfg, splits))
    train_set = splits["train"]
    if isinstance(train_set.inputs, ImageFolderInputs):  # lazy images: augmented following the run's seed
        train_set.inputs.seed = cfg.train.seed
        train_set.inputs.defer_crop = getattr(cfg.data, "augment_on", "workers") == "device"
    if train_set.multilabel:  # (N, L) 0/1 targets: L sigmoid outputs
        num_classes = int(train_set.targets.shape[1])
    else:
        num_classes = int(max(int(s.targets.max()) for k, s in splits.items() if not k.startswith("ood"))) + 1
    torch.manual_seed(cfg.train.seed)
    model = _build_model(cfg, train_set, num_classes).to(device)
    loss_fn = create_loss(cfg.loss.name, reduction=cfg.loss.reduction, **cfg.loss.kwargs).to(device)
    check_dynamics(cfg.train.dynamics, model)
    # everything the run needs exists and fits: only now is anything written
    if resume and state is not None:
        record = changes or (done and not finished)  # resuming a finished run that changes nothing: no record
        resumes = [*resumes, {"from_epoch": done, "changed": changes}] if record else resumes
    meta = {"torchcal_version": __version__, "git_revision": _git_revision(), "world_size": world,
            "device": str(device), "num_classes": num_classes, "adjusted": adjusted, "resumes": resumes}  # fmt: skip
    if train_set.multilabel:
        meta["label_names"] = list(train_set.label_names or range(num_classes))
    if rank == 0 and not (finished and not changes):  # a finished run left as it was keeps its config.yaml
        _write_config(run_dir, cfg, meta)
    amp_dtype, channels_last = _speed_options(cfg, device, train_set.inputs.ndim == 4)
    if channels_last:
        # Module.to takes memory_format (its documented fourth form), which torch's overloads leave out
        model = model.to(memory_format=torch.channels_last)  # pyright: ignore[reportCallIssue]
    ddp = None
    if world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    step_model = ddp if ddp is not None else model
    step_model = torch.compile(step_model) if cfg.train.compile else step_model
    n, bs = len(train_set), cfg.data.loader.batch_size
    n_batches = (n + bs - 1) // bs
    opt, sched, sched_mode = _optimizer(cfg, model, n_batches)
    # the global batch b of the (seed, epoch) permutation, sharded across ranks; lazy inputs are decoded in
    # DataLoader workers, which compute the same indices from (epoch, b)
    lazy = isinstance(train_set.inputs, ImageFolderInputs)  # image folders decoded per batch
    batches = TrainBatches(train_set.inputs, train_set.targets, EpochPlan(n, bs, cfg.train.seed, rank, world),
                           n_batches, cfg.data.loader.num_workers if lazy else 0,
                           pin_memory=device.type == "cuda")  # fmt: skip
    if isinstance(loss_fn, _RunLengthAware):  # a loss whose schedule spans the run (MaxSup's α ramp)
        loss_fn.set_total_epochs(cfg.train.epochs)
    run = _Run(cfg, run_dir, device, rank, world, splits, model, step_model, loss_fn, opt, sched, sched_mode,
               amp_dtype, channels_last, batches, n_batches, adjusted, ddp=ddp)  # fmt: skip
    if state is not None:
        _restore(run, state)
    return run


def _write_config(run_dir: Path, cfg: RunConfig, meta: dict) -> None:
    import yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump({**config_to_dict(cfg), "meta": meta})
    atomic_write_bytes(run_dir / CONFIG, lambda fh: fh.write(text.encode()))


def _restore(run: _Run, state: dict) -> None:
    """A resumed run's model, optimizer, scheduler, loss state and RNG from its checkpoint; the metrics log
    is cut back to the checkpointed epochs."""
    run.best = state.get("best")
    run.model.load_state_dict(state["model"])
    run.opt.load_state_dict(state["optimizer"])
    run.sched.load_state_dict(state["scheduler"])
    run.loss_fn.load_state_dict(state["loss"])
    torch.set_rng_state(state["rng"])
    run.start_epoch = int(state["epoch"])
    run.rows = [r for r in read_metrics(run.run_dir) if r["epoch"] < run.start_epoch]
    if run.rank == 0:
        write_jsonl(run.run_dir / METRICS, run.rows)  # drop an epoch logged after the last checkpoint
    barrier(run.world)


def _train_epoch(run: _Run, epoch: int, progress=None) -> float:
    """One pass over the training set; the mean training loss of its batches (over ranks)."""
    cfg, device, loss_fn, world = run.cfg, run.device, run.loss_fn, run.world
    if isinstance(loss_fn, _EpochAware):
        loss_fn.set_epoch(epoch)
    run.model.train()
    inputs = run.splits["train"].inputs
    augmented_in_decode = bool(getattr(inputs, "train", False))  # ImageNet's RandomResizedCrop
    # the in-loop crops and flips are drawn from (seed, epoch, rank): rank 0 draws what one process draws,
    # rank r from the seed plus r * 2^20 (the generator keeps a seed's low 32 bits: ranks < 4096 and epochs
    # < 2^20 never share a stream)
    epoch_gen = torch.Generator().manual_seed(cfg.train.seed * 100_003 + epoch + (run.rank << 20))
    torch.randperm(
        len(inputs), generator=epoch_gen
    )  # the plan's order; advances epoch_gen as augmentation expects
    total = 0.0
    n, bs = len(inputs), cfg.data.loader.batch_size
    for b, (xb, yb) in enumerate(run.batches.epoch(epoch)):
        run.opt.zero_grad(set_to_none=True)
        # gradient accumulation: this rank's share of the batch as train.accumulate micro-batches. Every rank
        # takes as many micro-batches as the fullest one (rank 0), so every rank joins each of DDP's
        # all-reduces; a micro-batch left empty contributes a zero loss whose graph reaches every parameter.
        count = min(bs, n - b * bs)  # samples in the global batch, over all ranks
        parts = torch.arange(len(yb)).tensor_split(min(cfg.train.accumulate, -(-count // world)))
        for j, part in enumerate(parts):
            x, y = as_model_input(xb[part], device), yb[part].to(device)
            if cfg.data.augment and not augmented_in_decode:
                x = random_crop_flip(x, epoch_gen)
            if run.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            last = j == len(parts) - 1
            with run.ddp.no_sync() if run.ddp is not None and not last else contextlib.nullcontext():
                with torch.autocast(
                    device.type, dtype=run.amp_dtype or torch.float32, enabled=run.amp_dtype is not None
                ):
                    loss = loss_fn(run.step_model(x), y) if len(part) else run.step_model(x).sum()
                # "mean": each micro-batch's loss weighted by its share of the global batch, times the world
                # size that DDP's average over ranks divides out, so that the update is the global batch's
                # mean however unevenly the ranks share it (the reported loss is that mean too)
                if cfg.loss.reduction == "mean" and len(part) * world != count:
                    loss = loss * (len(part) * world / count)
                # DDP averages gradients over ranks: a summed loss is scaled back to the global batch's sum
                (loss * world if world > 1 and cfg.loss.reduction == "sum" else loss).backward()
            total += loss.detach()
        if cfg.optim.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.optim.grad_clip_norm)
        run.opt.step()
        if run.sched_mode == "step":
            run.sched.step()
        every = cfg.loss.update_every_at(epoch)
        if every and isinstance(loss_fn, _ValidationUpdated) and (b + 1) % every == 0:
            loss_fn.update(
                metrics=_epoch_metrics(run.model, run.splits, cfg, device, ("val",), run.rank, world)["val"]
            )
            run.model.train()
        if progress is not None:
            progress(epoch, b + 1, run.n_batches)
    if run.sched_mode == "epoch":
        run.sched.step()
    if world > 1:
        import torch.distributed as dist

        total = torch.as_tensor(total, dtype=torch.float64, device=device)
        dist.all_reduce(total)
        total = total / world
    return float(total) / run.n_batches


def _validate(run: _Run, epoch: int) -> dict:
    """The epoch's streaming metrics: validation always, test every ``train.test_every`` epochs and at the
    last."""
    every = run.cfg.train.test_every
    with_test = every > 0 and ((epoch + 1) % every == 0 or epoch + 1 == run.cfg.train.epochs)
    names = ("val", "test") if with_test else ("val",)
    return _epoch_metrics(run.model, run.splits, run.cfg, run.device, names, rank=run.rank, world=run.world)


def _adapt(run: _Run, epoch: int, metrics: dict) -> None:
    """What the validation pass steers: the plateau schedule's learning rate, and a loss updated from the
    validation set (AdaFocal's γ per bin) when it is updated per epoch."""
    if run.sched_mode == "plateau":
        val = metrics["val"]
        values = val.compute() if isinstance(val, MultilabelCalibrationMetrics) else val.compute("nll")
        run.sched.step(float(values["nll"]))
    if isinstance(run.loss_fn, _ValidationUpdated) and not run.cfg.loss.update_every_at(epoch):
        run.loss_fn.update(metrics=metrics["val"])  # the validation pass we already made


def _log_epoch(run: _Run, epoch: int, train_loss: float, metrics: dict) -> dict:
    """The epoch's row of ``metrics.jsonl`` (appended to ``run.rows``): training loss, learning rate, each
    split's metrics, AdaFocal's γ and gaps, and the ``train.dynamics`` asked for."""
    row = {"epoch": epoch, "train_loss": train_loss, "lr": run.opt.param_groups[0]["lr"]}
    for split, m in metrics.items():
        values = m.compute() if isinstance(m, MultilabelCalibrationMetrics) else m.compute(_ROW_METRICS)
        row.update({f"{split}_{k}": float(values[k]) for k in _ROW_METRICS})
    if run.cfg.train.dynamics and run.rank == 0:  # opt-in; the rank that writes the log
        cfg = run.cfg
        row["dynamics"] = epoch_dynamics(
            cfg.train.dynamics, model=run.model, splits=run.splits, loss_fn=run.loss_fn,
            n_bins=cfg.train.dynamics_bins, batch_size=cfg.data.loader.batch_size,
            predict=lambda inputs: predict_logits(run.model, inputs, cfg.data.loader.eval_batch_size, run.device,
                                                  cfg.data.loader.num_workers),
        )  # fmt: skip
    if isinstance(run.loss_fn, AdaFocalLoss):
        row["gammas"] = [float(g) for g in run.loss_fn.gammas]
        if len(run.loss_fn.gap_history):
            row["gaps"] = [float(g) for g in run.loss_fn.gap_history[-1]]
    run.rows.append(row)
    return row


def _checkpoint(run: _Run, epoch: int, row: dict, on_epoch=None) -> None:
    """The best validation model (when this epoch is it), the metrics log and the checkpoint, in the order
    that leaves a resumable folder whenever the process is killed."""
    key = _SELECTION_KEYS.get(run.cfg.train.select)  # val_error or val_nll (None: the last epoch)
    improved = key is not None and (run.best is None or row[key] < run.best[key])
    # the earliest epoch with the lowest validation error (or NLL) wins ties
    best = {"epoch": epoch, key: row[key]} if improved else None
    if best is not None:
        run.best = best
    checkpoint = {
        "format": "torchcal-checkpoint-1", "epoch": epoch + 1, "model": run.model.state_dict(),
        "optimizer": run.opt.state_dict(), "scheduler": run.sched.state_dict(), "loss": run.loss_fn.state_dict(),
        "rng": torch.get_rng_state(), "config": config_to_dict(run.cfg), "adjusted": run.adjusted,
        "best": run.best,
    }  # fmt: skip
    if run.rank == 0:  # one writer; the others wait so that a resume finds a complete checkpoint
        if best is not None:  # written before the checkpoint that records it: a resume never points past it
            weights = {"format": "torchcal-best-1", **best, "model": run.model.state_dict()}
            atomic_write_bytes(run.run_dir / BEST, lambda fh: torch.save(weights, fh))
        # the epoch's row before the checkpoint that counts it: a kill between the two leaves a row that
        # resume drops, never a checkpoint without its row
        write_jsonl(run.run_dir / METRICS, run.rows)
        atomic_write_bytes(run.run_dir / CHECKPOINT, lambda fh: torch.save(checkpoint, fh))
        if on_epoch is not None:
            on_epoch(row)
    barrier(run.world)


def _select(run: _Run) -> dict:
    """Loads the model ``train.select`` names (the last epoch's, or the best validation model) and returns
    the selection record of ``selection.json``."""
    cfg = run.cfg
    selection = {
        "rule": cfg.train.select,
        "epoch": cfg.train.epochs - 1,
        "val_error": run.rows[-1]["val_error"],
    }
    key = _SELECTION_KEYS.get(cfg.train.select)
    if key is not None:
        saved = load_best(run.run_dir / BEST)
        run.model.load_state_dict(saved["model"])
        selection.update({"epoch": saved["epoch"], key: saved[key]})
    return selection


def _save_logits(run: _Run, selection: dict) -> None:
    """The selected model's logits of every evaluated split, the selection record, and the run's
    ``train.calibrators`` fitted on them (results of an earlier model, trained further, are removed)."""
    cfg, run_dir = run.cfg, run.run_dir
    logits, predicted = {}, {}
    for name, split in run.splits.items():
        if name != "train":
            if id(split) not in predicted:  # "ood" is also "ood_<first set>": predicted once, stored once
                predicted[id(split)] = {
                    "logits": predict_logits(run.model, split.inputs, cfg.data.loader.eval_batch_size, run.device,
                                             cfg.data.loader.num_workers),
                    "targets": split.targets,
                }  # fmt: skip
            logits[name] = predicted[id(split)]
    had_logits = (run_dir / LOGITS).exists()
    atomic_write_bytes(run_dir / LOGITS, lambda fh: torch.save(logits, fh))
    text = json.dumps(selection, indent=2)
    atomic_write_bytes(run_dir / SELECTION, lambda fh: fh.write(text.encode()))
    refit = tuple(cfg.train.calibrators)
    if had_logits:  # trained further: results and calibrators of the earlier model no longer apply
        drop_stale_results(run_dir, refit)
    if refit:
        _fit_calibrators(run_dir, refit)


def _finished_run_config(run_dir: Path, saved: RunConfig, requested: RunConfig, done: int) -> RunConfig:
    """The config of a finished run resumed with nothing to train. Of the changes resuming allows
    (:data:`~torchcal.experiments.config.RESUMABLE_KEYS`) only ``train.calibrators`` takes effect here: its
    calibrators not yet fitted are fitted (:func:`_fit_new_calibrators`) and the saved list gains them. The
    other execution settings apply to epochs still to train, so they keep their saved values (a warning names
    them): ``config.yaml`` says what ran."""
    from ..evaluation.evaluate import read_results

    old, new = flatten_config(saved), flatten_config(requested)
    idle = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k) and k != "train.calibrators")
    if idle:
        warnings.warn(
            f"{run_dir} has trained all its {done} epochs: {', '.join(idle)} would apply only to epochs still to "
            "train and keep their saved values (train.epochs=N trains further)",
            UserWarning,
            stacklevel=4,
        )
    fitted = read_results(run_dir)
    added = [c for c in requested.train.calibrators if c not in saved.train.calibrators and c not in fitted]
    cfg = copy.deepcopy(saved)
    cfg.train.calibrators = [*saved.train.calibrators, *added]
    return cfg


def _fit_new_calibrators(run_dir: Path, specs) -> None:
    """The calibrators of ``specs`` that the run's ``results.json`` does not hold yet, fitted and saved."""
    from ..evaluation.evaluate import read_results

    fitted = read_results(run_dir)
    missing = tuple(c for c in specs if c not in fitted)
    if missing:
        _fit_calibrators(run_dir, missing)


def _fit_calibrators(run_dir: Path, specs: tuple[str, ...]) -> None:
    """``train.calibrators`` fitted on the final validation logits and saved, as ``torchcal evaluate`` does
    (``results.json``, ``calibrators/<name>.pt`` / ``.json``). A calibrator the data cannot fit is named in
    a warning; the trained run stays."""
    from ..errors import UserError
    from ..evaluation.evaluate import evaluate_run

    try:
        evaluate_run(run_dir, specs)
    except UserError as err:
        warnings.warn(
            f"{run_dir}: train.calibrators were not fitted: {err}; the run is complete, fit others with "
            f"torchcal evaluate {run_dir} --calibrators ...",
            UserWarning,
            stacklevel=3,
        )


def _adjust_to_data(cfg: RunConfig, splits) -> dict:
    """Values the data made different from the request, written into ``cfg`` (so the saved config is what
    ran) and returned as ``{key: {"requested", "used", "why"}}`` for the run's ``meta.adjusted``."""
    adjusted = {}
    n_val = len(splits["val"])
    if n_val != cfg.data.val_size:
        why = FIXED_VALIDATION.get(cfg.data.name, "capped at a fifth of the training set")
        adjusted["data.val_size"] = {"requested": cfg.data.val_size, "used": n_val, "why": why}
        cfg.data.val_size = n_val
    if cfg.data.limit_train and len(splits["train"]) < cfg.data.limit_train:
        adjusted["data.limit_train"] = {"requested": cfg.data.limit_train, "used": 0,
                                        "why": f"the training split has only {len(splits['train'])} samples"}  # fmt: skip
        cfg.data.limit_train = 0
    for key, item in adjusted.items():
        warnings.warn(
            f"{key}={item['requested']} adjusted to {item['used']}: {item['why']}", UserWarning, stacklevel=3
        )
    return adjusted


def _channel_stats(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and standard deviation of (N, C, H, W) images in [0, 1] (uint8 read as /255),
    accumulated in float64 over 1,024 images at a time; a constant channel gets std 1."""
    scale = 1 / 255 if images.dtype == torch.uint8 else 1.0
    c = images.shape[1]
    total = torch.zeros(c, dtype=torch.float64)
    squares = torch.zeros(c, dtype=torch.float64)
    for start in range(0, len(images), 1024):
        x = images[start : start + 1024].to(torch.float64) * scale
        total += x.sum((0, 2, 3))
        squares += x.square().sum((0, 2, 3))
    n = images.numel() // c
    mean = total / n
    std = (squares / n - mean.square()).clamp(min=0).sqrt()
    std = torch.where(std > 1e-6, std, torch.ones_like(std))
    return tuple(mean.tolist()), tuple(std.tolist())


def _build_model(cfg: RunConfig, train_set, num_classes: int):
    """The configured model, checked on two training samples: a model that does not fit the data is a
    :class:`ConfigError` before anything is written."""
    extra = {}
    if cfg.model.name == "text_cnn":
        extra = {"embeddings": train_set.embeddings, "vocab_size": train_set.vocab_size}
    elif cfg.model.name == "transformer":
        extra = {"checkpoint": cfg.model.checkpoint}
    elif (
        train_set.inputs.ndim == 4
        and train_set.inputs.shape[1] != 3
        and isinstance(train_set.inputs, torch.Tensor)
    ):
        extra = {"stats": _channel_stats(train_set.inputs)}  # images of other than 3 channels: their own
    shape = tuple(train_set.inputs.shape[1:])
    try:
        model = create_model(cfg.model.name, num_classes, shape, cfg.model.width, **extra)
    except ValueError as err:
        raise ConfigError(
            f"model.name={cfg.model.name!r} cannot be built for data.name={cfg.data.name!r}: {err}"
        ) from None
    try:
        with torch.no_grad():
            out = model.eval()(as_model_input(train_set.inputs[:2]))
    except (RuntimeError, ValueError, IndexError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"model.name={cfg.model.name!r} does not fit the inputs of data.name={cfg.data.name!r} "
            f"(one sample has shape {shape}): {first}"
        ) from None
    if tuple(out.shape) != (min(2, len(train_set)), num_classes):
        raise ConfigError(f"model.name={cfg.model.name!r} gives outputs of shape {tuple(out.shape)} for "
                          f"{num_classes} classes")  # fmt: skip
    if isinstance(cfg.data, ChestXray14DataConfig) and cfg.data.ten_crop:
        model = TenCrop(model, cfg.data.image_size, train_set.multilabel)
    return model.train()
