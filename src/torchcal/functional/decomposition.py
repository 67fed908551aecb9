"""The direction of miscalibration and the decompositions of proper scores (SPEC §9.1, §9.3).

* :func:`calibration_error_direction`: binned ECE split into its over-confident and under-confident parts,
  and the signed ECE (their difference), with equal-width or equal-mass bins.
* :func:`brier_decomposition` and :func:`log_score_decomposition`: reliability, resolution and uncertainty
  (Murphy 1973; Bröcker 2009), with the two within-group terms that make the identity exact for any grouping.

Every function returns float64 values on the input's device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._namespace import only_public as _only_public
from .._validation import check_choice, check_positive_int
from ._binning import equal_width_index
from ._field_inputs import field_inputs, top_label_pairs
from ._spec import ordered_sum

__all__ = [
    "CalibrationDirection",
    "BrierDecomposition",
    "LogScoreDecomposition",
    "calibration_error_direction",
    "signed_calibration_error",
    "brier_decomposition",
    "log_score_decomposition",
    "direction_from_sums",
    "top_label_bin_index",
]


class CalibrationDirection(NamedTuple):
    """Binned top-label ECE and its split: ``ece = over + under`` and ``signed = over − under``."""

    ece: torch.Tensor
    signed: torch.Tensor
    over: torch.Tensor
    under: torch.Tensor


def direction_from_sums(count, conf_sum, correct_sum) -> CalibrationDirection:
    """The split from per-bin float64 (count, confidence sum, correct sum): with ``gap_b = (Σ conf − Σ c)/N``,
    ``over = Σ_b max(gap_b, 0)`` and ``under = Σ_b max(−gap_b, 0)``; empty bins add 0."""
    n = count.sum(-1, keepdim=True)
    gap = (conf_sum - correct_sum) / n.clamp(min=1)
    over, under = gap.clamp(min=0).sum(-1), (-gap).clamp(min=0).sum(-1)
    return CalibrationDirection(over + under, over - under, over, under)


def top_label_bin_index(conf: torch.Tensor, n_bins: int, convention: str = "torchcal"):
    """(index, number of slots) of each top-label confidence under an equal-width ``convention``:
    ``"torchcal"`` (SPEC §3): bins (m/M, (m+1)/M], 0 in bin 0, M slots; ``"torchmetrics"``: bins
    [m/M, (m+1)/M) from ``torch.linspace(0, 1, M + 1)``, plus slot M for conf == 1.0, with the confidences
    cast to float32 and binned against float32 edges whatever the input dtype, as torchmetrics bins (a
    float64 confidence just below an edge can round onto it)."""
    if convention == "torchcal":
        return equal_width_index(conf, n_bins), n_bins
    edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float32, device=conf.device)
    return torch.bucketize(conf.float(), edges, right=True) - 1, n_bins + 1


def _sums_by_index(index, slots, conf, correct):
    count = torch.bincount(index, minlength=slots).double()
    return (
        count,
        torch.bincount(index, weights=conf.double(), minlength=slots),
        torch.bincount(index, weights=correct.double(), minlength=slots),
    )


def _equal_mass_sums(conf, correct, n_bins):
    """Per-chunk sums of the stable ascending sort cut by ``tensor_split`` (numpy.array_split); with N < M the
    empty chunks are dropped (they add nothing to any of the sums)."""
    order = torch.sort(conf, stable=True).indices
    n = conf.shape[0]
    q, r = divmod(n, n_bins)
    pos = torch.arange(n, device=conf.device)
    head = r * (q + 1)
    index = pos if q == 0 else torch.where(pos < head, pos // (q + 1), r + (pos - head) // q)
    return _sums_by_index(index, n_bins, conf[order], correct[order])


def calibration_error_direction(
    probs,
    targets,
    *,
    n_bins: int = 15,
    binning: str = "width",
    convention: str = "torchcal",
    from_logits: bool = False,
) -> CalibrationDirection:
    r"""Top-label ECE split into over- and under-confidence, and the signed ECE.

    .. math::
        \mathrm{sECE} = \sum_b w_b (\mathrm{conf}_b - \mathrm{acc}_b), \quad
        \mathrm{ECE}_{over} = \sum_b w_b \max(\mathrm{conf}_b - \mathrm{acc}_b, 0), \quad
        \mathrm{ECE}_{under} = \sum_b w_b \max(\mathrm{acc}_b - \mathrm{conf}_b, 0)

    with ``w_b = n_b / N``. Then ``ECE = over + under`` and ``sECE = over − under`` exactly; positive sECE
    means over-confident. sECE equals ``mean(conf) − accuracy`` for any binning; the split depends on the
    bins. Empty bins add 0.

    Args:
        probs: probabilities (N, K) (or (N,) for P(class 1)), or logits with ``from_logits=True``.
        targets: integer labels (N,).
        n_bins: number of bins B.
        binning: ``"width"``: equal-width bins; ``"mass"``: the stable ascending sort of the confidences cut
            into B chunks like ``numpy.array_split`` (empty chunks when N < B are dropped).
        convention: equal-width edges: ``"torchcal"`` (SPEC §3: (m/B, (m+1)/B], 0 in bin 0) or
            ``"torchmetrics"`` ([m/B, (m+1)/B) and an extra bin holding exactly conf == 1.0, as torchmetrics
            and torch-uncertainty bin; the bin of a confidence is that of its float32 value, against float32
            edges, as theirs; the sums stay in the input dtype).
        from_logits: apply softmax first.

    Returns:
        :class:`CalibrationDirection` (ece, signed, over, under) of 0-d float64 tensors; all 0 for N = 0.

    References:
        Rahaman & Thiery 2021 (signed ECE, eq. 5); Naeini et al. 2015; Nixon et al. 2019 (equal mass).

    Example:
        >>> import torch
        >>> conf = torch.tensor([.95, .9, .85, .7, .65, .6, .55, .3], dtype=torch.float64)
        >>> correct = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0])
        >>> probs = torch.cat([conf[:, None], ((1 - conf) / 3)[:, None].expand(-1, 3)], 1)  # predicts 0
        >>> d = calibration_error_direction(probs, 1 - correct, n_bins=5, convention="torchmetrics")
        >>> [round(float(v), 5) for v in d]
        [0.3, 0.1875, 0.24375, 0.05625]
        >>> [round(float(v), 5) for v in calibration_error_direction(probs, 1 - correct, n_bins=5)]
        [0.1875, 0.1875, 0.1875, 0.0]
    """
    n_bins = check_positive_int(n_bins, "n_bins")
    check_choice(binning, "binning", {"width", "mass"})
    check_choice(convention, "convention", {"torchcal", "torchmetrics"})
    conf, correct = top_label_pairs(probs, targets, from_logits)
    if binning == "mass":
        sums = _equal_mass_sums(conf, correct, n_bins)
    else:
        sums = _sums_by_index(*top_label_bin_index(conf, n_bins, convention), conf, correct)
    return direction_from_sums(*sums)


def signed_calibration_error(probs, targets, *, from_logits: bool = False) -> torch.Tensor:
    """Signed ECE ``mean(conf) − accuracy`` (top label): Σ_b w_b (conf_b − acc_b) for any binning, so it
    needs no bins. Positive: over-confident. 0 for N = 0.

    Example:
        >>> import torch
        >>> signed_calibration_error(torch.tensor([[0.9, 0.1], [0.2, 0.8]]), torch.tensor([0, 0]))
        tensor(0.3500, dtype=torch.float64)
    """
    conf, correct = top_label_pairs(probs, targets, from_logits)
    if conf.shape[0] == 0:
        return torch.zeros((), dtype=torch.float64, device=conf.device)
    return (ordered_sum(conf.double()) - ordered_sum(correct.double())) / conf.shape[0]


# ----------------------------------------------------------------------------- decompositions


class BrierDecomposition(NamedTuple):
    """``score = reliability − resolution + uncertainty + within_variance − 2·within_covariance``."""

    score: torch.Tensor
    reliability: torch.Tensor
    resolution: torch.Tensor
    uncertainty: torch.Tensor
    within_variance: torch.Tensor
    within_covariance: torch.Tensor


class LogScoreDecomposition(NamedTuple):
    """``score = reliability − resolution + uncertainty + within``; ``calibration = reliability``,
    ``refinement = uncertainty − resolution`` (and ``score = calibration + refinement + within``)."""

    score: torch.Tensor
    reliability: torch.Tensor
    resolution: torch.Tensor
    uncertainty: torch.Tensor
    within: torch.Tensor

    @property
    def calibration(self) -> torch.Tensor:
        return self.reliability

    @property
    def refinement(self) -> torch.Tensor:
        return self.uncertainty - self.resolution


def _groups(probs, targets, groups, n_bins):
    """(group index (N,), number of groups, group forecast (G, K) or None): ``"unique"`` groups identical
    probability vectors (the forecast is the vector itself), ``"width"`` the equal-width top-label bins of
    SPEC §3 (the forecast is the group's mean vector)."""
    if groups == "unique":
        rows, inverse = torch.unique(probs, dim=0, return_inverse=True)
        return inverse, rows.shape[0], rows.double()
    conf = probs.amax(dim=1)
    return equal_width_index(conf, n_bins), n_bins, None


def _group_means(probs64, onehot, index, n_groups):
    count = torch.bincount(index, minlength=n_groups).double()
    p_sum = torch.zeros(n_groups, probs64.shape[1], dtype=torch.float64, device=probs64.device)
    y_sum = torch.zeros_like(p_sum)
    p_sum.index_add_(0, index, probs64)
    y_sum.index_add_(0, index, onehot)
    safe = count.clamp(min=1)[:, None]
    return count, p_sum / safe, y_sum / safe


def brier_decomposition(
    probs, targets, *, groups: str = "unique", n_bins: int = 15, from_logits: bool = False
) -> BrierDecomposition:
    r"""Murphy's decomposition of the multiclass Brier score ``BS = (1/N) Σ_i ‖P_i − Y_i‖²`` (range [0, 2]).

    .. math::
        \mathrm{REL} = \tfrac1N \sum_g n_g \|\bar f_g - \bar y_g\|^2, \quad
        \mathrm{RES} = \tfrac1N \sum_g n_g \|\bar y_g - \bar y\|^2, \quad
        \mathrm{UNC} = 1 - \|\bar y\|^2

    and ``BS = REL − RES + UNC + WBV − 2·WBC`` exactly, with the within-group variance
    ``WBV = (1/N) Σ_i ‖P_i − f̄_g‖²`` and covariance ``WBC = (1/N) Σ_i ⟨P_i − f̄_g, Y_i − ȳ_g⟩`` (Stephenson et
    al. 2008). ``groups="unique"`` (default) groups identical probability vectors, where both within terms
    are 0 and ``BS = REL − RES + UNC``; ``groups="width"`` groups by equal-width top-label confidence bins
    (SPEC §3), a fixed-size statistic that :class:`torchcal.metrics.CalibrationMetrics` streams.

    Args:
        probs: probabilities (N, K) (or (N,) for P(class 1)), or logits with ``from_logits=True``.
        targets: integer labels (N,).
        groups: ``"unique"`` or ``"width"``.
        n_bins: bins of ``groups="width"``.
        from_logits: apply softmax first.

    Returns:
        :class:`BrierDecomposition` of 0-d float64 tensors.

    References:
        Murphy 1973; Stephenson, Coelho & Jolliffe 2008.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[0.8, 0.2], [0.8, 0.2], [0.3, 0.7], [0.3, 0.7]], dtype=torch.float64)
        >>> d = brier_decomposition(probs, torch.tensor([0, 1, 1, 1]))
        >>> [round(float(v), 4) for v in d[:4]]
        [0.43, 0.18, 0.125, 0.375]
    """
    check_choice(groups, "groups", {"unique", "width"})
    n_bins = check_positive_int(n_bins, "n_bins")
    probs, targets = field_inputs(probs, targets, from_logits, allow_empty=False)
    p = probs.double()
    y = torch.nn.functional.one_hot(targets, p.shape[1]).double()
    index, n_groups, forecast = _groups(probs, targets, groups, n_bins)
    count, f_bar, y_bar_g = _group_means(p, y, index, n_groups)
    if forecast is not None:
        f_bar = forecast
    n = p.shape[0]
    y_bar = y.mean(0)
    w = count / n
    score = ordered_sum(((p - y) ** 2).sum(1)) / n
    rel = ordered_sum(w * ((f_bar - y_bar_g) ** 2).sum(1))
    res = ordered_sum(w * ((y_bar_g - y_bar) ** 2).sum(1))
    unc = 1 - (y_bar**2).sum()
    dp, dy = p - f_bar[index], y - y_bar_g[index]
    within_variance, within_covariance = ordered_sum((dp**2).sum(1)) / n, ordered_sum((dp * dy).sum(1)) / n
    return BrierDecomposition(score, rel, res, unc, within_variance, within_covariance)


def log_score_decomposition(
    probs, targets, *, groups: str = "unique", n_bins: int = 15, from_logits: bool = False
) -> LogScoreDecomposition:
    r"""Reliability-resolution-uncertainty decomposition of the log score ``LS = −(1/N) Σ_i log P_{i,y_i}``
    (nats, no clipping: a zero probability on the label gives ``inf``).

    .. math::
        \mathrm{REL} = \sum_g \tfrac{n_g}{N} \mathrm{KL}(\bar y_g \| f_g), \quad
        \mathrm{RES} = \sum_g \tfrac{n_g}{N} \mathrm{KL}(\bar y_g \| \bar y), \quad
        \mathrm{UNC} = H(\bar y)

    with ``0·log 0 = 0``, and ``LS = REL − RES + UNC + within`` exactly, where
    ``within = (1/N) Σ_i log(f_{g,y_i} / P_{i,y_i})`` is 0 for ``groups="unique"`` (identical probability
    vectors; ``f_g`` is the vector) and, for ``groups="width"`` (equal-width top-label bins, streamable),
    ``f_g`` is the group's mean vector. ``calibration = REL`` and ``refinement = UNC − RES =
    Σ_g (n_g/N) H(ȳ_g)`` (DeGroot & Fienberg 1983).

    Returns:
        :class:`LogScoreDecomposition` of 0-d float64 tensors (``.calibration``, ``.refinement``).

    References:
        Bröcker 2009; Weijs, van Nooijen & van de Giesen 2010.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[0.8, 0.2], [0.8, 0.2], [0.3, 0.7], [0.3, 0.7]], dtype=torch.float64)
        >>> d = log_score_decomposition(probs, torch.tensor([0, 1, 1, 1]))
        >>> round(float(d.score), 6), round(float(d.calibration + d.refinement), 6)
        (0.636483, 0.636483)
    """
    check_choice(groups, "groups", {"unique", "width"})
    n_bins = check_positive_int(n_bins, "n_bins")
    probs, targets = field_inputs(probs, targets, from_logits, allow_empty=False)
    p = probs.double()
    y = torch.nn.functional.one_hot(targets, p.shape[1]).double()
    index, n_groups, forecast = _groups(probs, targets, groups, n_bins)
    count, f_bar, y_bar_g = _group_means(p, y, index, n_groups)
    if forecast is not None:
        f_bar = forecast
    return _log_terms(p.gather(1, targets[:, None]).squeeze(1), targets, index, count, f_bar, y_bar_g)


def _log_terms(p_true, targets, index, count, f_bar, y_bar_g) -> LogScoreDecomposition:
    """The log-score terms from per-sample true-class probabilities and per-group (count, f, ȳ_g)."""
    n = count.sum()
    w = count / n
    y_bar = ordered_sum(w[:, None] * y_bar_g, 0)
    score = -ordered_sum(torch.log(p_true)) / p_true.shape[0]
    neg_ent_g = torch.special.xlogy(y_bar_g, y_bar_g).sum(1)  # −H(ȳ_g)
    rel = ordered_sum(w * (neg_ent_g - torch.special.xlogy(y_bar_g, f_bar).sum(1)))
    res = ordered_sum(w * (neg_ent_g - torch.special.xlogy(y_bar_g, y_bar).sum(1)))
    unc = -torch.special.xlogy(y_bar, y_bar).sum()
    f_true = f_bar[index, targets]
    gap = torch.where(f_true == p_true, 0.0, torch.log(f_true) - torch.log(p_true))
    within = ordered_sum(gap) / p_true.shape[0]
    return LogScoreDecomposition(score, rel, res, unc, within)


_only_public(__name__)
