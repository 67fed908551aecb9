"""Margin and penalty losses of the field (SPEC §8): cross entropy plus a term on the logits or probabilities.

* :func:`logit_margin_l1_loss`, MbLS (Liu et al. 2022): CE + α·mean_{i,k} relu(max_j z_ij − z_ik − m);
* :func:`acls_loss`, ACLS (Park et al. 2023): CE + α·(a squared hinge on the top logit and on the distances);
* :func:`poly1_cross_entropy`, Poly-1 (Leng et al. 2022): CE + ε(1 − p_t);
* :func:`confidence_penalty_loss` (Pereyra et al. 2017): CE + β(log K − H(p));
* :func:`maxsup_loss`, MaxSup (Zhou et al. 2025): CE + λ(max_k z_k − mean_k z_k);
* :func:`mdca_loss`, NLL / focal / LS + β·MDCA (Hebbalaguppe et al. 2022), a term of the batch's class means;
* :func:`dca_loss`, CE + β·abs(mean confidence − accuracy) (Liang et al. 2020), a term of the batch;
* :func:`sbece_loss`, CE + λ·soft-binned ECE (Karandikar et al. 2021), a term of the batch.

They share the contract of :mod:`torchcal.functional.losses` (decision 73): (N, K) logits with (N,) labels or
(N, K, d1, ...) logits with (N, d1, ...) labels (each position a sample), labels equal to ``ignore_index``
left out, soft targets (class probabilities of the logits' shape) for the cross-entropy term, reductions
``"none" | "mean" | "sum"``, half-precision logits and autocast regions computed in float32. Where the
released code differs from the paper, the code is the default (SPEC §8; decisions 131-139). The losses do not
call ``.item()`` or branch on tensor values, so they trace into one ``torch.compile`` graph. On the CPU, with
the C++ library built (``torchcal build-extension``), for integer labels and float32/float64 logits, MbLS,
ACLS, MaxSup, the confidence penalty, CALS (its training statistics included) and Poly-1 (without label
smoothing; class weights included) run as one fused operator (decisions 200, 206-208); MDCA (all three
bases), DCA, SB-ECE, AvUC, S-AvUC and ESD take their per-row numbers (base loss, top-label confidence,
correctness, entropy, MDCA's column sums) and the logits' gradient from another, with the batch term
computed in torch on those (M,) vectors (decision 202; SB-ECE's default label-binned term is a C++ operator
on the confidences too, decision 203); :func:`ml1ace_loss` has its own operator (decision 211). The code
below is the reference path and that of every other case (soft targets, half precision, other devices,
Poly-1's label smoothing, the extension off).

Only Poly-1 is a function of the target distribution, so only it takes class ``weight`` and
``label_smoothing``; MbLS, ACLS, the confidence penalty and MaxSup add a term that does not depend on the
target, which the released code never weights, and refuse both in one sentence (decision 133); MDCA and
SB-ECE refuse both (batch statistics), DCA takes ``weight`` in its cross entropy as the official function
does. The batch terms of MDCA, DCA and SB-ECE are those of each rank's batch under data parallelism, as in
the reference code, with ``sync=True`` for the global batch.
"""

from __future__ import annotations

import contextlib
import math
from typing import Literal, NamedTuple

import torch

from .._validation import check_bool, check_choice, check_float, check_positive_int
from ._backend import batch_loss, batch_rows, ml1ace_cross_entropy, penalised_cross_entropy, sbece_label
from ._loss_inputs import (
    IGNORE_INDEX,
    LossRows,
    check_class_weight,
    check_ignore_index,
    check_label_smoothing,
    loss_rows,
    reduce_rows,
    smoothed_targets,
)
from ._spec import REDUCTIONS, ordered_softmax, ordered_sum

__all__ = [
    "acls_loss",
    "confidence_penalty_loss",
    "dca_loss",
    "logit_margin_l1_loss",
    "maxsup_loss",
    "mbls_alpha",
    "mdca_loss",
    "mdca_penalty",
    "poly1_cross_entropy",
    "sbece_loss",
    "sbece_penalty",
    "avuc_loss",
    "avuc_penalty",
    "soft_avuc_loss",
    "soft_avuc_penalty",
    "esd_loss",
    "esd_penalty",
    "ml1ace_loss",
    "ml1ace_penalty",
    "cals_loss",
    "cals_statistics",
    "phr_penalty",
]

_PENALTY_IS_NOT_PER_CLASS = (
    "the {} term does not depend on the target, and the reference code weights and smooths nothing; use "
    "poly1_cross_entropy or cross_entropy for weighted or smoothed targets"
)
MBLS_SCHEDULES = ("", "add", "multiply", "step")
_FUSED = (torch.float32, torch.float64)  # the logits' dtypes of the C++ operator


def _number(value, name, low=None, high=None, low_open=False):
    """A hyper-parameter checked as :func:`check_float` does, except while ``torch.compile`` traces: a
    value that changes between calls (a schedule's α) becomes a symbolic float there, which the check would
    turn into a graph break; the modules checked it at construction."""
    if torch.compiler.is_compiling():
        return value
    return check_float(value, name, low=low, high=high, low_open=low_open)


def _refuse_weight_and_smoothing(name: str, weight, label_smoothing) -> None:
    reason = _PENALTY_IS_NOT_PER_CLASS.format(name)
    if weight is not None:
        raise ValueError(f"`weight` is not accepted: {reason}")
    check_label_smoothing(label_smoothing, reason)


def _ce_rows(logits, targets, ignore_index):
    """Checked rows, their log-probabilities (float32 or float64) and the per-row cross entropy (ignored rows
    hold the loss of the label 0; the reduction masks them)."""
    rows = loss_rows(logits, targets, ignore_index)
    log_p = torch.log_softmax(rows.logits, 1)
    if rows.soft:
        ce = -(rows.targets * log_p).sum(1)
    else:
        ce = -log_p.gather(1, rows.targets[:, None])[:, 0]
    return rows, log_p, ce


class _TopGapPenalty(torch.autograd.Function):
    r"""Per row, Σ_k w_k·r_ik^p with r_ik = relu(b_k + a_k(z_i^max − z_ik)) and p = 1 or 2: the margin terms of
    MbLS (a = 1, b = −m, w = 1/K, p = 1), ACLS's negative term (the same with p = 2, w = 1/(K − 1) and the max
    detached) and CALS's PHR penalty (a = ρ/s, b = λ − ρm/s, w = 1/(2ρK), p = 2), with an analytic backward.

    ``grad_scale`` is w_k·a_k, which is the same for every class in all three (1/K, 1/(K − 1), 1/(2Ks)): the
    gradient is −g_i·grad_scale·p·r_ik^(p−1) on z_ik and, when the max is not detached (``top_grad``), minus
    the row's sum of those on the arg-max entry (its own term cancels). Autograd's chain through d = max − z,
    the hinge, the power and the mean takes five (N, K) temporaries forward and as many backward; this takes
    one (N, K) array forward (kept for the backward: the hinge, or its active mask for p = 1) and writes the
    gradient in one pass. Differentiable once.

    Outputs (value (M,), z^max (M,), statistics). The second is the max with its gradient (ACLS's positive
    term), added on the arg-max entries of the same gradient array rather than through a dense max backward.
    With ``stats_rows`` (M,) row weights (CALS's training accumulation, p = 2), the third holds, from the same
    hinge, Σ_i s_i clamp(r_ik, lo, hi) (K), Σ_i s_i z_ik (K) and Σ_i s_i z_i^max (1), detached; it is empty
    otherwise."""

    @staticmethod
    def forward(ctx, z, a, b, w, grad_scale, power, top_grad, stats_rows=None, lo=0.0, hi=math.inf):
        top, arg = z.max(dim=1)
        if isinstance(a, float) and a == 1.0:
            r = torch.sub((top[:, None] + b) if isinstance(b, torch.Tensor) else (top + b)[:, None], z)
        else:
            r = torch.sub(top[:, None], z).mul_(a).add_(b)
        r.clamp_(min=0)
        if power == 1:
            value = r.sum(1) * w if isinstance(w, float) else r @ w
            r = r > 0
        else:
            # (the norm's reduction allocates nothing, unlike r·r)
            value = (
                torch.linalg.vector_norm(r, dim=1).square() * w if isinstance(w, float) else r.square() @ w
            )
        stats = z.new_empty(0)
        if stats_rows is not None:
            rows_w = stats_rows[:, None]
            clamped, logit_sums = ordered_sum(rows_w * r.clamp(lo, hi), 0), ordered_sum(rows_w * z, 0)
            stats = torch.cat([clamped, logit_sums, ordered_sum(stats_rows * top)[None]])
        ctx.mark_non_differentiable(stats)
        ctx.set_materialize_grads(False)
        ctx.grad_scale, ctx.power, ctx.top_grad = grad_scale, power, top_grad
        ctx.save_for_backward(r, arg)
        return value, top, stats

    @staticmethod
    def backward(ctx, grad_value, grad_top, grad_stats):  # pyright: ignore[reportIncompatibleMethodOverride]
        del grad_stats
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # (create_graph=True: the saved hinge is not a function of z, so a graph of this gradient would
            # miss the second derivative; refused rather than wrong)
            raise RuntimeError(
                "the margin terms of MbLS, ACLS and CALS are differentiable once only (an analytic backward); "
                "second-order gradients are not available for them"
            )
        r, arg = ctx.saved_tensors
        if grad_value is None and grad_top is None:
            return (None,) * 10
        if grad_value is None:
            grad = torch.zeros(r.shape, dtype=grad_top.dtype, device=grad_top.device)
        else:
            coef = (-ctx.grad_scale * ctx.power) * grad_value[:, None]
            grad = torch.where(r, coef, coef.new_zeros(())) if ctx.power == 1 else r.mul(coef)
        at_top = -grad.sum(1) if ctx.top_grad and grad_value is not None else None
        if grad_top is not None:
            at_top = grad_top if at_top is None else at_top + grad_top
        if at_top is not None:
            grad.scatter_add_(1, arg[:, None], at_top[:, None])
        return grad, None, None, None, None, None, None, None, None, None


def _reduce_penalised(ce, penalty, coef, rows, reduction, penalty_keep: Literal["rows"] | None = "rows"):
    """CE_i + coef·penalty_i reduced over the rows. The CE term leaves out ignored rows; the penalty leaves
    out the rows of ``penalty_keep`` ("rows": the same as CE; None: it covers every row, MbLS's released code
    with a negative ``ignore_index``). ``"mean"`` averages each term over the rows it covers (so it is
    ``"none"``'s mean whenever both cover the same rows); ``"none"`` gives an ignored row its penalty only
    when the penalty covers it."""
    keep = rows.keep
    pen_keep = keep if penalty_keep == "rows" else penalty_keep
    zero = ce.new_zeros(())
    if keep is not None:
        ce = torch.where(keep, ce, zero)
    if pen_keep is not None:
        penalty = torch.where(pen_keep, penalty, zero)
    if reduction == "none":
        return (ce + coef * penalty).reshape(rows.shape)
    if reduction == "sum":
        return ordered_sum(ce) + coef * ordered_sum(penalty)
    n_ce = ce.shape[0] if keep is None else keep.sum()
    n_pen = penalty.shape[0] if pen_keep is None else pen_keep.sum()
    return ordered_sum(ce) / n_ce + coef * (ordered_sum(penalty) / n_pen)


# -- MbLS ----------------------------------------------------------------------------------------------------


def logit_margin_l1_loss(
    logits,
    targets,
    margin: float = 10.0,
    alpha: float = 0.1,
    *,
    ignored_rows: str = "reference",
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    r"""Margin-based label smoothing, MbLS (Liu et al., CVPR 2022): cross entropy plus a hinge on the logit
    distances :math:`d_{ik} = \max_j z_{ij} - z_{ik}` above the margin m,

    .. math:: \mathrm{CE} + \alpha \cdot \frac{1}{NK} \sum_{i,k} \mathrm{relu}(d_{ik} - m).

    As the released code (by-liu/MbLS ``logit_margin_l1.py``, decision 131): the penalty is a mean over all
    N·K entries, the arg-max entry included (it adds 0 but counts, so the paper's per-sample sum has the
    effective weight α/K), and the max is not detached (the gradient reaches the max logit and the others).
    Per sample the loss is CE_i + (α/K) Σ_k relu(d_ik − m).

    ``ignored_rows="reference"`` (the default) follows the released code: positions labelled ``ignore_index``
    leave both terms only when ``ignore_index`` >= 0 (255 for VOC); with a negative one (−100, the default)
    cross entropy leaves them out but the margin term still covers them, its mean running over every row.
    ``ignored_rows="drop"`` leaves them out of both terms (the contract of the other losses). Soft targets
    (class probabilities) enter the cross-entropy term. Class ``weight`` and ``label_smoothing`` are refused.

    Args:
        margin: m >= 0 (10 in the paper and the configs).
        alpha: α >= 0 (0.1); :class:`~torchcal.losses.LogitMarginL1Loss` offers the released code's α
            schedule (:func:`mbls_alpha`).
        ignored_rows: "reference" or "drop" (see above).

    Shape:
        logits (N, K) or (N, K, d1, ...); targets (N,) / (N, d1, ...) labels or class probabilities of the
        logits' shape; ``reduction="none"`` returns (N,) or (N, d1, ...).

    Example:
        >>> import torch
        >>> logits = torch.tensor([[12.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
        >>> # the first row's distances 12 and 11 exceed m = 10 by 2 and 1: α·(0 + 2 + 1)/3 = 0.1
        >>> logit_margin_l1_loss(logits, torch.tensor([0, 1]), reduction="none")
        tensor([0.1000, 0.5514])
    """
    m = _number(margin, "margin", low=0)
    a = _number(alpha, "alpha", low=0)
    check_choice(ignored_rows, "ignored_rows", {"reference", "drop"})
    check_choice(reduction, "reduction", REDUCTIONS)
    _refuse_weight_and_smoothing("MbLS margin", weight, label_smoothing)
    ignore_index = check_ignore_index(ignore_index)
    reference_keeps_all = ignored_rows == "reference" and (ignore_index is None or ignore_index < 0)
    fused = penalised_cross_entropy(logits, targets, "mbls", [a, m], ignore_index, reference_keeps_all, reduction)
    if fused is not None:
        return fused
    with _autocast_off(logits):
        rows, _, ce = _ce_rows(logits, targets, ignore_index)
        k = rows.logits.shape[1]
        penalty = _TopGapPenalty.apply(rows.logits, 1.0, -m, 1.0 / k, 1.0 / k, 1, True)[0]
        return _reduce_penalised(ce, penalty, a, rows, reduction, None if reference_keeps_all else "rows")


def mbls_alpha(
    alpha: float,
    epoch: int,
    schedule: str = "",
    mu: float = 0.0,
    max_alpha: float = 100.0,
    step_size: int = 100,
) -> float:
    """MbLS's α in force during ``epoch`` (0-based) under the released code's schedule, called once at the end
    of each epoch e = 0, 1, ...: "add" α ← min(α + μ, max_alpha); "multiply" α ← min(α·μ, max_alpha); "step"
    the multiply update when (e + 1) % step_size == 0; "" (every number of the paper) keeps α.

    Example:
        >>> mbls_alpha(0.1, 3, "add", mu=0.1)
        0.4
        >>> mbls_alpha(0.1, 250, "step", mu=10, step_size=100)  # after epochs 99 and 199
        10.0
    """
    value = check_float(alpha, "alpha", low=0)
    check_choice(schedule, "schedule", set(MBLS_SCHEDULES))
    mu = check_float(mu, "mu")
    max_alpha = check_float(max_alpha, "max_alpha", low=0)
    step_size = check_positive_int(step_size, "step_size")
    epoch = check_positive_int(epoch, "epoch", minimum=0)
    for e in range(epoch if schedule else 0):
        if schedule == "add":
            value = min(value + mu, max_alpha)
        elif schedule == "multiply" or (e + 1) % step_size == 0:
            value = min(value * mu, max_alpha)
    return value


# -- Poly-1 --------------------------------------------------------------------------------------------------


def poly1_cross_entropy(
    logits,
    targets,
    epsilon: float = 1.0,
    *,
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    r"""Poly-1 cross entropy (Leng et al., ICLR 2022): :math:`-\log p_t + \varepsilon (1 - p_t)`.

    Against a target distribution q (soft targets, or the smoothed labels (1 − α)·onehot + α/K of
    ``label_smoothing`` α) it is Σ_k q_k (−log p_k + ε(1 − p_k)), the paper's listing with smoothed labels
    (SPEC §8: the smoothed 1 − p_t is Σ_k q_k(1 − p_k), not 1 − p_y). Class ``weight`` as
    ``F.cross_entropy`` (decision 96): w_y·loss, each class's term weighted against a distribution, and
    ``"mean"`` divides by Σ w_y over the kept labels (by the number of rows against soft targets). The full
    gradient flows through p_t. 1 − p_t is computed as −expm1(log p_t).

    Args:
        epsilon: ε >= −1 (1.0, the library default; the paper tunes it per task).

    Example:
        >>> import torch
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
        >>> poly1_cross_entropy(logits, torch.tensor([0, 1]), reduction="none")
        tensor([0.2461, 0.5822])
    """
    eps = _number(epsilon, "epsilon", low=-1)
    smoothing = check_label_smoothing(label_smoothing)
    check_choice(reduction, "reduction", REDUCTIONS)
    ignore_index = check_ignore_index(ignore_index)
    if not smoothing and type(logits) is torch.Tensor and logits.ndim >= 2 and logits.dtype in _FUSED:
        # integer labels without smoothing: CE + ε(1 − p_y), weighted by w_y, through the C++ operator
        w = None if weight is None else check_class_weight(weight, logits)
        fused = penalised_cross_entropy(logits, targets, "poly1", [eps], ignore_index, False, reduction, w, False)
        if fused is not None:
            return fused[0]
    with _autocast_off(logits):
        rows = loss_rows(logits, targets, ignore_index)
        w = check_class_weight(weight, rows.logits)
        log_p = torch.log_softmax(rows.logits, 1)
        if not (rows.soft or smoothing):
            log_pt = log_p.gather(1, rows.targets[:, None])[:, 0]
            return reduce_rows(-log_pt - eps * torch.expm1(log_pt), rows, reduction, w)
        q = smoothed_targets(rows, smoothing)
        if w is not None:
            q = q * w
        loss = (q * (-log_p - eps * torch.expm1(log_p))).sum(1)
        if rows.soft or w is None or reduction != "mean":
            return reduce_rows(loss, rows, reduction)
        # smoothed labels with weights: each class's term weighted, "mean" over the labels' weights
        label_w = w[rows.targets]
        if rows.keep is not None:
            loss = torch.where(rows.keep, loss, loss.new_zeros(()))
            label_w = torch.where(rows.keep, label_w, label_w.new_zeros(()))
        return ordered_sum(loss) / ordered_sum(label_w)


# -- confidence penalty -------------------------------------------------------------------------------------


def confidence_penalty_loss(
    logits,
    targets,
    beta: float = 1.0,
    *,
    eps: float = 1e-6,
    form: str = "sample",
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    r"""Confidence penalty (Pereyra et al. 2017): cross entropy minus β times the entropy of p.

    ``form="sample"`` (the default; torch-uncertainty's ``ConfidencePenaltyLoss``, decision 134): per sample
    :math:`\mathrm{CE}_i + \beta (\log K + \sum_k p_{ik} \log(p_{ik} + \epsilon))`, i.e. CE − β·H(p) + β log K
    with ``eps`` = 1e-6 inside the log as that code (``eps=0`` takes the exact log-softmax); the constant
    β log K makes the penalty 0 at the uniform distribution and changes no gradient. ``form="mbls"`` is the
    MbLS repository's baseline ``penalty_ent``: CE − β·mean_{i,k}(−p̃ log p̃) with p̃ = clamp(p, 1e-10,
    1 − 1e-10), an entropy averaged over N·K (so β acts as β/K per sample; the paper used β = 0.1 there) and
    no constant. Ignored rows leave both terms; soft targets enter the cross entropy. Class ``weight`` and
    ``label_smoothing`` are refused.

    Example:
        >>> import torch
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 0.0]])
        >>> confidence_penalty_loss(logits, torch.tensor([0, 1]), reduction="none")
        tensor([0.4547, 0.6931])
    """
    b = _number(beta, "beta", low=0)
    eps = _number(eps, "eps", low=0)
    check_choice(form, "form", {"sample", "mbls"})
    check_choice(reduction, "reduction", REDUCTIONS)
    _refuse_weight_and_smoothing("confidence penalty", weight, label_smoothing)
    ignore_index = check_ignore_index(ignore_index)
    fused = penalised_cross_entropy(
        logits, targets, "confidence-penalty", [b, eps, form == "mbls"], ignore_index, False, reduction
    )
    if fused is not None:
        return fused
    with _autocast_off(logits):
        rows, log_p, ce = _ce_rows(logits, targets, ignore_index)
        p = log_p.exp()
        k = p.shape[1]
        if form == "mbls":
            pc = p.clamp(1e-10, 1 - 1e-10)
            penalty = (pc * pc.log()).sum(1) / k  # −(entropy averaged over the K entries)
        else:
            neg_entropy = (p * (log_p if eps == 0 else torch.log(p + eps))).sum(1)
            penalty = math.log(k) + neg_entropy
        return _reduce_penalised(ce, penalty, b, rows, reduction)


# -- MaxSup --------------------------------------------------------------------------------------------------


def maxsup_loss(
    logits,
    targets,
    alpha: float = 0.1,
    *,
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    r"""Max suppression, MaxSup (Zhou et al. 2025): :math:`\mathrm{CE}_i + \alpha (\max_k z_{ik} -
    \frac{1}{K}\sum_k z_{ik})`.

    It is label smoothing's logit-level term α(z_y − mean_k z) with the target logit replaced by the top
    logit, so it penalises the top logit whether the prediction is right or wrong. As the official code, no
    label smoothing is combined with it (``label_smoothing`` is refused, decision 135); the gradient flows
    through the max and the mean. The official schedule raises α linearly over the epochs (0.1 → 0.2): see
    :class:`~torchcal.losses.MaxSupLoss`; this function takes the α in force. Ignored rows leave both terms;
    soft targets enter the cross entropy. Class ``weight`` is refused.

    Example:
        >>> import torch
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
        >>> maxsup_loss(logits, torch.tensor([0, 0]), reduction="none")
        tensor([0.2269, 1.3633])
    """
    a = _number(alpha, "alpha", low=0)
    check_choice(reduction, "reduction", REDUCTIONS)
    _refuse_weight_and_smoothing("MaxSup", weight, label_smoothing)
    ignore_index = check_ignore_index(ignore_index)
    fused = penalised_cross_entropy(logits, targets, "maxsup", [a], ignore_index, False, reduction)
    if fused is not None:
        return fused
    with _autocast_off(logits):
        rows, _, ce = _ce_rows(logits, targets, ignore_index)
        z = rows.logits
        # the mean in float64, as the operator: a float32 row's sum may overflow (equal logits near 3e38)
        penalty = z.max(dim=1).values - z.mean(1, dtype=torch.float64).to(z.dtype)
        return _reduce_penalised(ce, penalty, a, rows, reduction)


def _device_type(logits) -> str:
    return logits.device.type if isinstance(logits, torch.Tensor) else "cpu"


_NO_CONTEXT = contextlib.nullcontext()


def _autocast_off(logits):
    """The context in which a loss computes in its inputs' dtype: autocast disabled on the logits' device
    where it is enabled, else nothing to leave (entering and leaving ``torch.autocast`` costs ~4 µs, a tenth of
    a small batch's step); always the autocast context while torch.compile traces."""
    device = _device_type(logits)
    if torch.compiler.is_compiling() or torch.is_autocast_enabled(device):
        return torch.autocast(device, enabled=False)
    return _NO_CONTEXT


# -- ACLS ----------------------------------------------------------------------------------------------------


def acls_loss(
    logits,
    targets,
    alpha: float = 0.1,
    margin: float = 10.0,
    *,
    lambda_pos: float = 1.0,
    lambda_neg: float = 0.1,
    ignored_rows: str = "reference",
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    r"""Adaptive and conditional label smoothing, ACLS (Park et al., ICCV 2023), as the released code
    (cvlab-yonsei/ACLS ``acls.py``, decision 138): cross entropy plus α times

    .. math:: \lambda_{pos} \frac{1}{N} \sum_{i,k} 1[z_{ik} = z_i^{max}]\, \mathrm{relu}(z_i^{max} - m)^2
              + \lambda_{neg} \frac{1}{N(K-1)} \sum_{i,k} (1 - 1[z_{ik} = z_i^{max}])\,
              \mathrm{relu}(\mathrm{sg}(z_i^{max}) - z_{ik} - m)^2 .

    The positive term penalises the **absolute** top logit above m and keeps its gradient; the negative term
    detaches the max, so only the other logits get a gradient. The indicator compares detached logits, so
    tied maxima are each "positive" while the divisor stays N. ``ignored_rows`` as
    :func:`logit_margin_l1_loss`: the released code never filters its regulariser, so by default
    ("reference") it covers the rows labelled ``ignore_index`` whatever its sign, while cross entropy leaves
    them out; "drop" leaves them out of both. Soft targets enter the cross entropy. Class ``weight`` and
    ``label_smoothing`` are refused.

    Args:
        alpha: α >= 0 (0.1, config ``acls.yaml``); margin: m >= 0 (10); lambda_pos (1.0), lambda_neg (0.1).

    Example:
        >>> import torch
        >>> logits = torch.tensor([[12.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
        >>> # row 1: 1·(12 − 10)² + 0.1·(2² + 3²)/2 = 4.65, times α
        >>> acls_loss(logits, torch.tensor([0, 1]), reduction="none")
        tensor([0.4650, 0.5514])
    """
    a = _number(alpha, "alpha", low=0)
    m = _number(margin, "margin", low=0)
    lam_pos = _number(lambda_pos, "lambda_pos", low=0)
    lam_neg = _number(lambda_neg, "lambda_neg", low=0)
    check_choice(ignored_rows, "ignored_rows", {"reference", "drop"})
    check_choice(reduction, "reduction", REDUCTIONS)
    _refuse_weight_and_smoothing("ACLS regulariser", weight, label_smoothing)
    ignore_index = check_ignore_index(ignore_index)
    fused = penalised_cross_entropy(
        logits, targets, "acls", [a, m, lam_pos, lam_neg], ignore_index, ignored_rows == "reference", reduction
    )
    if fused is not None:
        return fused
    with _autocast_off(logits):
        rows, _, ce = _ce_rows(logits, targets, ignore_index)
        z = rows.logits
        k = z.shape[1]
        # the negative term with the max detached; the tied maxima's own distance is −m <= 0, so the hinge
        # leaves them out. The max returned keeps its gradient for the positive term.
        neg, top, _ = _TopGapPenalty.apply(z, 1.0, -m, 1.0 / (k - 1), 1.0 / (k - 1), 2, False)
        ties = (z.detach() == top.detach()[:, None]).sum(1).to(z.dtype)  # every tied maximum is positive
        pos = ties * torch.relu(top - m) ** 2
        penalty = lam_pos * pos + lam_neg * neg
        return _reduce_penalised(
            ce, penalty, a, rows, reduction, None if ignored_rows == "reference" else "rows"
        )


# -- batch-level penalties: MDCA and DCA ---------------------------------------------------------------------

_DCA_NEEDS_LABELS = "DCA compares the confidence with the accuracy of the predicted class, which needs labels"
_MDCA_IS_A_BATCH_TERM = (
    "MDCA's penalty is a statistic of the whole batch, which class weights and smoothed targets do not define "
    "(the MDCA repository's own smoothing is base='ls')"
)
MDCA_BASES = ("nll", "focal", "ls")


def _global_sums(sums: torch.Tensor, sync: bool, group=None) -> torch.Tensor:
    """``sums`` (local per-batch sums) summed over the ranks of ``group`` when ``sync`` and torch.distributed
    is initialised (a differentiable all-reduce: each rank's gradient is the world size times its share of
    the global term's gradient, which data-parallel gradient averaging divides back); the local sums
    otherwise (one process is its own global batch)."""
    if not sync:
        return sums
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return sums
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(sums, op=dist.ReduceOp.SUM, group=group)


def _kept_count(count: torch.Tensor) -> torch.Tensor:
    """A batch statistic's divisor, the number of kept positions ``count``, taken as 1 when none is kept (the
    sums are then 0, and a 0/0 would put NaN into every row's gradient, also where the reductions mask the
    term); :func:`_when_kept` then makes the statistic NaN."""
    return torch.where(count > 0, count, torch.ones_like(count))


def _when_kept(value: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``value``, or NaN with a zero gradient when no position is kept: "sum" and "none" then give 0 and
    "mean" NaN, each with the zero gradient of ``F.cross_entropy``."""
    return torch.where(count > 0, value, torch.full_like(value, math.nan))


def _with_batch_term(base, rows, reduction, coef, penalty, weight=None):
    """Per-row ``base`` plus the batch's ``coef·penalty``: "mean" is the base's mean (weighted as
    ``F.cross_entropy`` with ``weight``) + coef·penalty, "none" gives every kept row base_i + coef·penalty
    (ignored rows 0), "sum" is the sum of "none"."""
    if reduction == "mean":
        return reduce_rows(base, rows, "mean", weight) + coef * penalty
    term = coef * penalty
    if rows.keep is not None:
        term = torch.where(rows.keep, term, term.new_zeros(()))
    else:
        term = term.expand(base.shape)
    none = reduce_rows(base, rows, "none", weight) + term.reshape(rows.shape)
    return none if reduction == "none" else ordered_sum(none)


class _Batch(NamedTuple):
    """What the batch-term losses read of their rows: ``rows`` (:class:`LossRows` whose targets are (M,) labels
    with ignored ones 0, or soft targets), the per-row ``base`` loss, top-label confidence ``conf`` r_i (with
    gradient), correctness ``correct`` a_i (a constant), ``kept`` (1.0 / 0.0), ``entropy`` H_i and ``colsum``
    Σ_i kept_i p_i (K); None where not asked for."""

    rows: LossRows
    base: torch.Tensor | None
    conf: torch.Tensor | None
    correct: torch.Tensor | None
    kept: torch.Tensor
    entropy: torch.Tensor | None
    colsum: torch.Tensor | None


def _focal_power(u, gamma):
    """u^γ of u = 1 − p for the focal base, u clamped at float's tiny as the dual focal ablation's
    (functional/losses.py): where u = 0 (p = 1 to the dtype, log p = 0) the clamp passes no gradient, the
    term's limit (−γ u^γ), where 0^(γ−1) = inf (0 < γ < 1) times log p = 0 was NaN."""
    return u.clamp(min=torch.finfo(u.dtype).tiny) ** gamma


def _given(value: torch.Tensor | None) -> torch.Tensor:
    """A per-row number of :class:`_Batch` that the loss asked :func:`_batch` for (so never None)."""
    assert value is not None
    return value


def _batch(
    logits, targets, ignore_index, reduction, soft_refusal=None, *, base: str | None = "nll", gamma=1.0,
    alpha=0.0, top=True, entropy=None, colsum=False,
) -> _Batch:  # fmt: skip
    """The per-row numbers of a batch-term loss: by the C++ operator where it applies (CPU float32/64 logits,
    integer labels; decision 202), else by the torch path below, the reference. ``base``: "nll" (cross
    entropy), "focal" (−(1 − p_t)^γ log p_t), "ls" (the MDCA repository's label smoothing with α) or None;
    ``entropy``: None, "avuc" (−Σ p log(p + 1e-10)) or "smoothed" (of (1 − 1e-5)p + 1e-5/K). The caller
    has checked ``ignore_index`` and ``reduction``."""
    fused = batch_rows(logits, targets, ignore_index, reduction, base or "nll", gamma, alpha, entropy, colsum)
    if fused is not None:
        base_loss, conf, correct, h, col = fused
        shape = tuple(targets.shape)
        labels = targets.reshape(-1)
        keep = None
        if ignore_index is not None:
            keep = labels != ignore_index
            labels = labels.masked_fill(~keep, 0)
        kept = base_loss.new_ones(()).expand(labels.shape) if keep is None else keep.to(base_loss.dtype)
        rows = LossRows(logits, labels.long(), keep, shape)
        return _Batch(rows, base_loss if base else None, conf if top else None, correct if top else None, kept,
                      h if entropy else None, col if colsum else None)  # fmt: skip
    rows = loss_rows(logits, targets, ignore_index, soft_refusal=soft_refusal)
    log_p = torch.log_softmax(rows.logits, 1)
    kept = log_p.new_ones(log_p.shape[0]) if rows.keep is None else rows.keep.to(log_p.dtype)
    p = log_p.exp() if entropy or colsum or (rows.soft and base == "focal") else None
    loss = None
    if base is not None:
        k = log_p.shape[1]
        if rows.soft:
            q = rows.targets
            factor = 1.0 if base == "nll" else _focal_power(-torch.expm1(log_p), gamma)
            loss = -(q * factor * log_p).sum(1)
        else:
            log_pt = log_p.gather(1, rows.targets[:, None])[:, 0]
            if base == "nll":
                loss = -log_pt
            elif base == "focal":
                loss = -_focal_power(-torch.expm1(log_pt), gamma) * log_pt
            else:
                others = log_p.sum(1) - log_pt
                loss = -(1 - alpha) * log_pt - alpha / (k - 1) * others
    conf = correct = None
    if top:
        conf, correct, _ = _correct_and_kept(rows, log_p)
    h = None
    if entropy == "avuc":
        h = -(_given(p) * torch.log(_given(p) + 1e-10)).sum(1)
    elif entropy == "smoothed":
        smoothed = (1 - 1e-5) * _given(p) + 1e-5 / log_p.shape[1]
        h = -(smoothed * smoothed.log()).sum(1)
    colsums = ordered_sum(kept[:, None] * _given(p), 0) if colsum else None
    return _Batch(rows, loss, conf, correct, kept, h, colsums)


def mdca_penalty(logits, targets, *, sync: bool = False, group=None, ignore_index: int | None = IGNORE_INDEX):
    r"""The multi-class difference in confidence and accuracy of a batch (Hebbalaguppe et al., CVPR 2022):
    :math:`\frac{1}{K} \sum_k \bigl| \frac{1}{N}\sum_i p_{ik} - \frac{1}{N}\sum_i 1[y_i = k] \bigr|`, the
    batch-mean probability of every class against the class frequency of the **labels** (soft targets: their
    mean). The gradient flows through every p_ik. Positions labelled ``ignore_index`` are not part of the
    batch (none kept: the term is NaN and passes no gradient, so the loss's "sum" and "none" are 0 with a
    zero gradient, as ``F.cross_entropy``; the same for DCA and SB-ECE); (N, K, d1, ...) inputs are
    flattened to positions (a spec choice; the reference takes (N, K)).

    Under data parallelism the reference's term is that of each rank's batch (``sync=False``); ``sync=True``
    sums the class totals over the ranks of ``group`` (a differentiable all-reduce), the term of the global
    batch, every rank's value the same.

    Example:
        >>> import torch
        >>> # class means of p (0.575, 0.425) against the label frequencies (1, 0)
        >>> mdca_penalty(torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 0]))
        tensor(0.4251)
    """
    with _autocast_off(logits):
        batch = _batch(logits, targets, check_ignore_index(ignore_index), "mean", base=None, top=False, colsum=True)
        return _mdca_term(batch, sync, group)


def _mdca_term(batch: _Batch, sync, group):
    rows, kept, colsum = batch.rows, batch.kept, _given(batch.colsum)
    k = colsum.shape[0]
    # the label counts by a scatter of the (N,) mask, not an (N, K) one-hot matrix
    if rows.soft:
        labels = ordered_sum(kept[:, None] * rows.targets, 0)
    else:
        labels = kept.new_zeros(k).index_add(0, rows.targets, kept)
    sums = torch.cat([colsum, labels, ordered_sum(kept)[None]])
    sums = _global_sums(sums, sync, group)
    count = sums[-1]
    return _when_kept(((sums[:k] - sums[k : 2 * k]) / _kept_count(count)).abs().mean(), count)


def mdca_loss(
    logits,
    targets,
    beta: float = 1.0,
    *,
    base: str = "nll",
    gamma: float = 1.0,
    smoothing: float = 0.1,
    sync: bool = False,
    group=None,
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    r"""A classification loss plus β·MDCA of the batch (:func:`mdca_penalty`; Hebbalaguppe et al. 2022).

    ``base`` (the MDCA repository's ``ClassficationAndMDCA``): "nll" (cross entropy, NLL+MDCA, the default),
    "focal" (−(1 − p_t)^γ log p_t with ``gamma``, 1 in the FL+MDCA preset), "ls" (the repository's label
    smoothing: 1 − α on the label and α/(K − 1) on each other class, α = ``smoothing`` = 0.1, which is
    **not** PyTorch's ``label_smoothing``; decision 137). β = 1 in every script. The MDCA term belongs to
    the batch: "mean" is base.mean() + β·MDCA, "none" gives every kept position base_i + β·MDCA, "sum" the
    sum of "none"; ignored positions leave both terms. Soft targets (bases "nll" and "focal") enter the base
    loss and the class frequencies. Class ``weight`` and ``label_smoothing`` are refused. ``sync`` as in
    :func:`mdca_penalty` (DDP: per-rank batch by default).

    Example:
        >>> import torch
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
        >>> mdca_loss(logits, torch.tensor([0, 1]))
        tensor(0.2950)
        >>> mdca_loss(logits, torch.tensor([0, 0]), base="ls")
        tensor(1.1952)
    """
    b = _number(beta, "beta", low=0)
    check_choice(base, "base", set(MDCA_BASES))
    gamma = _number(gamma, "gamma", low=0)
    alpha = _number(smoothing, "smoothing", low=0, high=1)
    check_choice(reduction, "reduction", REDUCTIONS)
    if weight is not None:
        raise ValueError(f"`weight` is not accepted: {_MDCA_IS_A_BATCH_TERM}")
    check_label_smoothing(label_smoothing, _MDCA_IS_A_BATCH_TERM)
    ignore_index = check_ignore_index(ignore_index)
    refusal = "the MDCA repository's label smoothing is defined on labels" if base == "ls" else None
    with _autocast_off(logits):
        fused = batch_loss(logits, targets, ignore_index, reduction, "mdca", [b], base=base, gamma=gamma, alpha=alpha,
                           sync=sync)  # fmt: skip
        if fused is not None:
            return fused[0]
        batch = _batch(logits, targets, ignore_index, reduction, refusal, base=base, gamma=gamma, alpha=alpha,
                       top=False, colsum=True)  # fmt: skip
        return _with_batch_term(_given(batch.base), batch.rows, reduction, b, _mdca_term(batch, sync, group))


def dca_loss(
    logits,
    targets,
    beta: float = 10.0,
    *,
    sync: bool = False,
    group=None,
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    r"""Cross entropy plus the difference between confidence and accuracy, DCA (Liang et al., BMVC 2020):
    :math:`\mathrm{CE} + \beta \cdot \bigl| \frac{1}{N}\sum_i r_i - \frac{1}{N}\sum_i a_i \bigr|`, with r_i
    the top-label probability and a_i = 1[argmax_k p_ik = y_i] a constant; the gradient flows only through
    r. β = 10, the default of the official ``cross_entropy_with_dca_loss`` (its demo uses 25; the MDCA
    repository's baseline 1; decision 137). Class ``weight`` enters the cross entropy as in the official
    function (``F.cross_entropy``'s weighted mean), not the batch term. "mean" is CE + β·DCA, "none" gives
    every kept position CE_i (weighted) + β·DCA, "sum" the sum of "none"; ignored positions leave both terms.
    Soft targets and ``label_smoothing`` are refused. Under data parallelism the reference's term is each
    rank's batch (``sync=False``); ``sync=True`` takes the means over the global batch (see
    :func:`mdca_penalty`).

    Example:
        >>> import torch
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
        >>> dca_loss(logits, torch.tensor([0, 0]))  # mean confidence 0.805, accuracy 0.5
        tensor(3.7794)
    """
    b = _number(beta, "beta", low=0)
    check_choice(reduction, "reduction", REDUCTIONS)
    check_label_smoothing(label_smoothing, _DCA_NEEDS_LABELS)
    ignore_index = check_ignore_index(ignore_index)
    with _autocast_off(logits):
        fused = None if weight is not None else batch_loss(logits, targets, ignore_index, reduction, "dca", [b], sync=sync)
        if fused is not None:
            return fused[0]
        batch = _batch(logits, targets, ignore_index, reduction, _DCA_NEEDS_LABELS)
        conf, correct, kept = _given(batch.conf), _given(batch.correct), batch.kept
        w = check_class_weight(weight, batch.rows.logits)
        sums = _global_sums(
            torch.stack([ordered_sum(conf * kept), ordered_sum(correct * kept), ordered_sum(kept)]),
            sync,
            group,
        )
        penalty = _when_kept(((sums[0] - sums[1]) / _kept_count(sums[2])).abs(), sums[2])
        return _with_batch_term(_given(batch.base), batch.rows, reduction, b, penalty, w)


# -- SB-ECE --------------------------------------------------------------------------------------------------

_SBECE_NEEDS_LABELS = "SB-ECE compares the confidence with the correctness of the predicted class"
_SBECE_IS_A_BATCH_TERM = (
    "SB-ECE is a statistic of the whole batch, which class weights and smoothed targets do not define"
)


def _safe_sqrt(value: torch.Tensor) -> torch.Tensor:
    """sqrt(max(value, 0)) with a zero (not infinite) gradient at and below 0; NaN stays NaN (a NaN logit's
    term is NaN, as on the operator)."""
    return torch.where(value <= 0, value.new_zeros(()), value.clamp(min=torch.finfo(value.dtype).tiny).sqrt())


def _sbece_term(batch: _Batch, n_bins, temperature, form, sync, group):
    conf, correct, kept = _given(batch.conf), _given(batch.correct), batch.kept
    if form == "label":
        fused = sbece_label(conf, correct, kept, n_bins, temperature, sync)
        if fused is not None:
            return fused
    centres = (torch.arange(n_bins, dtype=conf.dtype, device=conf.device) + 0.5) / n_bins
    g = ordered_softmax(-((conf[:, None] - centres) ** 2) / temperature) * kept[:, None]  # (M rows, bins)
    if form == "label":
        sums = _global_sums(
            torch.cat([ordered_sum(g, 0), ordered_sum(g * correct[:, None], 0), ordered_sum(kept)[None]]),
            sync,
            group,
        )
        mass, hits, count = sums[:n_bins], sums[n_bins : 2 * n_bins], sums[-1]
        acc = hits / torch.where(mass > 0, mass, torch.ones_like(mass))
        total = _global_sums(ordered_sum(g * (acc - conf[:, None]) ** 2)[None], sync, group)[0]
        return _when_kept(_safe_sqrt(total / _kept_count(count)), count)
    sums = _global_sums(
        torch.cat(
            [ordered_sum(g, 0), ordered_sum(g * conf[:, None], 0), ordered_sum(g * correct[:, None], 0)]
        ),
        sync,
        group,
    )
    mass, conf_sum, hits = sums[:n_bins], sums[n_bins : 2 * n_bins], sums[2 * n_bins :]
    safe = mass.clamp(min=1e-5)
    total = mass.sum()  # (the number of kept positions, to rounding)
    weights = mass / _kept_count(total)
    return _when_kept(_safe_sqrt((weights * (conf_sum / safe - hits / safe) ** 2).sum()), total)


def sbece_penalty(
    logits,
    targets,
    *,
    n_bins: int = 15,
    temperature: float = 0.01,
    form: str = "label",
    sync: bool = False,
    group=None,
    ignore_index: int | None = IGNORE_INDEX,
):
    r"""Soft-binned ECE of a batch (Karandikar et al., NeurIPS 2021), on the top-label confidences r_i (with
    gradient) and the correctness a_i (a constant). Memberships g_bi = softmax_b(−(r_i − ξ_b)²/T) over the
    bin centres ξ_b = (b − ½)/M, S_b = Σ_i g_bi.

    ``form="label"`` (default; the label-binned p = 2 form of the ESD authors' re-implementation, SPEC §8,
    decision 139): A_b = Σ_i g_bi a_i / S_b (an empty bin's S_b taken as 1) and
    sqrt((1/N) Σ_b Σ_i g_bi (A_b − r_i)²). ``form="binned"`` (uncertainty-baselines'
    ``get_soft_binning_ece_tensor``): C_b and A_b are the g-weighted means of r and a (S_b floored at 1e-5),
    w_b = S_b / Σ_b S_b and sqrt(Σ_b w_b (C_b − A_b)²). The sqrt has a zero gradient at 0. Positions labelled
    ``ignore_index`` are not part of the batch. Under data parallelism the term is each rank's batch;
    ``sync=True`` takes it over the global batch (differentiable all-reduces of the bin sums).

    Example:
        >>> import torch
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
        >>> sbece_penalty(logits, torch.tensor([0, 1, 1]))
        tensor(0.1748)
    """
    n_bins = check_positive_int(n_bins, "n_bins")
    temperature = _number(temperature, "temperature", low=0, low_open=True)
    check_choice(form, "form", {"label", "binned"})
    with _autocast_off(logits):
        batch = _batch(logits, targets, check_ignore_index(ignore_index), "mean", _SBECE_NEEDS_LABELS, base=None)
        return _sbece_term(batch, n_bins, temperature, form, sync, group)


def sbece_loss(
    logits,
    targets,
    lambda_: float = 2.0,
    *,
    n_bins: int = 15,
    temperature: float = 0.01,
    form: str = "label",
    sync: bool = False,
    group=None,
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    r"""Cross entropy + λ·SB-ECE of the batch (:func:`sbece_penalty`). λ = 2, M = 15, T = 0.01 are the ESD
    authors' re-implementation's settings (the SB-ECE authors released no training configuration; decision
    139). The term belongs to the batch: "mean" is CE.mean() + λ·SB-ECE, "none" gives every kept position
    CE_i + λ·SB-ECE, "sum" the sum of "none". Soft targets, class ``weight`` and ``label_smoothing`` are
    refused. Per-rank batch under data parallelism unless ``sync=True``.

    Example:
        >>> import torch
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
        >>> sbece_loss(logits, torch.tensor([0, 1, 1]))
        tensor(0.9341)
    """
    lam = _number(lambda_, "lambda_", low=0)
    n_bins = check_positive_int(n_bins, "n_bins")
    temperature = _number(temperature, "temperature", low=0, low_open=True)
    check_choice(form, "form", {"label", "binned"})
    check_choice(reduction, "reduction", REDUCTIONS)
    if weight is not None:
        raise ValueError(f"`weight` is not accepted: {_SBECE_IS_A_BATCH_TERM}")
    check_label_smoothing(label_smoothing, _SBECE_IS_A_BATCH_TERM)
    ignore_index = check_ignore_index(ignore_index)
    with _autocast_off(logits):
        if form == "label":
            params = [lam, n_bins, temperature]
            fused = batch_loss(logits, targets, ignore_index, reduction, "sb-ece", params, sync=sync)
            if fused is not None:
                return fused[0]
        batch = _batch(logits, targets, ignore_index, reduction, _SBECE_NEEDS_LABELS)
        penalty = _sbece_term(batch, n_bins, temperature, form, sync, group)
        return _with_batch_term(_given(batch.base), batch.rows, reduction, lam, penalty)


# -- AvUC and S-AvUC -----------------------------------------------------------------------------------------

_AVUC_NEEDS_LABELS = "AvUC compares the uncertainty with the correctness of the predicted class"
_AVUC_IS_A_BATCH_TERM = (
    "AvUC is a statistic of the whole batch, which class weights and smoothed targets do not define"
)


def _correct_and_kept(rows, log_p):
    """Top-label confidence r_i, correctness a_i (constant) and the kept mask (1.0 / 0.0) of the rows, from
    the log-probabilities (r = exp(max log p): no (N, K) exponential for the top label alone)."""
    top, pred = log_p.max(1)
    correct = (pred == rows.targets).to(log_p.dtype)
    kept = log_p.new_ones(log_p.shape[0]) if rows.keep is None else rows.keep.to(log_p.dtype)
    return top.exp(), correct, kept


def _pair_sums(weights: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """(4,) sums over the rows of weights[:, a]·parts[:, b] for a, b in {0, 1} (a-major), in the order of
    :func:`ordered_sum` (a matrix product's would depend on the thread count)."""
    return ordered_sum((weights[:, :, None] * parts[:, None, :]).reshape(-1, 4), 0)


def _avuc_term(batch: _Batch, threshold, sync, group, statistics=False):
    """AvUC of the rows; with ``statistics``, (AvUC, the detached (Σ H over the correct predictions, their
    count, Σ H over the wrong ones, their count) of the kept rows: the threshold update's sums)."""
    conf, correct, kept, entropy = _given(batch.conf), _given(batch.correct), batch.kept, _given(batch.entropy)
    entropy_sums = None
    if statistics:
        h = entropy.detach()
        right, wrong_kept = correct * kept, (1 - correct) * kept
        entropy_sums = torch.stack(
            [ordered_sum(h * right), ordered_sum(right), ordered_sum(h * wrong_kept), ordered_sum(wrong_kept)]
        )
    t = torch.tanh(entropy)
    certain = (entropy <= threshold).to(entropy.dtype)
    right = kept * correct
    # [[n_AC, n_AU], [n_IC, n_IU]]: (accurate r, inaccurate 1 − r) against (certain 1 − tanh H, uncertain
    # tanh H), four sums over the rows in one (M, 4) product
    sums = _pair_sums(
        torch.stack([right * conf, (kept - right) * (1 - conf)], 1),
        torch.stack([certain * (1 - t), t - certain * t], 1),
    )
    sums = _global_sums(sums, sync, group)
    avu = (sums[0] + sums[3]) / (sums.sum() + 1e-10)
    penalty = -torch.log(avu + 1e-10)
    return (penalty, entropy_sums) if statistics else penalty


def avuc_penalty(
    logits, targets, *, threshold: float | torch.Tensor = 1.0, sync: bool = False, group=None, ignore_index: int | None = IGNORE_INDEX
):
    r"""The accuracy-versus-uncertainty calibration term of a batch, AvUC (Krishnan & Tickoo, NeurIPS 2020),
    as the released code (IntelLabs/AVUC ``AvULoss``): with H_i = −Σ_k p_ik log(p_ik + 1e-10), r_i the
    top-label probability and a_i its correctness, a position is *certain* when H_i <= ``threshold`` (u_th);
    n_AC = Σ_{accurate, certain} r_i(1 − tanh H_i), n_AU = Σ_{accurate, uncertain} r_i tanh H_i,
    n_IC = Σ_{inaccurate, certain} (1 − r_i)(1 − tanh H_i), n_IU = Σ_{inaccurate, uncertain} (1 − r_i) tanh H_i,
    and the term is −log(AvU + 1e-10) with AvU = (n_AC + n_IU) / (n_AC + n_AU + n_IC + n_IU + 1e-10). The
    partition and a_i are constants; the gradient flows through r_i and H_i. ``threshold`` may be a 0-d
    tensor (:class:`~torchcal.losses.AvUCLoss` keeps it as state). Positions labelled ``ignore_index`` are not
    part of the batch. Under data parallelism the reference's term is each rank's batch (``sync=False``);
    ``sync=True`` sums the four counts over the ranks of ``group`` (the global batch).

    Example:
        >>> import torch
        >>> logits = torch.tensor([[3.0, 0.0], [0.0, 0.2], [2.0, 0.0]])
        >>> avuc_penalty(logits, torch.tensor([0, 1, 1]))
        tensor(0.0750)
    """
    with _autocast_off(logits):
        batch = _batch(logits, targets, check_ignore_index(ignore_index), "mean", _AVUC_NEEDS_LABELS, base=None,
                       entropy="avuc")  # fmt: skip
        return _avuc_term(batch, _threshold(threshold), sync, group)


def _threshold(threshold):
    if isinstance(threshold, torch.Tensor):
        return threshold
    return _number(threshold, "threshold", low=0)


def _refuse_batch_term(reason: str, weight, label_smoothing) -> None:
    if weight is not None:
        raise ValueError(f"`weight` is not accepted: {reason}")
    check_label_smoothing(label_smoothing, reason)


def avuc_loss(
    logits,
    targets,
    beta: float = 3.0,
    *,
    threshold: float | torch.Tensor = 1.0,
    sync: bool = False,
    group=None,
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
    statistics: bool = False,
):
    r"""Cross entropy + β·AvUC of the batch (:func:`avuc_penalty`). β = 3 as the released training scripts
    (the class default there is 1); u_th = ``threshold`` (1.0, the scripts' start; the module
    :class:`~torchcal.losses.AvUCLoss` updates it as they do). "mean" is CE.mean() + β·AvUC, "none" gives every
    kept position CE_i + β·AvUC, "sum" the sum of "none". Soft targets, class ``weight`` and
    ``label_smoothing`` are refused. Per-rank batch under data parallelism unless ``sync=True``.
    ``statistics=True`` returns (loss, (Σ H of the correct predictions, their count, Σ H of the wrong ones,
    their count) over the kept positions, detached): the threshold update's sums from the same pass.

    Example:
        >>> import torch
        >>> logits = torch.tensor([[3.0, 0.0], [0.0, 0.2], [2.0, 0.0]])
        >>> avuc_loss(logits, torch.tensor([0, 1, 1]))
        tensor(1.1496)
    """
    b = _number(beta, "beta", low=0)
    check_choice(reduction, "reduction", REDUCTIONS)
    _refuse_batch_term(_AVUC_IS_A_BATCH_TERM, weight, label_smoothing)
    threshold = _threshold(threshold)
    ignore_index = check_ignore_index(ignore_index)
    with _autocast_off(logits):
        fused = batch_loss(logits, targets, ignore_index, reduction, "avuc", [b, threshold], sync=sync)
        if fused is not None:
            loss, sums = fused
            return (loss, sums[:4].to(logits.dtype)) if statistics else loss
        batch = _batch(logits, targets, ignore_index, reduction, _AVUC_NEEDS_LABELS, entropy="avuc")
        out = _avuc_term(batch, threshold, sync, group, statistics)
        penalty, sums = out if statistics else (out, None)
        loss = _with_batch_term(_given(batch.base), batch.rows, reduction, b, penalty)
        return (loss, sums) if statistics else loss


def _savuc_term(batch: _Batch, k, temperature, kappa, sync, group):
    correct, kept, entropy = _given(batch.correct), batch.kept, _given(batch.entropy)
    tiny = torch.finfo(entropy.dtype).eps
    e = (entropy / math.log(k)).clamp(tiny, 1 - tiny)  # (1 at a uniform row: its log-odds would be infinite)
    q = torch.sigmoid((torch.log(e / (1 - e)) - math.log(kappa / (1 - kappa))) / temperature)
    t = torch.tanh(entropy)
    right = kept * correct
    # [[n_AC, n_AU], [n_IC, n_IU]]: (accurate, inaccurate) against (certain (1 − q)(1 − tanh H), uncertain
    # q tanh H)
    sums = _pair_sums(torch.stack([right, kept - right], 1), torch.stack([(1 - q) * (1 - t), q * t], 1))
    sums = _global_sums(sums, sync, group)
    return torch.log1p((sums[1] + sums[2]) / (sums[0] + sums[3]).clamp(min=1e-5))


def soft_avuc_penalty(
    logits, targets, *, temperature: float, kappa: float, sync: bool = False, group=None,
    ignore_index: int | None = IGNORE_INDEX,
):  # fmt: skip
    r"""Soft AvUC of a batch, S-AvUC (Karandikar et al., NeurIPS 2021, eq. 15; uncertainty-baselines
    ``get_soft_avuc_loss``): with p' = (1 − 1e-5)p + 1e-5/K, H_i = −Σ_k p'_ik log p'_ik, e_i = H_i / log K and
    the soft uncertainty q_i = σ((logit(e_i) − logit(κ)) / T), n_AC = Σ_{accurate} (1 − q_i)(1 − tanh H_i),
    n_AU = Σ_{accurate} q_i tanh H_i, n_IC = Σ_{inaccurate} (1 − q_i)(1 − tanh H_i),
    n_IU = Σ_{inaccurate} q_i tanh H_i, and the term log(1 + (n_AU + n_IC) / max(n_AC + n_IU, 1e-5)). The
    confidence r_i does not enter (unlike AvUC). ``temperature`` T > 0 and ``kappa`` κ in (0, 1) have no
    published default (the reference code has none) and must be given. e_i is kept inside (0, 1) by the
    dtype's machine epsilon (an exactly uniform row would otherwise have infinite log-odds). Positions
    labelled ``ignore_index`` are not part of the batch; ``sync=True`` sums the counts over the ranks (global
    batch), the reference's term being each rank's batch.

    Example:
        >>> import torch
        >>> logits = torch.tensor([[3.0, 0.0], [0.0, 0.2], [2.0, 0.0]])
        >>> soft_avuc_penalty(logits, torch.tensor([0, 1, 1]), temperature=0.1, kappa=0.5)
        tensor(0.5362)
    """
    temperature = _number(temperature, "temperature", low=0, low_open=True)
    kappa = _kappa(kappa)
    with _autocast_off(logits):
        batch = _batch(logits, targets, check_ignore_index(ignore_index), "mean", _AVUC_NEEDS_LABELS, base=None,
                       entropy="smoothed")  # fmt: skip
        return _savuc_term(batch, _classes(logits), temperature, kappa, sync, group)


def _classes(logits) -> int:
    """K of checked logits (N, K, d1, ...)."""
    return logits.shape[1]


def _kappa(kappa):
    kappa = _number(kappa, "kappa", low=0, high=1, low_open=True)
    if not torch.compiler.is_compiling() and kappa >= 1:
        raise ValueError(f"`kappa` must lie in (0, 1), got {kappa!r}")
    return kappa


def soft_avuc_loss(
    logits,
    targets,
    beta: float = 1.0,
    *,
    temperature: float,
    kappa: float,
    sync: bool = False,
    group=None,
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    r"""Cross entropy + β·S-AvUC of the batch (:func:`soft_avuc_penalty`); ``temperature`` and ``kappa`` must be
    given (no published default), β = 1. Reductions, refusals and ``sync`` as :func:`avuc_loss`.

    Example:
        >>> import torch
        >>> logits = torch.tensor([[3.0, 0.0], [0.0, 0.2], [2.0, 0.0]])
        >>> soft_avuc_loss(logits, torch.tensor([0, 1, 1]), temperature=0.1, kappa=0.5)
        tensor(1.4607)
    """
    b = _number(beta, "beta", low=0)
    temperature = _number(temperature, "temperature", low=0, low_open=True)
    kappa = _kappa(kappa)
    check_choice(reduction, "reduction", REDUCTIONS)
    _refuse_batch_term(_AVUC_IS_A_BATCH_TERM.replace("AvUC", "S-AvUC"), weight, label_smoothing)
    ignore_index = check_ignore_index(ignore_index)
    with _autocast_off(logits):
        fused = batch_loss(logits, targets, ignore_index, reduction, "s-avuc", [b, temperature, kappa], sync=sync)
        if fused is not None:
            return fused[0]
        batch = _batch(logits, targets, ignore_index, reduction, _AVUC_NEEDS_LABELS, entropy="smoothed")
        penalty = _savuc_term(batch, _classes(logits), temperature, kappa, sync, group)
        return _with_batch_term(_given(batch.base), batch.rows, reduction, b, penalty)


# -- ESD -----------------------------------------------------------------------------------------------------

_ESD_NEEDS_LABELS = "ESD compares the confidence with the correctness of the predicted class"
_ESD_IS_A_BATCH_TERM = (
    "ESD is a statistic of the whole batch, which class weights and smoothed targets do not define"
)


def _gather_rows(tensors, sync, group):
    """The rows of every rank of ``group`` concatenated (a differentiable all-gather; every rank's batch must
    have the same number of rows) when ``sync`` and torch.distributed is initialised, else ``tensors``."""
    if not sync:
        return tensors
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return tensors
    from torch.distributed.nn.functional import all_gather

    return [torch.cat(all_gather(t.contiguous(), group=group)) for t in tensors]


def _esd_term(conf, correct, kept, sync, group):
    """The U-statistic ESD of the kept rows in O(n log n): with x_j = a_j − r_j, S_i = Σ_{j≠i, r_j<=r_i} x_j
    and Q_i = Σ_{j≠i, r_j<=r_i} x_j², d_i² = (S_i² − Q_i) / ((n − 1)(n − 2)) and ESD = mean_i d_i². The sum
    over i does not depend on the order of the rows, so it runs in the sorted order, where the last row with
    r_j <= r_i is the end of i's run of equal confidences (a reversed running minimum; no binary search)."""
    x = (correct - conf) * kept
    conf, x, kept = _gather_rows([conf, x, kept], sync, group)
    r = conf.detach()
    order = torch.argsort(r)
    r_sorted = r[order]
    x_sorted = x[order]
    m = r_sorted.shape[0]
    ends = torch.cat([r_sorted[1:] != r_sorted[:-1], torch.ones(1, dtype=torch.bool, device=r.device)])
    positions = torch.arange(m, device=r.device)
    upto = torch.where(ends, positions, m).flip(0).cummin(0).values.flip(0)  # (i itself when no tie)
    s = torch.cumsum(x_sorted, 0)[upto] - x_sorted
    q = torch.cumsum(x_sorted * x_sorted, 0)[upto] - x_sorted * x_sorted
    n = ordered_sum(kept)
    d2 = (s * s - q) * kept[order]
    # (clamped as a whole: n = 0 would make the unused quotient 0/0, a NaN in the gradient)
    denom = (n * ((n - 1) * (n - 2))).clamp(min=1)
    return torch.where(n >= 3, ordered_sum(d2) / denom, d2.new_zeros(()))


def esd_penalty(logits, targets, *, sync: bool = False, group=None, ignore_index=IGNORE_INDEX):
    r"""The expected squared difference between confidence and accuracy of a batch, ESD (Yoon et al., ICLR
    2023; hee-suk-yoon/ESD ``ESD``), the unbiased U-statistic: with x_ij = (a_j − r_j)·1[r_j <= r_i] over the
    other n − 1 kept positions j of the batch, d_i² = Σ_{j≠k; j,k≠i} x_ij x_ik / ((n − 1)(n − 2)) and
    ESD = (1/n) Σ_i d_i² (it can be negative). The indicator and a_j are constants; the gradient flows
    through r. Computed by sorting (O(n log n) time, O(n) memory) rather than the reference's n × n matrix,
    the same number. Fewer than 3 kept positions give 0 (with a zero gradient). Positions labelled
    ``ignore_index`` are not part of the batch. Under data parallelism the reference's term is each rank's batch; ``sync=True`` takes it over
    the global batch (a differentiable all-gather of r and a − r: every rank's batch must have the same
    number of positions, as with ``drop_last``).

    Example:
        >>> import torch
        >>> logits = torch.tensor([[3.0, 0.0], [0.0, 0.2], [2.0, 0.0], [0.5, 0.0]])
        >>> esd_penalty(logits, torch.tensor([0, 1, 1, 1]))  # unbiased, so it can be negative
        tensor(-0.0341)
    """
    with _autocast_off(logits):
        batch = _batch(logits, targets, check_ignore_index(ignore_index), "mean", _ESD_NEEDS_LABELS, base=None)
        return _esd_term(_given(batch.conf), _given(batch.correct), batch.kept, sync, group)


def esd_loss(
    logits,
    targets,
    lambda_: float = 4.0,
    *,
    holdout: float = 0.0,
    sync: bool = False,
    group=None,
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    r"""Cross entropy + λ·sqrt(relu(ESD)) (:func:`esd_penalty`); λ = 4, the released ImageNet-100 script's.

    The released training computes ESD on a **separate calibration batch** drawn each step from 10% of the
    training split held out from cross entropy (``--calset_ratio 0.1``). A loss sees one batch, so
    ``holdout`` h splits it (decision 166): the last ceil(h·N) samples of the batch (along dimension 0, all
    their positions) form the calibration part and leave the cross entropy; ESD is computed on them alone.
    ``holdout=0`` (the default, what a trainer without a calibration loader can run) computes both terms on
    the whole batch; ``holdout=0.1`` spends the reference's share of the data. For the reference's
    interleaved form call ``cross_entropy(train) + λ·esd_penalty(calibration).clamp(min=0).sqrt()`` with two
    batches. The sqrt has a zero gradient where ESD <= 0. "mean" is CE.mean() + λ·sqrt(ESD⁺), "none" gives
    every kept training position CE_i + λ·sqrt(ESD⁺) (held-out positions 0), "sum" the sum of "none". Soft
    targets, class ``weight`` and ``label_smoothing`` are refused. Per-rank batch under data parallelism
    unless ``sync=True`` (see :func:`esd_penalty`).

    Example:
        >>> import torch
        >>> logits = torch.tensor([[3.0, 0.0], [0.0, 0.2], [2.0, 0.0], [0.5, 0.0]])
        >>> esd_loss(logits, torch.tensor([0, 1, 1, 1]))
        tensor(0.9369)
    """
    lam = _number(lambda_, "lambda_", low=0)
    holdout = _number(holdout, "holdout", low=0, high=1)
    check_choice(reduction, "reduction", REDUCTIONS)
    _refuse_batch_term(_ESD_IS_A_BATCH_TERM, weight, label_smoothing)
    ignore_index = check_ignore_index(ignore_index)
    with _autocast_off(logits):
        samples = logits.shape[0] if isinstance(logits, torch.Tensor) and logits.dim() >= 2 else 0
        held = math.ceil(holdout * samples) if holdout else 0
        if held < samples:
            fused = batch_loss(logits, targets, ignore_index, reduction, "esd", [lam], sync=sync, held=held)
            if fused is not None:
                return fused[0]
        batch = _batch(logits, targets, ignore_index, reduction, _ESD_NEEDS_LABELS)
        rows, conf, correct, kept = batch.rows, _given(batch.conf), _given(batch.correct), batch.kept
        n = rows.shape[0]
        held = math.ceil(holdout * n) if holdout else 0
        if held >= n:
            raise ValueError(f"`holdout` = {holdout} holds out all {n} samples of the batch; nothing is left")
        if held == 0:
            penalty = _safe_sqrt(_esd_term(conf, correct, kept, sync, group))
            return _with_batch_term(_given(batch.base), rows, reduction, lam, penalty)
        split = (n - held) * (kept.shape[0] // n)
        train = _first_rows(rows, split)
        penalty = _safe_sqrt(_esd_term(conf[split:], correct[split:], kept[split:], sync, group))
        out = _with_batch_term(_given(batch.base)[:split], train, reduction, lam, penalty)
        if reduction == "none":
            return torch.cat([out, out.new_zeros((held, *out.shape[1:]))])
        return out


def _first_rows(rows, split):
    """The rows before ``split`` (a whole number of samples along dimension 0) as a :class:`LossRows`."""
    keep = rows.keep
    per_sample = rows.targets.shape[0] // rows.shape[0]
    return type(rows)(rows.logits, rows.targets[:split], None if keep is None else keep[:split],
                      (split // per_sample, *rows.shape[1:]))  # fmt: skip


# -- mL1-ACE -------------------------------------------------------------------------------------------------

ACE_BINNINGS = ("hard", "soft")
_FLOAT32_EPS = 1.1920928955078125e-07  # the reference's upper bin edge is 1 + float32 eps


def _ace_groups(p, y, kept, group_of, n_groups, n_bins, binning, empty_weight):
    """mL1-ACE per (group, class) from probabilities p (M, C), targets y (M, C) in [0, 1], kept (M,) 1/0 and
    the group (image) index of each row: (ace (G, C), the number of kept rows of each group (G,), Σ y (G, C)).
    Hard bins: edges linspace(0, 1 + eps32, M + 1), bin b = (e_b, e_{b+1}] (bucketize, right=False, 0 in bin
    0). Soft bins: each p split linearly between its two neighbouring centres (2b + 1)/(2M)·(1 + eps32), all
    of it in the end bin below the first or above the last centre. ACE = mean over the occupied bins
    (count > 0; soft: count >= ``empty_weight``) of |mean p − mean y|."""
    m, c = p.shape
    cell = (group_of[:, None] * c + torch.arange(c, device=p.device)) * n_bins  # (M, C) first bin of the cell
    size = n_groups * c * n_bins
    w = kept[:, None].expand(m, c)
    if binning == "hard":
        edges = torch.linspace(0, 1 + _FLOAT32_EPS, n_bins + 1, dtype=p.dtype, device=p.device)
        index = (cell + torch.bucketize(p.detach().contiguous(), edges[1:-1], right=False)).reshape(-1)
        parts = [(index, w.reshape(-1))]
    else:
        u = (p * (n_bins / (1 + _FLOAT32_EPS)) - 0.5).clamp(0, n_bins - 1)  # position in centre units
        if n_bins == 1:
            left, right_w = torch.zeros_like(u, dtype=torch.long), torch.zeros_like(u)
        else:
            # (NaN p, whose weights carry NaN into the bins' sums, indexed as 0: floor(NaN) has no integer)
            left = u.detach().nan_to_num(0.0).floor().clamp(max=n_bins - 2)
            right_w = u - left
            left = left.long()
        index = (cell + left).reshape(-1)
        parts = [(index, (w * (1 - right_w)).reshape(-1)), (index + 1, (w * right_w).reshape(-1))]
    count = p.new_zeros(size)
    sum_p = p.new_zeros(size)
    sum_y = p.new_zeros(size)
    pf, yf = p.reshape(-1), y.reshape(-1)
    for idx, weight in parts:
        if binning == "soft" and n_bins == 1 and idx is not parts[0][0]:
            continue
        count = count.index_add(0, idx, weight)
        sum_p = sum_p.index_add(0, idx, weight * pf)
        sum_y = sum_y.index_add(0, idx, weight * yf)
    count, sum_p, sum_y = (t.reshape(n_groups, c, n_bins) for t in (count, sum_p, sum_y))
    # (a NaN count, from a NaN p, counts as occupied: its NaN reaches the ACE, as in hard bins)
    occupied = count > 0 if binning == "hard" else ~(count < empty_weight)
    safe = torch.where(occupied, count, torch.ones_like(count))
    gap = torch.where(occupied, (sum_p - sum_y).abs() / safe, torch.zeros_like(count))
    n_occupied = occupied.sum(-1)
    ace = gap.sum(-1) / n_occupied.clamp(min=1)
    # each group's rows are one contiguous block of equal size (:func:`_groups`): block sums, not a scatter
    # (Inductor's CPU code generation fails on a scatter-add into one group, torch 2.13)
    per_group = m // n_groups if n_groups else 0
    rows_per_group = kept.reshape(n_groups, per_group).sum(1)
    present = (y * kept[:, None]).reshape(n_groups, per_group, c).sum(1)
    return ace, rows_per_group, present


def _ace_term(p, y, kept, group_of, n_groups, options):
    """mL1-ACE of every (group, class) cell, the reference's aggregation: a class absent from a group's
    targets counts 0 (``ignore_empty_classes``); ``include_background=False`` leaves out class 0. Returns
    (ace (G, C'), mask (G, C') of the cells the mean covers: the groups with a kept row)."""
    n_bins, binning, empty_weight, include_background, ignore_empty = options
    if not include_background:
        p, y = p[:, 1:], y[:, 1:]
    ace, rows_per_group, present = _ace_groups(p, y, kept, group_of, n_groups, n_bins, binning, empty_weight)
    if ignore_empty:
        ace = torch.where(present > 0, ace, torch.zeros_like(ace))
    cover = (rows_per_group > 0)[:, None].expand_as(ace)
    return ace, cover


def _check_ace_options(n_bins, binning, empty_weight, include_background, ignore_empty_classes):
    return (
        check_positive_int(n_bins, "n_bins"),
        check_choice(binning, "binning", set(ACE_BINNINGS)),
        _number(empty_weight, "empty_weight", low=0),
        check_bool(include_background, "include_background"),
        check_bool(ignore_empty_classes, "ignore_empty_classes"),
    )


def _groups(shape, m, per_image, device):
    """The group (image) of each of the m rows and the number of groups: one per sample of dimension 0 when
    ``per_image`` (None: when the input has spatial dimensions), one for the whole batch otherwise."""
    if per_image is None:
        per_image = len(shape) > 1
    if not per_image:
        return torch.zeros(m, dtype=torch.long, device=device), 1
    n = shape[0]
    return torch.arange(n, device=device).repeat_interleave(m // n if n else 0), n


def _ace_reduce(base, ace, cover, rows_group, reduction, coef, base_keep, shape):
    """base (per element, 0 where left out) + coef·ACE: "mean" is base's mean over its kept elements + coef·the
    mean of ACE over the covered cells; "none" gives each kept element of group g base + coef·(mean over the
    classes of g's ACE); "sum" the sum of "none"."""
    zero = base.new_zeros(())
    if reduction == "mean":
        n_base = base.numel() if base_keep is None else base_keep.sum()
        covered = torch.where(cover, ace, zero).sum() / cover.sum()
        return ordered_sum(base) / n_base + coef * covered
    per_group = ace.mean(1)[rows_group]
    term = coef * per_group.reshape(base.shape[0], *([1] * (base.ndim - 1))).expand_as(base)
    if base_keep is not None:
        term = torch.where(base_keep, term, zero)
    none = (base + term).reshape(shape)
    return none if reduction == "none" else ordered_sum(none)


def ml1ace_penalty(
    logits,
    targets,
    *,
    n_bins: int = 20,
    binning: str = "hard",
    empty_weight: float = 0.01,
    multilabel: bool = False,
    per_image=None,
    include_background: bool = True,
    ignore_empty_classes: bool = True,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    r"""Marginal L1 average calibration error, mL1-ACE (Barfoot et al., MICCAI 2024 / arXiv 2506.03942; the
    reference code cai4cai/Average-Calibration-Losses ``HardL1ACELoss`` / ``SoftL1ACELoss``, proposed to MONAI
    in Project-MONAI/MONAI#9092), a differentiable ACE of every class's probability against its indicator.

    For each image b (sample of dimension 0) and class c, the probabilities p_bc of its positions are binned
    into ``n_bins`` M bins over [0, 1] and ACE_bc is the mean over the occupied bins of |mean p − mean y|
    (every occupied bin counts the same: ACE, not ECE). ``binning="hard"``: bins (e_m, e_{m+1}] with edges
    linspace(0, 1 + 1.19e-7, M + 1), the gradient through the bin means of p. ``"soft"``: each p is split
    linearly between its two neighbouring bin centres (all of it into the end bin below the first centre or
    above the last), the gradient through the weights as well; a bin with total weight < ``empty_weight``
    (0.01) is empty. A class absent from an image's targets counts 0 (``ignore_empty_classes``, the
    reference's default) but stays in the mean over the N·K cells; ``include_background=False`` leaves out
    class 0. Defaults M = 20 as the reference.

    Softmax outputs (default): logits (N, K, d1, ...) with labels (N, d1, ...) or class probabilities; the
    target of class c is the one-hot indicator (or the probability); positions labelled ``ignore_index``
    leave every bin; an image with no kept position leaves the mean. ``multilabel=True``: sigmoid outputs,
    logits (N, L, d1, ...) with targets of the same shape in [0, 1] (no ``ignore_index``). ``per_image``:
    None (default) bins per image when the input has spatial dimensions and over the whole batch for (N, K)
    inputs (one "image": the batch's positions pooled, a batch term, per rank under data parallelism); True or
    False forces either. The target is a constant.

    Returns the mean over the (image, class) cells (``reduction="mean"``), their sum, or the (N, K) values
    (``"none"``; (1, K) when pooled).

    Example:
        >>> import torch
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
        >>> ml1ace_penalty(logits, torch.tensor([0, 1, 1]))
        tensor(0.3731)
    """
    options = _check_ace_options(n_bins, binning, empty_weight, include_background, ignore_empty_classes)
    check_choice(reduction, "reduction", REDUCTIONS)
    with _autocast_off(logits):
        p, y, kept, group_of, n_groups, _ = _ace_inputs(logits, targets, multilabel, per_image, ignore_index)
        ace, cover = _ace_term(p, y, kept, group_of, n_groups, options)
        if reduction == "none":
            return ace
        total = torch.where(cover, ace, ace.new_zeros(())).sum()
        return total if reduction == "sum" else total / cover.sum()


def _ace_inputs(logits, targets, multilabel, per_image, ignore_index):
    """(p (M, C), y (M, C), kept (M,), group of each row, number of groups, the rows (softmax) or the checked
    binary (logits, targets))."""
    if check_bool(multilabel, "multilabel"):
        if ignore_index is not None and ignore_index != IGNORE_INDEX:
            raise ValueError(
                "`ignore_index` is not accepted with multilabel=True (targets are 0/1 per label)"
            )
        from .binary import _check_binary_targets

        if not isinstance(logits, torch.Tensor) or logits.ndim < 2:
            raise ValueError("`logits` must have shape (N, L) or (N, L, d1, ...) with multilabel=True")
        z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        t, _ = _check_binary_targets(targets, z.shape, z.device)
        t = t.to(z.dtype)
        c = z.shape[1]
        p = torch.sigmoid(z).movedim(1, -1).reshape(-1, c)
        y = t.movedim(1, -1).reshape(-1, c)
        kept = p.new_ones(p.shape[0])
        shape = (z.shape[0], *z.shape[2:])
        group_of, n_groups = _groups(shape, p.shape[0], per_image, p.device)
        return p, y, kept, group_of, n_groups, (z, t)
    rows = loss_rows(logits, targets, check_ignore_index(ignore_index))
    if rows.keep is not None:  # an ignored row's logits take no part (NaN or −inf padding: 0, and 0 gradient)
        rows = rows._replace(logits=torch.where(rows.keep[:, None], rows.logits, rows.logits.new_zeros(())))
    p = ordered_softmax(rows.logits)
    c = p.shape[1]
    y = rows.targets if rows.soft else torch.nn.functional.one_hot(rows.targets, c).to(p.dtype)
    kept = p.new_ones(p.shape[0]) if rows.keep is None else rows.keep.to(p.dtype)
    group_of, n_groups = _groups(rows.shape, p.shape[0], per_image, p.device)
    return p, y, kept, group_of, n_groups, rows


def ml1ace_loss(
    logits,
    targets,
    lambda_: float = 1.0,
    *,
    n_bins: int = 20,
    binning: str = "hard",
    empty_weight: float = 0.01,
    multilabel: bool = False,
    per_image=None,
    include_background: bool = True,
    ignore_empty_classes: bool = True,
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
):
    r"""Cross entropy (binary cross entropy with ``multilabel=True``) + λ·mL1-ACE (:func:`ml1ace_penalty`). The
    paper trains Dice + CE + mL1-ACE in equal parts (1:1:1); torchcal has no Dice loss, so the default is
    CE + 1·mL1-ACE, the CE-to-ACE ratio of the paper. "mean" is the base loss's mean over its kept elements
    + λ·the mean ACE over the (image, class) cells; "none" gives each kept position (each element with
    ``multilabel``) its base loss + λ·the mean over the classes of its image's ACE; "sum" the sum of "none".
    Soft targets (class probabilities) enter both terms. Class ``weight`` and ``label_smoothing`` are refused
    (the ACE term is a statistic of each image). Integer labels of CPU float32/float64 logits take the C++
    operator when it is built (decision 211; differentiable once); everything else the torch path.

    Example:
        >>> import torch
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
        >>> ml1ace_loss(logits, torch.tensor([0, 1, 1]))
        tensor(0.9576)
    """
    lam = _number(lambda_, "lambda_", low=0)
    options = _check_ace_options(n_bins, binning, empty_weight, include_background, ignore_empty_classes)
    check_choice(reduction, "reduction", REDUCTIONS)
    _refuse_batch_term(_ACE_IS_PER_IMAGE, weight, label_smoothing)
    if not check_bool(multilabel, "multilabel"):
        fused = ml1ace_cross_entropy(logits, targets, lam, options, per_image, check_ignore_index(ignore_index),
                                     reduction)  # fmt: skip
        if fused is not None:
            return fused
    with _autocast_off(logits):
        p, y, kept, group_of, n_groups, rows = _ace_inputs(
            logits, targets, multilabel, per_image, ignore_index
        )
        ace, cover = _ace_term(p, y, kept, group_of, n_groups, options)
        if not isinstance(rows, LossRows):  # multilabel: the checked (logits, 0/1 targets)
            z, t = rows
            base = torch.nn.functional.binary_cross_entropy_with_logits(z, t, reduction="none")
            flat = base.movedim(1, -1).reshape(-1)  # element order of the rows: (position, label)
            rows_group = group_of.repeat_interleave(z.shape[1])
            out = _ace_reduce(flat, ace.repeat_interleave(1, 1), cover, rows_group, reduction, lam, None,
                              (*z.shape[:1], *z.shape[2:], z.shape[1]))  # fmt: skip
            return out.movedim(-1, 1) if reduction == "none" else out
        log_p = torch.log_softmax(rows.logits, 1)
        ce = -(rows.targets * log_p).sum(1) if rows.soft else -log_p.gather(1, rows.targets[:, None])[:, 0]
        if rows.keep is not None:
            ce = torch.where(rows.keep, ce, ce.new_zeros(()))
        return _ace_reduce(ce, ace, cover, group_of, reduction, lam, rows.keep, rows.shape)


_ACE_IS_PER_IMAGE = (
    "mL1-ACE is a statistic of each image's bins, which class weights and smoothed targets do not define"
)


# -- CALS ----------------------------------------------------------------------------------------------------

_CALS_PENALTY_IS_NOT_PER_CLASS = (
    "CALS's multipliers are its class weights, and the released code smooths nothing; use "
    "cross_entropy for weighted or smoothed targets"
)


def _class_numbers(lambdas, rhos, z):
    """CALS's multipliers and penalty parameters as (K,) tensors of the logits' device and dtype, or the
    ValueError that names them."""
    if lambdas is None or rhos is None:
        raise ValueError("`lambdas` and `rhos` must be given: CALS's per-class multipliers and penalty parameters")
    lam = torch.as_tensor(lambdas).to(z.device, z.dtype)
    rho = torch.as_tensor(rhos).to(z.device, z.dtype)
    if lam.shape != (z.shape[1],) or rho.shape != (z.shape[1],):
        raise ValueError(
            f"`lambdas` and `rhos` must have shape ({z.shape[1]},) (one per class), got "
            f"{tuple(lam.shape)} and {tuple(rho.shape)}"
        )
    if lam.device.type == "cpu" and not torch.compiler.is_compiling():
        _check_class_values(lam, rho)
    return lam, rho


def _check_class_values(lam, rho):
    """The ValueError for a λ that is negative or not finite, or a ρ that is not positive or not finite (the
    PHR penalty divides by ρ; the update never makes a negative multiplier), naming the first class that
    fails."""
    for name, values, bad, expected in (
        ("lambdas", lam, ~torch.isfinite(lam) | (lam < 0), "finite and >= 0 (CALS's multipliers)"),
        ("rhos", rho, ~torch.isfinite(rho) | (rho <= 0), "finite and > 0 (the penalty divides by them)"),
    ):
        if bool(bad.any()):
            k = int(bad.nonzero()[0, 0])
            raise ValueError(f"`{name}` must be {expected}, got {float(values[k].detach())} for class {k}")


def _cals_h(z, margin, normalize):
    """h_ik = (max_j z_ij − z_ik − m) (/ m with ``normalize``): the constraint h <= 0 per row and class."""
    h = z.max(dim=1).values[:, None] - z - margin
    return h / margin if normalize else h


def phr_penalty(h, lambdas, rhos):
    r"""The PHR augmented-Lagrangian penalty P(h; λ, ρ) = (max(0, λ + ρh)² − λ²)/(2ρ), elementwise (its
    derivative in h is max(0, λ + ρh)).

    Example:
        >>> import torch
        >>> phr_penalty(torch.tensor([-1.0, 0.0, 0.5]), torch.tensor(1.0), torch.tensor(2.0))
        tensor([-0.2500,  0.0000,  0.7500])
    """
    return (torch.relu(lambdas + rhos * h) ** 2 - lambdas**2) / (2 * rhos)


def _cals_penalty(z, lam, rho, margin, normalize, kept=None, lambda_min=0.0, lambda_max=math.inf):
    """mean_k P(h_ik; λ_k, ρ_k) per row: with s = m (normalised) or 1, λ + ρh = (λ − ρm/s) + (ρ/s)(max − z),
    so Σ_k P = Σ_k relu(·)²/(2ρ_k) − Σ_k λ_k²/(2ρ_k), the first through :class:`_TopGapPenalty`. With
    ``kept`` (M,) 1/0, also the sums of :func:`cals_statistics` from the same pass (else None)."""
    k = z.shape[1]
    s = margin if normalize else 1.0
    a = rho / s
    w = 1 / (2 * rho * k)
    hinge, _, raw = _TopGapPenalty.apply(
        z, a, lam - a * margin, w, 1 / (2 * k * s), 2, True, kept, lambda_min, lambda_max
    )
    penalty = hinge - (lam * lam * w).sum()
    if kept is None:
        return penalty, None
    count = ordered_sum(kept)
    # Σ_i h_ik = (Σ_i max_i − Σ_i z_ik − m·n)/s over the kept rows
    h_sums = (raw[2 * k] - raw[k : 2 * k] - margin * count) / s
    return penalty, torch.cat([raw[:k], h_sums, count[None]])


# the last per-class numbers of _cals_class_params: (copies of λ and ρ, (dtype, m, s), the numbers)
_CALS_LAST: list = [None]


def _cals_class_params(lambdas, rhos, dtype, m, s):
    """CALS's (4, K) per-class numbers a = ρ/s, b = λ − am, w = 1/(2ρK), λ²w in ``dtype`` (as
    :func:`_cals_penalty` computes them). The last ones are kept with copies of the λ and ρ they came from
    and reused while λ and ρ equal them (two comparisons for ten small tensor operations, about a tenth of
    cross entropy's time at 4096 × 100; a comparison of values, which no in-place change escapes)."""
    caching = not torch.compiler.is_compiling()
    key = (dtype, m, s)
    last = _CALS_LAST[0]
    if caching and last is not None:
        lam0, rho0, key0, params = last
        if key0 == key and torch.equal(lam0, lambdas) and torch.equal(rho0, rhos):
            return params
    k = lambdas.shape[0]
    lam, rho = lambdas.to(dtype), rhos.to(dtype)
    if caching:  # (in the logits' dtype, as _class_numbers: a float64 ρ of 1e-50 is 0 in float32)
        _check_class_values(lam, rho)
    a = rho / s
    w = 1 / (2 * rho * k)
    params = torch.stack([a, lam - a * m, w, lam * lam * w])
    if caching:
        _CALS_LAST[0] = (lambdas.clone(), rhos.clone(), key, params)
    return params


def _fused_cals(logits, targets, lambdas, rhos, m, normalize, ignored_rows, ignore_index, reduction, statistics):
    """CALS through the C++ operator: (loss, statistics or an empty tensor), or None where it does not apply
    (see penalised_cross_entropy; λ or ρ not CPU tensors of shape (K,) without gradient: the torch path then
    computes, or raises the named error). The per-class numbers a = ρ/s, b = λ − am, w = 1/(2ρK) and λ²w are
    those of :func:`_cals_penalty`, in the logits' dtype."""
    if type(logits) is not torch.Tensor or logits.ndim < 2:
        return None
    k = logits.shape[1]
    for value in (lambdas, rhos):
        if type(value) is not torch.Tensor or value.shape != (k,) or value.requires_grad or not value.is_cpu:
            return None
    s = m if normalize else 1.0
    lo, hi = statistics if statistics is not None else (0.0, 0.0)
    return penalised_cross_entropy(  # (the statistics come in the logits' dtype)
        logits, targets, "cals", [1.0, s, lo, hi, m], ignore_index, ignored_rows == "reference", reduction,
        _cals_class_params(lambdas, rhos, logits.dtype, m, s), statistics is not None,
    )  # fmt: skip


def cals_loss(
    logits,
    targets,
    lambdas,
    rhos,
    margin: float = 10.0,
    *,
    normalize: bool = True,
    ignored_rows: str = "reference",
    weight=None,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
    statistics=None,
):
    r"""Class-adaptive label smoothing, CALS (Liu et al., CVPR 2023; by-liu/CALS ``AugLagrangianClass``): cross
    entropy plus the PHR penalty (:func:`phr_penalty`) of the logit-distance constraints h_ik <= 0 with
    h_ik = (max_j z_ij − z_ik − m)/m, per class multipliers λ_k and penalty parameters ρ_k (K,):
    CE + mean_{i,k} P(h_ik; λ_k, ρ_k), the mean over all N·K entries, the arg-max entry (h = −1) included,
    as the released code. h is not detached. :class:`~torchcal.losses.CALSLoss` holds λ and ρ and updates
    them; this function takes them as constants.

    ``ignored_rows="reference"`` (default): as the released code, the penalty covers every position, those
    labelled ``ignore_index`` included (cross entropy leaves them out); ``"drop"`` leaves them out of both.
    Soft targets enter the cross entropy. Class ``weight`` and ``label_smoothing`` are refused.
    ``statistics=(lambda_min, lambda_max)`` returns (loss, the detached sums of :func:`cals_statistics` over
    the kept positions) from the same pass (the module's training accumulation).

    Example:
        >>> import torch
        >>> logits = torch.tensor([[12.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
        >>> lam, rho = torch.full((3,), 1e-6), torch.ones(3)
        >>> cals_loss(logits, torch.tensor([0, 1]), lam, rho, reduction="none")
        tensor([0.0084, 0.5514])
    """
    m = _number(margin, "margin", low=0, low_open=True)
    normalize = check_bool(normalize, "normalize")
    check_choice(ignored_rows, "ignored_rows", {"reference", "drop"})
    check_choice(reduction, "reduction", REDUCTIONS)
    if weight is not None:
        raise ValueError(f"`weight` is not accepted: {_CALS_PENALTY_IS_NOT_PER_CLASS}")
    check_label_smoothing(label_smoothing, _CALS_PENALTY_IS_NOT_PER_CLASS)
    ignore_index = check_ignore_index(ignore_index)
    fused = _fused_cals(logits, targets, lambdas, rhos, m, normalize, ignored_rows, ignore_index, reduction,
                        statistics)  # fmt: skip
    if fused is not None:
        return fused[0] if statistics is None else fused
    with _autocast_off(logits):
        rows, _, ce = _ce_rows(logits, targets, ignore_index)
        z = rows.logits
        lam, rho = _class_numbers(lambdas, rhos, z)
        kept = None
        if statistics is not None:
            kept = z.new_ones(z.shape[0]) if rows.keep is None else rows.keep.to(z.dtype)
        penalty, sums = _cals_penalty(z, lam, rho, m, normalize, kept, *(statistics or ()))
        loss = _reduce_penalised(
            ce, penalty, 1.0, rows, reduction, None if ignored_rows == "reference" else "rows"
        )
        return loss if statistics is None else (loss, sums)


def cals_statistics(logits, targets=None, lambdas=None, rhos=None, margin: float = 10.0, *, normalize=True,
                    lambda_min: float = 1e-6, lambda_max: float = 1e6, ignore_index: int | None = IGNORE_INDEX):  # fmt: skip
    r"""The sums CALS's multiplier update averages, over the positions of a batch (detached): per class k,
    Σ_i clamp(P'(h_ik; λ_k, ρ_k), λ_min, λ_max), Σ_i h_ik, and the number of positions, as a (2K + 1,)
    tensor. ``targets`` only mark the positions labelled ``ignore_index`` (left out); None counts every
    position, as the released code's validation pass.

    Example:
        >>> import torch
        >>> logits = torch.tensor([[12.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
        >>> cals_statistics(logits, None, torch.full((3,), 0.5), torch.ones(3))
        tensor([ 2.0000e-06,  7.0000e-01,  6.0000e-01, -1.9000e+00, -8.0000e-01,
                -8.0000e-01,  2.0000e+00])
    """
    with torch.autocast(
        _device_type(logits), enabled=False
    ):  # (detached: no_grad would split a compile graph)
        z = logits.detach()
        z = z.float() if z.dtype in (torch.float16, torch.bfloat16) else z
        k = z.shape[1]
        if z.ndim > 2:
            z = z.movedim(1, -1).reshape(-1, k)
        kept = z.new_ones(z.shape[0])
        if targets is not None and ignore_index is not None:
            kept = (
                (targets.reshape(-1) != ignore_index).to(z.dtype) if not targets.is_floating_point() else kept
            )
        h = _cals_h(z, margin, normalize)
        lam, rho = _class_numbers(lambdas, rhos, z)
        grad = torch.relu(lam + rho * h).clamp(lambda_min, lambda_max)
        return torch.cat(
            [ordered_sum(grad * kept[:, None], 0), ordered_sum(h * kept[:, None], 0), ordered_sum(kept)[None]]
        )
