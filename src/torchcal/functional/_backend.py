"""The backend seam: the one place that decides which implementation of each kernel runs.

Two implementations per kernel, one per role (see docs/architecture.md):

* **torch** — the reference, and the path of every device (GPU included) and of CPUs without the compiled
  library: :func:`torchcal.functional._binning.torch_scan`, ``torch.sort(stable=True)``,
  :class:`torchcal.functional._true_class.TrueClassLoss`;
* **C++** — the CPU accelerator, when built and enabled (:mod:`torchcal.functional._extension`): one pass
  for the scan, a radix sort carrying the correctness, a fused loss with its own autograd node.

Kernels: the metrics' top-label scan (:func:`scan`, which also gives the classwise and per-sample sums), the
top label straight from logits (:func:`top_label_from_logits`, no probability matrix), the stable sorts of
confidences with their correctness (:func:`sort_with_flags`, ascending; :func:`sort_descending_with_flags`),
and the p_t-only training loss (:func:`true_class_loss`). Public functions call these; no other module asks which backend exists.
"""

from __future__ import annotations

import functools
import warnings

import torch

from .._validation import check_choice
from . import _extension
from ._binning import Scan, _FinishedClasswise, bin_sums, equal_width_index, torch_scan
from ._loss_inputs import (
    IGNORE_INDEX,
    check_class_weight,
    check_label_smoothing,
    loss_rows,
    reduce_rows,
    smoothed_targets,
)
from ._spec import REDUCTIONS, ordered_sum, reduce_loss
from ._true_class import SoftTargetLoss, TrueClassLoss

__all__ = [
    "scan",
    "scan_checks_labels",
    "top_label_from_logits",
    "sort_with_flags",
    "sort_descending_with_flags",
    "true_class_loss",
    "penalised_cross_entropy",
    "batch_rows",
    "batch_loss",
    "sbece_label",
    "use_cpu_kernels",
    "cpu_kernels_available",
]

# -- metrics: the top-label scan and the stable sort ---------------------------------------------------------


def scan_checks_labels(probs: torch.Tensor) -> bool:
    """Whether :func:`scan` checks the label range in its own pass (the C++ scan does; the torch path needs
    the caller's check)."""
    return _extension.scan_applies(probs)


def scan(
    probs, targets, classwise_bins=None, n_bins=None, threshold=None, row_bins=False, bin_vectors=False
) -> Scan:
    """The top-label scan of validated ``probs`` (N, K) and ``targets`` (N,): confidence, correctness,
    validation statistics and, on request, the equal-width (``n_bins``) and classwise (``classwise_bins``)
    bin sums, (``threshold``; C++ only, else None) the per-sample sums and (``row_bins`` with ``n_bins``)
    each row's equal-width top-label bin, (``bin_vectors`` with ``n_bins``; C++ only, else None) the per-bin
    vector sums of the decompositions. C++ for contiguous float32/64 CPU tensors when the library is built;
    torch otherwise (whose scan always gives each row's bin with ``n_bins``)."""
    if _extension.scan_applies(probs):
        conf, correct, worst, lowest, nonfinite, top, cw, sum_sq, bins, sums, vectors = (
            _extension.top_label_scan(
                probs, targets, n_bins, classwise_bins, threshold, row_bins, bin_vectors
            )
        )
        classwise = None if cw is None else _FinishedClasswise(cw)
        return Scan(conf, correct, (worst, lowest, nonfinite), classwise, top, sum_sq, sums, bins, vectors)
    return torch_scan(probs, targets, classwise_bins, n_bins)


def top_label_from_logits(logits, targets, n_bins=None):
    """The top label straight from validated ``logits`` (N, K), without the (N, K) probability matrix:
    (conf, correct, equal-width (count, conf sum, correct sum) or None without ``n_bins``). conf is the
    largest softmax probability, 1 / Σ_j exp(z_j − max_j z_j). C++ (one pass; it checks the label range) for
    contiguous float32/64 CPU logits when built; torch otherwise (the caller checks the label range)."""
    if _extension.scan_applies(logits):
        return _extension.logits_top_label(logits, targets, n_bins)
    top_logit, pred = logits.max(dim=1)
    conf = torch.exp(logits - top_logit[:, None]).sum(dim=1).reciprocal_()
    correct = pred == targets
    top = None if n_bins is None else bin_sums(equal_width_index(conf, n_bins), n_bins, conf, correct)
    return conf, correct, top


def sort_with_flags(values: torch.Tensor, flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable ascending sort of non-negative confidences ``values`` carrying the bool ``flags`` (correctness)
    along: (sorted values, their flags). C++ radix sort on CPU when built; ``torch.sort(stable=True)`` and a
    gather otherwise."""
    if flags.dtype == torch.bool and _extension.sort_applies(values):
        return _extension.sort_with_flags(values, flags)
    values_sorted, order = torch.sort(values, stable=True)
    return values_sorted, flags[order]


def sort_descending_with_flags(
    values: torch.Tensor, flags: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable descending sort of finite scores ``values`` (ties keep input order) carrying the bool ``flags``
    along. Non-negative values on CPU take the radix sort of :func:`sort_with_flags` on the reversed input,
    reversed back: ascending with ties in reversed input order, read backwards, is descending with ties in
    input order. Otherwise ``torch.sort(descending=True, stable=True)`` and a gather."""
    if (
        flags.dtype == torch.bool
        and _extension.sort_applies(values)
        and values.numel() > 0
        and bool(values.amin() >= 0)
    ):
        values_sorted, flags_sorted = _extension.sort_with_flags(values.flip(0), flags.flip(0))
        return values_sorted.flip(0), flags_sorted.flip(0)
    values_sorted, order = torch.sort(values, descending=True, stable=True)
    return values_sorted, flags[order]


# -- losses: the p_t-only training losses --------------------------------------------------------------------

_RUNNER_UP_NEEDS_LABELS = "the dual focal loss is defined by the true class and the runner-up below it"
_INTEGER_DTYPES = frozenset((torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8))
_FUSED_DTYPES = frozenset((torch.float32, torch.float64))


def _fast_cpu_call(logits, targets, reduction) -> bool:
    """Whether a loss call can go straight to the C++ operator: valid CPU float32/64 (N >= 1, K >= 2)
    logits and integer targets of matching length. Attribute checks only (a few µs); anything else takes
    the validated path below, which raises the named errors (the operator checks the labels). Autocast needs
    no care: the operator has no autocast rule and its float32/64 input is used as it is."""
    if type(logits) is not torch.Tensor or type(targets) is not torch.Tensor:
        return False
    if not _extension.cpu_extension_available():  # first: the torch path pays one check only
        return False
    shape = logits.shape
    return (
        len(shape) == 2
        and targets.ndim == 1
        and shape[0] == targets.shape[0] > 0
        and shape[1] >= 2
        and logits.dtype in _FUSED_DTYPES
        and targets.dtype in _INTEGER_DTYPES
        and reduction in _extension.REDUCTION_CODES
        and logits.is_cpu  # (`.device` builds a device object: several µs here)
        and targets.is_cpu
    )


def true_class_loss(
    logits,
    targets,
    reduction,
    weight_fn,
    *,
    brier_lambda=0.0,
    runner_up=False,
    spec=None,
    ignore_index: int | None = IGNORE_INDEX,
    soft_refusal=None,
    weight=None,
    label_smoothing=0.0,
):
    """A p_t-only loss: the C++ operator on CPU when built and the loss describes itself with a
    :class:`~torchcal.functional._spec.LossSpec` (``spec``, which then carries the runner-up and Brier options
    too); :class:`~torchcal.functional._true_class.TrueClassLoss` with ``weight_fn`` otherwise, and
    :class:`~torchcal.functional._true_class.SoftTargetLoss` for soft targets and label smoothing (unless
    ``soft_refusal`` says why the loss refuses them; losses with a runner-up always refuse them).
    (N, K, d1, ...) inputs, labels equal to ``ignore_index`` and class ``weight`` go through
    :func:`~torchcal.functional._loss_inputs.loss_rows` and
    :func:`~torchcal.functional._loss_inputs.reduce_rows` (decisions 73 and 96)."""
    if runner_up:  # the dual focal form: the soft-target path has no runner-up
        soft_refusal = _RUNNER_UP_NEEDS_LABELS
    plain = weight is None and not label_smoothing
    # (not while torch.compile traces: the fallback on ignored labels needs the operator's error)
    if (
        plain
        and spec is not None
        and not torch.compiler.is_compiling()
        and _fast_cpu_call(logits, targets, reduction)
    ):
        if ignore_index is None or not 0 <= ignore_index < logits.shape[1]:
            try:  # ignored labels lie outside [0, K): the operator raises on them, and nothing is lost
                return _extension.fused_true_class(logits, targets, spec, reduction)
            except ValueError:
                if ignore_index is None:
                    raise
    check_choice(reduction, "reduction", REDUCTIONS)
    eps = check_label_smoothing(label_smoothing, soft_refusal)
    rows = loss_rows(logits, targets, ignore_index, soft_refusal=soft_refusal)
    w = check_class_weight(weight, rows.logits)
    if rows.soft or eps:
        with torch.autocast(rows.logits.device.type, enabled=False):
            q = smoothed_targets(rows, eps)
            loss = SoftTargetLoss.apply(rows.logits, q, weight_fn, brier_lambda, w)
        if rows.soft or w is None:
            return reduce_rows(loss, rows, reduction)
        # labels smoothed: the weights entered each class's term; "mean" divides by the labels' weights
        keep = rows.keep
        if reduction != "mean":
            return reduce_rows(loss, rows, reduction)
        label_w = w[rows.targets]
        if keep is not None:
            loss = torch.where(keep, loss, loss.new_zeros(()))
            label_w = torch.where(keep, label_w, label_w.new_zeros(()))
        return ordered_sum(loss) / ordered_sum(label_w)
    direct = plain and rows.keep is None and len(rows.shape) == 1  # plain (N, K) rows: nothing to mask
    inner = reduction if direct else "none"
    if spec is not None and _fast_cpu_call(rows.logits, rows.targets, inner):
        loss = _extension.fused_true_class(rows.logits, rows.targets, spec, inner)
    else:
        with torch.autocast(rows.logits.device.type, enabled=False):
            loss = TrueClassLoss.apply(rows.logits, rows.targets, weight_fn, brier_lambda, runner_up)
        if direct:
            return reduce_loss(loss, reduction)
    return loss if direct else reduce_rows(loss, rows, reduction, w)


# -- losses: cross entropy plus a row-wise penalty (the margin family) -----------------------------------------


def _fast_margin_call(logits, targets, reduction) -> bool:
    """Whether a margin loss can go to the C++ operator: CPU float32/64 logits (N, K, d1, ...) with N >= 1,
    K >= 2 and no empty dimension, integer labels of shape (N, d1, ...). Attribute checks only; anything else
    (soft targets, half precision, another device) takes the caller's torch path."""
    if type(logits) is not torch.Tensor or type(targets) is not torch.Tensor:
        return False
    if not _extension.cpu_extension_available():
        return False
    shape = logits.shape
    return (
        len(shape) >= 2
        and shape[1] >= 2
        and logits.numel() > 0
        and targets.shape == (shape[0], *shape[2:])
        and logits.dtype in _FUSED_DTYPES
        and targets.dtype in _INTEGER_DTYPES
        and reduction in _extension.REDUCTION_CODES
        and logits.is_cpu
        and targets.is_cpu
    )


def penalised_cross_entropy(
    logits, targets, kind, params, ignore_index, penalty_all_rows, reduction, class_params=None, sums=None
):
    """Cross entropy plus the penalty ``kind`` of :mod:`torchcal.functional.margin` by the C++ operator
    (``params`` = [coef, the penalty's numbers]; ``penalty_all_rows``: the penalty also covers rows labelled
    ``ignore_index``), or None where it does not apply (not built or disabled, soft targets, another dtype or
    device, a label outside [0, K) that is not ``ignore_index``: the caller's torch path then computes, or
    raises the named error). The kinds with per-class numbers (CALS, Poly-1) take ``class_params`` (logits'
    dtype, csrc/margin.h) and ``sums`` (a bool: CALS's statistics); they return (loss, statistics)."""
    if not _fast_margin_call(logits, targets, reduction):
        return None
    params = [float(p) for p in params]
    if sums is None:

        def call():
            return _extension.fused_margin(logits, targets, kind, params, ignore_index, penalty_all_rows, reduction)

    else:
        if class_params is not None and (
            type(class_params) is not torch.Tensor or class_params.requires_grad or not class_params.is_cpu
        ):
            return None  # (a differentiable weight: the torch path carries its gradient)

        def call():
            return _extension.fused_margin_class(
                logits, targets, kind, params, class_params, ignore_index, penalty_all_rows, reduction, sums
            )

    if torch.compiler.is_compiling():  # (no fallback inside a graph: the operator raises on a bad label)
        return call()
    try:
        return call()
    except ValueError:
        return None


def ml1ace_cross_entropy(logits, targets, lam, options, per_image, ignore_index, reduction):
    """Cross entropy + λ·mL1-ACE of :func:`torchcal.functional.margin.ml1ace_loss` by the C++ operator
    (``options`` the checked (n_bins, binning, empty_weight, include_background, ignore_empty_classes)), or
    None where it does not apply (as :func:`penalised_cross_entropy`)."""
    if not _fast_margin_call(logits, targets, reduction):
        return None
    n_bins, binning, empty_weight, include_background, ignore_empty = options
    soft = binning == "soft"
    # (traced: made in the graph; a tensor cached while tracing would be a fake one)
    make = _ace_edges.__wrapped__ if torch.compiler.is_compiling() else _ace_edges
    edges = make(0 if soft else int(n_bins), logits.dtype)
    per_image = logits.ndim > 2 if per_image is None else bool(per_image)
    codes = [int(n_bins), int(soft), 0 if include_background else 1, int(ignore_empty), int(per_image),
             _extension.REDUCTION_CODES[reduction]]  # fmt: skip
    params = [float(lam), float(empty_weight)]
    if torch.compiler.is_compiling():
        return _extension.fused_ace(logits, targets, edges, params, codes, ignore_index)
    try:
        return _extension.fused_ace(logits, targets, edges, params, codes, ignore_index)
    except ValueError:
        return None


_FLOAT32_EPS = 1.1920928955078125e-07  # the reference's upper bin edge is 1 + float32 eps (margin.py)


@functools.lru_cache(maxsize=64)
def _ace_edges(n_bins: int, dtype: torch.dtype) -> torch.Tensor:
    """The hard bins' inner edges linspace(0, 1 + eps, M + 1)[1:-1] in ``dtype`` (n_bins 0: none, soft bins),
    made once per (M, dtype): the operator only reads them, and building them took ~10 µs of every call. Made
    outside inference mode, so that a graph recorded later can save them for its backward."""
    with torch.inference_mode(False):
        if n_bins == 0:
            return torch.empty(0, dtype=dtype)
        return torch.linspace(0, 1 + _FLOAT32_EPS, n_bins + 1, dtype=dtype)[1:-1]


def batch_rows(logits, targets, ignore_index, reduction, base, gamma, alpha, entropy, colsum):
    """The per-row numbers of the batch-term losses of :mod:`torchcal.functional.margin` by the C++ operator
    (:func:`~torchcal.functional._extension.fused_batch_rows`: base loss, r, correctness, entropy, column sums),
    or None where it does not apply (as :func:`penalised_cross_entropy`: the caller's torch path then computes,
    or raises the named error for a label outside [0, K))."""
    if not _fast_margin_call(logits, targets, reduction):
        return None
    args = (logits, targets, ignore_index, base, gamma, alpha, entropy, colsum)
    if torch.compiler.is_compiling():  # (no fallback inside a graph: the operator raises on a bad label)
        return _extension.fused_batch_rows(*args)
    try:
        return _extension.fused_batch_rows(*args)
    except ValueError:
        return None


def _synced(sync) -> bool:
    """Whether ``sync`` asks for the global batch and torch.distributed is initialised (the torch path's
    all-reduces then run)."""
    if not sync:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def batch_loss(
    logits, targets, ignore_index, reduction, term, params, *, base="nll", gamma=1.0, alpha=0.0, sync=False, held=0
) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """A whole batch-term loss of :mod:`torchcal.functional.margin` (MDCA, DCA, SB-ECE's label form, AvUC,
    S-AvUC, ESD) as one C++ autograd node (:func:`~torchcal.functional._extension.fused_batch_loss`), with
    ``held`` samples (along dimension 0) held out for ESD's term; returns (loss, the node's five float64
    numbers: AvUC's four sums, then the empty-batch flag), or None where it does not apply: no operator, the
    inputs of :func:`_fast_margin_call`, while torch.compile traces (the traced loss takes :func:`batch_rows`
    and the torch terms), ``sync`` with torch.distributed initialised, a label outside [0, K) (the caller's
    torch path raises the named error) or a base or term with no row (the torch path's 0/0 limits)."""
    if torch.compiler.is_compiling() or not _fast_margin_call(logits, targets, reduction) or _synced(sync):
        return None
    rows = targets.numel()
    split = (logits.shape[0] - held) * (rows // logits.shape[0]) if held else rows
    params = [float(p) for p in params]  # (a 0-d threshold tensor read here, once the operator applies)
    try:
        loss, stats = _extension.fused_batch_loss(
            logits, targets, ignore_index, base, gamma, alpha, term, params, reduction, split
        )
    except ValueError:
        return None
    if stats.tolist()[4]:
        return None
    return loss, stats


def sbece_label(conf, correct, kept, n_bins, temperature, sync):
    """SB-ECE's label-binned term of the (M) vectors by the C++ operator, or None where it does not apply
    (not built or disabled, another dtype or device, more than 64 bins, or ``sync`` with torch.distributed
    initialised: the global sums then need the torch path's all-reduces)."""
    if not (
        type(conf) is torch.Tensor
        and conf.dtype in _FUSED_DTYPES
        and conf.is_cpu
        and n_bins <= _extension.SBECE_MAX_BINS
        and _extension.cpu_extension_available()
    ):
        return None
    if _synced(sync):
        return None
    return _extension.fused_sbece_label(conf, correct, kept, n_bins, temperature)


# -- retired switches ----------------------------------------------------------------------------------------


def use_cpu_kernels(enabled: bool):
    """Deprecated alias of :func:`~torchcal.functional.use_cpu_extension` (the numba kernels it switched were
    retired in favour of the C++ operators; decision 65)."""
    warnings.warn(
        "use_cpu_kernels is deprecated: the numba kernels were retired; use use_cpu_extension",
        DeprecationWarning,
        stacklevel=2,
    )
    return _extension.use_cpu_extension(enabled)


def cpu_kernels_available() -> bool:
    """Deprecated alias of :func:`~torchcal.functional.cpu_extension_available` (decision 65)."""
    warnings.warn(
        "cpu_kernels_available is deprecated: the numba kernels were retired; use cpu_extension_available",
        DeprecationWarning,
        stacklevel=2,
    )
    return _extension.cpu_extension_available()
