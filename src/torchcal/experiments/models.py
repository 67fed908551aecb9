"""Model registry of the runner (the demo models for now; the papers' CIFAR models follow with their data)."""

from __future__ import annotations

from torch import nn

__all__ = ["create_model", "list_models"]


def _mlp(num_classes: int, in_shape, width: int) -> nn.Module:
    size = 1
    for d in in_shape:
        size *= d
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(size, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, num_classes),
    )


def _small_cnn(num_classes: int, in_shape, width: int) -> nn.Module:
    c, h, w_in = in_shape
    w = max(8, width // 8)
    return nn.Sequential(
        nn.Conv2d(c, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * w * (h // 4) * (w_in // 4), width), nn.ReLU(), nn.Linear(width, num_classes),
    )  # fmt: skip


_MODELS = {
    "mlp": (_mlp, "two hidden ReLU layers of `width` units"),
    "small_cnn": (_small_cnn, "two conv + pool blocks and a `width`-unit head"),
}


def list_models() -> dict[str, str]:
    return {k: v[1] for k, v in _MODELS.items()}


def create_model(name: str, num_classes: int, in_shape, width: int = 256) -> nn.Module:
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; available: {sorted(_MODELS)}")
    return _MODELS[name][0](num_classes, tuple(in_shape), width)
