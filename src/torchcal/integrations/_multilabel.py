"""Multi-label (sigmoid) metric state with unknown targets masked, shared by the integrations.

The framework adapters (torchmetrics, Lightning, Hugging Face) see targets that
:class:`torchcal.metrics.MultilabelCalibrationMetrics` does not take: unknown labels marked −1 or −100 in
an (N, L) target matrix, and sequence layouts (N, T, L). Here every sum is kept per label with its own count,
so a masked element leaves out that label of that sample only.

State: per-label equal-width bin sums (count, p sum, positives), 3·L·M float64 numbers (also giving the
direction of each label's ECE), and per label the
count of known targets and the sums of Brier, NLL and wrong 0/1 decisions, 4·L numbers; optionally every
sample's (p, y) as (B, 2, L) float64 rows, y = −1 where the target is unknown (equal-mass ECE, AUROC).
Without masked elements the values equal :class:`~torchcal.metrics.MultilabelCalibrationMetrics`'.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as nnf

from .._validation import as_data
from ..functional import binary as B
from ..functional._binning import equal_width_index
from ..functional.calibration import binary_auroc, ece_from_sums, mce_from_sums
from ..functional.cumulative import cumulative_extremes
from ..metrics import label_direction

# metric name -> (needs the per-sample rows, averages it supports)
MULTILABEL_METRICS = {
    "ece": (False, ("macro", "micro", "none")),
    "mce": (False, ("macro", "micro", "none")),
    "brier": (False, ("macro", "micro", "none")),
    "nll": (False, ("macro", "micro", "none")),
    "error": (False, ("macro", "micro", "none")),
    "signed_ece": (False, ("macro", "micro", "none")),
    "ece_over": (False, ("macro", "micro", "none")),
    "ece_under": (False, ("macro", "micro", "none")),
    "adaece": (True, ("macro", "micro", "none")),
    "ks": (True, ("macro", "none")),
    "kuiper": (True, ("macro", "none")),
    "auroc": (True, ("macro", "none")),
}


def state_size(num_labels: int, n_bins: int) -> int:
    return 3 * num_labels * n_bins + 4 * num_labels


def _views(sums, num_labels, n_bins):
    lm = num_labels * n_bins
    return sums[: 3 * lm].view(3, num_labels, n_bins), sums[3 * lm :].view(4, num_labels)


def label_rows(scores, targets, num_labels, ignore_index=None, class_dim=None, names=("preds", "target")):
    """(scores (rows, L), targets (rows, L)) from (N, L) or, with the label dimension ``class_dim``,
    (N, ..., L, ...) inputs whose targets have the same shape. Targets equal to ``ignore_index`` stay in
    place (masked later, element by element)."""
    scores, targets = as_data(scores, names[0]), as_data(targets, names[1])
    if tuple(targets.shape) != tuple(scores.shape):
        raise ValueError(
            f"`{names[1]}` must have the shape of `{names[0]}` {tuple(scores.shape)} (one 0/1 target per "
            f"label), got {tuple(targets.shape)}"
        )
    if scores.ndim > 2:
        dim = resolve_class_dim(scores.shape, num_labels, class_dim, names[0], what="labels")
        scores = scores.movedim(dim, -1).reshape(-1, num_labels)
        targets = targets.movedim(dim, -1).reshape(-1, num_labels)
    elif scores.ndim == 1:
        scores, targets = scores[:, None], targets[:, None]
    if scores.shape[-1] != num_labels:
        raise ValueError(
            f"`{names[0]}` has {scores.shape[-1]} labels (last dimension), expected num_labels={num_labels}"
        )
    return scores, targets


def resolve_class_dim(shape, k, class_dim, name, what="classes") -> int:
    """The class (label) dimension of a score tensor with extra dimensions: ``class_dim`` when given, else 1
    when only dimension 1 has size ``k``. A shape whose dimension 1 and last dimension both have size k
    ((N, K, T) or (N, T, K) with T == K) is refused rather than guessed."""
    ndim = len(shape)
    if class_dim is not None:
        if not -ndim <= class_dim < ndim or class_dim % ndim == 0:
            raise ValueError(
                f"`class_dim` must name a dimension of `{name}` other than the batch dimension 0, got "
                f"{class_dim} for shape {tuple(shape)}"
            )
        if shape[class_dim] != k:
            raise ValueError(
                f"`{name}` has size {shape[class_dim]} in class_dim={class_dim}, expected {k} {what}"
            )
        return class_dim % ndim
    if shape[1] == k and shape[-1] == k:
        raise ValueError(
            f"`{name}` of shape {tuple(shape)} is ambiguous: dimension 1 and the last dimension both have "
            f"{k} entries; pass class_dim=1 for PyTorch's (N, K, d1, ...) layout or class_dim=-1 for Hugging "
            "Face's (N, T, K)"
        )
    if shape[1] != k:
        hint = " (for Hugging Face's (N, T, K) layout pass class_dim=-1)" if shape[-1] == k else ""
        raise ValueError(f"`{name}` of shape {tuple(shape)} must have its {k} {what} in dimension 1{hint}")
    return 1


def batch_state(scores, targets, num_labels, n_bins, from_logits, ignore_index, keep_rows):
    """A batch's (flat float64 sums, (B, 2, L) rows or None): ``scores`` (B, L), ``targets`` (B, L) with
    ``ignore_index`` marking unknown labels."""
    known = torch.ones_like(targets, dtype=torch.bool) if ignore_index is None else targets != ignore_index
    clean = torch.where(known, targets, torch.zeros((), dtype=targets.dtype, device=targets.device))
    if ignore_index is not None and not bool(known.any()):
        return None, None
    p, y = B._metric_inputs(scores, clean, from_logits)
    k = known.double()
    m, labels = n_bins, num_labels
    index = (equal_width_index(p, m) + torch.arange(labels, device=p.device) * m).reshape(-1)
    w = k.reshape(-1)
    sums = torch.zeros(state_size(labels, m), dtype=torch.float64, device=p.device)
    bins, per_label = _views(sums, labels, m)
    bins += torch.stack([
        torch.bincount(index, weights=w, minlength=labels * m),
        torch.bincount(index, weights=(p * k).reshape(-1), minlength=labels * m),
        torch.bincount(index, weights=(y * k).reshape(-1), minlength=labels * m),
    ]).view(3, labels, m)  # fmt: skip
    if from_logits:
        nll = nnf.binary_cross_entropy_with_logits(scores.detach().double(), y, reduction="none")
    else:
        q = p.clamp(1e-12, 1 - 1e-12)
        nll = -(y * q.log() + (1 - y) * (1 - q).log())
    per_label += torch.stack([
        k.sum(0), ((p - y) ** 2 * k).sum(0), (nll * k).sum(0), (((p >= 0.5).double() != y).double() * k).sum(0)
    ])  # fmt: skip
    rows = torch.stack([p, torch.where(known, y, -1.0)], dim=1) if keep_rows else None
    return sums, rows


def compute(sums, rows, num_labels, n_bins, names=None) -> dict[str, torch.Tensor]:
    """``<name>`` (macro: mean over the labels with a known target), ``<name>_micro`` (every known (sample,
    label) pair pooled) and ``<name>_per_label`` (L,) for each metric of :data:`MULTILABEL_METRICS` (NaN for
    a label with no known target; AUROC also NaN for a label whose known targets hold one class)."""
    bins, per_label = _views(sums, num_labels, n_bins)
    count = per_label[0]
    if float(count.sum()) == 0:
        raise RuntimeError("multi-label metric computed before any update with a known target")
    nan = torch.tensor(math.nan, dtype=torch.float64, device=sums.device)
    seen = count > 0
    names = set(MULTILABEL_METRICS) if names is None else set(names)
    out: dict[str, torch.Tensor] = {}

    def put(name, values, micro):
        values = torch.where(seen, values, nan)
        out[name], out[f"{name}_per_label"] = values[seen].mean(), values
        if micro is not None:
            out[f"{name}_micro"] = micro

    labels = range(num_labels)
    has_rows = seen.tolist()

    def binned(fn):  # a label without a known target is NaN (no 0/0 of numpy, which would warn)
        return torch.stack([fn(*bins[:, j]).to(nan) if has_rows[j] else nan for j in labels])

    if "ece" in names:
        put("ece", binned(ece_from_sums), ece_from_sums(*bins.sum(1)))
    if "mce" in names:
        put("mce", binned(mce_from_sums), mce_from_sums(*bins.sum(1)))
    if names & {"signed_ece", "ece_over", "ece_under"}:
        out.update(label_direction(bins))
    safe = count.clamp_min(1)
    for i, name in enumerate(("brier", "nll", "error"), start=1):
        if name in names:
            put(name, per_label[i] / safe, per_label[i].sum() / count.sum())
    if names & {"adaece", "auroc", "ks", "kuiper"}:
        if rows is None:
            raise RuntimeError("adaece, auroc, ks and kuiper need the per-sample rows (keep_rows)")
        p, y = rows[:, 0], rows[:, 1]
        known = y >= 0
        if "adaece" in names:
            ada = torch.stack([_adaece(p[known[:, j], j], y[known[:, j], j], n_bins, nan) for j in labels])
            put("adaece", ada, _adaece(p[known], y[known], n_bins, nan))
        if "auroc" in names:
            auroc = torch.stack([_auroc(p[known[:, j], j], y[known[:, j], j], nan) for j in labels])
            kept = auroc[~torch.isnan(auroc)]
            out["auroc"], out["auroc_per_label"] = (kept.mean() if kept.numel() else nan), auroc
        if names & {"ks", "kuiper"}:
            extremes = [_extremes(p[known[:, j], j], y[known[:, j], j], nan) for j in labels]
            hi, lo = torch.stack([e[0] for e in extremes]), torch.stack([e[1] for e in extremes])
            put("ks", torch.maximum(hi, -lo), None)
            put("kuiper", hi - lo, None)
    return out


def _adaece(p, y, n_bins, nan):
    if p.numel() == 0:
        return nan
    return B.multilabel_adaece(p[:, None], y[:, None], n_bins=n_bins, average="none")[0]


def _extremes(p, y, nan):
    """KS/Kuiper's (max(0, max D), min(0, min D)) of one label's known (p, y); NaN for a label without any."""
    return (nan, nan) if p.numel() == 0 else cumulative_extremes(p, y)


def _auroc(p, y, nan):
    n_pos = float(y.sum())
    if n_pos == 0 or n_pos == y.numel():
        return nan
    return binary_auroc(p, y)


def value(out: dict, metric: str, average: str) -> torch.Tensor:
    """One entry of :func:`compute`'s result for ``average`` "macro", "micro" or "none"."""
    return out[{"macro": metric, "micro": f"{metric}_micro", "none": f"{metric}_per_label"}[average]]
