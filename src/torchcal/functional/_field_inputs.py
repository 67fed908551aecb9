"""Inputs of the metrics of SPEC §9 (signed ECE, KS/Kuiper, decompositions, selective prediction, conformal
sets): validated float (N, K) probabilities (a 1-D (N,) input is P(class 1) and becomes [1 − p, p]), int64
targets, the top-label reduction with the first maximal index, and N = 0 allowed (each metric states what it
returns then)."""

from __future__ import annotations

import torch

from .._validation import as_data, check_targets
from ._inputs import probs_and_targets, top_label_inputs


def field_inputs(probs, targets, from_logits: bool = False, name: str = "probs", allow_empty: bool = True):
    """Validated (probs (N, K), targets (N,)); 1-D probabilities are P(class 1) (not with ``from_logits``)."""
    if not isinstance(from_logits, bool):
        raise TypeError(f"`from_logits` must be a bool, got {type(from_logits).__name__}")
    probs = as_data(probs, name)
    if probs.ndim == 1:
        if from_logits:
            raise ValueError(
                f"`{name}` must have shape (N, K) with from_logits=True, got {tuple(probs.shape)}"
            )
        if not probs.is_floating_point():
            raise TypeError(f"`{name}` must be a floating-point tensor, got dtype {probs.dtype}")
        probs = torch.stack([1 - probs, probs], dim=-1)
    if probs.ndim == 2 and probs.shape[0] == 0 and allow_empty:
        if not probs.is_floating_point():
            raise TypeError(f"`{name}` must be a floating-point tensor, got dtype {probs.dtype}")
        if probs.shape[1] < 2:
            raise ValueError(f"`{name}` must have at least 2 classes (columns), got {probs.shape[1]}")
        targets = check_targets(targets, 0, probs.shape[1], check_range=False)
        return probs, targets.to(probs.device)
    return probs_and_targets(probs, targets, from_logits, name)


def top_label(probs: torch.Tensor, targets: torch.Tensor):
    """(conf, correct float64, pred): ``max_k p_ik``, the first maximal index, and 1[pred == target]."""
    pred = probs.argmax(dim=1)
    conf = probs.gather(1, pred[:, None]).squeeze(1)
    return conf, (pred == targets).double(), pred


def top_label_pairs(probs, targets, from_logits: bool = False, name: str = "probs"):
    """Validated top-label (conf, correct float64) of (N, K) probabilities or logits from the one fused pass of
    :func:`torchcal.functional._inputs.top_label_inputs` (validation, max and argmax together; no (N, K)
    copy); 1-D and empty inputs go through :func:`field_inputs`."""
    raw = as_data(probs, name)
    if raw.ndim == 2 and raw.shape[0] > 0:
        conf, correct = top_label_inputs(raw, targets, from_logits, name)
        return conf, correct.double()
    probs, targets = field_inputs(raw, targets, from_logits, name)
    conf, correct, _ = top_label(probs, targets)
    return conf, correct
