"""Optional fused CPU kernels (numba) for the metrics' scans and the training losses.

The torch path needs several passes over an (N, K) probability matrix: row sums and minimum for validation,
an index-returning ``max(dim=1)`` (slow on CPU for short rows), ``bucketize`` and ``bincount``. With numba
installed (``pip install "torchcal[fast]"``), one compiled pass over each row does all of it: the row sum,
the sign check and the maximum run as vectorised reductions (the maximum on the integer view of the float
bits, which orders non-negative IEEE floats exactly as their values), the prediction is the first index
holding the maximum (ties go to the lowest class index), and the confidence is binned on the spot with the
exact float64 edges of ``_binning``. Classwise bin sums, Σ p² and smECE's grid have kernels too. The
focal-family losses keep torch's vectorised ``log_softmax``/``exp`` and fuse everything else
(:class:`FusedTrueClass`).

The kernels release the GIL; the metric scans split large inputs into row parts run on a small thread pool
(no numba threading layer: safe under fork, DataLoader workers and DDP). They run only for contiguous
float32 / float64 CPU tensors; everything else, and everything when numba is missing or
disabled (``TORCHCAL_NUMBA=0`` or :func:`use_cpu_kernels`), takes the torch path. Both paths follow the same
conventions and are tested against the same float64 references.
"""

from __future__ import annotations

import contextlib
import math
import os
from functools import lru_cache

import numpy as np
import torch

from .._validation import label_range_error

__all__ = ["cpu_kernels_available", "use_cpu_kernels"]


def env_enabled(name: str) -> bool:
    """False when the environment variable ``name`` is 0, false, no or off (any case); True otherwise."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


@contextlib.contextmanager
def switched(state: dict, enabled: bool):
    """Sets ``state["enabled"]`` for the duration of a ``with`` block (the body of :func:`use_cpu_kernels`
    and :func:`~torchcal.functional.use_cpu_extension`)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"`enabled` must be a bool, got {type(enabled).__name__}")
    previous = state["enabled"]
    state["enabled"] = enabled
    try:
        yield
    finally:
        state["enabled"] = previous


_state = {"enabled": env_enabled("TORCHCAL_NUMBA")}


@lru_cache(maxsize=1)
def _compiled():
    """The jitted kernels, or None when numba cannot be imported."""
    try:
        from . import _numba_kernels
    except ImportError:
        return None
    return _numba_kernels


def cpu_kernels_available() -> bool:
    """True when numba is importable and the kernels are enabled (``TORCHCAL_NUMBA`` unset or not 0).

    Example:
        >>> from torchcal.functional import cpu_kernels_available, use_cpu_kernels
        >>> with use_cpu_kernels(False):
        ...     cpu_kernels_available()
        False
    """
    return _state["enabled"] and _compiled() is not None


def use_cpu_kernels(enabled: bool):
    """Context manager that switches the numba CPU kernels on or off, process-wide (e.g. to compare both
    paths, or to take higher-order gradients of a loss).

    Example:
        >>> import torch
        >>> from torchcal.functional import expected_calibration_error, use_cpu_kernels
        >>> probs, targets = torch.tensor([[0.9, 0.1], [0.6, 0.4]]), torch.tensor([0, 1])
        >>> with use_cpu_kernels(False):
        ...     torch_path = expected_calibration_error(probs, targets)
        >>> bool(torch_path == expected_calibration_error(probs, targets))
        True
    """
    return switched(_state, enabled)


_BITS = {torch.float32: np.int32, torch.float64: np.int64}
# Up to this many classes the prediction is found with a branch-free pass (mispredicted branches cost more).
_SHORT_ROWS = 32


def applies(probs: torch.Tensor) -> bool:
    """Whether the kernels handle this tensor (enabled, numba present, contiguous float32/64 on CPU)."""
    return (
        _state["enabled"]
        and probs.device.type == "cpu"
        and probs.dtype in _BITS
        and probs.is_contiguous()
        and _compiled() is not None
    )


def top_label_scan(probs, targets, n_bins=None, classwise_bins=None, threshold=None):
    """One pass over contiguous CPU ``probs`` (N, K) and integer ``targets`` (N,) (the pass checks their range).

    Returns ``(conf, correct, worst, lowest, nonfinite, top, classwise, sum_sq, sums)``: top-label confidence
    (in the input dtype) and correctness (bool) tensors; the largest |row sum − 1|, the most negative entry
    (0.0 if none) and whether any row sum is not finite; the top-label equal-width (count, conf sum, correct
    sum) float64 tensors of shape (n_bins,) (None without ``n_bins``); the classwise (count, p sum, [y = k]
    sum), each (K, classwise_bins) float64 (None without ``classwise_bins``); Σ_ik p_ik² in float64; and the
    per-sample sums of :class:`torchcal.functional._binning.ScanSums`, which the C++ scan computes on request
    (``threshold``) and this one never (None: the caller computes them with torch).
    """
    kernels = _compiled()
    p = probs.detach().numpy()
    n, k = p.shape
    bits = p.view(_BITS[probs.dtype])
    t = targets.detach().numpy()
    if t.dtype != np.int64:
        t = t.astype(np.int64)
    conf = np.empty(n, dtype=p.dtype)
    conf_bits = conf.view(bits.dtype)
    correct = np.empty(n, dtype=np.bool_)
    m = n_bins or 0
    edges = _edges(m)
    bounds = _row_parts(n, k)
    parts = len(bounds) - 1
    tops = np.zeros((parts, 3, m), dtype=np.float64)
    scan = kernels.scan_short_rows if k <= _SHORT_ROWS else kernels.scan_long_rows

    def scan_part(i):
        a, b = bounds[i], bounds[i + 1]
        return scan(p[a:b], bits[a:b], t[a:b], conf[a:b], conf_bits[a:b], correct[a:b], edges, tops[i])

    stats = _in_threads(scan_part, parts)
    if sum(s[4] for s in stats):
        raise label_range_error(t, k)
    worst = max(s[0] for s in stats)
    lowest = min(s[1] for s in stats)
    nonfinite = any(s[2] for s in stats)
    sum_sq = math.fsum(s[3] for s in stats)
    top = tops.sum(0) if parts > 1 else tops[0]
    top_t = tuple(torch.from_numpy(top[i]) for i in range(3)) if m else None
    cw_t = None
    if classwise_bins:
        mc = classwise_bins
        cw_edges = _edges(mc)
        above = np.zeros((parts, 2, k, mc), dtype=np.float64)
        col_total = np.zeros((parts, k), dtype=np.float64)
        true_count = np.zeros((parts, k, mc), dtype=np.float64)

        def classwise_part(i):
            a, b = bounds[i], bounds[i + 1]
            kernels.classwise(p[a:b], t[a:b], cw_edges, above[i], col_total[i], true_count[i])

        _in_threads(classwise_part, parts)
        above, col_total, true_count = above.sum(0), col_total.sum(0), true_count.sum(0)
        # bin 0 gets the rest of each column, as in _binning._ClasswiseAccumulator
        above[0, :, 0] = n - above[0, :, 1:].sum(1)
        above[1, :, 0] = np.maximum(col_total - above[1, :, 1:].sum(1), 0.0)
        cw_t = (torch.from_numpy(above[0]), torch.from_numpy(above[1]), torch.from_numpy(true_count))
    return (
        torch.from_numpy(conf),
        torch.from_numpy(correct),
        float(worst),
        float(lowest),
        bool(nonfinite),
        top_t,
        cw_t,
        float(sum_sq),
        None,
    )


def spread_on_grid(conf: torch.Tensor, correct: torch.Tensor, g: int) -> torch.Tensor:
    """(2, G) float64: residual conf − correct and 1 spread linearly onto G grid points (smECE, relplot)."""
    grids = np.zeros((2, g), dtype=np.float64)
    _compiled().spread(conf.detach().numpy(), correct.detach().numpy(), grids)
    return torch.from_numpy(grids)


# Smallest share of an (N, K) scan worth a thread of its own (thread hand-off costs ~20-40 µs).
_MIN_PART_ELEMENTS = 1 << 15
_pool_state = {"pid": None, "pool": None, "workers": 0}


def _row_parts(n: int, k: int) -> list[int]:
    """Row boundaries splitting N rows into up to ``torch.get_num_threads()`` parts of about
    _MIN_PART_ELEMENTS entries or more (one part for small inputs). Per-part sums are added in part order, so
    results are deterministic for a given thread setting."""
    parts = max(1, min(torch.get_num_threads(), (n * k) // _MIN_PART_ELEMENTS, n))
    # part 0 runs on the calling thread, which starts first (a pool thread takes ~20-40 µs to wake):
    # it gets 1.5 shares, the others 1
    total = parts + 0.5
    return [0] + [min(n, int(n * (i + 0.5) / total)) for i in range(1, parts)] + [n]


def _in_threads(fn, parts: int) -> list:
    """[fn(0), ..., fn(parts − 1)]: part 0 on the calling thread, the others on a process-local thread pool
    (the kernels release the GIL). The pool is rebuilt after a fork."""
    if parts == 1:
        return [fn(0)]
    from concurrent.futures import ThreadPoolExecutor

    state = _pool_state
    if state["pid"] != os.getpid() or state["workers"] < parts - 1:
        if state["pid"] == os.getpid():  # grown: let the smaller pool's threads finish and exit
            state["pool"].shutdown(wait=False)
        state.update(
            pid=os.getpid(), pool=ThreadPoolExecutor(parts - 1, "torchcal-kernel"), workers=parts - 1
        )
    futures = [state["pool"].submit(fn, i) for i in range(1, parts)]
    first = fn(0)
    return [first] + [f.result() for f in futures]


@lru_cache(maxsize=16)
def _edges(m: int) -> np.ndarray:
    """The float64 edges m/M of _binning (read-only; a dummy pair when M = 0)."""
    edges = np.arange(max(m, 1) + 1, dtype=np.float64) / max(m, 1)
    edges.flags.writeable = False
    return edges


# Largest N·K for which the fused focal-family losses run: beyond it the torch path's multi-threaded
# (N, K) passes win and the per-op overhead these kernels remove no longer matters.
_LOSS_MAX_ELEMENTS = 1 << 20


def loss_applies(logits: torch.Tensor) -> bool:
    """Whether the fused focal-family loss runs (enabled, numba, contiguous float32/64 CPU, N·K <= 2**20)."""
    return applies(logits) and logits.numel() <= _LOSS_MAX_ELEMENTS


class LossSpec:
    """What a fused p_t-only loss computes (see ``_numba_kernels.true_class_forward``).

    γ_i is ``gammas[j]`` with j the number of ``thresholds`` below the selection value (at or below with
    ``upper_on_tie``), or one γ per sample (``sample_gammas``, a tensor); negative γ means the inverse focal
    form with |γ| (the AdaFocal convention). The selection value is p_t, or p_t − p_j with ``margin``; with
    ``cal_lambda`` γ = exp(λ(p_t − gammas[j])) (CalFocal eq. 2). ``dual``: the dual focal base; ``nll=False``:
    no likelihood term; ``brier``: λ of an added Σ_k (p_k − onehot_k)² term.
    """

    __slots__ = (
        "gammas",
        "thresholds32",
        "thresholds64",
        "sample_gammas",
        "flags",
        "brier",
        "cpp_params32",
        "cpp_params64",
    )

    def __init__(
        self,
        gammas,
        thresholds=(),
        upper_on_tie=True,
        sample_gammas=None,
        *,
        dual=False,
        margin=False,
        nll=True,
        cal_lambda=None,
        brier=0.0,
    ):
        self.gammas = np.asarray(gammas, dtype=np.float64).reshape(-1)
        # the torch path compares with thresholds in the input dtype: float32-rounded copies for float32
        self.thresholds64 = np.asarray(thresholds, dtype=np.float64).reshape(-1)
        self.thresholds32 = self.thresholds64.astype(np.float32).astype(np.float64)
        self.sample_gammas = sample_gammas
        self.brier = float(brier)
        # P_UPPER, P_DUAL, P_MARGIN, P_NLL, P_CAL, P_CAL_LAMBDA, P_BRIER (P_ROUND32, P_TINY are per call)
        cal = cal_lambda is not None
        self.flags = (upper_on_tie, dual, margin, nll, cal, cal_lambda if cal else 0.0, self.brier)
        # the same packed into one float64 vector per input dtype for the C++ operator (``_extension``):
        # flags, number of thresholds, thresholds, γs
        head = np.array([*self.flags, len(self.thresholds64)], dtype=np.float64)
        self.cpp_params32 = torch.from_numpy(np.concatenate([head, self.thresholds32, self.gammas]))
        self.cpp_params64 = torch.from_numpy(np.concatenate([head, self.thresholds64, self.gammas]))


_EMPTY = np.zeros(0, dtype=np.float64)
# below every finite log-probability that log_softmax of representable logits produces
_FLOOR = {np.float32: np.float32(-3.0e38), np.float64: np.float64(-1.0e308)}
_TINY = {np.float32: float(np.finfo(np.float32).tiny), np.float64: float(np.finfo(np.float64).tiny)}


class FusedTrueClass(torch.autograd.Function):
    """Forward and backward of the p_t-only losses (focal family, dual focal, Brier term) in two numba
    calls around torch's vectorised ``log_softmax`` and ``exp``: per-sample losses and coefficients
    c = p·∂loss/∂p in float64, then the gradient −(c_t + c_j)·p + c_t e_t + c_j e_j (+ the Brier term) in one
    pass, with the reduction folded in. For small CPU batches, where the torch path's many small ops
    dominate. Differentiable once (the backward refuses ``create_graph=True``)."""

    @staticmethod
    def forward(ctx, logits, targets, spec, reduction):
        kernels = _compiled()
        log_p = torch.log_softmax(logits, 1)
        lp = log_p.detach().numpy()
        n, k = lp.shape
        t = targets.numpy()
        round32 = lp.dtype == np.float32
        # p = exp(log p) once: the Brier term's Σp² here and the whole backward need it (saved instead of log p)
        probs = log_p.exp() if spec.brier or ctx.needs_input_grad[0] else None
        p = lp[:0] if probs is None else probs.numpy()
        sample = _EMPTY
        if spec.sample_gammas is not None:
            sample = np.ascontiguousarray(spec.sample_gammas.detach().cpu().numpy(), dtype=np.float64)
        params = np.array((float(round32), _TINY[lp.dtype.type]) + spec.flags, dtype=np.float64)
        out = np.empty((5, n), dtype=np.float64)
        total, n_bad = kernels.true_class_forward(
            lp,
            p,
            t,
            spec.thresholds32 if round32 else spec.thresholds64,
            spec.gammas,
            sample,
            params,
            _FLOOR[lp.dtype.type],
            out,
        )
        if n_bad:
            raise label_range_error(t, k)
        ctx.save_for_backward(probs, targets)
        ctx.out = out
        ctx.brier = spec.brier
        ctx.reduction = reduction
        if reduction == "none":
            return torch.from_numpy(out[0].astype(lp.dtype))
        return torch.from_numpy(np.asarray(total / n if reduction == "mean" else total, dtype=lp.dtype))

    @staticmethod
    def backward(ctx, grad_loss):
        if torch.is_grad_enabled():  # backward(create_graph=True): this backward is not differentiable
            raise RuntimeError(
                "the fused CPU focal-family loss is differentiable once only; for higher-order gradients "
                "run it with torchcal.functional.use_cpu_kernels(False)"
            )
        probs, targets = ctx.saved_tensors
        n = probs.shape[0]
        if ctx.reduction == "none":
            scale = grad_loss.detach().cpu().numpy().astype(np.float64)
        else:
            scale = np.full(n, float(grad_loss) / (n if ctx.reduction == "mean" else 1))
        grad = torch.empty_like(probs)
        _compiled().true_class_backward(
            probs.numpy(), targets.numpy(), ctx.out, scale, ctx.brier, grad.numpy()
        )
        return grad, None, None, None
