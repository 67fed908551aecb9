"""Training dynamics: what the papers' analysis figures plot over epochs, logged when ``train.dynamics``
asks for it (nothing is computed otherwise).

Each name of :data:`DYNAMICS` adds one entry to the epoch's row of ``metrics.jsonl`` under ``"dynamics"``:

- ``bins``: per equal-width confidence bin (``train.dynamics_bins`` bins, SPEC §3's edges) of the training
  and validation sets, the sample count, the mean confidence and the accuracy (AdaFocal Figs. 1, 2, 7-14:
  E_val per bin and train against validation confidence; focal loss Fig. 2: train-set reliability). The
  training set is scored as evaluated (no augmentation) by the model at the end of the epoch.
- ``outputs``: on the test set, the NLL, softmax entropy and p_y of the correct and of the wrong samples,
  and the test ECE (focal loss Figs. 1 and 3; dual focal Fig. 4a).
- ``weights``: the Frobenius norm of the last linear layer's weight (focal loss §3, weight magnification).
- ``logits``: on the test set, the percentiles 0, 1, ..., 100 of the maximum logit (an equal-mass histogram,
  dual focal Fig. 4b) and the box-plot statistics of q_j, the largest probability below the true class's
  (dual focal Fig. 4c; whiskers at the furthest values within 1.5 IQR, outliers not kept).
- ``gradients``: the percentiles 0, ..., 100 and the mean of the per-sample gradient norm of the training
  loss with respect to the last linear layer's weight, over the training set (focal loss Fig. 4b-d). For a
  linear layer z = W h + b the sample's gradient is g hᵀ with g = ∂L/∂z, so its norm is ‖g‖ ‖h‖; g is
  the gradient of the configured loss over training-sized batches (its batch reduction undone), h the
  layer's input.

Per-sample quantities are computed in float64 from float32 logits, on the rank that writes the log.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["DYNAMICS", "NEEDS_LINEAR_HEAD", "check_dynamics", "epoch_dynamics", "last_linear"]

DYNAMICS = {
    "bins": "per-bin count, confidence and accuracy of the training and validation sets",
    "outputs": "test NLL, entropy and p_y of correct and wrong samples; test ECE",
    "weights": "the last linear layer's weight norm",
    "logits": "test max-logit percentiles and the box plot of q_j",
    "gradients": "percentiles of the per-sample gradient norm of the last linear layer over the training set",
}
NEEDS_LINEAR_HEAD = ("weights", "gradients")
_PERCENTILES = torch.linspace(0, 1, 101, dtype=torch.float64)


def last_linear(model: nn.Module) -> nn.Linear | None:
    """The model's last ``nn.Linear`` in module order (its classifier head for every registered model)."""
    found = None
    for module in model.modules():
        if isinstance(module, nn.Linear):
            found = module
    return found


def check_dynamics(names, model: nn.Module) -> None:
    """Refuses, before anything is written, names that need a linear head on a model without one."""
    from ..errors import ConfigError

    wanted = [n for n in names if n in NEEDS_LINEAR_HEAD]
    if wanted and last_linear(model) is None:
        raise ConfigError(
            f"train.dynamics={wanted} need a model with a final nn.Linear layer; this model has none"
        )


def _float_or_none(value: torch.Tensor) -> float | None:
    return None if value.numel() == 0 or not torch.isfinite(value) else float(value)


def bin_statistics(logits: torch.Tensor, targets: torch.Tensor, n_bins: int) -> dict[str, list]:
    """Count, mean confidence and accuracy per equal-width top-label confidence bin (None where empty)."""
    from ...functional._binning import equal_width_index

    probs = torch.softmax(logits.double(), dim=1)
    conf, pred = probs.max(dim=1)
    correct = (pred == targets).double()
    bins = equal_width_index(conf, n_bins)
    count = torch.bincount(bins, minlength=n_bins).double()
    conf_sum = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, bins, conf)
    hit_sum = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, bins, correct)
    safe = count.clamp(min=1)
    return {
        "count": [int(c) for c in count],
        "confidence": [float(c) if n else None for c, n in zip(conf_sum / safe, count, strict=True)],
        "accuracy": [float(a) if n else None for a, n in zip(hit_sum / safe, count, strict=True)],
    }


def output_statistics(logits: torch.Tensor, targets: torch.Tensor, n_bins: int) -> dict:
    """NLL, entropy and p_y means over the correct and over the wrong samples (None where there are none),
    and the ECE of the split."""
    from ...functional import expected_calibration_error

    logp = torch.log_softmax(logits.double(), dim=1)
    p = logp.exp()
    nll = -logp.gather(1, targets[:, None]).squeeze(1)
    entropy = -(p * logp).sum(1)
    p_y = p.gather(1, targets[:, None]).squeeze(1)
    correct = p.argmax(1) == targets
    out: dict = {
        "nll": float(nll.mean()),
        "ece": float(expected_calibration_error(p, targets, n_bins=n_bins)),
    }
    for name, mask in (("correct", correct), ("wrong", ~correct)):
        out[f"n_{name}"] = int(mask.sum())
        for key, values in (("nll", nll), ("entropy", entropy), ("p_y", p_y)):
            out[f"{key}_{name}"] = _float_or_none(values[mask].mean())
    return out


def box_statistics(values: torch.Tensor) -> dict[str, float]:
    """Tukey's box plot of ``values``: quartiles (linear interpolation), whiskers at the furthest values
    within 1.5 IQR of the box."""
    v = values.double()
    q1, med, q3 = torch.quantile(v, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)).tolist()
    iqr = q3 - q1
    inside = v[(v >= q1 - 1.5 * iqr) & (v <= q3 + 1.5 * iqr)]
    return {"whislo": float(inside.min()), "q1": q1, "med": med, "q3": q3, "whishi": float(inside.max())}


def dual_probability(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """q_j: per sample, the largest softmax probability strictly below the true class's (0 if none)."""
    p = torch.softmax(logits.double(), dim=1)
    p_y = p.gather(1, targets[:, None])
    below = torch.where(p < p_y, p, torch.zeros_like(p))
    return below.max(dim=1).values


def logit_statistics(logits: torch.Tensor, targets: torch.Tensor) -> dict:
    top = logits.double().max(dim=1).values
    return {
        "max_logit_percentiles": torch.quantile(top, _PERCENTILES).tolist(),
        "q_j": box_statistics(dual_probability(logits, targets)),
    }


def gradient_norms(
    model: nn.Module, loss_fn: nn.Module, inputs, targets: torch.Tensor, predict: Callable, batch_size: int
) -> torch.Tensor:
    """Per-sample ‖∂L_i/∂W‖ of the last linear layer over ``inputs`` (float64, on the CPU). The loss is taken
    over consecutive batches of ``batch_size`` rows, the training batch: a batch-level term (MMCE's pairs,
    ESD's sort) then sees a training-sized batch and never the whole set at once."""
    head = last_linear(model)
    assert head is not None  # check_dynamics refused the run otherwise
    norms: list[torch.Tensor] = []
    handle = head.register_forward_hook(
        lambda _m, args, _out: norms.append(args[0].detach().double().norm(dim=1).cpu())
    )
    try:
        logits = predict(inputs)
    finally:
        handle.remove()
    h_norm = torch.cat(norms)
    loss = copy.deepcopy(loss_fn).cpu()  # a stateful loss's own state is not touched
    grads = []
    for z, y in zip(logits.double().split(batch_size), targets.split(batch_size), strict=True):
        z = z.clone().requires_grad_(True)
        with torch.enable_grad():
            (grad,) = torch.autograd.grad(loss(z, y), z)
        if getattr(loss, "reduction", "mean") == "mean":
            grad = grad * len(y)  # undo the batch mean: each sample's own gradient
        grads.append(grad.norm(dim=1))
    return torch.cat(grads) * h_norm


def epoch_dynamics(
    names,
    *,
    model: nn.Module,
    splits: dict,
    loss_fn: nn.Module,
    n_bins: int,
    predict: Callable,
    batch_size: int,
) -> dict:
    """The epoch's ``dynamics`` entry for ``names`` (:data:`DYNAMICS`); ``predict(inputs)`` returns a split's
    logits (float32, CPU) from the model in evaluation mode; ``batch_size``: the training batch, over which
    the gradients' loss is taken."""
    out: dict = {}
    cache: dict[str, torch.Tensor] = {}

    def logits_of(split: str) -> torch.Tensor:
        if split not in cache:
            cache[split] = predict(splits[split].inputs)
        return cache[split]

    if "gradients" in names:  # the training pass with the head's inputs; its logits serve "bins" too
        train = splits["train"]
        norms = gradient_norms(
            model,
            loss_fn,
            train.inputs,
            train.targets,
            lambda x: cache.setdefault("train", predict(x)),
            batch_size,
        )
        out["gradients"] = {
            "percentiles": torch.quantile(norms, _PERCENTILES).tolist(),
            "mean": float(norms.mean()),
        }
    if "bins" in names:
        out["bins"] = {s: bin_statistics(logits_of(s), splits[s].targets, n_bins) for s in ("train", "val")}
    if "outputs" in names:
        out["outputs"] = output_statistics(logits_of("test"), splits["test"].targets, n_bins)
    if "logits" in names:
        out["logits"] = logit_statistics(logits_of("test"), splits["test"].targets)
    if "weights" in names:
        head = last_linear(model)
        assert head is not None
        out["weights"] = {"last_linear_norm": float(head.weight.detach().double().norm())}
    return out
