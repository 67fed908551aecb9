import gzip
import struct

import numpy as np
import pytest
import torch

from torchcal.experiments.data.readers import (
    DatasetError,
    gaussian_noise,
    load_digits_28,
    load_fashion_mnist,
    read_idx,
    split_train_val,
)


def write_idx(path, array, compress):
    codes = {np.uint8: 0x08}
    header = bytes([0, 0, codes[array.dtype.type], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.tobytes()
    if compress:
        with gzip.open(str(path) + ".gz", "wb") as fh:
            fh.write(data)
    else:
        path.write_bytes(data)


def make_fashion_mnist(root, n_train=12, n_test=5, compress=True):
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        write_idx(root / f"{split}-images-idx3-ubyte", images, compress)
        write_idx(root / f"{split}-labels-idx1-ubyte", labels, compress)
        arrays[split] = (images, labels)
    return arrays


@pytest.mark.parametrize("compress", [True, False])
def test_fashion_mnist_idx_round_trip(tmp_path, compress):
    arrays = make_fashion_mnist(tmp_path, compress=compress)
    train, test = load_fashion_mnist(tmp_path)
    assert train.inputs.shape == (12, 1, 28, 28) and test.inputs.shape == (5, 1, 28, 28)
    assert train.inputs.dtype == torch.float32 and train.targets.dtype == torch.int64
    np.testing.assert_allclose(train.inputs[:, 0].numpy(), arrays["train"][0] / 255.0, rtol=0, atol=1e-7)
    assert test.targets.tolist() == arrays["t10k"][1].tolist()


def test_missing_file_says_where_to_put_what(tmp_path):
    with pytest.raises(DatasetError, match=r"apt-get install dataset-fashion-mnist.*data.root"):
        load_fashion_mnist(tmp_path)


def test_bad_idx_files(tmp_path):
    (tmp_path / "x").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(DatasetError, match="bad magic"):
        read_idx(tmp_path / "x")
    (tmp_path / "y").write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 10) + b"\x00" * 3)
    with pytest.raises(DatasetError, match="holds 3 values"):
        read_idx(tmp_path / "y")


def test_cut_idx_files_are_dataset_errors_naming_the_file(tmp_path):
    make_fashion_mnist(tmp_path)
    gz = tmp_path / "train-images-idx3-ubyte.gz"
    gz.write_bytes(gz.read_bytes()[:-30])  # a download cut short: gzip ends before its end-of-stream marker
    with pytest.raises(DatasetError, match=f"{gz} cannot be decompressed.*download it again"):
        load_fashion_mnist(tmp_path)
    cut = tmp_path / "int32"  # int32 values, the file ends 2 bytes into the third
    cut.write_bytes(bytes([0, 0, 0x0C, 1]) + struct.pack(">I", 3) + b"\x00" * 10)
    with pytest.raises(DatasetError, match=f"{cut} ends inside a value"):
        read_idx(cut)
    header = tmp_path / "header"  # 3 dimensions announced, the file ends in the second
    header.write_bytes(bytes([0, 0, 8, 3]) + b"\x00" * 6)
    with pytest.raises(DatasetError, match=f"{header} ends inside its header"):
        read_idx(header)


def test_fashion_mnist_labels_outside_0_to_9_are_refused(tmp_path):
    make_fashion_mnist(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.array([0, 1, 9, 10, 3], dtype=np.uint8), compress=True)
    labels = tmp_path / "t10k-labels-idx1-ubyte.gz"
    with pytest.raises(DatasetError, match=f"{labels} holds labels from 0 to 10: Fashion-MNIST's are 0-9"):
        load_fashion_mnist(tmp_path)


def test_split_is_seeded_disjoint_and_complete():
    full = load_digits_28()
    train, val = split_train_val(full, 300, seed=1)
    again, _ = split_train_val(full, 300, seed=1)
    assert len(train) == len(full) - 300 and len(val) == 300
    assert torch.equal(train.inputs, again.inputs)
    rows = {tuple(r) for r in torch.cat([train.inputs, val.inputs]).flatten(1)[:, ::40].tolist()}
    assert len(rows) > 0.9 * len(full)  # nothing duplicated by the split (digits has a few identical images)
    with pytest.raises(ValueError, match="`val_size`"):
        split_train_val(full, 0)


def test_digits_rescaled_and_noise_shift():
    digits = load_digits_28()
    assert digits.inputs.shape == (1797, 1, 28, 28)
    assert 0 <= digits.inputs.min() and digits.inputs.max() <= 1
    noisy = gaussian_noise(digits, 0.5)
    assert noisy.inputs.min() >= 0 and noisy.inputs.max() <= 1
    assert not torch.equal(noisy.inputs, digits.inputs) and torch.equal(noisy.targets, digits.targets)
