"""AdaFocal (Ghosh et al. 2022): focal loss with one γ per validation confidence bin, steered by the
validation calibration error of that bin, switching to inverse focal loss for γ < 0 (SPEC §2)."""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from ._validation import check_choice, check_float, check_positive_int
from .functional import _backend
from .functional import losses as L
from .functional._binning import equal_mass_sums
from .functional._inputs import top_label_inputs
from .functional._loss_inputs import check_ignore_index, check_label_smoothing, class_weight_buffer
from .functional._spec import LossSpec

__all__ = ["AdaFocalLoss", "CalFocalLoss"]


class _ValidationBins(nn.Module):
    """Shared state: M validation bins (edges (M + 1,), right-closed, first open below, last open above)."""

    bin_edges: torch.Tensor

    def __init__(self, n_bins: int):
        super().__init__()
        self.n_bins = check_positive_int(n_bins, "n_bins")
        self.register_buffer("bin_edges", torch.arange(n_bins + 1, dtype=torch.float64) / n_bins)

    def _cached_spec(self, name: str, tensors: tuple, options: tuple, build):
        """``build()`` cached until one of ``tensors`` is replaced (``.to()``, ``.float()``) or changed in place
        (an update, a loaded state: its ``_version`` moves) or ``options`` change. The cache holds the
        tensors themselves, so their ids cannot be reused by other tensors while it is compared."""
        key = (*map(id, tensors), *(t._version for t in tensors), *options)
        cached = self.__dict__.get(name)
        if cached is None or cached[1] != key:
            cached = (build(), key, tensors)
            self.__dict__[name] = cached
        return cached[0]

    def _fused_spec(self, gammas: torch.Tensor, edges: torch.Tensor, dual: bool = False):
        """The fused CPU path's description of the per-bin γ (None for accelerator buffers), rebuilt only
        when ``gammas`` or the bin ``edges`` changed."""
        if not gammas.is_cpu or torch.compiler.is_compiling():  # (the spec reads the values)
            return None
        return self._cached_spec(
            "_spec_cache",
            (gammas, edges),
            (dual,),
            lambda: LossSpec(gammas, edges[1:-1], upper_on_tie=False, dual=dual),
        )

    def _bin_of(self, p_t: torch.Tensor) -> torch.Tensor:
        edges = self.bin_edges.to(device=p_t.device, dtype=p_t.dtype)
        return torch.bucketize(p_t.detach(), edges[1:-1], right=False)

    @staticmethod
    def validation_statistics(
        val_probs=None, val_targets=None, *, metrics=None, n_bins=15, from_logits=False
    ):
        """Equal-mass bins of the validation top-label confidences: (edges, mean confidence, accuracy, count).

        Edges: 0, the largest confidence of each group but the last, 1 (so bin b holds (e_b, e_{b+1}]).
        Pass probabilities and targets, or a :class:`torchcal.metrics.CalibrationMetrics` that has seen the
        validation pass (no second pass needed).
        """
        if metrics is not None:
            if val_probs is not None or val_targets is not None:
                raise ValueError(
                    "pass the validation set either as (val_probs, val_targets) or as `metrics`, not both"
                )
            from .metrics import CalibrationMetrics

            if not isinstance(metrics, CalibrationMetrics):
                raise TypeError(f"`metrics` must be a CalibrationMetrics, got {type(metrics).__name__}")
            if not metrics.equal_mass:
                raise ValueError("`metrics` was built with equal_mass=False: AdaFocal needs equal-mass bins")
            if metrics.num_samples == 0:
                raise ValueError("`metrics` holds no samples: update() it with the validation pass first")
            conf_s, corr_s = metrics.sorted_confidences()
        elif val_probs is None or val_targets is None:
            raise ValueError("update() needs the validation set: (val_probs, val_targets) or metrics=...")
        else:
            from .functional.calibration import sorted_by_confidence

            conf_s, corr_s = sorted_by_confidence(*top_label_inputs(val_probs, val_targets, from_logits))
        count, conf_sum, corr_sum = equal_mass_sums(conf_s, corr_s, n_bins)
        safe = count.clamp(min=1)
        ends = count.long().cumsum(0)
        c64 = conf_s.double()
        uppers = c64[(ends - 1).clamp(min=0)]
        # an empty group (fewer samples than bins) repeats the previous upper edge
        uppers = torch.where(count > 0, uppers, torch.zeros_like(uppers)).cummax(0).values
        edges = torch.cat(
            [
                torch.zeros(1, dtype=torch.float64, device=c64.device),
                uppers[:-1],
                torch.ones(1, dtype=torch.float64, device=c64.device),
            ]
        )
        return edges, conf_sum / safe, corr_sum / safe, count


class AdaFocalLoss(_ValidationBins):
    """AdaFocal loss with its γ-per-bin state machine (Ghosh et al. 2022, Algorithm 1; SPEC §2).

    Per training sample, γ_b of the validation bin b containing the **true-class** p_t is used: the focal
    form −(1 − p_t)^γ log p_t if γ_b >= 0, the inverse focal form −(1 + p_t)^|γ_b| log p_t otherwise (with
    ``dual=True``, the dual focal form −(1 − p_t + p_j)^γ log p_t: AdaDualFocal). :meth:`update` takes the
    validation set after an epoch (or every n batches): equal-mass bins, gap_b = mean confidence − accuracy
    (0 for an empty bin), then per bin γ ← γ·exp(λ·gap) if γ >= 0 else γ·exp(−λ·gap); if |γ| < S_th the sign
    switches (γ ← −S_th if it was positive, +S_th if negative); γ is clipped to [γ_min, γ_max]; the new
    validation boundaries are adopted. Start: equal-width bins and γ = ``gamma_init``. ``gamma_max`` may be
    infinite (``math.inf`` or "inf"): the paper's unconstrained γ (its appendix N).

    Everything needed to resume (edges, γ, the history of γ and gaps) is in ``state_dict()``.

    Example:
        >>> import torch
        >>> loss_fn = AdaFocalLoss(n_bins=3)
        >>> logits, targets = torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1])
        >>> loss_fn(logits, targets)  # γ = 1 in every bin at the start
        tensor(0.0497)
        >>> val = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4], [0.95, 0.05], [0.55, 0.45]])
        >>> loss_fn.update(val, torch.tensor([0, 1, 0, 1, 0, 0]))
        >>> loss_fn.gammas
        tensor([1.0779, 1.2840, 0.9277], dtype=torch.float64)
    """

    weight: torch.Tensor | None
    gamma_per_bin: torch.Tensor
    gamma_history: torch.Tensor
    gap_history: torch.Tensor

    def __init__(
        self,
        n_bins: int = 15,
        lambda_: float = 1.0,
        gamma_init: float = 1.0,
        gamma_max: float = 20.0,
        gamma_min: float = -2.0,
        switch_threshold: float = 0.2,
        *,
        dual: bool = False,
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
        reduction: str = "mean",
    ):
        super().__init__(n_bins)
        self.ignore_index = check_ignore_index(ignore_index)
        check_label_smoothing(label_smoothing, L._RUNNER_UP_NEEDS_LABELS if dual else L._BINS_NEED_LABELS)
        self.register_buffer("weight", class_weight_buffer(weight))
        self.lambda_ = check_float(lambda_, "lambda_", low=0)
        self.gamma_max = _check_gamma_max(gamma_max)
        self.gamma_min = check_float(gamma_min, "gamma_min", high=self.gamma_max)
        self.switch_threshold = check_float(switch_threshold, "switch_threshold", low=0)
        gamma_init = check_float(gamma_init, "gamma_init", low=self.gamma_min, high=self.gamma_max)
        self.dual = dual
        self.reduction = check_choice(reduction, "reduction", L.REDUCTIONS)
        self.register_buffer("gamma_per_bin", torch.full((self.n_bins,), gamma_init, dtype=torch.float64))
        self.register_buffer("gamma_history", torch.empty(0, self.n_bins, dtype=torch.float64))
        self.register_buffer("gap_history", torch.empty(0, self.n_bins, dtype=torch.float64))

    @property
    def gammas(self) -> torch.Tensor:
        """Current γ per bin (negative: inverse focal with |γ|)."""
        return self.gamma_per_bin

    def forward(self, logits, targets):
        buffers = self._buffers  # (module attribute lookup of a buffer costs ~1 µs per access)
        if self.dual:
            return _ada_dual(logits, targets, self, self.reduction, self.ignore_index, buffers["weight"])
        gammas, edges = buffers["gamma_per_bin"], buffers["bin_edges"]
        assert gammas is not None and edges is not None  # registered tensors

        def weight(log_pt):
            p_t = log_pt.exp().detach()
            bins = torch.bucketize(p_t, edges[1:-1].to(p_t.dtype), right=False)
            return L._signed_gamma_weight(gammas.to(p_t.device, p_t.dtype)[bins])(log_pt)

        spec = self._fused_spec(gammas, edges)
        return _backend.true_class_loss(
            logits,
            targets,
            self.reduction,
            weight,
            spec=spec,
            ignore_index=self.ignore_index,
            soft_refusal=L._BINS_NEED_LABELS,
            weight=buffers["weight"],
        )

    @torch.no_grad()
    def update(self, val_probs=None, val_targets=None, *, metrics=None, from_logits: bool = False) -> None:
        """One γ-update step from the validation set (probabilities or, with ``from_logits``, logits), or from
        a :class:`torchcal.metrics.CalibrationMetrics` that accumulated the validation pass."""
        edges, conf, acc, count = self.validation_statistics(
            val_probs, val_targets, metrics=metrics, n_bins=self.n_bins, from_logits=from_logits
        )
        gap = torch.where(count > 0, conf - acc, torch.zeros_like(conf)).to(self.gamma_per_bin.device)
        g = self.gamma_per_bin
        new = torch.where(g >= 0, g * torch.exp(self.lambda_ * gap), g * torch.exp(-self.lambda_ * gap))
        small = new.abs() < self.switch_threshold
        new = torch.where(small & (g >= 0), torch.full_like(new, -self.switch_threshold), new)
        new = torch.where(small & (g < 0), torch.full_like(new, self.switch_threshold), new)
        new = new.clamp(self.gamma_min, self.gamma_max)
        self.gamma_per_bin.copy_(new)
        self.bin_edges.copy_(edges.to(self.bin_edges.device))
        self.gamma_history = torch.cat([self.gamma_history, new[None]])
        self.gap_history = torch.cat([self.gap_history, gap[None]])

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # the histories grow with every update: resize them to the saved length before copying (the module's
        # dtype and device, as every other buffer keeps them; the copy converts the saved values)
        for name in ("gamma_history", "gap_history"):
            key = prefix + name
            if key in state_dict:
                current = getattr(self, name)
                shape = state_dict[key].shape
                setattr(self, name, torch.empty(shape, dtype=current.dtype, device=current.device))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _check_gamma_max(gamma_max) -> float:
    """γ_max: a real number, or infinity (``math.inf``, YAML's ``.inf`` or the string "inf"): the AdaFocal
    paper's unconstrained γ (its appendix N)."""
    if isinstance(gamma_max, str) and gamma_max.strip().lower() in ("inf", "+inf", "infinity", ".inf"):
        return math.inf
    if isinstance(gamma_max, numbers.Real) and not isinstance(gamma_max, bool) and gamma_max == math.inf:
        return math.inf
    if isinstance(gamma_max, str):
        raise TypeError(f"`gamma_max` must be a real number or 'inf', got {gamma_max!r}")
    return check_float(gamma_max, "gamma_max")


def _ada_dual(logits, targets, bins, reduction, ignore_index, class_weight=None):
    """AdaDualFocal: the dual focal base (1 − p_t + p_j) with AdaFocal's per-bin γ (inverse form for γ < 0)."""

    def weight(log_pt, p_j):
        p_t = log_pt.exp().detach()
        gamma = bins.gamma_per_bin.to(p_t.device, p_t.dtype)[bins._bin_of(p_t)]
        d_loss, d_ct, d_cj = L._dual_weight(gamma.clamp(min=0))(log_pt, p_j)
        i_loss, i_ct = L._inverse_focal_weight((-gamma).clamp(min=0))(log_pt)
        positive = gamma >= 0
        return (
            torch.where(positive, d_loss, i_loss),
            torch.where(positive, d_ct, i_ct),
            torch.where(positive, d_cj, torch.zeros_like(d_cj)),
        )

    spec = bins._fused_spec(bins.gamma_per_bin, bins.bin_edges, dual=True)
    return _backend.true_class_loss(
        logits,
        targets,
        reduction,
        weight,
        runner_up=True,
        spec=spec,
        ignore_index=ignore_index,
        weight=class_weight,
    )


class CalFocalLoss(_ValidationBins):
    """CalFocal (Ghosh et al. 2022, eq. 2 with ``case=1``, eq. 3 with ``case=2``): γ from the validation
    accuracy (and confidence) of the bin containing p_t; :meth:`update` adopts new validation statistics."""

    weight: torch.Tensor | None
    bin_accuracy: torch.Tensor
    bin_confidence: torch.Tensor

    def __init__(
        self,
        n_bins: int = 15,
        lambda_: float = 10.0,
        case: int = 2,
        *,
        weight=None,
        label_smoothing: float = 0.0,
        ignore_index=L.IGNORE_INDEX,
        reduction: str = "mean",
    ):
        super().__init__(n_bins)
        self.ignore_index = check_ignore_index(ignore_index)
        check_label_smoothing(label_smoothing, L._BINS_NEED_LABELS)
        self.register_buffer("weight", class_weight_buffer(weight))
        self.lambda_ = check_float(lambda_, "lambda_")
        self.case = check_choice(case, "case", {1, 2})
        self.reduction = check_choice(reduction, "reduction", L.REDUCTIONS)
        # before the first update: A = C = bin centre, so case 2 starts as FL-1 and case 1 near it
        centres = (self.bin_edges[:-1] + self.bin_edges[1:]) / 2
        self.register_buffer("bin_accuracy", centres.clone())
        self.register_buffer("bin_confidence", centres.clone())

    def forward(self, logits, targets):
        buffers = self._buffers  # (module attribute lookup of a buffer costs ~1 µs per access)
        edges, acc, confidence = buffers["bin_edges"], buffers["bin_accuracy"], buffers["bin_confidence"]
        assert edges is not None and acc is not None and confidence is not None  # registered tensors
        conf = confidence if self.case == 2 else None
        if (
            type(logits) is not torch.Tensor
            or not (logits.is_cpu and edges.is_cpu)
            or torch.compiler.is_compiling()
        ):
            return L.calfocal_loss(
                logits,
                targets,
                edges,
                acc,
                self.lambda_,
                bin_confidence=conf,
                weight=buffers["weight"],
                ignore_index=self.ignore_index,
                reduction=self.reduction,
            )
        spec = self._cached_spec(
            "_cal_spec_cache",
            (edges, acc, confidence),
            (self.case, self.lambda_),
            lambda: L._calfocal_spec(edges, acc, conf, self.lambda_),
        )
        return L._calfocal(
            logits, targets, edges, acc, conf, self.lambda_, self.reduction, spec, self.ignore_index,
            buffers["weight"],
        )  # fmt: skip

    @torch.no_grad()
    def update(self, val_probs=None, val_targets=None, *, metrics=None, from_logits: bool = False) -> None:
        edges, conf, acc, _ = self.validation_statistics(
            val_probs, val_targets, metrics=metrics, n_bins=self.n_bins, from_logits=from_logits
        )
        self.bin_edges.copy_(edges)
        self.bin_accuracy.copy_(acc)
        self.bin_confidence.copy_(conf)
