"""The numba kernels behind :mod:`torchcal.functional._kernels` (imported only when numba is installed).

Compiled on first use and cached on disk (``cache=True``). Each call is single-threaded and ``nogil``
(the caller may run row parts in threads).
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
def first_equal(row, value):
    """Index of the first entry equal to ``value`` (present), without branches (vectorised)."""
    k = row.shape[0]
    first = k
    for j in range(k):
        first = min(first, j if row[j] == value else k)
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


@njit(**_OPTS)
def is_first_max(bits, hi, y):
    """Whether y is the first index holding ``hi``, from one more branch-free pass (short rows, where
    mispredicted branches cost more than the pass)."""
    return first_equal(bits, hi) == y


def _make_scan(is_hit):
    """The top-label scan with its predictor bound at compile time (see below)."""

    @njit(**_OPTS)
    def scan(p, bits, t, conf, conf_bits, correct, edges, top):
        """Top-label scan: validation statistics, confidence (from the bits of the row maximum), correctness
        ``is_hit(bits, hi, y)`` (:func:`is_first_max` for short rows, :func:`first_max_branching` for long ones;
        numba compiles one loop per predictor) and, with ``top`` of shape (3, M), the equal-width bin sums.
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
            hit = is_hit(rbits, hi, y)
            conf_bits[i] = hi
            correct[i] = hit
            if m:
                c = np.float64(conf[i])
                b = bin_index(c, m, edges)
                top[0, b] += 1.0
                top[1, b] += c
                top[2, b] += hit
        return worst, lowest, nonfinite, total_sq, n_bad

    return scan


# The predictor is bound when the scan is compiled: numba specialises the loop on it (as fast as a
# hand-written copy), and a function passed from Python would cost ~15 µs of dispatch per call. Closures
# cache separately because numba's cache key includes their captured values.
scan_short_rows = _make_scan(is_first_max)
scan_long_rows = _make_scan(first_max_branching)


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


# params of true_class_forward (float64): indices into one small array, so that the dispatcher unboxes few
# arguments (its per-argument cost shows at batch sizes of a few hundred)
P_ROUND32, P_TINY, P_UPPER, P_DUAL, P_MARGIN, P_NLL, P_CAL, P_CAL_LAMBDA, P_BRIER = range(9)
# rows of its per-sample output
O_LOSS, O_CT, O_CJ, O_J, O_SQ = range(5)


@njit(fastmath={"nnan", "nsz", "reassoc"}, **_OPTS)
def masked_max(row, below, floor):
    """max(floor, max of the entries < ``below``), vectorised (NaN-free: log-softmax of finite logits)."""
    best = floor
    for j in range(row.shape[0]):
        v = row[j]
        best = max(best, v if v < below else floor)
    return best


@njit(**_OPTS)
def true_class_forward(log_p, p, t, thresholds, gammas, sample_gammas, params, floor, out):
    """Per-sample loss and coefficients of the p_t-only losses, as ``losses._TrueClassLoss`` with the weight
    functions of ``losses`` (focal, inverse focal, dual focal, Brier term), all in float64.

    γ_i is ``sample_gammas[i]`` when that array is not empty, else ``gammas[j]`` with j the number of
    ``thresholds`` below the selection value (at or below with P_UPPER): p_t, or the margin p_t − p_j with
    P_MARGIN, computed in float32 first when P_ROUND32 (the thresholds hold float32-rounded values then), as
    the torch path compares in the input dtype. With P_CAL, γ = exp(λ(p_t − gammas[j])) (CalFocal eq. 2,
    ``gammas`` holding the bins' accuracies). γ >= 0: focal −(1 − p_t)^γ log p_t, or with P_DUAL the dual
    form −(1 − p_t + p_j)^γ log p_t where p_j is the largest probability strictly below p_t (0 if none);
    γ < 0: inverse focal −(1 + p_t)^|γ| log p_t. P_NLL = 0 drops that term (Brier loss). P_BRIER = λ adds
    λ·(Σ p² − 2 p_t + 1), Σ p² taken from ``p`` = exp(log p) (unused otherwise).

    ``floor`` (in the dtype of ``log_p``) is below every finite log-probability: entries at or below it
    (−inf: p underflowed to 0) never count as a runner-up, which changes nothing since their p_j is 0.
    Writes loss, c_t = p_t ∂loss/∂p_t, c_j = p_j ∂loss/∂p_j, j and Σ p² per sample into ``out`` (5, N) and
    returns (Σ loss, number of labels outside [0, K)).
    """
    n, k = log_p.shape
    round32 = params[P_ROUND32] != 0
    tiny = params[P_TINY]
    upper = params[P_UPPER] != 0
    dual = params[P_DUAL] != 0
    margin = params[P_MARGIN] != 0
    nll = params[P_NLL] != 0
    cal = params[P_CAL] != 0
    cal_lambda = params[P_CAL_LAMBDA]
    lam = params[P_BRIER]
    per_sample = sample_gammas.shape[0] > 0
    total = 0.0
    n_bad = 0
    for i in range(n):
        y = t[i]
        n_bad += (y < 0) | (y >= k)
        y = min(max(y, 0), k - 1)
        row = log_p[i]
        lpt = row[y]
        lp = np.float64(lpt)
        p_t = math.exp(lp)
        p_j = 0.0
        jj = 0
        if dual:  # runner-up: the largest entry strictly below p_t (ties with p_t excluded), no sort
            best = masked_max(row, lpt, floor)
            if best > floor:  # else no entry below p_t: p_j = 0
                jj = first_equal(row, best)
                p_j = math.exp(np.float64(best))
        if per_sample:
            g = sample_gammas[i]
        else:
            if round32:
                sel = np.float64(np.float32(p_t) - np.float32(p_j)) if margin else np.float64(np.float32(p_t))
            else:
                sel = p_t - p_j if margin else p_t
            b = 0
            for th in thresholds:
                b += (th <= sel) if upper else (th < sel)
            g = gammas[b]
            if cal:
                g = math.exp(cal_lambda * (sel - g))
        loss = 0.0
        c_t = 0.0
        c_j = 0.0
        if nll:
            if g >= 0 and dual:
                base = max(-math.expm1(lp) + p_j, tiny)
                w = base**g
                g_log = g * w * lp / base
                loss = -w * lp
                c_t = g_log * p_t - w
                c_j = -g_log * p_j
            elif g >= 0:
                q = max(-math.expm1(lp), tiny)
                w = q**g
                loss = -w * lp
                # p log p / (1 − p) → −1 as p → 1; where q is clamped (log p rounds to 0) it is 0
                c_t = w * (g * (p_t * lp / q) - 1.0)
            else:
                a = -g
                base = 1.0 + p_t
                w = base**a
                loss = -w * lp
                c_t = -a * p_t * base ** (a - 1.0) * lp - w
        sq = 0.0
        if lam != 0:
            prow = p[i]
            for j in range(k):
                v = np.float64(prow[j])
                sq += v * v
            loss += lam * (sq - 2.0 * p_t + 1.0)
        out[O_LOSS, i] = loss
        out[O_CT, i] = c_t
        out[O_CJ, i] = c_j
        out[O_J, i] = jj
        out[O_SQ, i] = sq
        total += loss
    return total, n_bad


@njit(**_OPTS)
def true_class_backward(p, t, out, scale, lam, grad):
    """grad = −(c_t + c_j)·p + c_t e_t + c_j e_j, plus λ·(2p⊙(p − Σp² + p_t) − 2p_t e_t) for the Brier
    term, every row scaled by ``scale`` (the incoming gradient): the backward of ``_TrueClassLoss``."""
    n, k = p.shape
    for i in range(n):
        s = scale[i]
        c_t = out[O_CT, i] * s
        c_j = out[O_CJ, i] * s
        j = int(out[O_J, i])
        y = t[i]
        prow = p[i]
        grow = grad[i]
        row = c_t + c_j
        if lam != 0:
            w = 2.0 * lam * s
            p_t = np.float64(prow[y])
            a = w * (p_t - out[O_SQ, i]) - row
            for m in range(k):
                v = np.float64(prow[m])
                grow[m] = v * (a + w * v)
            grow[y] += c_t - w * p_t
        else:
            for m in range(k):
                grow[m] = -row * prow[m]
            grow[y] += c_t
        grow[j] += c_j
