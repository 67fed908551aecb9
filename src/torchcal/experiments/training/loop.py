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
import os
import subprocess
import warnings
from pathlib import Path

import torch

from ... import __version__
from ...adafocal import AdaFocalLoss
from ...losses import create as create_loss
from ...metrics import CalibrationMetrics, MultilabelCalibrationMetrics
from ..config import (
    RunConfig,
    config_from_dict,
    config_to_dict,
    flatten_config,
    resume_config,
    validate_config,
)
from ..data import FIXED_VALIDATION, load_splits, random_crop_flip
from ..data.streaming import DeferredCrops, EpochPlan, TrainBatches, crop_on_device, sequential_batches
from ..data.text import load_tokenizer
from ..errors import CheckpointError, ConfigError, RunError
from ..models import TenCrop, create_model

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


def resolve_device(name: str) -> torch.device:
    """ "auto": CUDA when available (the local rank's GPU under torchrun), else CPU. A device this torch
    build or machine does not have (``cuda`` on a CPU-only build, ``mps`` off Apple silicon, ``cuda:3`` on a
    machine with one GPU) is a :class:`ConfigError` in one sentence."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(
            f"train.device={name!r} is not a device (auto, cpu, cuda, cuda:1, mps, ...)"
        ) from None
    if device.type == "cpu":
        return device
    if device.type == "mps":
        backend = getattr(torch.backends, "mps", None)
    else:
        backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        why = {"cuda": f"this torch build ({torch.__version__}) has no CUDA or sees no NVIDIA GPU",
               "mps": "MPS needs an Apple-silicon Mac with a torch build that has it"}.get(
                   device.type, f"this torch build ({torch.__version__}) has no {device.type} device")  # fmt: skip
        raise ConfigError(f"train.device={name} is not available here: {why}; use train.device=cpu (or auto)")
    count = getattr(backend, "device_count", None)
    if device.index is not None and count is not None and device.index >= count():
        raise ConfigError(
            f"train.device={name} is not available here: this machine has {count()} {device.type} device(s) "
            f"({', '.join(f'{device.type}:{i}' for i in range(count()))})"
        )
    return device


def load_checkpoint(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the same thing to the user
        raise CheckpointError(f"checkpoint {path} is corrupt or not a torchcal checkpoint ({err})") from None
    required = {"format", "epoch", "model", "optimizer", "scheduler", "loss", "rng", "config"}
    if not isinstance(state, dict) or state.get("format") != "torchcal-checkpoint-1" or required - set(state):
        raise CheckpointError(f"checkpoint {path} is not a torchcal checkpoint (missing {sorted(required)})")
    return state


def as_model_input(x: torch.Tensor, device=None) -> torch.Tensor:
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


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    atomic_write_bytes(path, lambda fh: fh.write(text.encode()))


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
        logits = predict_logits(model, inputs, cfg.data.loader.eval_batch_size, device, cfg.data.loader.num_workers)
        if targets.ndim == 2:  # multi-label: sigmoid outputs
            m = MultilabelCalibrationMetrics(num_labels=logits.shape[1], from_logits=True)
            m.update(logits, targets.to(logits.device))
            out[name] = m.sync() if world > 1 else m
            continue
        m = CalibrationMetrics(num_classes=logits.shape[1], from_logits=True)
        m.update(logits, targets.to(logits.device))
        out[name] = m.sync() if world > 1 else m
    return out


def _distributed(device):
    """(rank, world size) from torchrun's environment; initialises the process group (gloo on CPU, NCCL on
    CUDA) when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def _barrier(world):
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


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
    import yaml

    run_dir = Path(run_dir)
    ckpt_path = run_dir / CHECKPOINT
    state, adjusted, resumes, changes, done = None, {}, [], {}, 0
    if resume:
        saved, adjusted, resumes, state = _saved_run(run_dir)
        done = int(state["epoch"]) if state is not None else 0
        cfg = saved if cfg is None else resume_config(saved, cfg, done, adjusted)
        old, new = flatten_config(saved), flatten_config(cfg)
        changes = {k: [old[k], new[k]] for k in old if old[k] != new[k]}
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
    rank, world = _distributed(device)
    tokenizer = load_tokenizer(cfg.model.checkpoint) if cfg.model.name == "transformer" else None
    splits = load_splits(cfg.data, tokenizer)
    adjusted.update(_adjust_to_data(cfg, splits))
    train_set = splits["train"]
    if hasattr(train_set.inputs, "seed"):  # lazy images: their augmentation follows the run's seed
        train_set.inputs.seed = cfg.train.seed
        train_set.inputs.defer_crop = getattr(cfg.data, "augment_on", "workers") == "device"
    if train_set.multilabel:  # (N, L) 0/1 targets: L sigmoid outputs
        num_classes = int(train_set.targets.shape[1])
    else:
        num_classes = int(max(int(s.targets.max()) for k, s in splits.items() if not k.startswith("ood"))) + 1
    torch.manual_seed(cfg.train.seed)
    model = _build_model(cfg, train_set, num_classes).to(device)
    loss_fn = create_loss(cfg.loss.name, reduction=cfg.loss.reduction, **cfg.loss.kwargs).to(device)
    # everything the run needs exists and fits: only now is anything written
    if resume and state is not None:
        resumes = [*resumes, {"from_epoch": done, "changed": changes}] if changes or done else resumes
    meta = {"torchcal_version": __version__, "git_revision": _git_revision(), "world_size": world,
            "device": str(device), "num_classes": num_classes, "adjusted": adjusted, "resumes": resumes}  # fmt: skip
    if train_set.multilabel:
        meta["label_names"] = list(train_set.label_names or range(num_classes))
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(
            run_dir / CONFIG,
            lambda fh: fh.write(yaml.safe_dump({**config_to_dict(cfg), "meta": meta}).encode()),
        )
    amp_dtype, channels_last = _speed_options(cfg, device, train_set.inputs.ndim == 4)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    step_model = model
    if world > 1:
        step_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    step_model = torch.compile(step_model) if cfg.train.compile else step_model
    n = len(train_set)
    bs = cfg.data.loader.batch_size
    n_batches = (n + bs - 1) // bs
    opt, sched, sched_mode = _optimizer(cfg, model, n_batches)
    start_epoch, rows, best = 0, [], None
    if state is not None:
        best = state.get("best")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        loss_fn.load_state_dict(state["loss"])
        torch.set_rng_state(state["rng"])
        start_epoch = int(state["epoch"])
        rows = [r for r in read_metrics(run_dir) if r["epoch"] < start_epoch]
        if rank == 0:
            _write_jsonl(run_dir / METRICS, rows)  # drop an epoch logged after the last checkpoint
        _barrier(world)

    done_here = 0
    lazy = hasattr(train_set.inputs, "decode")  # image folders decoded per batch
    augmented_in_decode = bool(getattr(train_set.inputs, "train", False))  # ImageNet's RandomResizedCrop
    # the global batch b of the (seed, epoch) permutation, sharded across ranks; lazy inputs are decoded in
    # DataLoader workers, which compute the same indices from (epoch, b)
    plan = EpochPlan(n, bs, cfg.train.seed, rank, world)
    batches = TrainBatches(train_set.inputs, train_set.targets, plan, n_batches,
                           cfg.data.loader.num_workers if lazy else 0, pin_memory=device.type == "cuda")  # fmt: skip
    if hasattr(loss_fn, "set_total_epochs"):  # a loss whose schedule spans the run (MaxSup's α ramp)
        loss_fn.set_total_epochs(cfg.train.epochs)
    for epoch in range(start_epoch, cfg.train.epochs):
        if hasattr(loss_fn, "set_epoch"):
            loss_fn.set_epoch(epoch)
        model.train()
        epoch_gen = torch.Generator().manual_seed(cfg.train.seed * 100_003 + epoch)
        torch.randperm(
            n, generator=epoch_gen
        )  # the plan's order; advances epoch_gen as the augmentation expects
        total = 0.0
        for b, (xb, yb) in enumerate(batches.epoch(epoch)):
            opt.zero_grad(set_to_none=True)
            # gradient accumulation: the batch as train.accumulate micro-batches, each loss weighted by its
            # share of the batch ("mean") so that the update is the whole batch's
            members = torch.arange(len(yb))
            parts = [p for p in members.tensor_split(cfg.train.accumulate) if len(p)]
            for j, part in enumerate(parts):
                x, y = as_model_input(xb[part], device), yb[part].to(device)
                if cfg.data.augment and not augmented_in_decode:
                    x = random_crop_flip(x, epoch_gen)
                if channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                last = j == len(parts) - 1
                with step_model.no_sync() if world > 1 and not last else contextlib.nullcontext():
                    with torch.autocast(
                        device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None
                    ):
                        loss = loss_fn(step_model(x), y)
                    if len(parts) > 1 and cfg.loss.reduction == "mean":
                        loss = loss * (len(part) / len(members))
                    # DDP averages gradients over ranks: a summed loss is scaled back to the global batch's sum
                    (loss * world if world > 1 and cfg.loss.reduction == "sum" else loss).backward()
                total += loss.detach()
            if cfg.optim.grad_clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip_norm)
            opt.step()
            if sched_mode == "step":
                sched.step()
            if cfg.loss.update_every and hasattr(loss_fn, "update") and (b + 1) % cfg.loss.update_every == 0:
                loss_fn.update(
                    metrics=_epoch_metrics(model, splits, cfg, device, ("val",), rank, world)["val"]
                )
                model.train()
            if progress is not None:
                progress(epoch, b + 1, n_batches)
        if sched_mode == "epoch":
            sched.step()
        every = cfg.train.test_every
        with_test = every > 0 and ((epoch + 1) % every == 0 or epoch + 1 == cfg.train.epochs)
        names = ("val", "test") if with_test else ("val",)
        metrics = _epoch_metrics(model, splits, cfg, device, names, rank=rank, world=world)
        if world > 1:
            import torch.distributed as dist

            total = torch.as_tensor(total, dtype=torch.float64, device=device)
            dist.all_reduce(total)
            total = total / world
        if sched_mode == "plateau":
            val = metrics["val"]
            values = val.compute() if isinstance(val, MultilabelCalibrationMetrics) else val.compute("nll")
            sched.step(float(values["nll"]))
        if hasattr(loss_fn, "update") and not cfg.loss.update_every:
            loss_fn.update(metrics=metrics["val"])  # AdaFocal: the validation pass we already made
        row = {"epoch": epoch, "train_loss": float(total) / n_batches, "lr": opt.param_groups[0]["lr"]}
        for split, m in metrics.items():
            values = m.compute() if isinstance(m, MultilabelCalibrationMetrics) else m.compute(_ROW_METRICS)
            row.update({f"{split}_{k}": float(values[k]) for k in _ROW_METRICS})
        if isinstance(loss_fn, AdaFocalLoss):
            row["gammas"] = [float(g) for g in loss_fn.gammas]
            if len(loss_fn.gap_history):
                row["gaps"] = [float(g) for g in loss_fn.gap_history[-1]]
        rows.append(row)
        key = _SELECTION_KEYS.get(cfg.train.select)  # val_error or val_nll (None: the last epoch)
        improved = key is not None and (best is None or row[key] < best[key])
        if improved:  # the earliest epoch with the lowest validation error (or NLL) wins ties
            best = {"epoch": epoch, key: row[key]}
        checkpoint = {
            "format": "torchcal-checkpoint-1", "epoch": epoch + 1, "model": model.state_dict(),
            "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "loss": loss_fn.state_dict(),
            "rng": torch.get_rng_state(), "config": config_to_dict(cfg), "adjusted": adjusted, "best": best,
        }  # fmt: skip
        if rank == 0:  # one writer; the others wait so that a resume finds a complete checkpoint
            if improved:  # written before the checkpoint that records it: a resume never points past it
                weights = {"format": "torchcal-best-1", **best, "model": model.state_dict()}
                atomic_write_bytes(run_dir / BEST, lambda fh, w=weights: torch.save(w, fh))
            # the epoch's row before the checkpoint that counts it: a kill between the two leaves a row that
            # resume drops, never a checkpoint without its row
            _write_jsonl(run_dir / METRICS, rows)
            atomic_write_bytes(ckpt_path, lambda fh, c=checkpoint: torch.save(c, fh))
            if on_epoch is not None:
                on_epoch(row)
        _barrier(world)
        done_here += 1
        if stop_after is not None and done_here >= stop_after and epoch + 1 < cfg.train.epochs:
            return rows

    if done_here == 0 and (run_dir / LOGITS).exists():
        return rows  # a finished run resumed without more epochs: its logits are those of this model
    if rank == 0:
        selection = {
            "rule": cfg.train.select,
            "epoch": cfg.train.epochs - 1,
            "val_error": rows[-1]["val_error"],
        }
        key = _SELECTION_KEYS.get(cfg.train.select)
        if key is not None:
            saved = _load_best(run_dir / BEST)
            model.load_state_dict(saved["model"])
            selection.update({"epoch": saved["epoch"], key: saved[key]})
        logits, done = {}, {}
        for name, split in splits.items():
            if name != "train":
                if id(split) not in done:  # "ood" is also "ood_<first set>": predicted once, stored once
                    done[id(split)] = {
                        "logits": predict_logits(
                            model, split.inputs, cfg.data.loader.eval_batch_size, device, cfg.data.loader.num_workers
                        ),
                        "targets": split.targets,
                    }
                logits[name] = done[id(split)]
        had_logits = (run_dir / LOGITS).exists()
        atomic_write_bytes(run_dir / LOGITS, lambda fh: torch.save(logits, fh))
        text = json.dumps(selection, indent=2)
        atomic_write_bytes(run_dir / SELECTION, lambda fh: fh.write(text.encode()))
        refit = tuple(cfg.train.calibrators)
        if had_logits:  # trained further: results and calibrators of the earlier model no longer apply
            _drop_stale_results(run_dir, refit)
        if refit:
            _fit_calibrators(run_dir, refit)
    _barrier(world)
    return rows


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


def _load_best(path: Path) -> dict:
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the same thing to the user
        raise CheckpointError(f"{path} (the best validation model) is missing or damaged ({err})") from None
    if not isinstance(saved, dict) or saved.get("format") != "torchcal-best-1":
        raise CheckpointError(f"{path} is not a torchcal best-model file")
    return saved


def _drop_stale_results(run_dir: Path, refit: tuple[str, ...] = ()) -> None:
    import shutil

    stale = [p for p in (run_dir / RESULTS, run_dir / CALIBRATORS) if p.exists()]
    for path in stale:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    if stale:
        then = (
            f"train.calibrators ({', '.join(refit)}) are fitted again; others need torchcal evaluate"
            if refit
            else "run torchcal evaluate again"
        )
        warnings.warn(
            f"{run_dir}: trained further, so {', '.join(p.name for p in stale)} of the earlier model were "
            f"removed; {then}",
            UserWarning,
            stacklevel=3,
        )


def _saved_run(run_dir: Path):
    """(saved config, adjusted values, resume history, checkpoint state or None) of a run to resume. A run
    interrupted before its first checkpoint resumes from its saved config at epoch 0."""
    import yaml

    ckpt_path, cfg_path = run_dir / CHECKPOINT, run_dir / CONFIG
    if not run_dir.is_dir():
        raise RunError(f"cannot resume: {run_dir} does not exist")
    meta = {}
    if cfg_path.exists():
        try:
            meta = (yaml.safe_load(cfg_path.read_text()) or {}).get("meta") or {}
        except (yaml.YAMLError, AttributeError, OSError):
            meta = {}
    if ckpt_path.exists():
        state = load_checkpoint(ckpt_path)
        saved = config_from_dict(state["config"], validate=False)
        return (
            saved,
            dict(state.get("adjusted") or meta.get("adjusted") or {}),
            list(meta.get("resumes", [])),
            state,
        )
    if not cfg_path.exists():
        raise RunError(f"cannot resume: {run_dir} holds no run (no {CONFIG}, no {CHECKPOINT})")
    try:
        raw = yaml.safe_load(cfg_path.read_text()) or {}
        raw.pop("meta", None)
        saved = config_from_dict(raw, validate=False)
    except (yaml.YAMLError, ConfigError, AttributeError) as err:
        raise RunError(f"cannot resume: {cfg_path} is damaged ({err})") from None
    return saved, dict(meta.get("adjusted") or {}), list(meta.get("resumes", [])), None


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
    if getattr(cfg.data, "ten_crop", False):
        model = TenCrop(model, cfg.data.image_size, train_set.multilabel)
    return model.train()
