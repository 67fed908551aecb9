"""The focal calibration map of Komisarenko & Kull 2024 (SPEC §4), computed in log space."""

from __future__ import annotations

import math

import torch

from .._validation import check_float, check_logits, check_probs

__all__ = ["focal_calibration_map", "focal_log_map"]


def _log_one_minus(log_q: torch.Tensor) -> torch.Tensor:
    """log(1 − q_k) for every entry, exact for the top entry even when q_top rounds to 1.

    Entries other than the row maximum are <= 0.5, where log1p(−q) is accurate; for the maximum we use
    log Σ_{j≠top} q_j (a logsumexp of the other log-probabilities), which needs no subtraction from 1.
    The result is clamped below at log(tiny) so that a one-hot row stays finite.
    """
    top = log_q.argmax(dim=-1, keepdim=True)
    l1 = torch.log1p(-log_q.exp().clamp(max=0.5))
    others = log_q.scatter(-1, top, -math.inf)
    l1 = l1.scatter(-1, top, torch.logsumexp(others, dim=-1, keepdim=True))
    return l1.clamp(min=math.log(torch.finfo(log_q.dtype).tiny))


def _focal_ratio(log_q: torch.Tensor, l1: torch.Tensor) -> torch.Tensor:
    """a = q (−ln q) / (1 − q) ∈ [0, 1], accurate at both ends.

    Where 1 − q < 1/2 (only the top entry), −ln q is taken as −log1p(−(1 − q)) from the accurate 1 − q,
    because the rounded log q of a probability near 1 has large relative error; a → 1 as q → 1. q = 0 gives 0.
    """
    one_minus = l1.exp()
    neg_log_q = torch.where(one_minus < 0.5, -torch.log1p(-one_minus), -log_q)
    a = torch.exp(log_q - l1) * neg_log_q
    return torch.where(torch.isfinite(log_q), a, torch.zeros_like(a))


def focal_log_map(log_q: torch.Tensor, gamma) -> torch.Tensor:
    """Log of the normalised focal map, from log-probabilities; ``gamma`` may be a float or a tensor that
    broadcasts against ``log_q`` (e.g. shape (G, 1, 1) to map many γ at once)."""
    l1 = _log_one_minus(log_q)
    a = _focal_ratio(log_q, l1)
    log_h = log_q - gamma * l1 - torch.log1p(gamma * a)
    return log_h - torch.logsumexp(log_h, dim=-1, keepdim=True)


def focal_calibration_map(probs, gamma: float, *, from_logits: bool = False) -> torch.Tensor:
    r"""The focal calibration map: the probabilities a focal-loss-trained model's outputs correspond to.

    .. math:: \mathrm{focal}_\gamma(q)_i \propto \frac{1}{\varphi'(q_i)}
              = \frac{q_i (1-q_i)^{-\gamma}}{1 + \gamma q_i (-\ln q_i)/(1-q_i)},
              \qquad \varphi(q) = -(1-q)^\gamma \ln q

    normalised over classes. It is the identity at γ = 0 and defined for γ > −1 (at −1 the denominator
    vanishes as q → 1). Everything is computed in log space; 1 − q of the top class is taken as the sum of
    the other probabilities, so rows whose top probability rounds to 1.0 stay finite and a one-hot row maps
    to itself.

    Args:
        probs: probabilities (N, K), or logits with ``from_logits=True``.
        gamma: focal parameter γ > −1.

    Returns:
        Mapped probabilities of shape (N, K), rows summing to 1, in the working dtype.

    References:
        Komisarenko & Kull 2024, "Improving calibration by relating focal loss, temperature scaling, and
        properness".

    Example:
        >>> import torch
        >>> q = torch.tensor([[0.7, 0.2, 0.1]], dtype=torch.float64)
        >>> focal_calibration_map(q, 0.0)
        tensor([[0.7000, 0.2000, 0.1000]], dtype=torch.float64)
        >>> focal_calibration_map(q, 2.0)
        tensor([[0.9197, 0.0546, 0.0257]], dtype=torch.float64)
    """
    gamma = check_float(gamma, "gamma", low=-1, low_open=True)
    if from_logits:
        log_q = torch.log_softmax(check_logits(probs, "probs"), dim=1)
    else:
        log_q = torch.log(check_probs(probs, "probs"))
    return focal_log_map(log_q, gamma).exp()
