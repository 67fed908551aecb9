"""A Lightning callback for calibration (``pip install torchcal[lightning]``).

:class:`CalibrationCallback` does three things with the validation loop, under any strategy (DDP included):

1. **logs the calibration metrics** of each validation epoch (``val/ece``, ``val/adaece``, ...), computed over
   the whole validation set: the per-rank sums are all-reduced (constant size) and the per-sample
   confidences all-gathered only for the equal-mass metrics;
2. **updates AdaFocal** (every :class:`~torchcal.adafocal.AdaFocalLoss` and
   :class:`~torchcal.adafocal.CalFocalLoss` inside the LightningModule) from those global validation
   statistics, so every rank holds the same γ — the papers' per-epoch schedule;
3. **fits a post-hoc calibrator** (a spec such as ``"ts"`` or ``"ts:objective=ece"``) on the epoch's
   validation logits, gathered from every rank; it is part of the callback's state, so each checkpoint
   Lightning writes carries the calibrator fitted to its own weights (``callback.calibrator_``; restored by
   ``Trainer.fit(..., ckpt_path=...)`` or :meth:`CalibrationCallback.calibrator_from_checkpoint`).

The validation step must return the batch's logits and integer targets: a dict with ``"logits"`` and
``"targets"`` keys, a ``(logits, targets)`` tuple, or anything ``outputs_fn(outputs, batch)`` turns into
that. Logits may have extra dimensions (N, K, d1, ...) with targets (N, d1, ...); targets equal to
``ignore_index`` are left out. The sanity-check pass is skipped. Only the first validation dataloader is
used. Under DDP, Lightning's distributed sampler repeats up to world size − 1 samples to even out the shards
when the validation set does not divide; those repeats count like any sample, as in Lightning's own metrics.
"""

from __future__ import annotations

try:
    from lightning.pytorch import Callback
except ImportError:  # pragma: no cover - the older package name
    try:
        from pytorch_lightning import Callback
    except ImportError as err:
        raise ImportError(
            "torchcal.integrations.lightning needs Lightning: pip install 'torchcal[lightning]'"
        ) from err

import torch

from .._validation import check_bool, check_positive_int
from ..adafocal import AdaFocalLoss, CalFocalLoss
from ..calibrators import from_spec
from ..functional._loss_inputs import check_ignore_index
from ..metrics import (
    EQUAL_MASS_METRICS,
    EQUAL_WIDTH_METRICS,
    CalibrationMetrics,
    all_gather_rows,
    metric_rows,
)

__all__ = ["CalibrationCallback"]

DEFAULT_METRICS = ("ece", "adaece", "classwise_ece", "mce", "nll", "brier")


class CalibrationCallback(Callback):
    """Calibration metrics, AdaFocal updates and a post-hoc calibrator from the validation loop.

    Args:
        num_classes: K.
        metrics: names of :meth:`torchcal.metrics.CalibrationMetrics.compute` to log.
        calibrator: calibrator spec fitted on each epoch's validation logits, or None.
        update_adafocal: update the AdaFocal / CalFocal losses of the module after each validation epoch.
        n_bins: bins of the metrics (and of AdaFocal's equal-mass statistics: it uses the loss's own).
        prefix: prefix of the logged names.
        ignore_index: targets left out (None: every target must be a class).
        outputs_fn: ``(outputs, batch) -> (logits, targets)``; None reads a dict or a tuple.

    Example:
        >>> from torchcal.integrations.lightning import CalibrationCallback
        >>> CalibrationCallback(num_classes=10, calibrator="ts:objective=ece").calibrator
        'ts:objective=ece'
    """

    def __init__(
        self,
        num_classes: int,
        metrics=DEFAULT_METRICS,
        calibrator: str | None = "ts",
        *,
        update_adafocal: bool = True,
        n_bins: int = 15,
        prefix: str = "val/",
        ignore_index: int | None = -100,
        outputs_fn=None,
    ):
        super().__init__()
        self.num_classes = check_positive_int(num_classes, "num_classes", minimum=2)
        self.metrics = (metrics,) if isinstance(metrics, str) else tuple(metrics)
        unknown = set(self.metrics) - set(EQUAL_WIDTH_METRICS + EQUAL_MASS_METRICS)
        if unknown:
            raise ValueError(
                f"`metrics` has unknown names {sorted(unknown)}; choose from "
                f"{list(EQUAL_WIDTH_METRICS + EQUAL_MASS_METRICS)}"
            )
        self.calibrator = calibrator
        if calibrator is not None:
            from_spec(calibrator)  # a bad spec fails here, not after the first epoch
        self.update_adafocal = check_bool(update_adafocal, "update_adafocal")
        self.n_bins = check_positive_int(n_bins, "n_bins")
        self.prefix = str(prefix)
        self.ignore_index = check_ignore_index(ignore_index)
        self.outputs_fn = outputs_fn
        self.calibrator_ = None
        self._reset()

    def _reset(self):
        self._accumulator = CalibrationMetrics(self.num_classes, self.n_bins, from_logits=True)
        self._logits: list[torch.Tensor] = []
        self._targets: list[torch.Tensor] = []

    @property
    def state_key(self) -> str:
        return f"CalibrationCallback[{self.calibrator}]"

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
        if self.update_adafocal:
            for module in pl_module.modules():
                if isinstance(module, AdaFocalLoss | CalFocalLoss):
                    module.update(metrics=acc)
        if self.calibrator is not None:
            mine = (
                (torch.cat(self._logits), torch.cat(self._targets))
                if self._logits
                else _no_rows(self.num_classes)
            )
            logits, targets = _gather_rows(*mine)
            self.calibrator_ = from_spec(self.calibrator).fit(logits, targets)

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
        return metric_rows(logits, targets, self.ignore_index)

    # -- checkpoints -------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        fitted = None if self.calibrator_ is None else self.calibrator_.state_dict()
        return {"calibrator": self.calibrator, "fitted": fitted}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("fitted") is not None:
            self.calibrator_ = from_spec(state_dict["calibrator"]).load_state_dict(state_dict["fitted"])

    @staticmethod
    def calibrator_from_checkpoint(path, calibrator: str = "ts"):
        """The fitted calibrator saved in a Lightning checkpoint by a callback with this ``calibrator`` spec
        (None if that callback had fitted none)."""
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        key = f"CalibrationCallback[{calibrator}]"
        states = checkpoint.get("callbacks", {})
        if key not in states:
            raise KeyError(f"{path} holds no state of {key}; it has {sorted(states)}")
        state = states[key]
        if state.get("fitted") is None:
            return None
        return from_spec(state["calibrator"]).load_state_dict(state["fitted"])


def _no_rows(k: int):
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
    mine = torch.cat([logits.to(device, torch.float64), targets.to(device, torch.float64)[:, None]], dim=1)
    rows = torch.cat(all_gather_rows(mine)).cpu()
    return rows[:, :-1].to(logits.dtype), rows[:, -1].long()
