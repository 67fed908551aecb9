"""Calibration metrics with one explicit convention (SPEC §3).

Every public function takes ``probs`` of shape (N, K) (or logits with ``from_logits=True``) and integer
``targets`` of shape (N,), validates them, and returns a 0-d float64 tensor on the input's device. As the
losses, they also take (N, K, d1, ...) scores with (N, d1, ...) targets (each position a sample) and
``ignore_index`` (default None: every label counts; −100 leaves out the positions so labelled, as
``F.cross_entropy``), decision 97. Sums are
accumulated in float64. The ``*_from_*`` helpers compute the same numbers from sufficient statistics; the
streaming :class:`torchcal.metrics.CalibrationMetrics` calls them too, so streamed and one-shot values agree.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Literal, NamedTuple, overload

import numpy as np
import torch

from .._validation import (
    _FROM_LOGITS_ADVICE,
    as_data,
    check_choice,
    check_float,
    check_logits,
    check_positive_int,
    check_probs,
    check_targets,
)
from . import _backend
from ._binning import (
    bin_sums,
    classwise_sums,
    equal_mass_cuts,
    equal_mass_sums,
    equal_width_index,
    prefix_sums,
)
from ._inputs import metric_rows, probs_and_targets, scan_inputs, top_label_bins, top_label_inputs
from ._spec import ordered_sum

_NAMES = ("probs", "targets")  # the arguments' names in metric_rows' errors

__all__ = [
    "expected_calibration_error",
    "adaptive_calibration_error",
    "classwise_calibration_error",
    "maximum_calibration_error",
    "negative_log_likelihood",
    "brier_score",
    "root_brier_score",
    "error_rate",
    "smooth_calibration_error",
    "debiased_calibration_error",
    "ece_sweep",
    "kde_calibration_error",
    "confidence_at_least",
    "ood_auroc",
    "ConfidenceShare",
]


# ----------------------------------------------------------------------------- statistics -> metric


def ece_from_sums(count, conf_sum, correct_sum) -> torch.Tensor:
    """Σ_m (|B_m|/N)·|acc_m − conf_m| = Σ_m |Σ correct − Σ conf| / N; empty bins add 0."""
    if count.ndim == 1 and count.is_cpu and conf_sum.dtype == torch.float64 and not conf_sum.requires_grad:
        # one set of M float64 bins on CPU: numpy's ops cost ~1 µs where each torch op costs ~5-10 µs
        gap = np.abs(correct_sum.numpy() - conf_sum.numpy()).sum() / count.numpy().sum()
        return torch.from_numpy(np.asarray(gap, dtype=np.float64))
    return (correct_sum - conf_sum).abs().sum(-1) / count.sum(-1)


def mce_from_sums(count, conf_sum, correct_sum) -> torch.Tensor:
    """max over non-empty bins of |acc_m − conf_m|."""
    gaps = (correct_sum - conf_sum).abs() / count.clamp(min=1)
    return torch.where(count > 0, gaps, torch.full_like(gaps, -math.inf)).amax(-1)


def classwise_from_sums(conf_sum, correct_sum, n) -> torch.Tensor:
    """Mean over the K classes of Σ_m |Σ [y = k] − Σ p_k| / N (arguments of shape (K, M))."""
    return ((correct_sum - conf_sum).abs().sum(dim=1) / n).mean()


def sorted_by_confidence(conf: torch.Tensor, correct: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable ascending sort of confidences, carrying correctness along (ties keep input order).

    On CPU with the C++ extension built this is its radix sort of the bit patterns, which carries the
    correctness itself (1M samples on 2 cores: ~13 ms); otherwise ``torch.sort(stable=True)`` and a gather
    (:func:`torchcal.functional._backend.sort_with_flags`)."""
    return _backend.sort_with_flags(conf, correct)


def adaece_from_sorted(conf_sorted, correct_sorted, n_bins: int, prefix=None) -> torch.Tensor:
    return ece_from_sums(*equal_mass_sums(conf_sorted, correct_sorted, n_bins, prefix))


def debiased_from_sorted(conf_sorted, correct_sorted, n_bins: int, prefix=None) -> torch.Tensor:
    return debiased_from_sums(*equal_mass_sums(conf_sorted, correct_sorted, n_bins, prefix))


def debiased_from_sums(count, conf_sum, correct_sum) -> torch.Tensor:
    """Kumar et al. 2019 debiased L2 error from bin sums: sqrt(max(0, Σ_m w_m (gap_m² − v_m)))."""
    n = count.sum(-1, keepdim=True)
    safe = count.clamp(min=1)
    acc = correct_sum / safe
    gap_sq = ((correct_sum - conf_sum) / safe) ** 2
    variance = acc * (1 - acc) / (count - 1).clamp(min=1)
    per_bin = torch.where(count >= 2, gap_sq - variance, torch.zeros_like(gap_sq))
    return ((count / n) * per_bin).sum(-1).clamp(min=0).sqrt()


def _first_non_monotone(c_corr: torch.Tensor, n: int, lo: int, hi: int) -> int | None:
    """The smallest b in [lo, hi] whose b equal-mass bins have decreasing accuracies somewhere, None if there
    is none: every (b, bin) pair of the block at once, from the prefix sums ``c_corr`` of the sorted
    correctness (integer sums: the comparisons are exact)."""
    b, j, start, end = equal_mass_cuts(n, lo, hi, c_corr.device)
    acc = (c_corr[end] - c_corr[start]) / (end - start).double()
    drop = (acc[1:] < acc[:-1]) & (j[1:] > 0)  # a decrease between neighbouring bins of the same b
    if not bool(drop.any()):
        return None
    return int(b[1:][drop].min())


def sweep_from_sorted(conf_sorted, correct_sorted, p: int = 1, prefix=None):
    """Roelofs et al. 2022 ECE_sweep (equal mass): the largest b whose bin accuracies are monotone.

    Returns (value, n_bins). Bin sums come from :func:`prefix_sums` (``prefix``: already computed); the b
    are tested in blocks, all bins of a block in one pass of tensor ops (b = 2…64, then blocks doubling in
    length, at most ~2^22 bins each) instead of a loop of small ops per b.
    """
    n = conf_sorted.shape[0]
    prefix = prefix_sums(conf_sorted, correct_sorted) if prefix is None else prefix
    c_corr = prefix[1]

    corr = correct_sorted.to(torch.int8)
    if bool((corr[1:] >= corr[:-1]).all()):
        best = n  # a sorted 0/1 sequence gives monotone bin means for every b
    else:
        best, lo = n, 2
        while lo <= n:  # b = 2, 3, ... tested in blocks: [2, 64], then blocks doubling in length, of at
            hi = min(n, max(64, 2 * lo - 1))  # most ~2^22 (b, bin) pairs
            hi = min(hi, lo - 1 + max(1, (1 << 22) // hi))
            failed = _first_non_monotone(c_corr, n, lo, hi)
            if failed is not None:
                best = failed - 1
                break
            lo = hi + 1
    count, conf_sum, corr_sum = equal_mass_sums(conf_sorted, correct_sorted, best, prefix)
    gaps = ((corr_sum - conf_sum) / count).abs() ** p
    value = ((count / n) * gaps).sum() ** (1.0 / p)
    return value, best


def brier_per_sample(probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Σ_k (p_k − onehot_k)² = Σ_k p_k² − 2 p_t + 1, the squares summed in float64 as the C++ scan sums them
    (a float32 batch is upcast in chunks of 2^20 entries: no (N, K) float64 copy)."""
    if probs.dtype == torch.float64 or probs.numel() == 0:
        sq = torch.linalg.vector_norm(probs, dim=1, dtype=torch.float64) ** 2
    else:
        rows = max(1, (1 << 20) // probs.shape[1])
        sq = (
            torch.cat([torch.linalg.vector_norm(c, dim=1, dtype=torch.float64) for c in probs.split(rows)])
            ** 2
        )
    p_true = probs.gather(1, targets[:, None]).squeeze(1).double()
    return sq - 2 * p_true + 1


def brier_from_sums(sum_sq: float, p_true: torch.Tensor, n: int) -> torch.Tensor:
    """Mean Brier score from Σ_ik p_ik² (float64, from the fused scan) and the true-class probabilities."""
    return (sum_sq - 2 * ordered_sum(p_true.double()) + n) / n


# ----------------------------------------------------------------------------- public metrics


def expected_calibration_error(
    probs, targets, *, n_bins: int = 15, from_logits: bool = False, ignore_index=None
):
    r"""Expected calibration error with equal-width bins (top-label).

    .. math:: \mathrm{ECE} = \sum_{m} \frac{|B_m|}{N} \left| \mathrm{acc}(B_m) - \mathrm{conf}(B_m) \right|

    Bin ``m`` holds confidences in ``(m/M, (m+1)/M]`` (closed on the right); bin 0 also holds 0. An empty
    bin adds 0. Confidence is ``max_k p_ik``; a tie in the maximum predicts the lowest class index.

    Args:
        probs: probabilities (rows sum to 1), or logits with ``from_logits=True``.
        targets: integer class labels.
        n_bins: number of bins M.
        from_logits: apply softmax to ``probs`` first.

    Shape:
        probs (N, K) with K >= 2, targets (N,). Returns a 0-d float64 tensor in [0, 1].

    Raises:
        ValueError: naming the argument on bad shapes, ranges or NaN.
        TypeError: naming the argument on a bad dtype.

    References:
        Naeini et al. 2015; Guo et al. 2017.

    Example:
        >>> import torch
        >>> from torchcal.functional import expected_calibration_error
        >>> probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7]])
        >>> targets = torch.tensor([0, 1, 1])
        >>> expected_calibration_error(probs, targets, n_bins=10)  # float32 0.6 > 0.6: bin (0.6, 0.7]
        tensor(0.1333, dtype=torch.float64)
    """
    probs, targets = metric_rows(probs, targets, ignore_index, names=_NAMES)
    n_bins = check_positive_int(n_bins, "n_bins")
    return ece_from_sums(*top_label_bins(probs, targets, from_logits, n_bins))


def maximum_calibration_error(
    probs, targets, *, n_bins: int = 15, from_logits: bool = False, ignore_index=None
):
    """Maximum calibration error: the largest |acc_m − conf_m| over non-empty equal-width bins.

    Bins as in :func:`expected_calibration_error` (``(m/M, (m+1)/M]``, 0 in bin 0); empty bins are skipped.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7]])
        >>> maximum_calibration_error(probs, torch.tensor([0, 1, 1]), n_bins=10)
        tensor(0.1500, dtype=torch.float64)
    """
    probs, targets = metric_rows(probs, targets, ignore_index, names=_NAMES)
    n_bins = check_positive_int(n_bins, "n_bins")
    return mce_from_sums(*top_label_bins(probs, targets, from_logits, n_bins))


def adaptive_calibration_error(
    probs, targets, *, n_bins: int = 15, from_logits: bool = False, ignore_index=None
):
    """Adaptive (equal-mass) ECE, "AdaECE" / "ECE_EM".

    Confidences are sorted (stable: ties keep input order) and the sorted order is cut into ``n_bins``
    contiguous groups whose sizes differ by at most one, larger groups first (``numpy.array_split``). The
    value is Σ_m (|B_m|/N)·|acc_m − conf_m|; with N < M the empty groups add 0. Every sample is counted
    (Mukhoti et al.'s released code drops the lowest-confidence sample; see docs/decisions.md).

    Example:
        >>> import torch
        >>> probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.2, 0.8]])
        >>> adaptive_calibration_error(probs, torch.tensor([0, 1, 1, 0]), n_bins=2)  # .5*.15 + .5*.35
        tensor(0.2500, dtype=torch.float64)
    """
    probs, targets = metric_rows(probs, targets, ignore_index, names=_NAMES)
    n_bins = check_positive_int(n_bins, "n_bins")
    return adaece_from_sorted(*sorted_by_confidence(*top_label_inputs(probs, targets, from_logits)), n_bins)


def classwise_calibration_error(
    probs, targets, *, n_bins: int = 15, from_logits: bool = False, ignore_index=None
):
    """Classwise ECE: the mean over the K columns of a per-class equal-width ECE.

    For class k, bins are equal-width on p_ik over all N samples (``(m/M, (m+1)/M]``, 0 in bin 0), the bin
    accuracy is the fraction with y = k and the bin confidence the mean p_ik; CE_k = Σ_m (|B_mk|/N)·|acc −
    conf|, empty bins add 0, and the result is (1/K) Σ_k CE_k with K = ``probs.shape[1]``.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7]])
        >>> classwise_calibration_error(probs, torch.tensor([0, 1, 1]), n_bins=10)
        tensor(0.3333, dtype=torch.float64)
    """
    probs, targets = metric_rows(probs, targets, ignore_index, names=_NAMES)
    n_bins = check_positive_int(n_bins, "n_bins")
    probs, targets = probs_and_targets(probs, targets, from_logits)
    _, conf_sum, correct_sum = classwise_sums(probs, targets, n_bins)
    return classwise_from_sums(conf_sum, correct_sum, probs.shape[0])


def negative_log_likelihood(probs, targets, *, from_logits: bool = False, ignore_index=None):
    """Mean negative log-likelihood −(1/N) Σ log p_t.

    p_t is clamped below at the smallest positive normal number of the working dtype (float32 for half
    inputs), so a zero probability costs −log(tiny) (≈ 87.3 in float32) instead of inf. The C++ scan (CPU)
    takes the log of the clamped p_t in float64, the torch path in the working dtype (they agree to its
    rounding, ~1e-7 relative for float32). With
    ``from_logits=True`` the same clamp is applied to the log-softmax, so both paths agree.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[0.5, 0.5], [0.25, 0.75]], dtype=torch.float64)
        >>> negative_log_likelihood(probs, torch.tensor([0, 1]))
        tensor(0.4904, dtype=torch.float64)
    """
    probs, targets = metric_rows(probs, targets, ignore_index, names=_NAMES)
    if from_logits:
        logits = check_logits(as_data(probs, "probs"), "probs", warn_if_probs=_FROM_LOGITS_ADVICE)
        targets = check_targets(targets, logits.shape[0], logits.shape[1])
        log_p = torch.log_softmax(logits, dim=1).gather(1, targets[:, None]).squeeze(1)
        floor = math.log(torch.finfo(log_p.dtype).tiny)
        return ordered_sum((-log_p.clamp(min=floor)).double()) / log_p.shape[0]
    probs, targets, scan = scan_inputs(probs, targets, False, threshold=1.0)
    assert scan.sums is not None  # scan_inputs sums with a threshold
    return torch.as_tensor(scan.sums.nll / probs.shape[0], dtype=torch.float64, device=probs.device)


def brier_score(probs, targets, *, from_logits: bool = False, ignore_index=None):
    """Multiclass Brier score: the mean over samples of Σ_k (p_k − onehot_k)², in [0, 2].

    This is the convention of Mukhoti et al. (not divided by K).

    Example:
        >>> import torch
        >>> brier_score(torch.tensor([[0.75, 0.25], [0.5, 0.5]]), torch.tensor([0, 1]))
        tensor(0.3125, dtype=torch.float64)
    """
    probs, targets = metric_rows(probs, targets, ignore_index, names=_NAMES)
    probs, targets, scan = scan_inputs(probs, targets, from_logits)
    if scan.sum_sq is None:
        return ordered_sum(brier_per_sample(probs, targets)) / probs.shape[0]
    return brier_from_sums(scan.sum_sq, probs.gather(1, targets[:, None]), probs.shape[0])


def root_brier_score(probs, targets, *, from_logits: bool = False, ignore_index=None):
    """Root Brier score (RBS) of Gruber & Buettner 2022: the square root of :func:`brier_score`, an upper
    bound of the L2 canonical calibration error whose estimate needs no binning (the Dual Focal paper's
    appendix G reports it). Streaming: :class:`~torchcal.metrics.CalibrationMetrics` takes it from its
    Brier sums.

    Example:
        >>> import torch
        >>> root_brier_score(torch.tensor([[0.75, 0.25], [0.5, 0.5]]), torch.tensor([0, 1]))  # sqrt(0.3125)
        tensor(0.5590, dtype=torch.float64)
    """
    # (the Brier score from sums can round a hair below 0 for perfect predictions)
    return brier_score(probs, targets, from_logits=from_logits, ignore_index=ignore_index).clamp(min=0).sqrt()


def error_rate(probs, targets, *, from_logits: bool = False, ignore_index=None):
    """Top-1 error 1 − accuracy; a tie in the maximum predicts the lowest class index.

    Example:
        >>> import torch
        >>> error_rate(torch.tensor([[0.75, 0.25], [0.5, 0.5]]), torch.tensor([0, 1]))
        tensor(0.5000, dtype=torch.float64)
    """
    probs, targets = metric_rows(probs, targets, ignore_index, names=_NAMES)
    _, correct = top_label_inputs(probs, targets, from_logits)
    return 1 - correct.double().mean()


# ----------------------------------------------------------------------------- smooth ECE


def _spread(conf: torch.Tensor, correct: torch.Tensor, g: int) -> torch.Tensor:
    """(2, G) float64 grids: residual conf − correct and weight 1 spread linearly onto G points of [0, 1]."""
    conf = conf.double()
    residual = conf - correct.double()
    pos = conf * (g - 1)
    left = pos.floor().long().clamp(0, g - 2)
    frac = pos - left
    grids = torch.zeros(2, g, dtype=torch.float64, device=conf.device)
    for row, weights in enumerate((residual, torch.ones_like(conf))):
        grids[row].index_add_(0, left, (1 - frac) * weights)
        grids[row].index_add_(0, left + 1, frac * weights)
    return grids


def _smooth_ece_at(conf: torch.Tensor, correct: torch.Tensor, sigma: float, cache=None) -> torch.Tensor:
    """smECE at a fixed bandwidth with the discretisation of the relplot package (Błasiok & Nakkiran 2023).

    Samples are spread linearly onto a regular grid of G points on [0, 1], G = max(2000, round(20/σ))//2 + 1;
    the grid is convolved with a Gaussian of width σ after reflecting it at 0 and 1; both smoothed residual
    r̂ and density δ̂ are read by linear interpolation at E = max(round(10/σ), 200) points, δ̂ gets +1e-4,
    and smECE_σ = Σ |r̂| / Σ δ̂.

    The spreading runs where the data is (torch ops); the (2, G) grids then go to the host, and the
    convolution and the rest run in numpy for every device: the σ search evaluates a dozen bandwidths, and on
    G ~ 1000 points numpy's steps cost a few µs where each small torch op costs ~10 µs (and on a GPU each
    evaluation synchronised anyway, to compare smECE_σ with σ). ``cache`` keeps the data's spectra per G, the
    grid and the interpolation weights across the evaluations of one search.
    """
    g = max(2000, round(20 / sigma)) // 2 + 1
    size = _fft_size(g)
    cache = {} if cache is None else cache
    if g not in cache:  # the data's spectra depend on σ only through G; σ >= 0.01 share G = 1001
        grids = _spread(conf, correct, g).cpu().numpy()
        ext = np.concatenate([grids[:, :0:-1], grids, grids[:, -2::-1]], axis=1)  # reflect: 3G - 2 points
        cache[g] = np.fft.rfft(ext, size)
        cache["t", g] = np.linspace(0.0, 1.0, g)
    t = cache["t", g]
    kernel = np.exp(-((t - 0.5) ** 2) / (2 * sigma**2)) / (math.sqrt(2 * math.pi) * sigma)
    full = np.fft.irfft(cache[g] * np.fft.rfft(kernel, size), size)
    start = g - 1 + g // 2  # the 'valid' part starts at G - 1; keep the G values centred on the data
    smoothed_residual, smoothed_ones = full[:, start : start + g]
    e = max(round(10 / sigma), 200)
    if ("interp", g, e) not in cache:
        pos = np.linspace(0.0, 1.0, e) * (g - 1)
        idx = np.clip(pos.astype(np.int64), 0, g - 2)
        cache["interp", g, e] = (idx, pos - idx)
    idx, w = cache["interp", g, e]
    num = smoothed_residual[idx] * (1 - w) + smoothed_residual[idx + 1] * w
    den = smoothed_ones[idx] * (1 - w) + smoothed_ones[idx + 1] * w + 1e-4
    return torch.tensor(float(np.abs(num).sum() / den.sum()), dtype=torch.float64, device=conf.device)


@functools.lru_cache(maxsize=64)
def _fft_size(g: int) -> int:
    """The FFT length for smECE's convolution on G grid points: the smallest 2^a 3^b 5^c that holds the
    reflected grid (3G − 2 points; a shorter transform would truncate it). Circular aliasing then never
    reaches the G outputs that are kept (those need a length above 2G − 2 + G//2 and 3G − 3 − G//2)."""
    need = 3 * g - 2
    best = 1 << (need - 1).bit_length()
    p5 = 1
    while p5 < best:
        p35 = p5
        while p35 < best:
            size = p35
            while size < need:
                size *= 2
            best = min(best, size)
            p35 *= 3
        p5 *= 5
    return best


def smooth_ece_from_conf(conf, correct, sigma=None, eps: float = 1e-3, refine: int = 10):
    """smECE and its σ from top-label confidences; σ = None solves smECE_σ = σ by bisection on (0, 1].

    The bisection follows relplot: σ = 1 if smECE_1 >= 1 (never in practice); otherwise ``refine`` halvings
    of [0, 1] keep the upper end at a σ with σ >= smECE_σ (or σ >= eps), so the returned σ is within 2^-refine
    of the fixed point, from above.
    """
    cache = {}
    if sigma is not None:
        return _smooth_ece_at(conf, correct, sigma, cache), sigma

    def below_fixed_point(s):
        return s < eps or s < float(_smooth_ece_at(conf, correct, s, cache))

    if below_fixed_point(1.0):
        sigma = 1.0
    else:
        hi, lo = 1.0, 0.0
        for _ in range(refine):
            mid = (hi + lo) / 2
            if below_fixed_point(mid):
                lo = mid
            else:
                hi = mid
        sigma = hi
    return _smooth_ece_at(conf, correct, sigma, cache), sigma


@overload
def smooth_calibration_error(
    probs, targets, *, sigma: float | None = ..., from_logits: bool = ..., ignore_index=...,
    return_sigma: Literal[False] = ...,
) -> torch.Tensor: ...
@overload
def smooth_calibration_error(
    probs, targets, *, sigma: float | None = ..., from_logits: bool = ..., ignore_index=...,
    return_sigma: Literal[True],
) -> tuple[torch.Tensor, float]: ...
@overload
def smooth_calibration_error(
    probs, targets, *, sigma: float | None = ..., from_logits: bool = ..., ignore_index=...,
    return_sigma: bool = ...,
) -> torch.Tensor | tuple[torch.Tensor, float]: ...
def smooth_calibration_error(
    probs,
    targets,
    *,
    sigma: float | None = None,
    from_logits: bool = False,
    ignore_index=None,
    return_sigma: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, float]:
    """Smooth ECE (smECE) of Błasiok & Nakkiran 2023 on the top-label confidence.

    The residual conf − correct is smoothed with a Gaussian kernel reflected at 0 and 1; smECE_σ is the
    density-weighted mean absolute smoothed residual. By default σ is the fixed point smECE_σ = σ, found by
    the same bisection and grid discretisation as the ``relplot`` package's ``smECE`` (agreement within 1e-6
    is tested). Pass ``sigma`` to evaluate at a fixed bandwidth.

    Args:
        sigma: fixed bandwidth in (0, 1], or None for the fixed point.
        return_sigma: also return the bandwidth used, as ``(value, sigma)``.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.2, 0.8]])
        >>> smooth_calibration_error(probs, torch.tensor([0, 1, 1, 0]))
        tensor(0.2498, dtype=torch.float64)
    """
    probs, targets = metric_rows(probs, targets, ignore_index, names=_NAMES)
    if sigma is not None:
        sigma = check_float(sigma, "sigma", low=0, high=1, low_open=True)
    value, used = smooth_ece_from_conf(*top_label_inputs(probs, targets, from_logits), sigma=sigma)
    return (value, used) if return_sigma else value


def debiased_calibration_error(
    probs, targets, *, n_bins: int = 15, from_logits: bool = False, ignore_index=None
):
    r"""Debiased L2 calibration error of Kumar et al. 2019 on equal-mass top-label bins.

    .. math:: \sqrt{\max\Big(0, \sum_m \frac{|B_m|}{N}\big[(\mathrm{conf}_m - \mathrm{acc}_m)^2
              - \frac{\mathrm{acc}_m (1-\mathrm{acc}_m)}{|B_m| - 1}\big]\Big)}

    Bins with fewer than two samples add 0. Bins are cut as in :func:`adaptive_calibration_error`
    (Kumar's code cuts at quantile boundaries, which differs only with ties at a boundary).

    Example:
        >>> import torch
        >>> probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.7, 0.3]])
        >>> debiased_calibration_error(probs, torch.tensor([1, 1, 1, 1]), n_bins=2)
        tensor(0.7566, dtype=torch.float64)
    """
    probs, targets = metric_rows(probs, targets, ignore_index, names=_NAMES)
    n_bins = check_positive_int(n_bins, "n_bins")
    return debiased_from_sorted(*sorted_by_confidence(*top_label_inputs(probs, targets, from_logits)), n_bins)


@overload
def ece_sweep(
    probs, targets, *, p: int = ..., binning: str = ..., from_logits: bool = ..., ignore_index=...,
    return_n_bins: Literal[False] = ...,
) -> torch.Tensor: ...
@overload
def ece_sweep(
    probs, targets, *, p: int = ..., binning: str = ..., from_logits: bool = ..., ignore_index=...,
    return_n_bins: Literal[True],
) -> tuple[torch.Tensor, int]: ...
@overload
def ece_sweep(
    probs, targets, *, p: int = ..., binning: str = ..., from_logits: bool = ..., ignore_index=...,
    return_n_bins: bool = ...,
) -> torch.Tensor | tuple[torch.Tensor, int]: ...
def ece_sweep(
    probs,
    targets,
    *,
    p: int = 1,
    binning: str = "equal_mass",
    from_logits: bool = False,
    ignore_index=None,
    return_n_bins: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, int]:
    """ECE_sweep of Roelofs et al. 2022, with equal-mass bins (default) or equal-width bins.

    Tries b = 2, 3, ... bins and keeps the largest b before the first whose bin accuracies are not
    monotonically non-decreasing in bin confidence (b = 1 if b = 2 already fails; empty bins are skipped);
    returns (Σ_m |B_m|/N · |acc_m − conf_m|^p)^(1/p) at that b. Equal-mass bins are cut as in
    :func:`adaptive_calibration_error`; ``binning="equal_width"`` uses the ECE's bins (m/b, (m+1)/b] (0 in
    bin 0), the EW sweep beside the EM one (AdaFocal's appendix F reports the EM sweep); both stop at b = N.

    Args:
        p: 1 for the L1 (ECE) form, 2 for the L2 form.
        binning: "equal_mass" or "equal_width".
        return_n_bins: also return the chosen number of bins, as ``(value, n_bins)``.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.2, 0.8]])
        >>> ece_sweep(probs, torch.tensor([0, 1, 1, 0]), return_n_bins=True)
        (tensor(0.2500, dtype=torch.float64), 2)
        >>> ece_sweep(probs, torch.tensor([0, 1, 1, 0]), binning="equal_width", return_n_bins=True)
        (tensor(0.2500, dtype=torch.float64), 4)
    """
    probs, targets = metric_rows(probs, targets, ignore_index, names=_NAMES)
    check_positive_int(p, "p")
    check_choice(binning, "binning", ("equal_mass", "equal_width"))
    conf, correct = top_label_inputs(probs, targets, from_logits)
    if binning == "equal_width":
        value, b = sweep_equal_width(conf, correct, p)
    else:
        value, b = sweep_from_sorted(*sorted_by_confidence(conf, correct), p=p)
    return (value, b) if return_n_bins else value


def sweep_equal_width(conf, correct, p: int = 1):
    """(value, n_bins) of the equal-width ECE_sweep from top-label confidences and correctness: one bin
    assignment per b (bins contiguous in confidence, so a confidence-sorted correctness that never decreases
    makes every b monotone: then b = N without trying each)."""
    n = conf.shape[0]
    conf64, correct = conf.double(), correct.bool()
    order = torch.sort(conf64, stable=True).indices
    corr_sorted = correct[order].to(torch.int8)

    def sums(b):
        return bin_sums(equal_width_index(conf64, b), b, conf64, correct)

    best = 1
    if bool((corr_sorted[1:] >= corr_sorted[:-1]).all()):
        best = max(n, 1)
    else:
        for b in range(2, n + 1):
            count, _, corr_sum = sums(b)
            acc = corr_sum[count > 0] / count[count > 0]
            if bool((acc[1:] < acc[:-1]).any()):
                break
            best = b
    count, conf_sum, corr_sum = sums(best)
    gaps = ((corr_sum - conf_sum) / count.clamp(min=1)).abs() ** p
    return ((count / n) * gaps).sum() ** (1.0 / p), best


# ----------------------------------------------------------------------------- KDE ECE

_KDE_BANDWIDTHS = tuple(10 ** (-5 + 4 * i / 14) for i in range(15)) + (0.2, 0.4, 0.6, 0.8, 1.0)


def _dirichlet_log_kernel(log_f_rows, f_cols, bandwidth, log_norm_cols):
    """log Dir(f_i | α_j = f_j/h + 1) for every row i against every column j: (n_rows, n_cols)."""
    return log_f_rows @ (f_cols / bandwidth).T + log_norm_cols[None, :]


def _kde_log_norm(f, bandwidth):
    alpha = f / bandwidth + 1
    return torch.lgamma(alpha.sum(1)) - torch.lgamma(alpha).sum(1)


# KDE ECE warns above this many kernel evaluations (pairs × bandwidths): about 5 s on 2 CPU cores
KDE_WARN_PAIRS = 400_000_000


def _kde_select_bandwidth(f, log_f, chunk) -> float:
    """Leave-one-out log-likelihood of the Dirichlet KDE over a fixed grid; returns the maximiser."""
    n = f.shape[0]
    best, best_ll = None, -math.inf
    for h in _KDE_BANDWIDTHS:
        log_norm = _kde_log_norm(f, h)
        ll = 0.0
        for s in range(0, n, chunk):
            lk = _dirichlet_log_kernel(log_f[s : s + chunk], f, h, log_norm)
            rows = torch.arange(lk.shape[0], device=f.device)
            lk[rows, rows + s] = -math.inf
            ll += float((torch.logsumexp(lk, dim=1) - math.log(n - 1)).sum())
        if ll > best_ll:
            best, best_ll = h, ll
    assert best is not None, "no bandwidth's leave-one-out log-likelihood exceeds -inf"
    return best


def kde_calibration_error(
    probs,
    targets,
    *,
    bandwidth: float | str = "auto",
    from_logits: bool = False,
    ignore_index=None,
    chunk_size: int = 1024,
):
    """Canonical L1 calibration error with a Dirichlet kernel (Popordanoska et al. 2022).

    E[y | f(x) = f_i] is estimated leave-one-out as Σ_{j≠i} k(f_i; f_j) onehot(y_j) / Σ_{j≠i} k(f_i; f_j)
    with the Dirichlet kernel k(f; f_j) = Dir(f; f_j/h + 1); the value is (1/N) Σ_i ‖Ê[y|f_i] − f_i‖₁,
    which lies in [0, 2] (an L1 distance between distributions, as in the paper). ``bandwidth="auto"``
    maximises the leave-one-out log-likelihood of the density estimate over the paper code's grid
    (15 log-spaced values in [1e-5, 0.1] and 0.2, ..., 1.0). Cost O(N²K) time, O(chunk·N) memory:
    one pass over the N² pairs per bandwidth tried (21 with ``"auto"``, 1 with a given bandwidth). Above
    4·10⁸ pair evaluations (N ≈ 4,400 with ``"auto"``, about 5 s on a 2-core CPU; N = 20,000 with a fixed
    bandwidth) it warns with the expected cost; nothing is subsampled silently: pass a random subset
    (or use :func:`bootstrap_ci` on subsets) if that is what you want.
    Probabilities are clamped below at 1e-12 before logs are taken.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.2, 0.8]], dtype=torch.float64)
        >>> kde_calibration_error(probs, torch.tensor([0, 0, 1, 1]), bandwidth=0.5)
        tensor(0.1561, dtype=torch.float64)
    """
    probs, targets = metric_rows(probs, targets, ignore_index, names=_NAMES)
    probs, targets = probs_and_targets(probs, targets, from_logits)
    n, k = probs.shape
    if n < 2:
        raise ValueError("`probs` must have at least 2 rows for the leave-one-out KDE estimator")
    chunk = check_positive_int(chunk_size, "chunk_size")
    passes = len(_KDE_BANDWIDTHS) + 1 if isinstance(bandwidth, str) and bandwidth == "auto" else 1
    if n * n * passes > KDE_WARN_PAIRS:
        warnings.warn(
            f"kde_calibration_error on N = {n} samples evaluates {n * n * passes:.2g} kernel pairs "
            f"(O(N²) per bandwidth, {passes} bandwidth(s)): expect minutes on a CPU; a random subset of a "
            "few thousand samples gives the estimate in seconds",
            UserWarning,
            stacklevel=2,
        )
    f = probs.double().clamp(min=1e-12)
    f = f / f.sum(1, keepdim=True)
    log_f = f.log()
    if bandwidth == "auto":
        h = _kde_select_bandwidth(f, log_f, chunk)
    else:
        h = check_float(bandwidth, "bandwidth", low=0, low_open=True)
    onehot = torch.nn.functional.one_hot(targets, k).double()
    return kde_l1_sum(f, log_f, onehot, h, chunk) / n


def kde_l1_sum(f, log_f, onehot, bandwidth: float, chunk: int) -> torch.Tensor:
    """Σ_i ‖Ê[y | f_i] − f_i‖₁ with the leave-one-out Dirichlet-kernel estimate of E[y | f]: the arithmetic of
    :func:`kde_calibration_error` and of the KDE-XE training loss
    (:func:`torchcal.functional.kde_xe_loss`), differentiable in ``f`` (N >= 2 rows, in f's dtype)."""
    n = f.shape[0]
    log_norm = _kde_log_norm(f, bandwidth)
    total = f.new_zeros(())
    for s in range(0, n, chunk):
        lk = _dirichlet_log_kernel(log_f[s : s + chunk], f, bandwidth, log_norm)
        rows = torch.arange(lk.shape[0], device=f.device)
        lk[rows, rows + s] = -math.inf
        weights = torch.softmax(lk, dim=1)
        total = total + ((weights @ onehot) - f[s : s + chunk]).abs().sum()
    return total


# ----------------------------------------------------------------------------- S99 and OOD


class ConfidenceShare(NamedTuple):
    """Share of samples with confidence >= threshold, and their accuracy (NaN when there are none)."""

    fraction: torch.Tensor
    accuracy: torch.Tensor


def confidence_at_least(
    probs, targets, threshold: float = 0.99, *, from_logits: bool = False, ignore_index=None
):
    """Share of samples whose top-label confidence is >= ``threshold`` and their accuracy ("S99").

    Mukhoti et al. 2020, Table 6. The accuracy is NaN when no sample reaches the threshold (there is no
    accuracy to report; a 0 would be a silent wrong number).

    Example:
        >>> import torch
        >>> probs = torch.tensor([[0.995, 0.005], [0.6, 0.4], [0.001, 0.999], [0.5, 0.5]])
        >>> confidence_at_least(probs, torch.tensor([0, 1, 0, 1]))
        ConfidenceShare(fraction=tensor(0.5000, dtype=torch.float64), accuracy=tensor(0.5000, dtype=torch.float64))
    """
    probs, targets = metric_rows(probs, targets, ignore_index, names=_NAMES)
    threshold = check_float(threshold, "threshold", low=0, high=1)
    conf, correct = top_label_inputs(probs, targets, from_logits)
    confident = conf >= threshold
    count = confident.double().sum()
    hits = (confident & correct).double().sum()
    accuracy = hits / count if bool(count > 0) else torch.tensor(math.nan, dtype=torch.float64)
    return ConfidenceShare(count / conf.shape[0], accuracy)


def _ood_scores(probs, score):
    if score == "entropy":
        return -(probs * torch.log(probs.clamp(min=torch.finfo(probs.dtype).tiny))).sum(1).double()
    return -probs.max(dim=1).values.double()


def binary_auroc(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """AUROC of ``scores`` for binary ``labels`` by the Mann-Whitney statistic with mid-ranks for ties."""
    n_pos = int(labels.sum())
    n_neg = labels.shape[0] - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUROC needs at least one sample of each group")
    s, order = torch.sort(scores.double(), stable=True)
    lab = labels[order]
    # mid-ranks: for each tie group the mean of its 1-based positions
    _, inverse, counts = torch.unique_consecutive(s, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    mid = ends - (counts.double() - 1) / 2
    ranks = mid[inverse]
    rank_sum = ranks[lab.bool()].sum()
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def ood_auroc(probs_in, probs_out, *, score: str = "entropy", from_logits: bool = False):
    """AUROC for telling out-of-distribution inputs (positive) from in-distribution ones (negative).

    ``score="entropy"`` ranks by predictive entropy (higher = more OOD); ``"max_prob"`` by the negated
    top-label probability. Ties get mid-ranks, so identical scores give 0.5.

    Example:
        >>> import torch
        >>> p_in = torch.tensor([[0.95, 0.05], [0.9, 0.1]])
        >>> p_out = torch.tensor([[0.5, 0.5], [0.92, 0.08]])
        >>> ood_auroc(p_in, p_out)
        tensor(0.7500, dtype=torch.float64)
    """
    check_choice(score, "score", {"entropy", "max_prob"})

    def check(x, name):
        x = as_data(x, name)
        return (
            torch.softmax(check_logits(x, name, warn_if_probs=_FROM_LOGITS_ADVICE), 1)
            if from_logits
            else check_probs(x, name)
        )

    p_in = check(probs_in, "probs_in")
    p_out = check(probs_out, "probs_out")
    if p_in.shape[1] != p_out.shape[1]:
        raise ValueError(f"`probs_in` has {p_in.shape[1]} classes but `probs_out` has {p_out.shape[1]}")
    scores = torch.cat([_ood_scores(p_in, score), _ood_scores(p_out.to(p_in.device), score)])
    labels = torch.cat([torch.zeros(p_in.shape[0]), torch.ones(p_out.shape[0])]).to(scores.device)
    return binary_auroc(scores, labels)
