"""Slow float64 references (Python loops) for the metrics of SPEC §9: direction of the ECE, decompositions,
KS/Kuiper, selective prediction, OOD, conformal scores and sets. They share no code with torchcal."""

from __future__ import annotations

import math

import numpy as np


def _rows(probs):
    return [[float(v) for v in row] for row in np.asarray(probs, dtype=np.float64)]


def top(row):
    best = 0
    for k in range(1, len(row)):
        if row[k] > row[best]:
            best = k
    return row[best], best


def top_pairs(probs, targets):
    out = []
    for row, t in zip(_rows(probs), targets):
        conf, pred = top(row)
        out.append((conf, 1.0 if pred == int(t) else 0.0))
    return out


def _bin_torchcal(value, n_bins):
    for m in range(n_bins):
        if value <= (m + 1) / n_bins:
            return m
    return n_bins - 1


def _bin_torchmetrics(value, n_bins, dtype):
    if value == 1.0:
        return n_bins
    edges = [float(e) for e in np.linspace(0, 1, n_bins + 1).astype(dtype)]
    for m in range(n_bins):
        if edges[m] <= value < edges[m + 1]:
            return m
    return n_bins - 1


def direction(probs, targets, n_bins, binning="width", convention="torchcal", dtype=np.float64):
    """(ece, signed, over, under) by explicit bins."""
    pairs = top_pairs(probs, targets)
    n = len(pairs)
    if binning == "mass":
        order = sorted(range(n), key=lambda i: pairs[i][0])
        groups = [[pairs[i] for i in chunk] for chunk in np.array_split(np.array(order, dtype=int), n_bins)]
    else:
        groups = [[] for _ in range(n_bins + 1)]
        for conf, c in pairs:
            b = (
                _bin_torchcal(conf, n_bins)
                if convention == "torchcal"
                else _bin_torchmetrics(conf, n_bins, dtype)
            )
            groups[b].append((conf, c))
    over = under = 0.0
    for g in groups:
        if not g:
            continue
        gap = sum(p for p, _ in g) / len(g) - sum(c for _, c in g) / len(g)
        if gap > 0:
            over += len(g) / n * gap
        else:
            under += len(g) / n * -gap
    return over + under, over - under, over, under


def brier_murphy(probs, targets):
    """(BS, REL, RES, UNC) grouping identical rows (as tuples)."""
    rows = _rows(probs)
    k = len(rows[0])
    n = len(rows)
    groups = {}
    for row, t in zip(rows, targets):
        groups.setdefault(tuple(row), []).append(int(t))
    ybar = [sum(1.0 for t in targets if int(t) == j) / n for j in range(k)]
    bs = (
        sum(
            sum((row[j] - (1.0 if j == int(t) else 0.0)) ** 2 for j in range(k))
            for row, t in zip(rows, targets)
        )
        / n
    )
    rel = res = 0.0
    for f, ts in groups.items():
        yg = [sum(1.0 for t in ts if t == j) / len(ts) for j in range(k)]
        rel += len(ts) / n * sum((f[j] - yg[j]) ** 2 for j in range(k))
        res += len(ts) / n * sum((yg[j] - ybar[j]) ** 2 for j in range(k))
    unc = sum(ybar[j] * (1 - ybar[j]) for j in range(k))
    return bs, rel, res, unc


def _xlogy(x, y):
    return 0.0 if x == 0 else x * math.log(y)


def log_murphy(probs, targets):
    """(LS, REL, RES, UNC) grouping identical rows."""
    rows = _rows(probs)
    k = len(rows[0])
    n = len(rows)
    groups = {}
    for row, t in zip(rows, targets):
        groups.setdefault(tuple(row), []).append(int(t))
    ybar = [sum(1.0 for t in targets if int(t) == j) / n for j in range(k)]
    ls = -sum(math.log(row[int(t)]) for row, t in zip(rows, targets)) / n
    rel = res = 0.0
    for f, ts in groups.items():
        yg = [sum(1.0 for t in ts if t == j) / len(ts) for j in range(k)]
        rel += len(ts) / n * sum(_xlogy(yg[j], yg[j]) - _xlogy(yg[j], f[j]) for j in range(k))
        res += len(ts) / n * sum(_xlogy(yg[j], yg[j]) - _xlogy(yg[j], ybar[j]) for j in range(k))
    unc = -sum(_xlogy(ybar[j], ybar[j]) for j in range(k))
    return ls, rel, res, unc


def cumulative(scores, targets):
    """(KS, Kuiper) of the cumulative-difference kernel by a loop over the stably sorted scores."""
    n = len(scores)
    if n == 0:
        return 0.0, 0.0
    order = sorted(range(n), key=lambda i: float(scores[i]))
    d, hi, lo, ks = 0.0, 0.0, 0.0, 0.0
    for i in order:
        d += (float(targets[i]) - float(scores[i])) / n
        hi, lo, ks = max(hi, d), min(lo, d), max(ks, abs(d))
    return ks, hi - lo


def selective_risks(conf, errors):
    """Per-sample (coverage, risk, generalized risk), most confident first (stable)."""
    n = len(conf)
    order = sorted(range(n), key=lambda i: -float(conf[i]))
    out, total = [], 0.0
    for k, i in enumerate(order, start=1):
        total += float(errors[i])
        out.append((k / n, total / k, total / n))
    return out


def aurc_per_sample(conf, errors, generalized=False):
    pts = selective_risks(conf, errors)
    n = len(pts)
    if n < 2:
        return math.nan
    area = 0.0
    for a, b in zip(pts[:-1], pts[1:]):
        ya, yb = (a[2], b[2]) if generalized else (a[1], b[1])
        area += (b[0] - a[0]) * (ya + yb) / 2
    return area / (1 - 1 / n)


def aurc_grouped(conf, errors, generalized=False):
    """fd-shifts: one point per distinct threshold τ (samples with conf ≥ τ), plus coverage 0."""
    n = len(conf)
    pts = []
    for tau in sorted({float(c) for c in conf}):
        sel = [float(e) for c, e in zip(conf, errors) if float(c) >= tau]
        cov = len(sel) / n
        pts.append((cov, sum(sel) / n if generalized else sum(sel) / len(sel)))
    pts.append((0.0, 0.0 if generalized else pts[-1][1]))
    pts.sort()
    return sum((b[0] - a[0]) * (a[1] + b[1]) / 2 for a, b in zip(pts[:-1], pts[1:]))


def fpr_at_recall(scores, is_ood, level=0.95):
    """Hendrycks' fpr_and_fdr_at_recall with numpy, on a stable descending order."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(is_ood, dtype=np.float64)
    order = np.argsort(-s, kind="stable")
    s, y = s[order], y[order]
    distinct = np.where(np.diff(s))[0]
    idx = np.r_[distinct, y.size - 1]
    tps = np.cumsum(y)[idx]
    fps = 1 + idx - tps
    recall = tps / tps[-1]
    last = tps.searchsorted(tps[-1])
    sl = slice(last, None, -1)
    recall, fps = np.r_[recall[sl], 1], np.r_[fps[sl], 0]
    cutoff = np.argmin(np.abs(recall - level))
    return fps[cutoff] / np.sum(np.logical_not(y))


def average_precision(scores, labels):
    """Σ_n (R_n − R_{n−1}) P_n over distinct thresholds, by a loop over the thresholds."""
    pos = sum(float(v) for v in labels)
    prev, ap = 0.0, 0.0
    for tau in sorted({float(s) for s in scores}, reverse=True):
        tp = sum(float(v) for s, v in zip(scores, labels) if float(s) >= tau)
        sel = sum(1 for s in scores if float(s) >= tau)
        ap += (tp / pos - prev) * tp / sel
        prev = tp / pos
    return ap


def conformal_score(row, label, method, u=None, lam=0.1, k_reg=1):
    """One sample's score for one label (loops: rank by a stable descending sort of the row)."""
    if method == "lac":
        return 1 - row[label]
    order = sorted(range(len(row)), key=lambda j: -row[j])
    rank = order.index(label) + 1
    cum = sum(row[j] for j in order[:rank])
    s = cum - (u * row[label] if u is not None else 0.0)
    if method == "raps":
        s += lam * max(0, rank - k_reg)
    return s


def conformal_qhat(scores, alpha):
    n = len(scores)
    k = math.ceil((n + 1) * (1 - alpha))
    return math.inf if n == 0 or k > n else sorted(scores)[k - 1]


def binary_binned(p, y, n_bins):
    """One label's (signed ECE, over, under, REL, RES, UNC, WBV, WBC, Brier) over equal-width bins of p (SPEC
    §3 bins), the Brier terms in the scalar form (p − y)², by explicit per-bin lists."""
    p, y = [float(v) for v in p], [float(v) for v in y]
    n = len(p)
    groups = [[] for _ in range(n_bins)]
    for pi, yi in zip(p, y):
        groups[_bin_torchcal(pi, n_bins)].append((pi, yi))
    ybar = sum(y) / n
    signed = over = under = rel = res = wbv = wbc = 0.0
    for g in groups:
        if not g:
            continue
        pb = sum(a for a, _ in g) / len(g)
        yb = sum(b for _, b in g) / len(g)
        gap = len(g) / n * (pb - yb)
        signed += gap
        over, under = over + max(gap, 0.0), under + max(-gap, 0.0)
        rel += len(g) / n * (pb - yb) ** 2
        res += len(g) / n * (yb - ybar) ** 2
        wbv += sum((a - pb) ** 2 for a, _ in g) / n
        wbc += sum((a - pb) * (b - yb) for a, b in g) / n
    brier = sum((a - b) ** 2 for a, b in zip(p, y)) / n
    return signed, over, under, rel, res, ybar * (1 - ybar), wbv, wbc, brier
