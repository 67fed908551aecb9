"""Is it noise? A calibration hypothesis test by consistency resampling (Bröcker & Smith 2007; SPEC §9.4) and
a paired bootstrap comparison of one metric on two models (or two calibrators) on the same test set."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .._namespace import only_public as _only_public
from .._validation import as_data, check_choice, check_float, check_positive_int
from . import calibration as C
from ._binning import equal_width_index
from ._field_inputs import field_inputs
from ._inputs import in_input_dtype, scan_inputs
from .bootstrap import _CHUNK, _WEIGHTED, _Weighted

__all__ = ["CalibrationTestResult", "PairedComparison", "calibration_test", "paired_bootstrap"]


class CalibrationTestResult(NamedTuple):
    """The observed statistic, the p-value of H0 "calibrated", and the R statistics simulated under H0."""

    statistic: torch.Tensor
    pvalue: torch.Tensor
    null_statistics: torch.Tensor


def _draws(n, n_resamples, seed, device):
    """(indices (R, N), uniforms (R, N)): per resample the N indices first, then the N uniforms."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.empty(n_resamples, n, dtype=torch.long)
    u = torch.empty(n_resamples, n, dtype=torch.float64)
    for r in range(n_resamples):
        torch.randint(n, (n,), generator=gen, out=idx[r])
        torch.rand(n, generator=gen, dtype=torch.float64, out=u[r])
    return idx.to(device), u.to(device)


def _top_label_null(probs, idx, u, n_bins):
    """Top-label equal-width ECE of each resample (rows of ``idx``/``u``): the resampled row keeps its
    confidence and prediction, and the drawn label min{k : Σ_{l≤k} P_l ≥ u} (clamped to K − 1) equals the
    prediction iff ``lo < u ≤ hi`` with lo, hi the cumulative sums before and at the predicted class.

    ``probs`` (N, K) with ``idx``/``u`` (R, N) gives (R,); a batch of data sets, ``probs`` (S, N, K) with
    ``idx``/``u`` (S, R, N), gives (S, R) in one pass."""
    single = probs.ndim == 2
    if single:
        probs, idx, u = probs[None], idx[None], u[None]
    pred = probs.argmax(-1)
    conf = probs.gather(-1, pred[..., None]).squeeze(-1)
    cum = torch.cumsum(probs.double(), -1)
    hi = cum.gather(-1, pred[..., None]).squeeze(-1)
    hi = torch.where(pred == probs.shape[-1] - 1, torch.full_like(hi, float("inf")), hi)
    below = cum.gather(-1, (pred - 1).clamp(min=0)[..., None]).squeeze(-1)
    lo = torch.where(pred > 0, below, torch.zeros_like(hi))
    bins = equal_width_index(conf, n_bins)
    s, r, _ = idx.shape

    def take(x):  # x (S, N) at the resampled rows: (S, R, N)
        return x[:, None, :].expand(s, r, x.shape[-1]).gather(-1, idx)

    correct = ((u > take(lo)) & (u <= take(hi))).double()
    offset = n_bins * torch.arange(s * r, device=idx.device).view(s, r, 1)
    flat = (take(bins) + offset).reshape(-1)
    size = s * r * n_bins
    count = torch.bincount(flat, minlength=size).double().view(s, r, n_bins)
    conf_sum = torch.bincount(flat, weights=take(conf.double()).reshape(-1), minlength=size).view(
        s, r, n_bins
    )
    corr_sum = torch.bincount(flat, weights=correct.reshape(-1), minlength=size).view(s, r, n_bins)
    out = C.ece_from_sums(count, conf_sum, corr_sum)
    return out[0] if single else out


def _sampled_labels(probs, idx, u):
    cum = torch.cumsum(probs.double(), 1)[idx]  # (N, K) for one resample
    return torch.searchsorted(cum, u[:, None], right=False).squeeze(1).clamp(max=probs.shape[1] - 1)


def calibration_test(
    probs,
    targets,
    *,
    kind: str = "top_label",
    statistic: Callable | None = None,
    n_bins: int = 15,
    n_resamples: int = 1000,
    seed: int = 0,
    pvalue: str = "reference",
    from_logits: bool = False,
) -> CalibrationTestResult:
    r"""Consistency-resampling test of H0 "the model is calibrated", ``P(Y | P(X)) = P(X)`` (right-tailed).

    For r = 1..R: draw N rows with replacement (``idx ~ U{0..N−1}``, all N first), then N uniforms ``u``, and
    the label ``y*_j = min{k : Σ_{l≤k} P*_{jl} ≥ u_j}`` (clamped to K − 1): a data set on which the model
    *is* calibrated. ``T_r`` is the statistic on it, and ``p = #{r : T_r ≥ T_obs} / R`` (``pvalue=
    "plus_one"``: ``(1 + #) / (R + 1)``). A small p says the miscalibration is larger than sampling noise at
    this N.

    Args:
        probs: probabilities (N, K) (or (N,) for P(class 1)), or logits with ``from_logits=True``.
        targets: integer labels (N,).
        kind: the statistic: ``"top_label"`` (ECE, L1, ``n_bins`` equal-width bins of SPEC §3; resamples
            evaluated at once) or ``"classwise"`` (classwise ECE); ignored when ``statistic`` is given.
        statistic: any ``f(probs, targets) -> scalar`` (e.g. :func:`ks_calibration_error`), evaluated on
            each resample in turn, on (N, K) probabilities in the caller's dtype (or the softmax of logits).
        n_resamples: R. seed: seed of the ``torch.Generator`` (same seed, same draws, on any device).

    Returns:
        :class:`CalibrationTestResult` (statistic, pvalue, null_statistics (R,)), float64.

    References:
        Bröcker & Smith 2007, "Increasing the reliability of reliability diagrams"; Vaicenavicius et al.
        2019, "Evaluating model calibration in classification" (AISTATS).

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(2)
        >>> probs = torch.softmax(2 * torch.randn(300, 4, generator=g), 1)
        >>> calibrated = torch.multinomial(probs, 1, generator=g).squeeze(1)  # labels drawn from probs
        >>> float(calibration_test(probs, calibrated, n_resamples=200).pvalue)
        0.69
        >>> sharp = torch.softmax(6 * probs.log(), 1)  # the same ranking, over-confident
        >>> float(calibration_test(sharp, calibrated, n_resamples=200).pvalue)
        0.0
    """
    check_choice(kind, "kind", {"top_label", "classwise"})
    check_choice(pvalue, "pvalue", {"reference", "plus_one"})
    n_bins = check_positive_int(n_bins, "n_bins")
    n_resamples = check_positive_int(n_resamples, "n_resamples")
    seed = check_positive_int(seed, "seed", minimum=0)
    if statistic is not None and not callable(statistic):
        raise TypeError(
            f"`statistic` must be a function (probs, targets) -> scalar, got {type(statistic).__name__}"
        )
    probs = as_data(probs, "probs")
    dtype = probs.dtype
    probs, targets = field_inputs(probs, targets, from_logits, allow_empty=False)
    n = probs.shape[0]
    idx, u = _draws(n, n_resamples, seed, probs.device)
    for_statistic = in_input_dtype(probs, dtype, from_logits)  # the statistic validates it again
    if statistic is None and kind == "top_label":
        observed = C.expected_calibration_error(for_statistic, targets, n_bins=n_bins)
        step = max(1, _CHUNK // n)
        null = torch.cat([_top_label_null(probs, idx[s : s + step], u[s : s + step], n_bins)
                          for s in range(0, n_resamples, step)])  # fmt: skip
    else:
        if statistic is None:

            def classwise(p, y):
                return C.classwise_calibration_error(p, y, n_bins=n_bins)

            statistic = classwise
        observed = torch.as_tensor(
            statistic(for_statistic, targets), dtype=torch.float64, device=probs.device
        )
        null = torch.stack([
            torch.as_tensor(statistic(for_statistic[idx[r]], _sampled_labels(probs, idx[r], u[r])),
                            dtype=torch.float64, device=probs.device).reshape(())
            for r in range(n_resamples)
        ])  # fmt: skip
    hits = (null >= observed).double().sum()
    p = hits / n_resamples if pvalue == "reference" else (1 + hits) / (n_resamples + 1)
    return CalibrationTestResult(observed.double(), p, null)


class PairedComparison(NamedTuple):
    """``difference = metric(B) − metric(A)`` on the same samples, its paired percentile interval, a two-
    sided p-value for "no difference", the two estimates and the R bootstrap differences."""

    difference: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    pvalue: torch.Tensor
    estimate_a: torch.Tensor
    estimate_b: torch.Tensor
    samples: torch.Tensor


def paired_bootstrap(
    metric: Callable,
    probs_a,
    probs_b,
    targets,
    *,
    n_resamples: int = 1000,
    confidence_level: float = 0.95,
    seed: int = 0,
    from_logits: bool = False,
    **metric_kwargs,
) -> PairedComparison:
    r"""Paired, seeded bootstrap of the difference ``metric(B) − metric(A)`` of two models (or calibrators)
    scored on the same test set: each replicate draws N indices with replacement and evaluates both models
    on the *same* rows, so the shared sampling noise cancels.

    Interval: percentile of the replicate differences at ``confidence_level``. p-value (two-sided, H0: no
    difference): the replicates shifted to mean zero under H0, ``(1 + #{r : |d*_r − d̂| ≥ |d̂|}) / (R + 1)``
    (Efron & Tibshirani 1993, §16.4). ECE, MCE, AdaECE, debiased ECE, NLL, Brier and error are evaluated for
    all replicates at once (as :func:`torchcal.functional.bootstrap_ci`); any other metric on each replicate.

    Args:
        metric: a metric function ``metric(probs, targets, **metric_kwargs)``; it gets the probabilities
            in the caller's dtype (float16 stays float16), or the softmax of logits.
        probs_a: the first model's probabilities (N, K) (logits with ``from_logits=True``).
        probs_b: the second model's, of the same shape.
        targets: the shared labels (N,).

    Returns:
        :class:`PairedComparison`, float64.

    Example:
        >>> import torch
        >>> from torchcal.functional import expected_calibration_error
        >>> g = torch.Generator().manual_seed(0)
        >>> logits = 2 * torch.randn(500, 4, generator=g)
        >>> targets = torch.multinomial(torch.softmax(logits, 1), 1, generator=g).squeeze(1)
        >>> res = paired_bootstrap(expected_calibration_error, 3 * logits, logits, targets, from_logits=True,
        ...                        n_resamples=300)
        >>> bool(res.high < 0), float(res.pvalue) < 0.01  # B (the calibrated logits) is better
        (True, True)
    """
    if not callable(metric):
        raise TypeError(f"`metric` must be a metric function, got {type(metric).__name__}")
    n_resamples = check_positive_int(n_resamples, "n_resamples")
    level = check_float(confidence_level, "confidence_level", low=0, high=1, low_open=True, high_open=True)
    seed = check_positive_int(seed, "seed", minimum=0)
    probs_a, probs_b = as_data(probs_a, "probs_a"), as_data(probs_b, "probs_b")
    shape_a, shape_b = tuple(probs_a.shape), tuple(probs_b.shape)
    if shape_a != shape_b:
        raise ValueError(f"`probs_a` has shape {shape_a} but `probs_b` has {shape_b}: score the same samples")
    pa, ta, scan_a = scan_inputs(probs_a, targets, from_logits, "probs_a")
    pb, tb, scan_b = scan_inputs(probs_b, targets, from_logits, "probs_b")
    pb, tb = pb.to(pa.device), tb.to(pa.device)
    # ``metric`` validates its input again: in the caller's dtype, with that dtype's row-sum tolerance
    ma, mb = in_input_dtype(pa, probs_a.dtype, from_logits), in_input_dtype(pb, probs_b.dtype, from_logits)
    est_a = torch.as_tensor(metric(ma, ta, **metric_kwargs), dtype=torch.float64).reshape(())
    est_b = torch.as_tensor(metric(mb, tb, **metric_kwargs), dtype=torch.float64).reshape(())
    n = pa.shape[0]
    gen = torch.Generator().manual_seed(seed)
    name = _WEIGHTED.get(metric)
    fast = None  # (A, B) weighted by resample counts: the metrics of _WEIGHTED
    if name is not None:
        n_bins = check_positive_int(metric_kwargs.get("n_bins", 15), "n_bins")
        fast = (
            _Weighted(name, pa, ta, scan_a.conf, scan_a.correct, n_bins),
            _Weighted(name, pb, tb, scan_b.conf.to(pa.device), scan_b.correct.to(pa.device), n_bins),
        )
    diffs = []
    step = max(1, _CHUNK // n)
    for start in range(0, n_resamples, step):
        b = min(step, n_resamples - start)
        idx = torch.randint(n, (b, n), generator=gen).to(pa.device)
        if fast is not None:
            counts = torch.zeros(b, n, dtype=torch.float64, device=pa.device)
            counts.scatter_add_(1, idx, torch.ones_like(counts))
            fast_a, fast_b = fast
            diffs.append(fast_b(counts) - fast_a(counts))
        else:
            for row in idx:
                va = torch.as_tensor(metric(ma[row], ta[row], **metric_kwargs), dtype=torch.float64)
                vb = torch.as_tensor(metric(mb[row], tb[row], **metric_kwargs), dtype=torch.float64)
                diffs.append((vb - va).reshape(1).to(pa.device))
    samples = torch.cat(diffs)
    diff = (est_b - est_a).to(samples.device)
    alpha = (1 - level) / 2
    qs = torch.quantile(samples, torch.tensor([alpha, 1 - alpha], dtype=torch.float64, device=samples.device))
    extreme = ((samples - diff).abs() >= diff.abs()).double().sum()
    return PairedComparison(
        diff,
        qs[0],
        qs[1],
        (1 + extreme) / (n_resamples + 1),
        est_a.to(diff.device),
        est_b.to(diff.device),
        samples,
    )


_only_public(__name__)
