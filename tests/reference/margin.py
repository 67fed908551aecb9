"""Float64 per-sample loop references of the margin and penalty losses (SPEC §8), written from the formulas of
the released code and the papers, not from torchcal's vectorised code.

Each position of (N, K, d1, ...) logits is visited by explicit loops over the sample and spatial indices, and
every sum is a Python loop over 0-d float64 tensors, so autograd through a reference gives the reference
gradient. Each function returns the loss with the requested reduction and the per-position shape for
``"none"``.
"""

from __future__ import annotations

import itertools
import math

import torch


def positions(logits, targets):
    """(index, [z_k as 0-d tensors], label or [q_k]) for every position of the sample and spatial dims."""
    n, k = logits.shape[:2]
    spatial = logits.shape[2:]
    soft = targets.is_floating_point()
    for i in range(n):
        for s in itertools.product(*(range(d) for d in spatial)):
            z = [logits[(i, c, *s)] for c in range(k)]
            t = [targets[(i, c, *s)] for c in range(k)] if soft else int(targets[(i, *s)])
            yield (i, *s), z, t


def log_softmax(z):
    top = max(float(v.detach()) for v in z)
    total = sum(torch.exp(v - top) for v in z)
    return [v - top - torch.log(total) for v in z]


def ce(log_p, t):
    if isinstance(t, int):
        return -log_p[t]
    return -sum(q * lp for q, lp in zip(t, log_p))


def _combine(logits, targets, per_position, reduction, ignore_index, penalty_on_ignored=False):
    """per_position(z, t) -> (ce_term, penalty_term). An ignored position's CE is left out; its penalty
    counts only when ``penalty_on_ignored``. "mean" averages each term over the positions it covers."""
    ce_terms, pen_terms, none = [], [], {}
    for idx, z, t in positions(logits, targets):
        ignored = isinstance(t, int) and ignore_index is not None and t == ignore_index
        c, pen = per_position(z, 0 if ignored else t)
        value = 0.0 * c
        if not ignored:
            ce_terms.append(c)
            value = value + c
        if not ignored or penalty_on_ignored:
            pen_terms.append(pen)
            value = value + pen
        none[idx] = value
    if reduction == "none":
        shape = (logits.shape[0], *logits.shape[2:])
        out = [none[idx] for idx in itertools.product(*(range(d) for d in shape))]
        return torch.stack(out).reshape(shape)
    if reduction == "sum":
        return sum(ce_terms) + sum(pen_terms)
    return sum(ce_terms) / len(ce_terms) + sum(pen_terms) / len(pen_terms)


def mbls(logits, targets, margin=10.0, alpha=0.1, *, ignore_index=-100, ignored_rows="reference",
         reduction="mean"):  # fmt: skip
    """CE + α·(1/K) Σ_k relu(z_max − z_k − m) per position; the released code keeps ignored rows in the
    margin term when ignore_index < 0."""

    def term(z, t):
        k = len(z)
        j = max(range(k), key=lambda c: float(z[c].detach()))  # the first arg-max, as torch.max
        hinge = sum(torch.clamp(z[j] - z[c] - margin, min=0) for c in range(k)) / k
        return ce(log_softmax(z), t), alpha * hinge

    on_ignored = ignored_rows == "reference" and (ignore_index is None or ignore_index < 0)
    return _combine(logits, targets, term, reduction, ignore_index, on_ignored)


def confidence_penalty(logits, targets, beta=1.0, *, eps=1e-6, form="sample", ignore_index=-100,
                       reduction="mean"):  # fmt: skip
    def term(z, t):
        log_p = log_softmax(z)
        p = [torch.exp(v) for v in log_p]
        k = len(z)
        if form == "mbls":
            pc = [torch.clamp(v, 1e-10, 1 - 1e-10) for v in p]
            pen = sum(v * torch.log(v) for v in pc) / k
        else:
            pen = math.log(k) + sum(v * (torch.log(v + eps) if eps else lv) for v, lv in zip(p, log_p))
        return ce(log_p, t), beta * pen

    return _combine(logits, targets, term, reduction, ignore_index)


def maxsup(logits, targets, alpha=0.1, *, ignore_index=-100, reduction="mean"):
    def term(z, t):
        k = len(z)
        j = max(range(k), key=lambda c: float(z[c].detach()))
        return ce(log_softmax(z), t), alpha * (z[j] - sum(z) / k)

    return _combine(logits, targets, term, reduction, ignore_index)


def poly1(logits, targets, epsilon=1.0, *, weight=None, label_smoothing=0.0, ignore_index=-100,
          reduction="mean"):  # fmt: skip
    """Σ_k w_k q_k(−log p_k + ε(1 − p_k)) with q the (smoothed) one-hot or soft target; "mean" divides by
    Σ w_y over the kept labels (the number of rows for soft targets)."""
    k = logits.shape[1]
    total, norm, none = 0.0, 0.0, {}
    for idx, z, t in positions(logits, targets):
        if isinstance(t, int) and ignore_index is not None and t == ignore_index:
            none[idx] = 0.0 * z[0]
            continue
        log_p = log_softmax(z)
        if isinstance(t, int):
            q = [(1 - label_smoothing) * (c == t) + label_smoothing / k for c in range(k)]
            norm += 1.0 if weight is None else float(weight[t])
        else:
            q = [(1 - label_smoothing) * v + label_smoothing / k for v in t]
            norm += 1.0
        w = [1.0] * k if weight is None else [float(v) for v in weight]
        value = sum(w[c] * q[c] * (-log_p[c] + epsilon * (1 - torch.exp(log_p[c]))) for c in range(k))
        none[idx] = value
        total = total + value
    if reduction == "none":
        shape = (logits.shape[0], *logits.shape[2:])
        return torch.stack([none[idx] for idx in itertools.product(*(range(d) for d in shape))]).reshape(
            shape
        )
    return total if reduction == "sum" else total / norm


def _batch_combined(logits, targets, base_fn, penalty, reduction, ignore_index, weight=None):
    """base_i (times w_y) of the kept positions plus the batch's penalty: "mean" is the base's mean (over
    Σ w_y with weights) + penalty, "none" gives each kept position base_i + penalty, "sum" their sum."""
    total, norm, none = 0.0, 0.0, {}
    for idx, z, t in positions(logits, targets):
        if isinstance(t, int) and ignore_index is not None and t == ignore_index:
            none[idx] = 0.0 * z[0]
            continue
        w = 1.0 if weight is None or not isinstance(t, int) else float(weight[t])
        value = w * base_fn(z, t)
        total, norm = total + value, norm + w
        none[idx] = value + penalty
    if reduction == "mean":
        return total / norm + penalty
    shape = (logits.shape[0], *logits.shape[2:])
    out = torch.stack([none[idx] for idx in itertools.product(*(range(d) for d in shape))]).reshape(shape)
    return out if reduction == "none" else out.sum()


def mdca_term(logits, targets, ignore_index=-100):
    """(1/K) Σ_k abs(mean_i p_ik − mean_i 1[y_i = k]) over the kept positions (soft targets: mean_i q_ik)."""
    k = logits.shape[1]
    mean_p, freq, n = [0.0] * k, [0.0] * k, 0
    for _, z, t in positions(logits, targets):
        if isinstance(t, int) and ignore_index is not None and t == ignore_index:
            continue
        p = [torch.exp(v) for v in log_softmax(z)]
        n += 1
        for c in range(k):
            mean_p[c] = mean_p[c] + p[c]
            freq[c] += float(t == c) if isinstance(t, int) else float(t[c])
    return sum(torch.abs(mean_p[c] / n - freq[c] / n) for c in range(k)) / k


def mdca(logits, targets, beta=1.0, *, base="nll", gamma=1.0, smoothing=0.1, ignore_index=-100,
         reduction="mean"):  # fmt: skip
    k = logits.shape[1]

    def base_fn(z, t):
        log_p = log_softmax(z)
        if not isinstance(t, int):
            factor = [1.0 if base == "nll" else (1 - torch.exp(lp)) ** gamma for lp in log_p]
            return -sum(q * f * lp for q, f, lp in zip(t, factor, log_p))
        if base == "nll":
            return -log_p[t]
        if base == "focal":
            return -((1 - torch.exp(log_p[t])) ** gamma) * log_p[t]
        return -sum(((1 - smoothing) if c == t else smoothing / (k - 1)) * log_p[c] for c in range(k))

    penalty = beta * mdca_term(logits, targets, ignore_index)
    return _batch_combined(logits, targets, base_fn, penalty, reduction, ignore_index)


def dca(logits, targets, beta=10.0, *, weight=None, ignore_index=-100, reduction="mean"):
    """CE (weighted) + β·abs(mean_i r_i − mean_i a_i) over the kept positions; a_i is a constant."""
    conf, acc, n = 0.0, 0.0, 0
    for _, z, t in positions(logits, targets):
        if ignore_index is not None and t == ignore_index:
            continue
        p = [torch.exp(v) for v in log_softmax(z)]
        j = max(range(len(p)), key=lambda c: float(p[c].detach()))
        conf, acc, n = conf + p[j], acc + float(j == t), n + 1
    penalty = beta * torch.abs(conf / n - acc / n)
    return _batch_combined(logits, targets, lambda z, t: -log_softmax(z)[t], penalty, reduction, ignore_index,
                           weight)  # fmt: skip


def acls(logits, targets, alpha=0.1, margin=10.0, *, lambda_pos=1.0, lambda_neg=0.1, ignore_index=-100,
         ignored_rows="reference", reduction="mean"):  # fmt: skip
    """CE + α·(λ_pos Σ_k [z_k ties the max] relu(z_max − m)² + λ_neg/(K − 1) Σ_k [z_k below the max]
    relu(sg(z_max) − z_k − m)²) per position; the released code's regulariser covers ignored positions."""

    def term(z, t):
        k = len(z)
        j = max(range(k), key=lambda c: float(z[c].detach()))  # the first arg-max, as torch.max
        top = float(z[j].detach())
        pos = sum(torch.clamp(z[j] - margin, min=0) ** 2 for c in range(k) if float(z[c].detach()) == top)
        neg = sum(torch.clamp(z[j].detach() - z[c] - margin, min=0) ** 2 for c in range(k)
                  if float(z[c].detach()) != top)  # fmt: skip
        return ce(log_softmax(z), t), alpha * (lambda_pos * pos + lambda_neg * neg / (k - 1))

    return _combine(logits, targets, term, reduction, ignore_index, ignored_rows == "reference")


def sbece_term(logits, targets, n_bins=15, temperature=0.01, form="label", ignore_index=-100):
    """Soft-binned ECE from the definitions, one position and one bin at a time."""
    rs, accs = [], []
    for _, z, t in positions(logits, targets):
        if ignore_index is not None and t == ignore_index:
            continue
        p = [torch.exp(v) for v in log_softmax(z)]
        j = max(range(len(p)), key=lambda c: float(p[c].detach()))
        rs.append(p[j])
        accs.append(float(j == t))
    centres = [(b + 0.5) / n_bins for b in range(n_bins)]
    g = []
    for r in rs:
        e = [torch.exp(-((r - c) ** 2) / temperature) for c in centres]
        total = sum(e)
        g.append([v / total for v in e])
    mass = [sum(g[i][b] for i in range(len(rs))) for b in range(n_bins)]
    if form == "label":
        acc = [sum(g[i][b] * accs[i] for i in range(len(rs))) / (mass[b] if float(mass[b].detach()) > 0 else 1.0)
               for b in range(n_bins)]  # fmt: skip
        value = sum(g[i][b] * (acc[b] - rs[i]) ** 2 for i in range(len(rs)) for b in range(n_bins)) / len(rs)
        return torch.sqrt(value)
    value = 0.0
    for b in range(n_bins):
        den = torch.clamp(mass[b], min=1e-5)
        conf_b = sum(g[i][b] * rs[i] for i in range(len(rs))) / den
        acc_b = sum(g[i][b] * accs[i] for i in range(len(rs))) / den
        value = value + mass[b] / sum(mass) * (conf_b - acc_b) ** 2
    return torch.sqrt(value)


def sbece(logits, targets, lambda_=2.0, *, n_bins=15, temperature=0.01, form="label", ignore_index=-100,
          reduction="mean"):  # fmt: skip
    penalty = lambda_ * sbece_term(logits, targets, n_bins, temperature, form, ignore_index)
    return _batch_combined(logits, targets, lambda z, t: -log_softmax(z)[t], penalty, reduction, ignore_index)
