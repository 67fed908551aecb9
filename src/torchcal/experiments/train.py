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

import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from .. import __version__
from ..adafocal import AdaFocalLoss
from ..losses import create as create_loss
from ..metrics import CalibrationMetrics
from .config import RunConfig, config_from_dict, config_to_dict
from .data import load_splits, random_crop_flip
from .models import create_model

__all__ = [
    "train",
    "CheckpointError",
    "atomic_write_bytes",
    "load_checkpoint",
    "predict_logits",
    "resolve_device",
]

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
CONFIG = "config.yaml"
LOGITS = "logits.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that is corrupt or does not belong to this run."""


def atomic_write_bytes(path: Path, write) -> None:
    """Calls ``write(file_object)`` on a temporary file next to ``path``, fsyncs it, then renames it over
    ``path``: readers see the old or the new file, never a partial one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _git_revision() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def resolve_device(name: str) -> torch.device:
    """ "auto": CUDA when available (the local rank's GPU under torchrun), else CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    return torch.device(name)


def load_checkpoint(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the same thing to the user
        raise CheckpointError(f"checkpoint {path} is corrupt or not a torchcal checkpoint ({err})") from None
    required = {"format", "epoch", "model", "optimizer", "scheduler", "loss", "rng", "config"}
    if not isinstance(state, dict) or state.get("format") != "torchcal-checkpoint-1" or required - set(state):
        raise CheckpointError(f"checkpoint {path} is not a torchcal checkpoint (missing {sorted(required)})")
    return state


@torch.no_grad()
def predict_logits(model, inputs: torch.Tensor, batch_size: int, device) -> torch.Tensor:
    model.eval()
    out = [
        model(inputs[i : i + batch_size].to(device)).float().cpu() for i in range(0, len(inputs), batch_size)
    ]
    return torch.cat(out)


def _optimizer(cfg: RunConfig, model):
    o = cfg.optim
    if o.name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    elif o.name == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)
    else:
        raise ValueError(f"unknown optimizer {o.name!r}; available: ['adam', 'sgd']")
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=list(o.milestones), gamma=o.gamma)
    return opt, sched


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


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / METRICS
    if not path.exists():
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _epoch_metrics(model, splits, cfg, device, names=("val", "test"), rank=0, world=1) -> dict:
    """Streaming metrics of each split; under data parallelism every rank scores its shard (rows rank,
    rank + world, ...) and ``sync`` all-reduces the bin sums, so every rank holds the global statistics."""
    out = {}
    for name in names:
        inputs, targets = splits[name].inputs[rank::world], splits[name].targets[rank::world]
        logits = predict_logits(model, inputs, cfg.data.eval_batch_size, device)
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
    cfg: RunConfig, run_dir: str | Path, *, resume: bool = False, progress=None, stop_after: int | None = None
):
    """Trains (or resumes) the run in ``run_dir``; returns the list of per-epoch metric rows.

    ``progress`` is an optional callable ``(epoch, batch, n_batches)``. ``stop_after`` ends the call after that
    many epochs of this call (the run stays resumable), for tests and time-boxed jobs.
    """
    import yaml

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = run_dir / CHECKPOINT
    state = None
    if resume:
        if not ckpt_path.exists():
            raise CheckpointError(f"cannot resume: {ckpt_path} does not exist (was the run started?)")
        state = load_checkpoint(ckpt_path)
        cfg = config_from_dict(state["config"])
    elif ckpt_path.exists():
        raise FileExistsError(
            f"{run_dir} already holds a run; pass --resume to continue it or choose another folder"
        )
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    device = resolve_device(cfg.train.device)
    rank, world = _distributed(device)
    meta = {"torchcal_version": __version__, "git_revision": _git_revision(), "world_size": world}
    if rank == 0:
        atomic_write_bytes(
            run_dir / CONFIG,
            lambda fh: fh.write(yaml.safe_dump({**config_to_dict(cfg), "meta": meta}).encode()),
        )
    splits = load_splits(cfg.data)
    train_set = splits["train"]
    num_classes = int(max(int(s.targets.max()) for k, s in splits.items() if k != "ood")) + 1
    torch.manual_seed(cfg.train.seed)
    extra = {}
    if cfg.model.name == "text_cnn":
        extra = {"embeddings": train_set.embeddings, "vocab_size": train_set.vocab_size}
    model = create_model(
        cfg.model.name, num_classes, train_set.inputs.shape[1:], cfg.model.width, **extra
    ).to(device)
    amp_dtype, channels_last = _speed_options(cfg, device, train_set.inputs.ndim == 4)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    step_model = model
    if world > 1:
        step_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    step_model = torch.compile(step_model) if cfg.train.compile else step_model
    loss_fn = create_loss(cfg.loss.name, reduction=cfg.loss.reduction, **cfg.loss.kwargs).to(device)
    opt, sched = _optimizer(cfg, model)
    start_epoch, rows = 0, []
    if state is not None:
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

    n = len(train_set)
    bs = cfg.data.batch_size
    n_batches = (n + bs - 1) // bs
    done_here = 0
    for epoch in range(start_epoch, cfg.train.epochs):
        if hasattr(loss_fn, "set_epoch"):
            loss_fn.set_epoch(epoch)
        model.train()
        epoch_gen = torch.Generator().manual_seed(cfg.train.seed * 100_003 + epoch)
        order = torch.randperm(n, generator=epoch_gen)
        total = 0.0
        for b in range(n_batches):
            # the global batch b, sharded across ranks (every rank sees the same permutation)
            idx = order[b * bs : (b + 1) * bs][rank::world]
            x, y = train_set.inputs[idx].to(device), train_set.targets[idx].to(device)
            if cfg.data.augment:
                x = random_crop_flip(x, epoch_gen)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                loss = loss_fn(step_model(x), y)
            # DDP averages gradients over ranks: a summed loss is scaled back to the global batch's sum
            (loss * world if world > 1 and cfg.loss.reduction == "sum" else loss).backward()
            if cfg.optim.grad_clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip_norm)
            opt.step()
            total += loss.detach()
            if cfg.loss.update_every and hasattr(loss_fn, "update") and (b + 1) % cfg.loss.update_every == 0:
                loss_fn.update(
                    metrics=_epoch_metrics(model, splits, cfg, device, ("val",), rank, world)["val"]
                )
                model.train()
            if progress is not None:
                progress(epoch, b + 1, n_batches)
        sched.step()
        metrics = _epoch_metrics(model, splits, cfg, device, rank=rank, world=world)
        if world > 1:
            import torch.distributed as dist

            total = torch.as_tensor(total, dtype=torch.float64, device=device)
            dist.all_reduce(total)
            total = total / world
        if hasattr(loss_fn, "update") and not cfg.loss.update_every:
            loss_fn.update(metrics=metrics["val"])  # AdaFocal: the validation pass we already made
        row = {"epoch": epoch, "train_loss": float(total) / n_batches, "lr": opt.param_groups[0]["lr"]}
        for split, m in metrics.items():
            row.update(
                {
                    f"{split}_{k}": float(v)
                    for k, v in m.compute(("ece", "adaece", "nll", "error")).items()
                    if k in ("ece", "adaece", "nll", "error")
                }
            )
        if isinstance(loss_fn, AdaFocalLoss):
            row["gammas"] = [float(g) for g in loss_fn.gammas]
            if len(loss_fn.gap_history):
                row["gaps"] = [float(g) for g in loss_fn.gap_history[-1]]
        rows.append(row)
        checkpoint = {
            "format": "torchcal-checkpoint-1", "epoch": epoch + 1, "model": model.state_dict(),
            "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "loss": loss_fn.state_dict(),
            "rng": torch.get_rng_state(), "config": config_to_dict(cfg),
        }  # fmt: skip
        if rank == 0:  # one writer; the others wait so that a resume finds a complete checkpoint
            atomic_write_bytes(ckpt_path, lambda fh, c=checkpoint: torch.save(c, fh))
            _write_jsonl(run_dir / METRICS, rows)
        _barrier(world)
        done_here += 1
        if stop_after is not None and done_here >= stop_after and epoch + 1 < cfg.train.epochs:
            return rows

    if rank == 0:
        logits = {}
        for name, split in splits.items():
            if name != "train":
                logits[name] = {
                    "logits": predict_logits(model, split.inputs, cfg.data.eval_batch_size, device),
                    "targets": split.targets,
                }
        atomic_write_bytes(run_dir / LOGITS, lambda fh: torch.save(logits, fh))
    _barrier(world)
    return rows
