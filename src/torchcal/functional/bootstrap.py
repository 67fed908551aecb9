"""Seeded bootstrap confidence intervals for every calibration estimator."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .._validation import as_data, check_float, check_positive_int
from . import calibration as C
from ._binning import _edges, equal_width_index
from ._inputs import in_input_dtype, nll_from_true_probs, scan_inputs

__all__ = ["BootstrapResult", "bootstrap_ci", "bootstrap_replicates", "resample_counts"]

# Resample matrices are processed in chunks of at most this many (replicate, sample) entries.
_CHUNK = 1 << 22
# Per-sample design matrices (sample × bin statistics) up to this many entries turn the binned sums of all
# resamples into one matrix product; larger ones take index_add / a sparse product.
_DESIGN_LIMIT = 1 << 22


class BootstrapResult(NamedTuple):
    """Point estimate on the full data, percentile interval and the bootstrap replicates."""

    estimate: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    samples: torch.Tensor


def _prefix_at(cum_counts, cum_values, values, positions):
    """Σ of the first ``positions`` items of each resample, where item i is repeated counts[i] times.

    cum_counts, cum_values: (B, N) inclusive prefix sums of counts and counts·values in sorted order;
    values: (N,); positions: (B, P) integers in [0, N].
    """
    i = torch.searchsorted(cum_counts, positions.double(), right=False).clamp(max=values.shape[0] - 1)
    prev_counts = torch.where(
        i > 0, cum_counts.gather(1, (i - 1).clamp(min=0)), torch.zeros_like(positions.double())
    )
    prev_values = torch.where(
        i > 0, cum_values.gather(1, (i - 1).clamp(min=0)), torch.zeros_like(prev_counts)
    )
    out = prev_values + values[i] * (positions.double() - prev_counts)
    return torch.where(positions > 0, out, torch.zeros_like(out))


class _Weighted:
    """Metrics whose value on a resample follows from per-sample statistics weighted by resample counts."""

    def __init__(self, name, probs, targets, conf, correct, n_bins):
        self.name, self.n_bins = name, n_bins
        self.n = conf.shape[0]
        if name in ("ece", "mce"):
            self.bins = equal_width_index(conf, n_bins)
            self.conf, self.correct = conf.double(), correct.double()
            self.design = None
            if self.n * 3 * n_bins <= _DESIGN_LIMIT:  # bin sums of all resamples as one matrix product
                self.design = torch.zeros(self.n, 3, n_bins, dtype=torch.float64, device=conf.device)
                rows = torch.arange(self.n, device=conf.device)
                for j, v in enumerate((torch.ones_like(self.conf), self.conf, self.correct)):
                    self.design[rows, j, self.bins] = v
                self.design = self.design.view(self.n, 3 * n_bins)
        elif name in ("adaece", "debiased"):
            conf_s, self.order = torch.sort(conf, stable=True)  # the order of C.sorted_by_confidence
            self.conf, self.correct = conf_s.double(), correct[self.order].double()
            q, r = divmod(self.n, n_bins)
            sizes = torch.full((n_bins,), q, dtype=torch.long)
            sizes[:r] += 1
            self.ends = sizes.cumsum(0).to(conf.device)
            self.sizes = sizes.double().to(conf.device)
        elif name == "classwise":
            self._init_classwise(probs, targets)
        elif name == "nll":
            p_true = probs.gather(1, targets[:, None]).squeeze(1)
            self.per_sample = nll_from_true_probs(p_true).double()
        elif name == "brier":
            self.per_sample = C.brier_per_sample(probs, targets)
        else:  # error
            self.per_sample = 1 - correct.double()

    def _init_classwise(self, probs, targets):
        """Entries above the first edge 1/M as a sparse (K·M, N) matrix of p_ik at row k·M + bin; bin 0 of
        each class is the weighted column total minus the rest (as :func:`~torchcal.functional._binning.
        classwise_sums` does), so the cost grows with the entries above 1/M, not with N·K."""
        n, k = probs.shape
        m = self.n_bins
        r, c = (probs > _edges(m, probs.dtype, probs.device)[1]).nonzero(as_tuple=True)
        values = probs[r, c]
        rows = c * m + equal_width_index(values, m)
        self.dense = None
        if n * k * m <= _DESIGN_LIMIT:  # few classes: a dense (N, K·M) matrix multiplies faster
            self.dense = torch.zeros(n, k * m, dtype=torch.float64, device=probs.device)
            self.dense[r, rows] = values.double()
        self.above = torch.sparse_coo_tensor(
            torch.stack([rows, r]), values.double(), (k * m, n), device=probs.device, check_invariants=True
        ).coalesce()
        self.probs64 = probs.double()
        p_true = probs.gather(1, targets[:, None]).squeeze(1)
        self.true_flat = targets * m + equal_width_index(p_true, m)
        self.k = k

    def _classwise(self, counts):
        b, m, k = counts.shape[0], self.n_bins, self.k
        if self.dense is not None:
            conf = (counts @ self.dense).view(b, k, m)
        else:
            conf = torch.sparse.mm(self.above, counts.T.contiguous()).T.reshape(b, k, m)
        conf[:, :, 0] = (counts @ self.probs64 - conf[:, :, 1:].sum(2)).clamp(min=0)
        correct = torch.zeros(b, k * m, dtype=torch.float64, device=counts.device)
        correct.index_add_(1, self.true_flat, counts)
        return (correct.view(b, k, m) - conf).abs().sum(2).mean(1) / self.n

    def __call__(self, counts):
        b = counts.shape[0]
        if self.name == "classwise":
            return self._classwise(counts)
        if self.name in ("ece", "mce"):
            if self.design is not None:
                sums = (counts @ self.design).view(b, 3, self.n_bins).unbind(1)
            else:
                sums = []
                for w in (counts, counts * self.conf, counts * self.correct):
                    out = torch.zeros(b, self.n_bins, dtype=torch.float64, device=counts.device)
                    sums.append(out.index_add_(1, self.bins, w))
            return (C.ece_from_sums if self.name == "ece" else C.mce_from_sums)(*sums)
        if self.name in ("adaece", "debiased"):
            counts = counts[:, self.order]
            cum = counts.cumsum(1)
            ends = self.ends.expand(b, -1)
            sums = []
            for v in (self.conf, self.correct):
                at_end = _prefix_at(cum, (counts * v).cumsum(1), v, ends)
                sums.append(torch.diff(at_end, dim=1, prepend=torch.zeros_like(at_end[:, :1])))
            count = self.sizes.expand(b, -1)
            return (C.ece_from_sums if self.name == "adaece" else C.debiased_from_sums)(count, *sums)
        return counts @ self.per_sample / self.n


_WEIGHTED = {
    C.expected_calibration_error: "ece",
    C.maximum_calibration_error: "mce",
    C.adaptive_calibration_error: "adaece",
    C.debiased_calibration_error: "debiased",
    C.negative_log_likelihood: "nll",
    C.brier_score: "brier",
    C.classwise_calibration_error: "classwise",
    C.error_rate: "error",
}


def bootstrap_ci(
    metric: Callable,
    probs,
    targets,
    *,
    n_resamples: int = 1000,
    confidence_level: float = 0.95,
    seed: int = 0,
    from_logits: bool = False,
    **metric_kwargs,
) -> BootstrapResult:
    """Percentile bootstrap interval of any metric of :mod:`torchcal.functional`.

    Each replicate draws N indices with replacement from a ``torch.Generator`` seeded with ``seed`` (same
    seed, same replicates, on any device). ECE, MCE, AdaECE, debiased ECE, NLL, Brier, error and classwise ECE are
    evaluated for all replicates at once from per-sample statistics weighted by resample counts, with no
    per-replicate copy of ``probs``; other metrics are evaluated on each resample in turn. In the weighted
    equal-mass path, tied confidences are ordered by original index (the per-resample path orders them by
    resample position); the two differ only when tied samples with different correctness straddle a bin cut.

    Args:
        metric: a metric function, e.g. :func:`torchcal.functional.expected_calibration_error`. It gets the
            probabilities in the caller's dtype (float16 stays float16), or the softmax of logits.
        n_resamples: number of bootstrap replicates.
        confidence_level: coverage of the two-sided percentile interval.
        seed: random seed.
        **metric_kwargs: passed to ``metric`` (e.g. ``n_bins``).

    Returns:
        :class:`BootstrapResult` with the estimate on the full data, the interval and the replicates.

    Example:
        >>> import torch
        >>> from torchcal.functional import bootstrap_ci, expected_calibration_error
        >>> g = torch.Generator().manual_seed(0)
        >>> probs = torch.softmax(3 * torch.randn(500, 4, generator=g), dim=1)
        >>> targets = torch.randint(0, 4, (500,), generator=g)
        >>> res = bootstrap_ci(expected_calibration_error, probs, targets, n_resamples=200, seed=1)
        >>> bool(res.low <= res.estimate <= res.high), res.samples.shape
        (True, torch.Size([200]))
    """
    if not callable(metric):
        raise TypeError(f"`metric` must be a metric function, got {type(metric).__name__}")
    n_resamples = check_positive_int(n_resamples, "n_resamples")
    level = check_float(confidence_level, "confidence_level", low=0, high=1, low_open=True, high_open=True)
    check_positive_int(seed, "seed", minimum=0)
    # one validating pass that also gives the top-label statistics of the weighted path
    probs = as_data(probs, "probs")
    dtype = probs.dtype
    probs, targets, scan = scan_inputs(probs, targets, from_logits)
    conf, correct = scan.conf, scan.correct
    for_metric = in_input_dtype(probs, dtype, from_logits)  # ``metric`` validates it again
    estimate = metric(for_metric, targets, **metric_kwargs)
    n = probs.shape[0]
    gen = torch.Generator().manual_seed(seed)
    name = _WEIGHTED.get(metric)
    fast = None
    if name is not None:
        n_bins = check_positive_int(metric_kwargs.get("n_bins", 15), "n_bins")
        fast = _Weighted(name, probs, targets, conf, correct, n_bins)
    if fast is not None:
        samples = [fast(counts) for counts in _draw_counts(n, n_resamples, gen, probs.device)]
    else:
        samples = []
        step = max(1, _CHUNK // n)
        for start in range(0, n_resamples, step):
            idx = torch.randint(n, (min(step, n_resamples - start), n), generator=gen).to(probs.device)
            for row in idx:
                value = metric(for_metric[row], targets[row], **metric_kwargs)
                value = value[0] if isinstance(value, tuple) else value
                samples.append(torch.as_tensor(value, dtype=torch.float64, device=probs.device).reshape(1))
    samples = torch.cat(samples)
    alpha = (1 - level) / 2
    qs = torch.quantile(samples, torch.tensor([alpha, 1 - alpha], dtype=torch.float64, device=samples.device))
    return BootstrapResult(estimate, qs[0], qs[1], samples)


def _draw_counts(n: int, n_resamples: int, gen: torch.Generator, device):
    """Resample counts in chunks of (b, n) float64, in replicate order (the draws of :func:`bootstrap_ci`)."""
    step = max(1, _CHUNK // n)
    for start in range(0, n_resamples, step):
        b = min(step, n_resamples - start)
        idx = torch.randint(n, (b, n), generator=gen).to(device)
        counts = torch.zeros(b, n, dtype=torch.float64, device=device)
        yield counts.scatter_add_(1, idx, torch.ones_like(counts))


def resample_counts(n: int, n_resamples: int = 1000, seed: int = 0, device=None) -> list[torch.Tensor]:
    """The resamples that :func:`bootstrap_ci` and :func:`bootstrap_replicates` draw for a test set of ``n``
    samples with this seed: how often each sample is drawn, as chunks of (b, n) float32 tensors in replicate
    order (counts are integers, exact in float32). Pass them to :func:`bootstrap_replicates` (``counts=``) to
    score several models of the same test set without drawing again; memory: 4·n·n_resamples bytes.

    Example:
        >>> from torchcal.functional import resample_counts
        >>> chunks = resample_counts(100, n_resamples=5, seed=1)
        >>> [tuple(c.shape) for c in chunks], chunks[0].sum(1).tolist()
        ([(5, 100)], [100.0, 100.0, 100.0, 100.0, 100.0])
    """
    n = check_positive_int(n, "n")
    n_resamples = check_positive_int(n_resamples, "n_resamples")
    check_positive_int(seed, "seed", minimum=0)
    gen = torch.Generator().manual_seed(seed)
    return [c.float() for c in _draw_counts(n, n_resamples, gen, device)]


def bootstrap_replicates(
    metrics: dict[str, Callable],
    probs,
    targets,
    *,
    n_resamples: int = 1000,
    seed: int = 0,
    n_bins: int = 15,
    from_logits: bool = False,
    counts: list[torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Bootstrap replicates of several metrics on one draw of the resamples: ``{name: (n_resamples,)}``, each
    equal to ``bootstrap_ci(metric, probs, targets, n_resamples=..., seed=...).samples``.

    The resample counts are drawn once and shared by every metric, which saves the draw per metric. Two
    predictions of the same test set given the same seed get the same resamples, so their replicates are
    paired (the difference of two models' replicates is the bootstrap of their difference). Only the metrics
    of the vectorised path are accepted (ECE, MCE, AdaECE, debiased ECE, NLL, Brier, error, classwise ECE);
    the others go through :func:`bootstrap_ci`. ``counts`` (from :func:`resample_counts` with the same
    ``n_resamples`` and ``seed``) skips the draw.

    Example:
        >>> import torch
        >>> from torchcal.functional import bootstrap_ci, bootstrap_replicates, brier_score, nll
        >>> g = torch.Generator().manual_seed(0)
        >>> probs = torch.softmax(3 * torch.randn(300, 4, generator=g), dim=1)
        >>> targets = torch.randint(0, 4, (300,), generator=g)
        >>> reps = bootstrap_replicates({"nll": nll, "brier": brier_score}, probs, targets, n_resamples=50, seed=2)
        >>> torch.equal(reps["brier"], bootstrap_ci(brier_score, probs, targets, n_resamples=50, seed=2).samples)
        True
    """
    n_resamples = check_positive_int(n_resamples, "n_resamples")
    check_positive_int(seed, "seed", minimum=0)
    n_bins = check_positive_int(n_bins, "n_bins")
    if not isinstance(metrics, dict) or not metrics:
        raise TypeError("`metrics` must be a non-empty dict of name -> metric function")
    slow = [name for name, metric in metrics.items() if metric not in _WEIGHTED]
    if slow:
        raise ValueError(f"`metrics` {slow} have no vectorised bootstrap; use bootstrap_ci for them")
    probs, targets, scan = scan_inputs(probs, targets, from_logits)
    fast = {
        name: _Weighted(_WEIGHTED[m], probs, targets, scan.conf, scan.correct, n_bins)
        for name, m in metrics.items()
    }
    n = probs.shape[0]
    if counts is None:
        chunks = _draw_counts(n, n_resamples, torch.Generator().manual_seed(seed), probs.device)
    else:
        if sum(c.shape[0] for c in counts) != n_resamples or any(
            c.ndim != 2 or c.shape[1] != n for c in counts
        ):
            raise ValueError(f"`counts` must be resample_counts({n}, n_resamples={n_resamples}, ...) of this "
                             f"test set")  # fmt: skip
        chunks = (c.to(probs.device, torch.float64) for c in counts)
    samples = {name: [] for name in metrics}
    for chunk in chunks:
        for name, weighted in fast.items():
            samples[name].append(weighted(chunk))
    return {name: torch.cat(values) for name, values in samples.items()}
