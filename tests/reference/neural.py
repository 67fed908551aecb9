"""Slow float64 references for the network calibrators' maps (PTS, IOP), row by row with numpy, built the
way the reference implementations build them (Keras layout for PTS; the cumulative sum over the flipped
gaps for IOP). They share no code with torchcal."""

from __future__ import annotations

import numpy as np


def _mlp(x, kernels, biases):
    """Dense layers in Keras' layout: x @ W + b, ReLU between layers."""
    for i, (w, b) in enumerate(zip(kernels, biases)):
        x = x @ w + b
        if i < len(kernels) - 1:
            x = np.maximum(x, 0.0)
    return x


def pts_probs(logits, kernels, biases, top_k):
    """PTS (tochris/pts-uncertainty): clip to ±100, T = clip(|MLP(top-k sorted descending)|, 1e-12, 1e12),
    softmax(z / T)."""
    out = []
    for z in np.asarray(logits, dtype=np.float64):
        z = np.clip(z, -100.0, 100.0)
        t = np.sort(z)[::-1][:top_k]
        temp = float(np.clip(abs(_mlp(t[None, :], kernels, biases)[0, 0]), 1e-12, 1e12))
        e = np.exp(z / temp - np.max(z / temp))
        out.append(e / e.sum())
    return np.array(out)


def iop_logits(log_probs, kernels, biases, invariant=True):
    """IOP (AmirooR/IntraOrderPreservingCalibration): s = sort(x, descending), u = flip([s_0 − s_1, …,
    s_{K−2} − s_{K−1}, 1]), m = MLP(s) with m_0 = 0 and softplus on the rest, o = flip(cumsum(u ⊙ m)),
    returned at the original class positions."""
    out = []
    for x in np.asarray(log_probs, dtype=np.float64):
        order = np.argsort(-x, kind="stable")
        s = x[order]
        u = np.append(s[:-1] - s[1:], 1.0)[::-1]
        m = _mlp((s if invariant else x)[None, :], kernels, biases)[0]
        m = np.concatenate([[0.0], np.logaddexp(0.0, m[1:])])
        running, um = 0.0, []
        for a, b in zip(u, m):
            running += a * b
            um.append(running)
        ranked = np.array(um)[::-1]
        o = np.empty_like(x)
        o[order] = ranked
        out.append(o)
    return np.array(out)
