"""Grad-CAM heatmaps (Selvaraju et al. 2017) and the FCL paper's comparison figure (§5.3.1, Fig. 1: where
CE, focal and FCL models look on the same chest X-rays).

Our own implementation: the ``grad-cam`` package pins a torchvision that replaces the supported torch
(decision 79). For a layer with activations A (C, h, w) and the score y of a class (its logit: softmax or
sigmoid outputs alike), the map is ReLU(Σ_k α_k A_k) with α_k the mean over positions of ∂y/∂A_k,
upsampled bilinearly to the input size and, by default, scaled to a maximum of 1 per image. Grad-CAM is
made for convolutional networks with a global-pooling head (DenseNet-121 of CheXNet, the ResNets): with a
flattening dense head the position-averaged gradients can be negative everywhere, and the map is then 0.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

__all__ = ["grad_cam", "default_layer", "load_run_model", "gradcam_figure"]


def default_layer(model: nn.Module, example: torch.Tensor) -> str:
    """The name of the last module whose output is a feature map (a 4-D tensor larger than 1 × 1) for
    ``example``: the usual Grad-CAM layer (the last convolutional block)."""
    names, hooks = [], []
    for name, module in model.named_modules():
        if name:
            hooks.append(module.register_forward_hook(
                lambda m, i, o, name=name: names.append(name) if _is_map(o) else None
            ))  # fmt: skip
    try:
        with torch.no_grad():
            model(example[:1])
    finally:
        for h in hooks:
            h.remove()
    if not names:
        raise ValueError("the model has no layer with a 4-D (feature map) output: Grad-CAM needs one")
    return names[-1]


def _is_map(output) -> bool:
    return isinstance(output, torch.Tensor) and output.ndim == 4 and output.shape[-1] * output.shape[-2] > 1


def grad_cam(
    model: nn.Module, inputs: torch.Tensor, target, layer: str | None = None, *, normalize: bool = True
):
    """Grad-CAM maps (B, H, W) of ``inputs`` (B, C, H, W) for class / label ``target`` (an int, or a (B,)
    tensor of one per image) at ``layer`` (a module name of ``model``; default :func:`default_layer`).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Conv2d(1, 2, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2, 3))
        >>> grad_cam(model, torch.rand(4, 1, 8, 8), target=1).shape
        torch.Size([4, 8, 8])
    """
    layer = layer or default_layer(model, inputs)
    module = model.get_submodule(layer)
    saved = {}

    def keep(_, __, output):
        output.retain_grad()
        saved["a"] = output

    was_training = model.training
    model.eval()
    handle = module.register_forward_hook(keep)
    try:
        with torch.enable_grad():
            x = inputs.detach().clone().requires_grad_(True)  # a graph even when the weights are frozen
            scores = model(x)
            if scores.ndim != 2:
                raise ValueError(f"the model's output must be (B, classes), got {tuple(scores.shape)}")
            index = torch.as_tensor(target, device=scores.device).long().expand(scores.shape[0])
            picked = scores.gather(1, index[:, None]).sum()
            model.zero_grad(set_to_none=True)
            picked.backward()
    finally:
        handle.remove()
        model.train(was_training)
    a, g = saved["a"], saved["a"].grad
    if a.ndim != 4 or g is None:
        raise ValueError(f"layer {layer!r} gives no 4-D feature map with a gradient (got {tuple(a.shape)})")
    weights = g.mean(dim=(2, 3), keepdim=True)
    cam = torch.relu((weights * a).sum(1, keepdim=True)).detach()
    cam = nn.functional.interpolate(cam, size=inputs.shape[-2:], mode="bilinear", align_corners=False)[:, 0]
    if normalize:
        peak = cam.flatten(1).amax(1).clamp(min=torch.finfo(cam.dtype).tiny)
        cam = cam / peak[:, None, None]
    return cam


def load_run_model(run_dir) -> tuple[nn.Module, dict]:
    """The model of a finished run (the weights its ``logits.pt`` came from: ``best.pt`` when it selected the
    best validation epoch) in eval mode, and its data splits."""
    import yaml

    from ..config import config_from_dict
    from ..data import load_splits
    from ..data.text import load_tokenizer
    from ..training.loop import BEST, CHECKPOINT, CONFIG, _build_model, load_checkpoint  # noqa: F401

    run_dir = Path(run_dir)
    state = load_checkpoint(run_dir / CHECKPOINT)
    cfg = config_from_dict(state["config"], validate=False)
    meta = (yaml.safe_load((run_dir / CONFIG).read_text()) or {}).get("meta") or {}
    tokenizer = load_tokenizer(cfg.model.checkpoint) if cfg.model.name == "transformer" else None
    splits = load_splits(cfg.data, tokenizer)
    train = splits["train"]
    num_classes = int(
        meta.get("num_classes") or (train.targets.shape[1] if train.multilabel else train.targets.max() + 1)
    )
    model = _build_model(cfg, train, num_classes)
    weights = state["model"]
    if (run_dir / BEST).exists() and cfg.train.select != "last":
        weights = torch.load(run_dir / BEST, map_location="cpu", weights_only=True)["model"]
    model.load_state_dict(weights)
    return model.eval(), splits


def gradcam_figure(models: dict, images: torch.Tensor, target, *, layer: str | None = None, titles=None):
    """The comparison figure: one row per image, the image and then each model's Grad-CAM map over it
    (``models``: label -> model, e.g. {"CE": ..., "focal": ..., "FCL": ...}). Returns the Figure."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from ..training.loop import as_model_input

    images = as_model_input(images)  # uint8 images of the lazy sets to [0, 1]
    maps = {name: grad_cam(_unwrap(m), _crop_for(m, images), target, layer) for name, m in models.items()}
    shown = _crop_for(next(iter(models.values())), images)
    n = shown.shape[0]
    fig, axes = plt.subplots(n, len(models) + 1, figsize=(2.4 * (len(models) + 1), 2.4 * n), squeeze=False)
    for i in range(n):
        picture = shown[i].mean(0).numpy()
        axes[i, 0].imshow(picture, cmap="gray")
        axes[i, 0].set_title(titles[i] if titles else "input", fontsize=9)
        for j, (name, cam) in enumerate(maps.items(), 1):
            axes[i, j].imshow(picture, cmap="gray")
            axes[i, j].imshow(cam[i].numpy(), cmap="jet", alpha=0.45, vmin=0, vmax=1)
            axes[i, j].set_title(name, fontsize=9)
    for ax in axes.flat:
        ax.axis("off")
    fig.tight_layout()
    return fig


def _unwrap(model: nn.Module) -> nn.Module:
    from ..models import TenCrop

    return model.model if isinstance(model, TenCrop) else model


def _crop_for(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The centre crop a ten-crop model takes (its training size); other models see the images as they are."""
    from ..models import TenCrop

    if not isinstance(model, TenCrop):
        return images
    c = model.crop
    h, w = images.shape[-2:]
    top, left = (h - c) // 2, (w - c) // 2
    return images[..., top : top + c, left : left + c]
