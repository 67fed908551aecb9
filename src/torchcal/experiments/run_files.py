"""The layout of a run folder (file names) and the two ways the runner touches its files: an atomic write and
reading the per-epoch rows. A leaf module: training, evaluation and reports all import it, it imports none
of them."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from .errors import RunError

__all__ = [
    "BEST",
    "CALIBRATORS",
    "CHECKPOINT",
    "CONFIG",
    "LOGITS",
    "METRICS",
    "RESULTS",
    "RUN_FILES",
    "SELECTION",
    "atomic_write_bytes",
    "read_metrics",
]

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
CONFIG = "config.yaml"
LOGITS = "logits.pt"
BEST = (
    "best.pt"  # with train.select=best_val_error: the weights of the epoch with the lowest validation error
)
SELECTION = "selection.json"  # which epoch's model made logits.pt, and by which rule
RESULTS = "results.json"
CALIBRATORS = "calibrators"  # folder of the fitted calibrators (<name>.pt, <name>.json)
RUN_FILES = (CONFIG, CHECKPOINT, METRICS, LOGITS)


def atomic_write_bytes(path: Path, write) -> None:
    """Calls ``write(file_object)`` on a temporary file next to ``path``, fsyncs it, then renames it over
    ``path``: readers see the old or the new file, never a partial one. The file gets the permissions of
    any new file (0666 minus the process's umask), so colleagues and web servers can read reports."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_metrics(run_dir: Path) -> list[dict]:
    """The per-epoch rows of ``metrics.jsonl`` (``[]`` when there is none); a damaged file is a
    :class:`RunError` naming the file and line."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        return []
    rows = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict) or not isinstance(row.get("epoch"), int):
                raise RunError(f"{path} is damaged: line {number} is not a complete epoch record")
            rows.append(row)
    return rows
