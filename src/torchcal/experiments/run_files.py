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
    "check_writable",
    "make_dir",
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


def _cannot_write(path: Path, err: OSError) -> RunError:
    return RunError(f"cannot write {path}: {err.strerror or err}")


def atomic_write_bytes(path: Path, write) -> None:
    """Calls ``write(file_object)`` on a temporary file next to ``path``, fsyncs it, then renames it over
    ``path``: readers see the old or the new file, never a partial one. The file gets the permissions of
    any new file (0666 minus the process's umask), so colleagues and web servers can read reports. A file
    that cannot be written (a read-only folder, a file where the folder should be, a full disk) is a
    :class:`RunError` ``cannot write <path>: <reason>``."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as fh:
                write(fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.lexists(tmp):
                os.remove(tmp)
    except OSError as err:
        raise _cannot_write(path, err) from None


def make_dir(folder: Path) -> Path:
    """``folder`` created with its parents when missing; one that cannot be is a :class:`RunError`
    ``cannot write <folder>: <reason>``."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _cannot_write(folder, err) from None
    return folder


def check_writable(folder: Path) -> None:
    """Refuses (:class:`RunError` ``cannot write <folder>: <reason>``) an output folder that cannot be created
    or written, creating nothing: a file in its place, a file among its parents, or a read-only (or
    immutable) folder where it would be created. The check writes and removes one empty file in the nearest
    existing folder, so it holds for root and for ``chattr +i`` folders too."""
    folder = Path(folder)
    existing = folder
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        reason = "it is a file, not a folder" if existing == folder else f"{existing} is a file, not a folder"
        raise RunError(f"cannot write {folder}: {reason}")
    probe = existing / f".torchcal-write-check.{secrets.token_hex(6)}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.remove(probe)
    except OSError as err:
        raise _cannot_write(folder, err) from None


def read_json_object(path: Path, damaged: str) -> dict:
    """The JSON object in ``path`` ({} when there is no file); a file that is not a JSON object is a
    :class:`RunError` "<path> is damaged: <damaged>", a file that cannot be read one naming the reason."""
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        value = None
    except OSError as err:
        raise RunError(f"cannot read {path}: {err.strerror or err}") from None
    if not isinstance(value, dict):
        raise RunError(f"{path} is damaged: {damaged}")
    return value


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
