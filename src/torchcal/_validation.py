"""Cheap argument checks shared by every public function: a leaf module.

Each check costs at most one reduction over the input (or works on statistics handed to it) and raises
``ValueError`` or ``TypeError`` with the argument's name and what was expected. Nothing here ever repairs an
input silently, and nothing here imports :mod:`torchcal.functional`: which implementation computes what is
decided by :mod:`torchcal.functional._backend`, and the metrics' validated entry is
:mod:`torchcal.functional._inputs`.
"""

from __future__ import annotations

import math
import numbers
import warnings

import numpy as np
import torch

# Row-sum tolerance for probabilities, by dtype: a float32 softmax of 1000 classes sums to 1 within ~1e-6.
_SUM_TOL = {
    torch.float64: 1e-6,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 2e-2,
}


def as_tensor(x, name: str) -> torch.Tensor:
    """Converts numpy arrays and nested lists to tensors; rejects anything else with a named error."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray | list | tuple):
        try:
            return torch.as_tensor(np.asarray(x))
        except (TypeError, ValueError) as err:
            raise TypeError(f"`{name}` could not be converted to a tensor: {err}") from None
    raise TypeError(f"`{name}` must be a torch.Tensor or numpy array, got {type(x).__name__}")


def check_positive_int(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}")
    return int(value)


def check_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {type(value).__name__}")
    return value


def check_float(value, name: str, low=None, high=None, low_open=False, high_open=False) -> float:
    if type(value) is not float:  # (a float skips the ABC check, ~1 µs)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"`{name}` must be a real number, got {type(value).__name__}")
        value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be finite, got {value}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"`{name}` must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ValueError(f"`{name}` must be {'<' if high_open else '<='} {high}, got {value}")
    return value


def label_range_error(labels, k: int, name: str = "targets") -> ValueError:
    """The error for labels outside [0, k), naming the first offending label of ``labels`` (a label, or a
    tensor / numpy array known to hold one)."""
    labels = labels.numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    bad = labels[(labels < 0) | (labels >= k)].reshape(-1)[0]
    return ValueError(f"`{name}` must lie in [0, {k}), found label {bad}")


def check_targets(targets, n: int, num_classes: int, name: str = "targets", check_range: bool = True):
    """Checks integer class labels of shape (n,) in [0, num_classes) (the range only with ``check_range``:
    the fused scan checks it in its own pass)."""
    targets = as_data(targets, name)
    if targets.dtype == torch.bool or targets.is_floating_point() or targets.is_complex():
        raise TypeError(f"`{name}` must hold integer class indices, got dtype {targets.dtype}")
    if targets.ndim != 1:
        raise ValueError(f"`{name}` must have shape (N,), got {tuple(targets.shape)}")
    if targets.shape[0] != n:
        raise ValueError(f"`{name}` has {targets.shape[0]} entries but the scores have {n} rows")
    if check_range:
        lo, hi = torch.stack(torch.aminmax(targets)).tolist()
        if lo < 0 or hi >= num_classes:
            raise label_range_error(lo if lo < 0 else hi, num_classes, name)
    return targets.long()


def check_scores(x, name: str, min_classes: int = 2) -> torch.Tensor:
    """Checks a floating (N, K) tensor with N >= 1 and K >= min_classes; returns it as a tensor."""
    x = as_tensor(x, name)
    if not x.is_floating_point():
        raise TypeError(f"`{name}` must be a floating-point tensor, got dtype {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"`{name}` must have shape (N, K), got {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError(f"`{name}` is empty: at least one sample is needed")
    if x.shape[1] < min_classes:
        raise ValueError(f"`{name}` must have at least {min_classes} classes (columns), got {x.shape[1]}")
    return x


def _upcast_low_precision(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


# Rows of "logits" checked for looking like probabilities (a cheap test on the first rows only).
_PROBS_LOOK_ROWS = 64


def as_data(x, name: str) -> torch.Tensor:
    """``x`` as a tensor that metrics and calibrators treat as data: detached from any autograd graph."""
    return as_tensor(x, name).detach()


def check_logits(
    logits, name: str = "logits", *, warn_if_probs: str | None = None, check_finite: bool = True
) -> torch.Tensor:
    """Checks finite floating (N, K) logits. With ``warn_if_probs`` (the advice to print), warns when the
    first rows are non-negative and sum to 1, i.e. look like probabilities passed where logits are expected
    (one host sync in all, shared with the finiteness check). ``check_finite=False`` leaves finiteness to a
    caller whose own pass checks it (``isfinite`` over the whole input costs as much as a softmax on CPU)."""
    logits = check_scores(logits, name)
    # one host sync for everything asked: [all finite], [most negative head entry, worst head row sum − 1]
    stats = [torch.isfinite(logits).all().double()] if check_finite else []
    if warn_if_probs is not None:
        head = logits[:_PROBS_LOOK_ROWS]
        stats += [head.amin().double(), (head.double().sum(1) - 1).abs().amax()]
    values = torch.stack(stats).tolist() if stats else []
    if check_finite and not values.pop(0):
        raise ValueError(f"`{name}` contains NaN or infinite values")
    if warn_if_probs is not None:
        lowest, worst = values
        if lowest >= 0 and worst <= _SUM_TOL.get(logits.dtype, 1e-4) * max(1.0, logits.shape[1] / 100):
            warnings.warn(
                f"`{name}` rows are non-negative and sum to 1: they look like probabilities, not logits; "
                f"{warn_if_probs}",
                UserWarning,
                stacklevel=3,
            )
    return _upcast_low_precision(logits)


_FROM_LOGITS_ADVICE = "from_logits=True applies a softmax to them (pass from_logits=False for probabilities)"


def check_probs(probs, name: str = "probs") -> torch.Tensor:
    """Checks that rows are finite, non-negative and sum to one within a dtype-dependent tolerance."""
    probs = check_scores(probs, name)
    tol = _SUM_TOL.get(probs.dtype, 1e-4)
    probs = _upcast_low_precision(probs)
    # summing in the input dtype avoids an (N, K) float64 copy on CPU
    check_prob_stats(row_stats(probs.sum(dim=1), probs.amin()), name, tol, probs.shape[1])
    return probs


def row_stats(row_sums: torch.Tensor, min_entry: torch.Tensor):
    """(largest |row sum − 1|, min(min_entry, 0), not finite) as Python numbers, with one host sync.

    A row sum is finite only if every entry of the row is finite, so the sums check NaN/inf as well.
    """
    worst, lowest = torch.stack([(row_sums.double() - 1).abs().amax(), min_entry.double()]).tolist()
    nonfinite = worst != worst or worst == math.inf
    return worst, min(lowest, 0.0), nonfinite


def check_prob_stats(stats, name, tol, k) -> None:
    """Validation from precomputed statistics ``(largest |row sum − 1|, most negative entry or 0, any row sum
    not finite)`` (see :func:`row_stats`)."""
    worst, lowest, nonfinite = stats
    if nonfinite:
        raise ValueError(f"`{name}` contains NaN or infinite values")
    if lowest < 0:
        raise ValueError(f"`{name}` has negative entries; pass from_logits=True if these are logits")
    if worst > tol * max(1.0, k / 100):
        raise ValueError(
            f"rows of `{name}` must sum to 1 (largest deviation {worst:.3g}); "
            "pass from_logits=True if these are logits"
        )


def check_logits_for_loss(logits, targets, check_range: bool = True):
    """Sync-free checks for training losses: (N, K) floating logits with K >= 2, integer targets (N,).

    The label range is checked only for CPU tensors, where it costs no device synchronisation; on an
    accelerator an out-of-range label fails in the gather (device-side assert). NaN logits are not
    checked: they propagate to a NaN loss, which is visible, not silently wrong. ``check_range=False`` leaves
    the label range to the caller (the fused CPU losses check it in their own pass).
    """
    logits = check_scores(logits, "logits")
    targets = as_tensor(targets, "targets")
    if targets.dtype == torch.bool or targets.is_floating_point() or targets.is_complex():
        raise TypeError(f"`targets` must hold integer class indices, got dtype {targets.dtype}")
    if targets.ndim != 1 or targets.shape[0] != logits.shape[0]:
        raise ValueError(
            f"`targets` must have shape ({logits.shape[0]},) to match `logits`, got {tuple(targets.shape)}"
        )
    if targets.device != logits.device:
        raise ValueError(f"`targets` is on {targets.device} but `logits` is on {logits.device}")
    if check_range:
        check_label_range(targets, logits.shape[1])
    return logits, targets.long()


def check_label_range(targets: torch.Tensor, k: int, ignore_index: int | None = None) -> None:
    """Labels in [0, k) (those equal to ``ignore_index`` excepted), checked for CPU tensors only (no device
    synchronisation)."""
    if targets.device.type == "cpu" and targets.numel():
        lo, hi = torch.stack(torch.aminmax(targets)).tolist()
        if lo < 0 or hi >= k:
            if ignore_index is None:
                raise label_range_error(lo if lo < 0 else hi, k)
            bad = targets[((targets < 0) | (targets >= k)) & (targets != ignore_index)]
            if bad.numel():
                raise label_range_error(bad, k)


def check_choice(value, name: str, choices) -> str:
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {sorted(choices)}, got {value!r}")
    return value
