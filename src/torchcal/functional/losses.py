"""Training losses for calibration (SPEC §1), as pure functions of logits and targets.

Every loss takes (N, K) logits with (N,) integer labels, and also, as ``F.cross_entropy`` does, (N, K, d1, ...)
logits with (N, d1, ...) labels, labels equal to ``ignore_index`` (−100 by default; ``None`` ignores none)
left out, and soft targets (class probabilities of the logits' shape) where the loss's definition extends
to them (see :mod:`torchcal.functional._loss_inputs` and decision 73). Every loss but MMCE takes class
``weight`` with ``F.cross_entropy``'s normalisation, and the losses that are functions of the target
distribution take ``label_smoothing``; the others refuse it in one sentence (decision 96).

Everything starts from ``log_softmax``; ``1 − p_t`` is ``−expm1(log p_t)`` (no cancellation as p_t → 1).
Losses that depend on the logits only through p_t (and the runner-up p_j, and a squared-error term) run
through one autograd Function with an analytic backward: per-sample coefficients c = p·∂loss/∂p, then a
single (N, K) pass like cross entropy's. Bases of powers ``x**γ`` are clamped at the smallest normal number
and the coefficients are written so that they stay finite for 0 < γ < 1 as p_t → 1 (e.g. γ q^γ·p log p/q with
p log p/q → −1). Half-precision logits (and ``torch.autocast`` regions) are computed in float32. No loss
calls ``.item()``, loops over samples or synchronises with an accelerator (the label range is checked for
CPU tensors only).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as nnf

from .._validation import as_tensor, check_choice, check_float, check_label_range, check_positive_int
from . import _backend
from ._loss_inputs import (
    IGNORE_INDEX,
    check_class_weight,
    check_ignore_index,
    check_label_smoothing,
    check_loss_inputs,
    loss_rows,
    reduce_rows,
)
from ._spec import REDUCTIONS, LossSpec

__all__ = [
    "brier_loss",
    "calfocal_loss",
    "cross_entropy",
    "dual_focal_loss",
    "dual_sample_dependent_focal_loss",
    "focal_calibration_loss",
    "focal_gamma_star",
    "focal_loss",
    "inverse_focal_loss",
    "kde_xe_loss",
    "label_smoothing_loss",
    "mmce_loss",
    "mmce_penalty",
    "sample_dependent_focal_loss",
    "varying_focal_loss",
]


def _one_minus_pt(log_pt: torch.Tensor) -> torch.Tensor:
    return -torch.expm1(log_pt)


def _gamma(gamma, name="gamma", low=0.0):
    return check_float(gamma, name, low=low)


def _cached(fn):
    """``fn`` memoised on its (typed) arguments: a loss called every step with the same hyper-parameters
    validates them and builds its fused description once. Unhashable arguments (lists) are not cached;
    arguments that fail validation raise every time (exceptions are not cached). While ``torch.compile``
    traces, ``fn`` itself is traced (once per compiled graph)."""
    cached = functools.lru_cache(maxsize=256, typed=True)(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        try:
            hash((args, tuple(kwargs.items())))
        except TypeError:
            return fn(*args, **kwargs)
        return cached(*args, **kwargs)

    return wrapper


@_cached
def _spec(gammas: tuple, thresholds: tuple = (), **options) -> LossSpec:
    """Description of a loss for the fused path, for constant hyper-parameters (built once per setting)."""
    return LossSpec(gammas, thresholds, upper_on_tie=True, **options)


@_cached
def _gamma_spec(gamma, form: str = "focal", lam=0.0):
    """(γ, λ, spec) of the focal (``form`` "focal"), inverse focal ("inverse"), dual focal ("dual") and focal
    calibration ("fcl", with λ) losses, checked."""
    gamma = _gamma(gamma)
    if form == "inverse":  # negative γ: the inverse form (−0.0 is γ = 0, cross entropy)
        return gamma, 0.0, _spec((-gamma,))
    if form == "dual":
        return gamma, 0.0, _spec((gamma,), dual=True)
    if form == "fcl":
        lam = check_float(lam, "lambda_", low=0)
        return gamma, lam, _spec((gamma,), brier=lam)
    return gamma, 0.0, _spec((gamma,))


@_cached
def _schedule_spec(gammas, thresholds, dual: bool = False):
    """(γs, thresholds, spec) of FLSD (``dual``: DualFLSD on the margin), checked."""
    gammas, thresholds = _check_schedule(gammas, thresholds)
    spec = _spec(tuple(gammas), tuple(thresholds), dual=dual, margin=dual)
    return gammas, thresholds, spec


def _dual_weight(gamma):
    """−B^γ log p_t with B = 1 − p_t + p_j; c_t = p_t ∂/∂p_t = γ B^γ p_t log p_t / B − B^γ and
    c_j = p_j ∂/∂p_j = −γ B^γ p_j log p_t / B (finite as B → 0: |log p_t| <= B/p_t there)."""

    def weight(log_pt, p_j):
        b = (_one_minus_pt(log_pt) + p_j).clamp_(min=torch.finfo(log_pt.dtype).tiny)
        w = b**gamma
        g_log = gamma * w * log_pt / b
        return -w * log_pt, g_log * log_pt.exp() - w, -g_log * p_j

    return weight


def _focal_weight(gamma):
    """−(1 − p)^γ log p and p·d/dp = γ (1 − p)^γ · p log p/(1 − p) − (1 − p)^γ, finite as p → 1 for any γ >= 0."""

    def weight(log_pt):
        q = _one_minus_pt(log_pt).clamp_(min=torch.finfo(log_pt.dtype).tiny)
        q_pow = q**gamma
        # p log p / (1 − p) → −1 as p → 1; where q is clamped (log p_t rounds to 0) it is 0 and the
        # coefficient −(1 − p)^γ is itself ~0
        ratio = log_pt.exp().mul_(log_pt).div_(q)
        return -q_pow * log_pt, q_pow * (gamma * ratio - 1)

    return weight


def _inverse_focal_weight(gamma):
    """−(1 + p)^γ log p and p·d/dp = −γ p (1 + p)^(γ−1) log p − (1 + p)^γ."""

    def weight(log_pt):
        p = log_pt.exp()
        base = 1 + p
        w = base**gamma
        return -w * log_pt, -gamma * p * base ** (gamma - 1) * log_pt - w

    return weight


def _signed_gamma_weight(gamma):
    """AdaFocal's convention: focal with γ where γ >= 0, inverse focal with |γ| where γ < 0 (γ per sample)."""

    def weight(log_pt):
        g = gamma.to(log_pt.dtype)
        focal_loss_, focal_coef = _focal_weight(g.clamp(min=0))(log_pt)
        inv_loss, inv_coef = _inverse_focal_weight((-g).clamp(min=0))(log_pt)
        positive = g >= 0
        return torch.where(positive, focal_loss_, inv_loss), torch.where(positive, focal_coef, inv_coef)

    return weight


# ----------------------------------------------------------------------------- CE and friends


def cross_entropy(
    logits,
    targets,
    *,
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    """Cross entropy −log p_t, optionally against (1 − ε)·onehot + ε/K (PyTorch's ``label_smoothing``);
    −Σ_k q_k log p_k against soft targets q (smoothed as (1 − ε)·q + ε/K); class ``weight`` (K,) as
    ``F.cross_entropy``. ``F.cross_entropy``'s semantics, except that ``ignore_index=None`` ignores no label
    and that the weights must be non-negative.

    Example:
        >>> import torch
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
        >>> cross_entropy(logits, torch.tensor([0, 1]))
        tensor(0.2201)
        >>> cross_entropy(logits, torch.tensor([0, -100]))  # the second sample is ignored
        tensor(0.1269)
        >>> cross_entropy(logits, torch.tensor([[1.0, 0.0], [0.5, 0.5]]), reduction="none")  # soft targets
        tensor([0.1269, 0.8133])
    """
    eps = check_float(label_smoothing, "label_smoothing", low=0, high=1)
    check_choice(reduction, "reduction", REDUCTIONS)
    ignore_index = check_ignore_index(ignore_index)
    logits, targets, soft = check_loss_inputs(logits, targets, ignore_index, check_range=False)
    weight = check_class_weight(weight, logits)
    ignored = _NO_IGNORED_LABEL if ignore_index is None else ignore_index
    try:
        # on CPU every label outside [0, K) but the ignored one raises IndexError inside the op, so the range
        # needs no separate pass (decision 40)
        return nnf.cross_entropy(
            logits, targets, weight, label_smoothing=eps, reduction=reduction, ignore_index=ignored
        )
    except IndexError as err:
        if soft:
            raise
        error = err
    check_label_range(targets, logits.shape[1], ignore_index)  # the named ValueError (no chained trace)
    raise error


_NO_IGNORED_LABEL = -(2**63)  # int64's minimum, a label no dataset holds


def label_smoothing_loss(
    logits, targets, epsilon: float = 0.05, *, weight=None, ignore_index: int | None = IGNORE_INDEX, reduction: str = "mean"
):
    """Label smoothing LS-ε: cross entropy against (1 − ε)·onehot + ε/K (Müller et al. 2019; ε = 0.05 in
    Mukhoti et al.). Same as ``cross_entropy(..., label_smoothing=epsilon)``.
    Example:
        >>> import torch
        >>> label_smoothing_loss(torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1]), 0.1)
        tensor(0.2951)
    """
    return cross_entropy(
        logits,
        targets,
        weight=weight,
        label_smoothing=epsilon,
        ignore_index=ignore_index,
        reduction=reduction,
    )


def brier_loss(
    logits, targets, *, weight=None, label_smoothing: float = 0.0, ignore_index: int | None = IGNORE_INDEX, reduction="mean"
):
    """Brier loss Σ_k (p_k − onehot_k)² of softmax probabilities; Σ_k (p_k − q_k)² against soft targets q
    (and against the smoothed (1 − ε)·onehot + ε/K with ``label_smoothing``). With class ``weight`` a row
    counts with its label's weight (Σ_k w_k q_k for soft targets; decision 96).

    Example:
        >>> import torch
        >>> brier_loss(torch.tensor([[0.0, 0.0]]), torch.tensor([0]))
        tensor(0.5000)
    """

    def no_nll(log_pt):
        zero = torch.zeros_like(log_pt)
        return zero, zero

    spec = _spec((0.0,), nll=False, brier=1.0)
    return _backend.true_class_loss(
        logits,
        targets,
        reduction,
        no_nll,
        brier_lambda=1.0,
        spec=spec,
        ignore_index=ignore_index,
        weight=weight,
        label_smoothing=label_smoothing,
    )


# ----------------------------------------------------------------------------- focal family


def focal_loss(
    logits,
    targets,
    gamma: float = 3.0,
    *,
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    r"""Focal loss :math:`-(1 - p_t)^\gamma \log p_t` (Lin et al. 2017; Mukhoti et al. 2020).

    γ = 0 is cross entropy. Finite loss and gradients for any finite logits, also for 0 < γ < 1 as p_t → 1.
    Against soft targets q: −Σ_k q_k (1 − p_k)^γ log p_k (decision 73); ``label_smoothing`` ε takes
    q = (1 − ε)·onehot + ε/K; class ``weight`` as ``F.cross_entropy`` (decision 96).

    Args:
        gamma: γ >= 0 (use :func:`inverse_focal_loss` for the AdaFocal's negative γ).
        weight: optional (K,) class weights: w_y·loss, and "mean" divides by Σ w_y over the kept labels.
        label_smoothing: ε in [0, 1].

    Example:
        >>> import torch
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
        >>> focal_loss(logits, torch.tensor([0, 1]), gamma=2.0)
        tensor(0.0122)
    """
    gamma, _, spec = _gamma_spec(gamma)
    return _backend.true_class_loss(
        logits,
        targets,
        reduction,
        _focal_weight(gamma),
        spec=spec,
        ignore_index=ignore_index,
        weight=weight,
        label_smoothing=label_smoothing,
    )


def inverse_focal_loss(
    logits,
    targets,
    gamma: float = 1.0,
    *,
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    r"""Inverse focal loss :math:`-(1 + p_t)^\gamma \log p_t` (Wang et al. 2021), used by AdaFocal for γ < 0;
    −Σ_k q_k (1 + p_k)^γ log p_k against soft targets q.

    Example:
        >>> import torch
        >>> inverse_focal_loss(torch.tensor([[0.0, 0.0]]), torch.tensor([0]), gamma=1.0)
        tensor(1.0397)
    """
    gamma, _, spec = _gamma_spec(gamma, "inverse")
    return _backend.true_class_loss(
        logits,
        targets,
        reduction,
        _inverse_focal_weight(gamma),
        spec=spec,
        ignore_index=ignore_index,
        weight=weight,
        label_smoothing=label_smoothing,
    )


def _pick_gamma(values, thresholds, gammas):
    """γ_i = gammas[number of thresholds <= value_i] (a value equal to a threshold takes the upper γ)."""
    t = torch.tensor(thresholds, dtype=values.dtype, device=values.device)
    g = torch.tensor(gammas, dtype=values.dtype, device=values.device)
    return g[torch.bucketize(values.detach(), t, right=True)]


def _check_schedule(gammas, thresholds):
    for name, values in (("gammas", gammas), ("thresholds", thresholds)):
        if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
            raise TypeError(f"`{name}` must be a sequence of numbers, got {type(values).__name__}")
    gammas = [_gamma(g, "gammas") for g in gammas]
    thresholds = [check_float(t, "thresholds", low=0, high=1) for t in thresholds]
    if len(gammas) != len(thresholds) + 1:
        raise ValueError(
            f"`gammas` needs one more entry than `thresholds`, got {len(gammas)} and {len(thresholds)}"
        )
    if any(a >= b for a, b in zip(thresholds, thresholds[1:])):
        raise ValueError(f"`thresholds` must be strictly increasing, got {thresholds}")
    return gammas, thresholds


def sample_dependent_focal_loss(
    logits,
    targets,
    gammas=(5.0, 3.0),
    thresholds=(0.2,),
    *,
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    """Sample-dependent focal loss (FLSD) of Mukhoti et al. 2020.

    γ_i is chosen from the **detached** p_t: ``gammas[j]`` where j is the number of ``thresholds`` <= p_t,
    so a p_t equal to a threshold takes the upper γ. FLSD-53: gammas (5, 3), thresholds (0.2,);
    FLSD-532: gammas (5, 3, 2), thresholds (0.2, 0.5). Against soft targets q: −Σ_k q_k (1 − p_k)^γ_k log p_k
    with γ_k chosen from the detached p_k by the same thresholds (decision 73).

    Example:
        >>> import torch
        >>> logits = torch.tensor([[0.0, 0.0], [1.0, 0.0]])  # p_t = 0.5 and 0.73: γ = 3 for both
        >>> sample_dependent_focal_loss(logits, torch.tensor([0, 0]), reduction="none")
        tensor([0.0866, 0.0061])
    """
    gammas, thresholds, spec = _schedule_spec(gammas, thresholds)

    def focal_weight(log_pt):
        return _focal_weight(_pick_gamma(log_pt.exp(), thresholds, gammas))(log_pt)

    return _backend.true_class_loss(
        logits,
        targets,
        reduction,
        focal_weight,
        spec=spec,
        ignore_index=ignore_index,
        weight=weight,
        label_smoothing=label_smoothing,
    )


def varying_focal_loss(
    logits,
    targets,
    gamma: torch.Tensor,
    *,
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    """Focal loss with a per-sample γ tensor of the labels' shape ((N,) or (N, d1, ...)): focal form where
    γ_i >= 0, inverse focal with |γ_i| where γ_i < 0 (the AdaFocal convention). γ is treated as a constant
    (no gradient).
    Example:
        >>> import torch
        >>> z = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
        >>> varying_focal_loss(z, torch.tensor([0, 1]), torch.tensor([2.0, -1.0]), reduction="none")
        tensor([0.0018, 0.5423])
    """
    gamma = torch.as_tensor(gamma).detach()
    shape = (
        (logits.shape[0], *logits.shape[2:])
        if isinstance(logits, torch.Tensor) and logits.ndim >= 2
        else None
    )
    if shape is None or tuple(gamma.shape) != shape:
        raise ValueError(f"`gamma` must have shape {shape}, one γ per sample, got {tuple(gamma.shape)}")
    gamma = gamma.to(logits.device).reshape(-1)
    spec = None if torch.compiler.is_compiling() else LossSpec((), sample_gammas=gamma)
    return _backend.true_class_loss(
        logits,
        targets,
        reduction,
        _signed_gamma_weight(gamma),
        spec=spec,
        ignore_index=ignore_index,
        soft_refusal="γ is given per sample, for its true class",
        weight=weight,
        label_smoothing=label_smoothing,
    )


def dual_focal_loss(
    logits,
    targets,
    gamma: float = 5.0,
    *,
    dual_logit: str | float = "largest",
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    r"""Dual focal loss :math:`-(1 - p_t + p_j)^\gamma \log p_t` (Tao et al. 2023).

    p_j is the largest probability strictly smaller than p_t: the runner-up when the true class is the
    argmax, the largest class below the true one otherwise; 0 when no class is below p_t (all-equal rows);
    classes tied with p_t are excluded. The gradient flows through p_j, as in the released code. Class
    ``weight`` as ``F.cross_entropy``; ``label_smoothing`` is refused (the loss needs the true class).

    ``dual_logit`` chooses p_j among the variants of the paper's ablation (its Table 4), all over the classes
    strictly below p_t, ranked in descending order: ``"largest"`` (the loss above), ``"second"`` and
    ``"third"`` (the 2nd / 3rd of them; 0 when there are fewer), ``"mean2"`` and ``"mean3"`` (the mean of the
    first 2 / 3 of them, over those that exist), ``"mean"`` (the mean of all of them), or a number c in
    [0, 1], the "fixed dual logit": −(1 − p_t + c)^γ log p_t, focal loss at c = 0. The gradient flows through
    the chosen probabilities. Every variant but ``"largest"`` runs on the torch path on every device
    (decision 142).

    Example:
        >>> import torch
        >>> logits = torch.tensor([[2.0, 1.0, 0.0]])
        >>> dual_focal_loss(logits, torch.tensor([0]), gamma=1.0)
        tensor(0.2362)
        >>> dual_focal_loss(logits, torch.tensor([0]), gamma=1.0, dual_logit="mean")  # p_j = (.245 + .090)/2
        tensor(0.2047)
        >>> dual_focal_loss(logits, torch.tensor([0]), gamma=0.0, dual_logit=0.1)  # γ = 0: cross entropy
        tensor(0.4076)
    """
    dual_logit = _check_dual_logit(dual_logit)
    if dual_logit != "largest":
        return _dual_variant_loss(
            logits, targets, _gamma(gamma), dual_logit, weight, label_smoothing, ignore_index, reduction
        )
    gamma, _, spec = _gamma_spec(gamma, "dual")
    return _backend.true_class_loss(
        logits,
        targets,
        reduction,
        _dual_weight(gamma),
        runner_up=True,
        spec=spec,
        ignore_index=ignore_index,
        weight=weight,
        label_smoothing=label_smoothing,
    )


DUAL_LOGITS = ("largest", "second", "third", "mean2", "mean3", "mean")
_DUAL_RANK = {"second": 2, "third": 3}
_DUAL_MEAN = {"mean2": 2, "mean3": 3}


def _check_dual_logit(dual_logit):
    """One of :data:`DUAL_LOGITS` or a fixed dual value c in [0, 1] (a float)."""
    if isinstance(dual_logit, str):
        return check_choice(dual_logit, "dual_logit", DUAL_LOGITS)
    if isinstance(dual_logit, bool) or not isinstance(dual_logit, (int, float)):
        raise TypeError(
            f"`dual_logit` must be one of {list(DUAL_LOGITS)} or a number in [0, 1], "
            f"got {type(dual_logit).__name__}"
        )
    return check_float(dual_logit, "dual_logit", low=0, high=1)


def _dual_values(log_p, log_pt, dual_logit):
    """p_j (M,) of a :func:`dual_focal_loss` variant from log-probabilities (M, K), differentiable."""
    if not isinstance(dual_logit, str):
        return log_pt.new_full(log_pt.shape, dual_logit)
    below = log_p < log_pt[:, None]  # ties with p_t are excluded, as for the default
    p_below = log_p.exp().masked_fill(~below, 0.0)
    if dual_logit == "mean":
        return p_below.sum(dim=1) / below.sum(dim=1).clamp(min=1)
    m = _DUAL_RANK.get(dual_logit) or _DUAL_MEAN[dual_logit]
    k = log_p.shape[1]
    # the excluded classes hold −1, below every probability: they rank last
    top = torch.where(below, p_below, -1.0).topk(min(m, k), dim=1).values
    valid = top >= 0
    top = top.clamp(min=0)
    if dual_logit in _DUAL_RANK:
        return top[:, m - 1] if m <= k else top.new_zeros(top.shape[0])
    return (top * valid).sum(dim=1) / valid.sum(dim=1).clamp(min=1)


def _dual_variant_loss(logits, targets, gamma, dual_logit, weight, label_smoothing, ignore_index, reduction):
    """The torch path of the :func:`dual_focal_loss` ablation variants (autograd through p_j)."""
    check_choice(reduction, "reduction", REDUCTIONS)
    check_label_smoothing(label_smoothing, _RUNNER_UP_NEEDS_LABELS)
    rows = loss_rows(logits, targets, ignore_index, soft_refusal=_RUNNER_UP_NEEDS_LABELS)
    w = check_class_weight(weight, rows.logits)
    with torch.autocast(rows.logits.device.type, enabled=False):
        log_p = torch.log_softmax(rows.logits, dim=1)
        log_pt = log_p.gather(1, rows.targets[:, None]).squeeze(1)
        base = _one_minus_pt(log_pt) + _dual_values(log_p, log_pt, dual_logit)
        loss = -(base.clamp(min=torch.finfo(base.dtype).tiny) ** gamma) * log_pt
    return reduce_rows(loss, rows, reduction, w)


def dual_sample_dependent_focal_loss(
    logits,
    targets,
    gammas=(5.0, 3.0),
    thresholds=(0.2,),
    *,
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    """DualFLSD: the dual focal form with γ_i chosen by the FLSD thresholds applied to the detached margin
    p_t − p_j (Tao et al. 2023's sample-dependent variant; DualFLSD-53 by default).
    Example:
        >>> import torch
        >>> dual_sample_dependent_focal_loss(torch.tensor([[2.0, 1.0, 0.0]]), torch.tensor([0]))  # margin .42: γ 3
        tensor(0.0793)
    """
    gammas, thresholds, spec = _schedule_spec(gammas, thresholds, True)

    def dual_weight(log_pt, p_j):
        return _dual_weight(_pick_gamma(log_pt.exp() - p_j, thresholds, gammas))(log_pt, p_j)

    return _backend.true_class_loss(
        logits,
        targets,
        reduction,
        dual_weight,
        runner_up=True,
        spec=spec,
        ignore_index=ignore_index,
        weight=weight,
        label_smoothing=label_smoothing,
    )


def focal_calibration_loss(
    logits,
    targets,
    gamma: float = 4.0,
    lambda_: float = 1.5,
    *,
    distance: str = "l2",
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction="mean",
):
    r"""Focal calibration loss: focal(γ) + λ·Σ_k (p_k − onehot_k)² ("Towards Trustworthy DNN through
    Euclidean Distance"; e.g. (γ, λ) = (4.0, 1.5) for CIFAR-10 ResNet-50); against soft targets q (or the
    smoothed labels of ``label_smoothing``), the soft focal term plus λ·Σ_k (p_k − q_k)². With class
    ``weight``: Σ_k w_k q_k f(p_k) + λ·(Σ_k w_k q_k)·Σ_k (p_k − q_k)², w_y·loss for labels (decision 96).

    ``distance="l1"`` is the paper's L1 / mean-absolute-error ablation (its appendix A.15, Table 8): the term
    λ·Σ_k |p_k − onehot_k|, which for a label equals 2λ·(1 − p_t). It takes labels only (soft targets and
    ``label_smoothing`` are refused) and runs on the torch path on every device (decision 141).

    Example:
        >>> import torch
        >>> focal_calibration_loss(torch.tensor([[0.0, 0.0]]), torch.tensor([0]), gamma=0.0, lambda_=1.0)
        tensor(1.1931)
        >>> focal_calibration_loss(  # log 2 + 1·(|0.5 − 1| + |0.5 − 0|)
        ...     torch.tensor([[0.0, 0.0]]), torch.tensor([0]), gamma=0.0, lambda_=1.0, distance="l1"
        ... )
        tensor(1.6931)
    """
    check_choice(distance, "distance", _FCL_DISTANCES)
    if distance == "l1":
        gamma, lam, _ = _gamma_spec(gamma, "fcl", lambda_)
        return _backend.true_class_loss(
            logits,
            targets,
            reduction,
            _l1_focal_weight(gamma, lam),
            soft_refusal=_FCL_L1_NEEDS_LABELS,
            ignore_index=ignore_index,
            weight=weight,
            label_smoothing=label_smoothing,
        )
    gamma, lam, spec = _gamma_spec(gamma, "fcl", lambda_)
    return _backend.true_class_loss(
        logits,
        targets,
        reduction,
        _focal_weight(gamma),
        brier_lambda=lam,
        spec=spec,
        ignore_index=ignore_index,
        weight=weight,
        label_smoothing=label_smoothing,
    )


_FCL_DISTANCES = ("l2", "l1")
_FCL_L1_NEEDS_LABELS = (
    "focal_calibration_loss with distance='l1' is defined for labels (its term is 2λ·(1 − p_t))"
)


def _l1_focal_weight(gamma, lam):
    """FCL's L1 ablation for a label: −(1 − p)^γ log p + 2λ(1 − p), since Σ_k |p_k − onehot_k| = 2(1 − p_t);
    p·d/dp of the L1 term is −2λp."""
    focal = _focal_weight(gamma)

    def weight(log_pt):
        loss, coef = focal(log_pt)
        return loss + (2 * lam) * _one_minus_pt(log_pt), coef - (2 * lam) * log_pt.exp()

    return weight


# ----------------------------------------------------------------------------- MMCE


def mmce_penalty(
    logits, targets, *, normalization: str = "code", bandwidth: float = 0.4, ignore_index: int | None = IGNORE_INDEX
):
    """Kumar et al. 2018 weighted MMCE of a batch, on top-label confidences r and correctness c.

    The paper's MMCE_w² = Σ_{c,c}(1−r)(1−r')k/m² + Σ_{w,w} r r' k/n² − 2 Σ_{c,w}(1−r) r' k/(m n),
    k = exp(−|r − r'|/0.4), m correct and n wrong samples; the result is sqrt(max(0, ·)) and 0 when the batch
    is all correct or all wrong. The default, ``normalization="code"``, is the released code's (SPEC §1): it
    divides each block once more by m², n² and m·n, a term about batch-size² smaller; every published MMCE
    number and the papers' λ = 2 (images) and 8 (text) were obtained with it. ``normalization="paper"`` is
    the paper's single normalisation, a far stronger term at the same λ (at λ = 2 it cost 4.7 points of
    accuracy on Fashion-MNIST; docs/fidelity.md). Note: with the released normalisation, a batch with a single
    wrong (or correct) sample divides that block by 1, so where batches keep one or two errors (small data,
    Adam) the term stays large. Positions labelled ``ignore_index`` are not part of the batch.

    Example:
        >>> import torch
        >>> logits, targets = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0]]), torch.tensor([0, 1, 1])
        >>> mmce_penalty(logits, targets)
        tensor(0.6437)
        >>> mmce_penalty(logits, targets, normalization="paper")
        tensor(0.5573)
    """
    check_choice(normalization, "normalization", {"paper", "code"})
    return _mmce_rows(
        loss_rows(logits, targets, ignore_index, soft_refusal=_MMCE_NEEDS_LABELS), normalization, bandwidth
    )


_RUNNER_UP_NEEDS_LABELS = _backend._RUNNER_UP_NEEDS_LABELS
_MMCE_NEEDS_LABELS = "MMCE measures whether the top-label prediction is correct"
_MMCE_IS_A_BATCH_TERM = (
    "MMCE's penalty is a kernel statistic of the whole batch's confidences and correctness, which class "
    "weights and smoothed targets do not define"
)


def check_mmce_options(weight, label_smoothing) -> None:
    """MMCE refuses class weights and label smoothing, in one sentence each."""
    if weight is not None:
        raise ValueError(f"`weight` is not accepted: {_MMCE_IS_A_BATCH_TERM}")
    check_label_smoothing(label_smoothing, _MMCE_IS_A_BATCH_TERM)


def _mmce_rows(rows, normalization, bandwidth):
    """The weighted MMCE of checked rows; ignored rows get zero weight (no indexing: sync-free)."""
    log_p = torch.log_softmax(rows.logits, 1)
    conf, pred = log_p.exp().max(1)
    correct = (pred == rows.targets).to(conf.dtype)
    wrong = 1 - correct
    if rows.keep is not None:
        kept = rows.keep.to(conf.dtype)
        correct, wrong = correct * kept, wrong * kept
    m, n = correct.sum(), wrong.sum()
    kernel = torch.exp(-(conf[:, None] - conf[None, :]).abs() / bandwidth)
    a = (1 - conf) * correct  # weights of correct samples
    b = conf * wrong  # weights of wrong samples
    m_safe, n_safe = m.clamp(min=1), n.clamp(min=1)
    cc = a @ kernel @ a / m_safe**2
    ww = b @ kernel @ b / n_safe**2
    cw = a @ kernel @ b / (m_safe * n_safe)
    if normalization == "code":
        cc, ww, cw = cc / m_safe**2, ww / n_safe**2, cw / (m_safe * n_safe)
    value = (cc + ww - 2 * cw).clamp(min=0)
    # sqrt with a finite gradient at 0
    value = torch.where(value > 0, value.clamp(min=torch.finfo(value.dtype).tiny).sqrt(), value)
    return torch.where((m > 0) & (n > 0), value, torch.zeros_like(value))


def mmce_loss(
    logits,
    targets,
    lambda_: float = 2.0,
    *,
    normalization: str = "code",
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    """Cross entropy + λ·MMCE_w(batch) (Kumar et al. 2018; λ = 2 for images, 8 for text), by default with
    the released code's normalisation, ``normalization="paper"`` for the paper's (see :func:`mmce_penalty`).

    The MMCE term belongs to the batch: ``"mean"`` is CE.mean() + λ·MMCE, ``"none"`` gives every sample
    CE_i + λ·MMCE (so its mean is the "mean" loss) and ``"sum"`` is the sum of ``"none"``. Positions labelled
    ``ignore_index`` are left out of both terms (their "none" loss is 0). Class ``weight`` and
    ``label_smoothing`` are refused (decision 96): the penalty is a statistic of the whole batch.

    Example:
        >>> import torch
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
        >>> mmce_loss(logits, torch.tensor([0, 1, 1]))
        tensor(1.8719)
        >>> mmce_loss(logits, torch.tensor([0, 1, 1]), normalization="paper")
        tensor(1.6990)
    """
    lam = check_float(lambda_, "lambda_", low=0)
    check_choice(reduction, "reduction", REDUCTIONS)
    check_choice(normalization, "normalization", {"paper", "code"})
    check_mmce_options(weight, label_smoothing)
    rows = loss_rows(logits, targets, ignore_index, soft_refusal=_MMCE_NEEDS_LABELS)
    ce = nnf.cross_entropy(rows.logits, rows.targets, reduction="none")
    loss = ce + lam * _mmce_rows(rows, normalization, 0.4)
    return reduce_rows(loss, rows, reduction)


# ----------------------------------------------------------------------------- KDE-XE

_KDE_NEEDS_LABELS = "the KDE calibration term compares each sample's one-hot label with its neighbours'"
_KDE_IS_A_BATCH_TERM = "the KDE calibration error is a statistic of the whole batch"


def check_kde_xe_options(lambda_, bandwidth, weight, label_smoothing) -> tuple[float, float | str]:
    """(λ, bandwidth) of KDE-XE, checked; class weights and label smoothing refused."""
    lam = check_float(lambda_, "lambda_", low=0)
    if not (isinstance(bandwidth, str) and bandwidth == "auto"):
        if isinstance(bandwidth, str):
            raise ValueError(f"`bandwidth` must be 'auto' or a number > 0, got {bandwidth!r}")
        bandwidth = check_float(bandwidth, "bandwidth", low=0, low_open=True)
    if weight is not None:
        raise ValueError(f"`weight` is not accepted: {_KDE_IS_A_BATCH_TERM}")
    check_label_smoothing(label_smoothing, _KDE_IS_A_BATCH_TERM)
    return lam, bandwidth


def kde_xe_loss(
    logits,
    targets,
    lambda_: float = 1.0,
    *,
    bandwidth: float | str = "auto",
    chunk_size: int = 1024,
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    """KDE-XE (Popordanoska et al. 2022; the Dual Focal paper's appendix F): cross entropy + λ·ECE_KDE(batch),
    the canonical L1 calibration error of the batch's softmax vectors estimated leave-one-out with Dirichlet
    kernels, differentiable in the logits through every kernel (the arithmetic of
    :func:`~torchcal.functional.kde_calibration_error`, in the logits' dtype).

    ``bandwidth="auto"`` picks, for every batch, the bandwidth that maximises the leave-one-out likelihood of
    the detached softmax vectors over the metric's grid (Popordanoska et al.'s rule); a number fixes it.
    Picking it reads values on the host (one synchronisation per batch on an accelerator). The term belongs
    to the batch, as MMCE's: ``"mean"`` is CE.mean() + λ·ECE_KDE, ``"none"`` gives each sample
    CE_i + λ·ECE_KDE and ``"sum"`` their sum; ignored positions are left out of both terms, and a batch
    with fewer than 2 kept samples has no KDE term (0). Class ``weight`` and ``label_smoothing`` are
    refused. λ has no published default (the paper chooses it by cross-validation): 1.0 here (decision 144).
    Cost O(B²K) per batch.

    Example:
        >>> import torch
        >>> logits = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 2.0]])
        >>> targets = torch.tensor([0, 0, 1, 0])
        >>> kde_xe_loss(logits, targets, lambda_=0.0)  # cross entropy
        tensor(0.7201)
        >>> kde_xe_loss(logits, targets, lambda_=1.0, bandwidth=0.5)
        tensor(1.1387)
    """
    from .calibration import _kde_select_bandwidth, kde_l1_sum

    lam, bandwidth = check_kde_xe_options(lambda_, bandwidth, weight, label_smoothing)
    check_choice(reduction, "reduction", REDUCTIONS)
    chunk = check_positive_int(chunk_size, "chunk_size")
    rows = loss_rows(logits, targets, ignore_index, soft_refusal=_KDE_NEEDS_LABELS)
    with torch.autocast(rows.logits.device.type, enabled=False):
        log_p = torch.log_softmax(rows.logits, dim=1)
        ce = -log_p.gather(1, rows.targets[:, None]).squeeze(1)
        kept_log_p, kept_targets = log_p, rows.targets
        if rows.keep is not None:
            kept_log_p, kept_targets = log_p[rows.keep], rows.targets[rows.keep]
        n, k = kept_log_p.shape
        term = ce.new_zeros(())
        if lam and n >= 2:
            # the metric's clamp at 1e-12 (renormalised), then logs: finite kernels for saturated rows
            f = kept_log_p.exp().clamp(min=1e-12)
            f = f / f.sum(1, keepdim=True)
            log_f = f.log()
            h = bandwidth
            if isinstance(h, str):  # "auto" (checked)
                h = _kde_select_bandwidth(f.detach(), log_f.detach(), chunk)
            onehot = nnf.one_hot(kept_targets, k).to(f.dtype)
            term = kde_l1_sum(f, log_f, onehot, h, chunk) / n
    return reduce_rows(ce + lam * term, rows, reduction)


# ----------------------------------------------------------------------------- CalFocal and γ*


def calfocal_loss(
    logits,
    targets,
    bin_edges,
    bin_accuracy,
    lambda_: float = 10.0,
    *,
    bin_confidence=None,
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    """CalFocal (Ghosh et al. 2022, eq. 2 and 3): focal loss whose γ follows validation calibration.

    Each sample's validation bin b is the one containing its detached p_t (``bin_edges`` are the M + 1
    boundaries; bins are right-closed, the first open below and the last open above).
    Case 1 (eq. 2, ``bin_confidence=None``): γ_n = exp(λ(p_n − A_val,b)) per sample (p_n detached).
    Case 2 (eq. 3): γ_b = exp(λ(C_val,b − A_val,b)) per bin. Class ``weight`` as ``F.cross_entropy``;
    ``label_smoothing`` is refused (the bin is looked up by the true class).

    Example:
        >>> import torch
        >>> z = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
        >>> calfocal_loss(z, torch.tensor([0, 1]), bin_edges=[0.0, 0.5, 1.0], bin_accuracy=[0.4, 0.9], lambda_=1.0)
        tensor(0.0595)
    """
    lam = check_float(lambda_, "lambda_")
    device = logits.device if isinstance(logits, torch.Tensor) else None
    edges = torch.as_tensor(as_tensor(bin_edges, "bin_edges"), device=device)
    acc = torch.as_tensor(as_tensor(bin_accuracy, "bin_accuracy"), device=device)
    if edges.ndim != 1 or edges.shape[0] < 2 or acc.shape != (edges.shape[0] - 1,):
        raise ValueError(
            f"`bin_edges` must have M + 1 entries and `bin_accuracy` M (M >= 1), got {tuple(edges.shape)} and "
            f"{tuple(acc.shape)}"
        )
    conf = None
    if bin_confidence is not None:
        conf = torch.as_tensor(as_tensor(bin_confidence, "bin_confidence"), device=device)
        if conf.shape != acc.shape:
            raise ValueError(f"`bin_confidence` must have shape {tuple(acc.shape)}, got {tuple(conf.shape)}")
    _check_bin_statistics(edges, acc, conf)

    spec = _calfocal_spec(edges, acc, conf, lam)
    return _calfocal(
        logits, targets, edges, acc, conf, lam, reduction, spec, ignore_index, weight, label_smoothing
    )


def _check_bin_statistics(edges, acc, conf) -> None:
    """CalFocal's validation bins: real edges, non-decreasing in [0, 1] (a repeated edge is an empty bin), and
    accuracies (and confidences) in [0, 1]; anything else would pick bins or γ silently wrong. The values are
    read on CPU only (no synchronisation with an accelerator, decision 22)."""
    for name, t in (("bin_edges", edges), ("bin_accuracy", acc), ("bin_confidence", conf)):
        if t is not None and (t.is_complex() or t.dtype == torch.bool):
            raise TypeError(f"`{name}` must hold real numbers, got dtype {t.dtype}")
    if not edges.is_cpu or torch.compiler.is_compiling():
        return
    for name, t in (("bin_edges", edges), ("bin_accuracy", acc), ("bin_confidence", conf)):
        if t is None:
            continue
        t = t.double()
        if not bool(torch.isfinite(t).all()) or float(t.min()) < 0 or float(t.max()) > 1:
            raise ValueError(f"`{name}` must lie in [0, 1], got {t.tolist()}")
    if bool((edges[1:] < edges[:-1]).any()):
        raise ValueError(f"`bin_edges` must be non-decreasing, got {edges.tolist()}")


def _calfocal_spec(edges, acc, conf, lam):
    """The fused CPU paths' description of CalFocal (None for accelerator tensors)."""
    if not edges.is_cpu or torch.compiler.is_compiling():  # (the spec reads the values)
        return None
    interior = edges[1:-1].double().numpy()
    if conf is None:  # eq. 2: γ_n = exp(λ(p_n − A_b))
        return LossSpec(acc.double().numpy(), interior, upper_on_tie=False, cal_lambda=lam)
    bin_gamma = torch.exp(lam * (conf.double() - acc.double())).numpy()  # eq. 3: one γ per bin
    return LossSpec(bin_gamma, interior, upper_on_tie=False)


_BINS_NEED_LABELS = "the validation bin is looked up by the true-class probability"


def _calfocal(
    logits,
    targets,
    edges,
    acc,
    conf,
    lam,
    reduction,
    spec,
    ignore_index: int | None = IGNORE_INDEX,
    class_weight=None,
    eps=0.0,
):
    """CalFocal on checked bin statistics (``torchcal.adafocal.CalFocalLoss`` passes its cached ``spec``)."""

    def weight(log_pt):
        p_t = log_pt.exp().detach()
        b = torch.bucketize(p_t, edges[1:-1].to(p_t.dtype), right=False)
        a = acc.to(p_t.dtype)
        if conf is None:
            gamma = torch.exp(lam * (p_t - a[b]))
        else:
            gamma = torch.exp(lam * (conf.to(p_t.dtype) - a))[b]
        return _focal_weight(gamma)(log_pt)

    return _backend.true_class_loss(
        logits,
        targets,
        reduction,
        weight,
        spec=spec,
        ignore_index=ignore_index,
        soft_refusal=_BINS_NEED_LABELS,
        weight=class_weight,
        label_smoothing=eps,
    )


def _lambert_w(x: float, branch: int) -> float:
    """Lambert W on the real branches 0 (x >= −1/e) and −1 (−1/e <= x < 0) by Halley's method."""
    if x < -1 / math.e - 1e-15:
        raise ValueError(f"Lambert W is real only for x >= -1/e, got {x}")
    if x == 0:
        if branch == 0:
            return 0.0
        raise ValueError("the W_-1 branch is unbounded at 0")
    if branch == 0:
        w = math.log1p(x) if x > -0.3 else -1 + math.sqrt(2 * (1 + math.e * x))
    else:
        if x >= 0:
            raise ValueError("the W_-1 branch needs -1/e <= x < 0")
        w = math.log(-x) - math.log(-math.log(-x)) if x > -0.25 else -1 - math.sqrt(2 * (1 + math.e * x))
    for _ in range(100):
        ew = math.exp(w)
        f = w * ew - x
        if w == -1:
            break
        step = f / (ew * (w + 1) - (w + 2) * f / (2 * w + 2))
        w -= step
        if abs(step) <= 1e-15 * (1 + abs(w)):
            break
    return w


def focal_gamma_star(p0: float) -> float:
    r"""γ* of Mukhoti et al. 2020, Prop. 2: the γ for which the focal loss gradient matches cross entropy's
    at p_t = p0, i.e. the root of g(p0, γ) = (1 − p0)^γ − γ p0 (1 − p0)^(γ−1) ln p0 = 1 other than γ = 0.

    With a = 1 − p0, L = −p0 ln p0 / a and c = −ln a / L, g = 1 becomes u e^{−c u} = e^{−c} for u = 1 + γL,
    so u = −W(−c e^{−c})/c on the branch that does not give the trivial u = 1 (W₋₁ when c < 1, W₀ when
    c > 1), and γ* = (u − 1)/L. Near p0 = 1/2 the argument of W nears its branch point −1/e, where W loses
    half the digits, so t = u − 1 is refined by Newton's method on log(1 + t)/t = c (the same equation
    without its trivial root), which stays accurate as t → 0; ln a is ``log1p(−p0)``, exact for tiny p0.

    Example:
        >>> round(focal_gamma_star(0.2), 2), round(focal_gamma_star(0.25), 2)
        (4.85, 3.07)
    """
    p0 = check_float(p0, "p0", low=0, high=1, low_open=True, high_open=True)
    a = 1 - p0
    big_l = -p0 * math.log(p0) / a
    c = -math.log1p(-p0) / big_l
    if c == 1:
        raise ValueError(
            f"no non-zero γ* can be told from 0 at p0 = {p0}: γ = 0 is a double root at p0 = 1/2"
        )
    w = _lambert_w(-c * math.exp(-c), -1 if c < 1 else 0)
    return _refine_gamma_star_t(-w / c - 1, c) / big_l


def _refine_gamma_star_t(t: float, c: float) -> float:
    """The root t != 0 of h(t) = log1p(t)/t = c (h decreases from +inf at t = −1 to 0, with h(0) = 1), by
    Newton's method from the Lambert-W estimate ``t``; h and h' use their Taylor series near t = 0."""
    for _ in range(60):
        if abs(t) < 1e-4:
            h = 1 - t / 2 + t * t / 3 - t**3 / 4
            dh = -0.5 + 2 * t / 3 - 0.75 * t * t
        else:
            h = math.log1p(t) / t
            dh = (t / (1 + t) - math.log1p(t)) / (t * t)
        step = (h - c) / dh
        t_next = t - step
        if t_next <= -1:  # stay in the domain (only reachable from a poor start)
            t_next = (t - 1) / 2
        if t_next == t or abs(step) <= 4e-16 * abs(t_next):
            return t_next
        t = t_next
    return t
