"""The metrics beyond ECE (SPEC §9) as ``torchmetrics.Metric`` classes (``pip install torchcal[torchmetrics]``).

:class:`FieldCalibrationMetric` keeps the state of :class:`torchcal.field_metrics.FieldMetrics`: the
O(M·K) float64 bin sums, summed across processes on sync. Only the metrics that need every sample (the
equal-mass split, KS, Kuiper, AURC, AUGRC) also keep each sample's (confidence, correctness, ranking score),
concatenated across processes. ``compute`` calls the same function as ``FieldMetrics.compute``.

Example:
    >>> import torch
    >>> from torchcal.integrations.torchmetrics_field import FieldCalibrationMetric
    >>> from torchcal.functional import aurc
    >>> m = FieldCalibrationMetric(num_classes=4, metric="aurc", from_logits=True)
    >>> g = torch.Generator().manual_seed(0)
    >>> logits, targets = torch.randn(200, 4, generator=g), torch.randint(0, 4, (200,), generator=g)
    >>> for i in range(0, 200, 50):
    ...     m.update(logits[i:i + 50], targets[i:i + 50])
    >>> bool(torch.isclose(m.compute(), aurc(logits, targets, from_logits=True)))
    True
"""

from __future__ import annotations

import torch

try:
    from torchmetrics import Metric
    from torchmetrics.utilities import dim_zero_cat
except ImportError as err:  # pragma: no cover - exercised only without torchmetrics
    raise ImportError(
        "torchcal.integrations.torchmetrics_field needs torchmetrics: pip install 'torchcal[torchmetrics]'"
    ) from err

from .._validation import check_bool, check_choice, check_positive_int
from ..field_metrics import (
    BINNED_FIELD_METRICS,
    ROW_FIELD_METRICS,
    _state_size,
    field_batch_state,
    field_results,
)
from ..functional.selective import CONFIDENCE_SCORES

__all__ = ["FieldCalibrationMetric", "FIELD_METRICS"]

FIELD_METRICS = BINNED_FIELD_METRICS + ROW_FIELD_METRICS


class FieldCalibrationMetric(Metric):
    """One metric of :class:`torchcal.field_metrics.FieldMetrics` as a ``torchmetrics.Metric``.

    Args:
        num_classes: K.
        metric: one of :data:`FIELD_METRICS` (``"signed_ece"``, ``"ece_over"``, ``"brier_reliability"``,
            ``"ks"``, ``"aurc"``, ...).
        n_bins: bins M (equal-width top-label bins of SPEC §3).
        score: the ranking score of AURC/AUGRC (:func:`torchcal.functional.confidence_score`).
        from_logits: ``update`` receives logits.
        **kwargs: ``torchmetrics.Metric`` options.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    # the states (add_state)
    sums: torch.Tensor
    rows: list[torch.Tensor]

    def __init__(
        self,
        num_classes: int,
        metric: str = "signed_ece",
        n_bins: int = 15,
        *,
        score: str = "max_prob",
        from_logits: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_classes = check_positive_int(num_classes, "num_classes", minimum=2)
        self.metric = check_choice(metric, "metric", FIELD_METRICS)
        self.n_bins = check_positive_int(n_bins, "n_bins")
        self.score = check_choice(score, "score", set(CONFIDENCE_SCORES))
        self.from_logits = check_bool(from_logits, "from_logits")
        if score in ("max_logit", "energy") and not from_logits:
            raise ValueError(f"score={score!r} needs logits: build the metric with from_logits=True")
        size = _state_size(self.num_classes, self.n_bins)
        self.add_state("sums", default=torch.zeros(size, dtype=torch.float64), dist_reduce_fx="sum")
        self.keep_rows = self.metric in ROW_FIELD_METRICS
        if self.keep_rows:
            self.add_state("rows", default=[], dist_reduce_fx="cat")

    def update(self, preds, target) -> None:
        """Adds a batch of probabilities (or logits) (N, K) and integer targets (N,)."""
        sums, rows = field_batch_state(
            preds, target, self.num_classes, self.n_bins, self.score, self.from_logits, self.keep_rows
        )
        if sums.device != self.sums.device:
            raise ValueError(
                f"`preds` is on {sums.device} but the metric's state is on {self.sums.device}: "
                f"move the metric with .to({str(sums.device)!r})"
            )
        self.sums += sums
        if rows is not None:
            self.rows.append(rows)

    def compute(self) -> torch.Tensor:
        """The metric over every batch since the last ``reset`` (all processes after a sync), 0-d float64."""
        rows = None
        if self.keep_rows:
            rows = dim_zero_cat(self.rows) if len(self.rows) else torch.zeros(0, 3, dtype=torch.float64)
        return field_results(self.sums, rows, self.num_classes, self.n_bins)[self.metric]
