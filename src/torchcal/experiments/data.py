"""Dataset readers and the papers' splits, offline only: a missing file is a clear error saying what to put
where. Images come back as float32 tensors in [0, 1] of shape (N, C, H, W) and labels as int64 (N,).
"""

from __future__ import annotations

import gzip
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "Dataset",
    "DatasetError",
    "FASHION_MNIST_DIR",
    "read_idx",
    "load_fashion_mnist",
    "load_digits_28",
    "split_train_val",
    "gaussian_noise",
    "load_splits",
    "list_datasets",
]

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


class DatasetError(FileNotFoundError):
    """A dataset file is missing or malformed; the message says where to put what."""


@dataclass
class Dataset:
    """Tensors of one split: inputs (N, ...) and integer labels (N,)."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __len__(self) -> int:
        return int(self.targets.shape[0])


def read_idx(path: str | Path) -> np.ndarray:
    """Reads an IDX file (the MNIST format), gzip-compressed or not."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        data = fh.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_TYPES:
        raise DatasetError(f"{path} is not an IDX file (bad magic number)")
    ndim = data[3]
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    dtype = np.dtype(_IDX_TYPES[data[2]])
    body = np.frombuffer(data, dtype=dtype, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise DatasetError(f"{path} holds {body.size} values, its header says {dims}")
    return body.reshape(dims)


def _find(root: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (root / name).is_file():
            return root / name
    raise DatasetError(
        f"Fashion-MNIST file {stem}[.gz] not found in {root}. Install the Debian package "
        f"dataset-fashion-mnist (apt-get install dataset-fashion-mnist) or put the four IDX files "
        f"(train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, "
        f"optionally .gz) in that folder and pass data.root=<folder>."
    )


def load_fashion_mnist(root: str | Path = FASHION_MNIST_DIR) -> tuple[Dataset, Dataset]:
    """(train, test) of Fashion-MNIST from IDX files: 60,000 and 10,000 images of 1 × 28 × 28."""
    root = Path(root or FASHION_MNIST_DIR)
    out = []
    for split in ("train", "t10k"):
        images = read_idx(_find(root, f"{split}-images-idx3-ubyte"))
        labels = read_idx(_find(root, f"{split}-labels-idx1-ubyte"))
        if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
            raise DatasetError(
                f"Fashion-MNIST {split} files disagree: images {images.shape}, labels {labels.shape}"
            )
        x = torch.from_numpy(images.astype(np.float32) / 255.0)[:, None]
        out.append(Dataset(x, torch.from_numpy(labels.astype(np.int64))))
    return out[0], out[1]


def load_digits_28() -> Dataset:
    """scikit-learn's bundled digits (1,797 images of 8 × 8), rescaled to 1 × 28 × 28 in [0, 1] (bilinear)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    images = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    images = torch.nn.functional.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    return Dataset(images.clamp(0, 1), torch.tensor(y, dtype=torch.long))


def split_train_val(train: Dataset, val_size: int, seed: int = 1) -> tuple[Dataset, Dataset]:
    """Shuffles with ``seed`` and takes the first ``val_size`` as validation, the rest as training (SPEC §5)."""
    n = len(train)
    if not 0 < val_size < n:
        raise ValueError(f"`val_size` must be in (0, {n}), got {val_size}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    val_idx, train_idx = perm[:val_size], perm[val_size:]
    return (
        Dataset(train.inputs[train_idx], train.targets[train_idx]),
        Dataset(train.inputs[val_idx], train.targets[val_idx]),
    )


def gaussian_noise(data: Dataset, std: float, seed: int = 0) -> Dataset:
    """A covariate-shifted copy: additive Gaussian noise of standard deviation ``std``, clipped to [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(data.inputs.shape, generator=g) * std
    return Dataset((data.inputs + noise).clamp(0, 1), data.targets.clone())


_DATASETS = {
    "fashion_mnist": "Fashion-MNIST (IDX files; Debian package dataset-fashion-mnist)",
    "digits": "scikit-learn digits rescaled to 28 x 28 (bundled with scikit-learn)",
}


def list_datasets() -> dict[str, str]:
    return dict(_DATASETS)


def load_splits(cfg) -> dict[str, Dataset]:
    """train / val / test (and shift / ood when configured) for a :class:`DataConfig`."""
    if cfg.name == "fashion_mnist":
        train, test = load_fashion_mnist(
            cfg.root or os.environ.get("TORCHCAL_FASHION_MNIST", FASHION_MNIST_DIR)
        )
    elif cfg.name == "digits":
        full = load_digits_28()
        perm = torch.randperm(len(full), generator=torch.Generator().manual_seed(0))
        test_idx, train_idx = perm[:497], perm[497:]
        train = Dataset(full.inputs[train_idx], full.targets[train_idx])
        test = Dataset(full.inputs[test_idx], full.targets[test_idx])
    else:
        raise ValueError(f"unknown dataset {cfg.name!r}; available: {sorted(_DATASETS)}")
    train, val = split_train_val(train, min(cfg.val_size, len(train) // 5), cfg.split_seed)
    if cfg.limit_train:
        train = Dataset(train.inputs[: cfg.limit_train], train.targets[: cfg.limit_train])
    splits = {"train": train, "val": val, "test": test}
    if cfg.shift == "gaussian_noise":
        splits["shift"] = gaussian_noise(test, cfg.shift_severity)
    elif cfg.shift:
        raise ValueError(f"unknown shift {cfg.shift!r}; available: ['gaussian_noise']")
    if cfg.ood == "digits" and cfg.name != "digits":
        splits["ood"] = load_digits_28()
    elif cfg.ood and cfg.ood != "digits":
        raise ValueError(f"unknown OOD set {cfg.ood!r}; available: ['digits']")
    return splits
