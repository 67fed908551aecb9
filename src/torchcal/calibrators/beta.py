"""Beta calibration (Kull, Silva Filho, Flach 2017): binary / per label, and one-vs-rest for softmax outputs."""

from __future__ import annotations

import math

import torch

from .._namespace import only_public as _only_public
from .._validation import check_positive_int
from .base import Calibrator
from .binary import BinaryCalibrator

__all__ = ["BetaCalibration", "BinaryBetaCalibration", "fit_beta"]

#: float32 machine epsilon: betacal clips s to [eps, 1 − eps] of the dtype, and probmetrics passes float32.
BETA_EPS = float(torch.finfo(torch.float32).eps)


def _beta_features(log_s, log_1ms, dim: int = -1):
    """[ln s, −ln(1 − s)] of s clipped to [eps, 1 − eps], from ln s and ln(1 − s), stacked along ``dim``."""
    lo, hi = math.log(BETA_EPS), math.log1p(-BETA_EPS)
    return torch.stack([log_s.clamp(lo, hi), -log_1ms.clamp(lo, hi)], dim=dim)


#: Newton's early, damped iterations run on every k-th row when N is large (see _logistic_newton)
WARM_ROWS = 8192
#: each problem's subsample must hold this many positives and negatives, or the warm start is skipped
WARM_MIN_EACH = 50


def _logistic_newton(x, t, active, max_iter: int):
    """:func:`_newton_batch` from a warm start when N ≥ 4 · ``WARM_ROWS``: the same regressions, first
    solved on every (N // ``WARM_ROWS``)-th row to a Newton decrement² of 1e-6 (at most 20 iterations),
    whose solution lies within sampling error of the full one. The full-data iterations then start near
    Newton's quadratic phase: 4 steps instead of 8 at 50k rows. The stopping rule on the full data is
    unchanged, so the result is the full problem's optimum to the same tolerance. It is skipped when a
    subsample holds fewer than ``WARM_MIN_EACH`` positives or negatives (its optimum could be far off or at
    infinity)."""
    n = x.shape[2]
    theta0 = None
    if n >= 4 * WARM_ROWS:
        stride = n // WARM_ROWS
        ts = t[:, ::stride]
        pos = ts.sum(1)
        if bool(((pos >= WARM_MIN_EACH) & (ts.shape[1] - pos >= WARM_MIN_EACH)).all()):
            theta0 = _newton_batch(x[:, :, ::stride], ts, active, min(max_iter, 20), tol=1e-6)
    return _newton_batch(x, t, active, max_iter, theta0=theta0)


def _newton_batch(x, t, active, max_iter: int, theta0=None, tol: float = 1e-14):
    """Unregularised logistic regressions, batched over the leading dimension: x (B, 2, N) features plus an
    intercept, t (B, N) 0/1 targets, ``active`` (B, 2) which features each problem uses (an inactive
    coefficient stays 0). Newton's method with step halving per problem, float64. Returns (B, 3):
    (coef_1, coef_2, intercept). Starts at ``theta0`` (default 0); a problem stops moving once its Newton
    decrement² is at most ``tol``.

    The logit s = θ₁x₁ + θ₂x₂ + θ₃ is formed once per trial point (the accepted trial's is reused for the
    gradient and Hessian), and Σ t·s is linear in θ (tᵀ[x₁, x₂, 1] is computed once), so a Newton step
    costs one sigmoid, the weighted features and one batched matrix product that gives the gradient and
    the Hessian together."""
    b, _, n = x.shape
    x = x * active[:, :, None]
    tx = torch.cat([(x @ t[:, :, None])[..., 0], t.sum(1, keepdim=True)], 1) / n  # (B, 3): mean t·[x, 1]
    mask = torch.cat([active, torch.ones_like(active[:, :1])], 1)
    theta = torch.zeros(b, 3, dtype=x.dtype, device=x.device)

    def logit(th):
        return torch.baddbmm(th[:, 2:3, None], th[:, None, :2], x)[:, 0]  # (B, N)

    def loss(s, th):  # mean softplus(s) − t·s at θ = th, s = logit(th)
        return torch.nn.functional.softplus(s).mean(1) - (tx * th).sum(1)

    if theta0 is None:
        s = torch.zeros_like(t)  # the logit at θ = 0, where the loss is ln 2
        current = torch.full_like(t[:, 0], math.log(2.0))
    else:
        theta = theta0 * mask
        s = logit(theta)
        current = loss(s, theta)
    eye = torch.eye(3, dtype=x.dtype, device=x.device)
    design = torch.cat([x, torch.ones_like(x[:, :1])], 1)  # (B, 3, N)
    weighted = torch.empty(b, 4, n, dtype=x.dtype, device=x.device)  # [μ, w x₁, w x₂, w], w = μ(1 − μ)
    for _ in range(max_iter):
        mu = torch.sigmoid(s)
        w = mu * (1 - mu)
        weighted[:, 0] = mu
        torch.mul(x, w[:, None, :], out=weighted[:, 1:3])
        weighted[:, 3] = w
        sums = (design @ weighted.transpose(1, 2)) / n  # (B, 3, 4): mean [x, 1]·μ, then the Hessian
        grad = (sums[:, :, 0] - tx) * mask
        hess = (
            sums[:, :, 1:] * (mask[:, :, None] * mask[:, None, :])
            + eye * (1 - mask)[:, None, :]
            + 1e-12 * eye
        )
        step = torch.linalg.solve(hess, grad[:, :, None])[..., 0]
        decrement = (grad * step).sum(1)  # Newton decrement² of each problem
        active_rows = decrement > tol  # converged problems stop moving
        if not bool(active_rows.any()):
            break
        step = step * active_rows[:, None]
        scale = torch.ones(b, 1, dtype=x.dtype, device=x.device)
        candidate, value, bad, s_new = theta, current, active_rows, s  # (set again by the loop, which runs)
        for _ in range(30):  # halve the step of the problems whose loss did not decrease enough
            candidate = theta - scale * step
            s_new = logit(candidate)
            value = loss(s_new, candidate)
            bad = active_rows & (value > current - 1e-4 * scale[:, 0] * decrement)
            if not bool(bad.any()):
                break
            scale = torch.where(bad[:, None], scale / 2, scale)
        else:  # no decrease at all (round-off at the optimum): keep the old point for those
            keep = bad[:, None]
            candidate = torch.where(keep, theta, candidate)
            value = torch.where(bad, current, value)
            s_new = torch.where(keep, s, s_new)
        theta, current, s = candidate, value, s_new
    return theta


def fit_beta(log_s, log_1ms, targets, max_iter: int = 100):
    """Beta calibration "abm" maps for a batch of binary problems, betacal's procedure: a logistic regression
    on [ln s, −ln(1 − s)] with an intercept; if the coefficient a of ln s is negative, refit on −ln(1 − s)
    alone (a = 0), else if b is negative, refit on ln s alone (b = 0); the refit is not re-checked.

    Args:
        log_s, log_1ms: ln s and ln(1 − s), (B, N) (s is clipped to [eps, 1 − eps], eps = float32's).
        targets: (B, N) in {0, 1}.

    Returns:
        (B, 3) float64: (a, b, c) with μ(s) = σ(a ln s − b ln(1 − s) + c).
    """
    x = _beta_features(log_s, log_1ms, dim=1).double()  # (B, 2, N)
    t = targets.double()
    active = torch.ones(x.shape[0], 2, dtype=torch.float64, device=x.device)
    theta = _logistic_newton(x, t, active, max_iter)
    refit = active.clone()
    refit[theta[:, 0] < 0, 0] = 0.0
    refit[(theta[:, 0] >= 0) & (theta[:, 1] < 0), 1] = 0.0
    redo = (refit < 1).any(1)
    if bool(redo.any()):
        theta[redo] = _logistic_newton(x[redo], t[redo], refit[redo], max_iter)
    return theta


def _beta_map(params, log_s, log_1ms):
    x = _beta_features(log_s, log_1ms).to(params.dtype)
    return torch.sigmoid(x[..., 0] * params[:, 0:1] + x[..., 1] * params[:, 1:2] + params[:, 2:3])


class BinaryBetaCalibration(BinaryCalibrator):
    """Beta calibration per label (the "abm" family): μ(s) = σ(a ln s − b ln(1 − s) + c) for s = σ(z),
    with a, b ≥ 0 (betacal 1.1.0's procedure: an unregularised logistic regression, a negative coefficient
    dropped and the regression refitted once). ``params_`` (L, 3) holds (a, b, c). Monotone non-decreasing in s, so it never reorders the scores of a
    label.

    References:
        M. Kull, T. Silva Filho, P. Flach, "Beta calibration: a well-founded and easily implemented
        improvement on logistic calibration for binary classifiers", AISTATS 2017.

    Example:
        >>> import torch
        >>> from torchcal.calibrators import BinaryBetaCalibration
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(20000, generator=g)
        >>> y = (torch.rand(20000, generator=g) < torch.sigmoid(0.5 * z + 0.3)).float()
        >>> [round(v, 2) for v in BinaryBetaCalibration().fit(z, y).params_[0].tolist()]
        [0.48, 0.51, 0.29]
    """

    name = "beta"
    fitted_attributes = ("params_",)

    def __init__(self, max_iter: int = 100):
        self.max_iter = max_iter

    def check_params(self):
        check_positive_int(self.max_iter, "max_iter")
        return self

    def _fit(self, logits, targets):
        max_iter = check_positive_int(self.max_iter, "max_iter")
        ls, l1 = torch.nn.functional.logsigmoid(logits), torch.nn.functional.logsigmoid(-logits)
        self.params_ = fit_beta(ls.T, l1.T, targets.T, max_iter)

    def _transform(self, logits):
        ls, l1 = torch.nn.functional.logsigmoid(logits), torch.nn.functional.logsigmoid(-logits)
        return _beta_map(self.params_.to(logits.device), ls.T, l1.T).T


class BetaCalibration(Calibrator):
    """Beta calibration for softmax outputs, one-vs-rest (probmetrics'
    ``MulticlassOneVsRestCalibrator(BetacalCalibrator())``): class k gets a binary beta map fitted on
    (p_k, 1[y = k]) (see :class:`BinaryBetaCalibration`); the K outputs are floored at 1e-30 and divided by
    their row sum. ``params_`` (K, 3) holds each class's (a, b, c). Can change the argmax (the classes'
    maps differ).

    References:
        M. Kull, T. Silva Filho, P. Flach, AISTATS 2017.

    Example:
        >>> import torch
        >>> from torchcal.calibrators import BetaCalibration
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(5000, 3, generator=g, dtype=torch.float64)
        >>> y = torch.multinomial(torch.softmax(z, 1), 1, generator=g)[:, 0]
        >>> probs = BetaCalibration().fit(3 * z, y).transform(3 * z)
        >>> probs.shape, round(float(probs.sum(1).max()), 6)
        (torch.Size([5000, 3]), 1.0)
    """

    name = "beta_calibration"
    fitted_attributes = ("params_",)

    def __init__(self, max_iter: int = 100):
        self.max_iter = max_iter

    @staticmethod
    def _logs(logits):
        ell = torch.log_softmax(logits.double(), dim=1)
        # ln(1 − p_k) by log1p(−p_k), and by ln(−expm1(ln p_k)) (stable for p_k near 1) where p_k > 1/2: only
        # a row's largest entry can be, so that form is evaluated on the row maxima alone
        top = ell.amax(1, keepdim=True)
        l1 = torch.where(ell > -math.log(2), torch.log(-torch.expm1(top)), torch.log1p(-torch.exp(ell)))
        return ell.T, l1.T

    def check_params(self):
        check_positive_int(self.max_iter, "max_iter")
        return self

    def _fit(self, logits, targets):
        max_iter = check_positive_int(self.max_iter, "max_iter")
        k = logits.shape[1]
        onehot = (targets[None, :] == torch.arange(k, device=logits.device)[:, None]).double()
        ls, l1 = self._logs(logits)
        self.params_ = fit_beta(ls, l1, onehot, max_iter)

    def _transform(self, logits):
        ls, l1 = self._logs(logits)
        out = _beta_map(self.params_.to(logits.device), ls, l1).T.clamp_min(1e-30)
        return (out / out.sum(1, keepdim=True)).to(logits.dtype)


_only_public(__name__)
