"""Training a run: the protocol's loop, checkpoints and resuming, the distributed (DDP) set-up, and the
logits the evaluation reads."""

from __future__ import annotations

from .loop import load_checkpoint, predict_logits, resolve_device, train

__all__ = ["train", "load_checkpoint", "predict_logits", "resolve_device"]
