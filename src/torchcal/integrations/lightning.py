"""A Lightning callback for calibration (``pip install torchcal[lightning]``).

:class:`CalibrationCallback` does three things with the validation loop, under any strategy (DDP included):

1. **logs the calibration metrics** of each validation epoch (``val/ece``, ``val/adaece``, ...), computed over
   the whole validation set: the per-rank sums are all-reduced (constant size) and the per-sample
   confidences all-gathered only for the equal-mass metrics;
2. **updates AdaFocal** (every :class:`~torchcal.adafocal.AdaFocalLoss` and
   :class:`~torchcal.adafocal.CalFocalLoss` inside the LightningModule) from those global validation
   statistics, so every rank holds the same γ — the papers' per-epoch schedule — and calls the end-of-epoch
   update of :class:`~torchcal.losses.CALSLoss` and :class:`~torchcal.losses.AvUCLoss` (their multipliers
   and threshold from the training statistics they accumulated, summed over the ranks). Only the validation epochs
   that ``Trainer.fit`` runs update it: a stand-alone ``Trainer.validate`` (before training, or of a
   checkpoint) measures and leaves the loss as it is. A validation run more than once per epoch
   (``val_check_interval``) updates after each run, as Hugging Face's evaluations every n steps (AdaFocal-n).
   When several callbacks watch the same module, only the first of them that updates (multiclass,
   ``update_adafocal=True``) updates the loss: each validation run updates it once. Scheduled losses get the
   epoch, 0-based, at the start of each training epoch (``set_epoch``: FLS-531 / FLS-532's γ, MbLS's α
   schedule, MaxSup's ramp) and the trainer's ``max_epochs`` when training starts (``set_total_epochs``:
   MaxSup), as the runner gives them; a resumed fit continues the schedule from its checkpoint's epoch;
3. **fits a post-hoc calibrator** (a spec such as ``"ts"`` or ``"ts:objective=ece"``) on the epoch's
   validation logits, gathered from every rank, and records the global step and epoch of the weights it was
   fitted to (``callback.calibrator_fitted_at_``). It is part of the callback's state: a checkpoint written
   at that step carries it (``callback.calibrator_``; restored by ``Trainer.fit(..., ckpt_path=...)`` or
   :meth:`CalibrationCallback.calibrator_from_checkpoint`); a checkpoint of later weights (a checkpoint
   every epoch with ``check_val_every_n_epoch=2``, say) carries none, and loading it says so.

The validation step must return the batch's logits and targets: a dict with ``"logits"`` and ``"targets"``
keys, a ``(logits, targets)`` tuple, or anything ``outputs_fn(outputs, batch)`` turns into that. With
``task="multiclass"`` (softmax outputs) logits may have extra dimensions (N, K, d1, ...) with integer targets
(N, d1, ...); targets equal to ``ignore_index`` are left out. With ``task="multilabel"`` (sigmoid outputs)
logits are (N, L) with 0/1 targets (N, L); a target equal to ``ignore_index`` (−1 or −100 for an unknown
label) leaves out that label of that sample from the metrics, and the calibrator is fitted on the samples
whose labels are all known. The sanity-check pass is skipped. Only the first validation dataloader is used.
Under DDP, Lightning's distributed sampler repeats up to world size − 1 samples to even out the shards when
the validation set does not divide; those repeats count like any sample, as in Lightning's own metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # one base class for the type checker: the current package name
    from lightning.pytorch import Callback
else:
    try:
        from lightning.pytorch import Callback
    except ImportError:  # pragma: no cover - the older package name
        try:
            from pytorch_lightning import Callback
        except ImportError as err:
            raise ImportError(
                "torchcal.integrations.lightning needs Lightning: pip install 'torchcal[lightning]'"
            ) from err

import warnings

import torch

from .._validation import check_bool, check_choice, check_positive_int
from ..calibrators import from_spec
from ..functional._loss_inputs import check_ignore_index
from ..losses import ADAPTIVE_LOSSES
from ..metrics import (
    DECOMPOSITION_METRICS,
    METRICS,
    ROW_METRICS,
    CalibrationMetrics,
    all_gather_rows,
    metric_rows,
)
from . import _multilabel as ML

__all__ = ["CalibrationCallback"]

DEFAULT_METRICS = ("ece", "adaece", "classwise_ece", "mce", "nll", "brier")
DEFAULT_MULTILABEL_METRICS = ("ece", "adaece", "mce", "nll", "brier", "auroc")


class CalibrationCallback(Callback):
    """Calibration metrics, AdaFocal updates and a post-hoc calibrator from the validation loop.

    Args:
        num_classes: K (with ``task="multilabel"``: the number of labels L).
        metrics: names to log: of :meth:`torchcal.metrics.CalibrationMetrics.compute` (multiclass), or
            "ece", "mce", "adaece", "brier", "nll", "error", "auroc" (multi-label: the macro mean over labels;
            ``<name>_micro`` pools every (sample, label) pair, not for AUROC). None: the task's defaults.
        calibrator: calibrator spec fitted on each epoch's validation logits, or None (with
            ``task="multilabel"`` a sigmoid calibrator: ``"ts"`` is per-label temperature scaling).
        update_adafocal: update the AdaFocal / CalFocal / CALS / AvUC losses of the module after each
            validation epoch of ``Trainer.fit`` (multiclass only), and give scheduled losses the epoch.
        n_bins: bins of the metrics (and of AdaFocal's equal-mass statistics: it uses the loss's own).
        prefix: prefix of the logged names; part of :attr:`state_key`, so two callbacks with the same
            calibrator spec and other prefixes keep their own state in a checkpoint.
        ignore_index: targets left out (None: every target must be a class, or 0/1 for multi-label).
        outputs_fn: ``(outputs, batch) -> (logits, targets)``; None reads a dict or a tuple.
        task: "multiclass" (softmax outputs, integer targets) or "multilabel" (sigmoid outputs, (N, L) 0/1
            targets).

    Example:
        >>> from torchcal.integrations.lightning import CalibrationCallback
        >>> CalibrationCallback(num_classes=10, calibrator="ts:objective=ece").calibrator
        'ts:objective=ece'
    """

    def __init__(
        self,
        num_classes: int,
        metrics=None,
        calibrator: str | None = "ts",
        *,
        update_adafocal: bool = True,
        n_bins: int = 15,
        prefix: str = "val/",
        ignore_index: int | None = -100,
        outputs_fn=None,
        task: str = "multiclass",
    ):
        super().__init__()
        self.task = check_choice(task, "task", ("multiclass", "multilabel"))
        multilabel = self.task == "multilabel"
        self.num_classes = check_positive_int(num_classes, "num_classes", minimum=1 if multilabel else 2)
        if metrics is None:
            metrics = DEFAULT_MULTILABEL_METRICS if multilabel else DEFAULT_METRICS
        self.metrics = (metrics,) if isinstance(metrics, str) else tuple(metrics)
        if multilabel:
            known = list(ML.MULTILABEL_METRICS) + [
                f"{m}_micro" for m, (_, averages) in ML.MULTILABEL_METRICS.items() if "micro" in averages
            ]
        else:
            known = list(METRICS)
        unknown = set(self.metrics) - set(known)
        if unknown:
            raise ValueError(f"`metrics` has unknown names {sorted(unknown)}; choose from {known}")
        self.calibrator = calibrator
        if calibrator is not None:
            from_spec(calibrator, task=self.task)  # a bad spec fails here, not after the first epoch
        self.update_adafocal = check_bool(update_adafocal, "update_adafocal")
        self.n_bins = check_positive_int(n_bins, "n_bins")
        self.prefix = str(prefix)
        self.ignore_index = check_ignore_index(ignore_index)
        self.outputs_fn = outputs_fn
        self.calibrator_ = None
        self.calibrator_fitted_at_: dict | None = None  # {"global_step": ..., "epoch": ...} of the fit
        self._reset()

    def _reset(self):
        if self.task == "multilabel":
            self._accumulator = _MultilabelAccumulator(
                self.num_classes, self.n_bins, self.metrics, self.ignore_index
            )
        else:
            wanted = set(self.metrics)  # the state those metrics need, no more
            self._accumulator = CalibrationMetrics(
                self.num_classes,
                self.n_bins,
                from_logits=True,
                equal_mass=self.update_adafocal or bool(wanted & set(ROW_METRICS)),  # AdaFocal: the rows
                decompositions=bool(wanted & set(DECOMPOSITION_METRICS)),
            )
        self._logits: list[torch.Tensor] = []
        self._targets: list[torch.Tensor] = []

    @property
    def state_key(self) -> str:
        return _state_key(self.calibrator, self.prefix, self.task)

    # -- the training loop: scheduled losses ------------------------------------------------------------

    def on_train_start(self, trainer, pl_module) -> None:
        epochs = getattr(trainer, "max_epochs", None)
        if not self.update_adafocal or not isinstance(epochs, int) or epochs < 1:  # (-1: max_steps bounds it)
            return
        for module in _torchcal_modules(pl_module, "set_total_epochs"):
            module.set_total_epochs(epochs)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if not self.update_adafocal:
            return
        for module in _torchcal_modules(pl_module, "set_epoch"):
            module.set_epoch(trainer.current_epoch)

    def _updates_loss(self, trainer) -> bool:
        """Whether this callback updates the loss: the first of the trainer's callbacks that would."""
        if not (self.update_adafocal and self.task == "multiclass"):
            return False
        for callback in getattr(trainer, "callbacks", [self]):
            if isinstance(callback, CalibrationCallback) and callback.update_adafocal:
                if callback.task == "multiclass":
                    return callback is self
        return True

    # -- the validation loop -----------------------------------------------------------------------------

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._reset()

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ) -> None:
        if trainer.sanity_checking or dataloader_idx != 0:
            return
        logits, targets = self._extract(outputs, batch)
        if logits.shape[0] == 0:
            return
        self._accumulator.update(logits, targets)
        if self.calibrator is not None:
            if self.task == "multilabel" and self.ignore_index is not None:  # samples with every label known
                known = (targets != self.ignore_index).all(1)
                logits, targets = logits[known], targets[known]
            self._logits.append(logits.float().cpu())
            self._targets.append(targets.cpu())

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or self._accumulator.num_samples == 0 and not _distributed():
            return
        acc = self._accumulator.sync()  # global sums on every rank (a no-op in one process)
        if acc.num_samples == 0:
            return
        values = acc.compute(self.metrics)
        pl_module.log_dict(
            {f"{self.prefix}{name}": values[name].float() for name in self.metrics},
            on_epoch=True,
            sync_dist=True,  # the values are already global: the mean over ranks of equal values is that value
        )
        if self._updates_loss(trainer) and _fitting(trainer):
            for module in pl_module.modules():
                if isinstance(module, ADAPTIVE_LOSSES):
                    module.update(metrics=acc)
        if self.calibrator is not None:
            mine = (
                (torch.cat(self._logits), torch.cat(self._targets))
                if self._logits
                else _no_rows(self.num_classes, self.task)
            )
            logits, targets = _gather_rows(*mine)
            if logits.shape[0] == 0:  # multi-label: no sample with every label known
                warnings.warn(
                    "CalibrationCallback: no validation sample has every label known; no calibrator fitted",
                    UserWarning,
                    stacklevel=2,
                )
                self.calibrator_ = self.calibrator_fitted_at_ = None
                return
            self.calibrator_ = from_spec(self.calibrator, task=self.task).fit(logits, targets)
            self.calibrator_fitted_at_ = {"global_step": trainer.global_step, "epoch": trainer.current_epoch}

    # -- inputs ------------------------------------------------------------------------------------------

    def _extract(self, outputs, batch):
        if self.outputs_fn is not None:
            logits, targets = self.outputs_fn(outputs, batch)
        elif isinstance(outputs, dict) and {"logits", "targets"} <= set(outputs):
            logits, targets = outputs["logits"], outputs["targets"]
        elif isinstance(outputs, tuple | list) and len(outputs) == 2:
            logits, targets = outputs
        else:
            raise TypeError(
                "CalibrationCallback: validation_step must return {'logits': ..., 'targets': ...} or "
                "(logits, targets), or pass outputs_fn=(outputs, batch) -> (logits, targets); got "
                f"{type(outputs).__name__}"
            )
        if self.task == "multilabel":
            return ML.label_rows(logits, targets, self.num_classes, names=("logits", "targets"))
        return metric_rows(logits, targets, self.ignore_index)

    # -- checkpoints -------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        fitted = None if self.calibrator_ is None else self.calibrator_.state_dict()
        return {
            "calibrator": self.calibrator,
            "task": self.task,
            "num_classes": self.num_classes,
            "fitted": fitted,
            "fitted_at": self.calibrator_fitted_at_,
        }

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        """Leaves out of ``checkpoint`` a calibrator fitted to other weights than the checkpoint's (the
        weights changed after the fit: training went on without a validation epoch)."""
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if state is None or state.get("fitted") is None:
            return
        fitted_step = (state.get("fitted_at") or {}).get("global_step")
        saved_step = checkpoint["global_step"] if "global_step" in checkpoint else trainer.global_step
        if fitted_step != saved_step:
            state["fitted"] = None
            state["stale"] = {"fitted_at": state["fitted_at"], "global_step": saved_step}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores the fitted calibrator; refuses one fitted for another task or number of classes."""
        self.calibrator_ = self.calibrator_fitted_at_ = None
        calibrator = _calibrator_of(state_dict, self.state_key, expected=(self.task, self.num_classes))
        if calibrator is not None:
            self.calibrator_, self.calibrator_fitted_at_ = calibrator, state_dict.get("fitted_at")

    @staticmethod
    def calibrator_from_checkpoint(
        path, calibrator: str = "ts", *, prefix: str = "val/", task: str = "multiclass", weights_only=True
    ):
        """The fitted calibrator saved in a Lightning checkpoint by the callback with this ``calibrator``
        spec, ``prefix`` and ``task``: None, with a warning, when the checkpoint's weights changed after the
        last fit (no calibrator fits them), and None when the callback had fitted none.

        The checkpoint is read with ``torch.load(weights_only=True)``: tensors and plain Python values only,
        nothing executed. A checkpoint that holds other objects (hyper-parameters of custom classes) is
        refused; pass ``weights_only=False`` for a file you trust."""
        try:
            checkpoint = torch.load(
                path, map_location="cpu", weights_only=check_bool(weights_only, "weights_only")
            )
        except Exception as err:  # pickle.UnpicklingError and its relatives name the offending global
            if not weights_only:
                raise
            raise ValueError(
                f"{path} holds objects other than tensors and plain values, which torch.load(weights_only=True) "
                f"does not read ({str(err).splitlines()[0]}); pass weights_only=False if you trust the file"
            ) from None
        key = _state_key(calibrator, prefix, task)
        states = checkpoint.get("callbacks", {})
        legacy = f"CalibrationCallback[{calibrator}]"
        if key not in states and legacy in states and prefix == "val/" and task == "multiclass":
            key = legacy  # written before the prefix and task were part of the key
        if key not in states:
            raise KeyError(f"{path} holds no state of {key}; it has {sorted(states)}")
        return _calibrator_of(states[key], key)


def _state_key(calibrator, prefix: str, task: str) -> str:
    task_part = "" if task == "multiclass" else f", task={task}"
    return f"CalibrationCallback[{calibrator}, prefix={prefix}{task_part}]"


def _calibrator_of(state: dict, key: str, expected=None):
    """The calibrator of a callback state (None if none was fitted, with a warning if it was left out for
    being fitted to earlier weights); ``expected`` (task, number of classes) is checked."""
    if state.get("stale") is not None:
        stale = state["stale"]
        fitted_at = stale.get("fitted_at") or {}
        when = (
            f"global step {fitted_at['global_step']}, epoch {fitted_at['epoch']}"
            if {"global_step", "epoch"} <= set(fitted_at)
            else "at an unrecorded step"
        )
        warnings.warn(
            f"{key}: the checkpoint's weights (global step {stale['global_step']}) changed after the "
            f"calibrator was fitted ({when}), so it was not saved; fit one on these weights (Trainer.validate "
            "with this callback)",
            UserWarning,
            stacklevel=3,
        )
        return None
    if state.get("fitted") is None:
        return None
    task = state.get("task", "multiclass")
    calibrator = from_spec(state["calibrator"], task=task).load_state_dict(state["fitted"])
    if expected is not None:
        fitted_k = calibrator.num_classes_
        if (task, fitted_k) != tuple(expected):
            what = "labels" if expected[0] == "multilabel" else "classes"
            raise ValueError(
                f"{key}: the checkpoint's calibrator was fitted for task={task!r} with {fitted_k} "
                f"{'labels' if task == 'multilabel' else 'classes'}, but this callback has task="
                f"{expected[0]!r} with {expected[1]} {what}"
            )
    return calibrator


def _torchcal_modules(module: torch.nn.Module, hook: str) -> list:
    """The torchcal modules inside ``module`` that have the method ``hook`` (a model's own ``set_epoch``, which
    may mean something else, is left alone)."""
    return [
        m
        for m in module.modules()
        if callable(getattr(m, hook, None))
        and any(c.__module__.startswith("torchcal.") for c in type(m).__mro__)
    ]


def _fitting(trainer) -> bool:
    """Whether the trainer runs ``fit`` (its validation epochs may adapt the loss), not ``validate``."""
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return fn is not None and str(getattr(fn, "value", fn)) == "fit"


class _MultilabelAccumulator:
    """The multi-label metrics of a validation epoch (unknown targets masked): sums all-reduced on ``sync``,
    per-sample rows all-gathered only when AdaECE or AUROC is asked for."""

    def __init__(self, num_labels, n_bins, names, ignore_index):
        self.num_labels, self.n_bins, self.ignore_index = num_labels, n_bins, ignore_index
        self.names = tuple(dict.fromkeys(n.removesuffix("_micro") for n in names))
        self.keeps_rows = any(ML.MULTILABEL_METRICS[n][0] for n in self.names)
        self._sums = torch.zeros(ML.state_size(num_labels, n_bins), dtype=torch.float64)
        self._rows: list[torch.Tensor] = []

    def update(self, logits, targets):
        sums, rows = ML.batch_state(
            logits, targets, self.num_labels, self.n_bins, True, self.ignore_index, self.keeps_rows
        )
        if sums is None:
            return
        self._sums = self._sums.to(sums.device) + sums
        if rows is not None:
            self._rows.append(rows)

    @property
    def num_samples(self) -> int:
        return int(ML._views(self._sums, self.num_labels, self.n_bins)[1][0].sum())

    def sync(self):
        if not _distributed():
            return self
        import torch.distributed as dist

        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        self._sums = self._sums.to(device)
        dist.all_reduce(self._sums)
        if self.keeps_rows:
            empty = torch.zeros(0, 2, self.num_labels, dtype=torch.float64)
            mine = torch.cat(self._rows) if self._rows else empty
            self._rows = all_gather_rows(mine.to(device))
        return self

    def compute(self, names):
        rows = torch.cat(self._rows).to(self._sums.device) if self.keeps_rows else None
        out = ML.compute(self._sums, rows, self.num_labels, self.n_bins, self.names)
        return {name: out[name] for name in names}


def _no_rows(k: int, task: str = "multiclass"):
    if task == "multilabel":
        return torch.zeros(0, k), torch.zeros(0, k)
    return torch.zeros(0, k), torch.zeros(0, dtype=torch.long)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _gather_rows(logits: torch.Tensor, targets: torch.Tensor):
    """Every rank's (logits, targets) rows on every rank, in rank order (shards of any size)."""
    if not _distributed():
        return logits, targets
    import torch.distributed as dist

    device = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else logits.device
    )
    if targets.ndim == 2:  # multi-label: (N, L) targets beside (N, L) logits
        mine = torch.cat([logits.to(device, torch.float64), targets.to(device, torch.float64)], dim=1)
        rows = torch.cat(all_gather_rows(mine)).cpu()
        k = logits.shape[1]
        return rows[:, :k].to(logits.dtype), rows[:, k:].to(targets.dtype)
    mine = torch.cat([logits.to(device, torch.float64), targets.to(device, torch.float64)[:, None]], dim=1)
    rows = torch.cat(all_gather_rows(mine)).cpu()
    return rows[:, :-1].to(logits.dtype), rows[:, -1].long()
