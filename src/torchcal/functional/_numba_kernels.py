"""The numba kernels behind :mod:`torchcal.functional._kernels` (imported only when numba is installed).

Compiled on first use and cached on disk (``cache=True``). Single-threaded and ``nogil``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

_OPTS = {"cache": True, "nogil": True, "boundscheck": False}


@njit(fastmath={"reassoc", "contract", "nsz"}, **_OPTS)
def row_stats(row, bits):
    """Σ p and Σ p² in float64, and the maximum and minimum of the integer view of the bits.

    All four are vectorised reductions (reassociation is allowed for the sums only; the integer max/min are
    exact). Non-negative IEEE floats order as their bit patterns, so the integer maximum is the maximum
    probability; a negative minimum means a sign bit is set somewhere.
    """
    s = 0.0
    sq = 0.0
    hi = bits[0]
    lo = bits[0]
    for j in range(row.shape[0]):
        v = np.float64(row[j])
        s += v
        sq += v * v
        b = bits[j]
        hi = max(hi, b)
        lo = min(lo, b)
    return s, sq, hi, lo


@njit(**_OPTS)
def first_max(bits, hi):
    """Index of the first entry equal to ``hi``, without branches (vectorised)."""
    k = bits.shape[0]
    first = k
    for j in range(k):
        first = min(first, j if bits[j] == hi else k)
    return first


@njit(**_OPTS)
def first_max_branching(bits, hi, y):
    """Whether y is the first index holding ``hi``: branches, cheap for long rows where p_y rarely ties."""
    if bits[y] != hi:
        return False
    for j in range(y):
        if bits[j] == hi:
            return False
    return True


@njit(inline="always", **_OPTS)
def bin_index(v, m, edges):
    """Bin of a float64 value among the float64 ``edges``: (e_b, e_{b+1}], 0 in bin 0 (see _binning)."""
    b = int(v * m)
    if b > m - 1:
        b = m - 1
    if b < 0:
        b = 0
    while b > 0 and v <= edges[b]:
        b -= 1
    while b < m - 1 and v > edges[b + 1]:
        b += 1
    return b


# The two scans differ only in how the prediction is found; they are written out in full because numba
# optimises each loop best without a (even never taken) branch to the other variant inside it.


@njit(**_OPTS)
def scan_short_rows(p, bits, t, conf, conf_bits, correct, edges, top):
    """Top-label scan for short rows: the prediction from a second, branch-free pass over the row.
    Returns (largest |Σp − 1|, most negative entry or 0, any non-finite row sum, Σ p², number of labels
    outside [0, K))."""
    n, k = p.shape
    m = top.shape[1]
    worst = 0.0
    lowest = 0.0
    nonfinite = False
    total_sq = 0.0
    n_bad = 0
    for i in range(n):
        row = p[i]
        rbits = bits[i]
        # a label outside [0, K) is counted (the caller raises) and clamped, without a branch
        y = t[i]
        n_bad += (y < 0) | (y >= k)
        y = min(max(y, 0), k - 1)
        s, sq, hi, lo = row_stats(row, rbits)
        total_sq += sq
        if not math.isfinite(s):
            nonfinite = True
        d = abs(s - 1.0)
        if d > worst:
            worst = d
        if lo < 0:  # a sign bit is set: a negative entry (or −0.0, which is fine)
            for j in range(k):
                if row[j] < lowest:
                    lowest = row[j]
        hit = first_max(rbits, hi) == y
        conf_bits[i] = hi
        correct[i] = hit
        if m:
            c = np.float64(conf[i])
            b = bin_index(c, m, edges)
            top[0, b] += 1.0
            top[1, b] += c
            top[2, b] += hit
    return worst, lowest, nonfinite, total_sq, n_bad


@njit(**_OPTS)
def scan_long_rows(p, bits, t, conf, conf_bits, correct, edges, top):
    """Top-label scan for long rows: p_y compared with the maximum, ties checked on the rare tied rows."""
    n, k = p.shape
    m = top.shape[1]
    worst = 0.0
    lowest = 0.0
    nonfinite = False
    total_sq = 0.0
    n_bad = 0
    for i in range(n):
        row = p[i]
        rbits = bits[i]
        # a label outside [0, K) is counted (the caller raises) and clamped, without a branch
        y = t[i]
        n_bad += (y < 0) | (y >= k)
        y = min(max(y, 0), k - 1)
        s, sq, hi, lo = row_stats(row, rbits)
        total_sq += sq
        if not math.isfinite(s):
            nonfinite = True
        d = abs(s - 1.0)
        if d > worst:
            worst = d
        if lo < 0:  # a sign bit is set: a negative entry (or −0.0, which is fine)
            for j in range(k):
                if row[j] < lowest:
                    lowest = row[j]
        hit = first_max_branching(rbits, hi, y)
        conf_bits[i] = hi
        correct[i] = hit
        if m:
            c = np.float64(conf[i])
            b = bin_index(c, m, edges)
            top[0, b] += 1.0
            top[1, b] += c
            top[2, b] += hit
    return worst, lowest, nonfinite, total_sq, n_bad


@njit(**_OPTS)
def classwise(p, t, edges, above, col_total, true_count):
    """Classwise bin sums: float64 column totals (vectorised), entries above the first edge binned one by
    one into ``above`` = (count, p sum) of shape (2, K, M), the true class's bin counted in ``true_count``."""
    n, k = p.shape
    m = edges.shape[0] - 1
    first = edges[1]
    for i in range(n):
        row = p[i]
        for j in range(k):
            col_total[j] += row[j]
        for j in range(k):
            v = np.float64(row[j])
            if v > first:
                b = bin_index(v, m, edges)
                above[0, j, b] += 1.0
                above[1, j, b] += v
        y = t[i]
        true_count[y, bin_index(np.float64(row[y]), m, edges)] += 1.0


@njit(**_OPTS)
def spread(conf, correct, grids):
    """Linear spreading of the residual conf − correct (row 0) and of 1 (row 1) onto the G points of
    ``grids`` (2, G), as the torch path of smECE's discretisation: position c·(G − 1), left point clamped to
    [0, G − 2]."""
    g = grids.shape[1]
    for i in range(conf.shape[0]):
        c = np.float64(conf[i])
        pos = c * (g - 1)
        left = min(max(int(math.floor(pos)), 0), g - 2)
        frac = pos - left
        r = c - (1.0 if correct[i] else 0.0)
        grids[0, left] += (1.0 - frac) * r
        grids[0, left + 1] += frac * r
        grids[1, left] += 1.0 - frac
        grids[1, left + 1] += frac


@njit(**_OPTS)
def focal_forward(log_p, t, thresholds, gammas, upper_on_tie, sample_gammas, round32, tiny, loss, coef):
    """Per-sample focal loss with a signed γ (γ >= 0: −(1 − p)^γ log p; γ < 0: inverse focal
    −(1 + p)^|γ| log p) and its coefficient c = p·∂loss/∂p (as ``losses._focal_weight`` and
    ``_inverse_focal_weight``), from log-probabilities (N, K).

    γ_i is ``sample_gammas[i]`` when that array is not empty, else ``gammas[j]`` with j the number of
    ``thresholds`` below p_t (``upper_on_tie``: at or below), p_t rounded to float32 first when ``round32``
    (the thresholds hold float32-rounded values then), as the torch path compares in the input dtype.
    Returns (Σ loss, number of labels outside [0, K)); the per-sample values go to ``loss`` and ``coef``.
    """
    n, k = log_p.shape
    total = 0.0
    n_bad = 0
    per_sample = sample_gammas.shape[0] > 0
    for i in range(n):
        y = t[i]
        n_bad += (y < 0) | (y >= k)
        y = min(max(y, 0), k - 1)
        lp = np.float64(log_p[i, y])
        p = math.exp(lp)
        if per_sample:
            g = sample_gammas[i]
        else:
            pc = np.float64(np.float32(p)) if round32 else p
            j = 0
            for th in thresholds:
                j += (th <= pc) if upper_on_tie else (th < pc)
            g = gammas[j]
        if g >= 0:
            q = max(-math.expm1(lp), tiny)
            w = q**g
            loss[i] = -w * lp
            # p log p / (1 − p) → −1 as p → 1; where q is clamped (log p rounds to 0) it is 0
            coef[i] = w * (g * (p * lp / q) - 1.0)
        else:
            a = -g
            base = 1.0 + p
            w = base**a
            loss[i] = -w * lp
            coef[i] = -a * p * base ** (a - 1.0) * lp - w
        total += loss[i]
    return total, n_bad


@njit(**_OPTS)
def scale_rows(p, t, coef):
    """In place: p_ij ← −c_i p_ij + c_i [j = t_i], the gradient −c·p + c·e_t of the p_t-only losses."""
    n, k = p.shape
    for i in range(n):
        c = coef[i]
        row = p[i]
        for j in range(k):
            row[j] *= -c
        row[t[i]] += c
