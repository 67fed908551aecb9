"""Model registry of the runner: the demo models and the papers' CIFAR models (SPEC §5)."""

from __future__ import annotations

from torch import nn

from .cifar_models import BasicBlock, Bottleneck, CifarResNet, DenseNet, WideResNet

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


def _resnet50(num_classes, in_shape, width):
    return CifarResNet(Bottleneck, (3, 4, 6, 3), num_classes, in_channels=in_shape[0])


def _resnet110(num_classes, in_shape, width):
    return CifarResNet(Bottleneck, (3, 4, 26, 3), num_classes, in_channels=in_shape[0])


def _resnet110_he(num_classes, in_shape, width):
    return CifarResNet(BasicBlock, (18, 18, 18), num_classes, widths=(16, 32, 64), in_channels=in_shape[0])


_MODELS = {
    "mlp": (_mlp, "two hidden ReLU layers of `width` units"),
    "small_cnn": (_small_cnn, "two conv + pool blocks and a `width`-unit head"),
    "resnet50": (_resnet50, "CIFAR ResNet-50: bottleneck blocks (3, 4, 6, 3), 3 x 3 stem"),
    "resnet110": (_resnet110, "the papers' 'ResNet-110': bottleneck blocks (3, 4, 26, 3) at ImageNet widths"),
    "resnet110_he": (_resnet110_he, "He et al.'s CIFAR ResNet-110: basic blocks 3 x 18, widths 16/32/64"),
    "wrn_26_10": (lambda k, s, w: WideResNet(26, 10, k), "WRN-26-10 without dropout"),
    "densenet121": (lambda k, s, w: DenseNet((6, 12, 24, 16), 32, k), "DenseNet-121 (growth 32) for CIFAR"),
}


def list_models() -> dict[str, str]:
    return {k: v[1] for k, v in _MODELS.items()}


def create_model(name: str, num_classes: int, in_shape, width: int = 256) -> nn.Module:
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; available: {sorted(_MODELS)}")
    return _MODELS[name][0](num_classes, tuple(in_shape), width)
