"""The names of the runner's datasets, shift sets and OOD sets, grouped by the settings they take.

A leaf module: the configuration schema (``experiments.config``) and the readers (``experiments.data``) both
read it, so that the schema's choices and the readers' registry cannot drift apart.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "ImageDatasetName",
    "TextDatasetName",
    "DATASETS",
    "IMAGE_DATASETS",
    "TEXT_DATASETS",
    "MULTILABEL_DATASETS",
    "LAZY_DATASETS",
    "POINT_DATASETS",
    "FIXED_VALIDATION",
    "SHIFTS",
    "OOD_SETS",
]

DATASETS = {
    "fashion_mnist": "Fashion-MNIST (IDX files; Debian package dataset-fashion-mnist)",
    "digits": "scikit-learn digits rescaled to 28 x 28 (bundled with scikit-learn)",
    "fashion_mnist_attributes": "Fashion-MNIST images with 5 overlapping attributes of their class (multi-label)",
    "chestxray14": "ChestX-ray14 (NIH): 14 pathologies, official split, images decoded per batch (multi-label)",
    "imagenet": "ImageNet train/ and val/ <wnid> folders, decoded per batch; val halved into validation / test",
    "cifar10": "CIFAR-10 python pickles (cifar-10-batches-py); 45k/5k split with seed 1",
    "cifar100": "CIFAR-100 python pickles (cifar-100-python); 45k/5k split with seed 1",
    "svhn": "SVHN train_32x32.mat / test_32x32.mat (data.root, default data/svhn); 5k validation, seed 1",
    "20newsgroups": "20 Newsgroups bydate folders + GloVe 100-d vectors (data.glove)",
    "20newsgroups_papers": "20news-19997 folders in the papers' split 15,098 / 900 / 3,999 + GloVe (data.glove)",
    "ag_news": "AG News train.csv / test.csv + GloVe 100-d vectors (data.glove)",
    "finsen": "FinSen finsen.csv in its loader's 70 / 15 / 15 split (seed 42) + GloVe (data.glove)",
    "sst_binary": "Stanford Sentiment Treebank PTB trees, binary (6,920 / 872 / 1,821 sentences)",
    "sst_fine": "Stanford Sentiment Treebank PTB trees, five classes (8,544 / 1,101 / 2,210 sentences)",
    "tiny_imagenet": "Tiny-ImageNet-200 folders; validation = 50 training images per class, test = val split",
    "moons": "scikit-learn's two moons: 2-D points of 2 classes, Gaussian noise data.noise, drawn from data.seed",
}
# small image sets held in memory: the only ones with a shifted test set and OOD sets
ImageDatasetName = Literal["fashion_mnist", "digits", "cifar10", "cifar100", "svhn"]
IMAGE_DATASETS: tuple[str, ...] = get_args(ImageDatasetName)
MULTILABEL_DATASETS = ("fashion_mnist_attributes", "chestxray14")
# images decoded per batch: no shift or OOD set (those are small in-memory image sets)
LAZY_DATASETS = ("chestxray14", "imagenet", "tiny_imagenet")
# points drawn by a generator (no files): 2-D inputs (N, 2), each split drawn on its own from data.seed
POINT_DATASETS = ("moons",)
TextDatasetName = Literal["20newsgroups", "20newsgroups_papers", "ag_news", "finsen", "sst_binary", "sst_fine"]
TEXT_DATASETS: tuple[str, ...] = get_args(TextDatasetName)
FIXED_VALIDATION = {  # datasets whose split fixes the validation set (data.val_size and split_seed unused)
    "tiny_imagenet": "Tiny-ImageNet's validation split is 50 training images per class",
    "20newsgroups_papers": "the papers' 20 Newsgroups split fixes 900 validation documents",
    "finsen": "FinSen's split fixes 15 % of the articles for validation",
    "sst_binary": "the Stanford Sentiment Treebank's dev split is the validation set",
    "sst_fine": "the Stanford Sentiment Treebank's dev split is the validation set",
    "chestxray14": "ChestX-ray14's validation set takes whole patients until data.val_size images",
    "imagenet": "ImageNet's validation images are split into validation and test halves",
}
SHIFTS = {"gaussian_noise": "additive Gaussian noise of σ = data.shift.severity", "cifar10_c": "CIFAR-10-C"}
OOD_SETS = {
    "digits": "scikit-learn digits 28 x 28",
    "svhn": "SVHN test_32x32.mat (data.ood.root)",
    "cifar10_c": "CIFAR-10-C Gaussian noise, severity 5 (data.shift.root)",
}
