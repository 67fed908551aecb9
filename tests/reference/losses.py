"""Per-sample float64 reference implementations of the training losses (plain Python math)."""

from __future__ import annotations

import math


def softmax(row):
    m = max(row)
    e = [math.exp(v - m) for v in row]
    s = sum(e)
    return [v / s for v in e]


def _per_sample(logits, targets, fn):
    return [fn(softmax([float(v) for v in row]), int(t)) for row, t in zip(logits.tolist(), targets.tolist())]


def ce(logits, targets, eps=0.0):
    def f(p, t):
        k = len(p)
        return -sum(((1 - eps) * (j == t) + eps / k) * math.log(p[j]) for j in range(k))

    return _per_sample(logits, targets, f)


def focal(logits, targets, gamma):
    return _per_sample(logits, targets, lambda p, t: -((1 - p[t]) ** gamma) * math.log(p[t]))


def inverse_focal(logits, targets, gamma):
    return _per_sample(logits, targets, lambda p, t: -((1 + p[t]) ** gamma) * math.log(p[t]))


def flsd(logits, targets, gammas, thresholds):
    def f(p, t):
        g = gammas[sum(1 for th in thresholds if p[t] >= th)]
        return -((1 - p[t]) ** g) * math.log(p[t])

    return _per_sample(logits, targets, f)


def poly1(logits, targets, epsilon):
    return _per_sample(logits, targets, lambda p, t: -math.log(p[t]) + epsilon * (1 - p[t]))


def runner_up(p, t):
    below = [v for j, v in enumerate(p) if v < p[t]]
    return max(below) if below else 0.0


def dfl(logits, targets, gamma):
    return _per_sample(
        logits, targets, lambda p, t: -((1 - p[t] + runner_up(p, t)) ** gamma) * math.log(p[t])
    )


def dual_flsd(logits, targets, gammas, thresholds):
    def f(p, t):
        pj = runner_up(p, t)
        g = gammas[sum(1 for th in thresholds if p[t] - pj >= th)]
        return -((1 - p[t] + pj) ** g) * math.log(p[t])

    return _per_sample(logits, targets, f)


def brier(logits, targets):
    return _per_sample(logits, targets, lambda p, t: sum((v - (j == t)) ** 2 for j, v in enumerate(p)))


def fcl(logits, targets, gamma, lam):
    return [a + lam * b for a, b in zip(focal(logits, targets, gamma), brier(logits, targets))]


def mmce(logits, targets, lam, normalization="paper", bandwidth=0.4):
    """CE_i + λ·MMCE_w of the batch, with the double loop over pairs."""
    probs = [softmax([float(v) for v in row]) for row in logits.tolist()]
    ts = [int(t) for t in targets.tolist()]
    r = [max(p) for p in probs]
    c = [max(range(len(p)), key=lambda j: (p[j], -j)) == t for p, t in zip(probs, ts)]
    m, n = sum(c), len(c) - sum(c)
    ce_i = [-math.log(p[t]) for p, t in zip(probs, ts)]
    if m == 0 or n == 0:
        return ce_i
    cc = ww = cw = 0.0
    for i in range(len(r)):
        for j in range(len(r)):
            k = math.exp(-abs(r[i] - r[j]) / bandwidth)
            if c[i] and c[j]:
                cc += (1 - r[i]) * (1 - r[j]) * k
            if not c[i] and not c[j]:
                ww += r[i] * r[j] * k
            if c[i] and not c[j]:
                cw += (1 - r[i]) * r[j] * k
    cc, ww, cw = cc / m**2, ww / n**2, cw / (m * n)
    if normalization == "code":
        cc, ww, cw = cc / m**2, ww / n**2, cw / (m * n)
    penalty = math.sqrt(max(cc + ww - 2 * cw, 0.0))
    return [v + lam * penalty for v in ce_i]


# -- soft targets (class probabilities q per sample; decision 73) ---------------------------------------------


def _per_sample_soft(logits, q, fn):
    return [
        fn(softmax([float(v) for v in row]), [float(v) for v in qs])
        for row, qs in zip(logits.tolist(), q.tolist())
    ]


def soft_ce(logits, q, eps=0.0):
    def f(p, qs):
        k = len(p)
        return -sum(((1 - eps) * qs[j] + eps / k) * math.log(p[j]) for j in range(k))

    return _per_sample_soft(logits, q, f)


def soft_focal(logits, q, gamma):
    return _per_sample_soft(
        logits, q, lambda p, qs: -sum(qj * (1 - pj) ** gamma * math.log(pj) for pj, qj in zip(p, qs))
    )


def soft_inverse_focal(logits, q, gamma):
    return _per_sample_soft(
        logits, q, lambda p, qs: -sum(qj * (1 + pj) ** gamma * math.log(pj) for pj, qj in zip(p, qs))
    )


def soft_flsd(logits, q, gammas, thresholds):
    def f(p, qs):
        total = 0.0
        for pj, qj in zip(p, qs):
            g = gammas[sum(1 for th in thresholds if pj >= th)]
            total -= qj * (1 - pj) ** g * math.log(pj)
        return total

    return _per_sample_soft(logits, q, f)


def soft_brier(logits, q):
    return _per_sample_soft(logits, q, lambda p, qs: sum((pj - qj) ** 2 for pj, qj in zip(p, qs)))


def soft_fcl(logits, q, gamma, lam):
    return [a + lam * b for a, b in zip(soft_focal(logits, q, gamma), soft_brier(logits, q))]


# -- class weights and label smoothing (F.cross_entropy's conventions; decision 96) --------------------------


def smoothed(targets, k, eps):
    """Target distributions as lists: the one-hot rows of labels (or the given rows), smoothed by ε."""
    rows = targets.tolist()
    if targets.ndim == 1:
        rows = [[float(j == t) for j in range(k)] for t in rows]
    return [[(1 - eps) * v + eps / k for v in row] for row in rows]


def soft_general(logits, q_rows, f, weight=None, lam=0.0):
    """Per row Σ_k w_k q_k f(p_k, k) + λ·(Σ_k w_k q_k)·Σ_k (p_k − q_k)² (w = 1 without weights)."""
    out = []
    for row, qs in zip(logits.tolist(), q_rows):
        p = softmax([float(v) for v in row])
        w = [1.0] * len(p) if weight is None else [float(v) for v in weight]
        value = sum(w[j] * qs[j] * f(p[j], j) for j in range(len(p)))
        if lam:
            value += lam * sum(w[j] * qs[j] for j in range(len(p))) * sum((a - b) ** 2 for a, b in zip(p, qs))
        out.append(value)
    return out


def focal_term(gamma):
    return lambda pj, j: -((1 - pj) ** gamma) * math.log(pj)


def reduce_weighted(per_sample, targets, weight, reduction, *, scale=True, ignore_index=-100):
    """F.cross_entropy's reduction of per-sample losses. Labels (``targets`` integer): each row is multiplied
    by w_y (unless ``scale`` is False: rows already weighted per class, as with label smoothing), ignored
    labels add 0 and "mean" divides by Σ w_y over the kept labels. Soft rows (``targets`` None): "mean"
    divides by the row count."""
    values, norm = [], 0.0
    labels = [None] * len(per_sample) if targets is None else [int(t) for t in targets.reshape(-1).tolist()]
    for v, t in zip(per_sample, labels):
        if t is not None and t == ignore_index:
            values.append(0.0)
            continue
        w_t = 1.0 if t is None or weight is None else float(weight[t])
        values.append(v * w_t if scale else v)
        norm += w_t
    if reduction == "none":
        return values
    total = math.fsum(values)
    return total / norm if reduction == "mean" else total
