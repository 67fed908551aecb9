"""A run folder's training state: the checkpoint written after every epoch, the best validation model, the
metrics log, and reading a run back to resume it."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from ..config import RunConfig, config_from_dict
from ..errors import CheckpointError, ConfigError, RunError
from ..run_files import CALIBRATORS, CHECKPOINT, CONFIG, RESULTS, atomic_write_bytes

__all__ = ["load_checkpoint", "load_best", "write_jsonl", "drop_stale_results", "saved_run"]


def load_checkpoint(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the same thing to the user
        raise CheckpointError(f"checkpoint {path} is corrupt or not a torchcal checkpoint ({err})") from None
    required = {"format", "epoch", "model", "optimizer", "scheduler", "loss", "rng", "config"}
    if not isinstance(state, dict) or state.get("format") != "torchcal-checkpoint-1" or required - set(state):
        raise CheckpointError(f"checkpoint {path} is not a torchcal checkpoint (missing {sorted(required)})")
    return state


def write_jsonl(path: Path, rows: list[dict]) -> None:
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    atomic_write_bytes(path, lambda fh: fh.write(text.encode()))


def load_best(path: Path) -> dict:
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the same thing to the user
        raise CheckpointError(f"{path} (the best validation model) is missing or damaged ({err})") from None
    if not isinstance(saved, dict) or saved.get("format") != "torchcal-best-1":
        raise CheckpointError(f"{path} is not a torchcal best-model file")
    return saved


def drop_stale_results(run_dir: Path, refit: tuple[str, ...] = ()) -> None:
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


def saved_run(run_dir: Path) -> tuple[RunConfig, dict, list, dict | None]:
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
