"""The lazy input pipeline on a 1,000-image "ImageNet" fixture in the real layout (train/<wnid>/*.JPEG,
val/<wnid>/*.JPEG; greyscale and CMYK JPEGs among them): decoding, the standard augmentation drawn per
(seed, epoch, sample), the papers' validation/test halves, and training that is identical with any number of
DataLoader workers, after a SIGKILL and --resume, and under 2-rank DDP."""

import json
import os
import signal
import struct
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import assert_weights_match_up_to_sum_order, free_port
from torchcal.experiments.config import load_config
from torchcal.experiments.data.streaming import ImageFolderInputs, load_imagenet, random_resized_crop
from torchcal.experiments.errors import DatasetError
from torchcal.experiments.training.loop import train

WNIDS = ["n01440764", "n01443537", "n01484850", "n01491361"]


def write_imagenet(root, train_per_class=250, val_per_class=25):
    """Class k: a bright square in quadrant k on noise; sizes vary; every 10th image greyscale, every 15th CMYK."""
    from PIL import Image

    rng = np.random.default_rng(0)
    count = 0
    for split, n in (("train", train_per_class), ("val", val_per_class)):
        for k, wnid in enumerate(WNIDS):
            folder = root / split / wnid
            folder.mkdir(parents=True)
            for i in range(n):
                w, h = int(rng.integers(40, 64)), int(rng.integers(40, 64))
                pixels = rng.integers(0, 80, (h, w, 3), dtype=np.uint8)
                y0, x0 = (k // 2) * h // 2, (k % 2) * w // 2
                pixels[y0 : y0 + h // 2, x0 : x0 + w // 2] = 230
                image = Image.fromarray(pixels)
                count += 1
                if count % 10 == 0:
                    image = image.convert("L")
                elif count % 15 == 0:
                    image = image.convert("CMYK")
                image.save(folder / f"{wnid}_{i}.JPEG", quality=90)


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory):
    root = tmp_path_factory.mktemp("imagenet")
    write_imagenet(root)
    return root


def args(root, *extra):
    return [f"data.root={root}", "data.name=imagenet", "data.image_size=32", "data.val_size=50",
            "data.loader.batch_size=100", "data.loader.eval_batch_size=100", "data.augment=true",
            "model.name=small_cnn", "model.width=16", "train.epochs=2", "train.num_threads=1",
            "train.calibrators=[ts]", "optim.lr=0.003", *extra]  # fmt: skip


def weights(run):
    return torch.load(run / "checkpoint.pt", weights_only=True)["model"]


def test_reader_layout_modes_and_halves(imagenet):
    train_set, val, test = load_imagenet(imagenet, image_size=24, val_size=40, split_seed=1)
    assert len(train_set) == 1000 and (len(val), len(test)) == (40, 60)
    assert train_set.targets.tolist() == sorted(train_set.targets.tolist())  # classes in sorted wnid order
    assert not {p.name for p in val.inputs.paths} & {p.name for p in test.inputs.paths}
    modes = set()
    from PIL import Image

    for path in train_set.inputs.paths[:40]:
        with Image.open(path) as image:
            modes.add(image.mode)
    assert {"L", "CMYK", "RGB"} <= modes
    batch = val.inputs[torch.arange(10)]
    assert batch.shape == (10, 3, 24, 24) and batch.dtype == torch.uint8
    grey = [i for i, p in enumerate(train_set.inputs.paths[:40]) if Image.open(p).mode == "L"][0]
    decoded = train_set.inputs.decode(grey)  # a greyscale JPEG on three equal channels
    assert torch.equal(decoded[0], decoded[1]) and torch.equal(decoded[1], decoded[2])
    with pytest.raises(DatasetError, match="train/n01440764/\\*.JPEG"):
        load_imagenet(imagenet / "nothing")


def test_augmentation_is_a_function_of_seed_epoch_and_sample(imagenet):
    paths = [p for p in sorted((imagenet / "train" / WNIDS[0]).iterdir())][:6]
    a = ImageFolderInputs(paths, 24, train=True, seed=3)
    first = a[torch.arange(6)]
    again = ImageFolderInputs(paths, 24, train=True, seed=3)
    assert torch.equal(again[torch.arange(6)], first)
    assert torch.equal(a[1::2][torch.arange(3)], first[1::2])  # a shard decodes its samples as the whole set
    a.set_epoch(1)
    assert not torch.equal(a[torch.arange(6)], first)  # another epoch, other crops
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        left, top, w, h = random_resized_crop(64, 48, g)
        assert 0 <= left and left + w <= 64 and 0 <= top and top + h <= 48 and w * h >= 0.08 * 64 * 48 * 0.9


def test_workers_do_not_change_the_run(imagenet, tmp_path):
    train(load_config(None, args(imagenet)), tmp_path / "w0")
    train(load_config(None, args(imagenet, "data.loader.num_workers=2")), tmp_path / "w2")
    a, b = weights(tmp_path / "w0"), weights(tmp_path / "w2")
    for name in a:
        assert torch.equal(a[name], b[name]), name
    rows = [json.loads(x) for x in (tmp_path / "w2" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["val_error"] < 0.6  # it learns from the fixture (chance: 0.75)


def test_sigkill_with_workers_then_resume_is_identical(imagenet, tmp_path):
    cfg_args = args(imagenet, "data.loader.num_workers=2", "train.epochs=3")
    train(load_config(None, cfg_args), tmp_path / "reference")
    run = tmp_path / "killed"
    code = ("from torchcal.experiments.config import load_config; from torchcal.experiments.training.loop import train;"
            f"train(load_config(None, {cfg_args!r}), {str(run)!r})")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while not (run / "checkpoint.pt").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # workers die with their parent (DataLoader watches it)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (run / "logits.pt").exists()
    train(load_config(None, cfg_args), run, resume=True)
    reference, resumed = weights(tmp_path / "reference"), weights(run)
    for name in reference:
        assert torch.equal(reference[name], resumed[name]), name


def _worker(rank, world, port, root, run_dir, extra=()):
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
    train(load_config(None, args(root, "data.loader.num_workers=1", *extra)), run_dir)
    torch.distributed.destroy_process_group()


def test_two_ddp_ranks_match_one_process(imagenet, tmp_path):
    """Each rank decodes only its shard of every batch; the gradients are averaged, so the weights equal a
    single process's with the same global batch up to the order of the float32 gradient sums (each rank sums
    half the batch, then the halves are all-reduced). Plain SGD, so that this order's last-bit differences
    stay last-bit differences (see assert_weights_match_up_to_sum_order): with Adam they grew to 69 of 216
    first-layer weights 8.8e-5 apart on an AVX2 CPU."""
    sgd = ("optim.name=sgd", "optim.momentum=0", "optim.lr=0.05")
    train(load_config(None, args(imagenet, *sgd)), tmp_path / "single")
    mp.start_processes(_worker, args=(2, free_port(), str(imagenet), str(tmp_path / "ddp"), sgd), nprocs=2,
                       start_method="spawn")  # fmt: skip
    a, b = weights(tmp_path / "single"), weights(tmp_path / "ddp")
    assert_weights_match_up_to_sum_order(a, b, steps=2 * 10)  # 2 epochs of 1,000 images in batches of 100


def test_crops_on_the_device_match_the_workers_crops(imagenet):
    """augment_on=device: the same draws (box, flip) per sample; the crop resampled by grid_sample from the
    image resized to 256/224 of the crop, close to Pillow's crop of the original."""
    from torchcal.experiments.data.streaming import DeferredCrops, crop_on_device

    paths = sorted((imagenet / "train" / WNIDS[1]).iterdir())[:16]
    direct = ImageFolderInputs(paths, 32, train=True, seed=5)
    deferred = ImageFolderInputs(paths, 32, train=True, seed=5)
    deferred.defer_crop = True
    batch = deferred[torch.arange(16)]
    assert isinstance(batch, DeferredCrops) and batch.images.shape == (16, 3, 37, 37)
    assert isinstance(batch[torch.tensor([1, 3])], DeferredCrops) and len(batch[torch.tensor([1, 3])]) == 2
    on_device = crop_on_device(batch, "cpu")
    reference = direct[torch.arange(16)].float() / 255
    assert on_device.shape == reference.shape
    assert float((on_device - reference).abs().mean()) < 0.06  # the same crops, another resampling path


def test_device_augmentation_runs_and_ignores_workers(imagenet, tmp_path):
    train(load_config(None, args(imagenet, "data.augment_on=device")), tmp_path / "w0")
    train(load_config(None, args(imagenet, "data.augment_on=device", "data.loader.num_workers=2")), tmp_path / "w2")
    a, b = weights(tmp_path / "w0"), weights(tmp_path / "w2")
    for name in a:
        assert torch.equal(a[name], b[name]), name
    from torchcal.experiments.config import ConfigError

    with pytest.raises(ConfigError, match="data.augment_on=device applies to data.name=imagenet"):
        load_config(None, ["data.name=digits", "data.augment_on=device"])


def test_lazy_sets_refuse_the_in_memory_shift_and_ood_sets():
    from torchcal.experiments.config import ConfigError, validate_config

    for name in ("imagenet", "tiny_imagenet"):
        validate_config(load_config(None, [f"data.name={name}"]))  # no shift or OOD sets by default
        for key in ("data.shift.name=cifar10_c", "data.ood.sets=[svhn]"):
            with pytest.raises(ConfigError, match=f"not data.name={name} \\(decoded per batch\\)"):
                load_config(None, [f"data.name={name}", key])
    with pytest.raises(ConfigError, match="data.ten_crop applies to chestxray14"):
        validate_config(
            load_config(None, ["data.name=imagenet", "data.ten_crop=true"])
        )


def _write_png16(path, values):
    """A 16-bit greyscale PNG written byte by byte (no Pillow): IHDR bit depth 16, colour type 0, filter 0."""

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    h, w = values.shape
    raw = b"".join(b"\0" + row.astype(">u2").tobytes() for row in values)
    header = struct.pack(">IIBBBBB", w, h, 16, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw))
                     + chunk(b"IEND", b""))  # fmt: skip


def test_sixteen_bit_greyscale_is_scaled_to_eight_bits(tmp_path):
    from PIL import Image

    values = np.arange(64 * 64, dtype=np.uint16).reshape(64, 64) * 16  # 0 ... 65520
    values[0, :4] = [65535, 128, 129, 385]  # the top, and either side of a rounding step
    _write_png16(tmp_path / "grey16.png", values)
    expected = np.floor(values.astype(np.float64) * 255 / 65535 + 0.5).astype(np.uint8)
    # mode I (32-bit integers, as older Pillow reads 16-bit PNGs) the same way
    Image.fromarray(values.astype(np.int32)).save(tmp_path / "grey32.tiff")
    for name, mode in (("grey16.png", "I;16"), ("grey32.tiff", "I")):
        with Image.open(tmp_path / name) as image:
            assert image.mode == mode
        decoded = ImageFolderInputs([tmp_path / name], 64, resize="full")[0]
        for channel in decoded:
            np.testing.assert_array_equal(channel.numpy(), expected, err_msg=name)


def test_masks_and_negative_indices_select_as_a_tensor_does(tmp_path):
    """A boolean mask selects where it is True (it was read as the indices 0 and 1), and a negative index is
    the sample counted from the end with that sample's own augmentation (it was seeded by the negative
    number). The reference: the same samples by their non-negative positions, decoded one by one."""
    from PIL import Image

    rng = np.random.default_rng(1)
    paths = []
    for i in range(5):
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(rng.integers(0, 256, (30 + i, 36, 3), dtype=np.uint8)).save(paths[-1])
    inputs = ImageFolderInputs(paths, 16, train=True, seed=2)
    by_position = [inputs.decode(i) for i in range(5)]
    mask = torch.tensor([False, True, False, True, True])
    assert torch.equal(inputs[mask], torch.stack([by_position[i] for i in (1, 3, 4)]))
    assert torch.equal(inputs[mask.numpy()], inputs[[1, 3, 4]])
    assert torch.equal(inputs[torch.tensor([-1, -5])], torch.stack([by_position[4], by_position[0]]))
    assert torch.equal(inputs.decode(-2), by_position[3])
    with pytest.raises(IndexError, match=r"boolean mask must have shape \(5,\)"):
        inputs[torch.tensor([True, False])]
    with pytest.raises(IndexError, match="index 5 is out of range for 5 images"):
        inputs[[0, 5]]
    with pytest.raises(IndexError, match="integers or a boolean mask"):
        inputs[torch.tensor([0.0, 1.0])]
