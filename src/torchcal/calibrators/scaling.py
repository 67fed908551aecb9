"""Vector and matrix scaling (Guo et al. 2017): affine maps of the logits fitted by NLL."""

from __future__ import annotations

import warnings

import torch

from .._validation import check_float, check_positive_int
from .base import Calibrator

__all__ = ["VectorScaling", "MatrixScaling"]


def _warn_absent_classes(targets: torch.Tensor, k: int, name: str) -> None:
    """Warns when a class has no validation label: the NLL fit then drives its bias towards −∞, and its test
    probability collapses (to ~1e-9 or less) whatever the logits say."""
    absent = (torch.bincount(targets, minlength=k) == 0).nonzero().flatten().tolist()
    if absent:
        shown = ", ".join(map(str, absent[:10])) + (", ..." if len(absent) > 10 else "")
        warnings.warn(
            f"{name}: class{'es' if len(absent) > 1 else ''} {shown} ({len(absent)} of {k}) never appear in "
            "the validation labels, so the fit drives their probabilities towards 0 on every input; use more "
            "validation data, weight_decay > 0, or temperature scaling",
            RuntimeWarning,
            stacklevel=4,  # the caller of fit()
        )


class _AffineScaling(Calibrator):
    fitted_attributes = ("weight_", "bias_")
    _matrix = False

    def __init__(self, weight_decay: float = 0.0, max_iter: int = 500):
        self.weight_decay = weight_decay
        self.max_iter = max_iter

    def _fit(self, logits, targets):
        decay = check_float(self.weight_decay, "weight_decay", low=0)
        max_iter = check_positive_int(self.max_iter, "max_iter")
        z = logits.double()
        k = z.shape[1]
        _warn_absent_classes(targets, k, type(self).__name__)
        eye = torch.eye(k, dtype=torch.float64, device=z.device)
        w = eye.clone() if self._matrix else torch.ones(k, dtype=torch.float64, device=z.device)
        w.requires_grad_(True)
        b = torch.zeros(k, dtype=torch.float64, device=z.device, requires_grad=True)
        opt = torch.optim.LBFGS(
            [w, b],
            lr=1.0,
            max_iter=max_iter,
            tolerance_grad=1e-10,
            tolerance_change=1e-12,
            history_size=20,
            line_search_fn="strong_wolfe",
        )

        def closure():
            opt.zero_grad()
            out = z @ w.T + b if self._matrix else z * w + b
            loss = torch.nn.functional.cross_entropy(out, targets)
            if decay > 0:  # shrink towards the identity map (off-diagonal terms and bias, as in ODIR)
                ref = eye if self._matrix else torch.ones_like(w)
                loss = loss + decay * (((w - ref) ** 2).sum() + (b**2).sum())
            loss.backward()
            return loss

        opt.step(closure)
        self.weight_ = w.detach().cpu()
        self.bias_ = b.detach().cpu()

    def transform_logits(self, logits) -> torch.Tensor:
        """Calibrated logits."""
        self._check_fitted()
        z = self._check_input(logits)
        w = self.weight_.to(device=z.device, dtype=z.dtype)
        b = self.bias_.to(device=z.device, dtype=z.dtype)
        return z @ w.T + b if self._matrix else z * w + b

    def _transform(self, logits):
        return torch.softmax(self.transform_logits(logits), dim=1)


class VectorScaling(_AffineScaling):
    """Vector scaling: ``softmax(w ⊙ z + b)`` with per-class ``weight_`` (K,) and ``bias_`` (K,).

    Fitted by minimising validation NLL with L-BFGS (strong Wolfe line search, float64, deterministic on
    CPU) from the identity; ``weight_decay`` adds λ(‖w − 1‖² + ‖b‖²). Can change the argmax.

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

    Fitted like :class:`VectorScaling` from W = I; ``weight_decay`` adds λ(‖W − I‖² + ‖b‖²), which is
    advisable for many classes (K² parameters). Can change the argmax.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(3000, 3, generator=g)
        >>> y = torch.multinomial(torch.softmax(2 * z, 1), 1, generator=g).squeeze(1)
        >>> [round(v, 1) for v in MatrixScaling().fit(z, y).weight_.diagonal().tolist()]
        [1.7, 1.6, 1.8]
    """

    name = "matrix_scaling"
    _matrix = True
