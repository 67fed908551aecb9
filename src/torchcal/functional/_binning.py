"""Bin assignment and per-bin sums: the one place where bin conventions live (SPEC §3).

Equal width: bin m of M holds values in (m/M, (m+1)/M]; bin 0 also holds 0. The edge m/M is the float64
number nearest to m/M, and a value is compared with it *as a float64 number* whatever its own dtype (for a
float32 value we compare against the largest float32 not above the float64 edge, which is equivalent and
avoids an upcast of (N, K) inputs).

Equal mass: sort by value (stable, so ties keep input order) and cut the sorted order into M contiguous
groups whose sizes differ by at most one, the larger groups first (``numpy.array_split``). With N < M the
last M - N groups are empty.

Per-bin sums are accumulated in float64.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import torch

from .._validation import row_stats

# Rows per chunk when an (N, K) tensor is binned element-wise: bounds the int64 index buffer.
_CHUNK_ELEMENTS = 1 << 22
# Rows per chunk of the top-label scan: 2**_SCAN_SHIFT entries (a cache-resident scratch buffer).
_SCAN_SHIFT = 20
# Up to this many classes torch_scan uses torch.max(dim=1) directly.
_SMALL_K = 16


def equal_width_edges(n_bins: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """The M + 1 edges m/M, rounded down into ``dtype`` so that ``value <= edge`` is exact (see module)."""
    return _edges(n_bins, dtype, torch.device(device) if device is not None else torch.device("cpu")).clone()


@lru_cache(maxsize=64)
def _edges(n_bins: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    edges64 = torch.arange(n_bins + 1, dtype=torch.float64, device=device) / n_bins
    if dtype == torch.float64:
        return edges64
    edges = edges64.to(dtype)
    too_high = edges.double() > edges64
    if bool(too_high.any()):
        lower = torch.nextafter(edges, torch.full_like(edges, -1.0))
        edges = torch.where(too_high, lower, edges)
    return edges


def equal_width_index(values: torch.Tensor, n_bins: int) -> torch.Tensor:
    """Bin index in [0, n_bins) of every value in [0, 1] (any shape): bins are (m/M, (m+1)/M], 0 in bin 0."""
    edges = _edges(n_bins, values.dtype, values.device)
    # bucketize(right=False) gives i with edges[i-1] < v <= edges[i]; interior edges suffice.
    return torch.bucketize(values, edges[1:-1], right=False)


def equal_mass_group_index(n: int, n_bins: int, device=None) -> torch.Tensor:
    """Group id of each sorted position 0..n-1 under ``numpy.array_split(range(n), n_bins)``."""
    q, r = divmod(n, n_bins)
    pos = torch.arange(n, device=device)
    head = r * (q + 1)
    if q == 0:
        return pos
    return torch.where(pos < head, pos // (q + 1), r + (pos - head) // q)


def bin_sums(index: torch.Tensor, n_bins: int, conf: torch.Tensor, correct: torch.Tensor):
    """Float64 per-bin (count, confidence sum, correct sum) of 1-D ``conf``/``correct`` by ``index``."""
    # counts of wrong and right predictions per bin from one integer bincount on 2·index + correct
    pairs = torch.bincount(index * 2 + correct.long(), minlength=2 * n_bins).view(n_bins, 2).double()
    conf_sum = torch.bincount(index, weights=conf.double(), minlength=n_bins)
    return pairs.sum(1), conf_sum, pairs[:, 1].contiguous()


def equal_mass_cuts(n: int, lo: int, hi: int, device=None):
    """(b, j, start, end) of every bin j of the equal-mass cuts of N sorted values into b bins, for each b in
    [lo, hi], flattened in that order: the first N mod b bins hold N // b + 1 values, the rest N // b."""
    bs = torch.arange(lo, hi + 1, device=device)
    b = torch.repeat_interleave(bs, bs)
    first = torch.cumsum(bs, 0) - bs  # where each b's bins begin in the flat arrays
    j = torch.arange(b.shape[0], device=device) - torch.repeat_interleave(first, bs)
    q, r = n // b, n % b
    start = j * q + torch.minimum(j, r)
    return b, j, start, start + q + (j < r).long()


def prefix_sums(conf_sorted: torch.Tensor, correct_sorted: torch.Tensor):
    """Float64 prefix sums, with a leading 0 (length N + 1), of sorted confidences and of their correctness:
    the sums over any run of the sorted order are one difference. AdaECE, debiased ECE and the ECE sweep share
    them (:meth:`torchcal.metrics.CalibrationMetrics.compute` computes them once)."""
    n = conf_sorted.shape[0]
    out = torch.zeros(2, n + 1, dtype=torch.float64, device=conf_sorted.device)
    torch.cumsum(conf_sorted, 0, dtype=torch.float64, out=out[0, 1:])
    torch.cumsum(correct_sorted, 0, dtype=torch.float64, out=out[1, 1:])
    return out[0], out[1]


def equal_mass_sums(conf_sorted: torch.Tensor, correct_sorted: torch.Tensor, n_bins: int, prefix=None):
    """Float64 per-group (count, confidence sum, correct sum) of already sorted confidences under the
    equal-mass convention (the first r = N mod M groups hold N // M + 1 values, the rest N // M), as
    differences of the :func:`prefix_sums` (pass ``prefix`` to reuse them). The correct sums are exact
    (integers below 2^53); a confidence sum's rounding is that of the running total, ~1e-16 of N."""
    c_conf, c_corr = prefix_sums(conf_sorted, correct_sorted) if prefix is None else prefix
    count, start, end = _equal_mass_bounds(conf_sorted.shape[0], n_bins, c_conf.device)
    return count.clone(), c_conf[end] - c_conf[start], c_corr[end] - c_corr[start]


@lru_cache(maxsize=64)
def _equal_mass_bounds(n: int, n_bins: int, device: torch.device):
    """(count float64, start, end) of the n_bins equal-mass groups of N sorted values (cached: a handful of
    small ops that would otherwise cost more than the sums at N = 10k)."""
    _, _, start, end = equal_mass_cuts(n, n_bins, n_bins, device)
    return (end - start).double(), start, end


class _ClasswiseAccumulator:
    """Per-class bin sums of entries above the first edge 1/M, and float64 column totals, chunk by chunk."""

    def __init__(self, k, n_bins, dtype, device):
        self.n_bins = n_bins
        self.count = torch.zeros(k * n_bins, dtype=torch.float64, device=device)
        self.conf_sum = torch.zeros(k * n_bins, dtype=torch.float64, device=device)
        self.col_total = torch.zeros(k, dtype=torch.float64, device=device)
        self.first_edge = _edges(n_bins, dtype, device)[1]

    def add(self, chunk):
        self.col_total += chunk.sum(0, dtype=torch.float64)
        r, c = (chunk > self.first_edge).nonzero(as_tuple=True)
        if r.numel():
            values = chunk[r, c]
            flat = c * self.n_bins + equal_width_index(values, self.n_bins)
            self.count.index_add_(0, flat, torch.ones_like(values, dtype=torch.float64))
            self.conf_sum.index_add_(0, flat, values.double())

    def finish(self, probs, targets):
        n, k = probs.shape
        m = self.n_bins
        count = self.count.view(k, m)
        conf_sum = self.conf_sum.view(k, m)
        count[:, 0] = n - count[:, 1:].sum(1)
        conf_sum[:, 0] = (self.col_total - conf_sum[:, 1:].sum(1)).clamp(min=0)
        p_true = probs.gather(1, targets[:, None]).squeeze(1)
        true_flat = targets * m + equal_width_index(p_true, m)
        correct_sum = torch.bincount(true_flat, minlength=k * m).double().view(k, m)
        return count, conf_sum, correct_sum


def classwise_sums(probs: torch.Tensor, targets: torch.Tensor, n_bins: int, accumulator=None):
    """Per-class, per-bin float64 sums (count, p_k sum, [y = k] sum), each of shape (K, n_bins).

    Bins are equal-width on p_ik over all samples. Only entries above the first edge 1/M are binned
    individually (at most M − 1 per row, since a row sums to 1); bin 0 of each class gets the rest of the
    column total (summed in float64). Rows are processed in chunks of at most 4M entries, so no (N, K) int64
    or float64 buffer is ever allocated. ``accumulator`` may carry sums already gathered by
    :func:`torch_scan` (the same pass as the top-label statistics).
    """
    n, k = probs.shape
    if accumulator is None:
        accumulator = _ClasswiseAccumulator(k, n_bins, probs.dtype, probs.device)
        rows = max(1, _CHUNK_ELEMENTS // k)
        for start in range(0, n, rows):
            accumulator.add(probs[start : start + rows])
    return accumulator.finish(probs, targets)


class ScanSums(NamedTuple):
    """Per-sample sums of one pass, on request (``threshold``): float64 Σ −log max(p_y, tiny) and Σ p_y, and
    the counts of correct predictions, of confidences >= the threshold and of those correct. Python floats
    from the C++ scan (its log in float64); 0-d float64 tensors on the input's device from torch ops
    (:func:`torchcal._validation.scan_inputs`; the log in the input dtype)."""

    nll: float | torch.Tensor
    p_true: float | torch.Tensor
    correct: float | torch.Tensor
    confident: float | torch.Tensor
    confident_correct: float | torch.Tensor


class Scan(NamedTuple):
    """Result of :func:`torch_scan`."""

    conf: torch.Tensor  # top-label confidence (N,), input dtype
    correct: torch.Tensor  # argmax == target (N,), bool (ties: the lowest index is the prediction)
    stats: tuple  # (largest |row sum − 1|, most negative entry or 0.0, any row sum not finite)
    classwise: object  # object with .finish(probs, targets) -> classwise sums, or None
    top: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # top-label equal-width (count, conf sum, correct sum) with ``n_bins``, else None
    sum_sq: float | None = None  # Σ_ik p_ik² in float64 (fused path only)
    sums: ScanSums | None = None  # with ``threshold`` (scan_inputs fills them on every path)
    # each row's top-label bin (N,) int64: the torch path with ``n_bins``, the C++ one on request
    bins: torch.Tensor | None = None
    # per top-label bin Σ P_i and Σ onehot(y_i), float64 (2, n_bins, K): the C++ scan on request, else None
    vectors: torch.Tensor | None = None


class _FinishedClasswise:
    def __init__(self, sums):
        self.sums = sums

    def finish(self, probs, targets):
        return self.sums


def torch_scan(
    probs: torch.Tensor,
    targets: torch.Tensor,
    classwise_bins: int | None = None,
    n_bins: int | None = None,
) -> Scan:
    """The torch implementation of the top-label scan (:func:`torchcal.functional._backend.scan` picks it
    or the C++ one): the top-label confidence and correctness, the validation statistics and, on request,
    the top-label equal-width bin sums (``n_bins``) and the classwise bin sums of :func:`classwise_sums`
    (``classwise_bins``). It leaves ``sums`` None (the per-sample sums come from torch ops in
    :func:`torchcal.functional._inputs.scan_inputs`) and does not check the label range.

    Rows are copied chunk by chunk into a small cache-resident scratch buffer, where the row sums, the
    minimum (for validation) and the maximum over the other classes are taken; memory is read once. This
    avoids ``torch.max(dim=1)``, whose index-returning reduction is 4-6x slower on CPU than ``amax``: the
    true class is the argmax iff p_true > max_{j != y} p_j, the confidence is max(p_true, that maximum), and
    rows where p_true ties it are resolved with an exact ``argmax`` (lowest index wins) on those rows only.
    """
    n, k = probs.shape
    acc = (
        None
        if classwise_bins is None
        else _ClasswiseAccumulator(k, classwise_bins, probs.dtype, probs.device)
    )
    if k <= _SMALL_K:  # short rows: the index-returning max is cheap enough, three plain reductions win
        conf, pred = probs.max(dim=1)
        if acc is not None:
            rows = max(1, _CHUNK_ELEMENTS // k)
            for start in range(0, n, rows):
                acc.add(probs[start : start + rows])
        correct = pred == targets
        stats = row_stats(probs.sum(dim=1), probs.amin())
    else:
        rows = min(n, max(1, (1 << _SCAN_SHIFT) // k))
        scratch = torch.empty(rows, k, dtype=probs.dtype, device=probs.device)
        others = torch.empty(n, dtype=probs.dtype, device=probs.device)
        row_sums = torch.empty_like(others)
        mins = []
        for s in range(0, n, rows):
            m = min(rows, n - s)
            buf = scratch[:m]
            buf.copy_(probs[s : s + m])
            torch.sum(buf, dim=1, out=row_sums[s : s + m])
            mins.append(buf.amin())
            if acc is not None:
                acc.add(buf)
            buf.scatter_(1, targets[s : s + m, None], -math.inf)
            torch.amax(buf, dim=1, out=others[s : s + m])
        p_true = probs.gather(1, targets[:, None]).squeeze(1)
        conf = torch.maximum(p_true, others)
        correct = p_true > others
        tied = (p_true == others).nonzero().squeeze(1)
        if tied.numel():
            correct[tied] = probs[tied].argmax(dim=1) == targets[tied]
        stats = row_stats(row_sums, torch.stack(mins).amin())
    bins = top = None
    if n_bins is not None:
        bins = equal_width_index(conf, n_bins)
        top = bin_sums(bins, n_bins, conf, correct)
    return Scan(conf, correct, stats, acc, top, bins=bins)
