"""Spline calibration, histogram binning and isotonic regression (SPEC §4)."""

from __future__ import annotations

import numpy as np
import torch

from .._validation import check_positive_int
from ..functional._binning import classwise_sums, equal_width_index
from .base import Calibrator

__all__ = ["SplineCalibration", "HistogramBinning", "IsotonicCalibration"]


def _renormalise(probs: torch.Tensor) -> torch.Tensor:
    """Rows scaled to sum 1; an all-zero row becomes uniform."""
    total = probs.sum(1, keepdim=True)
    uniform = torch.full_like(probs, 1.0 / probs.shape[1])
    return torch.where(total > 0, probs / total.clamp(min=torch.finfo(probs.dtype).tiny), uniform)


def _replace_top(probs: torch.Tensor, new_top: torch.Tensor) -> torch.Tensor:
    """Sets the top-label probability to ``new_top`` (clipped to [1/K, 1]) and gives the others 1 − new_top.

    The others keep their proportions r_j = p_j / Σ_{i≠top} p_i unless one of them would then exceed the new
    top; in that case r is blended with the uniform distribution over the other classes, just enough that
    the largest other stays (by a relative 1e-6) below the new top. So the argmax never changes.
    """
    k = probs.shape[1]
    conf, pred = probs.max(1, keepdim=True)
    c = new_top[:, None].clamp(1.0 / k, 1.0)
    others = probs.scatter(1, pred, 0.0)
    rest = others.sum(1, keepdim=True)
    uniform = torch.full_like(others, 1.0 / (k - 1)).scatter(1, pred, 0.0)
    r = torch.where(rest > 0, others / rest.clamp(min=torch.finfo(probs.dtype).tiny), uniform)
    r_max = r.max(1, keepdim=True).values
    # largest allowed r_j, a relative 1e-6 below a tie so that float32 rounding cannot create one
    limit = c / (1 - c).clamp(min=torch.finfo(probs.dtype).tiny) * (1 - 1e-6)
    u = 1.0 / (k - 1)
    lam = torch.where(r_max > limit, (limit - u) / (r_max - u).clamp(min=torch.finfo(probs.dtype).tiny), 1.0)
    lam = lam.clamp(0, 1)
    spread = (1 - c) * (lam * r + (1 - lam) * uniform)
    return spread.scatter(1, pred, c)


# ----------------------------------------------------------------------------- spline


def _natural_spline_basis(x: torch.Tensor, knots: torch.Tensor, derivative: bool = False) -> torch.Tensor:
    """Natural cubic spline basis with the given knots (Hastie et al., ESL eq. 5.4–5.5), or its derivative."""
    last = knots[-1]

    def d(k):
        if derivative:
            num = 3 * (torch.clamp(x - knots[k], min=0) ** 2 - torch.clamp(x - last, min=0) ** 2)
        else:
            num = torch.clamp(x - knots[k], min=0) ** 3 - torch.clamp(x - last, min=0) ** 3
        return num / (last - knots[k])

    cols = [
        torch.zeros_like(x) if derivative else torch.ones_like(x),
        torch.ones_like(x) if derivative else x,
    ]
    d_last = d(len(knots) - 2)
    cols += [d(k) - d_last for k in range(len(knots) - 2)]
    return torch.stack(cols, dim=1)


class SplineCalibration(Calibrator):
    """Spline recalibration of the top-label confidence (Gupta et al. 2021).

    On validation data sorted by top-label confidence, the cumulative accuracy A(s) = (1/N) Σ_{j ≤ sN}
    correct_j is a function of the rank fraction s ∈ [0, 1]; a natural cubic spline with ``n_knots``
    equally spaced knots is fitted to it by least squares, and its derivative A'(s) is the accuracy at rank
    s. A test confidence is mapped to its rank fraction among the validation confidences (linear
    interpolation) and then to A'(s), clipped to [1/K, 1]. The other classes share the rest in their old
    proportions, blended towards uniform only as far as needed to stay below the new top: the argmax never
    changes.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> z = 2 * torch.randn(3000, 4, generator=g)
        >>> y = torch.multinomial(torch.softmax(z, 1), 1, generator=g).squeeze(1)
        >>> cal = SplineCalibration().fit(3 * z, y)
        >>> p = cal.transform(3 * z)
        >>> bool(torch.allclose(p.sum(1), torch.ones(3000, dtype=p.dtype)))
        True
    """

    name = "spline"
    fitted_attributes = ("knots_", "coef_", "scores_")

    def __init__(self, n_knots: int = 6):
        self.n_knots = n_knots

    def check_params(self) -> SplineCalibration:
        check_positive_int(self.n_knots, "n_knots", minimum=3)
        return self

    def _fit(self, logits, targets):
        n_knots = check_positive_int(self.n_knots, "n_knots", minimum=3)
        probs = torch.softmax(logits.double(), 1)
        conf, pred = probs.max(1)
        conf_s, order = torch.sort(conf, stable=True)
        correct = (pred == targets).double()[order]
        n = conf.shape[0]
        s = torch.arange(1, n + 1, dtype=torch.float64, device=conf.device) / n
        cum_acc = correct.cumsum(0) / n
        knots = torch.linspace(0, 1, n_knots, dtype=torch.float64, device=conf.device)
        basis = _natural_spline_basis(s, knots)
        # numpy's SVD least squares (minimum norm below n_knots points) gives the same bits on every call;
        # torch's (MKL) does not
        coef = np.linalg.lstsq(basis.cpu().numpy(), cum_acc.cpu().numpy(), rcond=None)[0]
        self.coef_ = torch.from_numpy(coef)
        self.knots_ = knots.cpu()
        self.scores_ = conf_s.cpu()

    def _rank_fraction(self, conf):
        scores = self.scores_.to(conf.device)
        n = scores.shape[0]
        ranks = torch.arange(1, n + 1, dtype=torch.float64, device=conf.device) / n
        return torch.from_numpy(np.interp(conf.cpu().numpy(), scores.cpu().numpy(), ranks.cpu().numpy())).to(
            conf.device
        )

    def _transform(self, logits):
        probs = torch.softmax(logits.double(), 1)
        conf = probs.max(1).values
        s = self._rank_fraction(conf)
        slope = _natural_spline_basis(s, self.knots_.to(s.device), derivative=True) @ self.coef_.to(s.device)
        return _replace_top(probs, slope.clamp(0, 1)).to(logits.dtype)


# ----------------------------------------------------------------------------- histogram binning


class HistogramBinning(Calibrator):
    """One-vs-rest histogram binning (Zadrozny & Elkan 2001; multiclass as in Guo et al. 2017).

    For each class k, p_k is binned on ``n_bins`` equal-width bins (``(m/M, (m+1)/M]``, 0 in bin 0) and
    replaced by the validation frequency of y = k in its bin; a bin without validation samples leaves p_k
    unchanged. Rows are renormalised (an all-zero row becomes uniform). This can change the argmax.

    Example:
        >>> import torch
        >>> z = torch.tensor([[2.0, 0.0], [1.5, 0.0], [0.0, 2.0], [0.0, 1.0]])
        >>> hb = HistogramBinning(n_bins=2).fit(z, torch.tensor([0, 1, 1, 1]))
        >>> hb.frequencies_
        tensor([[0.0000, 0.5000],
                [0.5000, 1.0000]], dtype=torch.float64)
    """

    name = "histogram_binning"
    fitted_attributes = ("frequencies_",)

    def __init__(self, n_bins: int = 15):
        self.n_bins = n_bins

    def check_params(self) -> HistogramBinning:
        check_positive_int(self.n_bins, "n_bins")
        return self

    def _fit(self, logits, targets):
        n_bins = check_positive_int(self.n_bins, "n_bins")
        probs = torch.softmax(logits, 1)
        count, _, correct_sum = classwise_sums(probs, targets, n_bins)
        self.frequencies_ = torch.where(count > 0, correct_sum / count.clamp(min=1), torch.nan).cpu()

    def _transform(self, logits):
        probs = torch.softmax(logits, 1)
        idx = equal_width_index(probs, self.frequencies_.shape[1])
        table = self.frequencies_.to(device=probs.device, dtype=probs.dtype)
        mapped = table.gather(1, idx.T).T  # row k of the table indexed by column k's bins
        return _renormalise(torch.where(torch.isnan(mapped), probs, mapped))


# ----------------------------------------------------------------------------- isotonic regression


def _pool_starts(xu: np.ndarray) -> np.ndarray:
    """Indices into the sorted distinct values ``xu`` where a pool of near-equal x starts: scikit-learn's
    ``_make_unique`` rule, x joins the current pool while x − (the pool's first x) < the resolution of x's
    dtype (1e-15 for float64). A gap of at least the resolution always starts a pool (the rounded
    difference to an earlier first value is no smaller), so only runs of smaller gaps are walked."""
    eps = np.finfo(xu.dtype).resolution
    new = np.ones(len(xu), dtype=bool)
    new[1:] = np.diff(xu) >= eps
    first = xu[0]
    for j in np.flatnonzero(~new).tolist():  # in order; xu[j − 1] is in the current pool
        if new[j - 1]:
            first = xu[j - 1]
        if xu[j] - first >= eps:
            new[j], first = True, xu[j]
    return np.flatnonzero(new)


def _pav(x: np.ndarray, y: np.ndarray):
    """Weighted pool-adjacent-violators on sorted x, values closer than the resolution of x's dtype pooled
    first as scikit-learn's ``IsotonicRegression`` pools them (:func:`_pool_starts`); returns (x, fit) with
    one entry per pool, x its first (smallest) value."""
    order = np.argsort(x, kind="stable")
    x, y = x[order], y[order]
    xu, start, counts = np.unique(x, return_index=True, return_counts=True)
    sums = np.add.reduceat(y, start)
    pools = _pool_starts(xu)
    xu, sums, counts = xu[pools], np.add.reduceat(sums, pools), np.add.reduceat(counts, pools)
    # stack of blocks: (weighted sum, weight, number of pools)
    b_sum, b_w, b_len = [], [], []
    for s, w in zip(sums.tolist(), counts.tolist(), strict=True):
        b_sum.append(s)
        b_w.append(w)
        b_len.append(1)
        while len(b_sum) > 1 and b_sum[-2] * b_w[-1] >= b_sum[-1] * b_w[-2]:
            s2, w2, l2 = b_sum.pop(), b_w.pop(), b_len.pop()
            b_sum[-1] += s2
            b_w[-1] += w2
            b_len[-1] += l2
    fit = np.repeat(np.array(b_sum) / np.array(b_w), b_len)
    return xu, fit


def _interp_rows(x: torch.Tensor, xp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    """np.interp for torch (values outside [xp[0], xp[-1]] are clipped to the end values)."""
    if xp.shape[0] == 1:
        return torch.full_like(x, float(fp[0]))
    i = torch.searchsorted(xp, x.contiguous()).clamp(1, xp.shape[0] - 1)
    x0, x1, f0, f1 = xp[i - 1], xp[i], fp[i - 1], fp[i]
    w = ((x - x0) / (x1 - x0)).clamp(0, 1)
    return f0 + w * (f1 - f0)


class IsotonicCalibration(Calibrator):
    """One-vs-rest isotonic regression (Zadrozny & Elkan 2002), then renormalisation.

    For each class k a non-decreasing map of p_k to the frequency of y = k is fitted by weighted
    pool-adjacent-violators and applied by linear interpolation between the fitted points, clipped at the
    ends: the same predictions as scikit-learn's ``IsotonicRegression(out_of_bounds="clip")`` (tested),
    whose rule for ties this follows: p_k within 1e-15 (float64's resolution) of the first value of a run
    are pooled first, so scores equal in exact arithmetic that differ by rounding (rows whose logits are
    permutations of each other) get one value. Rows are renormalised (all-zero rows become uniform); this
    can change the argmax. Fitting is O(N log N) per class with a Python loop over blocks.

    Example:
        >>> import torch
        >>> z = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 2.0]])
        >>> iso = IsotonicCalibration().fit(z, torch.tensor([0, 1, 0, 1]))
        >>> iso.transform(z)
        tensor([[1.0000, 0.0000],
                [0.5000, 0.5000],
                [0.5000, 0.5000],
                [0.0000, 1.0000]])
    """

    name = "isotonic"
    fitted_attributes = ("thresholds_", "values_")

    def _fit(self, logits, targets):
        probs = torch.softmax(logits.double(), 1).cpu().numpy()
        y = targets.cpu().numpy()
        thresholds, values = [], []
        for k in range(probs.shape[1]):
            xu, fit = _pav(probs[:, k], (y == k).astype(np.float64))
            thresholds.append(torch.from_numpy(xu))
            values.append(torch.from_numpy(fit))
        self.thresholds_, self.values_ = thresholds, values

    def _transform(self, logits):
        probs = torch.softmax(logits.double(), 1)
        cols = [
            _interp_rows(probs[:, k], self.thresholds_[k].to(probs.device), self.values_[k].to(probs.device))
            for k in range(probs.shape[1])
        ]
        return _renormalise(torch.stack(cols, 1)).to(logits.dtype)
