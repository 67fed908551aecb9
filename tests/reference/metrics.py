"""Slow, obviously correct float64 reference implementations (per-sample Python loops).

They share no code with torchcal: bins are found by comparing Python floats with m/M, equal-mass groups by
numpy.array_split, sums by plain loops.
"""

from __future__ import annotations

import math

import numpy as np


def _rows(probs):
    return [[float(v) for v in row] for row in np.asarray(probs, dtype=np.float64)]


def _top(row):
    best = 0
    for k in range(1, len(row)):
        if row[k] > row[best]:
            best = k
    return row[best], best


def equal_width_bin(value, n_bins):
    """(m/M, (m+1)/M], with 0 in bin 0, by direct comparison."""
    for m in range(n_bins):
        if value <= (m + 1) / n_bins:
            return m
    return n_bins - 1


def _binned_gaps(pairs, n_bins):
    bins = [[] for _ in range(n_bins)]
    for conf, correct in pairs:
        bins[equal_width_bin(conf, n_bins)].append((conf, correct))
    return bins


def ece(probs, targets, n_bins=15):
    pairs = [(_top(r)[0], float(_top(r)[1] == int(t))) for r, t in zip(_rows(probs), targets)]
    n = len(pairs)
    total = 0.0
    for b in _binned_gaps(pairs, n_bins):
        if b:
            acc = sum(c for _, c in b) / len(b)
            conf = sum(p for p, _ in b) / len(b)
            total += len(b) / n * abs(acc - conf)
    return total


def mce(probs, targets, n_bins=15):
    pairs = [(_top(r)[0], float(_top(r)[1] == int(t))) for r, t in zip(_rows(probs), targets)]
    worst = 0.0
    for b in _binned_gaps(pairs, n_bins):
        if b:
            acc = sum(c for _, c in b) / len(b)
            conf = sum(p for p, _ in b) / len(b)
            worst = max(worst, abs(acc - conf))
    return worst


def _equal_mass_groups(probs, targets, n_bins):
    pairs = [(_top(r)[0], float(_top(r)[1] == int(t))) for r, t in zip(_rows(probs), targets)]
    order = sorted(range(len(pairs)), key=lambda i: pairs[i][0])  # Python's sort is stable
    return [[pairs[i] for i in chunk] for chunk in np.array_split(np.array(order, dtype=int), n_bins)]


def adaece(probs, targets, n_bins=15):
    groups = _equal_mass_groups(probs, targets, n_bins)
    n = sum(len(g) for g in groups)
    total = 0.0
    for g in groups:
        if g:
            total += len(g) / n * abs(sum(c for _, c in g) / len(g) - sum(p for p, _ in g) / len(g))
    return total


def debiased(probs, targets, n_bins=15):
    groups = _equal_mass_groups(probs, targets, n_bins)
    n = sum(len(g) for g in groups)
    total = 0.0
    for g in groups:
        if len(g) < 2:
            continue
        acc = sum(c for _, c in g) / len(g)
        conf = sum(p for p, _ in g) / len(g)
        total += len(g) / n * ((conf - acc) ** 2 - acc * (1 - acc) / (len(g) - 1))
    return math.sqrt(max(total, 0.0))


def sweep(probs, targets, p=1):
    pairs = [(_top(r)[0], float(_top(r)[1] == int(t))) for r, t in zip(_rows(probs), targets)]
    order = sorted(range(len(pairs)), key=lambda i: pairs[i][0])
    n = len(pairs)

    def groups(b):
        return [[pairs[i] for i in chunk] for chunk in np.array_split(np.array(order, dtype=int), b)]

    def value(b):
        return sum(
            len(g) / n * abs(sum(c for _, c in g) / len(g) - sum(q for q, _ in g) / len(g)) ** p
            for g in groups(b)
        ) ** (1 / p)

    best = 1
    for b in range(2, n + 1):
        accs = [sum(c for _, c in g) / len(g) for g in groups(b)]
        if any(accs[i + 1] < accs[i] for i in range(len(accs) - 1)):
            break
        best = b
    return value(best), best


def classwise(probs, targets, n_bins=15):
    rows = _rows(probs)
    n, k = len(rows), len(rows[0])
    per_class = []
    for c in range(k):
        bins = [[] for _ in range(n_bins)]
        for r, t in zip(rows, targets):
            bins[equal_width_bin(r[c], n_bins)].append((r[c], float(int(t) == c)))
        total = 0.0
        for b in bins:
            if b:
                total += len(b) / n * abs(sum(y for _, y in b) / len(b) - sum(p for p, _ in b) / len(b))
        per_class.append(total)
    return sum(per_class) / k


def nll(probs, targets, tiny):
    rows = _rows(probs)
    return sum(-math.log(max(r[int(t)], tiny)) for r, t in zip(rows, targets)) / len(rows)


def brier(probs, targets):
    rows = _rows(probs)
    return sum(
        sum((p - (1.0 if k == int(t) else 0.0)) ** 2 for k, p in enumerate(r)) for r, t in zip(rows, targets)
    ) / len(rows)


def error(probs, targets):
    rows = _rows(probs)
    return sum(1.0 for r, t in zip(rows, targets) if _top(r)[1] != int(t)) / len(rows)


def s99(probs, targets, threshold=0.99):
    rows = _rows(probs)
    chosen = [(r, t) for r, t in zip(rows, targets) if _top(r)[0] >= threshold]
    frac = len(chosen) / len(rows)
    acc = sum(1.0 for r, t in chosen if _top(r)[1] == int(t)) / len(chosen) if chosen else float("nan")
    return frac, acc


def auroc(scores_neg, scores_pos):
    """P(score_pos > score_neg) + 0.5 P(equal), by counting all pairs."""
    total = 0.0
    for p in scores_pos:
        for q in scores_neg:
            total += 1.0 if p > q else (0.5 if p == q else 0.0)
    return total / (len(scores_pos) * len(scores_neg))


def entropy(row):
    return -sum(p * math.log(p) for p in row if p > 0)


def kde_canonical(probs, targets, bandwidth):
    """Leave-one-out Dirichlet-kernel canonical L1 error with an explicit double loop."""
    rows = [[max(v, 1e-12) for v in r] for r in _rows(probs)]
    rows = [[v / sum(r) for v in r] for r in rows]
    n, k = len(rows), len(rows[0])

    def log_dir(f, alpha):
        return (
            math.lgamma(sum(alpha))
            - sum(math.lgamma(a) for a in alpha)
            + sum((a - 1) * math.log(x) for a, x in zip(alpha, f))
        )

    total = 0.0
    for i in range(n):
        logs = []
        for j in range(n):
            if j != i:
                alpha = [v / bandwidth + 1 for v in rows[j]]
                logs.append((log_dir(rows[i], alpha), j))
        top = max(lk for lk, _ in logs)
        weights = [(math.exp(lk - top), j) for lk, j in logs]
        z = sum(w for w, _ in weights)
        expected = [0.0] * k
        for w, j in weights:
            expected[int(targets[j])] += w / z
        total += sum(abs(e - f) for e, f in zip(expected, rows[i]))
    return total / n


def focal_map(row, gamma):
    """Direct formula q (1-q)^-γ / (1 + γ q (-ln q)/(1-q)), normalised; 1 - q_i is the sum of the other
    entries and -ln q_i = -log1p(-(1 - q_i)), both exact in the reference's float64."""
    h = []
    for i, q in enumerate(row):
        one_minus = sum(v for j, v in enumerate(row) if j != i)
        if q == 0:
            h.append(0.0)
        else:
            neg_log = -math.log1p(-one_minus) if one_minus < 0.5 else -math.log(q)
            h.append(q * one_minus ** (-gamma) / (1 + gamma * q * neg_log / one_minus))
    s = sum(h)
    return [v / s for v in h]


def smece_at(conf, correct, sigma):
    """smECE at a fixed bandwidth with relplot's discretisation, by a direct (not FFT) convolution: samples
    spread linearly onto G = max(2000, round(20/σ))//2 + 1 grid points one by one, the grid reflected at both
    ends, convolved with the Gaussian sampled on the grid (np.convolve), read by linear interpolation at
    E = max(round(10/σ), 200) points; Σ|r̂| / Σ(δ̂ + 1e-4)."""
    g = max(2000, round(20 / sigma)) // 2 + 1
    residual, ones = [0.0] * g, [0.0] * g
    for c, y in zip(np.asarray(conf, dtype=np.float64).tolist(), np.asarray(correct).tolist()):
        pos = c * (g - 1)
        left = min(max(math.floor(pos), 0), g - 2)
        frac = pos - left
        r = c - (1.0 if y else 0.0)
        residual[left] += (1 - frac) * r
        residual[left + 1] += frac * r
        ones[left] += 1 - frac
        ones[left + 1] += frac
    kernel = [
        math.exp(-((i / (g - 1) - 0.5) ** 2) / (2 * sigma**2)) / (math.sqrt(2 * math.pi) * sigma)
        for i in range(g)
    ]
    start = g - 1 + g // 2
    smoothed = []
    for grid in (residual, ones):
        ext = grid[:0:-1] + grid + grid[-2::-1]
        smoothed.append(np.convolve(ext, kernel)[start : start + g])
    e = max(round(10 / sigma), 200)
    num = den = 0.0
    for i in range(e):
        pos = i / (e - 1) * (g - 1)
        left = min(int(pos), g - 2)
        w = pos - left
        num += abs(smoothed[0][left] * (1 - w) + smoothed[0][left + 1] * w)
        den += smoothed[1][left] * (1 - w) + smoothed[1][left + 1] * w + 1e-4
    return num / den
