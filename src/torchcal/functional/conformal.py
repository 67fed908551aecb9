"""Split-conformal classification scores, the conformal quantile and prediction-set metrics (SPEC §9.7).

Scores (lower = more conforming), for probabilities π sorted descending with a stable sort (ties: the lower
class index first), ``o(y)`` the 1-based rank of label y and ``C(x, y) = Σ_{j: o(j) ≤ o(y)} π_j``:

* THR / LAC: ``1 − π_y``;
* APS: ``C(x, y)``, randomized ``C(x, y) − U·π_y`` with one ``U ~ U(0, 1)`` per sample;
* RAPS: the APS score plus ``λ·max(0, o(y) − k_reg)``.

A set is ``{y : s(x, y) ≤ q̂}`` with ``q̂`` the ⌈(n+1)(1−α)⌉-th smallest calibration score. The predictor that
fits and applies them is :class:`torchcal.conformal.SplitConformalClassifier`. Set metrics take a boolean
(N, K) mask ``sets`` and integer ``targets``.
"""

from __future__ import annotations

import math
import warnings

import torch

from .._namespace import only_public as _only_public
from .._validation import as_data, check_choice, check_float, check_targets

__all__ = [
    "CONFORMAL_SCORES",
    "TORCHCP_STRATA",
    "conformal_scores",
    "conformal_quantile",
    "set_coverage",
    "average_set_size",
    "set_size_distribution",
    "size_stratified_coverage",
    "class_coverage_gap",
    "violated_classes",
    "conformal_set_metrics",
]

CONFORMAL_SCORES = ("lac", "aps", "raps")
# Size strata of TorchCP's SSCV (inclusive bounds on |C|); the RAPS paper uses [0,1],[2,3],[4,6],[7,10],...
TORCHCP_STRATA = ((0, 1), (2, 3), (4, 10), (11, 100), (101, 1000))


def conformal_scores(probs: torch.Tensor, method: str, *, u=None, lambda_: float = 0.1, k_reg: int = 1):
    """Scores of every label, float64 (N, K), for probabilities ``probs`` (N, K) (see the module).

    ``u``: (N,) uniforms for the randomized APS/RAPS scores (None: not randomized). ``lambda_`` and ``k_reg``
    are RAPS's penalty and the rank from which it applies.

    Example:
        >>> import torch
        >>> p = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
        >>> conformal_scores(p, "aps")
        tensor([[0.5000, 0.8000, 1.0000]], dtype=torch.float64)
        >>> conformal_scores(p, "raps", lambda_=0.1, k_reg=1)
        tensor([[0.5000, 0.9000, 1.2000]], dtype=torch.float64)
    """
    check_choice(method, "method", set(CONFORMAL_SCORES))
    p = probs.double()
    if method == "lac":
        return 1 - p
    sorted_p, order = torch.sort(p, dim=1, descending=True, stable=True)
    cum = torch.empty_like(p).scatter_(1, order, torch.cumsum(sorted_p, dim=1))
    scores = cum if u is None else cum - u.double()[:, None] * p
    if method == "raps":
        ranks = torch.arange(1, p.shape[1] + 1, dtype=torch.float64, device=p.device).expand_as(p)
        rank = torch.empty_like(p).scatter_(1, order, ranks)
        scores = scores + lambda_ * (rank - k_reg).clamp(min=0)
    return scores


def conformal_quantile(scores: torch.Tensor, alpha: float) -> torch.Tensor:
    """The finite-sample conformal quantile of 1-D calibration ``scores``: the k-th smallest with
    ``k = ⌈(n+1)(1−α)⌉`` (``numpy.quantile(scores, k/n, method="lower")``). ``+inf`` with a ``UserWarning``
    when k > n or n = 0 (every label is then in every set).

    Example:
        >>> import torch
        >>> conformal_quantile(torch.arange(1.0, 20.0), 0.1)  # n = 19: k = 18
        tensor(18.)
    """
    alpha = check_float(alpha, "alpha", low=0, high=1, low_open=True, high_open=True)
    n = scores.shape[0]
    k = math.ceil((n + 1) * (1 - alpha))
    if n == 0 or k > n:
        warnings.warn(
            f"conformal quantile: {n} calibration scores are too few for alpha={alpha} "
            f"(the ⌈(n+1)(1−α)⌉ = {k}-th is needed); the threshold is +inf, every label is in every set",
            UserWarning,
            stacklevel=2,
        )
        return torch.tensor(math.inf, dtype=scores.dtype, device=scores.device)
    return torch.kthvalue(scores, k).values


def _sets_and_targets(sets, targets):
    sets = as_data(sets, "sets")
    if sets.dtype != torch.bool:
        raise TypeError(f"`sets` must be a boolean (N, K) mask, got dtype {sets.dtype}")
    if sets.ndim != 2:
        raise ValueError(f"`sets` must have shape (N, K), got {tuple(sets.shape)}")
    if targets is None:
        return sets, None
    targets = check_targets(targets, sets.shape[0], sets.shape[1], check_range=sets.shape[0] > 0)
    return sets, targets.to(sets.device)


def _covered(sets, targets):
    return sets.gather(1, targets[:, None]).squeeze(1).double()


def _per_class_coverage(sets, targets):
    """(per-class coverage (K,) float64, per-class count (K,))."""
    k = sets.shape[1]
    count = torch.bincount(targets, minlength=k).double()
    hit = torch.bincount(targets, weights=_covered(sets, targets), minlength=k)
    return hit / count.clamp(min=1), count


def set_coverage(sets, targets, *, coverage_type: str = "micro") -> torch.Tensor:
    """Empirical coverage ``mean_i 1[y_i ∈ C(x_i)]`` (``"micro"``) or the mean over classes present in
    ``targets`` of the per-class coverage (``"macro"``). NaN for N = 0.

    Example:
        >>> import torch
        >>> sets = torch.tensor([[True, False], [True, True], [False, True], [True, False]])
        >>> set_coverage(sets, torch.tensor([0, 0, 0, 1])), set_coverage(sets, torch.tensor([0, 0, 0, 1]),
        ...     coverage_type="macro")
        (tensor(0.5000, dtype=torch.float64), tensor(0.3333, dtype=torch.float64))
    """
    check_choice(coverage_type, "coverage_type", {"micro", "macro"})
    sets, targets = _sets_and_targets(sets, targets)
    if coverage_type == "micro":
        return _covered(sets, targets).mean()
    cov, count = _per_class_coverage(sets, targets)
    return cov[count > 0].mean()


def average_set_size(sets) -> torch.Tensor:
    """Mean number of labels per set (empty sets count 0), float64.

    Example:
        >>> import torch
        >>> average_set_size(torch.tensor([[True, False, True], [False, False, False]]))
        tensor(1., dtype=torch.float64)
    """
    sets, _ = _sets_and_targets(sets, None)
    return sets.sum(1).double().mean()


def set_size_distribution(sets) -> torch.Tensor:
    """Share of sets of each size 0..K, float64 (K + 1,).

    Example:
        >>> import torch
        >>> set_size_distribution(torch.tensor([[True, False], [True, True], [False, False], [True, True]]))
        tensor([0.2500, 0.2500, 0.5000], dtype=torch.float64)
    """
    sets, _ = _sets_and_targets(sets, None)
    sizes = sets.sum(1)
    return torch.bincount(sizes, minlength=sets.shape[1] + 1).double() / max(1, sets.shape[0])


def size_stratified_coverage(sets, targets, alpha: float, *, strata=TORCHCP_STRATA):
    """(SSCV, {(lo, hi): coverage}): coverage within each size stratum (inclusive bounds on |C|) and the
    worst absolute deviation from 1 − α over the non-empty strata (−1 when all are empty), as TorchCP.

    Example:
        >>> import torch
        >>> sets = torch.tensor([[True, False, False], [True, True, False], [True, True, True]])
        >>> sscv, per = size_stratified_coverage(sets, torch.tensor([0, 2, 1]), 0.1)
        >>> round(float(sscv), 4), {k: round(float(v), 4) for k, v in per.items()}
        (0.4, {(0, 1): 1.0, (2, 3): 0.5})
    """
    alpha = check_float(alpha, "alpha", low=0, high=1, low_open=True, high_open=True)
    sets, targets = _sets_and_targets(sets, targets)
    sizes = sets.sum(1)
    covered = _covered(sets, targets)
    per, worst = {}, torch.tensor(-1.0, dtype=torch.float64, device=sets.device)
    for lo, hi in strata:
        mask = (sizes >= lo) & (sizes <= hi)
        if bool(mask.any()):
            cov = covered[mask].mean()
            per[(int(lo), int(hi))] = cov
            worst = torch.maximum(worst, (cov - (1 - alpha)).abs())
    return worst, per


def class_coverage_gap(sets, targets, alpha: float) -> torch.Tensor:
    """Class-conditional coverage gap **in percent**: ``100 · mean_{k: n_k > 0} |cov_k − (1 − α)|``
    (TorchCP's CovGap; Ding et al. 2023).

    Example:
        >>> import torch
        >>> sets = torch.tensor([[True, False], [True, True], [False, True], [True, False]])
        >>> class_coverage_gap(sets, torch.tensor([0, 0, 0, 1]), 0.1)
        tensor(56.6667, dtype=torch.float64)
    """
    alpha = check_float(alpha, "alpha", low=0, high=1, low_open=True, high_open=True)
    sets, targets = _sets_and_targets(sets, targets)
    cov, count = _per_class_coverage(sets, targets)
    return 100 * (cov[count > 0] - (1 - alpha)).abs().mean()


def violated_classes(sets, targets, alpha: float) -> int:
    """Number of classes present in ``targets`` whose coverage is below 1 − α.

    Example:
        >>> import torch
        >>> sets = torch.tensor([[True, False], [True, True], [False, True], [True, False]])
        >>> violated_classes(sets, torch.tensor([0, 0, 0, 1]), 0.1)
        2
    """
    alpha = check_float(alpha, "alpha", low=0, high=1, low_open=True, high_open=True)
    sets, targets = _sets_and_targets(sets, targets)
    cov, count = _per_class_coverage(sets, targets)
    return int(((cov < 1 - alpha) & (count > 0)).sum())


def conformal_set_metrics(sets, targets, alpha: float, *, strata=TORCHCP_STRATA) -> dict:
    """Every set metric at once: ``coverage``, ``macro_coverage``, ``set_size`` (mean), ``empty`` (share of
    empty sets), ``sscv``, ``coverage_gap`` (percent), ``violated_classes``, ``size_distribution`` ((K+1,)
    shares) and ``stratified_coverage`` (dict).

    Example:
        >>> import torch
        >>> sets = torch.tensor([[True, False], [True, True], [False, True], [True, False]])
        >>> m = conformal_set_metrics(sets, torch.tensor([0, 0, 0, 1]), 0.1)
        >>> float(m["coverage"]), float(m["set_size"]), m["violated_classes"]
        (0.5, 1.25, 2)
    """
    sets, targets = _sets_and_targets(sets, targets)
    sscv, per = size_stratified_coverage(sets, targets, alpha, strata=strata)
    dist = set_size_distribution(sets)
    return {
        "coverage": set_coverage(sets, targets),
        "macro_coverage": set_coverage(sets, targets, coverage_type="macro"),
        "set_size": average_set_size(sets),
        "empty": dist[0],
        "sscv": sscv,
        "coverage_gap": class_coverage_gap(sets, targets, alpha),
        "violated_classes": violated_classes(sets, targets, alpha),
        "size_distribution": dist,
        "stratified_coverage": per,
    }


_only_public(__name__)
