"""Hugging Face ``transformers`` with torchcal losses and metrics (``pip install torchcal[huggingface]``).

* :func:`loss_func` turns any torchcal loss into ``Trainer(compute_loss_func=...)``: the model's logits
  (classes last, as every Hugging Face head returns them: (N, K) for sequence classification, (N, T, K) for
  token classification) against its ``labels``, padding labels −100 ignored. When the Trainer counts the
  label items of an accumulated batch (``num_items_in_batch``) the loss is the sum over the batch divided by
  that count, as the Trainer expects of a ``compute_loss_func`` under gradient accumulation (a class-weighted
  loss: its weighted mean times the batch's share of the count).
* :class:`CalibrationTrainer` is a ``Trainer`` with such a loss that also updates AdaFocal (and CalFocal,
  CALS's multipliers, AvUC's threshold) after each scheduled evaluation of ``train()`` from the evaluation set's logits (gathered from every
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
import math
import os
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as err:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "torchcal.integrations.huggingface needs transformers: pip install 'torchcal[huggingface]'"
    ) from err

from .._validation import check_bool, check_choice, check_positive_int
from ..functional._loss_inputs import check_ignore_index
from ..losses import ADAPTIVE_LOSSES, _BinaryLoss
from ..metrics import DECOMPOSITION_METRICS, METRICS, ROW_METRICS, CalibrationMetrics, metric_rows
from . import _multilabel as ML

__all__ = ["loss_func", "compute_metrics", "CalibrationTrainer", "fused_loss", "FusedCalibrationTrainer"]

# the calibration loss's state_dict in each checkpoint folder of a CalibrationTrainer
CALIBRATION_LOSS_NAME = "calibration_loss.pt"


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
    losses ignore −100 labels themselves. A loss with class ``weight`` (whose mean is Σ w_y ℓ / Σ w_y) gives
    under that count its weighted mean times the batch's share of the step's labels, so a step of one batch
    gives the loss itself (the Trainer passes the count without accumulation too)."""
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
        return _step_share(loss, lambda: loss(logits, labels), labels, num_items_in_batch)

    return compute_loss


def _class_weighted(loss) -> bool:
    """Whether a module of ``loss`` holds class weights (its "mean" then divides by Σ w_y, not the count)."""
    return any(getattr(module, "weight", None) is not None for module in loss.modules())


def _step_share(loss, call, labels, num_items_in_batch) -> torch.Tensor:
    """This batch's share of an accumulated step whose labels other than −100 the Trainer counted
    (``num_items_in_batch``): the batch's sum over that count. A class-weighted loss gives its own weighted
    mean times the batch's share of the items (the runner's rule, as the Trainer counts labels, not
    weights): without accumulation the loss itself, not Σ w_y ℓ / N."""
    if not _class_weighted(loss):
        with _reduction(loss, "sum"):
            total = call()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    with _reduction(loss, "mean"):
        mean = call()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(mean.device)
    ignore_index = loss.ignore_index
    items = (labels != ignore_index).sum() if ignore_index is not None else labels.new_tensor(labels.numel())
    items = items.to(mean.device)
    # a batch whose labels are all ignored adds 0 (its mean is 0 / 0)
    return torch.where(items > 0, mean, torch.zeros_like(mean)) * items / num_items_in_batch


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
        known = set(METRICS)
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
        acc = CalibrationMetrics(  # the state the names need, no more
            num_classes,
            from_logits=True,
            equal_mass=bool(set(names) & set(ROW_METRICS)),
            decompositions=bool(set(names) & set(DECOMPOSITION_METRICS)),
        )
        acc.update(logits, labels)
        return {name: float(value) for name, value in acc.compute(names).items()}

    return compute


class CalibrationTrainer(Trainer):
    """A ``transformers.Trainer`` training with a torchcal loss (``calibration_loss``); after each scheduled
    evaluation of ``train()`` (``eval_strategy``, on the ``eval_dataset``) it updates every AdaFocal /
    CalFocal / CALS / AvUC module of the loss from the evaluation logits, the papers' per-epoch update when evaluating
    every epoch. Evaluating every n steps (``eval_strategy="steps"``) gives AdaFocal-n (the AdaFocal paper's
    AdaFocal-100 for BERT).

    ``evaluate()`` called outside ``train()`` (``evaluate(eval_dataset=test)`` for test metrics, the usual
    extra evaluation after training) and ``predict()`` measure without adapting the loss: the loss must not
    learn from test labels. ``evaluate(..., update_calibration_loss=True)`` updates it anyway;
    ``update_calibration_loss=False`` skips the update of an evaluation inside ``train()``.

    The update needs the evaluation logits: an evaluation that updates the loss keeps them even without
    ``compute_metrics`` (which otherwise makes the Trainer drop them). The evaluation that
    ``eval_on_start`` runs before the first step is a sanity check, as Lightning's, and does not update the
    loss: the first epoch trains with the loss's initial state, as in the papers.

    Scheduled losses get the epoch (0-based) at the start of each training epoch (``set_epoch``: FLS-531 /
    FLS-532's γ, MbLS's α schedule, MaxSup's ramp) and the run's number of epochs when training starts
    (``set_total_epochs``: MaxSup), as the runner gives them.

    The loss is not part of the model, so each checkpoint also holds its ``state_dict()`` (AdaFocal's γ per
    bin, bin edges and histories, CALS's multipliers, AvUC's threshold, ...) in ``calibration_loss.pt``,
    written atomically by the saving process; ``train(resume_from_checkpoint=...)`` loads it back before
    training resumes, so a resumed run continues from the loss of the checkpoint. Resuming from a checkpoint
    without that file, with a loss that has state, raises ``FileNotFoundError``."""

    def __init__(self, *args, calibration_loss, ignore_index: int | None = -100, **kwargs):
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("pass either calibration_loss or compute_loss_func, not both")
        kwargs["compute_loss_func"] = loss_func(calibration_loss)
        super().__init__(*args, **kwargs)
        self.calibration_loss = calibration_loss
        self.calibration_ignore_index = check_ignore_index(ignore_index)
        self._calibration_training = False
        self._calibration_started = False  # an epoch of train() has begun (eval_on_start's evaluation: not)
        self._calibration_update: bool | None = None
        self.add_callback(_LossSchedule(self))

    def train(self, *args, **kwargs):
        checkpoint = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if checkpoint is True:  # the Trainer's own choice: the last checkpoint in output_dir
            checkpoint = get_last_checkpoint(self.args.output_dir)
        # (a path that is no folder: the Trainer raises)
        if isinstance(checkpoint, str | os.PathLike) and os.path.isdir(checkpoint):
            self._load_calibration_loss(checkpoint)
        self._calibration_training, self._calibration_started = True, False
        try:
            return super().train(*args, **kwargs)
        finally:
            self._calibration_training = self._calibration_started = False

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:  # the folder the Trainer has just written (its _save_checkpoint's name)
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            _save_atomically(self.calibration_loss.state_dict(), os.path.join(folder, CALIBRATION_LOSS_NAME))

    def _load_calibration_loss(self, checkpoint) -> None:
        path = os.path.join(checkpoint, CALIBRATION_LOSS_NAME)
        if not os.path.isfile(path):
            if self.calibration_loss.state_dict():
                raise FileNotFoundError(
                    f"{checkpoint} has no {CALIBRATION_LOSS_NAME}, the state of the calibration loss "
                    f"({type(self.calibration_loss).__name__}), so the resumed run would start from a fresh "
                    "loss; save the loss's state_dict() there (torch.save) to resume from this checkpoint"
                )
            return
        self.calibration_loss.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

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

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        if self._calibration_update is None:
            update = self._calibration_training and self._calibration_started and metric_key_prefix == "eval"
        else:
            update = self._calibration_update
        adaptive = [m for m in self.calibration_loss.modules() if isinstance(m, ADAPTIVE_LOSSES)]
        # the update needs the logits, which the Trainer drops without compute_metrics
        if update and adaptive:
            prediction_loss_only = False
        output = super().evaluation_loop(
            dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
        )
        if update and adaptive and output.predictions is not None and output.label_ids is not None:
            logits, labels = self._calibration_rows(output.predictions, output.label_ids)
            for module in adaptive:
                module.update(logits, labels, from_logits=True)
        return output

    def _calibration_rows(self, predictions, label_ids):
        """The evaluation logits and labels the loss is updated from, as (rows, K) and (rows,) tensors."""
        return _rows(predictions, label_ids, self.calibration_ignore_index)


class _LossSchedule(TrainerCallback):
    """Gives the scheduled modules of a :class:`CalibrationTrainer`'s loss the run's number of epochs when
    training starts (``set_total_epochs``) and the epoch, 0-based, when each epoch starts (``set_epoch``), as
    the runner does; marks the start of the first epoch (evaluations before it do not update the loss)."""

    def __init__(self, trainer: CalibrationTrainer):
        self.trainer = trainer

    def _modules(self, hook: str):
        """The torchcal modules of the loss that have the method ``hook``."""
        return [
            m
            for m in self.trainer.calibration_loss.modules()
            if callable(getattr(m, hook, None))
            and any(c.__module__.startswith("torchcal.") for c in type(m).__mro__)
        ]

    def on_train_begin(self, args, state, control, **kwargs):
        epochs = getattr(state, "num_train_epochs", None)
        # (an iterable dataset trained for max_steps: sys.maxsize epochs, i.e. the count is unknown)
        if isinstance(epochs, int) and 0 < epochs < sys.maxsize:
            for module in self._modules("set_total_epochs"):
                module.set_total_epochs(epochs)

    def on_epoch_begin(self, args, state, control, **kwargs):
        # state.epoch is the epochs done: e + k/n inside epoch e (a resumed run's), exactly e at its start
        epoch = int(math.floor(state.epoch or 0))
        for module in self._modules("set_epoch"):
            module.set_epoch(epoch)
        self.trainer._calibration_started = True


def _save_atomically(state: dict, path: str) -> None:
    """``torch.save`` into a temporary file of the same folder, renamed onto ``path``: a reader sees the old
    file or the whole new one."""
    handle, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(state, file)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# -- the fused head: training without the logits (decision 128) ----------------------------------------------

# configuration fields of models that transform the head's logits after the matmul (soft-capping, scaling):
# the fused loss computes the loss of the plain head, so these models are refused
_LOGIT_TRANSFORMS = {
    "final_logit_softcapping": (None,),
    "logit_scale": (None, 1, 1.0),
    "logits_scaling": (None, 1, 1.0),
}


def _unwrapped(model: Any) -> Any:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):  # DDP, DataParallel
        model = model.module
    return model


def _fused_head(model, head=None) -> torch.nn.Linear:
    """The model's output head: ``head`` if given, else its output embeddings (language-model heads), else
    its ``classifier`` or ``score`` (token-classification heads); a linear layer."""
    model = _unwrapped(model)
    if head is None:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        for name in ("classifier", "score"):
            if head is None and isinstance(getattr(model, name, None), torch.nn.Module):
                head = getattr(model, name)
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(
            f"the fused loss needs the model's output head as a torch.nn.Linear (pass head=...), got "
            f"{type(head).__name__}"
        )
    config = getattr(model, "config", None)
    for field, plain in _LOGIT_TRANSFORMS.items():
        value = getattr(config, field, None)
        if value not in plain:
            raise ValueError(
                f"{type(model).__name__} transforms its logits after the head ({field}={value!r}); the fused "
                "loss computes the loss of the plain head: train it with CalibrationTrainer instead"
            )
    return head


def _is_causal_lm(model) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return type(_unwrapped(model)).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def _shifted(labels, ignore_index):
    """Labels of a causal LM aligned with its positions: position i predicts token i + 1 (Hugging Face's
    ``ForCausalLMLoss``); the last position gets ``ignore_index``."""
    if ignore_index is None:
        raise ValueError("a causal LM's shifted labels are padded with ignore_index: the loss needs one")
    return torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


@contextlib.contextmanager
def _head_input(head: torch.nn.Linear):
    """Inside the block, calling ``head`` records its input and returns an empty (..., 0) tensor in place of
    the logits, so the model's forward pass never computes them (anything that tries to use them fails loudly
    on the empty class dimension)."""
    captured = []

    def capture(input: torch.Tensor) -> torch.Tensor:  # (nn.Linear.forward's signature)
        captured.append(input)
        return input.new_empty(*input.shape[:-1], 0)

    head.forward = capture
    try:
        yield captured
    finally:
        del head.forward


def _as_fused(loss, chunk_size=None, vocab_chunk_size=None):
    from ..losses import FusedLinearLoss

    if isinstance(loss, FusedLinearLoss):
        if chunk_size is not None or vocab_chunk_size is not None:
            raise ValueError("chunk sizes are set on the FusedLinearLoss itself")
        return loss
    return FusedLinearLoss(loss, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size)


def _fused_from_hidden(fused, head, hidden, labels, num_items_in_batch, causal):
    if causal:
        labels = _shifted(labels, fused.ignore_index)
    if num_items_in_batch is None:
        return fused(hidden, head.weight, labels, head.bias)
    return _step_share(
        fused, lambda: fused(hidden, head.weight, labels, head.bias), labels, num_items_in_batch
    )


def fused_loss(model, inputs, loss, *, num_items_in_batch=None, head=None, shift_labels=None):
    """The loss of a Hugging Face model's batch computed by the fused head, without its logits: the model
    runs on ``inputs`` without ``labels``, its output head (a ``nn.Linear``: the language-model head, or the
    token classifier) hands its input to :class:`torchcal.losses.FusedLinearLoss`. Causal LMs (the
    ``AutoModelForCausalLM`` classes, or ``shift_labels=True``) predict the next token: labels are shifted as
    Hugging Face's ``ForCausalLMLoss`` does. ``loss`` is a torchcal loss module or name, or a
    ``FusedLinearLoss``. With ``num_items_in_batch`` the loss is the batch's sum divided by it (the
    Trainer's gradient-accumulation convention), else the loss's own reduction.

    Models that transform the logits after the head (Gemma-2 soft-capping, Cohere's and Granite's logit
    scaling) are refused: their loss is not the plain head's.
    """
    if not isinstance(inputs, Mapping) or inputs.get("labels") is None:
        raise ValueError("`inputs` must be a mapping with the batch's `labels`")
    fused = _as_fused(loss)
    head = _fused_head(model, head)
    causal = _is_causal_lm(model) if shift_labels is None else bool(shift_labels)
    inputs = dict(inputs)
    labels = inputs.pop("labels")
    with _head_input(head) as captured:
        model(**inputs)
    if len(captured) != 1:
        raise RuntimeError(
            f"the output head was called {len(captured)} times in one forward pass, expected once"
        )
    return _fused_from_hidden(fused, head, captured[0], labels, num_items_in_batch, causal)


class FusedCalibrationTrainer(CalibrationTrainer):
    """A :class:`CalibrationTrainer` whose training steps compute the loss with the fused head
    (:class:`torchcal.losses.FusedLinearLoss`, chunk sizes ``chunk_size`` / ``vocab_chunk_size``), never
    materialising the logits; evaluation and prediction steps, which return the logits, compute them and the
    same loss unfused. Labels of causal LMs are shifted (position i predicts token i + 1) in both, and the
    AdaFocal update after an evaluation uses the shifted labels too (it needs the evaluation logits, which the
    Trainer keeps when ``compute_metrics`` is set). Which evaluations update the loss, and the loss's state in
    each checkpoint, are :class:`CalibrationTrainer`'s. ``calibration_loss`` is a torchcal loss module or name
    (``"flsd-53"``) or a :class:`~torchcal.losses.FusedLinearLoss`."""

    def __init__(
        self,
        *args,
        calibration_loss,
        chunk_size: int | None = None,
        vocab_chunk_size: int | None = None,
        shift_labels: bool | None = None,
        ignore_index: int | None = -100,
        **kwargs,
    ):
        fused = _as_fused(calibration_loss, chunk_size, vocab_chunk_size)
        super().__init__(*args, calibration_loss=fused.loss, ignore_index=ignore_index, **kwargs)
        self.fused_loss = fused
        self._causal = _is_causal_lm(self.model) if shift_labels is None else bool(shift_labels)
        if self._causal:  # the unfused evaluation loss on shifted labels as well
            unfused = self.compute_loss_func

            def shifted_loss(outputs, labels, num_items_in_batch=None):
                labels = None if labels is None else _shifted(labels, fused.ignore_index)
                return unfused(outputs, labels, num_items_in_batch=num_items_in_batch)

            self.compute_loss_func = shifted_loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs or not model.training or inputs.get("labels") is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        head = _fused_head(model)
        unfused, causal = self.compute_loss_func, self._causal
        with _head_input(head) as captured:

            def fused(outputs, labels, num_items_in_batch=None):
                if len(captured) != 1:
                    raise RuntimeError(f"the output head was called {len(captured)} times, expected once")
                return _fused_from_hidden(
                    self.fused_loss, head, captured[0], labels, num_items_in_batch, causal
                )

            self.compute_loss_func = fused  # the Trainer's own bookkeeping (labels, token counts) around it
            try:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            finally:
                self.compute_loss_func = unfused

    def _calibration_rows(self, predictions, label_ids):
        if not self._causal:
            return super()._calibration_rows(predictions, label_ids)
        if isinstance(predictions, tuple | list):
            predictions = predictions[0]
        # position i predicts token i + 1
        return _rows(
            np.asarray(predictions)[:, :-1], np.asarray(label_ids)[:, 1:], self.calibration_ignore_index
        )
