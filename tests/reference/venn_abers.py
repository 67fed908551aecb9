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
