"""Slow float64 reference for the inductive Venn-Abers predictor: for each test score, scikit-learn's
isotonic regression is literally refitted on the calibration pairs plus (s, 0) and plus (s, 1). It shares
no code with torchcal."""

from __future__ import annotations

import numpy as np


def ivap_interval(cal_scores, cal_labels, test_scores):
    """(p0, p1) per test score, each a float64 array: the isotonic regression (non-decreasing, tied scores
    pooled) on calibration ∪ {(s, 0)} / ∪ {(s, 1)}, evaluated at s."""
    from sklearn.isotonic import IsotonicRegression

    x = np.asarray(cal_scores, dtype=np.float64)
    y = np.asarray(cal_labels, dtype=np.float64)
    p0, p1 = [], []
    for s in np.asarray(test_scores, dtype=np.float64):
        for label, out in ((0.0, p0), (1.0, p1)):
            iso = IsotonicRegression(out_of_bounds="clip").fit(np.append(x, s), np.append(y, label))
            out.append(float(iso.predict([s])[0]))
    return np.array(p0), np.array(p1)


def ivap_one_vs_all(cal_probs, cal_targets, test_probs):
    """Multiclass IVAP, one-vs-all: class k on (p_k, 1[y = k]); merged p1 / (1 − p0 + p1), then divided by
    the row sum. Returns (probabilities, p0, p1), each (n, K)."""
    cal_probs, test_probs = np.asarray(cal_probs, np.float64), np.asarray(test_probs, np.float64)
    cal_targets = np.asarray(cal_targets)
    k = cal_probs.shape[1]
    p0 = np.zeros((len(test_probs), k))
    p1 = np.zeros((len(test_probs), k))
    for c in range(k):
        p0[:, c], p1[:, c] = ivap_interval(cal_probs[:, c], cal_targets == c, test_probs[:, c])
    merged = p1 / (1 - p0 + p1)
    return merged / merged.sum(1, keepdims=True), p0, p1


def minmax_tables(sorted_scores, labels):
    """(p0, p1) at every boundary between distinct sorted calibration scores (positions 0..N where a test
    score can be inserted), straight from the min-max formula of the isotonic regression with the test point
    added: p[i] = max over boundaries a ≤ i of min over boundaries b ≥ i of (S_b − S_a + label) / (b − a + 1),
    S the cumulative label counts. O(N²) per position; returns {position: (p0, p1)} with exact fractions."""
    from fractions import Fraction

    x = np.asarray(sorted_scores, dtype=np.float64)
    y = [int(v) for v in labels]
    n = len(x)
    cum = [0]
    for v in y:
        cum.append(cum[-1] + v)
    bounds = [j for j in range(n + 1) if j in (0, n) or x[j - 1] < x[j]]
    out = {}
    for i in bounds:
        pair = []
        for extra in (0, 1):
            pair.append(
                max(
                    min(Fraction(cum[b] - cum[a] + extra, b - a + 1) for b in bounds if b >= i)
                    for a in bounds
                    if a <= i
                )
            )
        out[i] = tuple(pair)
    return out


def threshold_value(sorted_scores, labels, position, extra, iterations=80):
    """p0 (``extra`` = 0) or p1 (``extra`` = 1) at one insertion ``position``, by bisection on v: the isotonic
    value exceeds v exactly when min_{b ≥ i} G(b) − min_{a ≤ i} G(a) + extra − v > 0 with G(j) = S_j − v·j
    over the boundaries (the min-max formula with its ratios cleared of their positive denominators; the
    left side falls strictly as v rises). O(N) per step; accurate to the float64 rounding of G, ~N·1e-16."""
    x = np.asarray(sorted_scores, dtype=np.float64)
    n = len(x)
    cum = np.concatenate([[0.0], np.cumsum(np.asarray(labels, dtype=np.float64))])
    bound = np.ones(n + 1, dtype=bool)
    bound[1:-1] = x[1:] > x[:-1]
    pos = np.arange(n + 1, dtype=np.float64)
    lo, hi = 0.0, 1.0
    for _ in range(iterations):
        v = (lo + hi) / 2
        g = np.where(bound, cum - v * pos, np.inf)
        if g[position:].min() - g[: position + 1].min() + extra - v > 0:
            lo = v
        else:
            hi = v
    return (lo + hi) / 2


def minmax_tables_dense(sorted_scores, labels):
    """(p0, p1) at every boundary position, the min-max formula evaluated over all (a, b) pairs at once:
    R[a, b] = (S_b − S_a + label) / (b − a + 1) on boundaries a ≤ b, a suffix minimum over b, then a
    maximum over a ≤ i. O(N²) time and memory (numpy, float64); entries at non-boundary positions are NaN."""
    x = np.asarray(sorted_scores, dtype=np.float64)
    n = len(x)
    cum = np.concatenate([[0.0], np.cumsum(np.asarray(labels, dtype=np.float64))])
    bound = np.ones(n + 1, dtype=bool)
    bound[1:-1] = x[1:] > x[:-1]
    idx = np.arange(n + 1)
    pair = bound[:, None] & bound[None, :] & (idx[None, :] >= idx[:, None])
    out = []
    for extra in (0.0, 1.0):
        with np.errstate(divide="ignore", invalid="ignore"):
            r = (cum[None, :] - cum[:, None] + extra) / (idx[None, :] - idx[:, None] + 1)
        r = np.where(pair, r, np.inf)
        inner = np.minimum.accumulate(r[:, ::-1], axis=1)[:, ::-1]  # min over b ≥ i, per a
        inner = np.where(bound[:, None] & (idx[:, None] <= idx[None, :]), inner, -np.inf)
        value = inner.max(axis=0)  # max over a ≤ i
        out.append(np.where(bound, value, np.nan))
    return out[0], out[1]
