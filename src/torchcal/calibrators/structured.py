"""Structured vector and matrix scaling (SVS, SMS; Berta et al. 2026), as probmetrics 1.3 fits them (SPEC §7).

Both start from temperature-scaled, uniformly mixed log-probabilities and fit a ridge-regularised affine
map on them, shrunk toward the identity (toward the temperature-scaling solution).
"""

from __future__ import annotations

import math
import warnings

import torch

from .._namespace import only_public as _only_public
from .._validation import check_choice, check_float, check_positive_int
from . import _solvers as S
from .base import Calibrator
from .temperature import fit_temperature_nll

__all__ = ["StructuredVectorScaling", "StructuredMatrixScaling", "TAU32"]

#: ln(float32 tiny) = −87.3365: the floor probmetrics puts under every log-probability.
TAU32 = math.log(torch.finfo(torch.float32).tiny)
_SOLVERS = ("auto", "newton", "lbfgs")


def _log_probs(logits):
    """ℓ̂ = max(log_softmax(z), τ32)."""
    return torch.log_softmax(logits, dim=1).clamp_(min=TAU32)


def _ts_mix_fit(lhat, targets):
    """β of probmetrics' ``ts-mix`` pre-step: the root of d NLL(softmax(β ℓ̂))/dβ over β ∈ [e⁻¹⁶, e¹⁶]
    for ℓ̂ = :func:`_log_probs` of the logits."""
    with warnings.catch_warnings():  # probmetrics' bisection silently stops at the edge of its interval
        warnings.simplefilter("ignore")
        temperature = fit_temperature_nll(lhat, targets, bounds=(math.exp(-16), math.exp(16)))
    return 1.0 / temperature


def _ts_mix_features(logits, beta: float, epsilon: float, lhat=None):
    """f = max(ln((1 − ε) softmax(β ℓ̂) + ε/K), τ32): un-centred log-probabilities of the mixture (``lhat``,
    ℓ̂ of the logits if given, is overwritten)."""
    k = logits.shape[1]
    t = (_log_probs(logits) if lhat is None else lhat).mul_(beta)
    # softmax by exp of the row-shifted values, scaled by (1 − ε)/row sum: one log for the mixture (as
    # exact as ln's rounding, where a log-softmax would round ln q before mixing)
    q = t.sub_(t.amax(1, keepdim=True)).exp_()
    q.mul_((1 - epsilon) / q.sum(1, keepdim=True)).add_(epsilon / k)
    return q.log_().clamp_(min=TAU32)


class _Structured(Calibrator):
    fitted_attributes = ("beta_", "epsilon_", "weight_", "bias_", "n_iter_", "solver_")
    # the subclasses' parameters
    solver: str
    max_iter: int

    def check_params(self):
        for name in ("lambda_diagonal", "lambda_off_diagonal", "lambda_intercept"):
            if hasattr(self, name):
                check_float(getattr(self, name), name, low=0)
        self._check_common()
        return self

    def _check_common(self):
        check_choice(self.solver, "solver", _SOLVERS)
        return check_positive_int(self.max_iter, "max_iter")

    def _features(self, logits, targets):
        n = logits.shape[0]
        lhat = _log_probs(logits)
        beta = _ts_mix_fit(lhat, targets)
        epsilon = 1.0 / (n + 1)
        return beta, epsilon, _ts_mix_features(logits, beta, epsilon, lhat=lhat)

    def _finish(self, model, beta, epsilon, theta, n_iter, converged, solver):
        weight, bias = model.split(theta)
        S.warn_if_not_converged(type(self).__name__, converged, n_iter, solver, stacklevel=4)
        self.beta_ = float(beta)
        self.epsilon_ = float(epsilon)
        self.weight_ = weight.detach().clone()
        self.bias_ = bias.detach().clone()
        self.n_iter_ = int(n_iter)
        self.solver_ = solver

    def transform_logits(self, logits) -> torch.Tensor:
        """Calibrated logits (softmax gives :meth:`transform`)."""
        self._check_fitted()
        return self._logits(self._check_input(logits))

    def _logits(self, z):
        f = _ts_mix_features(z, self.beta_, self.epsilon_)
        w = self.weight_.to(device=z.device, dtype=z.dtype)
        b = self.bias_.to(device=z.device, dtype=z.dtype)
        return torch.addmm(b, f, w.T) if w.dim() == 2 else torch.addcmul(b, f, w)

    def _transform(self, logits):
        return torch.softmax(self._logits(logits), dim=1)


class StructuredVectorScaling(_Structured):
    """Structured vector scaling (SVS): ``softmax(v ⊙ f + b)`` on the log-probabilities ``f`` of the
    temperature-scaled, uniformly mixed softmax, with a ridge toward v = 1, b = 0 (probmetrics 1.3 ``svs``).

    Fitting, in three stages (SPEC §7):

    1. ``ts-mix``: β minimising validation NLL of softmax(β ℓ̂), ℓ̂ = max(log_softmax(z), τ32), τ32 = ln
       float32 tiny (``beta_``);
    2. the mixture q̃ = (1 − ε) softmax(β ℓ̂) + ε/K with ε = 1/(N_cal + 1) (``epsilon_``, also used at
       predict time), and f = max(ln q̃, τ32), neither centred nor re-logit'd;
    3. minimise mean NLL(softmax((1 + δ) ⊙ f + b)) + λ_v‖δ‖² + λ_b‖b‖² from δ = b = 0, with
       λ_v = ``lambda_diagonal`` · K/N and λ_b = ``lambda_intercept`` · K/N (no ½).

    The objective is convex; it is minimised by Newton's method (float64, exact Hessian) when the Hessian is
    cheap and by L-BFGS with a strong-Wolfe line search (in the input's dtype) otherwise (``solver``).
    Can change the argmax (the per-class scales and biases reorder classes).

    Args:
        lambda_diagonal: ridge strength on δ = v − 1, in units of K/N.
        lambda_intercept: ridge strength on b, in units of K/N.
        solver: ``"auto"`` (Newton for ≤ 600 parameters and N·P² ≤ 2.5e9, else L-BFGS), ``"newton"``,
            ``"lbfgs"``.
        max_iter: iteration limit of the solver (a fit that reaches it warns).

    Attributes: ``beta_``, ``epsilon_``, ``weight_`` (v, (K,)), ``bias_`` (b, (K,)), ``n_iter_``,
    ``solver_``.

    References:
        E. Berta, D. Holzmüller, M. I. Jordan, F. Bach, "Structured Matrix Scaling for Multi-Class
        Calibration", AISTATS 2026, arXiv:2511.03685.

    Example:
        >>> import torch
        >>> from torchcal.calibrators import StructuredVectorScaling
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(4000, 4, generator=g, dtype=torch.float64)
        >>> y = torch.multinomial(torch.softmax(z + torch.tensor([0.8, 0, 0, 0]), 1), 1, generator=g)[:, 0]
        >>> svs = StructuredVectorScaling().fit(3 * z, y)   # over-confident and biased against class 0
        >>> round(svs.beta_, 2), svs.solver_
        (0.3, 'newton')
        >>> [round(b, 2) for b in (svs.bias_ - svs.bias_.mean()).tolist()]
        [0.51, -0.15, -0.11, -0.26]
    """

    name = "structured_vector_scaling"

    def __init__(
        self,
        lambda_diagonal: float = 1.0,
        lambda_intercept: float = 1.0,
        solver: str = "auto",
        max_iter: int = 1000,
    ):
        self.lambda_diagonal = lambda_diagonal
        self.lambda_intercept = lambda_intercept
        self.solver = solver
        self.max_iter = max_iter

    def _fit(self, logits, targets):
        lam_v = check_float(self.lambda_diagonal, "lambda_diagonal", low=0)
        lam_b = check_float(self.lambda_intercept, "lambda_intercept", low=0)
        max_iter = self._check_common()
        with torch.no_grad():
            beta, epsilon, f = self._features(logits, targets)
            n, k = f.shape
            weights = torch.cat([torch.full((k,), lam_v * k / n), torch.full((k,), lam_b * k / n)])
            weights = weights.to(device=f.device, dtype=torch.float64)
            model = S.DiagModel(f, targets, scale="class", bias=True, scale0=1.0, penalty=S.ridge(weights))
            x0 = torch.zeros(2 * k, dtype=f.dtype, device=f.device)
            theta, _, n_iter, converged, solver = S.minimize(model, x0, self.solver, max_iter)
        self._finish(model, beta, epsilon, theta, n_iter, converged, solver)


class StructuredMatrixScaling(_Structured):
    """Structured matrix scaling (SMS): ``softmax((I + Δ) f + b)`` on the same features as
    :class:`StructuredVectorScaling`, with ridges toward Δ = 0, b = 0 of strengths λ_d = ``lambda_diagonal``
    · K/N on the diagonal of Δ, λ_o = ``lambda_off_diagonal`` · K(K − 1)/N on its off-diagonal entries and
    λ_b = ``lambda_intercept`` · K/N on b (probmetrics 1.3 ``sms``, its default multiclass ``logistic``
    calibrator). Row k of the logits is Σ_j (I + Δ)_kj f_j + b_k. Can change the argmax.

    Solved like SVS (Newton for small K, L-BFGS with a strong-Wolfe line search above ≈ 20 classes).

    Attributes: ``beta_``, ``epsilon_``, ``weight_`` (I + Δ, (K, K)), ``bias_`` (K,), ``n_iter_``,
    ``solver_``.

    References:
        E. Berta, D. Holzmüller, M. I. Jordan, F. Bach, "Structured Matrix Scaling for Multi-Class
        Calibration", AISTATS 2026, arXiv:2511.03685.

    Example:
        >>> import torch
        >>> from torchcal.calibrators import StructuredMatrixScaling
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(4000, 3, generator=g, dtype=torch.float64)
        >>> y = torch.multinomial(torch.softmax(z, 1), 1, generator=g)[:, 0]
        >>> sms = StructuredMatrixScaling().fit(2 * z, y)
        >>> sms.weight_.shape, round(sms.beta_, 2)
        (torch.Size([3, 3]), 0.52)
    """

    name = "structured_matrix_scaling"

    def __init__(
        self,
        lambda_diagonal: float = 1.0,
        lambda_off_diagonal: float = 1.0,
        lambda_intercept: float = 1.0,
        solver: str = "auto",
        max_iter: int = 1000,
    ):
        self.lambda_diagonal = lambda_diagonal
        self.lambda_off_diagonal = lambda_off_diagonal
        self.lambda_intercept = lambda_intercept
        self.solver = solver
        self.max_iter = max_iter

    def _fit(self, logits, targets):
        lam_d = check_float(self.lambda_diagonal, "lambda_diagonal", low=0)
        lam_o = check_float(self.lambda_off_diagonal, "lambda_off_diagonal", low=0)
        lam_b = check_float(self.lambda_intercept, "lambda_intercept", low=0)
        max_iter = self._check_common()
        with torch.no_grad():
            beta, epsilon, f = self._features(logits, targets)
            n, k = f.shape
            eye = torch.eye(k, dtype=torch.float64, device=f.device)
            w_mat = lam_d * k / n * eye + lam_o * k * (k - 1) / n * (1 - eye)
            weights = torch.cat([w_mat.reshape(-1), torch.full((k,), lam_b * k / n, device=f.device)])
            model = S.FullModel(f, targets, weight0=eye.to(f.dtype), penalty=S.ridge(weights))
            x0 = torch.zeros(k * k + k, dtype=f.dtype, device=f.device)
            theta, _, n_iter, converged, solver = S.minimize(model, x0, self.solver, max_iter)
        self._finish(model, beta, epsilon, theta, n_iter, converged, solver)


_only_public(__name__)
