"""SVHN as a training set (AdaFocal Fig. 53): the reader on fixture files in SVHN's exact on-disk format
(MATLAB .mat, X of shape (32, 32, 3, N) uint8, y of shape (N, 1) with 10 for the digit 0), the usual
validation split, the errors of missing and malformed files, the config's refusal of SVHN as its own OOD set,
and a tiny run end to end."""

import numpy as np
import pytest
import torch

from torchcal.experiments.config import ImageDataConfig, load_config
from torchcal.experiments.data.readers import DatasetError, load_splits, load_svhn
from torchcal.experiments.errors import ConfigError

sio = pytest.importorskip("scipy.io")


def write_svhn(folder, n_train=40, n_test=12, seed=0):
    """The two files as SVHN ships them; labels 1-10 with 10 meaning the digit 0 (each label present)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, n in (("train", n_train), ("test", n_test)):
        x = rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8)
        y = (np.arange(n) % 10 + 1).astype(np.uint8).reshape(n, 1)  # 1, 2, ..., 10, 1, ...
        sio.savemat(folder / f"{split}_32x32.mat", {"X": x, "y": y})
        written[split] = (x, y)
    return written


def test_train_file_is_read_with_label_ten_as_zero(tmp_path):
    written = write_svhn(tmp_path)
    data = load_svhn(tmp_path, "train")
    x, y = written["train"]
    assert data.inputs.shape == (40, 3, 32, 32) and data.inputs.dtype == torch.float32
    assert data.targets.tolist() == [int(v) % 10 for v in y[:, 0]]
    assert data.targets[9].item() == 0 and y[9, 0] == 10  # the file's 10 is the digit 0
    # image i, channel c, row r, column w is X[r, w, c, i] / 255
    np.testing.assert_allclose(data.inputs[7, 1].numpy(), x[:, :, 1, 7] / 255.0, atol=1e-7)
    np.testing.assert_allclose(data.inputs[3, :, 5, 6].numpy(), x[5, 6, :, 3] / 255.0, atol=1e-7)


def svhn_config(root, *more):
    return load_config(None, ["data.name=svhn", f"data.root={root}", "data.val_size=8", "data.shift.name=",
                              "data.ood.sets=[]", *more])  # fmt: skip


def test_the_runner_reads_svhn_with_the_usual_validation_split(tmp_path):
    write_svhn(tmp_path)
    cfg = svhn_config(tmp_path)
    assert isinstance(cfg.data, ImageDataConfig) and cfg.data.name == "svhn"
    splits = load_splits(cfg.data)
    train_all = load_svhn(tmp_path, "train")
    indices = np.arange(40)
    np.random.RandomState(1).shuffle(indices)  # the papers' split: RandomState(seed).shuffle, first val_size
    assert torch.equal(splits["val"].inputs, train_all.inputs[indices[:8]])
    assert torch.equal(splits["train"].targets, train_all.targets[indices[8:]])
    assert torch.equal(splits["test"].inputs, load_svhn(tmp_path, "test").inputs)
    assert set(splits) == {"train", "val", "test"}


def test_a_missing_file_names_the_file_the_folder_and_where_to_get_it(tmp_path):
    with pytest.raises(DatasetError) as caught:
        load_splits(svhn_config(tmp_path / "nowhere").data)
    message = str(caught.value)
    assert "train_32x32.mat not found in the folder" in message and str(tmp_path / "nowhere") in message
    assert "the folder does not exist" in message
    assert "http://ufldl.stanford.edu/housenumbers/train_32x32.mat" in message and "data.root" in message
    write_svhn(tmp_path)
    (tmp_path / "test_32x32.mat").unlink()
    with pytest.raises(DatasetError, match="test_32x32.mat not found in the folder") as caught:
        load_splits(svhn_config(tmp_path).data)
    assert "does not exist" not in str(caught.value)
    with pytest.raises(ValueError, match="`split` must be 'train' or 'test'"):
        load_svhn(tmp_path, "extra")


def test_malformed_files_are_refused(tmp_path):
    sio.savemat(tmp_path / "test_32x32.mat", {"X": np.zeros((28, 28, 1, 4), np.uint8), "y": np.ones((4, 1))})
    with pytest.raises(DatasetError, match=r"SVHN's files hold X of shape \(32, 32, 3, N\)"):
        load_svhn(tmp_path)
    sio.savemat(tmp_path / "test_32x32.mat", {"X": np.zeros((32, 32, 3, 4), np.uint8), "y": np.zeros((4, 1))})
    with pytest.raises(DatasetError, match="labels from 0 to 0: SVHN's are 1-10"):
        load_svhn(tmp_path)
    (tmp_path / "test_32x32.mat").write_bytes(b"not a mat file")
    with pytest.raises(DatasetError, match="is not a readable MATLAB file"):
        load_svhn(tmp_path)


def test_svhn_is_not_both_the_training_set_and_an_ood_set(tmp_path):
    with pytest.raises(ConfigError, match=r"data.ood.sets=\[svhn\] is the training dataset itself"):
        load_config(None, ["data.name=svhn", "data.ood.sets=[svhn]"])
    with pytest.raises(ConfigError, match="is the training dataset itself"):
        load_config(None, ["data.name=svhn", "data.ood.sets=[cifar10_c, svhn]"])
    assert load_config(None, ["data.name=cifar10", "data.ood.sets=[svhn]"]).data.ood.sets == ["svhn"]


def test_tiny_svhn_run(tmp_path):
    """One epoch on a fixture SVHN through `train`: every digit, 0 included, reaches the saved logits."""
    from torchcal.experiments.training.loop import train

    write_svhn(tmp_path / "svhn", n_train=40, n_test=10)
    cfg = svhn_config(tmp_path / "svhn", "model.name=small_cnn", "model.width=16", "train.epochs=1",
                      "data.loader.batch_size=16", "data.augment=true", "train.calibrators=[]")  # fmt: skip
    rows = train(cfg, tmp_path / "run")
    assert len(rows) == 1 and np.isfinite(rows[0]["train_loss"])
    logits = torch.load(tmp_path / "run" / "logits.pt", weights_only=True)
    assert logits["test"]["logits"].shape == (10, 10)
    assert sorted(logits["test"]["targets"].tolist()) == list(range(10))


def test_an_ood_set_of_another_image_shape_is_refused_before_training(tmp_path):
    """The default OOD set (scikit-learn digits, 1 × 28 × 28) does not fit a model of SVHN's 3 × 32 × 32
    images: refused when the data are loaded, before anything is written (it used to fail after training)."""
    from torchcal.experiments.training.loop import train

    write_svhn(tmp_path / "svhn")
    cfg = load_config(None, ["data.name=svhn", f"data.root={tmp_path / 'svhn'}", "data.val_size=8",
                             "model.name=small_cnn", "train.epochs=1"])  # fmt: skip
    assert cfg.data.ood.sets == ["digits"]
    with pytest.raises(DatasetError, match=r"digits holds images of shape \(1, 28, 28\), the model of "
                       r"data.name=svhn takes \(3, 32, 32\)"):  # fmt: skip
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_the_cli_refuses_missing_svhn_and_a_misfit_ood_set_in_one_line_writing_nothing(tmp_path):
    from typer.testing import CliRunner

    from torchcal.experiments.cli import app

    runner = CliRunner()
    missing = tmp_path / "nowhere"
    result = runner.invoke(app, ["train", "-o", str(tmp_path / "r"), "data.name=svhn", f"data.root={missing}",
                                 "data.ood.sets=[]"])  # fmt: skip
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert len(line.splitlines()) == 1 and "train_32x32.mat not found in the folder" in line
    assert str(missing) in line and "http://ufldl.stanford.edu/housenumbers/train_32x32.mat" in line
    assert not (tmp_path / "r").exists()
    write_svhn(tmp_path / "svhn")
    result = runner.invoke(app, ["train", "-o", str(tmp_path / "r"), "data.name=svhn",
                                 f"data.root={tmp_path / 'svhn'}", "data.val_size=8"])  # fmt: skip
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert len(line.splitlines()) == 1 and "digits holds images of shape (1, 28, 28)" in line
    assert not (tmp_path / "r").exists()
