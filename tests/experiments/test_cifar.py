"""CIFAR / SVHN / CIFAR-10-C readers on fixture files in their exact on-disk formats, augmentation, models."""

import pickle

import numpy as np
import pytest
import torch

from torchcal.experiments.config import load_config
from torchcal.experiments.data.readers import (
    DatasetError,
    load_cifar,
    load_cifar10_c,
    load_svhn,
    random_crop_flip,
    split_train_val,
)
from torchcal.experiments.models.registry import create_model
from torchcal.experiments.training.loop import train


def write_cifar(root, num_classes=10, per_batch=6, test=4):
    """Python-2-style pickles (byte-string keys), rows of 3072 uint8 in channel-major order."""
    rng = np.random.default_rng(num_classes)
    key = b"labels" if num_classes == 10 else b"fine_labels"
    folder = root / ("cifar-10-batches-py" if num_classes == 10 else "cifar-100-python")
    folder.mkdir(parents=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] if num_classes == 10 else ["train"]
    written = {}
    for name in [*names, "test_batch" if num_classes == 10 else "test"]:
        n = test if name.startswith("test") else per_batch
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = rng.integers(0, num_classes, size=n).tolist()
        with open(folder / name, "wb") as fh:
            pickle.dump({b"batch_label": name.encode(), key: labels, b"data": data}, fh, protocol=2)
        written[name] = (data, labels)
    return written


@pytest.mark.parametrize("num_classes", [10, 100])
def test_cifar_pickles(tmp_path, num_classes):
    written = write_cifar(tmp_path, num_classes)
    train_set, test_set = load_cifar(tmp_path, num_classes)
    n_train = 30 if num_classes == 10 else 6
    assert train_set.inputs.shape == (n_train, 3, 32, 32) and len(test_set) == 4
    first = written["data_batch_1" if num_classes == 10 else "train"]
    np.testing.assert_allclose(train_set.inputs[0].numpy().reshape(-1), first[0][0] / 255.0, atol=1e-7)
    assert train_set.targets[: len(first[1])].tolist() == first[1]


@pytest.mark.parametrize(
    "num_classes, sub, archive",
    [
        (10, "cifar-10-batches-py", "cifar-10-python.tar.gz"),
        (100, "cifar-100-python", "cifar-100-python.tar.gz"),
    ],
)
def test_missing_cifar_names_the_sub_folder_the_path_and_the_archive(tmp_path, num_classes, sub, archive):
    with pytest.raises(DatasetError) as caught:
        load_cifar(tmp_path / "nowhere", num_classes)
    message = str(caught.value)
    assert (
        f"looked for the folder {sub}" in message
        and f"{tmp_path / 'nowhere' / sub} does not exist" in message
    )
    assert f"https://www.cs.toronto.edu/~kriz/{archive}" in message
    assert f"tar xzf {archive} -C {tmp_path / 'nowhere'}" in message
    write_cifar(tmp_path, num_classes)
    lost = "test_batch" if num_classes == 10 else "test"
    (tmp_path / sub / lost).unlink()  # a half-unpacked folder: the missing file is named
    with pytest.raises(DatasetError, match=f"{tmp_path / sub} lacks {lost};"):
        load_cifar(tmp_path, num_classes)


def _rewrite(path, **entries):
    """The pickle at ``path`` with some entries replaced (byte-string keys, protocol 2, as CIFAR's)."""
    with open(path, "rb") as fh:
        batch = pickle.load(fh, encoding="bytes")
    batch.update({key.encode(): value for key, value in entries.items()})
    with open(path, "wb") as fh:
        pickle.dump(batch, fh, protocol=2)


def test_cifar_batches_whose_rows_and_labels_disagree_are_refused(tmp_path):
    written = write_cifar(tmp_path, 10)
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    again = "download https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz again"
    _rewrite(batch, labels=written["data_batch_3"][1][:-1])  # one label short
    with pytest.raises(DatasetError, match=f"{batch} holds 6 images but labels of shape \\(5,\\): {again}"):
        load_cifar(tmp_path, 10)
    _rewrite(batch, labels=written["data_batch_3"][1], data=written["data_batch_3"][0][:, :3000])
    with pytest.raises(DatasetError, match=f"{batch} holds data of shape \\(6, 3000\\).*{again}"):
        load_cifar(tmp_path, 10)
    test = tmp_path / "cifar-100-python" / "test"
    write_cifar(tmp_path, 100)
    _rewrite(test, data=np.zeros((4, 32, 32, 3), dtype=np.uint8))  # images not as rows
    with pytest.raises(DatasetError, match=f"{test} holds data of shape \\(4, 32, 32, 3\\)"):
        load_cifar(tmp_path, 100)


def test_cut_or_garbage_cifar_pickles_are_refused(tmp_path):
    write_cifar(tmp_path, 10)
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    again = "download https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz again"
    raw = batch.read_bytes()
    for broken in (raw[: len(raw) // 2], b"<html>Not Found</html>", pickle.dumps([1, 2, 3], protocol=2)):
        batch.write_bytes(broken)
        with pytest.raises(DatasetError, match=f"{batch} (is not a readable pickle|holds a list).*{again}"):
            load_cifar(tmp_path, 10)


def test_cifar_root_may_be_the_sub_folder_itself(tmp_path):
    write_cifar(tmp_path, 10)
    assert len(load_cifar(tmp_path / "cifar-10-batches-py", 10)[0]) == 30


def test_papers_split_is_numpy_seed_1():
    from torchcal.experiments.data.readers import Dataset

    data = Dataset(torch.arange(50).float()[:, None], torch.arange(50))
    train_set, val = split_train_val(data, 5, seed=1)
    indices = list(range(50))
    np.random.seed(1)  # noqa: NPY002 - the released code's legacy global-RNG split, on purpose
    np.random.shuffle(indices)  # noqa: NPY002
    assert val.targets.tolist() == indices[:5] and train_set.targets.tolist() == indices[5:]


def test_svhn_mat_label_ten_is_zero(tmp_path):
    sio = pytest.importorskip("scipy.io")
    x = np.random.default_rng(0).integers(0, 256, size=(32, 32, 3, 5), dtype=np.uint8)
    y = np.array([[10], [1], [2], [10], [9]], dtype=np.uint8)
    sio.savemat(tmp_path / "test_32x32.mat", {"X": x, "y": y})
    data = load_svhn(tmp_path)
    assert data.targets.tolist() == [0, 1, 2, 0, 9]
    assert data.inputs.shape == (5, 3, 32, 32)
    np.testing.assert_allclose(data.inputs[1, 2].numpy(), x[:, :, 2, 1] / 255.0, atol=1e-7)
    with pytest.raises(DatasetError, match="train_32x32.mat"):
        load_svhn(tmp_path, "train")


def test_cifar10_c_severity_blocks(tmp_path):
    images = np.zeros((50000, 32, 32, 3), dtype=np.uint8)
    for s in range(5):
        images[s * 10000 : (s + 1) * 10000] = s * 50
    np.save(tmp_path / "gaussian_noise.npy", images)
    np.save(tmp_path / "labels.npy", np.arange(50000) % 10)
    data = load_cifar10_c(tmp_path, "gaussian_noise", 5)
    assert len(data) == 10000 and data.inputs.shape == (10000, 3, 32, 32)
    assert torch.allclose(data.inputs, torch.full_like(data.inputs, 200 / 255))
    with pytest.raises(ValueError, match="`severity`"):
        load_cifar10_c(tmp_path, "gaussian_noise", 6)
    with pytest.raises(DatasetError, match="fog.npy"):
        load_cifar10_c(tmp_path, "fog", 1)


def test_random_crop_flip_is_a_shifted_possibly_flipped_window():
    x = torch.rand(64, 3, 8, 8)
    out = random_crop_flip(x, torch.Generator().manual_seed(0), padding=2)
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(64):
        found = any(
            torch.equal(out[i], w) or torch.equal(out[i], w.flip(2))
            for w in (padded[i, :, a : a + 8, b : b + 8] for a in range(5) for b in range(5))
        )
        assert found
    again = random_crop_flip(x, torch.Generator().manual_seed(0), padding=2)
    assert torch.equal(out, again)


@pytest.mark.parametrize(
    "name,params",
    [("resnet50", 23_520_842), ("resnet110_he", 1_730_714), ("densenet121", 6_956_298), ("resnet110", None),
     ("wrn_26_10", None)],
)  # fmt: skip
def test_cifar_models(name, params):
    model = create_model(name, 10, (3, 32, 32))
    if params is not None:  # the published parameter counts of these CIFAR variants
        assert sum(p.numel() for p in model.parameters()) == params
    with torch.no_grad():
        assert model.eval()(torch.rand(2, 3, 32, 32)).shape == (2, 10)


def test_tiny_cifar_run_with_augmentation(tmp_path):
    write_cifar(tmp_path / "data", 10, per_batch=8)
    cfg = load_config(None, [f"data.root={tmp_path / 'data'}", "data.name=cifar10", "data.val_size=5",
                             "data.augment=true", "data.shift.name=", "data.ood.sets=[]", "data.loader.batch_size=16",
                             "model.name=resnet110_he", "train.epochs=1", "optim.name=sgd",
                             "optim.lr=0.1", "optim.weight_decay=0.0005", "optim.grad_clip_norm=2.0",
                             "loss.name=flsd-53", "loss.reduction=sum"])  # fmt: skip
    rows = train(cfg, tmp_path / "run")
    assert len(rows) == 1 and np.isfinite(rows[0]["train_loss"])


def test_cifar10_c_block_size_comes_from_the_file(tmp_path):
    """A file of 5·n rows (here n = 7, not the released 10,000) splits into five blocks of n rows."""
    images = np.zeros((35, 32, 32, 3), dtype=np.uint8)
    for s in range(5):
        images[s * 7 : (s + 1) * 7] = 10 * (s + 1)
    np.save(tmp_path / "gaussian_noise.npy", images)
    np.save(tmp_path / "labels.npy", np.arange(35) % 10)
    data = load_cifar10_c(tmp_path, "gaussian_noise", 2)
    assert len(data) == 7 and torch.allclose(data.inputs, torch.full_like(data.inputs, 20 / 255))
    assert data.targets.tolist() == [(7 + i) % 10 for i in range(7)]
    np.save(tmp_path / "gaussian_noise.npy", images[:33])
    with pytest.raises(DatasetError, match="5 severity blocks of equal size"):
        load_cifar10_c(tmp_path, "gaussian_noise", 1)
    np.save(tmp_path / "gaussian_noise.npy", images[:30])
    with pytest.raises(DatasetError, match="labels but"):
        load_cifar10_c(tmp_path, "gaussian_noise", 1)


def test_auroc_for_every_configured_ood_set(tmp_path):
    """CIFAR-10 with SVHN and CIFAR-10-C (Gaussian noise, severity 5) as OOD sets, as in the papers' AUROC
    tables: results.json has one AUROC per set, each equal to ood_auroc of the saved logits, and the report
    one column per set."""
    sio = pytest.importorskip("scipy.io")
    import json

    import torchcal.functional as F
    from torchcal.experiments.evaluation.evaluate import evaluate_run, report

    write_cifar(tmp_path / "data", 10, per_batch=8)
    rng = np.random.default_rng(1)
    svhn = tmp_path / "svhn"
    svhn.mkdir()
    sio.savemat(svhn / "test_32x32.mat", {"X": rng.integers(0, 256, size=(32, 32, 3, 6), dtype=np.uint8),
                                          "y": rng.integers(1, 11, size=(6, 1)).astype(np.uint8)})  # fmt: skip
    c10c = tmp_path / "CIFAR-10-C"
    c10c.mkdir()
    np.save(c10c / "gaussian_noise.npy", rng.integers(0, 256, size=(20, 32, 32, 3), dtype=np.uint8))
    np.save(c10c / "labels.npy", np.arange(20) % 10)
    cfg = load_config(None, [f"data.root={tmp_path / 'data'}", "data.name=cifar10", "data.val_size=5",
                             "data.shift.name=", "data.ood.sets=[svhn, cifar10_c]", f"data.ood.root={svhn}",
                             f"data.shift.root={c10c}", "model.name=small_cnn", "model.width=8",
                             "train.epochs=1"])  # fmt: skip
    train(cfg, tmp_path / "run")
    logits = torch.load(tmp_path / "run" / "logits.pt", weights_only=True)
    assert {"ood", "ood_svhn", "ood_cifar10_c"} <= set(logits) and len(
        logits["ood_cifar10_c"]["targets"]
    ) == 4
    assert torch.equal(logits["ood"]["logits"], logits["ood_svhn"]["logits"])  # the first set
    res = evaluate_run(tmp_path / "run", ("ts",))
    by_set = res["uncalibrated"]["ood_auroc_by_set"]
    assert set(by_set) == {"svhn", "cifar10_c"} and set(res["ts"]["ood_auroc_by_set"]) == {
        "svhn",
        "cifar10_c",
    }
    for name, value in by_set.items():
        expected = F.ood_auroc(logits["test"]["logits"], logits[f"ood_{name}"]["logits"], from_logits=True)
        assert value == pytest.approx(expected.item())
    assert (
        json.loads((tmp_path / "run" / "results.json").read_text())["uncalibrated"]["ood_auroc"]
        == by_set["svhn"]
    )
    markdown, _ = report([tmp_path / "run"], tmp_path / "rep")
    assert "ood auroc cifar10_c | ood auroc svhn |" in markdown
    with pytest.raises(Exception, match=r"unknown OOD set 'mnist' in data.ood.sets\[1\]; available"):
        load_config(None, ["data.ood.sets=[svhn, mnist]"])
    with pytest.raises(Exception, match="is the training dataset itself"):
        load_config(None, ["data.name=digits", "data.ood.sets=[digits]"])
