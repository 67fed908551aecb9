"""Binning-free calibration errors from cumulative differences (SPEC §9.2): Kolmogorov-Smirnov (Gupta et al.
2021) and Kuiper (Arrieta-Ibarra et al. 2022), binary, top-label and classwise.

Kernel: sort the scores ``s`` ascending (stable: ties keep input order), ``D_k = (1/N) Σ_{j≤k} (t_(j) −
s_(j))`` for k = 1..N (the divisor is the total N); ``KS = max_k |D_k|`` and ``Kuiper = max(0, max_k D_k) −
min(0, min_k D_k)``. These need every score, so a stream keeps rows (:class:`torchcal.metrics.CalibrationMetrics`
keeps the top-label confidence and correctness and merges by gathering).
"""

from __future__ import annotations

import torch

from .._namespace import only_public as _only_public
from .._validation import check_choice
from ._field_inputs import field_inputs, top_label_pairs
from .calibration import sorted_by_confidence

__all__ = [
    "ks_calibration_error",
    "kuiper_calibration_error",
    "cumulative_extremes",
    "extremes_of_sorted",
]

# float64 elements of one classwise chunk: bounds the (N, chunk) sort and cumulative-sum buffers
_CHUNK_ELEMENTS = 1 << 23


def cumulative_extremes(scores: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max(0, max_k D_k), min(0, min_k D_k)) of the kernel, along dim 0 of ``scores``/``targets`` (N, ...)
    (float64; both 0 for N = 0). KS is ``max(hi, −lo)``, Kuiper ``hi − lo``."""
    n = scores.shape[0]
    if n == 0:
        zero = torch.zeros(scores.shape[1:], dtype=torch.float64, device=scores.device)
        return zero, zero.clone()
    s, order = torch.sort(scores, dim=0, stable=True)
    return extremes_of_sorted(s, targets.gather(0, order))


def extremes_of_sorted(scores_sorted: torch.Tensor, targets_sorted: torch.Tensor):
    """:func:`cumulative_extremes` of scores already sorted ascending (stable) with their targets."""
    n = scores_sorted.shape[0]
    if n == 0:
        zero = torch.zeros(scores_sorted.shape[1:], dtype=torch.float64, device=scores_sorted.device)
        return zero, zero.clone()
    d = torch.cumsum(targets_sorted.double() - scores_sorted.double(), dim=0) / n
    return d.amax(0).clamp(min=0), d.amin(0).clamp(max=0)


def _extremes(probs, targets, kind, from_logits):
    # top label and binary: validated probabilities (non-negative) with bool targets, sorted by
    # sorted_by_confidence (the C++ radix sort on CPU when built, carrying the targets along)
    if kind == "top_label":
        conf, correct = top_label_pairs(probs, targets, from_logits)
        return extremes_of_sorted(*sorted_by_confidence(conf, correct > 0.5))
    probs, targets = field_inputs(probs, targets, from_logits)
    if kind == "binary":
        if probs.shape[1] != 2:
            raise ValueError(f"kind='binary' needs 2 classes, `probs` has {probs.shape[1]}")
        return extremes_of_sorted(*sorted_by_confidence(probs[:, 1].contiguous(), targets == 1))
    n, k = probs.shape
    cols = max(1, _CHUNK_ELEMENTS // max(n, 1))
    his, los = [], []
    for start in range(0, k, cols):
        stop = min(k, start + cols)
        classes = torch.arange(start, stop, device=probs.device)
        hi, lo = cumulative_extremes(probs[:, start:stop], (targets[:, None] == classes).double())
        his.append(hi)
        los.append(lo)
    return torch.cat(his), torch.cat(los)


def _reduce(values, kind, reduction):
    if kind != "classwise" or reduction == "none":
        return values
    return values.mean() if reduction == "mean" else values.sum()


def ks_calibration_error(
    probs, targets, *, kind: str = "top_label", reduction: str = "mean", from_logits: bool = False
) -> torch.Tensor:
    r"""Kolmogorov-Smirnov calibration error ``max_k |D_k|`` (see the module for the kernel).

    ``kind``: ``"top_label"`` (s = max_k p_k, t = 1[argmax = y], first maximal index); ``"binary"``
    (K = 2: s = p_1, t = 1[y = 1], probmetrics' definition); ``"classwise"`` (per class k: s = p_k,
    t = 1[y = k], classes absent from the targets included; ``reduction`` ``"mean"`` (default), ``"sum"`` or
    ``"none"`` for the (K,) vector).

    Args:
        probs: probabilities (N, K) (or (N,) for P(class 1)), or logits with ``from_logits=True``.
        targets: integer labels (N,).

    Returns:
        0-d float64 tensor (or (K,) with ``reduction="none"``); 0 for N = 0.

    References:
        Gupta, Rahimi, Ajanthan, Mensink, Sminchisescu & Hartley 2021, "Calibration of Neural Networks using
        Splines" (ICLR).

    Example:
        >>> import torch
        >>> p1 = torch.tensor([.1, .4, .35, .8, .9, .65, .2, .55], dtype=torch.float64)
        >>> y = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1])
        >>> ks_calibration_error(p1, y, kind="binary")
        tensor(0.0813, dtype=torch.float64)
    """
    check_choice(kind, "kind", {"top_label", "binary", "classwise"})
    check_choice(reduction, "reduction", {"mean", "sum", "none"})
    hi, lo = _extremes(probs, targets, kind, from_logits)
    return _reduce(torch.maximum(hi, -lo), kind, reduction)


def kuiper_calibration_error(
    probs, targets, *, kind: str = "top_label", reduction: str = "mean", from_logits: bool = False
) -> torch.Tensor:
    r"""Kuiper calibration error ``max(0, max_k D_k) − min(0, min_k D_k)`` (see the module for the kernel and
    :func:`ks_calibration_error` for ``kind`` and ``reduction``). Always ≥ KS.

    References:
        Arrieta-Ibarra, Gujral, Tannen, Tygert & Xu 2022, "Metrics of calibration for probabilistic
        predictions" (JMLR).

    Example:
        >>> import torch
        >>> p1 = torch.tensor([.1, .4, .35, .8, .9, .65, .2, .55], dtype=torch.float64)
        >>> y = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1])
        >>> kuiper_calibration_error(p1, y, kind="binary")
        tensor(0.1313, dtype=torch.float64)
    """
    check_choice(kind, "kind", {"top_label", "binary", "classwise"})
    check_choice(reduction, "reduction", {"mean", "sum", "none"})
    hi, lo = _extremes(probs, targets, kind, from_logits)
    return _reduce(hi - lo, kind, reduction)


_only_public(__name__)
