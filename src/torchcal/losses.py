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
from typing import cast

import torch
from torch import nn

from ._validation import check_bool, check_choice, check_float, check_positive_int
from .adafocal import AdaFocalLoss, CalFocalLoss
from .functional import binary as B
from .functional import fused_head as FH
from .functional import losses as L
from .functional import margin as M
from .functional._loss_inputs import check_ignore_index, check_label_smoothing, class_weight_buffer

__all__ = [
    "ACLSLoss",
    "ADAPTIVE_LOSSES",
    "AdaFocalLoss",
    "AvUCLoss",
    "BinaryBrierLoss",
    "BinaryCrossEntropyLoss",
    "BinaryDualFocalLoss",
    "BinaryFocalCalibrationLoss",
    "BinaryFocalLoss",
    "BrierLoss",
    "CALSLoss",
    "CalFocalLoss",
    "ConfidencePenaltyLoss",
    "CrossEntropyLoss",
    "DCALoss",
    "DualFocalLoss",
    "DualSampleDependentFocalLoss",
    "ESDLoss",
    "FocalCalibrationLoss",
    "FocalLoss",
    "FusedLinearLoss",
    "InverseFocalLoss",
    "KDEXELoss",
    "LogitMarginL1Loss",
    "MDCALoss",
    "ML1ACELoss",
    "MMCELoss",
    "MaxSupLoss",
    "Poly1CrossEntropyLoss",
    "SBECELoss",
    "SampleDependentFocalLoss",
    "ScheduledFocalLoss",
    "SoftAvUCLoss",
    "create",
    "list_losses",
    "loss_task",
]


class _Loss(nn.Module):
    """Every loss takes ``ignore_index`` (−100 by default, as ``nn.CrossEntropyLoss``; None ignores no label)
    and (N, K, d1, ...) inputs, class ``weight`` (K,) (a buffer, as ``nn.CrossEntropyLoss``'s) and
    ``label_smoothing`` where the loss is a function of the target distribution; a loss that cannot take one
    refuses it at construction (see :mod:`torchcal.functional.losses`, decision 96)."""

    _args: tuple[str, ...] = ()
    _smoothing_refusal: str | None = None  # why the loss refuses label smoothing (None: it takes it)

    def __init__(
        self, reduction: str = "mean", ignore_index=L.IGNORE_INDEX, weight=None, label_smoothing: float = 0.0
    ):
        super().__init__()
        self.reduction = check_choice(reduction, "reduction", L.REDUCTIONS)
        self.ignore_index = check_ignore_index(ignore_index)
        self.label_smoothing = check_label_smoothing(label_smoothing, self._smoothing_refusal)
        self.register_buffer("weight", class_weight_buffer(weight))

    def _options(self) -> dict:
        return {
            "weight": self.weight,
            "label_smoothing": self.label_smoothing,
            "ignore_index": self.ignore_index,
            "reduction": self.reduction,
        }

    def extra_repr(self) -> str:
        args = (*self._args, "reduction")
        if self.label_smoothing and "label_smoothing" not in args:
            args += ("label_smoothing",)
        if self.weight is not None:
            args += ("weight",)
        if self.ignore_index != L.IGNORE_INDEX:
            args += ("ignore_index",)
        return ", ".join(f"{a}={_short(getattr(self, a))}" for a in args)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"


def _short(value) -> str:
    return repr(value.tolist()) if isinstance(value, torch.Tensor) else repr(value)


class CrossEntropyLoss(_Loss):
    """Cross entropy, with optional label smoothing ε (LS-ε) and class weights (``nn.CrossEntropyLoss``)."""

    _args = ("label_smoothing",)

    def __init__(
        self,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        *,
        weight=None,
        ignore_index=L.IGNORE_INDEX,
    ):
        super().__init__(reduction, ignore_index, weight, label_smoothing)

    def forward(self, logits, targets):
        return L.cross_entropy(logits, targets, **self._options())


class BrierLoss(_Loss):
    """Σ_k (p_k − onehot_k)²."""

    def __init__(
        self,
        reduction: str = "mean",
        *,
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        super().__init__(reduction, ignore_index, weight, label_smoothing)

    def forward(self, logits, targets):
        return L.brier_loss(logits, targets, **self._options())


class FocalLoss(_Loss):
    """Focal loss −(1 − p_t)^γ log p_t."""

    _args = ("gamma",)

    def __init__(
        self,
        gamma: float = 3.0,
        reduction: str = "mean",
        *,
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        super().__init__(reduction, ignore_index, weight, label_smoothing)
        self.gamma = check_float(gamma, "gamma", low=0)

    def forward(self, logits, targets):
        return L.focal_loss(logits, targets, self.gamma, **self._options())


class InverseFocalLoss(FocalLoss):
    """Inverse focal loss −(1 + p_t)^γ log p_t."""

    def forward(self, logits, targets):
        return L.inverse_focal_loss(logits, targets, self.gamma, **self._options())


class SampleDependentFocalLoss(_Loss):
    """FLSD: γ by detached p_t thresholds (FLSD-53 default; FLSD-532 = gammas (5, 3, 2), thresholds (0.2, 0.5))."""

    _args = ("gammas", "thresholds")

    def __init__(
        self,
        gammas=(5.0, 3.0),
        thresholds=(0.2,),
        reduction: str = "mean",
        *,
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        super().__init__(reduction, ignore_index, weight, label_smoothing)
        gammas, thresholds = L._check_schedule(gammas, thresholds)
        self.gammas, self.thresholds = tuple(gammas), tuple(thresholds)

    def forward(self, logits, targets):
        return L.sample_dependent_focal_loss(logits, targets, self.gammas, self.thresholds, **self._options())


class DualSampleDependentFocalLoss(SampleDependentFocalLoss):
    """DualFLSD: dual focal form with FLSD thresholds on the margin p_t − p_j."""

    _smoothing_refusal = L._RUNNER_UP_NEEDS_LABELS

    def forward(self, logits, targets):
        return L.dual_sample_dependent_focal_loss(
            logits, targets, self.gammas, self.thresholds, **self._options()
        )


class DualFocalLoss(FocalLoss):
    """Dual focal loss −(1 − p_t + p_j)^γ log p_t; ``dual_logit`` picks the p_j of the paper's Table 4
    ablation (see :func:`torchcal.functional.dual_focal_loss`)."""

    _smoothing_refusal = L._RUNNER_UP_NEEDS_LABELS

    def __init__(
        self,
        gamma: float = 5.0,
        reduction: str = "mean",
        *,
        dual_logit: str | float = "largest",
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        dual_logit = L._check_dual_logit(dual_logit)
        super().__init__(
            gamma, reduction, weight=weight, label_smoothing=label_smoothing, ignore_index=ignore_index
        )
        self.dual_logit = dual_logit
        if dual_logit != "largest":
            self._args = ("gamma", "dual_logit")

    def forward(self, logits, targets):
        return L.dual_focal_loss(logits, targets, self.gamma, dual_logit=self.dual_logit, **self._options())


class FocalCalibrationLoss(_Loss):
    """Focal calibration loss: focal(γ) + λ·‖p − y‖² (``distance="l1"``: λ·‖p − y‖₁, the paper's A.15
    ablation, labels only)."""

    _args = ("gamma", "lambda_")

    def __init__(
        self,
        gamma: float = 4.0,
        lambda_: float = 1.5,
        reduction: str = "mean",
        *,
        distance: str = "l2",
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        check_choice(distance, "distance", L._FCL_DISTANCES)
        if distance == "l1":
            check_label_smoothing(label_smoothing, L._FCL_L1_NEEDS_LABELS)
        super().__init__(reduction, ignore_index, weight, label_smoothing)
        self.distance = distance
        if distance == "l1":
            self._args = ("gamma", "lambda_", "distance")
        self.gamma = check_float(gamma, "gamma", low=0)
        self.lambda_ = check_float(lambda_, "lambda_", low=0)

    def forward(self, logits, targets):
        return L.focal_calibration_loss(
            logits, targets, self.gamma, self.lambda_, distance=self.distance, **self._options()
        )


class MMCELoss(_Loss):
    """Cross entropy + λ·weighted MMCE of the batch, by default with the released code's normalisation (the
    one every published MMCE number used); ``normalization="paper"`` for the paper's single normalisation.
    Refuses class ``weight`` and ``label_smoothing`` (the penalty is a statistic of the whole batch)."""

    _args = ("lambda_", "normalization")

    def __init__(
        self,
        lambda_: float = 2.0,
        normalization: str = "code",
        reduction: str = "mean",
        *,
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        L.check_mmce_options(weight, label_smoothing)
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


class KDEXELoss(_Loss):
    """KDE-XE: cross entropy + λ·the batch's canonical L1 calibration error estimated with Dirichlet kernels
    (Popordanoska et al. 2022; Dual Focal appendix F), bandwidth by leave-one-out likelihood per batch
    (``"auto"``) or fixed. Refuses class ``weight`` and ``label_smoothing`` (the term belongs to the batch)."""

    _args = ("lambda_", "bandwidth")

    def __init__(
        self,
        lambda_: float = 1.0,
        bandwidth: float | str = "auto",
        reduction: str = "mean",
        *,
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        self_lambda, self_bandwidth = L.check_kde_xe_options(lambda_, bandwidth, weight, label_smoothing)
        super().__init__(reduction, ignore_index)
        self.lambda_, self.bandwidth = self_lambda, self_bandwidth

    def forward(self, logits, targets):
        return L.kde_xe_loss(
            logits,
            targets,
            self.lambda_,
            bandwidth=self.bandwidth,
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
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        super().__init__(reduction, ignore_index, weight, label_smoothing)
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
        return L.focal_loss(logits, targets, self.gamma, **self._options())

    def get_extra_state(self):
        return {"epoch": self.epoch}

    def set_extra_state(self, state):
        self.epoch = int(state["epoch"])


# -- margin and penalty losses (SPEC §8; torchcal.functional.margin) -------------------------------------------


class LogitMarginL1Loss(_Loss):
    """MbLS, margin-based label smoothing: CE + α·mean_{i,k} relu(max_j z_ij − z_ik − m) (the released code's
    N·K mean, decision 131). The released code's α schedule, applied at the end of each epoch: ``schedule``
    "add" (α + μ), "multiply" (α·μ), "step" (α·μ every ``step_size`` epochs), each capped at ``max_alpha``;
    "" (the default, every number of the paper) keeps α. The α in force is a function of the epoch
    (:func:`torchcal.functional.mbls_alpha`), so :meth:`set_epoch`, which the runner calls each epoch, also
    restores it on resume. Refuses class ``weight`` and ``label_smoothing``."""

    _args = ("margin", "alpha", "schedule")

    def __init__(
        self,
        margin: float = 10.0,
        alpha: float = 0.1,
        reduction: str = "mean",
        *,
        schedule: str = "",
        mu: float = 0.0,
        max_alpha: float = 100.0,
        step_size: int = 100,
        ignored_rows: str = "reference",
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        M._refuse_weight_and_smoothing("MbLS margin", weight, label_smoothing)
        super().__init__(reduction, ignore_index)
        self.margin = check_float(margin, "margin", low=0)
        self.alpha = check_float(alpha, "alpha", low=0)
        self.ignored_rows = check_choice(ignored_rows, "ignored_rows", {"reference", "drop"})
        self.schedule, self.mu, self.max_alpha, self.step_size = schedule, mu, max_alpha, step_size
        self.set_epoch(0)  # checks the schedule's arguments

    def set_epoch(self, epoch: int) -> None:
        """The α of ``epoch`` (0-based): the schedule's updates at the end of epochs 0 … epoch − 1."""
        self.epoch = check_positive_int(epoch, "epoch", minimum=0)
        self.current_alpha = M.mbls_alpha(
            self.alpha, self.epoch, self.schedule, self.mu, self.max_alpha, self.step_size
        )

    def forward(self, logits, targets):
        return M.logit_margin_l1_loss(
            logits,
            targets,
            self.margin,
            self.current_alpha,
            ignored_rows=self.ignored_rows,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
        )

    def get_extra_state(self):
        return {"epoch": self.epoch}

    def set_extra_state(self, state):
        self.set_epoch(int(state["epoch"]))


class ACLSLoss(_Loss):
    """ACLS: CE + α·(λ_pos·relu(z_max − m)² on the top logit + λ_neg·mean over the others of
    relu(sg(z_max) − z_k − m)²), as the released code (decision 138); its regulariser covers ignored rows
    by default (``ignored_rows="drop"`` for the contract). Refuses class ``weight`` and ``label_smoothing``."""

    _args = ("alpha", "margin", "lambda_pos", "lambda_neg")

    def __init__(
        self,
        alpha: float = 0.1,
        margin: float = 10.0,
        reduction: str = "mean",
        *,
        lambda_pos: float = 1.0,
        lambda_neg: float = 0.1,
        ignored_rows: str = "reference",
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        M._refuse_weight_and_smoothing("ACLS regulariser", weight, label_smoothing)
        super().__init__(reduction, ignore_index)
        self.alpha = check_float(alpha, "alpha", low=0)
        self.margin = check_float(margin, "margin", low=0)
        self.lambda_pos = check_float(lambda_pos, "lambda_pos", low=0)
        self.lambda_neg = check_float(lambda_neg, "lambda_neg", low=0)
        self.ignored_rows = check_choice(ignored_rows, "ignored_rows", {"reference", "drop"})

    def forward(self, logits, targets):
        return M.acls_loss(
            logits,
            targets,
            self.alpha,
            self.margin,
            lambda_pos=self.lambda_pos,
            lambda_neg=self.lambda_neg,
            ignored_rows=self.ignored_rows,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
        )


class Poly1CrossEntropyLoss(_Loss):
    """Poly-1: CE + ε(1 − p_t); against a (smoothed or soft) target distribution q, Σ_k q_k(−log p_k +
    ε(1 − p_k)). Takes class ``weight`` and ``label_smoothing``."""

    _args = ("epsilon",)

    def __init__(
        self,
        epsilon: float = 1.0,
        reduction: str = "mean",
        *,
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        super().__init__(reduction, ignore_index, weight, label_smoothing)
        self.epsilon = check_float(epsilon, "epsilon", low=-1)

    def forward(self, logits, targets):
        return M.poly1_cross_entropy(logits, targets, self.epsilon, **self._options())


class ConfidencePenaltyLoss(_Loss):
    """Confidence penalty: CE + β(log K − H(p)) per sample (torch-uncertainty's form, decision 134);
    ``form="mbls"`` for the MbLS baseline's N·K-averaged entropy. Refuses class ``weight`` and
    ``label_smoothing``."""

    _args = ("beta", "form")

    def __init__(
        self,
        beta: float = 1.0,
        reduction: str = "mean",
        *,
        eps: float = 1e-6,
        form: str = "sample",
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        M._refuse_weight_and_smoothing("confidence penalty", weight, label_smoothing)
        super().__init__(reduction, ignore_index)
        self.beta = check_float(beta, "beta", low=0)
        self.eps = check_float(eps, "eps", low=0)
        self.form = check_choice(form, "form", {"sample", "mbls"})

    def forward(self, logits, targets):
        return M.confidence_penalty_loss(
            logits,
            targets,
            self.beta,
            eps=self.eps,
            form=self.form,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
        )


class MaxSupLoss(_Loss):
    """MaxSup: CE + α_t(max_k z_k − mean_k z_k), with α_t rising linearly from ``alpha`` (0.1) at the first
    epoch to ``alpha_end`` (0.2) at the last, α_t = alpha + (alpha_end − alpha)·t/(epochs − 1) (the official
    ResNet ``train.py``, decision 135). The ramp needs the number of ``epochs``: the runner sets it from
    ``train.epochs`` (:meth:`set_total_epochs`) and calls :meth:`set_epoch`; until it is known, and with
    ``alpha_end=None`` (torch-uncertainty's constant α), α_t = alpha. Refuses ``label_smoothing`` (the
    official code trains without it) and class ``weight``."""

    _args = ("alpha", "alpha_end", "epochs")

    def __init__(
        self,
        alpha: float = 0.1,
        alpha_end: float | None = 0.2,
        reduction: str = "mean",
        *,
        epochs: int | None = None,
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        M._refuse_weight_and_smoothing("MaxSup", weight, label_smoothing)
        super().__init__(reduction, ignore_index)
        self.alpha = check_float(alpha, "alpha", low=0)
        self.alpha_end = None if alpha_end is None else check_float(alpha_end, "alpha_end", low=0)
        self.epochs = None
        if epochs is not None:
            self.set_total_epochs(epochs)
        self.epoch = 0

    def set_total_epochs(self, epochs: int) -> None:
        self.epochs = check_positive_int(epochs, "epochs")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = check_positive_int(epoch, "epoch", minimum=0)

    @property
    def spans_the_run(self) -> bool:
        """Whether α_t depends on the number of epochs (a ramp from ``alpha`` to a different
        ``alpha_end``): then a run's epochs are fixed once it has trained one."""
        return self.alpha_end is not None and self.alpha_end != self.alpha

    @property
    def current_alpha(self) -> float:
        if self.alpha_end is None or self.epochs is None or self.epochs < 2:
            return self.alpha
        t = min(self.epoch, self.epochs - 1)
        return self.alpha + (self.alpha_end - self.alpha) * t / (self.epochs - 1)

    def forward(self, logits, targets):
        return M.maxsup_loss(
            logits, targets, self.current_alpha, ignore_index=self.ignore_index, reduction=self.reduction
        )

    def get_extra_state(self):
        return {"epoch": self.epoch, "epochs": self.epochs}

    def set_extra_state(self, state):
        self.epoch = int(state["epoch"])
        self.epochs = None if state["epochs"] is None else int(state["epochs"])


class MDCALoss(_Loss):
    """A base loss + β·MDCA of the batch: ``base`` "nll" (default), "focal" (γ = ``gamma``) or "ls" (the MDCA
    repository's smoothing α = ``smoothing``, not PyTorch's). ``sync=True`` takes the MDCA term over the
    global batch under torch.distributed (the reference's is each rank's batch). Refuses class ``weight``
    and ``label_smoothing``."""

    _args = ("beta", "base")

    def __init__(
        self,
        beta: float = 1.0,
        base: str = "nll",
        reduction: str = "mean",
        *,
        gamma: float = 1.0,
        smoothing: float = 0.1,
        sync: bool = False,
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        if weight is not None:
            raise ValueError(f"`weight` is not accepted: {M._MDCA_IS_A_BATCH_TERM}")
        check_label_smoothing(label_smoothing, M._MDCA_IS_A_BATCH_TERM)
        super().__init__(reduction, ignore_index)
        self.beta = check_float(beta, "beta", low=0)
        self.base = check_choice(base, "base", set(M.MDCA_BASES))
        self.gamma = check_float(gamma, "gamma", low=0)
        self.smoothing = check_float(smoothing, "smoothing", low=0, high=1)
        self.sync = check_bool(sync, "sync")

    def extra_repr(self) -> str:
        extra = {"focal": f", gamma={self.gamma!r}", "ls": f", smoothing={self.smoothing!r}"}.get(
            self.base, ""
        )
        return super().extra_repr() + extra + (", sync=True" if self.sync else "")

    def forward(self, logits, targets):
        return M.mdca_loss(
            logits,
            targets,
            self.beta,
            base=self.base,
            gamma=self.gamma,
            smoothing=self.smoothing,
            sync=self.sync,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
        )


class DCALoss(_Loss):
    """Cross entropy + β·abs(mean confidence − accuracy) of the batch (β = 10, the official function's
    default). Class ``weight`` enters the cross entropy (as the official function); ``sync=True`` takes the
    batch term over the global batch under torch.distributed. Refuses ``label_smoothing``."""

    _args = ("beta",)

    def __init__(
        self,
        beta: float = 10.0,
        reduction: str = "mean",
        *,
        sync: bool = False,
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        check_label_smoothing(label_smoothing, M._DCA_NEEDS_LABELS)
        super().__init__(reduction, ignore_index, weight)
        self.beta = check_float(beta, "beta", low=0)
        self.sync = check_bool(sync, "sync")

    def extra_repr(self) -> str:
        return super().extra_repr() + (", sync=True" if self.sync else "")

    def forward(self, logits, targets):
        return M.dca_loss(
            logits,
            targets,
            self.beta,
            sync=self.sync,
            weight=self.weight,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
        )


class SBECELoss(_Loss):
    """Cross entropy + λ·soft-binned ECE of the batch (λ = 2, M = 15 bins, T = 0.01; label-binned form by
    default, ``form="binned"`` for the bin-weighted one). ``sync=True`` takes the term over the global batch
    under torch.distributed. Refuses class ``weight``, ``label_smoothing`` and soft targets."""

    _args = ("lambda_", "n_bins", "temperature", "form")

    def __init__(
        self,
        lambda_: float = 2.0,
        reduction: str = "mean",
        *,
        n_bins: int = 15,
        temperature: float = 0.01,
        form: str = "label",
        sync: bool = False,
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        if weight is not None:
            raise ValueError(f"`weight` is not accepted: {M._SBECE_IS_A_BATCH_TERM}")
        check_label_smoothing(label_smoothing, M._SBECE_IS_A_BATCH_TERM)
        super().__init__(reduction, ignore_index)
        self.lambda_ = check_float(lambda_, "lambda_", low=0)
        self.n_bins = check_positive_int(n_bins, "n_bins")
        self.temperature = check_float(temperature, "temperature", low=0, low_open=True)
        self.form = check_choice(form, "form", {"label", "binned"})
        self.sync = check_bool(sync, "sync")

    def extra_repr(self) -> str:
        return super().extra_repr() + (", sync=True" if self.sync else "")

    def forward(self, logits, targets):
        return M.sbece_loss(
            logits,
            targets,
            self.lambda_,
            n_bins=self.n_bins,
            temperature=self.temperature,
            form=self.form,
            sync=self.sync,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
        )


def _all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor``, summed over the ranks when torch.distributed is initialised."""
    import torch.distributed as dist

    tensor = tensor.clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


class AvUCLoss(_Loss):
    """Cross entropy + β·AvUC of the batch (β = 3, the released scripts') with the released code's threshold
    schedule: u_th (a buffer, 1.0 at the start) is set to ½(mean entropy of the correct predictions + mean
    entropy of the wrong ones) by :meth:`update` at the end of each of the first ``warmup_epochs`` epochs (6:
    epochs 0-5 of the CIFAR script), then frozen. :meth:`update` takes the validation logits (the CIFAR
    script's source); called without them (``metrics=`` only, as the runner and the Lightning callback do) it
    uses the training predictions this module saw since the last update (the ImageNet script's source),
    summed over the ranks under torch.distributed so that every rank holds the same u_th. The threshold, the
    sums and the number of updates are buffers: ``state_dict()`` restores them. ``sync=True`` takes the batch
    term over the global batch. Refuses class ``weight``, ``label_smoothing`` and soft targets."""

    # buffers (register_buffer)
    threshold: torch.Tensor
    entropy_sums: torch.Tensor
    updates: torch.Tensor

    _args = ("beta", "warmup_epochs")

    def __init__(
        self,
        beta: float = 3.0,
        reduction: str = "mean",
        *,
        threshold: float = 1.0,
        warmup_epochs: int = 6,
        sync: bool = False,
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        M._refuse_batch_term(M._AVUC_IS_A_BATCH_TERM, weight, label_smoothing)
        super().__init__(reduction, ignore_index)
        self.beta = check_float(beta, "beta", low=0)
        self.warmup_epochs = check_positive_int(warmup_epochs, "warmup_epochs", minimum=0)
        self.sync = check_bool(sync, "sync")
        self.register_buffer(
            "threshold", torch.tensor(check_float(threshold, "threshold", low=0), dtype=torch.float64)
        )
        # Σ H and the count of the correct, then of the wrong training predictions since the last update
        self.register_buffer("entropy_sums", torch.zeros(4, dtype=torch.float64))
        self.register_buffer("updates", torch.zeros((), dtype=torch.long))

    def extra_repr(self) -> str:
        return (
            super().extra_repr()
            + f", threshold={float(self.threshold):.4g}"
            + (", sync=True" if self.sync else "")
        )

    def forward(self, logits, targets):
        accumulate = torch.is_grad_enabled() and self._warming_up()
        out = M.avuc_loss(
            logits,
            targets,
            self.beta,
            threshold=self.threshold,
            sync=self.sync,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            statistics=accumulate,
        )
        if not accumulate:
            return out
        loss, sums = out
        assert sums is not None  # asked for: statistics=True
        self.entropy_sums.add_(sums)
        return loss

    def _warming_up(self) -> bool:
        if torch.compiler.is_compiling():  # (the count is a tensor; accumulating after warm-up is harmless)
            return True
        return int(self.updates) < self.warmup_epochs

    @torch.no_grad()
    def update(self, logits=None, targets=None, *, metrics=None, from_logits: bool = True) -> None:
        """The end of an epoch: during the warm-up, u_th ← ½(mean H of the correct + mean H of the wrong
        predictions) of ``logits``/``targets`` (validation; ``from_logits=False`` for probabilities) or, when
        none are given, of the training predictions accumulated since the last update. ``metrics`` (the
        runner's validation metrics) is accepted and not used: it holds no entropies. A u_th with no correct
        or no wrong prediction to average is left as it is."""
        del metrics
        if logits is not None:
            if targets is None:
                raise ValueError("update(logits, targets): `targets` is missing")
            z = torch.as_tensor(logits)
            if not from_logits:
                z = z.double().clamp(min=1e-300).log()
            sums = _entropy_sums(z, torch.as_tensor(targets), self.ignore_index).to(self.entropy_sums)
        else:
            sums = _all_reduce_sum(self.entropy_sums)
        if int(self.updates) < self.warmup_epochs and sums[1] > 0 and sums[3] > 0:
            self.threshold.fill_(float(0.5 * (sums[0] / sums[1] + sums[2] / sums[3])))
        self.updates.add_(1)
        self.entropy_sums.zero_()


def _entropy_sums(logits, targets, ignore_index):
    """(Σ H over the correct predictions, their count, Σ H over the wrong ones, their count), detached, with
    AvUC's entropy H = −Σ p log(p + 1e-10)."""
    # (detached rather than under no_grad: a no_grad region splits a torch.compile graph)
    rows = M.loss_rows(logits.detach(), targets, ignore_index, soft_refusal=M._AVUC_NEEDS_LABELS)
    p = torch.softmax(rows.logits.double(), 1)
    entropy = -(p * torch.log(p + 1e-10)).sum(1)
    correct = (p.argmax(1) == rows.targets).double()
    kept = p.new_ones(p.shape[0]) if rows.keep is None else rows.keep.double()
    wrong = (1 - correct) * kept
    correct = correct * kept
    return torch.stack([(entropy * correct).sum(), correct.sum(), (entropy * wrong).sum(), wrong.sum()])


class SoftAvUCLoss(_Loss):
    """Cross entropy + β·S-AvUC of the batch (soft AvUC, Karandikar et al. 2021). ``temperature`` T and
    ``kappa`` κ have no published value (the reference code has no defaults; the functional form requires
    them): the module's T = 0.1 and κ = 0.5 (the midpoint of the normalised entropy) are torchcal's choice so
    that the registry name trains as it is, not a reproduction (decision 167); set both for a study.
    ``sync=True`` takes the term over the global batch. Refuses class ``weight``, ``label_smoothing`` and soft
    targets."""

    _args = ("beta", "temperature", "kappa")

    def __init__(
        self,
        beta: float = 1.0,
        reduction: str = "mean",
        *,
        temperature: float = 0.1,
        kappa: float = 0.5,
        sync: bool = False,
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        M._refuse_batch_term(M._AVUC_IS_A_BATCH_TERM.replace("AvUC", "S-AvUC"), weight, label_smoothing)
        super().__init__(reduction, ignore_index)
        self.beta = check_float(beta, "beta", low=0)
        self.temperature = check_float(temperature, "temperature", low=0, low_open=True)
        self.kappa = M._kappa(kappa)
        self.sync = check_bool(sync, "sync")

    def extra_repr(self) -> str:
        return super().extra_repr() + (", sync=True" if self.sync else "")

    def forward(self, logits, targets):
        return M.soft_avuc_loss(
            logits,
            targets,
            self.beta,
            temperature=self.temperature,
            kappa=self.kappa,
            sync=self.sync,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
        )


class ESDLoss(_Loss):
    """Cross entropy + λ·sqrt(relu(ESD)) (λ = 4, the released ImageNet-100 script's). ``holdout`` h: the last
    ceil(h·N) samples of each batch form the calibration part (ESD only, no cross entropy; decision 166); 0
    (default) computes both terms on the whole batch. ``sync=True`` takes ESD over the global batch. Refuses
    class ``weight``, ``label_smoothing`` and soft targets."""

    _args = ("lambda_", "holdout")

    def __init__(
        self,
        lambda_: float = 4.0,
        reduction: str = "mean",
        *,
        holdout: float = 0.0,
        sync: bool = False,
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        M._refuse_batch_term(M._ESD_IS_A_BATCH_TERM, weight, label_smoothing)
        super().__init__(reduction, ignore_index)
        self.lambda_ = check_float(lambda_, "lambda_", low=0)
        self.holdout = check_float(holdout, "holdout", low=0, high=1)
        self.sync = check_bool(sync, "sync")

    def extra_repr(self) -> str:
        return super().extra_repr() + (", sync=True" if self.sync else "")

    def forward(self, logits, targets):
        return M.esd_loss(
            logits,
            targets,
            self.lambda_,
            holdout=self.holdout,
            sync=self.sync,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
        )


class ML1ACELoss(_Loss):
    """Cross entropy + λ·mL1-ACE, the marginal L1 average calibration error per image and class (hard bins by
    default, ``binning="soft"`` for soft bins; M = 20 bins). ``multilabel=True`` for sigmoid outputs (binary
    cross entropy; the ``binary-`` registry names). Refuses class ``weight`` and ``label_smoothing``."""

    _args = ("lambda_", "binning", "n_bins")

    def __init__(
        self,
        lambda_: float = 1.0,
        binning: str = "hard",
        reduction: str = "mean",
        *,
        n_bins: int = 20,
        empty_weight: float = 0.01,
        multilabel: bool = False,
        per_image=None,
        include_background: bool = True,
        ignore_empty_classes: bool = True,
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        M._refuse_batch_term(M._ACE_IS_PER_IMAGE, weight, label_smoothing)
        super().__init__(reduction, ignore_index)
        self.lambda_ = check_float(lambda_, "lambda_", low=0)
        options = M._check_ace_options(
            n_bins, binning, empty_weight, include_background, ignore_empty_classes
        )
        self.n_bins, self.binning, self.empty_weight, self.include_background, self.ignore_empty_classes = (
            options
        )
        self.multilabel = check_bool(multilabel, "multilabel")
        if per_image is not None:
            per_image = check_bool(per_image, "per_image")
        self.per_image = per_image

    def extra_repr(self) -> str:
        return super().extra_repr() + (", multilabel=True" if self.multilabel else "")

    def forward(self, logits, targets):
        return M.ml1ace_loss(
            logits,
            targets,
            self.lambda_,
            n_bins=self.n_bins,
            binning=self.binning,
            empty_weight=self.empty_weight,
            multilabel=self.multilabel,
            per_image=self.per_image,
            include_background=self.include_background,
            ignore_empty_classes=self.ignore_empty_classes,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
        )


class CALSLoss(_Loss):
    """CALS, class-adaptive label smoothing (Liu et al. 2023): CE + mean_{i,k} P(h_ik; λ_k, ρ_k), the PHR
    penalty of the logit-distance constraints (:func:`torchcal.functional.cals_loss`), with the released
    code's augmented-Lagrangian updates of the per-class multipliers λ and penalty parameters ρ.

    State (buffers, so ``state_dict()`` and a checkpoint restore it): λ (K,) starting at ``lambda_min`` =
    1e-6, ρ (K,) starting at ``rho_min`` = 1, the previous constraint means, the update count and the sums of
    the current epoch. The K buffers are sized on the first call when ``num_classes`` is not given.

    :meth:`update` (the end of an epoch) sets λ_k ← clamp(mean_i clamp(max(0, λ_k + ρ_k h_ik), λ_min, λ_max),
    λ_min, λ_max), with the λ and ρ in force, and c_k = mean_i h_ik; every ``rho_step`` updates (10) and once
    a previous c exists, ρ_k ← clamp(γρ_k, ρ_min, ρ_max) where c_k > τ·max(c_prev_k, 0) (γ = 1.2, τ = 0.9,
    ρ_max = 10); c_prev ← c. The means run over the validation logits passed to :meth:`update` (the released
    code's source, which the Hugging Face trainer passes) or, when none are given (``metrics=`` only, as the
    runner and the Lightning callback call it), over the training positions this module saw since the last
    update, summed over the ranks under torch.distributed so that every rank holds the same λ and ρ
    (decision 168). The penalty covers the positions labelled ``ignore_index`` as the released code
    (``ignored_rows="drop"`` for the contract); the statistics leave them out. Margin m = 10 (the README's
    commands; the YAML default 20 is overridden there). Refuses class ``weight`` and ``label_smoothing``."""

    # buffers (register_buffer)
    lambdas: torch.Tensor
    rhos: torch.Tensor
    previous_constraint: torch.Tensor
    statistics: torch.Tensor
    updates: torch.Tensor

    _args = ("margin",)

    def __init__(
        self,
        margin: float = 10.0,
        reduction: str = "mean",
        *,
        num_classes: int | None = None,
        normalize: bool = True,
        lambda_min: float = 1e-6,
        lambda_max: float = 1e6,
        rho_min: float = 1.0,
        rho_max: float = 10.0,
        gamma: float = 1.2,
        tau: float = 0.9,
        rho_step: int = 10,
        ignored_rows: str = "reference",
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
    ):
        if weight is not None:
            raise ValueError(f"`weight` is not accepted: {M._CALS_PENALTY_IS_NOT_PER_CLASS}")
        check_label_smoothing(label_smoothing, M._CALS_PENALTY_IS_NOT_PER_CLASS)
        super().__init__(reduction, ignore_index)
        self.margin = check_float(margin, "margin", low=0, low_open=True)
        self.normalize = check_bool(normalize, "normalize")
        self.lambda_min = check_float(lambda_min, "lambda_min", low=0)
        self.lambda_max = check_float(lambda_max, "lambda_max", low=self.lambda_min)
        self.rho_min = check_float(rho_min, "rho_min", low=0, low_open=True)
        self.rho_max = check_float(rho_max, "rho_max", low=self.rho_min)
        self.gamma = check_float(gamma, "gamma", low=0)
        self.tau = check_float(tau, "tau")
        self.rho_step = check_positive_int(rho_step, "rho_step")
        self.ignored_rows = check_choice(ignored_rows, "ignored_rows", {"reference", "drop"})
        k = 0 if num_classes is None else check_positive_int(num_classes, "num_classes")
        self.register_buffer("lambdas", torch.full((k,), self.lambda_min, dtype=torch.float64))
        self.register_buffer("rhos", torch.full((k,), self.rho_min, dtype=torch.float64))
        self.register_buffer("previous_constraint", torch.full((k,), torch.nan, dtype=torch.float64))
        self.register_buffer("statistics", torch.zeros(2 * k + 1, dtype=torch.float64))
        self.register_buffer("updates", torch.zeros((), dtype=torch.long))

    def _size(self, k: int) -> None:
        """Sizes the per-class buffers for K classes on first use; a different K later is an error."""
        lambdas = self._buffers["lambdas"]
        if lambdas is not None and lambdas.numel() == k:
            return
        if self.lambdas.numel():
            raise ValueError(
                f"CALSLoss holds multipliers for {self.lambdas.numel()} classes, got logits with {k}"
            )
        device = self.lambdas.device
        self.lambdas = torch.full((k,), self.lambda_min, dtype=torch.float64, device=device)
        self.rhos = torch.full((k,), self.rho_min, dtype=torch.float64, device=device)
        self.previous_constraint = torch.full((k,), torch.nan, dtype=torch.float64, device=device)
        self.statistics = torch.zeros(2 * k + 1, dtype=torch.float64, device=device)

    def forward(self, logits, targets):
        self._size(logits.shape[1])
        # (read once from the dict: nn.Module's attribute fallback costs ~1.5 µs a read)
        buffers = self._buffers
        lambdas, rhos, sums_buffer = buffers["lambdas"], buffers["rhos"], buffers["statistics"]
        assert lambdas is not None and rhos is not None and sums_buffer is not None  # (registered in __init__)
        training = torch.is_grad_enabled()
        out = M.cals_loss(
            logits,
            targets,
            lambdas,
            rhos,
            self.margin,
            normalize=self.normalize,
            ignored_rows=self.ignored_rows,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            statistics=(self.lambda_min, self.lambda_max) if training else None,
        )
        if not training:
            return out
        loss, sums = out
        assert sums is not None  # asked for: the statistics' clamp range
        sums_buffer.add_(sums)
        return loss

    def _statistics(self, logits, targets):
        return M.cals_statistics(
            logits, targets, self.lambdas, self.rhos, self.margin, normalize=self.normalize,
            lambda_min=self.lambda_min, lambda_max=self.lambda_max, ignore_index=self.ignore_index,
        )  # fmt: skip

    @torch.no_grad()
    def update(self, logits=None, targets=None, *, metrics=None, from_logits: bool = True) -> None:
        """One multiplier update (the end of an epoch) from the validation ``logits`` (N, K) or (N, K, d1, ...)
        (``targets`` optional: positions labelled ``ignore_index`` are left out) or, without them, from the
        training positions accumulated since the last update. ``metrics`` is accepted and not used (it holds
        no logits). Without logits and with nothing accumulated, nothing changes."""
        del metrics
        if not from_logits:
            raise ValueError(
                "CALSLoss.update needs logits (from_logits=True): the constraints are on the logits"
            )
        if logits is not None:
            z = torch.as_tensor(logits)
            self._size(z.shape[1])
            sums = self._statistics(z, None if targets is None else torch.as_tensor(targets))
        else:
            sums = _all_reduce_sum(self.statistics)
        bad = ~torch.isfinite(sums)
        if bool(bad.any()):  # (before any state changes: λ, ρ and the accumulated sums stay as they were)
            k = sums.numel() // 2
            i = int(bad.nonzero()[0, 0])
            where = "the position count" if i == 2 * k else f"class {i % k}"
            raise ValueError(
                f"CALSLoss.update: the statistics of {where} are not finite (NaN or infinite logits); "
                "the multipliers were not updated"
            )
        self.statistics.zero_()
        sums = sums.to(self.lambdas)
        k = self.lambdas.numel()
        count = sums[-1]
        if k == 0 or count <= 0:
            return
        self.lambdas.copy_((sums[:k] / count).clamp(self.lambda_min, self.lambda_max))
        constraint = sums[k : 2 * k] / count
        self.updates.add_(1)
        if int(self.updates) % self.rho_step == 0 and not torch.isnan(self.previous_constraint).any():
            grow = constraint > self.tau * self.previous_constraint.clamp(min=0)
            self.rhos.copy_(
                torch.where(grow, self.gamma * self.rhos, self.rhos).clamp(self.rho_min, self.rho_max)
            )
        self.previous_constraint.copy_(constraint)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # the per-class buffers may still be unsized (num_classes not given): size them to the saved ones
        key = prefix + "lambdas"
        if key in state_dict and state_dict[key].numel() != self.lambdas.numel() and not self.lambdas.numel():
            self._size(state_dict[key].numel())
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


# losses with an ``update`` hook that the integrations call after each validation pass
ADAPTIVE_LOSSES = (AdaFocalLoss, CalFocalLoss, AvUCLoss, CALSLoss)


# -- sigmoid outputs (binary / multi-label; SPEC §6) ---------------------------------------------------------


class _BinaryLoss(nn.Module):
    """Base of the sigmoid losses: ``reduction`` and an optional ``pos_weight`` (L,) kept as a buffer (it
    follows ``.to(device)``)."""

    _args: tuple[str, ...] = ()

    def __init__(self, reduction: str = "mean", pos_weight=None):
        super().__init__()
        self.reduction = check_choice(reduction, "reduction", L.REDUCTIONS)
        self.register_buffer(
            "pos_weight", None if pos_weight is None else torch.as_tensor(pos_weight).double()
        )

    def extra_repr(self) -> str:
        args = (*self._args, "reduction") + (() if self.pos_weight is None else ("pos_weight",))
        return ", ".join(f"{a}={getattr(self, a)!r}" for a in args)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"


class BinaryCrossEntropyLoss(_BinaryLoss):
    """Binary cross entropy from logits, with optional label smoothing y ← y(1 − ε) + ε/2."""

    _args = ("label_smoothing",)

    def __init__(self, label_smoothing: float = 0.0, reduction: str = "mean", *, pos_weight=None):
        super().__init__(reduction, pos_weight)
        self.label_smoothing = check_float(label_smoothing, "label_smoothing", low=0, high=1)

    def forward(self, logits, targets):
        return B.binary_cross_entropy(
            logits, targets, pos_weight=self.pos_weight, label_smoothing=self.label_smoothing,
            reduction=self.reduction,
        )  # fmt: skip


class BinaryFocalLoss(_BinaryLoss):
    """Sigmoid focal loss −y(1 − p)^γ log p − (1 − y)p^γ log(1 − p), optional α-balancing."""

    _args = ("gamma", "alpha")

    def __init__(self, gamma: float = 2.0, alpha=None, reduction: str = "mean", *, pos_weight=None):
        super().__init__(reduction, pos_weight)
        self.gamma = check_float(gamma, "gamma", low=0)
        self.alpha = None if alpha is None else check_float(alpha, "alpha", low=0, high=1)

    def forward(self, logits, targets):
        return B.binary_focal_loss(
            logits,
            targets,
            self.gamma,
            alpha=self.alpha,
            pos_weight=self.pos_weight,
            reduction=self.reduction,
        )


class BinaryFocalCalibrationLoss(_BinaryLoss):
    """Binary focal(γ) + λ·(p − y)² per label (FCL for multi-label outputs)."""

    _args = ("gamma", "lambda_")

    def __init__(self, gamma: float = 4.0, lambda_: float = 1.5, reduction: str = "mean", *, pos_weight=None):
        super().__init__(reduction, pos_weight)
        self.gamma = check_float(gamma, "gamma", low=0)
        self.lambda_ = check_float(lambda_, "lambda_", low=0)

    def forward(self, logits, targets):
        return B.binary_focal_calibration_loss(
            logits, targets, self.gamma, self.lambda_, pos_weight=self.pos_weight, reduction=self.reduction
        )


class BinaryBrierLoss(_BinaryLoss):
    """(σ(z) − y)² per label."""

    def __init__(self, reduction: str = "mean"):
        super().__init__(reduction)

    def forward(self, logits, targets):
        return B.binary_brier_loss(logits, targets, reduction=self.reduction)


class BinaryDualFocalLoss(_BinaryLoss):
    """Dual focal loss per label as the two-class problem [0, z] (decision 78)."""

    _args = ("gamma",)

    def __init__(self, gamma: float = 5.0, reduction: str = "mean"):
        super().__init__(reduction)
        self.gamma = check_float(gamma, "gamma", low=0)

    def forward(self, logits, targets):
        return B.binary_dual_focal_loss(logits, targets, self.gamma, reduction=self.reduction)


_MULTILABEL = {
    "bce": lambda **kw: BinaryCrossEntropyLoss(**kw),
    "binary-brier": lambda **kw: BinaryBrierLoss(**kw),
    "binary-fcl": lambda **kw: BinaryFocalCalibrationLoss(**kw),
    "binary-dfl": lambda **kw: BinaryDualFocalLoss(**kw),
    "binary-hl1-ace": lambda **kw: ML1ACELoss(binning="hard", multilabel=True, **kw),
    "binary-sl1-ace": lambda **kw: ML1ACELoss(binning="soft", multilabel=True, **kw),
}
# parametrised names: (the argument the number fixes, the class that takes any value, the factory)
_MULTILABEL_PATTERNS = {
    r"binary-fl-(\d+(?:\.\d+)?)": ("gamma", "BinaryFocalLoss", lambda v, **kw: BinaryFocalLoss(float(v), **kw)),
    r"binary-ls-(\d*\.?\d+)": ("label_smoothing", "BinaryCrossEntropyLoss",
                                lambda v, **kw: BinaryCrossEntropyLoss(label_smoothing=float(v), **kw)),
}  # fmt: skip

_FIXED = {
    "ce": lambda **kw: CrossEntropyLoss(**kw),
    "brier": lambda **kw: BrierLoss(**kw),
    "mmce": lambda **kw: MMCELoss(**kw),
    "kde-xe": lambda **kw: KDEXELoss(**kw),
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
    "mbls": lambda **kw: LogitMarginL1Loss(**kw),
    "acls": lambda **kw: ACLSLoss(**kw),
    "poly1": lambda **kw: Poly1CrossEntropyLoss(**kw),
    "confidence-penalty": lambda **kw: ConfidencePenaltyLoss(**kw),
    "maxsup": lambda **kw: MaxSupLoss(**kw),
    "mdca": lambda **kw: MDCALoss(**kw),
    "focal-mdca": lambda **kw: MDCALoss(base="focal", **kw),
    "ls-mdca": lambda **kw: MDCALoss(base="ls", **kw),
    "dca": lambda **kw: DCALoss(**kw),
    "sb-ece": lambda **kw: SBECELoss(**kw),
    "avuc": lambda **kw: AvUCLoss(**kw),
    "s-avuc": lambda **kw: SoftAvUCLoss(**kw),
    "esd": lambda **kw: ESDLoss(**kw),
    "hl1-ace": lambda **kw: ML1ACELoss(binning="hard", **kw),
    "sl1-ace": lambda **kw: ML1ACELoss(binning="soft", **kw),
    "cals": lambda **kw: CALSLoss(**kw),
}
# the constructor arguments a fixed name sets, with their values and the class that takes any
_FIXED_ARGS = {
    "flsd-53": {"gammas": (5, 3), "thresholds": (0.2,), "class": "SampleDependentFocalLoss"},
    "flsd-532": {"gammas": (5, 3, 2), "thresholds": (0.2, 0.5), "class": "SampleDependentFocalLoss"},
    "dualflsd-53": {"gammas": (5, 3), "thresholds": (0.2,), "class": "DualSampleDependentFocalLoss"},
    "fls-531": {"gammas": (5, 3, 1), "milestones": (100, 250), "class": "ScheduledFocalLoss"},
    "fls-532": {"gammas": (5, 3, 2), "milestones": (100, 250), "class": "ScheduledFocalLoss"},
    "adadualfocal": {"dual": True, "class": "AdaFocalLoss"},
    "focal-mdca": {"base": "focal", "class": "MDCALoss"},
    "ls-mdca": {"base": "ls", "class": "MDCALoss"},
    "hl1-ace": {"binning": "hard", "multilabel": False, "class": "ML1ACELoss"},
    "sl1-ace": {"binning": "soft", "multilabel": False, "class": "ML1ACELoss"},
    "binary-hl1-ace": {"binning": "hard", "multilabel": True, "class": "ML1ACELoss"},
    "binary-sl1-ace": {"binning": "soft", "multilabel": True, "class": "ML1ACELoss"},
}
# parametrised names (fl-3, ifl-1, ls-0.05): (the argument the number fixes, the class that takes any value,
# the factory)
_PATTERNS = {
    r"fl-(\d+(?:\.\d+)?)": ("gamma", "FocalLoss", lambda v, **kw: FocalLoss(float(v), **kw)),
    r"ifl-(\d+(?:\.\d+)?)": ("gamma", "InverseFocalLoss", lambda v, **kw: InverseFocalLoss(float(v), **kw)),
    r"ls-(\d*\.?\d+)": ("label_smoothing", "CrossEntropyLoss",
                         lambda v, **kw: CrossEntropyLoss(label_smoothing=float(v), **kw)),
}  # fmt: skip


def list_losses(task: str = "multiclass") -> list[str]:
    """Registered names for softmax outputs (``task="multiclass"``; parametrised families shown with the
    papers' values: fl-1/2/3, ifl-1, ls-0.05) or for sigmoid outputs (``"multilabel"``: bce, binary-fl-2,
    binary-ls-0.05, binary-fcl, binary-brier, binary-dfl, binary-hl1-ace, binary-sl1-ace)."""
    check_choice(task, "task", {"multiclass", "multilabel"})
    if task == "multilabel":
        return sorted([*_MULTILABEL, "binary-fl-2", "binary-ls-0.05"])
    return sorted([*_FIXED, "fl-1", "fl-2", "fl-3", "ifl-1", "ls-0.05"])


def loss_task(name: str) -> str:
    """ "multilabel" for the sigmoid losses' names, "multiclass" otherwise."""
    key = name.lower()
    patterns = _MULTILABEL_PATTERNS
    return "multilabel" if key in _MULTILABEL or any(re.fullmatch(p, key) for p in patterns) else "multiclass"


def create(name: str, **kwargs) -> nn.Module:
    """A loss module by the papers' label: "ce", "ls-0.05", "brier", "mmce", "fl-3", "flsd-53", "flsd-532",
    "fls-531", "dfl", "dualflsd-53", "fcl", "adafocal", "adadualfocal", "calfocal", "ifl-1", and the margin
    and penalty losses "mbls", "acls", "poly1", "confidence-penalty", "maxsup", "mdca" (NLL+MDCA), "focal-mdca"
    (γ = 1), "ls-mdca" (α = 0.1), "dca", "sb-ece", "avuc", "s-avuc" (T = 0.1, κ = 0.5: no published value),
    "esd", "hl1-ace" / "sl1-ace" (mL1-ACE, hard / soft bins), "cals" (SPEC §8); keyword
    arguments go to the constructor (e.g. ``reduction="sum"``). An argument the name fixes (γ of ``fl-3``,
    ε of ``ls-0.05``, the schedule of ``flsd-53``) is a ``ValueError`` naming the loss to use instead.

    Example:
        >>> create("fl-2", reduction="sum").gamma
        2.0
        >>> create("fl-3", gamma=2)
        Traceback (most recent call last):
        ...
        ValueError: loss 'fl-3' fixes gamma = 3 (the number in its name); for gamma = 2 name it 'fl-2' (fl-<γ> takes any value) or use torchcal.losses.FocalLoss(gamma=2)
    """
    key = name.lower()
    if key in _FIXED or key in _MULTILABEL:
        fixed = sorted(set(_FIXED_ARGS.get(key, ())) & set(kwargs))
        if fixed:
            cls, values = _FIXED_ARGS[key]["class"], _FIXED_ARGS[key]
            shown = ", ".join(f"{k} = {values[k]}" for k in _FIXED_ARGS[key] if k != "class")
            raise ValueError(
                f"loss {name!r} is {cls} with {shown}, so {', '.join(fixed)} cannot be passed; for other "
                f"values use torchcal.losses.{cls}({', '.join(f'{k}=...' for k in fixed)})"
            )
        return (_FIXED if key in _FIXED else _MULTILABEL)[key](**kwargs)
    for pattern, (param, cls, make) in (*_PATTERNS.items(), *_MULTILABEL_PATTERNS.items()):
        match = re.fullmatch(pattern, key)
        if match:
            if param in kwargs:
                value, family = kwargs[param], pattern.split("(")[0]
                symbol = "ε" if param == "label_smoothing" else "γ"
                raise ValueError(
                    f"loss {name!r} fixes {param} = {match.group(1)} (the number in its name); for {param} = "
                    f"{value} name it '{family}{value}' ({family}<{symbol}> takes any value) or use "
                    f"torchcal.losses.{cls}({param}={value})"
                )
            return make(match.group(1), **kwargs)
    raise ValueError(
        f"unknown loss {name!r}; choose one of {list_losses()} or, for sigmoid outputs, "
        f"{list_losses('multilabel')} (fl-<γ>, ls-<ε>, binary-fl-<γ>, binary-ls-<ε> take any value)"
    )


# -- the fused linear head + loss (language-model vocabularies) ----------------------------------------------


def _fused_form(loss: nn.Module) -> tuple[str, dict]:
    """The :func:`~torchcal.functional.fused_linear_loss` name and keyword arguments of a loss module (its
    class ``weight`` included), read at each call (so AdaFocal's updates, a scheduled γ and changed
    hyper-parameters take effect). Label smoothing is fused for cross entropy only: any other loss with
    ``label_smoothing`` > 0 is a ``ValueError``."""
    name, kwargs = _fused_name_and_args(loss)
    smoothing = getattr(loss, "label_smoothing", 0.0)
    if smoothing and name != "cross_entropy":
        raise ValueError(
            f"{type(loss).__name__} with label_smoothing={smoothing} has no fused form: the fused head "
            "smooths the labels of cross entropy only; use label_smoothing=0 or the unfused loss"
        )
    kwargs["class_weight"] = getattr(loss, "weight", None)
    return name, kwargs


def _fused_name_and_args(loss: nn.Module) -> tuple[str, dict]:
    kind = type(loss)
    if kind is CrossEntropyLoss:
        return "cross_entropy", {"label_smoothing": loss.label_smoothing}
    if kind is BrierLoss:
        return "brier", {}
    if kind is FocalLoss or kind is ScheduledFocalLoss:
        return "focal", {"gamma": loss.gamma}
    if kind is InverseFocalLoss:
        return "inverse_focal", {"gamma": loss.gamma}
    if kind is DualFocalLoss:
        if loss.dual_logit != "largest":
            raise TypeError(
                f"DualFocalLoss with dual_logit={loss.dual_logit!r} has no fused form: the fused head computes "
                "the dual focal loss with the largest probability below p_t (dual_logit='largest')"
            )
        return "dual_focal", {"gamma": loss.gamma}
    if kind is SampleDependentFocalLoss or kind is DualSampleDependentFocalLoss:
        name = "sample_dependent_focal" if kind is SampleDependentFocalLoss else "dual_sample_dependent_focal"
        return name, {"gammas": loss.gammas, "thresholds": loss.thresholds}
    if kind is FocalCalibrationLoss:
        if loss.distance != "l2":
            raise TypeError(
                f"FocalCalibrationLoss with distance={loss.distance!r} has no fused form: the fused head "
                "computes the squared-error term (distance='l2')"
            )
        return "focal_calibration", {"gamma": loss.gamma, "lambda_": loss.lambda_}
    if kind is AdaFocalLoss:
        return "adafocal", {"bin_edges": loss.bin_edges, "bin_gammas": loss.gamma_per_bin, "dual": loss.dual}
    raise TypeError(
        f"{kind.__name__} has no fused form: FusedLinearLoss takes cross entropy (and label smoothing), Brier, "
        "focal, inverse focal, FLSD, FLS, dual focal, DualFLSD, FCL and AdaFocal (MMCE's term belongs to the "
        "whole batch, CalFocal and the sigmoid losses are not fused)"
    )


class FusedLinearLoss(nn.Module):
    """A loss of a linear head's logits computed without them: ``forward(hidden, weight, targets, bias=None)``
    equals ``loss(hidden @ weight.T + bias, targets)`` (classes last in ``hidden``'s layout: (..., H) features,
    (...) labels), through :func:`torchcal.functional.fused_linear_loss`, which never holds the N × V logits.

    ``loss`` is a torchcal loss module or a registry name (keyword arguments then go to :func:`create`); its
    ``reduction``, ``ignore_index``, class ``weight`` and hyper-parameters are read at every call, and it
    stays a submodule, so an AdaFocal loss is updated (and saved in ``state_dict``) as usual. Label smoothing
    is fused for cross entropy only: another loss with ``label_smoothing`` > 0 is a ``ValueError``.

    Example:
        >>> import torch
        >>> head = torch.nn.Linear(16, 1000)  # a vocabulary of 1,000 tokens
        >>> hidden = torch.randn(4, 32, 16, requires_grad=True)  # (batch, tokens, features)
        >>> labels = torch.randint(0, 1000, (4, 32))
        >>> labels[:, -5:] = -100  # padding
        >>> loss_fn = FusedLinearLoss("flsd-53", chunk_size=64)
        >>> loss_fn
        FusedLinearLoss(SampleDependentFocalLoss(gammas=(5.0, 3.0), thresholds=(0.2,), reduction='mean'), chunk_size=64)
        >>> loss = loss_fn(hidden, head.weight, labels, head.bias)
        >>> loss.backward()
        >>> unfused = create("flsd-53")(head(hidden).movedim(-1, 1), labels)
        >>> torch.allclose(loss, unfused)
        True
    """

    def __init__(
        self, loss="ce", *, chunk_size: int | None = None, vocab_chunk_size: int | None = None, **kwargs
    ):
        super().__init__()
        if isinstance(loss, str):
            loss = create(loss, **kwargs)
        elif kwargs:
            raise TypeError(
                f"keyword arguments {sorted(kwargs)} configure a loss given by name, not a module"
            )
        if not isinstance(loss, nn.Module):
            raise TypeError(f"`loss` must be a torchcal loss module or name, got {type(loss).__name__}")
        _fused_form(loss)
        self.loss = cast("_Loss | AdaFocalLoss", loss)  # (_fused_form accepts only these)
        self.chunk_size = None if chunk_size is None else check_positive_int(chunk_size, "chunk_size")
        self.vocab_chunk_size = (
            None if vocab_chunk_size is None else check_positive_int(vocab_chunk_size, "vocab_chunk_size")
        )

    @property
    def reduction(self) -> str:
        return self.loss.reduction

    @reduction.setter
    def reduction(self, value: str) -> None:
        self.loss.reduction = check_choice(value, "reduction", L.REDUCTIONS)

    @property
    def ignore_index(self):
        return self.loss.ignore_index

    def forward(self, hidden, weight, targets, bias=None):
        name, kwargs = _fused_form(self.loss)
        return FH.fused_linear_loss(
            hidden,
            weight,
            targets,
            name,
            bias=bias,
            chunk_size=self.chunk_size,
            vocab_chunk_size=self.vocab_chunk_size,
            ignore_index=self.loss.ignore_index,
            reduction=self.loss.reduction,
            **kwargs,
        )

    def __repr__(self) -> str:
        sizes = "".join(
            f", {a}={getattr(self, a)}"
            for a in ("chunk_size", "vocab_chunk_size")
            if getattr(self, a) is not None
        )
        return f"{type(self).__name__}({self.loss!r}{sizes})"
