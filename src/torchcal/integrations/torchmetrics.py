"""The calibration metrics as ``torchmetrics.Metric`` classes (``pip install torchcal[torchmetrics]``).

Each metric keeps the constant-size float64 sums of :class:`torchcal.metrics.CalibrationMetrics`
(3·M top-label bin sums, 2·K·M classwise bin sums and 7 scalars; for the Brier and log-score decomposition
terms also the 2·M·K per-bin vector sums), summed across processes on sync, so DDP moves O(K·M) numbers, not
every sample. Only the row metrics (``adaece``, ``debiased_ece``, ``ece_sweep``, ``smece``, ``adaece_over``,
``adaece_under``, ``ks``, ``kuiper``, ``aurc``, ``augrc``) also keep every sample's top-label confidence and
correctness (and the ranking score of AURC/AUGRC when it is not the confidence), concatenated across
processes. Metrics with the same state (ECE, MCE, classwise ECE, Brier, NLL, error, the signed ECE and its
split) share one update inside a ``MetricCollection`` (torchmetrics' compute groups). ``compute`` calls the
same functions as :meth:`torchcal.metrics.CalibrationMetrics.compute`.

Inputs are probabilities (or logits with ``from_logits=True``) of shape (N, K) or (N, K, d1, ...) with
integer targets (N,) or (N, d1, ...); targets equal to ``ignore_index`` are left out.

Example:
    >>> import torch
    >>> from torchmetrics import MetricCollection
    >>> from torchcal.integrations.torchmetrics import AdaptiveCalibrationError, ExpectedCalibrationError
    >>> from torchcal.functional import expected_calibration_error
    >>> metrics = MetricCollection({"ece": ExpectedCalibrationError(num_classes=4, from_logits=True),
    ...                             "adaece": AdaptiveCalibrationError(num_classes=4, from_logits=True)})
    >>> g = torch.Generator().manual_seed(0)
    >>> logits, targets = torch.randn(200, 4, generator=g), torch.randint(0, 4, (200,), generator=g)
    >>> for i in range(0, 200, 50):
    ...     metrics.update(logits[i:i + 50], targets[i:i + 50])
    >>> out = metrics.compute()
    >>> bool(torch.isclose(out["ece"], expected_calibration_error(logits, targets, from_logits=True).double()))
    True
"""

from __future__ import annotations

import torch

try:
    from torchmetrics import Metric
    from torchmetrics.utilities import dim_zero_cat
except ImportError as err:  # pragma: no cover - exercised only without torchmetrics
    raise ImportError(
        "torchcal.integrations.torchmetrics needs torchmetrics: pip install 'torchcal[torchmetrics]'"
    ) from err

from .._validation import check_bool, check_choice, check_float, check_positive_int
from ..functional._loss_inputs import check_ignore_index
from ..functional.selective import CONFIDENCE_SCORES
from ..metrics import (
    DECOMPOSITION_METRICS,
    METRICS,
    ROW_METRICS,
    batch_state,
    check_score,
    metric_rows,
    results,
    state_size,
)
from . import _multilabel as ML
from ._multilabel import resolve_class_dim

__all__ = [
    "CalibrationMetric",
    "ExpectedCalibrationError",
    "MaxCalibrationError",
    "ClasswiseCalibrationError",
    "AdaptiveCalibrationError",
    "DebiasedCalibrationError",
    "SmoothCalibrationError",
    "BrierScore",
    "NegativeLogLikelihood",
    "MultilabelCalibrationMetric",
    "METRICS",
]


class CalibrationMetric(Metric):
    """One torchcal calibration metric (``metric``: one of :data:`METRICS`) as a ``torchmetrics.Metric``.

    Args:
        num_classes: K.
        metric: a name of :data:`torchcal.metrics.METRICS`: "ece", "mce", "classwise_ece", "nll", "brier",
            "rbs", "error", "s99_fraction", "s99_accuracy", "signed_ece", "ece_over", "ece_under", the
            decomposition terms ("brier_reliability", "brier_resolution", "brier_uncertainty",
            "brier_within_variance", "brier_within_covariance", "log_reliability", "log_resolution",
            "log_uncertainty", "log_within") or the row metrics ("adaece", "debiased_ece", "ece_sweep",
            "smece", "adaece_over", "adaece_under", "ks", "kuiper", "aurc", "augrc").
        n_bins: bins of the binned estimators (15, the papers').
        from_logits: ``update`` receives logits and applies softmax.
        score: the ranking score of "aurc" and "augrc" (:func:`torchcal.functional.confidence_score`;
            "max_logit" and "energy" need ``from_logits``).
        ignore_index: targets with this value are left out (None: every target must be a class).
        s99_threshold: the confidence threshold of the S99 metrics.
        class_dim: the class dimension of inputs with extra dimensions: 1 for PyTorch's (N, K, d1, ...), −1
            for Hugging Face's token layout (N, T, K). None: dimension 1, and a shape whose dimension 1 and
            last dimension both have K entries is refused as ambiguous.
        **kwargs: ``torchmetrics.Metric`` options (``sync_on_compute``, ``dist_sync_on_step``, ...).

    Inside a ``MetricCollection`` metrics share one update only when every setting that changes ``update``
    (``from_logits``, ``ignore_index``, ``s99_threshold``, ``class_dim``, ``score``, K, M) is equal and their
    states have the same parts: the settings are
    part of the state torchmetrics compares, so a first batch that happens to give equal sums does not merge
    metrics whose settings differ.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    # the states (add_state)
    sums: torch.Tensor
    samples: list[torch.Tensor]

    def __init__(
        self,
        num_classes: int,
        metric: str = "ece",
        n_bins: int = 15,
        *,
        from_logits: bool = False,
        ignore_index: int | None = None,
        s99_threshold: float = 0.99,
        class_dim: int | None = None,
        score: str = "max_prob",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_classes = check_positive_int(num_classes, "num_classes", minimum=2)
        self.metric = check_choice(metric, "metric", METRICS)
        self.n_bins = check_positive_int(n_bins, "n_bins")
        self.from_logits = check_bool(from_logits, "from_logits")
        self.ignore_index = check_ignore_index(ignore_index)
        self.s99_threshold = check_float(s99_threshold, "s99_threshold", low=0, high=1)
        self.class_dim = _check_class_dim(class_dim)
        self.score = check_score(score, self.from_logits, "metric")
        self.decompositions = self.metric in DECOMPOSITION_METRICS  # the per-bin vector sums
        self.add_state(
            "sums",
            default=torch.zeros(
                state_size(self.num_classes, self.n_bins, self.decompositions), dtype=torch.float64
            ),
            dist_reduce_fx="sum",
        )
        score_code = float(CONFIDENCE_SCORES.index(self.score))
        _add_settings_state(
            self, self.from_logits, self.ignore_index, self.s99_threshold, self.class_dim, score_code
        )
        self.equal_mass = self.metric in ROW_METRICS
        self.ranked = self.metric in ("aurc", "augrc") and self.score != "max_prob"
        if self.equal_mass:  # every sample's (confidence, correct[, score]): all-gathered as one tensor
            self.add_state("samples", default=[], dist_reduce_fx="cat")
            self.samples.append(self._no_rows())

    def _no_rows(self) -> torch.Tensor:
        """No rows, in the rows' dtype and width: the list of rows always holds a block, so a process that
        never calls ``update`` sends the all-gather a tensor like the others' (torchmetrics' placeholder for
        an empty list, a 1-D tensor of the default dtype, aborts gloo's all-gather)."""
        return torch.zeros(0, 3 if self.ranked else 2, dtype=torch.float64, device=self.sums.device)

    def reset(self) -> None:
        """Resets the sums and the rows (to one empty block of rows, see ``_no_rows``)."""
        super().reset()
        if self.equal_mass:
            self.samples.append(self._no_rows())

    def update(self, preds, target) -> None:
        """Adds a batch of probabilities (or logits) (N, K[, d1, ...]) and targets (N[, d1, ...])."""
        shape = tuple(getattr(preds, "shape", ()))
        dim = resolve_class_dim(shape, self.num_classes, self.class_dim, "preds") if len(shape) > 2 else 1
        preds, target = metric_rows(
            preds, target, self.ignore_index, class_dim=dim, names=("preds", "target")
        )
        if preds.device != self.sums.device:
            raise ValueError(
                f"`preds` is on {preds.device} but the metric's state is on {self.sums.device}: "
                f"move the metric with .to({str(preds.device)!r})"
            )
        if preds.shape[0] == 0:  # every target ignored
            return
        sums, conf, correct, rank = batch_state(
            preds,
            target,
            self.num_classes,
            self.n_bins,
            self.from_logits,
            self.s99_threshold,
            decompositions=self.decompositions,
            score=self.score if self.ranked else "max_prob",
        )
        self.sums += sums
        if self.equal_mass:
            columns = [conf.double(), correct.double()] + ([rank] if rank is not None else [])
            self.samples.append(torch.stack(columns, dim=1))

    def compute(self) -> torch.Tensor:
        """The metric over every batch since the last ``reset`` (all processes after a sync), a 0-d float64
        tensor."""
        rows = None
        if self.equal_mass:
            samples = dim_zero_cat(self.samples) if len(self.samples) else self._no_rows()
            rows = (samples[:, 0], samples[:, 1] > 0.5, samples[:, 2] if self.ranked else None)
        out = results(self.sums, rows, self.num_classes, self.n_bins, (self.metric,), self.decompositions)
        return out[self.metric]


def _check_class_dim(class_dim):
    if class_dim is not None and (isinstance(class_dim, bool) or not isinstance(class_dim, int)):
        raise TypeError(f"`class_dim` must be an integer or None, got {class_dim!r}")
    return class_dim


def _add_settings_state(metric: Metric, *settings) -> None:
    """The settings that change ``update``, as a constant state tensor: torchmetrics' compute groups compare
    states, so metrics with other settings never share an update. A setting that is None is encoded as
    (0, 0) and any other value as (1, value); sync keeps the (equal) values with ``max``."""
    values = []
    for setting in settings:
        values += [0.0, 0.0] if setting is None else [1.0, float(setting)]
    metric.add_state("settings", default=torch.tensor(values, dtype=torch.float64), dist_reduce_fx="max")


class ExpectedCalibrationError(CalibrationMetric):
    """Top-label ECE with equal-width bins (SPEC §3)."""

    def __init__(self, num_classes: int, n_bins: int = 15, **kwargs):
        super().__init__(num_classes, "ece", n_bins, **kwargs)


class MaxCalibrationError(CalibrationMetric):
    """Top-label MCE: the largest bin gap, equal-width bins."""

    def __init__(self, num_classes: int, n_bins: int = 15, **kwargs):
        super().__init__(num_classes, "mce", n_bins, **kwargs)


class ClasswiseCalibrationError(CalibrationMetric):
    """Classwise ECE (SCE, Nixon et al. 2019), equal-width bins per class."""

    def __init__(self, num_classes: int, n_bins: int = 15, **kwargs):
        super().__init__(num_classes, "classwise_ece", n_bins, **kwargs)


class AdaptiveCalibrationError(CalibrationMetric):
    """AdaECE: top-label ECE with equal-mass bins (keeps every sample's confidence)."""

    def __init__(self, num_classes: int, n_bins: int = 15, **kwargs):
        super().__init__(num_classes, "adaece", n_bins, **kwargs)


class DebiasedCalibrationError(CalibrationMetric):
    """Debiased ECE (Kumar et al. 2019; keeps every sample's confidence)."""

    def __init__(self, num_classes: int, n_bins: int = 15, **kwargs):
        super().__init__(num_classes, "debiased_ece", n_bins, **kwargs)


class SmoothCalibrationError(CalibrationMetric):
    """smECE (Błasiok & Nakkiran 2023; keeps every sample's confidence)."""

    def __init__(self, num_classes: int, n_bins: int = 15, **kwargs):
        super().__init__(num_classes, "smece", n_bins, **kwargs)


class BrierScore(CalibrationMetric):
    """Multiclass Brier score: mean Σ_k (p_k − y_k)²."""

    def __init__(self, num_classes: int, n_bins: int = 15, **kwargs):
        super().__init__(num_classes, "brier", n_bins, **kwargs)


class NegativeLogLikelihood(CalibrationMetric):
    """Mean negative log-likelihood −log p_t."""

    def __init__(self, num_classes: int, n_bins: int = 15, **kwargs):
        super().__init__(num_classes, "nll", n_bins, **kwargs)


class MultilabelCalibrationMetric(Metric):
    """A calibration metric of sigmoid (multi-label) outputs as a ``torchmetrics.Metric``: the per-label
    reliability of p of :mod:`torchcal.functional.binary` (SPEC §6), streamed with constant-size state.

    Args:
        num_labels: L.
        metric: "ece", "mce", "signed_ece", "ece_over", "ece_under" (the direction of each label's ECE),
            "adaece", "brier", "nll", "error" (wrong 0/1 decisions at p >= 0.5), "ks", "kuiper" (per label,
            ``kind="binary"``) or "auroc".
        average: "macro" (mean over labels), "micro" (every (sample, label) pair pooled; not for AUROC, KS
            and Kuiper) or "none" (the (L,) values).
        n_bins: bins of the binned estimators.
        from_logits: ``update`` receives logits and applies the sigmoid.
        ignore_index: targets with this value (e.g. −1 or −100 for an unknown label) are left out, element
            by element: that label of that sample only. A label with no known target is NaN in
            ``average="none"`` and left out of the macro mean; so is a label whose known targets hold one
            class, for AUROC.
        class_dim: the label dimension of inputs with extra dimensions, e.g. −1 for (N, T, L) with targets
            (N, T, L); None: dimension 1, and a shape whose dimension 1 and last dimension both have L
            entries is refused as ambiguous.
        **kwargs: ``torchmetrics.Metric`` options.

    State: 3·L·M + 4·L float64 sums, summed across processes; AdaECE, KS, Kuiper and AUROC also keep every
    sample's (p, y) (16·L bytes a sample), concatenated across processes. Without ``ignore_index`` the values equal
    :class:`torchcal.metrics.MultilabelCalibrationMetrics`'.

    Example:
        >>> import torch
        >>> from torchcal.functional import multilabel_ece
        >>> g = torch.Generator().manual_seed(0)
        >>> logits, targets = torch.randn(200, 3, generator=g), torch.randint(0, 2, (200, 3), generator=g)
        >>> metric = MultilabelCalibrationMetric(num_labels=3, metric="ece", from_logits=True)
        >>> for i in range(0, 200, 64):
        ...     metric.update(logits[i:i + 64], targets[i:i + 64])
        >>> bool(torch.isclose(metric.compute(), multilabel_ece(logits, targets, from_logits=True)))
        True
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    # the states (add_state)
    sums: torch.Tensor
    samples: list[torch.Tensor]

    def __init__(
        self,
        num_labels: int,
        metric: str = "ece",
        average: str = "macro",
        n_bins: int = 15,
        *,
        from_logits: bool = False,
        ignore_index: int | None = None,
        class_dim: int | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_labels = check_positive_int(num_labels, "num_labels")
        self.metric = check_choice(metric, "metric", tuple(ML.MULTILABEL_METRICS))
        needs_rows, averages = ML.MULTILABEL_METRICS[self.metric]
        self.average = check_choice(average, "average", averages)
        self.n_bins = check_positive_int(n_bins, "n_bins")
        self.from_logits = check_bool(from_logits, "from_logits")
        self.ignore_index = check_ignore_index(ignore_index)
        self.class_dim = _check_class_dim(class_dim)
        self.add_state(
            "sums",
            default=torch.zeros(ML.state_size(self.num_labels, self.n_bins), dtype=torch.float64),
            dist_reduce_fx="sum",
        )
        _add_settings_state(self, self.from_logits, self.ignore_index, self.class_dim)
        self.keeps_rows = needs_rows
        if needs_rows:  # every sample's (p, y), y = -1 where unknown: all-gathered as one tensor
            self.add_state("samples", default=[], dist_reduce_fx="cat")
            self.samples.append(self._no_rows())

    def _no_rows(self) -> torch.Tensor:
        """No rows, in the rows' dtype and shape (see :meth:`CalibrationMetric._no_rows`)."""
        return torch.zeros(0, 2, self.num_labels, dtype=torch.float64, device=self.sums.device)

    def reset(self) -> None:
        """Resets the sums and the rows (to one empty block of rows)."""
        super().reset()
        if self.keeps_rows:
            self.samples.append(self._no_rows())

    def update(self, preds, target) -> None:
        """Adds a batch: probabilities (or logits) (N, L) or (N, ..., L) and targets of the same shape."""
        preds, target = ML.label_rows(preds, target, self.num_labels, self.ignore_index, self.class_dim)
        if preds.device != self.sums.device:
            raise ValueError(
                f"`preds` is on {preds.device} but the metric's state is on {self.sums.device}: "
                f"move the metric with .to({str(preds.device)!r})"
            )
        sums, rows = None, None
        if preds.shape[0] > 0:
            sums, rows = ML.batch_state(
                preds, target, self.num_labels, self.n_bins, self.from_logits, self.ignore_index, self.keeps_rows
            )  # fmt: skip
        if sums is None:  # no rows, or every target unknown
            return
        self.sums += sums
        if rows is not None:  # (made with keeps_rows)
            self.samples.append(rows)

    def compute(self) -> torch.Tensor:
        """The metric over every batch since the last ``reset``: a 0-d float64 tensor, or (L,) for
        ``average="none"``."""
        rows = None
        if self.keeps_rows:
            rows = dim_zero_cat(self.samples) if len(self.samples) else self._no_rows()
        out = ML.compute(self.sums, rows, self.num_labels, self.n_bins, (self.metric,))
        return ML.value(out, self.metric, self.average)
