"""Float64 references (plain Python math) of the losses and metrics that only the papers' ablations use."""

from __future__ import annotations

import math

from tests.reference.losses import _per_sample, focal


def fcl_l1(logits, targets, gamma, lam):
    """FCL's L1 ablation: focal(γ) + λ·Σ_k |p_k − onehot_k|, summed over the classes one by one."""
    l1 = _per_sample(logits, targets, lambda p, t: sum(abs(v - (j == t)) for j, v in enumerate(p)))
    return [a + lam * b for a, b in zip(focal(logits, targets, gamma), l1)]


def dual_value(p, t, dual_logit):
    """p_j of a dual focal variant: rank the classes strictly below p_t in descending order."""
    if not isinstance(dual_logit, str):
        return float(dual_logit)
    below = sorted((v for v in p if v < p[t]), reverse=True)
    if dual_logit == "largest":
        return below[0] if below else 0.0
    if dual_logit in ("second", "third"):
        r = 2 if dual_logit == "second" else 3
        return below[r - 1] if len(below) >= r else 0.0
    if dual_logit == "mean":
        return sum(below) / len(below) if below else 0.0
    m = 2 if dual_logit == "mean2" else 3
    first = below[:m]
    return sum(first) / len(first) if first else 0.0


def dfl_variant(logits, targets, gamma, dual_logit):
    return _per_sample(
        logits,
        targets,
        lambda p, t: -((1 - p[t] + dual_value(p, t, dual_logit)) ** gamma) * math.log(p[t]),
    )


def kde_l1(probs_rows, targets, h):
    """(1/N) Σ_i Σ_k |Ê[y_k | f_i] − f_ik| with leave-one-out Dirichlet kernels Dir(f_i; f_j/h + 1), from
    lgamma and logs one pair at a time."""
    n, k = len(probs_rows), len(probs_rows[0])
    total = 0.0
    for i in range(n):
        logs = []
        for j in range(n):
            if j == i:
                continue
            alpha = [v / h + 1 for v in probs_rows[j]]
            log_norm = math.lgamma(sum(alpha)) - sum(math.lgamma(a) for a in alpha)
            logs.append((j, log_norm + sum((a - 1) * math.log(x) for a, x in zip(alpha, probs_rows[i]))))
        m = max(v for _, v in logs)
        w = {j: math.exp(v - m) for j, v in logs}
        z = sum(w.values())
        for c in range(k):
            e = sum(w[j] * (int(targets[j]) == c) for j in w) / z
            total += abs(e - probs_rows[i][c])
    return total / n


def kde_xe(logits, targets, lam, h):
    """Mean cross entropy + λ·KDE L1 calibration error of the batch (the metric's clamp at 1e-12)."""
    rows = []
    for row in logits.tolist():
        m = max(row)
        e = [math.exp(v - m) for v in row]
        s = sum(e)
        p = [max(v / s, 1e-12) for v in e]
        t = sum(p)
        rows.append([v / t for v in p])
    ce = [-math.log(_softmax_at(row, int(t))) for row, t in zip(logits.tolist(), targets.tolist())]
    return sum(ce) / len(ce) + lam * kde_l1(rows, targets.tolist(), h)


def _softmax_at(row, t):
    m = max(row)
    return math.exp(row[t] - m) / sum(math.exp(v - m) for v in row)


def sweep_equal_width(probs, targets, p=1):
    """Roelofs et al.'s ECE_sweep with equal-width bins (m/b, (m+1)/b] (0 in bin 0), b = 2 ... N, by loops."""
    from tests.reference import metrics as RM

    pairs = [(RM._top(r)[0], float(RM._top(r)[1] == int(t))) for r, t in zip(RM._rows(probs), targets)]
    n = len(pairs)

    def bins(b):
        out = [[] for _ in range(b)]
        for q, c in pairs:
            out[RM.equal_width_bin(q, b)].append((q, c))
        return [g for g in out if g]

    def value(b):
        return sum(
            len(g) / n * abs(sum(c for _, c in g) / len(g) - sum(q for q, _ in g) / len(g)) ** p
            for g in bins(b)
        ) ** (1 / p)

    best = 1
    for b in range(2, n + 1):
        accs = [sum(c for _, c in g) / len(g) for g in bins(b)]
        if any(accs[i + 1] < accs[i] for i in range(len(accs) - 1)):
            break
        best = b
    return value(best), best
