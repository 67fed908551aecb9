"""The papers' CIFAR models (SPEC §5): CIFAR ResNet-50, the papers' "ResNet-110", He et al.'s ResNet-110 (also
with stochastic depth), WRN-26-10, DenseNet-121 and the original DenseNet-40, with input normalisation inside
the model."""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "CifarResNet",
    "WideResNet",
    "DenseNet",
    "CifarDenseNet",
    "StochasticDepthResNet",
    "survival_probabilities",
    "Normalize",
    "input_norm",
    "CIFAR_MEAN",
    "CIFAR_STD",
]

# CIFAR-10 statistics, used for CIFAR-100 too (SPEC §5: the released code normalises the CIFAR-100 test set
# with ImageNet statistics; we do not copy that).
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class Normalize(nn.Module):
    """Per-channel (x − mean)/std inside the model, so data stays in [0, 1] on disk and in augmentation."""

    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1))

    def forward(self, x):
        return (x - self.mean) / self.std


def input_norm(in_channels: int, stats=None, constants=(CIFAR_MEAN, CIFAR_STD)) -> Normalize:
    """The input normalisation of a model for ``in_channels``-channel images: the papers' ``constants``
    (CIFAR's, or ImageNet's for the ImageNet stems) for 3-channel images; for any other channel count the
    data's own per-channel ``stats`` = (mean, std) when given, else none (mean 0, std 1; the batch norm after
    the first convolution takes out the inputs' offset and scale either way).

    Example:
        >>> input_norm(1, ((0.29,), (0.35,))).mean.flatten().tolist()
        [0.28999999165534973]
        >>> input_norm(3).mean.shape
        torch.Size([1, 3, 1, 1])
    """
    mean, std = constants
    if in_channels != len(mean):
        mean, std = stats if stats is not None else ((0.0,) * in_channels, (1.0,) * in_channels)
        if len(mean) != in_channels or len(std) != in_channels:
            raise ValueError(f"stats hold {len(mean)} channel means for {in_channels}-channel images")
    return Normalize(tuple(float(m) for m in mean), tuple(float(s) for s in std))


def _bn_relu_conv(cin, cout, k, stride=1):
    return [nn.BatchNorm2d(cin), nn.ReLU(inplace=True), nn.Conv2d(cin, cout, k, stride, k // 2, bias=False)]


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_planes, planes, stride=1):
        super().__init__()
        out = planes * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(in_planes, planes, 1, bias=False), nn.BatchNorm2d(planes), nn.ReLU(inplace=True),
            nn.Conv2d(planes, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes), nn.ReLU(inplace=True),
            nn.Conv2d(planes, out, 1, bias=False), nn.BatchNorm2d(out),
        )  # fmt: skip
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, out, 1, stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes, planes, stride=1):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes), nn.ReLU(inplace=True),
            nn.Conv2d(planes, planes, 3, 1, 1, bias=False), nn.BatchNorm2d(planes),
        )  # fmt: skip
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


def _head(x, fc):
    return fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class CifarResNet(nn.Module):
    """ResNet: stages of ``block`` (stride 2 at the start of every stage but the first) after a stem:
    ``stem="cifar"``, a 3 × 3 stem without max-pool for 32 × 32 inputs; ``"imagenet"``, He et al.'s 7 × 7
    stride-2 stem and max-pool with ImageNet normalisation, for 224 × 224 inputs. Images of another channel
    count than 3 are normalised with their ``stats`` or not at all (:func:`input_norm`)."""

    def __init__(
        self, block, blocks, num_classes, widths=(64, 128, 256, 512), in_channels=3, stem="cifar", stats=None
    ):
        super().__init__()
        if stem == "imagenet":  # He et al.'s ImageNet stem: 7 × 7 stride 2, BN, ReLU, 3 × 3 max-pool stride 2
            self.norm = input_norm(in_channels, stats, (IMAGENET_MEAN, IMAGENET_STD))
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, widths[0], 7, 2, 3, bias=False), nn.BatchNorm2d(widths[0]),
                nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1),
            )  # fmt: skip
        else:
            self.norm = input_norm(in_channels, stats)
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False),
                nn.BatchNorm2d(widths[0]),
                nn.ReLU(inplace=True),
            )
        layers, in_planes = [], widths[0]
        for i, (n, planes) in enumerate(zip(blocks, widths, strict=True)):
            for j in range(n):
                layers.append(block(in_planes, planes, 2 if (i > 0 and j == 0) else 1))
                in_planes = planes * block.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(in_planes, num_classes)

    def forward(self, x):
        return _head(self.layers(self.stem(self.norm(x))), self.fc)


class WideBlock(nn.Module):
    def __init__(self, in_planes, planes, stride):
        super().__init__()
        self.body = nn.Sequential(
            *_bn_relu_conv(in_planes, planes, 3), *_bn_relu_conv(planes, planes, 3, stride)
        )
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Conv2d(in_planes, planes, 1, stride, bias=False)

    def forward(self, x):
        return self.body(x) + self.shortcut(x)


class WideResNet(nn.Module):
    """WRN-d-k (Zagoruyko & Komodakis 2016) without dropout; (d − 4)//6 blocks per stage, like the papers'
    code (so WRN-26-10 has 3 blocks per stage). Inputs of ``in_channels`` channels (:func:`input_norm`)."""

    def __init__(self, depth, widen, num_classes, in_channels=3, stats=None):
        super().__init__()
        n = (depth - 4) // 6
        widths = [16, 16 * widen, 32 * widen, 64 * widen]
        self.norm = input_norm(in_channels, stats)
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
        layers, in_planes = [], widths[0]
        for i, planes in enumerate(widths[1:]):
            for j in range(n):
                layers.append(WideBlock(in_planes, planes, 2 if (i > 0 and j == 0) else 1))
                in_planes = planes
        self.layers = nn.Sequential(*layers, nn.BatchNorm2d(in_planes), nn.ReLU(inplace=True))
        self.fc = nn.Linear(in_planes, num_classes)

    def forward(self, x):
        return _head(self.layers(self.conv1(self.norm(x))), self.fc)


class _DenseLayer(nn.Module):
    def __init__(self, in_planes, growth):
        super().__init__()
        self.body = nn.Sequential(
            *_bn_relu_conv(in_planes, 4 * growth, 1), *_bn_relu_conv(4 * growth, growth, 3)
        )

    def forward(self, x):
        return torch.cat([self.body(x), x], 1)


class DenseNet(nn.Module):
    """DenseNet-BC: bottleneck layers, transitions halving the channels; DenseNet-121 = blocks (6, 12, 24, 16),
    growth 32. ``stem="cifar"``: a 3 × 3 stem of 2·growth channels for 32 × 32 inputs; ``"imagenet"``: the
    ImageNet stem (7 × 7 stride 2 and a max-pool) and ImageNet normalisation, for 224 × 224 inputs. Inputs of
    ``in_channels`` channels (:func:`input_norm`)."""

    def __init__(self, blocks, growth, num_classes, stem: str = "cifar", in_channels=3, stats=None):
        super().__init__()
        planes = 2 * growth
        if (
            stem == "imagenet"
        ):  # Huang et al.'s ImageNet stem (CheXNet): 7 × 7 stride 2, BN, ReLU, 3 × 3 max-pool
            self.norm = input_norm(in_channels, stats, (IMAGENET_MEAN, IMAGENET_STD))
            self.conv1 = nn.Sequential(
                nn.Conv2d(in_channels, planes, 7, 2, 3, bias=False), nn.BatchNorm2d(planes), nn.ReLU(inplace=True),
                nn.MaxPool2d(3, 2, 1),
            )  # fmt: skip
        else:
            self.norm = input_norm(in_channels, stats)
            self.conv1 = nn.Conv2d(in_channels, planes, 3, 1, 1, bias=False)
        stages = []
        for i, n in enumerate(blocks):
            for _ in range(n):
                stages.append(_DenseLayer(planes, growth))
                planes += growth
            if i < len(blocks) - 1:
                stages += [*_bn_relu_conv(planes, planes // 2, 1), nn.AvgPool2d(2)]
                planes //= 2
        self.features = nn.Sequential(*stages, nn.BatchNorm2d(planes), nn.ReLU(inplace=True))
        self.fc = nn.Linear(planes, num_classes)

    def forward(self, x):
        return _head(self.features(self.conv1(self.norm(x))), self.fc)


def survival_probabilities(num_blocks: int, final: float = 0.5) -> list[float]:
    """Huang et al.'s (2016) linear decay rule of stochastic depth: block l = 1..L survives with probability
    p_l = 1 − (l / L)(1 − p_L), so p_0 = 1 is the input and the last block has ``final`` = p_L.

    Example:
        >>> survival_probabilities(4, 0.5)
        [0.875, 0.75, 0.625, 0.5]
    """
    if num_blocks < 1:
        raise ValueError(f"`num_blocks` must be at least 1, got {num_blocks}")
    if not 0.0 < final <= 1.0:
        raise ValueError(
            f"`final` (the last block's survival probability p_L) must be in (0, 1], got {final}"
        )
    return [1.0 - (block / num_blocks) * (1.0 - final) for block in range(1, num_blocks + 1)]


class StochasticDepthBlock(BasicBlock):
    """A basic block whose residual branch is dropped during training with probability 1 − ``survival``,
    one draw per mini-batch from torch's default CPU generator (so a seeded run drops the same blocks on any
    device): H = ReLU(b·f(x) + shortcut(x)), b ~ Bernoulli(survival). In evaluation the branch is scaled by
    its survival probability, H = ReLU(survival·f(x) + shortcut(x)). A dropped branch is not computed, but
    its parameters get a zero gradient (not none), so the optimiser's weight decay and momentum treat every
    block alike and ``DistributedDataParallel`` finds every parameter used."""

    survival: float = 1.0

    def forward(self, x):
        shortcut = self.shortcut(x)
        if not self.training:
            return torch.relu(self.body(x) * self.survival + shortcut)
        if self.survival >= 1.0 or bool(torch.rand(()) < self.survival):
            return torch.relu(self.body(x) + shortcut)
        zero = sum(p.sum() for p in self.body.parameters()) * 0.0  # ties the branch's parameters, O(#params)
        return torch.relu(shortcut + zero)


class StochasticDepthResNet(CifarResNet):
    """He et al.'s CIFAR ResNet (basic blocks, widths 16/32/64, 3 × 3 stem) with stochastic depth (Huang et
    al. 2016): the survival probability of the residual blocks decays linearly from 1 at the input to
    ``final_survival`` (p_L = 0.5 in the paper) at the last block (:func:`survival_probabilities`). Blocks
    (18, 18, 18) are ResNet-110 (SD). Downsampling shortcuts are 1 × 1 projections, as in ``resnet110_he``."""

    def __init__(
        self, blocks, num_classes, widths=(16, 32, 64), final_survival=0.5, in_channels=3, stats=None
    ):
        super().__init__(StochasticDepthBlock, blocks, num_classes, widths, in_channels, "cifar", stats)
        self.survival = survival_probabilities(len(self.layers), final_survival)
        for layer, p in zip(self.layers, self.survival, strict=True):
            assert isinstance(layer, StochasticDepthBlock)
            layer.survival = p


class _PlainDenseLayer(nn.Module):
    def __init__(self, in_planes, growth):
        super().__init__()
        self.body = nn.Sequential(*_bn_relu_conv(in_planes, growth, 3))

    def forward(self, x):
        return torch.cat([x, self.body(x)], 1)


class CifarDenseNet(nn.Module):
    """Huang et al.'s (2017) original CIFAR DenseNet (no bottleneck, no compression): a 3 × 3 convolution of
    16 channels, three dense blocks of (depth − 4) / 3 layers BN-ReLU-conv 3 × 3 of ``growth`` channels,
    transitions BN-ReLU-conv 1 × 1 (channels kept) + 2 × 2 average pooling, then BN-ReLU, global average
    pooling and the classifier; no dropout (the paper's setting for augmented data). Depth 40, growth 12 is
    DenseNet-40 (about 1.0 M parameters)."""

    def __init__(self, depth, growth, num_classes, in_channels=3, stats=None):
        super().__init__()
        if depth < 7 or (depth - 4) % 3:
            raise ValueError(f"`depth` must be 3·n + 4 with n ≥ 1, got {depth}")
        n, planes = (depth - 4) // 3, 16
        self.norm = input_norm(in_channels, stats)
        self.conv1 = nn.Conv2d(in_channels, planes, 3, 1, 1, bias=False)
        stages = []
        for i in range(3):
            for _ in range(n):
                stages.append(_PlainDenseLayer(planes, growth))
                planes += growth
            if i < 2:
                stages += [*_bn_relu_conv(planes, planes, 1), nn.AvgPool2d(2)]
        self.features = nn.Sequential(*stages, nn.BatchNorm2d(planes), nn.ReLU(inplace=True))
        self.fc = nn.Linear(planes, num_classes)

    def forward(self, x):
        return _head(self.features(self.conv1(self.norm(x))), self.fc)
