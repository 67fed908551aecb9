"""Slow float64 reference for parameterized probability adjustment (PPA): softmax, the argmax set and the
Brier sums row by row in plain Python floats. It shares no code with torchcal."""

from __future__ import annotations

import math


def _softmax(row):
    m = max(row)
    e = [math.exp(v - m) for v in row]
    s = sum(e)
    return [v / s for v in e]


def _target(p):
    top = max(p)
    members = [k for k, v in enumerate(p) if v == top]
    return [1.0 / len(members) if k in members else 0.0 for k in range(len(p))]


def ppa_fit(logits, targets):
    """(r, r*): the unconstrained Brier minimiser r* = −Σ_i Σ_k (p_ik − 1[k = y_i])(t_ik − p_ik) /
    Σ_i Σ_k (t_ik − p_ik)², and r = r* clipped to [0, 1] (0 when the denominator is 0)."""
    num = den = 0.0
    for row, y in zip(logits, targets):
        p = _softmax([float(v) for v in row])
        t = _target(p)
        for k in range(len(p)):
            d = t[k] - p[k]
            num -= (p[k] - (1.0 if k == int(y) else 0.0)) * d
            den += d * d
    if den == 0.0:
        return 0.0, 0.0
    r_star = num / den
    return min(max(r_star, 0.0), 1.0), r_star


def ppa_probs(logits, r):
    """(1 − r)·p + r·t per row, as nested lists."""
    out = []
    for row in logits:
        p = _softmax([float(v) for v in row])
        t = _target(p)
        out.append([(1.0 - r) * pk + r * tk for pk, tk in zip(p, t)])
    return out
