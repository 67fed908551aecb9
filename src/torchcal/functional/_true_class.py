"""The torch implementation of the p_t-only losses (focal family, dual focal, the Brier term): the reference
path, and the path of every device the C++ operator does not take; and of the same losses against soft
targets (class probabilities). :mod:`._backend` decides which runs."""

from __future__ import annotations

import math

import torch

__all__ = ["TrueClassLoss", "SoftTargetLoss"]


def _runner_up(log_p, log_pt):
    """log p_j and j for the largest class strictly below p_t (ties with p_t excluded; −inf when none),
    without sorting: a masked max over rows, chunked through one small cache-resident buffer so that no
    (N, K) temporary is allocated."""
    n, k = log_p.shape
    rows = min(n, max(1, (1 << 18) // k))
    buf = torch.empty(rows, k, dtype=log_p.dtype, device=log_p.device)
    values = torch.empty(n, dtype=log_p.dtype, device=log_p.device)
    index = torch.empty(n, dtype=torch.long, device=log_p.device)
    for s in range(0, n, rows):
        m = min(rows, n - s)
        chunk = buf[:m].copy_(log_p[s : s + m])
        chunk.masked_fill_(chunk >= log_pt[s : s + m, None], -math.inf)
        torch.max(chunk, dim=1, out=(values[s : s + m], index[s : s + m]))
    return values, index


class TrueClassLoss(torch.autograd.Function):
    """Per-sample f(p_t[, p_j]) + λ·Σ_k (p_k − onehot_k)² with an analytic backward.

    ``weight_fn(log_pt) -> (loss, c_t)`` or, with ``runner_up``, ``weight_fn(log_pt, p_j) -> (loss, c_t, c_j)``
    gives the per-sample loss and c = p·∂loss/∂p for p_t (and for the runner-up p_j of the dual focal loss,
    the largest probability strictly below p_t). Since ∂p_a/∂z = p_a(e_a − p), the gradient is
    −(c_t + c_j)·p + c_t e_t + c_j e_j, plus λ·(2p⊙(p − Σp² + p_t) − 2p_t e_t) for the squared-error term:
    one (N, K) pass in the backward like cross entropy's, instead of autograd's chain through per-sample and
    (N, K) temporaries. Only log_softmax is saved.
    """

    @staticmethod
    def forward(ctx, logits, targets, weight_fn, brier_lambda, runner_up):
        log_p = torch.log_softmax(logits, dim=1)
        log_pt = log_p.gather(1, targets[:, None]).squeeze(1)
        c_j = j = sq = None
        if runner_up:
            log_pj, j = _runner_up(log_p, log_pt)
            loss, c_t, c_j = weight_fn(log_pt, log_pj.exp())
        else:
            loss, c_t = weight_fn(log_pt)
        if brier_lambda:
            sq = torch.linalg.vector_norm(log_p.exp(), dim=1) ** 2
            loss = loss + brier_lambda * (sq - 2 * log_pt.exp() + 1)
        ctx.brier_lambda = brier_lambda
        ctx.save_for_backward(log_p, targets, c_t, c_j, j, sq)
        return loss

    # one gradient argument per output, as in torch's own Functions (the base declares *grad_outputs)
    @staticmethod
    def backward(ctx, grad_loss):  # pyright: ignore[reportIncompatibleMethodOverride]
        log_p, targets, c_t, c_j, j, sq = ctx.saved_tensors
        lam = ctx.brier_lambda
        c_t = c_t * grad_loss
        row = c_t if c_j is None else c_t + c_j * grad_loss
        p = torch.exp(log_p)
        at_target = c_t
        if lam:
            w = (2 * lam) * grad_loss
            p_t = log_p.gather(1, targets[:, None]).squeeze(1).exp()
            # p ⊙ (−row + w·(p − Σp² + p_t))
            grad = torch.addcmul((w * (p_t - sq) - row)[:, None], p, w[:, None]).mul_(p)
            at_target = at_target - w * p_t
        else:
            grad = p.mul_(-row[:, None])
        grad.scatter_add_(1, targets[:, None], at_target[:, None])
        if c_j is not None:
            grad.scatter_add_(1, j[:, None], (c_j * grad_loss)[:, None])
        return grad, None, None, None, None


class SoftTargetLoss(torch.autograd.Function):
    """Per-sample Σ_k q_k f(p_k) + λ·Σ_k (p_k − q_k)² against target distributions q (N, K), with an analytic
    backward (decision 73); with class weights w (K,) Σ_k w_k q_k f(p_k) + λ·(Σ_k w_k q_k)·Σ_k (p_k − q_k)²
    (decision 96: ``F.cross_entropy``'s soft-target weighting, and the squared-error term scaled by the row's
    expected weight, which is w_y for a one-hot row).

    ``weight_fn(log_p) -> (loss, c)`` is the same elementwise function as :class:`TrueClassLoss`'s, applied to
    every class: f(p_k) and c_k = p_k f'(p_k). With one-hot q this is the hard-label loss. The gradient is
    q⊙c − p·Σ_k q_k c_k (q weighted), plus 2λ_i·(p⊙(p − q) − p·Σ_k p_k (p_k − q_k)) for the squared-error
    term. No gradient flows to the targets or the weights.
    """

    @staticmethod
    def forward(ctx, logits, q, weight_fn, brier_lambda, class_weight=None):
        log_p = torch.log_softmax(logits, dim=1)
        f, c = weight_fn(log_p)
        qw = q if class_weight is None else q * class_weight
        loss = (qw * f).sum(dim=1)
        lam = None
        if brier_lambda:
            lam = (
                torch.full_like(loss, brier_lambda)
                if class_weight is None
                else brier_lambda * (q @ class_weight)
            )
            loss = loss + lam * (log_p.exp() - q).square().sum(dim=1)
        ctx.save_for_backward(log_p, q, qw * c, lam)
        return loss

    # one gradient argument per output, as in torch's own Functions (the base declares *grad_outputs)
    @staticmethod
    def backward(ctx, grad_loss):  # pyright: ignore[reportIncompatibleMethodOverride]
        log_p, q, qc, lam = ctx.saved_tensors
        p = torch.exp(log_p)
        grad = qc - p * qc.sum(dim=1, keepdim=True)
        if lam is not None:
            pd = p * (p - q)
            grad = grad + (2 * lam)[:, None] * (pd - p * pd.sum(dim=1, keepdim=True))
        return grad * grad_loss[:, None], None, None, None, None
