"""Bayesian binning into quantiles (BBQ, Naeini, Cooper, Hauskrecht 2015): a Bayesian average of equal-frequency
histogram binnings, one-vs-rest for softmax outputs and per label for sigmoid outputs (SPEC §7)."""

from __future__ import annotations

import math

import torch

from .._namespace import only_public as _only_public
from .._validation import check_float
from .base import Calibrator
from .binary import BinaryCalibrator

__all__ = ["BBQ", "BinaryBBQ", "bbq_bin_counts", "bbq_binning"]


def bbq_bin_counts(n: int, c: float = 10.0) -> range:
    """The numbers of bins BBQ averages over for ``n`` calibration scores: B from max(1, ⌊n^{1/3}/C⌋) to
    min(⌈n/5⌉, ⌈C·n^{1/3}⌉) (the paper's range, as pycalib computes it; at least one model)."""
    root = n ** (1 / 3)
    low = int(max(1, math.floor(root / c)))
    high = int(min(math.ceil(n / 5), math.ceil(c * root)))
    return range(low, max(low, high) + 1)


def bbq_binning(scores: torch.Tensor, positives: torch.Tensor, bins: int, prior_strength: float = 2.0):
    """One equal-frequency binning model of BBQ for B binary problems at once.

    The edges are the linear-interpolation quantiles j/``bins`` (j = 0..bins) of the calibration scores
    (numpy's default ``np.quantile``), with the outer edges set to 0 and 1 and made non-decreasing. A score
    s falls in bin b when edge_b ≤ s < edge_{b+1} (the last bin includes 1). The model's log marginal
    likelihood is the BDeu score with equivalent sample size N' = ``prior_strength`` and Beta priors centred
    on the bin midpoints p̄_b: Σ_b lnΓ(N'/B) − lnΓ(N_b + N'/B) + lnΓ(m_b + α_b) − lnΓ(α_b) + lnΓ(n_b + β_b)
    − lnΓ(β_b), α_b = (N'/B)·p̄_b, β_b = (N'/B)(1 − p̄_b) (floored at the float64 ``tiny`` for a bin of zero
    width at 0 or 1), where N_b, m_b and n_b count the scores, positives and negatives in bin b. The bin's
    prediction is its empirical frequency m_b / N_b, or p̄_b for an empty bin.

    Args:
        scores: (B, N) float64 calibration scores, sorted along dim 1.
        positives: (B, N + 1) float64 cumulative counts of positive labels in that order (starting at 0).
        bins: the number of bins.
        prior_strength: N'.

    Returns:
        (edges (B, bins + 1), predictions (B, bins), log marginal likelihood (B,)).
    """
    n = scores.shape[1]
    dtype, device = scores.dtype, scores.device
    # numpy's linspace and linear-quantile index arithmetic, operation for operation: a score equal to an
    # edge then falls in the same bin as with np.quantile (q (n − 1) in another rounding can land an edge
    # one ulp to the other side of a calibration score)
    q = torch.arange(bins + 1, dtype=dtype, device=device) * (1.0 / bins)
    where = (n * q + (1 + q * -1.0)) - 1
    lo = where.floor()
    frac = where - lo
    lo = lo.long().clamp(0, n - 1)
    hi = (lo + 1).clamp(max=n - 1)
    a, b = scores[:, lo], scores[:, hi]
    edges = torch.lerp(a, b, frac.expand_as(a))
    edges[:, 0], edges[:, -1] = 0.0, 1.0
    edges = torch.cummax(edges, dim=1).values
    # counts below each inner edge, from the sorted scores: bin b holds [edge_b, edge_{b+1})
    below = torch.searchsorted(scores, edges[:, 1:-1].contiguous(), right=False)
    zero = torch.zeros(scores.shape[0], 1, dtype=torch.long, device=device)
    full = torch.full_like(zero, n)
    bounds = torch.cat([zero, below, full], 1)  # (B, bins + 1)
    counts = bounds.diff(dim=1).to(dtype)
    pos = positives.gather(1, bounds).diff(dim=1)
    neg = counts - pos
    mid = (edges[:, :-1] + edges[:, 1:]) / 2
    a0 = prior_strength / bins
    tiny = torch.finfo(dtype).tiny
    alpha, beta = (a0 * mid).clamp_min(tiny), (a0 * (1 - mid)).clamp_min(tiny)
    log_ml = (
        math.lgamma(a0)
        - torch.lgamma(counts + a0)
        + torch.lgamma(pos + alpha)
        - torch.lgamma(alpha)
        + torch.lgamma(neg + beta)
        - torch.lgamma(beta)
    ).sum(1)
    predictions = torch.where(counts > 0, pos / counts.clamp_min(1), mid)
    return edges, predictions, log_ml


def _fit_bbq(scores: torch.Tensor, labels: torch.Tensor, c: float, prior_strength: float):
    """The averaged map of B binary problems as a step function: (weights (M, B), breakpoints (B, E),
    values (B, E + 1)), where a score s maps to values[searchsorted(breakpoints, s, right=True)].

    The models' weights are the softmax of their log marginal likelihoods (uniform model prior). The average
    Σ_M w_M θ_{M, bin_M(s)} changes only at the models' inner edges, by w_M (θ_{M, b+1} − θ_{M, b}) at edge
    b of model M, so its values are the cumulative sums of these jumps in edge order."""
    scores, order = torch.sort(scores, dim=1, stable=True)
    scores = scores.contiguous()
    y = labels.gather(1, order).to(scores.dtype)
    positives = torch.cat([torch.zeros_like(y[:, :1]), y.cumsum(1)], 1)
    models = [bbq_binning(scores, positives, b, prior_strength) for b in bbq_bin_counts(scores.shape[1], c)]
    weights = torch.softmax(torch.stack([m[2] for m in models]), dim=0)  # (M, B)
    base = torch.stack([w[:, None] * m[1][:, :1] for w, m in zip(weights, models)]).sum(0)  # every first bin
    edges = torch.cat([m[0][:, 1:-1] for m in models], 1)
    jumps = torch.cat([w[:, None] * m[1].diff(dim=1) for w, m in zip(weights, models)], 1)
    edges, order = torch.sort(edges, dim=1, stable=True)
    values = torch.cat([base, base + jumps.gather(1, order).cumsum(1)], 1)
    return weights, edges.contiguous(), values


def _apply_bbq(breakpoints, values, s):
    """The step function of :func:`_fit_bbq` at test scores s (B, n)."""
    return values.gather(1, torch.searchsorted(breakpoints, s, right=True))


class _BBQParams:
    def __init__(self, c: float = 10.0, prior_strength: float = 2.0):
        self.c = c
        self.prior_strength = prior_strength

    def _checked(self):
        return (
            check_float(self.c, "c", low=0.0, low_open=True),
            check_float(self.prior_strength, "prior_strength", low=0.0, low_open=True),
        )


class BBQ(_BBQParams, Calibrator):
    """Bayesian binning into quantiles for softmax outputs, one-vs-rest (SPEC §7, the paper's form).

    Class k uses the binary score s = p_k = softmax(z)_k and the labels 1[y = k]. BBQ averages equal-frequency
    histogram binnings with B = max(1, ⌊N^{1/3}/C⌋) … min(⌈N/5⌉, ⌈C N^{1/3}⌉) bins (:func:`bbq_bin_counts`),
    each weighted by its BDeu marginal likelihood with equivalent sample size N' = ``prior_strength`` and
    Beta priors centred on the bin midpoints (:func:`bbq_binning`); a bin predicts its empirical frequency.
    The K per-class outputs are floored at 1e-30 and divided by their row sum (as probmetrics'
    one-vs-rest wrapper does). Can change the argmax (the classes' maps differ).

    netcal's ``BBQ`` (what probmetrics wraps) is another variant: equal-width bins by default, a BIC score
    with elbow pruning instead of the marginal likelihood (docs/decisions.md, decision 171).

    The averaged map of each class is a step function: the fit stores its breakpoints ``breakpoints_``
    (K, E), the union of the models' inner edges, and its values ``values_`` (K, E + 1), plus the models'
    weights ``weights_`` (M, K); a test score costs one ``searchsorted``.

    References:
        M. P. Naeini, G. F. Cooper, M. Hauskrecht, "Obtaining well calibrated probabilities using Bayesian
        binning", AAAI 2015.

    Example:
        >>> import torch
        >>> from torchcal.calibrators import BBQ
        >>> g = torch.Generator().manual_seed(0)
        >>> z = 3 * torch.randn(2000, 4, generator=g, dtype=torch.float64)
        >>> y = torch.multinomial(torch.softmax(z / 3, 1), 1, generator=g)[:, 0]
        >>> bbq = BBQ().fit(z, y)
        >>> bbq.weights_.shape  # 126 binning models (B = 1 … ⌈10·2000^{1/3}⌉) per class
        torch.Size([126, 4])
        >>> probs = bbq.predict_proba(z)
        >>> round(float(probs.sum(1).max()), 6)
        1.0
    """

    def check_params(self) -> BBQ:
        self._checked()
        return self

    name = "bayesian_binning_quantiles"
    fitted_attributes = ("weights_", "breakpoints_", "values_")

    def _fit(self, logits, targets):
        c, strength = self._checked()
        probs = torch.softmax(logits.detach().double(), 1).T  # (K, N)
        labels = targets[None, :] == torch.arange(probs.shape[0], device=probs.device)[:, None]
        self.weights_, self.breakpoints_, self.values_ = _fit_bbq(probs, labels, c, strength)

    def _transform(self, logits):
        s = torch.softmax(logits.double(), 1).T.contiguous()
        out = _apply_bbq(self.breakpoints_.to(s.device), self.values_.to(s.device), s).T.clamp_min(1e-30)
        return (out / out.sum(1, keepdim=True)).to(logits.dtype)


class BinaryBBQ(_BBQParams, BinaryCalibrator):
    """Bayesian binning into quantiles per label for sigmoid outputs: the map of :class:`BBQ` on s = σ(z)
    with the label's 0/1 targets, no renormalisation. Monotone only within a binning, so it can reorder a
    label's scores.

    Example:
        >>> import torch
        >>> from torchcal.calibrators import BinaryBBQ
        >>> g = torch.Generator().manual_seed(0)
        >>> z = 3 * torch.randn(3000, generator=g)
        >>> y = (torch.rand(3000, generator=g) < torch.sigmoid(z / 3)).float()
        >>> p = BinaryBBQ().fit(z, y).transform(torch.tensor([-6.0, 0.0, 6.0]))
        >>> bool(p[0] < 0.3 and 0.3 < p[1] < 0.7 and p[2] > 0.7)
        True
    """

    def check_params(self) -> BinaryBBQ:
        self._checked()
        return self

    name = "bbq"
    fitted_attributes = ("weights_", "breakpoints_", "values_")

    def _fit(self, logits, targets):
        c, strength = self._checked()
        s = torch.sigmoid(logits).T  # (L, N) float64
        self.weights_, self.breakpoints_, self.values_ = _fit_bbq(s, targets.T, c, strength)

    def _transform(self, logits):
        s = torch.sigmoid(logits).T.contiguous()
        return _apply_bbq(self.breakpoints_.to(s.device), self.values_.to(s.device), s).T


_only_public(__name__)
