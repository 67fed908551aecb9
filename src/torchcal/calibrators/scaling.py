"""Vector and matrix scaling (Guo et al. 2017): affine maps of the logits fitted by NLL."""

from __future__ import annotations

import math
import warnings

import torch

from .._validation import check_choice, check_float, check_positive_int
from . import _solvers as S
from .base import Calibrator
from .temperature import fit_temperature_nll

__all__ = ["VectorScaling", "MatrixScaling", "BiasCorrectedTemperatureScaling", "NoBiasVectorScaling"]


_NO_DECAY_ADVICE = "use more validation data or temperature scaling"
_NBVS_EFFECT = (
    "so the fit can only lower their probabilities, often down to a weight at the bound 0 (the logit 0 on "
    "every input)"
)


def _warn_absent_classes(
    targets: torch.Tensor,
    k: int,
    name: str,
    effect: str = "so the fit drives their probabilities towards 0 on every input",
    advice: str = "use more validation data, weight_decay > 0, or temperature scaling",
) -> None:
    """Warns when a class has no validation label: the NLL fit then drives its bias towards −∞, and its test
    probability collapses (to ~1e-9 or less) whatever the logits say; ``effect`` says what happens instead
    for a map without a bias, ``advice`` what to do."""
    absent = (torch.bincount(targets, minlength=k) == 0).nonzero().flatten().tolist()
    if absent:
        shown = ", ".join(map(str, absent[:10])) + (", ..." if len(absent) > 10 else "")
        warnings.warn(
            f"{name}: class{'es' if len(absent) > 1 else ''} {shown} ({len(absent)} of {k}) never appear in "
            f"the validation labels, {effect}; {advice}",
            RuntimeWarning,
            stacklevel=4,  # the caller of fit()
        )


class _AffineScaling(Calibrator):
    fitted_attributes = ("weight_", "bias_", "n_iter_", "solver_")
    _matrix = False

    def __init__(self, weight_decay: float = 0.0, max_iter: int = 500, solver: str = "auto"):
        self.weight_decay = weight_decay
        self.max_iter = max_iter
        self.solver = solver

    def check_params(self):
        check_float(self.weight_decay, "weight_decay", low=0)
        check_positive_int(self.max_iter, "max_iter")
        check_choice(self.solver, "solver", ("auto", "newton", "lbfgs"))
        return self

    def _fit(self, logits, targets):
        decay = check_float(self.weight_decay, "weight_decay", low=0)
        max_iter = check_positive_int(self.max_iter, "max_iter")
        check_choice(self.solver, "solver", ("auto", "newton", "lbfgs"))
        with torch.no_grad():
            z = logits
            k = z.shape[1]
            _warn_absent_classes(targets, k, type(self).__name__)
            beta = 1.0 / _warm_temperature(z, targets)  # warm start: the temperature-scaling solution
            dev = z.device
            if self._matrix:
                center = torch.cat(
                    [torch.eye(k, dtype=torch.float64, device=dev).reshape(-1), z.new_zeros(k)]
                )
                x0 = torch.cat([beta * torch.eye(k, dtype=z.dtype, device=dev).reshape(-1), z.new_zeros(k)])
                penalty = S.ridge(torch.full_like(center, decay), center.double()) if decay > 0 else None
                model = S.FullModel(z, targets, penalty=penalty)
            else:
                center = torch.cat([torch.ones(k, dtype=torch.float64, device=dev), z.new_zeros(k).double()])
                x0 = torch.cat([torch.full((k,), beta, dtype=z.dtype, device=dev), z.new_zeros(k)])
                penalty = S.ridge(torch.full_like(center, decay), center) if decay > 0 else None
                model = S.DiagModel(z, targets, scale="class", bias=True, penalty=penalty)
            theta, _, n_iter, converged, solver = S.minimize(model, x0, self.solver, max_iter)
        S.warn_if_not_converged(
            type(self).__name__,
            converged,
            n_iter,
            solver,
            "without weight_decay the NLL can have no finite minimiser",
        )
        weight, bias = model.split(theta)
        assert bias is not None  # both models fit a bias here
        self.weight_ = weight.detach().clone()
        self.bias_ = bias.detach().clone()
        self.n_iter_ = int(n_iter)
        self.solver_ = solver

    def transform_logits(self, logits) -> torch.Tensor:
        """Calibrated logits."""
        self._check_fitted()
        return self._logits(self._check_input(logits))

    def _logits(self, z):
        w = self.weight_.to(device=z.device, dtype=z.dtype)
        b = self.bias_.to(device=z.device, dtype=z.dtype)
        return torch.addmm(b, z, w.T) if self._matrix else torch.addcmul(b, z, w)

    def _transform(self, logits):
        return torch.softmax(self._logits(logits), dim=1)


def _warm_temperature(logits, targets) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a bound hit only moves the starting point
        return fit_temperature_nll(logits, targets)


class VectorScaling(_AffineScaling):
    """Vector scaling: ``softmax(w ⊙ z + b)`` with per-class ``weight_`` (K,) and ``bias_`` (K,).

    Fitted by minimising validation NLL (a convex problem) from the temperature-scaling solution
    (w = 1/T, b = 0): by Newton's method in float64 with the exact Hessian when it is cheap (≤ 600
    parameters and N·P² ≤ 2.5e9), else by L-BFGS with a strong-Wolfe line search in the input's dtype
    (``solver``: ``"auto"``, ``"newton"``, ``"lbfgs"``). ``weight_decay`` adds λ(‖w − 1‖² + ‖b‖²). Can
    change the argmax.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(2000, 3, generator=g)
        >>> y = torch.multinomial(torch.softmax(2 * z + torch.tensor([0.5, 0.0, 0.0]), 1), 1, generator=g).squeeze(1)
        >>> vs = VectorScaling().fit(z, y)
        >>> [round(v, 1) for v in vs.weight_.tolist()]
        [2.0, 2.1, 2.0]
    """

    name = "vector_scaling"


class MatrixScaling(_AffineScaling):
    """Matrix scaling: ``softmax(W z + b)`` with ``weight_`` (K, K) and ``bias_`` (K,).

    Fitted like :class:`VectorScaling` from W = I/T; ``weight_decay`` adds λ(‖W − I‖² + ‖b‖²), which is
    advisable for many classes (K² parameters). Can change the argmax. Without weight decay, W and b are
    determined up to a vector added to every row (softmax ignores a shift shared by the classes), so the
    fitted values along that direction depend on the solver's path (the thread count included) while the
    probabilities do not: compare ``W − W.mean(0)``, as below (the true map 2·I centres to 2·I − 2/3).

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(3000, 3, generator=g)
        >>> y = torch.multinomial(torch.softmax(2 * z, 1), 1, generator=g).squeeze(1)
        >>> w = MatrixScaling().fit(z, y).weight_
        >>> [round(v, 1) for v in (w - w.mean(0)).diagonal().tolist()]
        [1.3, 1.3, 1.4]
    """

    name = "matrix_scaling"
    _matrix = True


class BiasCorrectedTemperatureScaling(Calibrator):
    """Bias-corrected temperature scaling (BCTS): ``softmax(z / T + b)`` with one ``temperature_`` and a
    per-class ``bias_`` (K,), fitted by validation NLL without regularisation (Alexandari et al. 2020).

    The objective is convex in (1/T, b); it is minimised by Newton's method (float64, exact Hessian) from
    the temperature-scaling solution, or by L-BFGS when the Hessian is large (``solver``), within the
    reference's (``abstention``) bounds T ≥ 0, i.e. 1/T ≥ 0. When the unconstrained optimum has 1/T < 0
    (logits that carry no information on the labels, or anti-correlated ones), the bounded optimum is
    1/T = 0 with the biases refitted: ``temperature_`` is ``inf``, and the map gives softmax(b), the
    validation class frequencies, on every input (the reference's L-BFGS-B moves T towards that limit and
    stops at a large finite T). On logits the map is used as is (the reference centres log-probabilities
    only when given probabilities, which changes nothing here: a common shift of a row cancels in the
    softmax). Can change the argmax (the bias reorders classes); robust to label shift, which is what the
    bias is for.

    References:
        A. Alexandari, A. Kundaje, A. Shrikumar, "Maximum Likelihood with Bias-Corrected Calibration is
        Hard-To-Beat at Label Shift Adaptation", ICML 2020, arXiv:1901.06852.

    Example:
        >>> import torch
        >>> from torchcal.calibrators import BiasCorrectedTemperatureScaling
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(5000, 3, generator=g, dtype=torch.float64)
        >>> y = torch.multinomial(torch.softmax(z + torch.tensor([1.0, 0, 0]), 1), 1, generator=g)[:, 0]
        >>> bcts = BiasCorrectedTemperatureScaling().fit(2 * z, y)
        >>> round(bcts.temperature_, 2), [round(b, 2) for b in (bcts.bias_ - bcts.bias_[1]).tolist()]
        (2.0, [1.05, 0.0, -0.03])
    """

    name = "bias_corrected_temperature_scaling"
    fitted_attributes = ("temperature_", "bias_", "n_iter_", "solver_")

    def __init__(self, max_iter: int = 500, solver: str = "auto"):
        self.max_iter = max_iter
        self.solver = solver

    def check_params(self):
        check_positive_int(self.max_iter, "max_iter")
        check_choice(self.solver, "solver", ("auto", "newton", "lbfgs"))
        return self

    def _fit(self, logits, targets):
        max_iter = check_positive_int(self.max_iter, "max_iter")
        check_choice(self.solver, "solver", ("auto", "newton", "lbfgs"))
        with torch.no_grad():
            z = logits
            k = z.shape[1]
            _warn_absent_classes(targets, k, type(self).__name__, advice=_NO_DECAY_ADVICE)
            x0 = torch.cat([z.new_full((1,), 1.0 / _warm_temperature(z, targets)), z.new_zeros(k)])
            model = S.DiagModel(z, targets, scale="shared", bias=True)
            bounded = torch.zeros(k + 1, dtype=torch.bool, device=z.device)
            bounded[0] = True  # 1/T >= 0
            theta, _, n_iter, converged, solver = S.minimize_nonnegative(
                model, x0, bounded, self.solver, max_iter
            )
        S.warn_if_not_converged(type(self).__name__, converged, n_iter, solver)
        beta = float(theta[0])
        self.temperature_ = 1.0 / beta if beta > 0 else math.inf
        self.bias_ = theta[1:].detach().clone()
        self.n_iter_ = int(n_iter)
        self.solver_ = solver

    def transform_logits(self, logits) -> torch.Tensor:
        """Calibrated logits z / T + b."""
        self._check_fitted()
        return self._logits(self._check_input(logits))

    def _logits(self, z):
        return z / self.temperature_ + self.bias_.to(device=z.device, dtype=z.dtype)  # z / inf = 0

    def _transform(self, logits):
        return torch.softmax(self._logits(logits), dim=1)


class NoBiasVectorScaling(Calibrator):
    """No-bias vector scaling (NBVS): ``softmax(w ⊙ z)`` with a per-class ``weight_`` (K,) ≥ 0 and no bias,
    fitted by validation NLL without regularisation (Alexandari et al. 2020).

    Solved like :class:`BiasCorrectedTemperatureScaling`, from w = 1/T, within the reference's bounds
    w ≥ 0: when the unconstrained optimum has negative weights (typically for a class absent from the
    validation labels), an active set holds weights at 0 and re-solves for the others until the KKT
    conditions hold (:func:`~torchcal.calibrators._solvers.minimize_nonnegative`); a weight of 0 gives its
    class the logit 0 on every input. Unlike BCTS the map is not invariant to a common shift of a row of
    logits (w differs by class), so pass the logits the model produced; the reference, given
    probabilities, uses centred log-probabilities. Can change the argmax.

    References:
        A. Alexandari, A. Kundaje, A. Shrikumar, ICML 2020, arXiv:1901.06852.

    Example:
        >>> import torch
        >>> from torchcal.calibrators import NoBiasVectorScaling
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(5000, 3, generator=g, dtype=torch.float64)
        >>> y = torch.multinomial(torch.softmax(z * torch.tensor([1.0, 0.5, 0.5]), 1), 1, generator=g)[:, 0]
        >>> [round(w, 1) for w in NoBiasVectorScaling().fit(z, y).weight_.tolist()]
        [1.0, 0.5, 0.5]
    """

    name = "no_bias_vector_scaling"
    fitted_attributes = ("weight_", "n_iter_", "solver_")

    def __init__(self, max_iter: int = 500, solver: str = "auto"):
        self.max_iter = max_iter
        self.solver = solver

    def check_params(self):
        check_positive_int(self.max_iter, "max_iter")
        check_choice(self.solver, "solver", ("auto", "newton", "lbfgs"))
        return self

    def _fit(self, logits, targets):
        max_iter = check_positive_int(self.max_iter, "max_iter")
        check_choice(self.solver, "solver", ("auto", "newton", "lbfgs"))
        with torch.no_grad():
            z = logits
            k = z.shape[1]
            _warn_absent_classes(targets, k, type(self).__name__, _NBVS_EFFECT, _NO_DECAY_ADVICE)
            x0 = z.new_full((k,), 1.0 / _warm_temperature(z, targets))
            model = S.DiagModel(z, targets, scale="class", bias=False)
            bounded = torch.ones(k, dtype=torch.bool, device=z.device)
            theta, _, n_iter, converged, solver = S.minimize_nonnegative(
                model, x0, bounded, self.solver, max_iter
            )
        S.warn_if_not_converged(type(self).__name__, converged, n_iter, solver)
        self.weight_ = theta.detach().clone()
        self.n_iter_ = int(n_iter)
        self.solver_ = solver

    def transform_logits(self, logits) -> torch.Tensor:
        """Calibrated logits w ⊙ z."""
        self._check_fitted()
        return self._logits(self._check_input(logits))

    def _logits(self, z):
        return z * self.weight_.to(device=z.device, dtype=z.dtype)

    def _transform(self, logits):
        return torch.softmax(self._logits(logits), dim=1)
