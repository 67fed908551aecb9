"""The inputs every training loss takes, checked and brought to rows once (decision 73).

Besides (N, K) logits with (N,) integer labels, every loss accepts what the PyTorch ecosystem produces, with
the conventions of ``F.cross_entropy``:

* **more dimensions**: logits (N, K, d1, ...) with labels (N, d1, ...) (segmentation, token
  classification); each position is a sample, and ``reduction="none"`` returns the (N, d1, ...) losses;
* **ignored labels**: positions labelled ``ignore_index`` (default −100, the padding label of Hugging Face's
  collators) add nothing; ``"mean"`` averages over the kept positions (NaN when there are none, as
  ``F.cross_entropy``), ``"none"`` gives them 0; ``ignore_index=None`` ignores nothing, so every label must lie
  in [0, K);
* **soft targets**: floating targets of the logits' shape are class probabilities per sample (mixup, cutmix,
  label smoothing done by the data pipeline); losses whose definition needs a true class refuse them.

Two more arguments follow ``F.cross_entropy`` (decision 96):

* **class weights** ``weight`` (K,): a sample's loss is multiplied by the weight of its class, and
  ``"mean"`` divides by the sum of the weights of the kept labels; against class probabilities q the
  per-class terms are weighted, Σ_k w_k q_k f(p_k), and ``"mean"`` divides by the number of rows;
* **label smoothing** ε: the target distribution (1 − ε)·onehot + ε/K (or (1 − ε)·q + ε/K), for the losses
  that are functions of it; weighted as above, ``"mean"`` still divides by the weights of the labels.

The checks cost no accelerator synchronisation: label ranges, the soft targets' rows and the weights' values
are checked for CPU tensors only, as everywhere in the core, and not at all while ``torch.compile`` traces
(they need the values; the operators still refuse labels outside [0, K)).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

from .._validation import _SUM_TOL, as_tensor, check_float, check_label_range, row_stats
from ._spec import ordered_sum, reduce_loss

__all__ = [
    "IGNORE_INDEX",
    "LossRows",
    "check_class_weight",
    "check_ignore_index",
    "check_label_smoothing",
    "check_loss_inputs",
    "class_weight_buffer",
    "loss_rows",
    "reduce_rows",
    "smoothed_targets",
]

IGNORE_INDEX = -100  # F.cross_entropy's default


class LossRows(NamedTuple):
    """A loss's inputs as rows: ``logits`` (M, K) in float32/64; ``targets`` (M,) int64 labels (ignored rows
    hold 0, a valid label whose loss is masked out) or (M, K) class probabilities; ``keep`` (M,) bool, False
    for ignored rows (None when nothing can be ignored); ``shape``, the per-sample loss shape (N, d1, ...)."""

    logits: torch.Tensor
    targets: torch.Tensor
    keep: torch.Tensor | None
    shape: tuple

    @property
    def soft(self) -> bool:
        return self.targets.ndim == 2


def check_ignore_index(ignore_index: object) -> int | None:
    """None or an integer (not a bool)."""
    if ignore_index is not None and (
        isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral)
    ):
        raise TypeError(f"`ignore_index` must be an integer or None, got {type(ignore_index).__name__}")
    return None if ignore_index is None else int(ignore_index)


def check_loss_inputs(
    logits, targets, ignore_index: int | None = IGNORE_INDEX, *, soft_refusal: str | None = None, check_range: bool = True
):
    """Checks the inputs of a training loss without reshaping them: (logits, targets, soft) with ``logits``
    upcast from half precision. ``soft_refusal`` is the reason a loss refuses soft targets (None: accepted).
    The range of integer labels (ignored ones excepted) is checked for CPU tensors unless ``check_range`` is
    False (a caller whose operator checks it)."""
    ignore_index = check_ignore_index(ignore_index)
    logits = as_tensor(logits, "logits")
    if not logits.is_floating_point():
        raise TypeError(f"`logits` must be a floating-point tensor, got dtype {logits.dtype}")
    if logits.ndim < 2:
        raise ValueError(f"`logits` must have shape (N, K) or (N, K, d1, ...), got {tuple(logits.shape)}")
    if logits.numel() == 0:
        raise ValueError(f"`logits` is empty (shape {tuple(logits.shape)}): at least one sample is needed")
    k = logits.shape[1]
    if k < 2:
        raise ValueError(f"`logits` must have at least 2 classes (dimension 1), got {k}")
    targets = as_tensor(targets, "targets")
    if targets.device != logits.device:
        raise ValueError(f"`targets` is on {targets.device} but `logits` is on {logits.device}")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if targets.is_floating_point():
        if soft_refusal is not None:
            raise TypeError(f"soft (floating) `targets` are not accepted: {soft_refusal}")
        if targets.shape != logits.shape:
            raise ValueError(
                "soft `targets` (class probabilities) must have the shape of `logits` "
                f"{tuple(logits.shape)}, got {tuple(targets.shape)}; integer labels have shape "
                f"{(logits.shape[0], *logits.shape[2:])}"
            )
        if targets.device.type == "cpu" and not torch.compiler.is_compiling():
            _check_soft_targets(targets)
        return logits, targets.to(logits.dtype), True
    if targets.dtype == torch.bool or targets.is_complex():
        raise TypeError(
            f"`targets` must hold integer class indices (or class probabilities), got dtype {targets.dtype}"
        )
    expected = (logits.shape[0], *logits.shape[2:])
    if tuple(targets.shape) != expected:
        raise ValueError(
            f"`targets` must have shape {expected} to match `logits`, got {tuple(targets.shape)}"
        )
    if check_range and not torch.compiler.is_compiling():
        check_label_range(targets, k, ignore_index)
    return logits, targets.long(), False


def _check_soft_targets(targets: torch.Tensor) -> None:
    """Rows of class probabilities: finite, non-negative, summing to 1 within the dtype's tolerance."""
    worst, lowest, nonfinite = row_stats(targets.sum(dim=1, dtype=torch.float64), targets.amin())
    if nonfinite:
        raise ValueError("soft `targets` contain NaN or infinite values")
    if lowest < 0:
        raise ValueError(f"soft `targets` must be class probabilities: found the negative entry {lowest:.3g}")
    tol = _SUM_TOL.get(targets.dtype, 1e-4) * max(1.0, targets.shape[1] / 100)
    if worst > tol:
        raise ValueError(
            f"soft `targets` must sum to 1 over the classes (dimension 1); largest deviation {worst:.3g}"
        )


def loss_rows(logits, targets, ignore_index: int | None = IGNORE_INDEX, *, soft_refusal: str | None = None) -> LossRows:
    """Checked inputs as :class:`LossRows`: positions become rows, ignored labels are replaced by 0 and masked."""
    ignore_index = check_ignore_index(ignore_index)
    logits, targets, soft = check_loss_inputs(logits, targets, ignore_index, soft_refusal=soft_refusal)
    k = logits.shape[1]
    shape = (logits.shape[0], *logits.shape[2:])
    if logits.ndim > 2:  # (N, K, d1, ...) -> (N·d1·..., K), the class dimension last
        logits = logits.movedim(1, -1).reshape(-1, k)
        targets = targets.movedim(1, -1).reshape(-1, k) if soft else targets.reshape(-1)
    keep = None
    if not soft and ignore_index is not None:
        keep = targets != ignore_index
        targets = targets.masked_fill(~keep, 0)
    return LossRows(logits, targets, keep, shape)


def check_label_smoothing(label_smoothing, refusal: str | None = None) -> float:
    """ε in [0, 1]; a loss that is not a function of the target distribution passes the reason as ``refusal``
    and any ε > 0 raises it."""
    eps = check_float(label_smoothing, "label_smoothing", low=0, high=1)
    if eps and refusal is not None:
        raise ValueError(f"`label_smoothing` is not accepted: {refusal}")
    return eps


def check_class_weight(weight, logits: torch.Tensor) -> torch.Tensor | None:
    """None, or ``weight`` as a (K,) tensor of the checked ``logits``' dtype and device: one finite,
    non-negative weight per class (values checked for CPU tensors)."""
    if weight is None:
        return None
    k = logits.shape[1]
    if not isinstance(weight, torch.Tensor):
        weight = as_tensor(weight, "weight").to(logits.device)
    if not weight.is_floating_point():
        raise TypeError(
            f"`weight` must be a floating-point tensor (one weight per class), got dtype {weight.dtype}"
        )
    if tuple(weight.shape) != (k,):
        raise ValueError(f"`weight` must have shape ({k},), one weight per class, got {tuple(weight.shape)}")
    if weight.device != logits.device:
        raise ValueError(f"`weight` is on {weight.device} but `logits` is on {logits.device}")
    if weight.device.type == "cpu" and not torch.compiler.is_compiling():
        lowest = float(torch.where(torch.isfinite(weight), weight, -torch.inf).amin())
        if lowest < 0:
            raise ValueError("`weight` must hold finite, non-negative class weights")
    return weight.to(logits.dtype)


def class_weight_buffer(weight) -> torch.Tensor | None:
    """A loss module's ``weight`` argument as the tensor it keeps as a buffer: None, or a 1-D floating tensor
    of finite, non-negative values (the class count is checked against the logits at each call)."""
    if weight is None:
        return None
    weight = as_tensor(weight, "weight")
    if not weight.is_floating_point() or weight.ndim != 1:
        raise ValueError(
            f"`weight` must be a 1-D floating-point tensor (one weight per class), got dtype {weight.dtype} "
            f"and shape {tuple(weight.shape)}"
        )
    if weight.device.type == "cpu" and not bool(torch.isfinite(weight).all() and (weight >= 0).all()):
        raise ValueError("`weight` must hold finite, non-negative class weights")
    return weight


def smoothed_targets(rows: LossRows, eps: float) -> torch.Tensor:
    """The rows' target distributions (M, K), smoothed as (1 − ε)·q + ε/K (the labels' one-hot rows when
    the targets are labels)."""
    k = rows.logits.shape[1]
    if rows.soft:
        q = rows.targets
    else:
        q = torch.nn.functional.one_hot(rows.targets, k).to(rows.logits.dtype)
    return q * (1 - eps) + eps / k if eps else q


def reduce_rows(
    loss: torch.Tensor, rows: LossRows, reduction: str, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """The (M,) per-row ``loss`` reduced as the caller asked: ignored rows add 0 and "mean" averages over the
    kept rows (NaN when none is kept, as ``F.cross_entropy``); "none" has the per-sample shape. With class
    ``weight`` (K,) and labels, each row is multiplied by its label's weight and "mean" divides by their sum
    over the kept rows (``F.cross_entropy``'s normalisation); soft rows are weighted by the loss itself."""
    sample_weight = None
    if weight is not None and not rows.soft:
        sample_weight = weight[rows.targets]
        loss = loss * sample_weight
    if rows.keep is not None:
        loss = torch.where(rows.keep, loss, loss.new_zeros(()))
        if reduction == "mean":
            if sample_weight is None:
                return ordered_sum(loss) / rows.keep.sum()
            return ordered_sum(loss) / ordered_sum(torch.where(rows.keep, sample_weight, sample_weight.new_zeros(())))
    if reduction == "none":
        return loss.reshape(rows.shape)
    if reduction == "mean" and sample_weight is not None:
        return ordered_sum(loss) / ordered_sum(sample_weight)
    return reduce_loss(loss, reduction)
