"""Hugging Face ``transformers`` with torchcal losses and metrics (``pip install torchcal[huggingface]``).

* :func:`loss_func` turns any torchcal loss into ``Trainer(compute_loss_func=...)``: the model's logits
  (classes last, as every Hugging Face head returns them: (N, K) for sequence classification, (N, T, K) for
  token classification) against its ``labels``, padding labels −100 ignored. When the Trainer counts the
  label items of an accumulated batch (``num_items_in_batch``) the loss is the sum over the batch divided by
  that count, as the Trainer expects of a ``compute_loss_func`` under gradient accumulation.
* :class:`CalibrationTrainer` is a ``Trainer`` with such a loss that also updates AdaFocal (and CalFocal)
  after each evaluation from the evaluation set's logits (gathered from every process by the Trainer).
* :func:`compute_metrics` gives ``Trainer(compute_metrics=...)`` the calibration metrics (``eval_ece``, ...).

Example:
    >>> from torchcal.integrations.huggingface import compute_metrics, loss_func
    >>> from torchcal.losses import create
    >>> compute_loss = loss_func(create("flsd-53"))  # Trainer(..., compute_loss_func=compute_loss)
    >>> metrics = compute_metrics(num_classes=20)  # Trainer(..., compute_metrics=metrics)
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import numpy as np
import torch

try:
    from transformers import Trainer
except ImportError as err:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "torchcal.integrations.huggingface needs transformers: pip install 'torchcal[huggingface]'"
    ) from err

from .._validation import check_positive_int
from ..adafocal import AdaFocalLoss, CalFocalLoss
from ..functional._loss_inputs import check_ignore_index
from ..metrics import EQUAL_MASS_METRICS, EQUAL_WIDTH_METRICS, CalibrationMetrics, metric_rows

__all__ = ["loss_func", "compute_metrics", "CalibrationTrainer"]


def _logits_of(outputs) -> torch.Tensor:
    logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
    if logits.ndim > 2:  # Hugging Face heads put the classes last: (N, T, K) -> (N, K, T)
        logits = logits.movedim(-1, 1)
    return logits


@contextlib.contextmanager
def _reduction(loss, reduction: str):
    previous = loss.reduction
    loss.reduction = reduction
    try:
        yield loss
    finally:
        loss.reduction = previous


def loss_func(loss):
    """``compute_loss_func(outputs, labels, num_items_in_batch=None)`` for ``transformers.Trainer`` from a
    torchcal loss module (it must have a ``reduction`` attribute, as every torchcal loss has)."""
    if not isinstance(loss, torch.nn.Module) or not hasattr(loss, "reduction"):
        raise TypeError(
            f"`loss` must be a torchcal loss module (torchcal.losses.create(...)), got {type(loss).__name__}"
        )

    def compute_loss(outputs, labels, num_items_in_batch=None):
        if labels is None:
            raise ValueError(
                "the batch has no `labels`: a torchcal loss needs them (name the dataset's label column "
                "'labels', or set TrainingArguments(label_names=[...]))"
            )
        logits = _logits_of(outputs)
        if num_items_in_batch is None:
            return loss(logits, labels)
        with _reduction(loss, "sum"):
            total = loss(logits, labels)
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch

    return compute_loss


def _rows(predictions, label_ids, ignore_index):
    """Evaluation logits (numpy, classes last, maybe a tuple) and labels as (rows, K) and (rows,) tensors,
    ignored labels dropped."""
    if isinstance(predictions, tuple | list):
        predictions = predictions[0]
    logits, labels = metric_rows(np.asarray(predictions), np.asarray(label_ids), ignore_index, class_dim=-1)
    return logits, labels.long()


def compute_metrics(
    num_classes: int, names=("ece", "adaece", "classwise_ece", "nll", "brier"), ignore_index=-100
):
    """``compute_metrics(eval_prediction) -> {name: float}`` for ``transformers.Trainer``: calibration metrics
    of the evaluation logits (the Trainer prefixes them, e.g. ``eval_ece``)."""
    num_classes = check_positive_int(num_classes, "num_classes", minimum=2)
    names = (names,) if isinstance(names, str) else tuple(names)
    unknown = set(names) - set(EQUAL_WIDTH_METRICS + EQUAL_MASS_METRICS)
    if unknown:
        raise ValueError(f"`names` has unknown metrics {sorted(unknown)}")
    ignore_index = check_ignore_index(ignore_index)

    def compute(eval_prediction) -> dict[str, float]:
        logits, labels = _rows(eval_prediction.predictions, eval_prediction.label_ids, ignore_index)
        acc = CalibrationMetrics(num_classes, from_logits=True)
        acc.update(logits, labels)
        return {name: float(value) for name, value in acc.compute(names).items()}

    return compute


class CalibrationTrainer(Trainer):
    """A ``transformers.Trainer`` training with a torchcal loss (``calibration_loss``); after each evaluation
    (``metric_key_prefix="eval"``, not ``predict``) it updates every AdaFocal / CalFocal module of the loss
    from the evaluation logits, the papers' per-epoch update when evaluating every epoch. Evaluating every n
    steps (``eval_strategy="steps"``) gives AdaFocal-n (the AdaFocal paper's AdaFocal-100 for BERT)."""

    def __init__(self, *args, calibration_loss, ignore_index: int | None = -100, **kwargs):
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("pass either calibration_loss or compute_loss_func, not both")
        kwargs["compute_loss_func"] = loss_func(calibration_loss)
        super().__init__(*args, **kwargs)
        self.calibration_loss = calibration_loss
        self.calibration_ignore_index = check_ignore_index(ignore_index)

    def evaluation_loop(self, *args, **kwargs):
        output = super().evaluation_loop(*args, **kwargs)
        prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
        adaptive = [m for m in self.calibration_loss.modules() if isinstance(m, AdaFocalLoss | CalFocalLoss)]
        if prefix == "eval" and adaptive and output.predictions is not None and output.label_ids is not None:
            logits, labels = _rows(output.predictions, output.label_ids, self.calibration_ignore_index)
            for module in adaptive:
                module.update(logits, labels, from_logits=True)
        return output
