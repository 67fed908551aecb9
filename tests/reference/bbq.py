"""Slow float64 reference for BBQ (Naeini et al. 2015) in the form SPEC §7 fixes: loops over the binning
models and their bins, numpy's quantiles and ``math.lgamma``. It shares no code with torchcal."""

from __future__ import annotations

import math

import numpy as np


def bbq_binary(cal_scores, cal_labels, test_scores, c=10.0, prior_strength=2.0):
    """Calibrated P(y = 1 | s) for each test score, and the models' normalised weights."""
    x = np.asarray(cal_scores, dtype=np.float64)
    y = np.asarray(cal_labels, dtype=np.float64)
    n = len(x)
    low = int(max(1, math.floor(n ** (1 / 3) / c)))
    high = max(low, int(min(math.ceil(n / 5), math.ceil(c * n ** (1 / 3)))))
    log_scores, tables = [], []
    for bins in range(low, high + 1):
        edges = np.quantile(x, np.linspace(0, 1, bins + 1))
        edges[0], edges[-1] = 0.0, 1.0
        edges = np.maximum.accumulate(edges)
        a0 = prior_strength / bins
        total, preds = 0.0, []
        for b in range(bins):
            last = b == bins - 1
            inside = (x >= edges[b]) & ((x <= edges[b + 1]) if last else (x < edges[b + 1]))
            nb, mb = int(inside.sum()), float(y[inside].sum())
            mid = (edges[b] + edges[b + 1]) / 2
            alpha = max(a0 * mid, np.finfo(np.float64).tiny)
            beta = max(a0 * (1 - mid), np.finfo(np.float64).tiny)
            total += (
                math.lgamma(a0)
                - math.lgamma(nb + a0)
                + math.lgamma(mb + alpha)
                - math.lgamma(alpha)
                + math.lgamma(nb - mb + beta)
                - math.lgamma(beta)
            )
            preds.append(mb / nb if nb else mid)
        log_scores.append(total)
        tables.append((edges, preds))
    log_scores = np.array(log_scores)
    weights = np.exp(log_scores - log_scores.max())
    weights /= weights.sum()
    out = []
    for s in np.asarray(test_scores, dtype=np.float64):
        value = 0.0
        for w, (edges, preds) in zip(weights, tables):
            b = 0
            while b < len(preds) - 1 and s >= edges[b + 1]:
                b += 1
            value += w * preds[b]
        out.append(value)
    return np.array(out), weights


def bbq_one_vs_rest(cal_probs, cal_targets, test_probs, c=10.0, prior_strength=2.0):
    """Multiclass BBQ: class k on (p_k, 1[y = k]); outputs floored at 1e-30 and divided by the row sum."""
    cal_probs, test_probs = np.asarray(cal_probs, np.float64), np.asarray(test_probs, np.float64)
    k = cal_probs.shape[1]
    out = np.zeros((len(test_probs), k))
    for j in range(k):
        out[:, j] = bbq_binary(
            cal_probs[:, j], np.asarray(cal_targets) == j, test_probs[:, j], c, prior_strength
        )[0]
    out = np.maximum(out, 1e-30)
    return out / out.sum(1, keepdims=True)
