"""Dirichlet calibration (Kull et al. 2019): full with ODIR or L2 regularisation, and diagonal (SPEC §7)."""

from __future__ import annotations

import math

import torch

from .._namespace import only_public as _only_public
from .._validation import check_bool, check_choice, check_float, check_positive_int
from . import _solvers as S
from .base import Calibrator

__all__ = ["DirichletCalibration", "DiagonalDirichletCalibration"]


def _log_probs(logits):
    """ℓ̄ = ln clip(softmax(z), tiny, 1 − tiny) of the dtype, computed as a clamped log_softmax."""
    return torch.log_softmax(logits, dim=1).clamp_(min=math.log(torch.finfo(logits.dtype).tiny))


class _Dirichlet(Calibrator):
    fitted_attributes = ("weight_", "bias_", "n_iter_", "solver_")
    # the subclasses' parameters
    reg_lambda: float
    reg_mu: float | None
    reg_norm: bool
    solver: str
    max_iter: int

    def check_params(self):
        self._check_common()
        return self

    def _check_common(self):
        lam = check_float(self.reg_lambda, "reg_lambda", low=0)
        mu = None if self.reg_mu is None else check_float(self.reg_mu, "reg_mu", low=0)
        check_bool(self.reg_norm, "reg_norm")
        check_choice(self.solver, "solver", ("auto", "newton", "lbfgs"))
        return lam, mu, check_positive_int(self.max_iter, "max_iter")

    def _finish(self, weight, bias, n_iter, converged, solver):
        S.warn_if_not_converged(type(self).__name__, converged, n_iter, solver, stacklevel=4)
        self.weight_ = weight.detach().clone()
        self.bias_ = bias.detach().clone()
        self.n_iter_ = int(n_iter)
        self.solver_ = solver

    def transform_logits(self, logits) -> torch.Tensor:
        """Calibrated logits W ℓ̄ + b (``weight_`` a matrix) or d ⊙ ℓ̄ + b (a vector)."""
        self._check_fitted()
        return self._logits(self._check_input(logits))

    def _logits(self, z):
        ell = _log_probs(z)
        w = self.weight_.to(device=z.device, dtype=z.dtype)
        b = self.bias_.to(device=z.device, dtype=z.dtype)
        return torch.addmm(b, ell, w.T) if w.dim() == 2 else torch.addcmul(b, ell, w)

    def _transform(self, logits):
        return torch.softmax(self._logits(logits), dim=1)


class DirichletCalibration(_Dirichlet):
    """Full Dirichlet calibration: ``softmax(W ℓ̄ + b)`` on the log-probabilities ℓ̄ = ln clip(softmax(z),
    tiny, 1 − tiny), with ODIR (off-diagonal and intercept) regularisation by default.

    As dirichletcal 0.5.3 and probmetrics' ``dircal`` (SPEC §7): W and b are measured after subtracting
    their last row from every row (the reference row, so the last class's logit is 0; ``weight_`` and
    ``bias_`` are stored that way), and the penalty acts on them:

    - ODIR (``reg_mu`` a number): λ Σ_{i≠j} W_ij² + μ Σ_i b_i²;
    - L2 (``reg_mu=None``): λ (Σ W_ij² + Σ b_i²), shrinking everything toward 0.

    With ``reg_norm=False`` (the reference's default) λ and μ are used as given; with ``reg_norm=True`` they
    are divided by K(K − 1) and K for ODIR (the paper's form), and λ by K(K + 1) for L2. The mean NLL plus
    the penalty is convex; it is minimised from W = I (minus the reference row), b = 0 by Newton's method
    for up to 23 classes (600 parameters) and by preconditioned L-BFGS above (``solver``). Can change
    the argmax.

    Args:
        reg_lambda: λ (default 1e-3, probmetrics' ``dircal``).
        reg_mu: μ for ODIR (default 1e-3); ``None`` selects L2.
        reg_norm: scale λ and μ by the number of entries they penalise.
        solver: ``"auto"``, ``"newton"`` or ``"lbfgs"``.
        max_iter: iteration limit (a fit that reaches it warns).

    References:
        M. Kull, M. Perello-Nieto, M. Kängsepp, T. Silva Filho, H. Song, P. Flach, "Beyond temperature
        scaling: Obtaining well-calibrated multi-class probabilities with Dirichlet calibration", NeurIPS
        2019, arXiv:1910.12656.

    Example:
        >>> import torch
        >>> from torchcal.calibrators import DirichletCalibration
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(3000, 3, generator=g, dtype=torch.float64)
        >>> y = torch.multinomial(torch.softmax(z, 1), 1, generator=g)[:, 0]
        >>> cal = DirichletCalibration().fit(3 * z, y)
        >>> cal.weight_[-1].tolist(), cal.solver_   # the reference row is 0
        ([0.0, 0.0, 0.0], 'newton')
        >>> [round(v, 2) for v in cal.weight_.diagonal().tolist()]
        [0.33, 0.31, 0.0]
    """

    name = "dirichlet_calibration"

    def __init__(
        self,
        reg_lambda: float = 1e-3,
        reg_mu: float | None = 1e-3,
        reg_norm: bool = False,
        solver: str = "auto",
        max_iter: int = 1000,
    ):
        self.reg_lambda = reg_lambda
        self.reg_mu = reg_mu
        self.reg_norm = reg_norm
        self.solver = solver
        self.max_iter = max_iter

    def _fit(self, logits, targets):
        lam, mu, max_iter = self._check_common()
        with torch.no_grad():
            ell = _log_probs(logits)
            k, dev = ell.shape[1], ell.device
            r = k - 1  # free rows: the last is the reference row
            eye = torch.eye(k, dtype=torch.float64, device=dev)
            if mu is not None:  # ODIR: off-diagonal entries and intercepts
                if self.reg_norm:
                    lam, mu = lam / (k * (k - 1)), mu / k
                w_weights = lam * (1 - eye[:r])
                b_weights = torch.full((r,), mu, dtype=torch.float64, device=dev)
            else:  # L2 on every entry
                if self.reg_norm:
                    lam = lam / (k * (k + 1))
                w_weights = torch.full((r, k), lam, dtype=torch.float64, device=dev)
                b_weights = torch.full((r,), lam, dtype=torch.float64, device=dev)
            weights = torch.cat([w_weights.reshape(-1), b_weights])
            w0 = eye[:r].clone()
            w0[:, -1] -= 1.0  # [I | 0] minus its last row
            x0 = torch.cat([w0.reshape(-1), torch.zeros(r, dtype=torch.float64, device=dev)]).to(ell.dtype)
            model = S.FullModel(ell, targets, penalty=S.ridge(weights), rows=r)
            theta, _, n_iter, converged, solver = S.minimize(model, x0, self.solver, max_iter)
            weight, bias = model.split(theta)
        self._finish(weight, bias, n_iter, converged, solver)


class DiagonalDirichletCalibration(_Dirichlet):
    """Diagonal Dirichlet calibration: ``softmax(d ⊙ ℓ̄ + b)``, dirichletcal's ``method="Diag"``.

    The same reference-row parametrisation and penalty as :class:`DirichletCalibration` applied to
    W = diag(d) minus its last row: ODIR therefore penalises λ (K − 1) d_K² (the −d_K entries of the last
    column are off the diagonal) and μ Σ_{k<K} (b_k − b_K)²; L2 penalises all of them including the
    diagonal. Initialised at d = 1, b = 0; solved by Newton's method (2K − 1 parameters) or L-BFGS above
    300 classes. ``weight_`` holds d, ``bias_`` holds b − b_K (last entry 0); predictions equal the
    reference's. Can change the argmax.

    References:
        M. Kull et al., NeurIPS 2019, arXiv:1910.12656.

    Example:
        >>> import torch
        >>> from torchcal.calibrators import DiagonalDirichletCalibration
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(3000, 3, generator=g, dtype=torch.float64)
        >>> y = torch.multinomial(torch.softmax(z, 1), 1, generator=g)[:, 0]
        >>> [round(v, 2) for v in DiagonalDirichletCalibration().fit(3 * z, y).weight_.tolist()]
        [0.34, 0.31, 0.36]
    """

    name = "diagonal_dirichlet_calibration"

    def __init__(
        self,
        reg_lambda: float = 1e-3,
        reg_mu: float | None = 1e-3,
        reg_norm: bool = False,
        solver: str = "auto",
        max_iter: int = 1000,
    ):
        self.reg_lambda = reg_lambda
        self.reg_mu = reg_mu
        self.reg_norm = reg_norm
        self.solver = solver
        self.max_iter = max_iter

    def _fit(self, logits, targets):
        lam, mu, max_iter = self._check_common()
        with torch.no_grad():
            ell = _log_probs(logits)
            k, dev = ell.shape[1], ell.device
            # logits d_k ℓ_k + (b_k − b_K) − d_K ℓ_K for k < K and 0 for K give the same softmax as
            # d ⊙ ℓ + [b − b_K, 0] (add d_K ℓ_K to every class): θ = [d (K), b − b_K (K − 1)]
            if mu is not None:
                if self.reg_norm:
                    lam, mu = lam / (k * (k - 1)), mu / k
                d_weights = torch.zeros(k, dtype=torch.float64, device=dev)
                d_weights[-1] = lam * (k - 1)
                b_weights = torch.full((k - 1,), mu, dtype=torch.float64, device=dev)
            else:
                if self.reg_norm:
                    lam = lam / (k * (k + 1))
                d_weights = torch.full((k,), lam, dtype=torch.float64, device=dev)
                d_weights[-1] = lam * (k - 1)  # d_K itself is removed by the reference row; −d_K, K − 1 times
                b_weights = torch.full((k - 1,), lam, dtype=torch.float64, device=dev)
            weights = torch.cat([d_weights, b_weights])
            x0 = torch.cat(
                [torch.ones(k, dtype=ell.dtype, device=dev), torch.zeros(k - 1, dtype=ell.dtype, device=dev)]
            )
            model = S.DiagModel(ell, targets, scale="class", bias="all_but_last", penalty=S.ridge(weights))
            theta, _, n_iter, converged, solver = S.minimize(model, x0, self.solver, max_iter)
            weight, bias = model.split(theta)
        self._finish(weight, bias, n_iter, converged, solver)


_only_public(__name__)
