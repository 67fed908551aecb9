"""ChestX-ray14 (Wang et al. 2017) for the CheXNet protocol (Rajpurkar et al. 2017; the FCL paper's appendix
A.16): 112,120 frontal X-rays (PNG, 1024 × 1024), 14 pathologies per image, the official patient-wise
``train_val_list.txt`` / ``test_list.txt`` split. Images are decoded on the fly, one batch at a time
(:class:`~torchcal.experiments.data.streaming.ImageFolderInputs`, in DataLoader workers with ``data.loader.num_workers``),
so a run's memory does not grow with the dataset (decisions 79, 80).
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import torch

from ..errors import DatasetError
from .dataset import Dataset
from .streaming import ImageFolderInputs

__all__ = ["PATHOLOGIES", "load_chestxray14"]

# The 14 labels in the standard (CheXNet) order.
PATHOLOGIES = (
    "Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Mass", "Nodule", "Pneumonia", "Pneumothorax",
    "Consolidation", "Edema", "Emphysema", "Fibrosis", "Pleural_Thickening", "Hernia",
)  # fmt: skip


def _image_index(root: Path) -> dict[str, Path]:
    """File name -> path of every PNG in the released layout (``images_001/images/*.png`` ...) or in one flat
    ``images/`` folder (or ``root`` itself)."""
    found = {}
    for pattern in ("images_*/images/*.png", "images/*.png", "*.png"):
        for path in sorted(root.glob(pattern)):
            found.setdefault(path.name, path)
    return found


def _read_list(path: Path) -> list[str]:
    if not path.is_file():
        raise DatasetError(
            f"missing file {path}: put ChestX-ray14's official split lists (train_val_list.txt, test_list.txt) "
            "under data.root"
        )
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def _check_lists(root: Path, train_val: list[str], test: list[str]) -> None:
    """Every image at most once in the split lists: a name listed twice would be trained (or tested) twice, and
    one in both lists would leak test images into training."""

    def first(names):
        return ", ".join(names[:3]) + (f" (and {len(names) - 3} more)" if len(names) > 3 else "")

    for name, listed in (("train_val_list.txt", train_val), ("test_list.txt", test)):
        seen, twice = set(), []
        for image in listed:
            if image in seen and image not in twice:
                twice.append(image)
            seen.add(image)
        if twice:
            raise DatasetError(f"{root / name} lists {len(twice)} image(s) more than once: {first(twice)}")
    in_test = set(test)
    both = [image for image in train_val if image in in_test]
    if both:
        raise DatasetError(
            f"{root / 'train_val_list.txt'} and {root / 'test_list.txt'} share {len(both)} image(s): {first(both)}; "
            "the official split lists are disjoint"
        )


def load_chestxray14(
    root: str | Path,
    val_size: int = 5000,
    split_seed: int = 1,
    image_size: int = 224,
    eval_size: int | None = None,
):
    """(train, val, test) Datasets of ChestX-ray14: lazy uint8 images, (N, 14) float 0/1 targets in
    :data:`PATHOLOGIES` order ("No Finding" = all zeros), ``label_names``.

    ``root`` holds ``Data_Entry_2017.csv`` (columns "Image Index", "Finding Labels" with labels separated
    by ``|``, "Patient ID"), the official ``train_val_list.txt`` and ``test_list.txt`` (disjoint, each image
    listed once: anything else is a :class:`DatasetError`), and the PNGs. The validation set is split off
    train_val **by patient** (no patient in two sets): patients shuffled with ``split_seed``, taken until at
    least ``val_size`` images. Training images are resized to
    ``image_size``, evaluated ones to ``eval_size`` (ten-crop evaluation: 256 for crops of 224)."""
    root = Path(root)
    entry = root / "Data_Entry_2017.csv"
    if not entry.is_file():
        raise DatasetError(
            f"missing file {entry}: put ChestX-ray14 (Data_Entry_2017.csv, train_val_list.txt, test_list.txt and "
            "the images_*/images/*.png folders of the NIH release) under data.root"
        )
    with open(entry, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        needed = {"Image Index", "Finding Labels", "Patient ID"}
        missing = needed - set(reader.fieldnames or ())
        if missing:
            raise DatasetError(f"{entry}: the header lacks {sorted(missing)}")
        rows = {r["Image Index"].strip(): r for r in reader}
    column = {name: j for j, name in enumerate(PATHOLOGIES)}
    images = _image_index(root)

    def part(names):
        paths, targets, patients = [], [], []
        for name in names:
            row = rows.get(name)
            if row is None:
                raise DatasetError(f"{name} is in a split list but not in {entry.name}")
            if name not in images:
                raise DatasetError(f"image {name} not found under {root} (images_*/images/ or images/)")
            y = np.zeros(len(PATHOLOGIES), dtype=np.float32)
            for finding in row["Finding Labels"].split("|"):
                finding = finding.strip()
                if finding == "No Finding":
                    continue
                if finding not in column:
                    raise DatasetError(f"{entry.name}: unknown finding {finding!r} for {name}")
                y[column[finding]] = 1
            paths.append(images[name])
            targets.append(y)
            patients.append(row["Patient ID"].strip())
        return paths, torch.from_numpy(np.stack(targets)) if targets else torch.zeros(0, 14), patients

    train_val = _read_list(root / "train_val_list.txt")
    test_names = _read_list(root / "test_list.txt")
    _check_lists(root, train_val, test_names)
    paths, targets, patients = part(train_val)
    unique = sorted(set(patients))
    order = np.random.RandomState(split_seed).permutation(len(unique))
    count = {p: 0 for p in unique}
    for p in patients:
        count[p] += 1
    val_patients, taken = set(), 0
    for i in order:
        if taken >= val_size:
            break
        val_patients.add(unique[i])
        taken += count[unique[i]]
    is_val = torch.tensor([p in val_patients for p in patients])
    if not bool(is_val.any()) or bool(is_val.all()):
        raise DatasetError(f"the patient-wise validation split of {len(unique)} patients left a split empty")
    eval_size = eval_size or image_size
    names = list(PATHOLOGIES)

    def dataset(mask, size):
        idx = mask.nonzero().squeeze(1).tolist()
        return Dataset(_lazy([paths[i] for i in idx], size), targets[mask], label_names=names)

    test_paths, test_targets, _ = part(test_names)
    train = dataset(~is_val, image_size)
    val = dataset(is_val, eval_size)
    test = Dataset(_lazy(test_paths, eval_size), test_targets, label_names=names)
    return train, val, test


def _lazy(paths, size):
    """The X-rays decoded per batch, as uint8 RGB (the greyscale image on three channels) resized to S × S."""
    return ImageFolderInputs(paths, size, resize="full")
