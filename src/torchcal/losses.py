"""``nn.Module`` twins of the functional losses, and a registry named after the papers' labels.

Each ``forward`` is one call into :mod:`torchcal.functional.losses`; the stateful AdaFocal lives in
:mod:`torchcal.adafocal`.

    >>> import torch
    >>> from torchcal.losses import create, list_losses
    >>> loss_fn = create("flsd-53")
    >>> loss_fn
    SampleDependentFocalLoss(gammas=(5.0, 3.0), thresholds=(0.2,), reduction='mean')
    >>> "adafocal" in list_losses() and "fl-3" in list_losses()
    True
"""

from __future__ import annotations

import re

from torch import nn

from ._validation import check_choice, check_float, check_positive_int
from .adafocal import AdaFocalLoss, CalFocalLoss
from .functional import losses as L
from .functional._loss_inputs import check_ignore_index

__all__ = [
    "AdaFocalLoss",
    "BrierLoss",
    "CalFocalLoss",
    "CrossEntropyLoss",
    "DualFocalLoss",
    "DualSampleDependentFocalLoss",
    "FocalCalibrationLoss",
    "FocalLoss",
    "InverseFocalLoss",
    "MMCELoss",
    "SampleDependentFocalLoss",
    "ScheduledFocalLoss",
    "create",
    "list_losses",
]


class _Loss(nn.Module):
    """Every loss takes ``ignore_index`` (−100 by default, as ``nn.CrossEntropyLoss``; None ignores no label)
    and (N, K, d1, ...) inputs; see :mod:`torchcal.functional.losses`."""

    _args: tuple[str, ...] = ()

    def __init__(self, reduction: str = "mean", ignore_index=L.IGNORE_INDEX):
        super().__init__()
        self.reduction = check_choice(reduction, "reduction", L.REDUCTIONS)
        self.ignore_index = check_ignore_index(ignore_index)

    def extra_repr(self) -> str:
        args = (*self._args, "reduction") + (() if self.ignore_index == L.IGNORE_INDEX else ("ignore_index",))
        return ", ".join(f"{a}={getattr(self, a)!r}" for a in args)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"


class CrossEntropyLoss(_Loss):
    """Cross entropy, with optional label smoothing ε (LS-ε)."""

    _args = ("label_smoothing",)

    def __init__(self, label_smoothing: float = 0.0, reduction: str = "mean", *, ignore_index=L.IGNORE_INDEX):
        super().__init__(reduction, ignore_index)
        self.label_smoothing = check_float(label_smoothing, "label_smoothing", low=0, high=1)

    def forward(self, logits, targets):
        return L.cross_entropy(
            logits,
            targets,
            label_smoothing=self.label_smoothing,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
        )


class BrierLoss(_Loss):
    """Σ_k (p_k − onehot_k)²."""

    def forward(self, logits, targets):
        return L.brier_loss(logits, targets, ignore_index=self.ignore_index, reduction=self.reduction)


class FocalLoss(_Loss):
    """Focal loss −(1 − p_t)^γ log p_t."""

    _args = ("gamma",)

    def __init__(self, gamma: float = 3.0, reduction: str = "mean", *, ignore_index=L.IGNORE_INDEX):
        super().__init__(reduction, ignore_index)
        self.gamma = check_float(gamma, "gamma", low=0)

    def forward(self, logits, targets):
        return L.focal_loss(
            logits, targets, self.gamma, ignore_index=self.ignore_index, reduction=self.reduction
        )


class InverseFocalLoss(FocalLoss):
    """Inverse focal loss −(1 + p_t)^γ log p_t."""

    def forward(self, logits, targets):
        return L.inverse_focal_loss(
            logits, targets, self.gamma, ignore_index=self.ignore_index, reduction=self.reduction
        )


class SampleDependentFocalLoss(_Loss):
    """FLSD: γ by detached p_t thresholds (FLSD-53 default; FLSD-532 = gammas (5, 3, 2), thresholds (0.2, 0.5))."""

    _args = ("gammas", "thresholds")

    def __init__(
        self, gammas=(5.0, 3.0), thresholds=(0.2,), reduction: str = "mean", *, ignore_index=L.IGNORE_INDEX
    ):
        super().__init__(reduction, ignore_index)
        gammas, thresholds = L._check_schedule(gammas, thresholds)
        self.gammas, self.thresholds = tuple(gammas), tuple(thresholds)

    def forward(self, logits, targets):
        return L.sample_dependent_focal_loss(
            logits,
            targets,
            self.gammas,
            self.thresholds,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
        )


class DualSampleDependentFocalLoss(SampleDependentFocalLoss):
    """DualFLSD: dual focal form with FLSD thresholds on the margin p_t − p_j."""

    def forward(self, logits, targets):
        return L.dual_sample_dependent_focal_loss(
            logits,
            targets,
            self.gammas,
            self.thresholds,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
        )


class DualFocalLoss(FocalLoss):
    """Dual focal loss −(1 − p_t + p_j)^γ log p_t."""

    def __init__(self, gamma: float = 5.0, reduction: str = "mean", *, ignore_index=L.IGNORE_INDEX):
        super().__init__(gamma, reduction, ignore_index=ignore_index)

    def forward(self, logits, targets):
        return L.dual_focal_loss(
            logits, targets, self.gamma, ignore_index=self.ignore_index, reduction=self.reduction
        )


class FocalCalibrationLoss(_Loss):
    """Focal calibration loss: focal(γ) + λ·‖p − y‖²."""

    _args = ("gamma", "lambda_")

    def __init__(
        self,
        gamma: float = 4.0,
        lambda_: float = 1.5,
        reduction: str = "mean",
        *,
        ignore_index=L.IGNORE_INDEX,
    ):
        super().__init__(reduction, ignore_index)
        self.gamma = check_float(gamma, "gamma", low=0)
        self.lambda_ = check_float(lambda_, "lambda_", low=0)

    def forward(self, logits, targets):
        return L.focal_calibration_loss(
            logits,
            targets,
            self.gamma,
            self.lambda_,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
        )


class MMCELoss(_Loss):
    """Cross entropy + λ·weighted MMCE of the batch (``normalization="code"`` for the released code's)."""

    _args = ("lambda_", "normalization")

    def __init__(
        self,
        lambda_: float = 2.0,
        normalization: str = "paper",
        reduction: str = "mean",
        *,
        ignore_index=L.IGNORE_INDEX,
    ):
        super().__init__(reduction, ignore_index)
        self.lambda_ = check_float(lambda_, "lambda_", low=0)
        self.normalization = check_choice(normalization, "normalization", {"paper", "code"})

    def forward(self, logits, targets):
        return L.mmce_loss(
            logits,
            targets,
            self.lambda_,
            normalization=self.normalization,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
        )


class ScheduledFocalLoss(_Loss):
    """Focal loss with γ by epoch (Mukhoti et al.'s FLS-531 / FLS-532): ``milestones`` are the epochs where
    the next γ starts. FLS-531: gammas (5, 3, 1), milestones (100, 250). Call :meth:`set_epoch` each epoch."""

    _args = ("gammas", "milestones")

    def __init__(
        self,
        gammas=(5.0, 3.0, 1.0),
        milestones=(100, 250),
        reduction: str = "mean",
        *,
        ignore_index=L.IGNORE_INDEX,
    ):
        super().__init__(reduction, ignore_index)
        gammas = tuple(check_float(g, "gammas", low=0) for g in gammas)
        milestones = tuple(check_positive_int(m, "milestones") for m in milestones)
        if len(gammas) != len(milestones) + 1 or list(milestones) != sorted(set(milestones)):
            raise ValueError("`gammas` needs one more entry than the strictly increasing `milestones`")
        self.gammas, self.milestones = gammas, milestones
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = check_positive_int(epoch, "epoch", minimum=0)

    @property
    def gamma(self) -> float:
        return self.gammas[sum(self.epoch >= m for m in self.milestones)]

    def forward(self, logits, targets):
        return L.focal_loss(
            logits, targets, self.gamma, ignore_index=self.ignore_index, reduction=self.reduction
        )

    def get_extra_state(self):
        return {"epoch": self.epoch}

    def set_extra_state(self, state):
        self.epoch = int(state["epoch"])


_FIXED = {
    "ce": lambda **kw: CrossEntropyLoss(**kw),
    "brier": lambda **kw: BrierLoss(**kw),
    "mmce": lambda **kw: MMCELoss(**kw),
    "flsd-53": lambda **kw: SampleDependentFocalLoss((5.0, 3.0), (0.2,), **kw),
    "flsd-532": lambda **kw: SampleDependentFocalLoss((5.0, 3.0, 2.0), (0.2, 0.5), **kw),
    "fls-531": lambda **kw: ScheduledFocalLoss((5.0, 3.0, 1.0), (100, 250), **kw),
    "fls-532": lambda **kw: ScheduledFocalLoss((5.0, 3.0, 2.0), (100, 250), **kw),
    "dfl": lambda **kw: DualFocalLoss(**kw),
    "dualflsd-53": lambda **kw: DualSampleDependentFocalLoss((5.0, 3.0), (0.2,), **kw),
    "fcl": lambda **kw: FocalCalibrationLoss(**kw),
    "adafocal": lambda **kw: AdaFocalLoss(**kw),
    "adadualfocal": lambda **kw: AdaFocalLoss(dual=True, **kw),
    "calfocal": lambda **kw: CalFocalLoss(**kw),
}
# parametrised names: fl-3, ifl-1, ls-0.05
_PATTERNS = {
    r"fl-(\d+(?:\.\d+)?)": lambda v, **kw: FocalLoss(float(v), **kw),
    r"ifl-(\d+(?:\.\d+)?)": lambda v, **kw: InverseFocalLoss(float(v), **kw),
    r"ls-(\d*\.?\d+)": lambda v, **kw: CrossEntropyLoss(label_smoothing=float(v), **kw),
}


def list_losses() -> list[str]:
    """Registered names (parametrised families shown with the papers' values: fl-1/2/3, ifl-1, ls-0.05)."""
    return sorted([*_FIXED, "fl-1", "fl-2", "fl-3", "ifl-1", "ls-0.05"])


def create(name: str, **kwargs) -> nn.Module:
    """A loss module by the papers' label: "ce", "ls-0.05", "brier", "mmce", "fl-3", "flsd-53", "flsd-532",
    "fls-531", "dfl", "dualflsd-53", "fcl", "adafocal", "adadualfocal", "calfocal", "ifl-1"; keyword
    arguments go to the constructor (e.g. ``reduction="sum"``)."""
    key = name.lower()
    if key in _FIXED:
        return _FIXED[key](**kwargs)
    for pattern, make in _PATTERNS.items():
        match = re.fullmatch(pattern, key)
        if match:
            return make(match.group(1), **kwargs)
    raise ValueError(f"unknown loss {name!r}; choose one of {list_losses()} (fl-<γ>, ls-<ε> take any value)")
