"""The runner's data: the dataset catalog, the readers of each on-disk format, the papers' splits, the
image-folder streaming of ImageNet and ChestX-ray14, and the text pipelines. Imports nothing of training,
evaluation or reports."""

from __future__ import annotations

from .catalog import (
    DATASETS,
    FIXED_VALIDATION,
    IMAGE_DATASETS,
    LAZY_DATASETS,
    MULTILABEL_DATASETS,
    OOD_SETS,
    POINT_DATASETS,
    SHIFTS,
    TEXT_DATASETS,
)
from .dataset import Dataset
from .readers import (
    FASHION_MNIST_DIR,
    gaussian_noise,
    list_datasets,
    load_cifar,
    load_cifar10_c,
    load_digits_28,
    load_fashion_mnist,
    load_moons,
    load_splits,
    load_svhn,
    load_tiny_imagenet,
    random_crop_flip,
    read_idx,
    split_train_val,
)

__all__ = [
    "DATASETS",
    "FIXED_VALIDATION",
    "IMAGE_DATASETS",
    "LAZY_DATASETS",
    "MULTILABEL_DATASETS",
    "OOD_SETS",
    "POINT_DATASETS",
    "SHIFTS",
    "TEXT_DATASETS",
    "Dataset",
    "FASHION_MNIST_DIR",
    "gaussian_noise",
    "list_datasets",
    "load_cifar",
    "load_cifar10_c",
    "load_digits_28",
    "load_fashion_mnist",
    "load_moons",
    "load_splits",
    "load_svhn",
    "load_tiny_imagenet",
    "random_crop_flip",
    "read_idx",
    "split_train_val",
]
