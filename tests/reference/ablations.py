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
