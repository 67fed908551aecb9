"""Tiny-ImageNet-200 folder layout on a fixture of a few PNG-encoded JPEG-named images."""

import numpy as np
import pytest
import torch
from PIL import Image

from torchcal.experiments.data.readers import DatasetError, load_tiny_imagenet


def write_tiny(root, wnids=("n01443537", "n01629819"), per_class=4):
    root = root / "tiny-imagenet-200"
    (root / "val" / "images").mkdir(parents=True)
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
    rng = np.random.default_rng(0)
    for c, w in enumerate(wnids):
        folder = root / "train" / w / "images"
        folder.mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(np.full((64, 64, 3), 40 * c + i, dtype=np.uint8)).save(
                folder / f"{w}_{i}.JPEG", format="PNG"
            )
    lines = []
    for i in range(3):
        name = f"val_{i}.JPEG"
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(
            root / "val" / "images" / name, format="PNG"
        )
        lines.append(f"{name}\t{wnids[i % 2]}\t0\t0\t63\t63")
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")


def test_tiny_imagenet_splits(tmp_path):
    write_tiny(tmp_path)
    train, val, test = load_tiny_imagenet(tmp_path, val_per_class=1)
    assert train.inputs.shape == (6, 3, 64, 64) and len(val) == 2 and len(test) == 3
    assert val.targets.tolist() == [0, 1] and test.targets.tolist() == [0, 1, 0]
    # the first sorted file of each class is validation; pixel values survive exactly (PNG)
    assert val.inputs[1].dtype == torch.uint8  # decoded per batch; the runner scales it on the device
    assert torch.equal(val.inputs[1], torch.full((3, 64, 64), 40, dtype=torch.uint8))
    with pytest.raises(DatasetError, match="need > 4"):
        load_tiny_imagenet(tmp_path, val_per_class=4)
    with pytest.raises(DatasetError, match="wnids.txt"):
        load_tiny_imagenet(tmp_path / "nothing")


def test_unknown_class_in_val_annotations_names_the_file_and_line(tmp_path):
    write_tiny(tmp_path)
    annotations = tmp_path / "tiny-imagenet-200" / "val" / "val_annotations.txt"
    lines = annotations.read_text().splitlines()
    lines[1] = lines[1].replace("n01629819", "n09999999")
    annotations.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match=f"{annotations}, line 2: val_1.JPEG has the class 'n09999999', which "
                                           "is not in .*wnids.txt"):  # fmt: skip
        load_tiny_imagenet(tmp_path, val_per_class=1)
