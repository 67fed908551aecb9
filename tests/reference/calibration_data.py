"""Seeded synthetic logits for the calibrator conformance goldens and benchmarks: over-confident and
class-biased, with labels drawn from a known model."""

from __future__ import annotations

import torch


def synthetic_logits(n: int, k: int, seed: int = 0, dtype=torch.float32):
    """(logits (n, k), targets (n,)): targets ~ softmax(t) for t = 2·randn + a class trend, logits
    = 2.5·(t + 0.3·noise) − 1.5·(class trend): too sharp, and biased toward the first classes. Generated
    in float64 on the CPU with a seeded generator (identical on every machine), then cast to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    trend = torch.linspace(-1.0, 1.0, k, dtype=torch.float64)
    true = 2.0 * torch.randn(n, k, generator=g, dtype=torch.float64) + trend
    targets = torch.multinomial(torch.softmax(true, 1), 1, generator=g).squeeze(1)
    noise = torch.randn(n, k, generator=g, dtype=torch.float64)
    logits = 2.5 * (true + 0.3 * noise) - 1.5 * trend
    return logits.to(dtype), targets


def split(logits, targets):
    """First half calibration, second half test."""
    h = logits.shape[0] // 2
    return (logits[:h], targets[:h]), (logits[h:], targets[h:])
