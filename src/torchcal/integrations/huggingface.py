"""Hugging Face ``transformers`` with torchcal losses and metrics (``pip install torchcal[huggingface]``).

* :func:`loss_func` turns any torchcal loss into ``Trainer(compute_loss_func=...)``: the model's logits
  (classes last, as every Hugging Face head returns them: (N, K) for sequence classification, (N, T, K) for
  token classification) against its ``labels``, padding labels −100 ignored. When the Trainer counts the
  label items of an accumulated batch (``num_items_in_batch``) the loss is the sum over the batch divided by
  that count, as the Trainer expects of a ``compute_loss_func`` under gradient accumulation.
* :class:`CalibrationTrainer` is a ``Trainer`` with such a loss that also updates AdaFocal (and CalFocal)
  after each scheduled evaluation of ``train()`` from the evaluation set's logits (gathered from every
  process by the Trainer). ``evaluate()`` called by the user (test metrics, the extra evaluation after
  training) leaves the loss as it is unless ``evaluate(..., update_calibration_loss=True)``.
* :func:`compute_metrics` gives ``Trainer(compute_metrics=...)`` the calibration metrics (``eval_ece``, ...)
  of softmax models, or with ``task="multilabel"`` of sigmoid models
  (``problem_type="multi_label_classification"``; unknown labels −100 left out label by label).

``eval_loss`` is the Trainer's loss on the evaluation set, i.e. the training loss (focal, AdaFocal with its
current γ, ...), not cross entropy: compare models, or pick the best checkpoint, on ``eval_nll``
(``TrainingArguments(metric_for_best_model="nll", greater_is_better=False)``).

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

from .._validation import check_bool, check_choice, check_positive_int
from ..adafocal import AdaFocalLoss, CalFocalLoss
from ..functional._loss_inputs import check_ignore_index
from ..losses import _BinaryLoss
from ..metrics import EQUAL_MASS_METRICS, EQUAL_WIDTH_METRICS, CalibrationMetrics, metric_rows
from . import _multilabel as ML

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


def loss_func(loss, *, ignore_index: int | None = -100):
    """``compute_loss_func(outputs, labels, num_items_in_batch=None)`` for ``transformers.Trainer`` from a
    torchcal loss module (it must have a ``reduction`` attribute, as every torchcal loss has).

    A sigmoid loss (``torchcal.losses.create("bce")``, ``"binary-fl-2"``, ...) takes the (N, L) logits of a
    ``problem_type="multi_label_classification"`` model and its (N, L) 0/1 labels; labels equal to
    ``ignore_index`` (an unknown label of a sample) are left out element by element: the loss is the mean
    over the known (sample, label) pairs. Under gradient accumulation the Trainer divides by its count of
    labels other than −100, which is that mean over the whole step for ``ignore_index=-100``. Multiclass
    losses ignore −100 labels themselves."""
    if not isinstance(loss, torch.nn.Module) or not hasattr(loss, "reduction"):
        raise TypeError(
            f"`loss` must be a torchcal loss module (torchcal.losses.create(...)), got {type(loss).__name__}"
        )
    ignore_index = check_ignore_index(ignore_index)
    sigmoid = isinstance(loss, _BinaryLoss)

    def compute_loss(outputs, labels, num_items_in_batch=None):
        if labels is None:
            raise ValueError(
                "the batch has no `labels`: a torchcal loss needs them (name the dataset's label column "
                "'labels', or set TrainingArguments(label_names=[...]))"
            )
        logits = _logits_of(outputs)
        if sigmoid and ignore_index is not None:
            known = labels != ignore_index
            with _reduction(loss, "none"):
                each = loss(logits, torch.where(known, labels, torch.zeros_like(labels)))
            total = torch.where(known, each, torch.zeros_like(each)).sum()
            if num_items_in_batch is None:
                return total / known.sum().clamp_min(1)
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(total.device)
            return total / num_items_in_batch
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


DEFAULT_NAMES = ("ece", "adaece", "classwise_ece", "nll", "brier")
DEFAULT_MULTILABEL_NAMES = ("ece", "adaece", "mce", "nll", "brier", "auroc")


def compute_metrics(num_classes: int, names=None, ignore_index=-100, *, task: str = "multiclass"):
    """``compute_metrics(eval_prediction) -> {name: float}`` for ``transformers.Trainer``: calibration metrics
    of the evaluation logits (the Trainer prefixes them, e.g. ``eval_ece``).

    Args:
        num_classes: K, or with ``task="multilabel"`` the number of labels L.
        names: metric names (None: the task's defaults). Multiclass: those of
            :meth:`torchcal.metrics.CalibrationMetrics.compute`. Multi-label: "ece", "mce", "adaece", "brier",
            "nll", "error", "auroc" (macro means over labels) and ``<name>_micro`` (every (sample, label)
            pair pooled; not for AUROC).
        ignore_index: labels left out (−100: Hugging Face's padding; for multi-label, an unknown label of a
            sample). None: every label must be a class (or 0/1).
        task: "multiclass" (softmax: (N, K) or token (N, T, K) logits, integer labels) or "multilabel"
            (sigmoid: (N, L) logits of a ``problem_type="multi_label_classification"`` model, 0/1 labels).
    """
    task = check_choice(task, "task", ("multiclass", "multilabel"))
    multilabel = task == "multilabel"
    num_classes = check_positive_int(num_classes, "num_classes", minimum=1 if multilabel else 2)
    if names is None:
        names = DEFAULT_MULTILABEL_NAMES if multilabel else DEFAULT_NAMES
    names = (names,) if isinstance(names, str) else tuple(names)
    if multilabel:
        known = set(ML.MULTILABEL_METRICS) | {
            f"{m}_micro" for m, (_, averages) in ML.MULTILABEL_METRICS.items() if "micro" in averages
        }
    else:
        known = set(EQUAL_WIDTH_METRICS + EQUAL_MASS_METRICS)
    unknown = set(names) - known
    if unknown:
        raise ValueError(f"`names` has unknown metrics {sorted(unknown)}; choose from {sorted(known)}")
    ignore_index = check_ignore_index(ignore_index)

    def compute(eval_prediction) -> dict[str, float]:
        if multilabel:
            predictions = eval_prediction.predictions
            predictions = predictions[0] if isinstance(predictions, tuple | list) else predictions
            logits, labels = ML.label_rows(
                torch.as_tensor(np.asarray(predictions)), torch.as_tensor(np.asarray(eval_prediction.label_ids)),
                num_classes, names=("predictions", "label_ids"),
            )  # fmt: skip
            wanted = tuple(dict.fromkeys(n.removesuffix("_micro") for n in names))
            keep_rows = any(ML.MULTILABEL_METRICS[n][0] for n in wanted)
            sums, rows = ML.batch_state(logits, labels, num_classes, 15, True, ignore_index, keep_rows)
            if sums is None:
                raise ValueError("every evaluation label equals ignore_index: no metric can be computed")
            out = ML.compute(sums, rows, num_classes, 15, wanted)
            return {name: float(out[name]) for name in names}
        logits, labels = _rows(eval_prediction.predictions, eval_prediction.label_ids, ignore_index)
        acc = CalibrationMetrics(num_classes, from_logits=True)
        acc.update(logits, labels)
        return {name: float(value) for name, value in acc.compute(names).items()}

    return compute


class CalibrationTrainer(Trainer):
    """A ``transformers.Trainer`` training with a torchcal loss (``calibration_loss``); after each scheduled
    evaluation of ``train()`` (``eval_strategy``, on the ``eval_dataset``) it updates every AdaFocal /
    CalFocal module of the loss from the evaluation logits, the papers' per-epoch update when evaluating
    every epoch. Evaluating every n steps (``eval_strategy="steps"``) gives AdaFocal-n (the AdaFocal paper's
    AdaFocal-100 for BERT).

    ``evaluate()`` called outside ``train()`` (``evaluate(eval_dataset=test)`` for test metrics, the usual
    extra evaluation after training) and ``predict()`` measure without adapting the loss: the loss must not
    learn from test labels. ``evaluate(..., update_calibration_loss=True)`` updates it anyway;
    ``update_calibration_loss=False`` skips the update of an evaluation inside ``train()``."""

    def __init__(self, *args, calibration_loss, ignore_index: int | None = -100, **kwargs):
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("pass either calibration_loss or compute_loss_func, not both")
        kwargs["compute_loss_func"] = loss_func(calibration_loss)
        super().__init__(*args, **kwargs)
        self.calibration_loss = calibration_loss
        self.calibration_ignore_index = check_ignore_index(ignore_index)
        self._calibration_training = False
        self._calibration_update: bool | None = None

    def train(self, *args, **kwargs):
        self._calibration_training = True
        try:
            return super().train(*args, **kwargs)
        finally:
            self._calibration_training = False

    def evaluate(self, *args, update_calibration_loss: bool | None = None, **kwargs):
        """``Trainer.evaluate``; ``update_calibration_loss`` (None: only inside ``train()``) says whether
        this evaluation updates the AdaFocal / CalFocal modules of the loss."""
        if update_calibration_loss is not None:
            update_calibration_loss = check_bool(update_calibration_loss, "update_calibration_loss")
        previous, self._calibration_update = self._calibration_update, update_calibration_loss
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self._calibration_update = previous

    def evaluation_loop(self, *args, **kwargs):
        output = super().evaluation_loop(*args, **kwargs)
        prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
        if self._calibration_update is None:
            update = self._calibration_training and prefix == "eval"
        else:
            update = self._calibration_update
        adaptive = [m for m in self.calibration_loss.modules() if isinstance(m, AdaFocalLoss | CalFocalLoss)]
        if update and adaptive and output.predictions is not None and output.label_ids is not None:
            logits, labels = _rows(output.predictions, output.label_ids, self.calibration_ignore_index)
            for module in adaptive:
                module.update(logits, labels, from_logits=True)
        return output
