"""Selective prediction and OOD detection (SPEC §9.5, §9.6).

Selective prediction ranks samples by a confidence score (higher = more confident), sorts it descending
(stable: ties keep input order) and, with ``e_(k)`` the top-label error of the k-th most confident sample,
defines the selective risk ``r_k = (1/k) Σ_{j≤k} e_(j)`` at coverage ``k/N`` and the generalized risk
``r_k · k/N``. The metrics need every score, so a stream keeps rows and merges by gathering
(:class:`torchcal.metrics.CalibrationMetrics`).

OOD scores are oriented the other way: higher = more OOD; OOD samples are the positive class.
"""

from __future__ import annotations

import math
import sys
from typing import NamedTuple

import torch

from .._namespace import only_public as _only_public
from .._validation import _FROM_LOGITS_ADVICE, as_data, check_choice, check_float, check_logits
from . import _backend
from ._field_inputs import field_inputs, top_label, top_label_pairs
from ._spec import ordered_sum
from .calibration import binary_auroc

__all__ = [
    "CONFIDENCE_SCORES",
    "RiskCoverageCurve",
    "OODMetrics",
    "confidence_score",
    "risk_coverage_curve",
    "aurc",
    "augrc",
    "risk_at_coverage",
    "coverage_at_risk",
    "fpr_at_tpr",
    "average_precision",
    "ood_detection_metrics",
]

CONFIDENCE_SCORES = ("max_prob", "entropy", "margin", "max_logit", "energy")


def confidence_score(scores, *, score: str = "max_prob", from_logits: bool = False) -> torch.Tensor:
    """Per-sample confidence (higher = more confident), float64 (N,).

    ``"max_prob"``: max_k p_k; ``"entropy"``: the negated predictive entropy Σ_k p_k log p_k (nats);
    ``"margin"``: p_(1) − p_(2), the top two probabilities; ``"max_logit"``: max_k z_k and ``"energy"``:
    logsumexp_k z_k (both need logits, ``from_logits=True``: temperature 1).

    Example:
        >>> import torch
        >>> confidence_score(torch.tensor([[0.7, 0.2, 0.1]]), score="margin")
        tensor([0.5000], dtype=torch.float64)
    """
    check_choice(score, "score", set(CONFIDENCE_SCORES))
    if score in ("max_logit", "energy"):
        if not from_logits:
            raise ValueError(f"score={score!r} needs logits: pass them with from_logits=True")
        z = check_logits(as_data(scores, "scores"), "scores", warn_if_probs=_FROM_LOGITS_ADVICE).double()
        return z.amax(1) if score == "max_logit" else torch.logsumexp(z, dim=1)
    probs, _ = field_inputs(scores, torch.zeros(_rows(scores), dtype=torch.long), from_logits, "scores")
    return confidence_from_probs(probs, score)


def confidence_from_probs(probs: torch.Tensor, score: str) -> torch.Tensor:
    """:func:`confidence_score` ``"max_prob"``, ``"entropy"`` or ``"margin"`` of probabilities (N, K) that
    were validated already, without validating them again (a float16 or bfloat16 input is validated with its
    own dtype's row-sum tolerance, then upcast to float32; the upcast copy need not meet float32's)."""
    # in the input dtype (SPEC §9.0), sums over the classes accumulated in float64; no (N, K) float64 copy
    if score == "max_prob":
        return probs.amax(1).double()
    if score == "entropy":
        return torch.special.xlogy(probs, probs).sum(1, dtype=torch.float64)
    top2 = probs.topk(2, dim=1).values.double()
    return top2[:, 0] - top2[:, 1]


def _rows(x) -> int:
    return int(as_data(x, "scores").shape[0])


def _confidence_and_errors(probs, targets, confidence, score, from_logits):
    """(confidence (N,) floating point, top-label errors bool (N,)), validated. The confidence keeps the
    dtype it was computed in (the ranking is the same as its float64 upcast's); the curves are float64."""
    if confidence is None and score == "max_prob":  # one fused pass: validation, confidence, correctness
        conf, correct = top_label_pairs(probs, targets, from_logits)
        return conf, correct < 0.5
    probs_in = probs
    probs, targets = field_inputs(probs, targets, from_logits)
    errors = top_label(probs, targets)[1] < 0.5
    if confidence is None:
        if score in ("max_logit", "energy"):
            confidence = confidence_score(probs_in, score=score, from_logits=from_logits)
        else:
            confidence = confidence_from_probs(probs, score)
    else:
        confidence = as_data(confidence, "confidence")
        if confidence.ndim != 1 or confidence.shape[0] != probs.shape[0]:
            raise ValueError(
                f"`confidence` must have shape ({probs.shape[0]},), got {tuple(confidence.shape)}"
            )
        if not confidence.is_floating_point() or not bool(torch.isfinite(confidence).all()):
            raise ValueError("`confidence` must hold finite floating-point scores")
        confidence = confidence.double().to(probs.device)
    return confidence, errors


class RiskCoverageCurve(NamedTuple):
    """Per-sample risk-coverage points, most confident first: ``coverage[k-1] = k/N``, the selective
    ``risk`` r_k, the ``generalized_risk`` r_k·k/N and the ``threshold`` (the k-th largest confidence)."""

    coverage: torch.Tensor
    risk: torch.Tensor
    generalized_risk: torch.Tensor
    threshold: torch.Tensor


def _curve(confidence, errors) -> RiskCoverageCurve:
    """The curve of finite ``confidence`` (N,) and bool ``errors`` (N,): a stable descending sort carrying the
    errors (:func:`torchcal.functional._backend.sort_descending_with_flags`: the radix sort on CPU for
    non-negative scores), their float64 cumulative count, and the float64 thresholds."""
    n = confidence.shape[0]
    conf_sorted, errors_sorted = _backend.sort_descending_with_flags(confidence, errors)
    cum = torch.cumsum(errors_sorted, 0, dtype=torch.float64)
    k = torch.arange(1, n + 1, dtype=torch.float64, device=confidence.device)
    return RiskCoverageCurve(k / n, cum / k, cum / n, conf_sorted.double())


def risk_coverage_curve(
    probs, targets, *, confidence=None, score: str = "max_prob", from_logits: bool = False
) -> RiskCoverageCurve:
    """The risk-coverage curve (:class:`RiskCoverageCurve`, float64 (N,) tensors) of the top-label errors
    ranked by ``confidence`` (an explicit (N,) score, higher = more confident) or by ``score`` (see
    :func:`confidence_score`). :func:`torchcal.plotting.plot_risk_coverage` draws it.

    Example:
        >>> import torch
        >>> c = risk_coverage_curve(torch.tensor([.1, .2, .3, .4, .2]), torch.tensor([0, 0, 1, 1, 0]))
        >>> c.risk.tolist()
        [0.0, 0.0, 0.0, 0.25, 0.4]
    """
    return _curve(*_confidence_and_errors(probs, targets, confidence, score, from_logits))


def _grouped_points(confidence, errors, generalized):
    """fd-shifts' points: one per distinct threshold (after each tie block), ascending coverage, plus cov 0."""
    n = confidence.shape[0]
    curve = _curve(confidence, errors)
    last = torch.ones(n, dtype=torch.bool, device=confidence.device)
    last[:-1] = curve.threshold[1:] != curve.threshold[:-1]
    cov = curve.coverage[last]
    risk = (curve.generalized_risk if generalized else curve.risk)[last]
    zero = torch.zeros(1, dtype=torch.float64, device=cov.device)
    return torch.cat([zero, cov]), torch.cat([zero if generalized else risk[:1], risk])


def _area(probs, targets, confidence, score, from_logits, ties, generalized):
    check_choice(ties, "ties", {"sample", "group"})
    confidence, errors = _confidence_and_errors(probs, targets, confidence, score, from_logits)
    n = confidence.shape[0]
    if n < 2:
        return torch.tensor(float("nan"), dtype=torch.float64, device=confidence.device)
    if ties == "group":
        cov, risk = _grouped_points(confidence, errors, generalized)
        return ordered_sum((risk[1:] + risk[:-1]) * (cov[1:] - cov[:-1])) / 2
    curve = _curve(confidence, errors)
    return sample_area(curve.generalized_risk if generalized else curve.risk)


def sample_area(y: torch.Tensor) -> torch.Tensor:
    """``ties="sample"``'s area under per-sample curve points ``y`` (N,) at coverages k/N:
    ``(1/(N−1)) Σ_{k=2}^N (y_{k−1} + y_k)/2``; NaN for N < 2."""
    n = y.shape[0]
    if n < 2:
        return torch.tensor(float("nan"), dtype=torch.float64, device=y.device)
    return ordered_sum(y[1:] + y[:-1]) / (2 * (n - 1))


def aurc(
    probs,
    targets,
    *,
    confidence=None,
    score: str = "max_prob",
    ties: str = "sample",
    from_logits: bool = False,
) -> torch.Tensor:
    r"""Area under the risk-coverage curve.

    ``ties="sample"`` (default, torch-uncertainty): the trapezoid over the N per-sample points divided by
    (1 − 1/N), i.e. :math:`\frac{1}{N-1}\sum_{k=2}^N (r_{k-1} + r_k)/2`; tied confidences are not grouped
    (the stable order decides). ``ties="group"`` (fd-shifts, unscaled): points only at distinct thresholds
    plus a coverage-0 point repeating the first risk, plain trapezoid. NaN for N < 2.

    Args:
        probs: probabilities (N, K) (or (N,) for P(class 1)), or logits with ``from_logits=True``.
        targets: integer labels (N,).
        confidence: optional (N,) ranking score (higher = more confident) in place of ``score``.
        score: a :func:`confidence_score` name.

    References:
        Geifman & El-Yaniv 2017; Geifman, Uziel & El-Yaniv 2019.

    Example:
        >>> import torch
        >>> probs, targets = torch.tensor([.1, .2, .3, .4, .2]), torch.tensor([0, 0, 1, 1, 0])
        >>> aurc(probs, targets), aurc(probs, targets, ties="group")
        (tensor(0.1125, dtype=torch.float64), tensor(0.0900, dtype=torch.float64))
    """
    return _area(probs, targets, confidence, score, from_logits, ties, generalized=False)


def augrc(
    probs,
    targets,
    *,
    confidence=None,
    score: str = "max_prob",
    ties: str = "sample",
    from_logits: bool = False,
) -> torch.Tensor:
    r"""Area under the generalized risk-coverage curve (generalized risk ``(1/N) Σ_{j≤k} e_(j)``), with the
    rules of :func:`aurc` (``ties="group"``: the points at distinct thresholds plus (0, 0)). NaN for N < 2.

    References:
        Traub, Bungert, Lüth, Baumgartner, Maier-Hein, Jäger & Jaeger 2024 (arXiv 2407.01032).

    Example:
        >>> import torch
        >>> probs, targets = torch.tensor([.1, .2, .3, .4, .2]), torch.tensor([0, 0, 1, 1, 0])
        >>> augrc(probs, targets), augrc(probs, targets, ties="group")
        (tensor(0.1000, dtype=torch.float64), tensor(0.0800, dtype=torch.float64))
    """
    return _area(probs, targets, confidence, score, from_logits, ties, generalized=True)


def risk_at_coverage(
    probs, targets, coverage: float, *, confidence=None, score: str = "max_prob", from_logits: bool = False
) -> torch.Tensor:
    """Selective risk ``r_⌈N·c⌉`` of the ⌈N·c⌉ most confident samples, ``coverage`` c in (0, 1]
    (c = 0 raises: there is no risk of an empty selection). NaN for N = 0.

    ⌈N·c⌉ is taken for the decimal value that c stands for: a float64 product N·c within 4 ulps of an
    integer counts as that integer, so the binary rounding of c adds no sample (100 · 0.07 is
    7.000000000000001 in float64, and c = 0.07 of 100 samples keeps 7, not 8).

    Example:
        >>> import torch
        >>> risk_at_coverage(torch.tensor([.1, .2, .3, .4, .2]), torch.tensor([0, 0, 1, 1, 1]), 0.5)
        tensor(0.3333, dtype=torch.float64)
    """
    c = check_float(coverage, "coverage", low=0, high=1, low_open=True)
    confidence, errors = _confidence_and_errors(probs, targets, confidence, score, from_logits)
    n = confidence.shape[0]
    if n == 0:
        return torch.tensor(float("nan"), dtype=torch.float64, device=confidence.device)
    return _curve(confidence, errors).risk[min(n, _ceil_count(n, c)) - 1]


def _ceil_count(n: int, fraction: float) -> int:
    """⌈n · fraction⌉, with a float64 product within 4 ulps of an integer taken as that integer (the binary
    value of a decimal fraction such as 0.07 lies a little above or below it)."""
    x = n * fraction
    k = round(x)
    return k if abs(x - k) <= 4 * sys.float_info.epsilon * max(1.0, x) else math.ceil(x)


def coverage_at_risk(
    probs, targets, risk: float, *, confidence=None, score: str = "max_prob", from_logits: bool = False
) -> torch.Tensor:
    """The largest coverage whose selective risk is at most ``risk``: ``max{k/N : r_k ≤ ρ}`` over all k (the
    curve need not be monotone); NaN when no k qualifies or N = 0.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.7, .3], [.6, .4], [.55, .45]])
        >>> coverage_at_risk(probs, torch.tensor([0, 1, 1, 1, 1]), 0.3)
        tensor(0.2000, dtype=torch.float64)
    """
    rho = check_float(risk, "risk", low=0, high=1)
    confidence, errors = _confidence_and_errors(probs, targets, confidence, score, from_logits)
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=confidence.device)
    if confidence.shape[0] == 0:
        return nan
    curve = _curve(confidence, errors)
    ok = curve.risk <= rho
    return torch.where(ok, curve.coverage, torch.zeros_like(curve.coverage)).amax() if bool(ok.any()) else nan


# ----------------------------------------------------------------------------- OOD detection


def _ood_inputs(scores, is_ood, label_name: str = "is_ood"):
    """(scores, labels as bool): finite floating ``scores`` (N,) and labels ``is_ood`` (named ``label_name``
    in errors) holding only 0 and 1, checked with one host sync (the range of an integer tensor, both values
    of a floating one; a bool tensor needs no check)."""
    scores = as_data(scores, "scores")
    is_ood = as_data(is_ood, label_name)
    if scores.ndim != 1:
        raise ValueError(f"`scores` must have shape (N,), got {tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise TypeError(f"`scores` must be a floating-point tensor, got dtype {scores.dtype}")
    if is_ood.shape != scores.shape:
        raise ValueError(f"`{label_name}` must have shape {tuple(scores.shape)}, got {tuple(is_ood.shape)}")
    labels = is_ood.to(scores.device)
    flags = [torch.isfinite(scores).all()]
    if labels.dtype != torch.bool and labels.numel() > 0:
        if labels.is_floating_point() or labels.is_complex():
            flags.append(((labels == 0) | (labels == 1)).all())
        else:
            lo, hi = torch.aminmax(labels)
            flags.append((lo >= 0) & (hi <= 1))
    finite, *valid = torch.stack(flags).tolist()
    if not finite:
        raise ValueError("`scores` contains NaN or infinite values")
    if not all(valid):
        raise ValueError(f"`{label_name}` must hold 0/1 (or bool) values")
    return scores, labels != 0


def _threshold_counts(scores, positive):
    """At the end of each tie block of the descending scores the cumulative (TP, FP) counts, float64. Only
    block ends are read, and they do not depend on the order inside a block, so the sort need not be stable;
    it runs in the input dtype (upcasting keeps the order and the ties). The bool labels are gathered and
    counted in int64 (exact), converted once at the block ends."""
    s, order = torch.sort(scores, descending=True)
    tps_all = torch.cumsum(positive[order], 0)
    last = torch.ones_like(s, dtype=torch.bool)
    torch.ne(s[1:], s[:-1], out=last[:-1])
    idx = torch.nonzero(last).squeeze(1)
    tps = tps_all[idx]
    return tps.double(), (idx + 1 - tps).double()


def fpr_at_tpr(scores, is_ood, *, tpr: float = 0.95, rule: str = "nearest") -> torch.Tensor:
    """False-positive rate at a recall (TPR) level, OOD positive, scores higher = more OOD; thresholds only at
    distinct scores (a tie is never split), no interpolation. NaN without OOD samples.

    ``rule="nearest"`` (default; SPEC §9.6, Hendrycks' ``fpr_and_fdr_at_recall`` as torch-uncertainty's
    development branch ports it): the recall nearest ``tpr``, which may lie below it; ties in |recall − tpr|
    go to the higher recall and, on a recall plateau, to the lowest threshold. ``rule="at_least"``
    (torch-uncertainty 0.13, scikit-learn's ``roc_curve``): the highest threshold whose recall is ≥ ``tpr``,
    among the distinct scores and, as ``roc_curve``'s first point, +inf (recall 0, FPR 0: ``tpr=0`` gives 0).
    Scores must be finite.

    Example:
        >>> import torch
        >>> fpr_at_tpr(torch.tensor([.9, .8, .7, .6, .4, .2, .1]), torch.tensor([1, 0, 1, 0, 0, 1, 0]))
        tensor(0.7500, dtype=torch.float64)
    """
    level = check_float(tpr, "tpr", low=0, high=1)
    check_choice(rule, "rule", {"nearest", "at_least"})
    scores, t = _ood_inputs(scores, is_ood)
    total = float(t.sum())
    if total == 0:
        return torch.tensor(float("nan"), dtype=torch.float64, device=scores.device)
    tps, fps = _threshold_counts(scores, t)
    if rule == "at_least":  # the points of roc_curve: threshold +inf (nothing selected), then each block
        zero = tps.new_zeros(1)
        tps, fps = torch.cat([zero, tps]), torch.cat([zero, fps])
        j = int(torch.searchsorted(tps / total, tps.new_tensor([level])))
        return fps[min(j, fps.shape[0] - 1)] / (t.shape[0] - total)
    stop = int(torch.searchsorted(tps, tps[-1]))  # first block reaching every positive
    return fps[_nearest_block(tps[: stop + 1] / total, level)] / (t.shape[0] - total)


def _nearest_block(recall: torch.Tensor, level: float) -> int:
    """The last index j minimising ``|recall_j − level|`` (float64) over a non-decreasing ``recall`` whose last
    entry is 1 >= level: ties go to the higher recall and, on a plateau, to the later block (the lowest
    threshold), as ``argmin`` over the reversed blocks does. ``recall − level`` rounds monotonically, so the
    distance does not increase up to the first block c with recall >= level and does not decrease from c
    on: the minimum is at c − 1 or at c, and the last block at c's distance closes the run from c."""
    c = int(torch.searchsorted(recall, recall.new_tensor([level])))
    above = (recall[c:] - level).abs()  # non-decreasing, above[0] is c's distance
    j = c + int(torch.searchsorted(above, above[:1], right=True)) - 1
    if c > 0 and float((recall[c - 1] - level).abs()) < float(above[0]):
        j = c - 1
    return j


def average_precision(scores, labels) -> torch.Tensor:
    """Average precision ``Σ_n (R_n − R_{n−1}) P_n`` over distinct thresholds (step rule; equals scikit-learn's
    ``average_precision_score``), positives ``labels == 1``, higher score = more positive. NaN without
    positives.

    Example:
        >>> import torch
        >>> average_precision(torch.tensor([.9, .8, .7, .1]), torch.tensor([1, 0, 1, 0]))
        tensor(0.8333, dtype=torch.float64)
    """
    scores, t = _ood_inputs(scores, labels, "labels")
    total = float(t.sum())
    if total == 0:
        return torch.tensor(float("nan"), dtype=torch.float64, device=scores.device)
    tps, fps = _threshold_counts(scores, t)
    precision = tps / (tps + fps)
    recall = tps / total
    return ordered_sum((recall - torch.cat([recall.new_zeros(1), recall[:-1]])) * precision)


class OODMetrics(NamedTuple):
    """OOD detection metrics (OOD positive): AUROC, FPR at 95 % TPR, AUPR-In (ID positive, confidence as
    score) and AUPR-Out (OOD positive)."""

    auroc: torch.Tensor
    fpr95: torch.Tensor
    aupr_in: torch.Tensor
    aupr_out: torch.Tensor


def ood_detection_metrics(
    in_dist, out_dist, *, score: str = "max_prob", from_logits: bool = False, tpr: float = 0.95
) -> OODMetrics:
    """AUROC, FPR@TPR, AUPR-In and AUPR-Out of telling ``out_dist`` samples from ``in_dist`` ones by a
    :func:`confidence_score` (the OOD score is its negation: higher = more OOD). ``"max_logit"`` and
    ``"energy"`` need logits (``from_logits=True``). AUROC counts ties ½ (Mann-Whitney); the AUPRs are
    average precisions (:func:`average_precision`).

    Example:
        >>> import torch
        >>> p_in = torch.tensor([[0.95, 0.05], [0.9, 0.1], [0.8, 0.2]])
        >>> p_out = torch.tensor([[0.5, 0.5], [0.85, 0.15]])
        >>> [round(float(v), 4) for v in ood_detection_metrics(p_in, p_out)]
        [0.8333, 0.3333, 1.0, 0.8333]
    """
    conf_in = confidence_score(in_dist, score=score, from_logits=from_logits)
    conf_out = confidence_score(out_dist, score=score, from_logits=from_logits).to(conf_in.device)
    ood = -torch.cat([conf_in, conf_out])
    t = torch.cat([torch.zeros_like(conf_in), torch.ones_like(conf_out)])
    return OODMetrics(
        binary_auroc(ood, t),
        fpr_at_tpr(ood, t, tpr=tpr),
        average_precision(-ood, 1 - t),
        average_precision(ood, t),
    )


_only_public(__name__)
