"""Parameterized probability adjustment (PPA, SPEC §7): one coefficient r ∈ [0, 1] that moves probability mass
toward the most likely class, fitted by the closed-form minimiser of the Brier score."""

from __future__ import annotations

import torch

from .._namespace import only_public as _only_public
from .base import Calibrator

__all__ = ["ParameterizedProbabilityAdjustment", "ppa_adjust", "ppa_coefficient", "ppa_target"]


def ppa_target(probs: torch.Tensor) -> torch.Tensor:
    """PPA's target t (N, K): t_k = 1/|A| for the classes k in A = {k : p_k = max_j p_j} and 0 elsewhere, so
    tied top classes share the mass. Ties are exact equality of ``probs`` in its own dtype."""
    top = probs == probs.amax(1, keepdim=True)
    return top.to(probs.dtype) / top.sum(1, keepdim=True).to(probs.dtype)


def ppa_adjust(probs: torch.Tensor, r: float) -> torch.Tensor:
    """The PPA map p' = (1 − r)·p + r·t (:func:`ppa_target`), row by row; rows keep summing to one."""
    return (1.0 - r) * probs + r * ppa_target(probs)


def ppa_coefficient(probs: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    """The Brier-optimal PPA coefficient for ``probs`` (N, K) and integer ``targets`` (N,).

    The Brier score Σ_i ‖p_i + r·d_i − e_{y_i}‖² with d_i = t_i − p_i is a quadratic in r, minimised at
    r* = −Σ_i (p_i − e_{y_i})·d_i / Σ_i ‖d_i‖² = 1 − Σ_i (t_i − e_{y_i})·d_i / Σ_i ‖d_i‖²; the coefficient
    is r* clipped to [0, 1] (exact for a convex quadratic), and 0 when Σ_i ‖d_i‖² = 0 (every row uniform
    or one-hot: the map is then the identity). The target t is found in the dtype of ``probs``; the sums
    are taken in float64 on its device.

    Each row's (t_i − e_{y_i})·d_i is 0 when y_i is a top class and 1/|A| − p_max + p_{y_i} ≥ 0 otherwise,
    so r* ≤ 1: only the lower clip acts (the upper one only absorbs rounding).

    Returns:
        (r, r*): the coefficient and the unconstrained minimiser (negative when moving toward the top class
        can only raise the Brier score, as on over-confident predictions).
    """
    t = ppa_target(probs).double()
    p = probs.double()
    d = t - p
    a = p.clone()
    a[torch.arange(p.shape[0], device=p.device), targets] -= 1.0
    den = d.square().sum()
    if not den > 0:
        return 0.0, 0.0
    r_star = float(-(a * d).sum() / den)
    return min(max(r_star, 0.0), 1.0), r_star


class ParameterizedProbabilityAdjustment(Calibrator):
    """Parameterized probability adjustment (PPA): p' = (1 − r)·p + r·t with p = softmax(z), where t puts
    mass 1/|A| on each class of the argmax set A of p (:func:`ppa_target`; tied top classes share it) and r ∈
    [0, 1] minimises the Brier score on the calibration set in closed form (:func:`ppa_coefficient`).

    r ≥ 0 can only sharpen: on over-confident predictions the unconstrained minimiser ``r_unconstrained_``
    is negative, the clip gives r = 0 and the map is the identity (PPA then leaves the probabilities as
    they are; use temperature scaling). The argmax set is kept: a top class gets (1 − r)·p_max + r/|A| and
    any other class (1 − r)·p_j ≤ (1 − r)·p_max (in floating point the top class keeps the highest value;
    two values can only tie where they tie in p or where r·t is below the rounding step).

    The definition is reconstructed from the description of torch-uncertainty's pull request #345
    ("PPAScaler", after eq. (15) of Shaker and Hüllermeier, 2025), whose code was not available; see
    docs/decisions.md, decision 174.

    Example:
        >>> import torch
        >>> from torchcal.calibrators import ParameterizedProbabilityAdjustment
        >>> probs = torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.4, 0.2], [0.6, 0.3, 0.1]], dtype=torch.float64)
        >>> ppa = ParameterizedProbabilityAdjustment().fit(probs.log(), torch.tensor([0, 1, 2]))
        >>> round(ppa.r_, 6)  # r* = 0.2 / 0.7
        0.285714
        >>> ppa.predict_proba(probs.log())[0] * 7  # (5/7)·p + (2/7)·(1, 0, 0)
        tensor([4.5000, 1.5000, 1.0000], dtype=torch.float64)
    """

    name = "ppa"
    fitted_attributes = ("r_", "r_unconstrained_")

    def _fit(self, logits, targets):
        probs = torch.softmax(logits.detach(), dim=1)
        self.r_, self.r_unconstrained_ = ppa_coefficient(probs, targets)

    def _transform(self, logits):
        return ppa_adjust(torch.softmax(logits, dim=1), self.r_)

    def transform_logits(self, logits) -> torch.Tensor:
        """The calibrated log-probabilities ln p' (N, K) (−inf for the other classes when r = 1)."""
        return self.transform(logits).log()


_only_public(__name__)
