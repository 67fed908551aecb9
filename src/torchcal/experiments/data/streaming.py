"""Datasets larger than memory: image folders read lazily, decoded and augmented per sample in DataLoader
worker processes (decision 80).

* :class:`ImageFolderInputs` behaves like the (N, 3, S, S) input tensor the runner indexes, but holds file
  paths: a batch is decoded when asked for (Pillow; greyscale, CMYK and palette images become RGB) and comes
  back as **uint8** (4× less memory and host-to-device traffic than float32; the runner scales it on the
  device). 16-bit greyscale images (PNG; Pillow modes ``I;16`` and ``I``) are scaled to 8 bits as
  round(value · 255 / 65535), so their whole range is kept (Pillow's own conversion clips every value above
  255 to white).
* Training images get the standard ImageNet augmentation, RandomResizedCrop (scale 0.08-1, aspect ratio
  3/4-4/3) and a horizontal flip, drawn from a generator seeded by (seed, epoch, sample index): a sample's
  augmentation does not depend on which worker decodes it, so runs with any number of workers, resumed
  runs and data-parallel ranks see the same images. Evaluated images are resized (shorter side to
  256/224 of the crop) and centre-cropped.
* With ``data.augment_on=device`` the workers only decode, draw the crop and resize the whole image to a
  fixed size; the crops and flips are then taken on the GPU in one ``grid_sample`` (:func:`crop_on_device`),
  which takes the resampling off the CPU (the same draws; the resampling differs slightly from Pillow's).
* :class:`TrainBatches` runs the decoding in persistent ``torch.utils.data.DataLoader`` workers (pinned
  memory, prefetch) over the batches the runner's (seed, epoch) permutation gives; each rank decodes only
  its shard. Workers receive (epoch, batch) keys and compute the indices themselves, so they persist
  across epochs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import overload

import numpy as np
import torch

from ..errors import DatasetError

__all__ = [
    "ImageFolderInputs",
    "image_folder",
    "load_imagenet",
    "random_resized_crop",
    "DeferredCrops",
    "crop_on_device",
    "epoch_order",
    "EpochPlan",
    "TrainBatches",
    "sequential_batches",
    "IMAGE_SUFFIXES",
]

IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")


_SIXTEEN_BIT = ("I", "I;16", "I;16B", "I;16L", "I;16N")  # Pillow's modes of a 16-bit greyscale image


def _open_rgb(path: Path):
    from PIL import Image

    try:
        with Image.open(path) as image:
            if image.mode in _SIXTEEN_BIT:
                values = np.clip(np.asarray(image, dtype=np.int64), 0, 65535)
                # round(v · 255 / 65535) = round(v / 257), exactly: v / 257 never ends in .5
                return Image.fromarray(((values + 128) // 257).astype(np.uint8)).convert("RGB")
            return image.convert("RGB")  # greyscale (L), CMYK, palette and RGBA images as RGB
    except OSError as err:
        raise DatasetError(f"cannot decode image {path}: {err}") from None


@dataclass(frozen=True)
class DeferredCrops:
    """A training batch whose crops are taken on the device (``data.augment_on=device``): the decoded images
    resized to R × R (R = 256/224 of the crop size) as uint8, each sample's crop box in fractions of its image
    (x0, y0, x1, y1) and its flip. Indexing takes the same samples of all three."""

    images: torch.Tensor
    boxes: torch.Tensor
    flips: torch.Tensor
    size: int

    def __getitem__(self, index: slice | torch.Tensor | np.ndarray | Sequence[int]) -> DeferredCrops:
        return DeferredCrops(self.images[index], self.boxes[index], self.flips[index], self.size)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def pin_memory(self) -> DeferredCrops:
        return DeferredCrops(
            self.images.pin_memory(), self.boxes.pin_memory(), self.flips.pin_memory(), self.size
        )


def crop_on_device(batch: DeferredCrops, device) -> torch.Tensor:
    """The augmented (B, 3, S, S) float32 batch in [0, 1]: every sample's box resampled bilinearly to S × S
    (and mirrored when its flip is set) with one ``grid_sample`` on ``device``.

    Example (the whole image as the box, mirrored):
        >>> import torch
        >>> image = torch.arange(16, dtype=torch.uint8).reshape(1, 1, 4, 4).expand(1, 3, 4, 4)
        >>> batch = DeferredCrops(image, torch.tensor([[0.0, 0.0, 1.0, 1.0]]), torch.tensor([True]), 4)
        >>> (crop_on_device(batch, "cpu")[0, 0] * 255).round().int()
        tensor([[ 3,  2,  1,  0],
                [ 7,  6,  5,  4],
                [11, 10,  9,  8],
                [15, 14, 13, 12]], dtype=torch.int32)
    """
    images = batch.images.to(device, non_blocking=True).float().div_(255)
    boxes = batch.boxes.to(device, torch.float32)
    x0, y0, x1, y1 = boxes.unbind(1)
    sx = (x1 - x0) * torch.where(batch.flips.to(device), -1.0, 1.0)
    theta = torch.zeros(len(batch), 2, 3, device=device)
    theta[:, 0, 0], theta[:, 0, 2] = sx, x0 + x1 - 1
    theta[:, 1, 1], theta[:, 1, 2] = y1 - y0, y0 + y1 - 1
    grid = torch.nn.functional.affine_grid(
        theta, [len(batch), 3, batch.size, batch.size], align_corners=False
    )
    return torch.nn.functional.grid_sample(
        images, grid, mode="bilinear", padding_mode="border", align_corners=False
    )


def random_resized_crop(
    width: int, height: int, generator: torch.Generator, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)
):
    """(left, top, w, h) of a random crop covering ``scale`` of the area with aspect ratio in ``ratio`` (log-
    uniform), 10 attempts, else the largest centred crop with the ratio clamped: torchvision's
    RandomResizedCrop algorithm, drawn from ``generator``.

    Example:
        >>> import torch
        >>> left, top, w, h = random_resized_crop(500, 375, torch.Generator().manual_seed(0))
        >>> 0 <= left <= 500 - w and 0 <= top <= 375 - h and 0.08 <= w * h / (500 * 375) <= 1.0
        True
    """
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        draws = torch.rand(3, generator=generator, dtype=torch.float64).tolist()
        target = area * (scale[0] + (scale[1] - scale[0]) * draws[0])
        aspect = math.exp(log_lo + (log_hi - log_lo) * draws[1])
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left = int(draws[2] * (width - w + 1))
            top = int(torch.rand(1, generator=generator, dtype=torch.float64).item() * (height - h + 1))
            return left, top, w, h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        h, w = height, round(height * ratio[1])
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


class ImageFolderInputs:
    """Lazy image inputs: see the module docstring. ``train=True`` augments (call :meth:`set_epoch` each
    epoch), otherwise resize + centre crop (``resize="crop"``) or a plain resize to S × S (``"full"``, a
    no-op for images of that size, e.g. Tiny-ImageNet's). Slicing with a step (``[rank::world]``) or :meth:`head` gives
    another lazy view; any other index decodes those images into a (B, 3, S, S) uint8 tensor."""

    def __init__(
        self, paths, size: int = 224, *, train: bool = False, seed: int = 0, epoch: int = 0, resize="crop"
    ):
        self.paths = [Path(p) for p in paths]
        self.size, self.train, self.seed, self.epoch = int(size), bool(train), int(seed), int(epoch)
        # evaluation: "crop" (shorter side to 256/224 of S, centre crop) or "full" (to S × S)
        self.resize = resize
        self.defer_crop = False  # training: draw the crop here, take it on the device (DeferredCrops)
        self.offset = 0  # index of paths[0] in the full set (views keep the samples' own seeds)
        self.step = 1

    # -- the tensor-like surface the runner uses -----------------------------------------------------------

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.paths), 3, self.size, self.size))

    @property
    def ndim(self) -> int:
        return 4

    @property
    def dtype(self):
        return torch.uint8

    def __len__(self) -> int:
        return len(self.paths)

    def is_floating_point(self) -> bool:
        return False

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _view(self, start: int, stop: int, step: int) -> ImageFolderInputs:
        view = ImageFolderInputs(self.paths[start:stop:step], self.size, train=self.train, seed=self.seed,
                                 epoch=self.epoch, resize=self.resize)  # fmt: skip
        view.offset, view.step = self.offset + start * self.step, self.step * step
        view.defer_crop = self.defer_crop
        return view

    def head(self, n: int) -> ImageFolderInputs:
        return self._view(0, n, 1)

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, index: slice) -> ImageFolderInputs | torch.Tensor | DeferredCrops: ...
    @overload
    def __getitem__(
        self, index: torch.Tensor | np.ndarray | Sequence[int]
    ) -> torch.Tensor | DeferredCrops: ...
    def __getitem__(self, index: int | slice | torch.Tensor | np.ndarray | Sequence[int]):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self.paths))
            if step != 1:
                return self._view(start, stop, step)
            positions = list(range(start, stop))
        elif isinstance(index, int):
            return self.decode(index)
        else:
            positions = self._positions(index)
        if not positions:
            return torch.zeros(0, 3, self.size, self.size, dtype=torch.uint8)
        if self.train and self.defer_crop:
            parts = [self._decode_deferred(i) for i in positions]
            return DeferredCrops(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]),
                                 torch.tensor([p[2] for p in parts]), self.size)  # fmt: skip
        return torch.stack([self.decode(i) for i in positions])

    def _positions(self, index) -> list[int]:
        """The positions an index tensor, array or list selects, as a tensor does: a boolean mask of this
        view's length selects where it is True; negative integers count from the end."""
        index = torch.as_tensor(index)
        n = len(self.paths)
        if index.dtype == torch.bool:
            if index.shape != (n,):
                raise IndexError(
                    f"a boolean mask must have shape ({n},) to index {n} images, got {tuple(index.shape)}"
                )
            return index.nonzero().reshape(-1).tolist()
        if index.numel() and (index.is_floating_point() or index.is_complex()):
            raise IndexError(f"images are indexed by integers or a boolean mask, got dtype {index.dtype}")
        return [self._position(i) for i in index.reshape(-1).tolist()]

    def _position(self, i: int) -> int:
        """``i`` as a position in 0..n-1 (negative counts from the end): the sample's own augmentation seed."""
        n = len(self.paths)
        if not -n <= i < n:
            raise IndexError(f"index {i} is out of range for {n} images")
        return i + n if i < 0 else i

    def _generator(self, i: int) -> torch.Generator:
        global_index = self.offset + i * self.step
        return torch.Generator().manual_seed(hash((self.seed, self.epoch, global_index)) & (2**63 - 1))

    def _decode_deferred(self, i: int):
        """(image resized to R × R as uint8, crop box in fractions, flip) with the draws of :meth:`decode`."""
        from PIL import Image

        image = _open_rgb(self.paths[i])
        g = self._generator(i)
        left, top, w, h = random_resized_crop(image.width, image.height, g)
        flip = torch.rand(1, generator=g).item() < 0.5
        r = round(self.size * 256 / 224)
        box = torch.tensor([left / image.width, top / image.height, (left + w) / image.width,
                            (top + h) / image.height], dtype=torch.float64)  # fmt: skip
        array = np.asarray(image.resize((r, r), Image.Resampling.BILINEAR), dtype=np.uint8)
        return torch.from_numpy(array.transpose(2, 0, 1).copy()), box, flip

    # -- decoding ----------------------------------------------------------------------------------------

    def decode(self, i: int) -> torch.Tensor:
        """Image ``i`` of this view as a (3, S, S) uint8 tensor, augmented (training) or centre-cropped."""
        from PIL import Image

        i = self._position(i)
        image = _open_rgb(self.paths[i])
        s = self.size
        if self.train:
            g = self._generator(i)
            left, top, w, h = random_resized_crop(image.width, image.height, g)
            image = image.resize((s, s), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
            if torch.rand(1, generator=g).item() < 0.5:
                image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        elif self.resize == "full":
            if image.size != (s, s):
                image = image.resize((s, s), Image.Resampling.BILINEAR)
        else:
            short = round(s * 256 / 224)
            scale = short / min(image.width, image.height)
            image = image.resize((max(s, round(image.width * scale)), max(s, round(image.height * scale))),
                                 Image.Resampling.BILINEAR)  # fmt: skip
            left, top = (image.width - s) // 2, (image.height - s) // 2
            image = image.crop((left, top, left + s, top + s))
        array = np.asarray(image, dtype=np.uint8)
        return torch.from_numpy(array.transpose(2, 0, 1).copy())


def image_folder(root: Path) -> tuple[list[Path], list[int], list[str]]:
    """(paths, labels, class names) of a ``<class>/<image>`` folder (ImageNet's ``train/<wnid>/*.JPEG`` and
    the usual ``val/<wnid>/*.JPEG`` layout); classes and files in sorted order."""
    if not root.is_dir():
        raise DatasetError(
            f"missing folder {root}: put ImageNet's train/ and val/ folders (one sub-folder per class, e.g. "
            "train/n01440764/*.JPEG; val/ in the same layout, as the usual valprep script makes it) under data.root"
        )
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    paths, labels = [], []
    for label, name in enumerate(classes):
        for path in sorted((root / name).iterdir()):
            if path.suffix.lower() in IMAGE_SUFFIXES:
                paths.append(path)
                labels.append(label)
    if not paths:
        raise DatasetError(f"{root} holds no images in <class>/<image> folders")
    return paths, labels, classes


def load_imagenet(
    root: str | Path, image_size: int = 224, val_size: int = 25000, split_seed: int = 1, augment: bool = True
):
    """(train, val, test) of ImageNet from ``root/train`` and ``root/val`` folders, lazily. The papers' split
    (AdaFocal, appendix D): the 50,000 validation images are divided into validation and test halves
    (``val_size`` of them, drawn with ``split_seed``, for validation; the rest for test). With ``augment`` the
    training images get RandomResizedCrop + flip while decoding; the runner sets their seed to the run's
    (``train.seed``)."""
    from .dataset import Dataset

    root = Path(root)
    train_paths, train_labels, classes = image_folder(root / "train")
    val_paths, val_labels, val_classes = image_folder(root / "val")
    if val_classes != classes:
        raise DatasetError(
            f"{root}/val holds other classes than {root}/train ({len(val_classes)} vs {len(classes)})"
        )
    if not 0 < val_size < len(val_paths):
        raise DatasetError(
            f"data.val_size={val_size} must leave images of {root}/val ({len(val_paths)}) for both halves"
        )
    order = np.random.RandomState(split_seed).permutation(len(val_paths))
    halves = order[:val_size], order[val_size:]

    def part(paths, labels, train):
        return Dataset(ImageFolderInputs(paths, image_size, train=train), torch.tensor(labels))

    train = part(train_paths, train_labels, augment)
    val, test = (part([val_paths[i] for i in h], [val_labels[i] for i in h], False) for h in halves)
    return train, val, test


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The runner's sample order of an epoch: a permutation seeded by (seed, epoch).

    Example:
        >>> torch.equal(epoch_order(5, seed=0, epoch=1), epoch_order(5, seed=0, epoch=1))
        True
    """
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


class EpochPlan:
    """This rank's share of batch ``b`` of epoch ``e`` (picklable: DataLoader workers compute it too)."""

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        self.n, self.batch_size, self.seed, self.rank, self.world = n, batch_size, seed, rank, world
        self._cached: tuple[int, torch.Tensor] | None = None  # (epoch, its permutation)

    def indices(self, epoch: int, b: int) -> torch.Tensor:
        if self._cached is None or self._cached[0] != epoch:  # one permutation per epoch and process
            self._cached = (epoch, epoch_order(self.n, self.seed, epoch))
        order = self._cached[1]
        return order[b * self.batch_size : (b + 1) * self.batch_size][self.rank :: self.world]


class _PlannedBatches(torch.utils.data.Dataset):
    """Key (epoch, b) -> the decoded batch (a worker runs this)."""

    def __init__(self, inputs, targets, plan: EpochPlan):
        self.inputs, self.targets, self.plan = inputs, targets, plan

    def __getitem__(self, key):
        epoch, b = key
        idx = self.plan.indices(epoch, b)
        if hasattr(self.inputs, "set_epoch"):  # the augmentation of lazy images depends on the epoch
            self.inputs.set_epoch(epoch)
        return self.inputs[idx], self.targets[idx]


class _EpochSampler(torch.utils.data.Sampler):
    def __init__(self, n_batches: int):
        self.n_batches, self.epoch = n_batches, 0

    def __iter__(self):
        return iter([(self.epoch, b) for b in range(self.n_batches)])

    def __len__(self):
        return self.n_batches


class TrainBatches:
    """The training batches of every epoch, decoded in ``num_workers`` persistent DataLoader workers (two
    batches prefetched each, pinned memory on request) or, with 0 workers, in this process."""

    def __init__(
        self, inputs, targets, plan: EpochPlan, n_batches: int, num_workers: int = 0, pin_memory=False
    ):
        self.dataset, self.n_batches = _PlannedBatches(inputs, targets, plan), n_batches
        self.sampler = _EpochSampler(n_batches)
        self.loader = None
        if num_workers > 0:
            self.loader = torch.utils.data.DataLoader(
                self.dataset, batch_size=None, sampler=self.sampler, num_workers=num_workers,
                pin_memory=pin_memory, persistent_workers=True, prefetch_factor=2,
            )  # fmt: skip

    def epoch(self, epoch: int):
        """An iterator of (inputs, targets) over the epoch's batches, in order."""
        if self.loader is None:
            return (self.dataset[(epoch, b)] for b in range(self.n_batches))
        self.sampler.epoch = epoch
        return iter(self.loader)


class _Sequential(torch.utils.data.Dataset):
    def __init__(self, inputs, batch_size):
        self.inputs, self.batch_size = inputs, batch_size

    def __len__(self):
        return -(-len(self.inputs) // self.batch_size)

    def __getitem__(self, b):
        return self.inputs[b * self.batch_size : (b + 1) * self.batch_size]


def sequential_batches(inputs, batch_size: int, num_workers: int = 0, pin_memory: bool = False):
    """``inputs`` in consecutive batches, in order (evaluation); lazy inputs decoded in DataLoader workers."""
    data = _Sequential(inputs, batch_size)
    if not hasattr(inputs, "decode") or num_workers == 0:
        return (data[b] for b in range(len(data)))
    return iter(
        torch.utils.data.DataLoader(data, batch_size=None, num_workers=num_workers, pin_memory=pin_memory)
    )
