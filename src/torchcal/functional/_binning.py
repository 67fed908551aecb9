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

import torch

# Rows per chunk when an (N, K) tensor is binned element-wise: bounds the int64 index buffer.
_CHUNK_ELEMENTS = 1 << 22


def equal_width_edges(n_bins: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """The M + 1 edges m/M, rounded down into ``dtype`` so that ``value <= edge`` is exact (see module)."""
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
    edges = equal_width_edges(n_bins, values.dtype, values.device)
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
    dev = conf.device
    count = torch.zeros(n_bins, dtype=torch.float64, device=dev)
    conf_sum = torch.zeros(n_bins, dtype=torch.float64, device=dev)
    correct_sum = torch.zeros(n_bins, dtype=torch.float64, device=dev)
    count.index_add_(0, index, torch.ones_like(conf, dtype=torch.float64))
    conf_sum.index_add_(0, index, conf.double())
    correct_sum.index_add_(0, index, correct.double())
    return count, conf_sum, correct_sum


def equal_mass_sums(conf_sorted: torch.Tensor, correct_sorted: torch.Tensor, n_bins: int):
    """Per-group sums of already sorted confidences under the equal-mass convention."""
    index = equal_mass_group_index(conf_sorted.shape[0], n_bins, conf_sorted.device)
    return bin_sums(index, n_bins, conf_sorted, correct_sorted)


def classwise_sums(probs: torch.Tensor, targets: torch.Tensor, n_bins: int):
    """Per-class, per-bin float64 sums (count, p_k sum, [y = k] sum), each of shape (K, n_bins).

    Bins are equal-width on p_ik over all samples. Rows are processed in chunks, so no (N, K) int64 or float64
    buffer is ever allocated.
    """
    n, k = probs.shape
    dev = probs.device
    size = k * n_bins
    count = torch.zeros(size, dtype=torch.float64, device=dev)
    conf_sum = torch.zeros(size, dtype=torch.float64, device=dev)
    offsets = torch.arange(k, device=dev) * n_bins
    rows = max(1, _CHUNK_ELEMENTS // k)
    true_bins = []
    for start in range(0, n, rows):
        chunk = probs[start : start + rows]
        flat = (equal_width_index(chunk, n_bins) + offsets).reshape(-1)
        count += torch.bincount(flat, minlength=size).double()
        conf_sum.index_add_(0, flat, chunk.reshape(-1).double())
        t = targets[start : start + rows]
        true_bins.append(flat.view(-1, k).gather(1, t[:, None]).squeeze(1))
    correct_sum = torch.bincount(torch.cat(true_bins), minlength=size).double()
    shape = (k, n_bins)
    return count.view(shape), conf_sum.view(shape), correct_sum.view(shape)


def top_label(probs: torch.Tensor, targets: torch.Tensor):
    """Top-label confidence and correctness: ``conf_i = max_k p_ik``, ``correct_i = [argmax_k p_ik == y_i]``.

    Ties in the maximum go to the lowest class index (``torch.max`` convention on CPU and CUDA).
    """
    conf, pred = probs.max(dim=1)
    return conf, pred == targets
