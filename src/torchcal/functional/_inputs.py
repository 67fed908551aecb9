"""The metrics' validated entry: checks (from :mod:`torchcal._validation`), the softmax when asked, and the
top-label scan through the backend seam (:mod:`torchcal.functional._backend`), sharing one pass."""

from __future__ import annotations

import torch

from .._validation import (
    _FROM_LOGITS_ADVICE,
    _SUM_TOL,
    _upcast_low_precision,
    as_data,
    check_logits,
    check_prob_stats,
    check_scores,
    check_targets,
    row_stats,
)
from . import _backend
from ._binning import ScanSums
from ._loss_inputs import check_ignore_index
from ._spec import ordered_sum

__all__ = [
    "metric_rows",
    "scan_inputs",
    "top_label_inputs",
    "top_label_bins",
    "probs_and_targets",
    "in_input_dtype",
    "nll_from_true_probs",
]


def nll_from_true_probs(p_true: torch.Tensor) -> torch.Tensor:
    """Per-sample −log p_t with p_t clamped below at the smallest positive normal of its dtype."""
    tiny = torch.finfo(p_true.dtype).tiny
    return -torch.log(p_true.clamp(min=tiny))


def top_label_inputs(probs, targets, from_logits: bool, name: str = "probs"):
    """Validated (conf, correct) of the top label, from one pass over ``probs`` (from logits: without the
    probability matrix, :func:`logits_top_label`)."""
    if from_logits is True:
        return logits_top_label(probs, targets, None, name)[:2]
    scan = scan_inputs(probs, targets, from_logits, name)[2]
    return scan.conf, scan.correct


def top_label_bins(
    probs, targets, from_logits: bool, n_bins: int, name: str = "probs"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validated top-label equal-width (count, confidence sum, correct sum), float64 of shape (n_bins,)."""
    if from_logits is True:
        top = logits_top_label(probs, targets, n_bins, name)[2]
    else:
        top = scan_inputs(probs, targets, from_logits, name, n_bins=n_bins)[2].top
    assert top is not None  # both passes bin with n_bins
    return top


def logits_top_label(logits, targets, n_bins, name: str = "probs"):
    """Validated (conf, correct, equal-width bin sums or None) straight from logits: the top-label
    confidence is the largest softmax probability, 1 / Σ_j exp(z_j − max_j z_j), so metrics that need only
    the top label never build the (N, K) softmax (:func:`torchcal.functional._backend.top_label_from_logits`).
    Same checks as :func:`scan_inputs` with ``from_logits=True``."""
    logits = as_data(logits, name)
    in_op = _backend.scan_checks_labels(logits)  # the C++ pass checks finiteness and labels itself
    logits = check_logits(logits, name, warn_if_probs=_FROM_LOGITS_ADVICE, check_finite=not in_op)
    targets = check_targets(targets, logits.shape[0], logits.shape[1], check_range=not in_op)
    if targets.device != logits.device:
        raise ValueError(f"`targets` is on {targets.device} but `{name}` is on {logits.device}")
    return _backend.top_label_from_logits(logits, targets, n_bins)


def scan_inputs(
    probs,
    targets,
    from_logits: bool,
    name: str = "probs",
    num_classes: int | None = None,
    classwise_bins=None,
    n_bins=None,
    threshold=None,
    row_bins: bool = False,
    bin_vectors: bool = False,
):
    """Validated (probs, targets, scan): validation, the top-label statistics and (with ``classwise_bins`` /
    ``n_bins`` / ``threshold`` / ``row_bins`` / ``bin_vectors``) the classwise and top-label bin sums, the
    per-sample sums, each row's top-label bin and the per-bin vector sums share one pass over ``probs``
    (:func:`torchcal.functional._backend.scan`)."""
    probs, targets, tol = _scores_and_targets(
        probs, targets, from_logits, name, num_classes, check_values=False, fused_scan=True
    )
    scan = _backend.scan(probs, targets, classwise_bins, n_bins, threshold, row_bins, bin_vectors)
    if not from_logits:
        check_prob_stats(scan.stats, name, tol, probs.shape[1])
    if threshold is not None and scan.sums is None:  # the paths whose pass does not sum them
        scan = scan._replace(sums=_torch_sums(probs, targets, scan, threshold))
    return probs, targets, scan


def _torch_sums(probs, targets, scan, threshold):
    """The per-sample sums of :class:`torchcal.functional._binning.ScanSums` by torch ops, as 0-d float64
    tensors on the input's device (no host sync): −log p_t with the clamp in the input dtype and the log in
    float64, as the C++ scan takes them, added by :func:`ordered_sum` (the counts are exact in any order)."""
    p_true = probs.gather(1, targets[:, None]).squeeze(1)
    confident = scan.conf >= threshold
    return ScanSums(
        -ordered_sum(torch.log(p_true.clamp(min=torch.finfo(p_true.dtype).tiny).double())),
        ordered_sum(p_true.double()),
        scan.correct.double().sum(),
        confident.double().sum(),
        (confident & scan.correct).double().sum(),
    )


def in_input_dtype(probs: torch.Tensor, dtype: torch.dtype, from_logits: bool) -> torch.Tensor:
    """Validated probabilities to hand to a function that validates them again (a metric passed to a
    wrapper): cast back to the caller's ``dtype``, so that function applies that dtype's row-sum tolerance
    (a float16 or bfloat16 input comes back exactly from its float32 upcast); from logits, the softmax as
    computed, unchanged."""
    return probs if from_logits else probs.to(dtype)


def probs_and_targets(probs, targets, from_logits: bool, name: str = "probs"):
    """The common entry of every metric: validated probabilities (softmax applied if asked) and targets."""
    return _scores_and_targets(probs, targets, from_logits, name)[:2]


def _scores_and_targets(
    probs, targets, from_logits, name, num_classes=None, check_values=True, fused_scan=False
):
    """Shared checks: (probs, targets, row-sum tolerance). With ``check_values=False`` the probability values
    are left for the caller to check from statistics of its own pass (:func:`check_prob_stats`); with
    ``fused_scan`` the caller's pass is :func:`torchcal.functional._backend.scan`, whose fused kernel (when
    it applies) also checks the label range."""
    if not isinstance(from_logits, bool):
        raise TypeError(f"`from_logits` must be a bool, got {type(from_logits).__name__}")
    probs = as_data(probs, name)
    if from_logits:
        probs = torch.softmax(check_logits(probs, name, warn_if_probs=_FROM_LOGITS_ADVICE), dim=1)
    else:
        probs = check_scores(probs, name)
    tol = _SUM_TOL.get(probs.dtype, 1e-4)
    probs = _upcast_low_precision(probs)
    if check_values and not from_logits:
        check_prob_stats(row_stats(probs.sum(dim=1), probs.amin()), name, tol, probs.shape[1])
    if num_classes is not None and probs.shape[1] != num_classes:
        raise ValueError(f"`{name}` has {probs.shape[1]} classes, this metric was built for {num_classes}")
    in_scan = fused_scan and _backend.scan_checks_labels(probs)
    targets = check_targets(targets, probs.shape[0], probs.shape[1], check_range=not in_scan)
    if targets.device != probs.device:
        raise ValueError(f"`targets` is on {targets.device} but `{name}` is on {probs.device}")
    return probs, targets, tol


def metric_rows(scores, targets, ignore_index=None, *, class_dim: int = 1, names=("scores", "targets")):
    """Scores with extra dimensions as (rows, K) and their targets as (rows,), rows whose target equals
    ``ignore_index`` dropped: the form every metric takes. ``class_dim=1`` for PyTorch's (N, K, d1, ...),
    ``-1`` for Hugging Face's (N, T, K); ``names`` are the arguments' names in errors. The inputs are treated
    as data (detached). Every metric calls it first (decision 97): dropping ignored rows is a boolean
    selection, one device synchronisation on an accelerator, made only when ``ignore_index`` is given.

    Example:
        >>> import torch
        >>> z, y = torch.zeros(2, 3, 4), torch.tensor([[0, 1, 2, -100], [2, 2, -100, -100]])
        >>> from torchcal.metrics import metric_rows
        >>> rows, labels = metric_rows(z, y, ignore_index=-100)
        >>> rows.shape, labels.tolist()
        (torch.Size([5, 3]), [0, 1, 2, 2, 2])
    """
    ignore_index = check_ignore_index(ignore_index)
    scores, targets = as_data(scores, names[0]), as_data(targets, names[1])
    if scores.ndim > 2:
        k = scores.shape[class_dim]
        expected = tuple(d for i, d in enumerate(scores.shape) if i != class_dim % scores.ndim)
        if tuple(targets.shape) != expected:
            raise ValueError(
                f"`{names[1]}` must have shape {expected} to match `{names[0]}`, got {tuple(targets.shape)}"
            )
        scores, targets = scores.movedim(class_dim, -1).reshape(-1, k), targets.reshape(-1)
    if ignore_index is not None and targets.ndim == 1 and targets.shape[0] == scores.shape[0]:
        keep = targets != ignore_index
        scores, targets = scores[keep], targets[keep]
    return scores, targets
