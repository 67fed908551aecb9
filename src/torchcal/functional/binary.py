"""Binary and multi-label (sigmoid) outputs (SPEC §6): training losses and calibration metrics.

Inputs are logits (or, for metrics, probabilities; ``from_logits=True`` applies the sigmoid) of shape (N, L)
for L independent labels, or (N,) for one binary label, with targets of the same shape in {0, 1} (float,
integer or bool). Losses also take soft targets in [0, 1] (label smoothing, mixup) where the definition
extends to them, as the multiclass losses do (decision 73).

**Losses** follow ``F.binary_cross_entropy_with_logits``: elementwise, ``reduction="mean"`` averages over all
N·L elements, optional ``pos_weight`` (L,) on the positive term. The focal family reuses the multiclass
implementation through the exact identity σ(z) = softmax([0, z])₁: a label is a two-class problem with
logits [0, z], so the binary focal loss has the same numerics (finite gradients at ±1e4, for γ < 1, under
autocast) and the same C++ path (decision 78).

**Metrics** measure the reliability of p itself, per label (SPEC §6): bins over [0, 1] as in the multiclass
ECE (``(m/M, (m+1)/M]``, 0 in bin 0), bin accuracy = fraction of positives, bin confidence = mean p;
``average="macro"`` is the mean over labels, ``"micro"`` the same estimator on all N·L pairs pooled,
``"none"`` the (L,) values. ``top_label=True`` gives the binary top-label variant instead (confidence
max(p, 1 − p), correct = [p > 0.5] == y): the multiclass top-label ECE of the columns (1 − p, p), whose
first maximal index predicts class 0 at the tie p = 0.5.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as nnf

from .._validation import as_data, as_tensor, check_bool, check_choice, check_float, check_positive_int
from ._binning import bin_sums, equal_width_index
from ._spec import REDUCTIONS, reduce_loss
from .calibration import adaece_from_sorted, binary_auroc, ece_from_sums, mce_from_sums, sorted_by_confidence
from .losses import dual_focal_loss, focal_loss

__all__ = [
    "binary_cross_entropy",
    "binary_focal_loss",
    "binary_focal_calibration_loss",
    "binary_brier_loss",
    "binary_dual_focal_loss",
    "multilabel_calibration_error",
    "multilabel_ece",
    "multilabel_adaece",
    "multilabel_mce",
    "multilabel_auroc",
    "multilabel_brier_score",
    "multilabel_nll",
]

# ----------------------------------------------------------------------------- inputs


def _check_binary_targets(targets, shape, device, name="targets", soft=True) -> tuple[torch.Tensor, bool]:
    """(targets, whether they are known to be exactly 0/1): integer and bool targets are; floating CPU
    targets are checked in one pass when they are 0/1, and for finiteness and [0, 1] otherwise; on an
    accelerator nothing is checked (no synchronisation) and they count as soft, unless ``soft=False`` (a
    loss or metric defined for 0/1 targets only), where one synchronisation checks that they are 0/1; while
    torch.compile traces nothing is checked (the values are not known)."""
    targets = as_tensor(targets, name)
    if targets.is_complex():
        raise TypeError(f"`{name}` must be real, got dtype {targets.dtype}")
    if tuple(targets.shape) != tuple(shape):
        raise ValueError(
            f"`{name}` must have the shape of the scores {tuple(shape)}, got {tuple(targets.shape)}"
        )
    if targets.device != device:
        raise ValueError(f"`{name}` is on {targets.device} but the scores are on {device}")
    if targets.dtype == torch.bool or not targets.is_floating_point():
        hard = True
        checked = targets.device.type == "cpu" and not torch.compiler.is_compiling()
        if checked and targets.numel() and targets.dtype != torch.bool:
            lo, hi = torch.stack(torch.aminmax(targets)).tolist()
            if lo < 0 or hi > 1:
                raise ValueError(
                    f"`{name}` must be 0 or 1 (1 = the label is present), found {lo if lo < 0 else hi}"
                )
        return targets, hard
    if targets.device.type != "cpu" or torch.compiler.is_compiling():
        if not soft and not torch.compiler.is_compiling():  # 0/1 targets only: one synchronisation checks
            if not bool(((targets == 0) | (targets == 1)).all()):
                raise ValueError(f"`{name}` must be 0 or 1 here (soft targets are not accepted)")
        # no synchronisation otherwise: the soft-target path serves 0/1 targets too, and a loss that needs
        # 0/1 targets takes them as labels
        return targets, not soft
    hard = bool(((targets == 0) | (targets == 1)).all())  # one pass decides the usual case (0/1 targets)
    if not hard and targets.numel():
        if not bool(torch.isfinite(targets).all()):
            raise ValueError(f"`{name}` contains NaN or infinite values")
        lo, hi = torch.stack(torch.aminmax(targets)).double().tolist()
        if lo < 0 or hi > 1:
            raise ValueError(
                f"`{name}` must lie in [0, 1] (1 = the label is present), found {lo if lo < 0 else hi:g}"
            )
        if not soft:
            raise ValueError(f"`{name}` must be 0 or 1 here (soft targets are not accepted)")
    return targets, hard


# The head rows looked at for sigmoid "logits" that are really probabilities (as check_logits does for softmax).
_SIGMOID_LOOK_ROWS = 64


def _finite_logits(z: torch.Tensor, name: str, advice: str | None) -> None:
    """Refuses NaN / infinite ``z``; with ``advice``, warns when the first rows all lie in [0, 1], i.e. look
    like sigmoid probabilities passed where logits are expected. One host sync for both checks."""
    stats = [torch.isfinite(z).all().double()]
    if advice is not None:
        head = z[:_SIGMOID_LOOK_ROWS]
        stats += list(torch.aminmax(head.double()))
    values = torch.stack(stats).tolist()
    if not values[0]:
        raise ValueError(f"`{name}` contains NaN or infinite values")
    if advice is not None and values[1] >= 0 and values[2] <= 1:
        warnings.warn(
            f"`{name}` entries all lie in [0, 1]: they look like sigmoid probabilities, not logits; {advice}",
            UserWarning,
            stacklevel=4,
        )


_SIGMOID_FROM_LOGITS_ADVICE = (
    "from_logits=True applies a sigmoid to them (pass from_logits=False for probabilities)"
)


def _check_scores(x, name) -> torch.Tensor:
    x = as_tensor(x, name)
    if not x.is_floating_point():
        raise TypeError(f"`{name}` must be a floating-point tensor, got dtype {x.dtype}")
    if x.ndim not in (1, 2) or x.shape[0] == 0:
        raise ValueError(f"`{name}` must have shape (N,) or (N, L) with N >= 1, got {tuple(x.shape)}")
    return x


def _weights(pos_weight, alpha, logits):
    """(weight of the positive term, of the negative term): α and 1 − α times ``pos_weight`` for the positive."""
    w_pos = w_neg = None
    if alpha is not None:
        alpha = check_float(alpha, "alpha", low=0, high=1)
        w_pos, w_neg = torch.tensor(alpha, dtype=torch.float64), torch.tensor(1 - alpha, dtype=torch.float64)
    if pos_weight is not None:
        pw = as_tensor(pos_weight, "pos_weight").to(logits.device, torch.float64)
        labels = logits.shape[1] if logits.ndim == 2 else 1
        if pw.shape not in ((labels,), ()):
            raise ValueError(
                f"`pos_weight` must have shape ({labels},), one weight per label, got {tuple(pw.shape)}"
            )
        if (
            pw.device.type == "cpu"
            and not torch.compiler.is_compiling()
            and not bool((pw >= 0).all() and torch.isfinite(pw).all())
        ):
            raise ValueError("`pos_weight` must be finite and >= 0")
        w_pos = pw if w_pos is None else w_pos * pw
    return w_pos, w_neg


def _two_class(multiclass, logits, targets, reduction, *, pos_weight=None, alpha=None, soft=True, **kwargs):
    """A multiclass p_t loss applied to every label as the two-class problem [0, z] (class 1 = present)."""
    check_choice(reduction, "reduction", REDUCTIONS)
    logits = _check_scores(logits, "logits")
    targets, hard = _check_binary_targets(targets, logits.shape, logits.device, soft=soft)
    w_pos, w_neg = _weights(pos_weight, alpha, logits)
    z = logits.reshape(-1)
    rows = torch.stack([torch.zeros_like(z), z], dim=1)
    shape = logits.shape
    if hard:
        y = targets.reshape(-1).long()
        loss = multiclass(rows, y, reduction="none", ignore_index=None, **kwargs).reshape(shape)
        if w_pos is not None or w_neg is not None:
            yb = targets.to(loss.dtype)
            pos = (w_pos.to(loss) if w_pos is not None else 1.0) * yb
            neg = (w_neg.to(loss) if w_neg is not None else 1.0) * (1 - yb)
            loss = loss * (pos + neg)
    else:  # soft (or on an accelerator, where 0/1 is not checked): Σ_k q_k f(p_k) with the weights in q
        y = targets.to(rows.dtype if rows.dtype in (torch.float32, torch.float64) else torch.float32)
        q_pos = y if w_pos is None else y * w_pos.to(y)
        q_neg = 1 - y if w_neg is None else (1 - y) * w_neg.to(y)
        q = torch.stack([q_neg.reshape(-1), q_pos.reshape(-1)], dim=1)
        loss = _weighted_soft(multiclass, rows, q, **kwargs).reshape(shape)
    return reduce_loss(loss, reduction)


def _weighted_soft(multiclass, rows, q, **kwargs):
    """Σ_k q_k f(p_k) for weights q that need not sum to 1 (α, pos_weight): scaled to rows of probabilities,
    which the soft-target path checks, and scaled back (the loss is linear in q). A row whose weights are all
    0 (a zero α or ``pos_weight`` on the only term its target has) adds 0: it is evaluated at (½, ½), a row
    of probabilities, and multiplied by its total 0, so its loss and gradient are exactly 0."""
    total = q.sum(dim=1)
    empty = (total > 0).logical_not()[:, None]
    scaled = torch.where(empty, torch.full_like(q, 0.5), q / torch.where(empty[:, 0], 1, total)[:, None])
    loss = multiclass(rows, scaled, reduction="none", **kwargs)
    return loss * total


# ----------------------------------------------------------------------------- losses


def binary_cross_entropy(logits, targets, *, pos_weight=None, label_smoothing: float = 0.0, reduction="mean"):
    """Binary cross entropy from logits, −w·y log p − (1 − y) log(1 − p), as
    ``F.binary_cross_entropy_with_logits`` (``pos_weight`` w per label), with optional label smoothing
    y ← y(1 − ε) + ε/2.

    Example:
        >>> import torch
        >>> binary_cross_entropy(torch.tensor([[2.0, -1.0]]), torch.tensor([[1.0, 0.0]]))
        tensor(0.2201)
    """
    check_choice(reduction, "reduction", REDUCTIONS)
    eps = check_float(label_smoothing, "label_smoothing", low=0, high=1)
    logits = _check_scores(logits, "logits")
    targets, _ = _check_binary_targets(targets, logits.shape, logits.device)
    w_pos, _ = _weights(pos_weight, None, logits)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    y = targets.to(logits.dtype)
    if eps:
        y = y * (1 - eps) + eps / 2
    pw = None if w_pos is None else w_pos.to(logits.dtype)
    return nnf.binary_cross_entropy_with_logits(logits, y, pos_weight=pw, reduction=reduction)


def binary_focal_loss(logits, targets, gamma: float = 2.0, *, alpha=None, pos_weight=None, reduction="mean"):
    r"""Sigmoid focal loss (Lin et al. 2017): :math:`-y(1-p)^\gamma \log p - (1-y) p^\gamma \log(1-p)`, with
    optional α-balancing (α on positives, 1 − α on negatives) and ``pos_weight`` on the positive term.
    γ = 0 is binary cross entropy. Soft targets y ∈ [0, 1] weight the two terms.

    Example:
        >>> import torch
        >>> z, y = torch.tensor([[2.0, -1.0]]), torch.tensor([[1.0, 0.0]])
        >>> binary_focal_loss(z, y, gamma=0.0), binary_focal_loss(z, y, gamma=2.0)
        (tensor(0.2201), tensor(0.0122))
    """
    gamma = check_float(gamma, "gamma", low=0)
    return _two_class(focal_loss, logits, targets, reduction, pos_weight=pos_weight, alpha=alpha, gamma=gamma)


def binary_brier_loss(logits, targets, *, reduction="mean"):
    """(σ(z) − y)² per label.

    Example:
        >>> import torch
        >>> binary_brier_loss(torch.tensor([0.0, 0.0]), torch.tensor([1.0, 0.0]), reduction="none")
        tensor([0.2500, 0.2500])
    """
    check_choice(reduction, "reduction", REDUCTIONS)
    logits = _check_scores(logits, "logits")
    targets, _ = _check_binary_targets(targets, logits.shape, logits.device)
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return reduce_loss((torch.sigmoid(z) - targets.to(z.dtype)) ** 2, reduction)


def binary_focal_calibration_loss(
    logits,
    targets,
    gamma: float = 4.0,
    lambda_: float = 1.5,
    *,
    alpha=None,
    pos_weight=None,
    reduction="mean",
):
    """Focal calibration loss per label: binary focal(γ) + λ·(p − y)² (the FCL paper's multi-label form for
    CheXNet; ``alpha`` and ``pos_weight`` weight the focal term only).

    Example:
        >>> import torch
        >>> binary_focal_calibration_loss(torch.tensor([0.0]), torch.tensor([1.0]), gamma=0.0, lambda_=1.0)
        tensor(0.9431)
    """
    lam = check_float(lambda_, "lambda_", low=0)
    focal = binary_focal_loss(logits, targets, gamma, alpha=alpha, pos_weight=pos_weight, reduction="none")
    loss = focal + lam * binary_brier_loss(logits, targets, reduction="none")
    return reduce_loss(loss, check_choice(reduction, "reduction", REDUCTIONS))


def binary_dual_focal_loss(logits, targets, gamma: float = 5.0, *, reduction="mean"):
    r"""Dual focal loss of each label as the two-class problem [0, z] (decision 78): the runner-up of p_t is
    the other class when it is below p_t, so :math:`-(2(1 - p_t))^\gamma \log p_t` when p_t > 1/2 and
    :math:`-(1 - p_t)^\gamma \log p_t` (the focal loss) otherwise. Needs 0/1 targets (the dual focal loss
    is defined by the true class).

    Example:
        >>> import torch
        >>> binary_dual_focal_loss(torch.tensor([0.0, 2.0]), torch.tensor([1, 1]), gamma=1.0, reduction="none")
        tensor([0.3466, 0.0303])
    """
    gamma = check_float(gamma, "gamma", low=0)
    return _two_class(dual_focal_loss, logits, targets, reduction, soft=False, gamma=gamma)


# ----------------------------------------------------------------------------- metrics


def _label_scores(x, name) -> torch.Tensor:
    """:func:`_check_scores` for the metrics and calibrators, which also need at least one label."""
    x = _check_scores(x, name)
    if x.ndim == 2 and x.shape[1] == 0:
        raise ValueError(f"`{name}` must have shape (N,) or (N, L) with L >= 1 labels, got {tuple(x.shape)}")
    return x


def _metric_inputs(probs, targets, from_logits):
    """(probabilities (N, L) float64, targets (N, L) float64) checked; (N,) becomes (N, 1)."""
    check_bool(from_logits, "from_logits")
    probs = _label_scores(as_data(probs, "probs"), "probs")
    targets, _ = _check_binary_targets(as_data(targets, "targets"), probs.shape, probs.device, soft=False)
    _finite_logits(probs, "probs", _SIGMOID_FROM_LOGITS_ADVICE if from_logits else None)
    p = torch.sigmoid(probs.double()) if from_logits else probs.double()
    if not from_logits:
        lo, hi = float(p.min()), float(p.max())
        if lo < 0 or hi > 1:
            raise ValueError(
                f"`probs` must lie in [0, 1], found {lo if lo < 0 else hi:g}; pass from_logits=True for logits"
            )
    y = targets.double()
    if p.ndim == 1:
        p, y = p[:, None], y[:, None]
    return p, y


def _pairs(p, y, top_label):
    """(confidence, correct) pairs whose reliability is measured; the top label predicts 1 iff p > 0.5 (at
    p = 0.5 the first maximum of (1 − p, p), class 0, as the multiclass argmax)."""
    if not top_label:
        return p, y
    return torch.maximum(p, 1 - p), ((p > 0.5).double() == y).double()


def _label_error(conf, correct, n_bins, norm, binning):
    if binning == "equal_width":
        count, conf_sum, correct_sum = bin_sums(equal_width_index(conf, n_bins), n_bins, conf, correct)
        return (ece_from_sums if norm == "l1" else mce_from_sums)(count, conf_sum, correct_sum)
    conf_s, corr_s = sorted_by_confidence(conf, correct.bool())
    return adaece_from_sorted(conf_s, corr_s, n_bins)


def multilabel_calibration_error(
    probs,
    targets,
    *,
    n_bins: int = 15,
    norm: str = "l1",
    binning: str = "equal_width",
    average: str = "macro",
    top_label: bool = False,
    from_logits: bool = False,
):
    """Calibration error of sigmoid outputs per label, averaged (module docstring; SPEC §6).

    Args:
        norm: "l1" (ECE) or "max" (MCE, equal-width bins only).
        binning: "equal_width" or "equal_mass" (AdaECE; every bin holds N/M samples, as the multiclass one).
        average: "macro" (mean over labels), "micro" (pooled N·L pairs) or "none" ((L,) values).
        top_label: the binary top-label variant (confidence max(p, 1 − p), prediction 1 iff p > 0.5) instead
            of the reliability of p.

    Example:
        >>> import torch
        >>> p = torch.tensor([[0.9, 0.2], [0.8, 0.1], [0.3, 0.7], [0.6, 0.4]])
        >>> y = torch.tensor([[1, 0], [1, 0], [0, 1], [0, 1]])
        >>> multilabel_calibration_error(p, y, n_bins=5, average="none")
        tensor([0.3000, 0.3000], dtype=torch.float64)
    """
    n_bins = check_positive_int(n_bins, "n_bins")
    check_choice(norm, "norm", {"l1", "max"})
    check_choice(binning, "binning", {"equal_width", "equal_mass"})
    check_choice(average, "average", {"macro", "micro", "none"})
    check_bool(top_label, "top_label")
    if norm == "max" and binning == "equal_mass":
        raise ValueError("norm='max' (MCE) is defined with binning='equal_width'")
    p, y = _metric_inputs(probs, targets, from_logits)
    conf, correct = _pairs(p, y, top_label)
    if average == "micro":
        return _label_error(conf.reshape(-1), correct.reshape(-1), n_bins, norm, binning)
    values = torch.stack(
        [
            _label_error(conf[:, j].contiguous(), correct[:, j].contiguous(), n_bins, norm, binning)
            for j in range(conf.shape[1])
        ]
    )
    return values if average == "none" else values.mean()


def multilabel_ece(probs, targets, *, n_bins: int = 15, average: str = "macro", from_logits: bool = False):
    """Equal-width ECE of each label's p (:func:`multilabel_calibration_error`)."""
    return multilabel_calibration_error(
        probs, targets, n_bins=n_bins, average=average, from_logits=from_logits
    )


def multilabel_adaece(probs, targets, *, n_bins: int = 15, average: str = "macro", from_logits: bool = False):
    """Equal-mass ECE of each label's p (:func:`multilabel_calibration_error`)."""
    return multilabel_calibration_error(
        probs, targets, n_bins=n_bins, binning="equal_mass", average=average, from_logits=from_logits
    )


def multilabel_mce(probs, targets, *, n_bins: int = 15, average: str = "macro", from_logits: bool = False):
    """Equal-width MCE of each label's p (:func:`multilabel_calibration_error`)."""
    return multilabel_calibration_error(
        probs, targets, n_bins=n_bins, norm="max", average=average, from_logits=from_logits
    )


def multilabel_auroc(scores, targets, *, average: str = "macro", label_names=None):
    """AUROC of each label (Mann–Whitney with mid-ranks for ties). A label whose targets hold one class only
    has no AUROC: it is NaN in ``average="none"`` and left out of the macro mean, with a warning naming it
    (by its entry of ``label_names``, one name per label, when given). Scores must be finite (NaN has no
    rank), as scikit-learn's ``roc_auc_score`` requires.

    Example:
        >>> import torch
        >>> s = torch.tensor([[0.9, 0.2], [0.8, 0.1], [0.3, 0.7], [0.6, 0.4]])
        >>> multilabel_auroc(s, torch.tensor([[1, 0], [1, 0], [0, 1], [0, 1]]), average="none")
        tensor([1., 1.], dtype=torch.float64)
    """
    check_choice(average, "average", {"macro", "none"})
    scores = _label_scores(as_data(scores, "scores"), "scores")
    targets, _ = _check_binary_targets(as_data(targets, "targets"), scores.shape, scores.device, soft=False)
    s, y = scores.double(), targets.double()
    if s.ndim == 1:
        s, y = s[:, None], y[:, None]
    if label_names is not None:
        label_names = list(label_names)
        if len(label_names) != s.shape[1]:
            raise ValueError(
                f"`label_names` must have one name per label ({s.shape[1]}), got {len(label_names)}"
            )
    if not bool(torch.isfinite(s).all()):
        raise ValueError("`scores` contains NaN or infinite values")
    values, missing = [], []
    for j in range(s.shape[1]):
        n_pos = float(y[:, j].sum())
        if n_pos == 0 or n_pos == y.shape[0]:
            values.append(torch.tensor(math.nan, dtype=torch.float64, device=s.device))
            missing.append(label_names[j] if label_names is not None else j)
        else:
            values.append(binary_auroc(s[:, j], y[:, j]))
    if missing:
        warnings.warn(
            f"AUROC is undefined for label(s) {missing}: their targets hold one class only; "
            "left out of the mean",
            UserWarning,
            stacklevel=2,
        )
    values = torch.stack(values)
    if average == "none":
        return values
    kept = values[~torch.isnan(values)]
    return kept.mean() if kept.numel() else torch.tensor(math.nan, dtype=torch.float64, device=s.device)


def multilabel_brier_score(probs, targets, *, average: str = "macro", from_logits: bool = False):
    """Mean (p − y)² per label; macro mean over labels (equal to the mean over all elements)."""
    check_choice(average, "average", {"macro", "none"})
    p, y = _metric_inputs(probs, targets, from_logits)
    values = ((p - y) ** 2).mean(0)
    return values if average == "none" else values.mean()


def multilabel_nll(probs, targets, *, average: str = "macro", from_logits: bool = False):
    """Mean binary cross entropy per label, −y log p − (1 − y) log(1 − p) (p clamped at 1e-12 away from 0
    and 1 for probability inputs; exact log-sigmoid for logits)."""
    check_choice(average, "average", {"macro", "none"})
    if from_logits:
        z = _label_scores(as_data(probs, "logits"), "logits")
        _finite_logits(z, "logits", _SIGMOID_FROM_LOGITS_ADVICE)
        z = z.double()
        y = _check_binary_targets(as_data(targets, "targets"), z.shape, z.device, soft=False)[0].double()
        z, y = (z[:, None], y[:, None]) if z.ndim == 1 else (z, y)
        values = nnf.binary_cross_entropy_with_logits(z, y, reduction="none").mean(0)
    else:
        p, y = _metric_inputs(probs, targets, False)
        p = p.clamp(1e-12, 1 - 1e-12)
        values = (-(y * p.log() + (1 - y) * (1 - p).log())).mean(0)
    return values if average == "none" else values.mean()
