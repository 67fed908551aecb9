"""Dataset readers and the papers' splits, offline only: a missing file is a clear error saying what to put
where. Images come back as float32 tensors in [0, 1] of shape (N, C, H, W) and labels as int64 (N,).
"""

from __future__ import annotations

import functools
import gzip
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from ..errors import DatasetError
from .catalog import (
    DATASETS,
    FIXED_VALIDATION,
    OOD_SETS,
    POINT_DATASETS,
    SHIFTS,
    TEXT_DATASETS,
)
from .dataset import Dataset

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
    "load_cifar",
    "load_svhn",
    "SVHN_DIR",
    "load_cifar10_c",
    "random_crop_flip",
    "load_tiny_imagenet",
    "load_moons",
]

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
SVHN_DIR = "data/svhn"  # the default folder of SVHN's .mat files, as training set and as OOD set
_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Reads an IDX file (the MNIST format), gzip-compressed or not. The array is read-only; a file read
    before in this process (same path, size and modification time) comes from a small cache, so a grid of
    runs in one worker decompresses Fashion-MNIST once (~1 s each time)."""
    path = Path(path)
    st = path.stat()
    return _read_idx_cached(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_idx_cached(name: str, size: int, mtime_ns: int) -> np.ndarray:
    path = Path(name)
    opener = gzip.open if path.suffix == ".gz" else open
    again = "the file is truncated or corrupt: download it again"
    try:
        with opener(path, "rb") as fh:
            data = fh.read()
    except (EOFError, OSError, zlib.error) as err:  # a cut or damaged .gz (gzip.BadGzipFile is an OSError)
        raise DatasetError(f"{path} cannot be decompressed ({err}): {again}") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_TYPES:
        raise DatasetError(f"{path} is not an IDX file (bad magic number)")
    ndim, offset = data[3], 4 + 4 * data[3]
    if len(data) < offset:
        raise DatasetError(f"{path} ends inside its header ({len(data)} bytes, {offset} expected): {again}")
    dims = struct.unpack(f">{ndim}I", data[4:offset])
    dtype = np.dtype(_IDX_TYPES[data[2]])
    if (len(data) - offset) % dtype.itemsize:
        raise DatasetError(
            f"{path} ends inside a value ({len(data) - offset} bytes of {dtype.itemsize}-byte values after the "
            f"header, which says {dims}): {again}"
        )
    body = np.frombuffer(data, dtype=dtype, offset=offset)
    if body.size != int(np.prod(dims)):
        raise DatasetError(f"{path} holds {body.size} values, its header says {dims}: {again}")
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
        labels_file = _find(root, f"{split}-labels-idx1-ubyte")
        labels = read_idx(labels_file)
        if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
            raise DatasetError(
                f"Fashion-MNIST {split} files disagree: images {images.shape}, labels {labels.shape}"
            )
        if labels.size and (labels.min() < 0 or labels.max() > 9):
            raise DatasetError(
                f"{labels_file} holds labels from {labels.min()} to {labels.max()}: Fashion-MNIST's are 0-9"
            )
        x = torch.from_numpy(images.astype(np.float32) / 255.0)[:, None]
        out.append(Dataset(x, torch.from_numpy(labels.astype(np.int64))))
    return out[0], out[1]


# Fashion-MNIST attributes: a multi-label task on real images, each attribute a fixed set of the ten classes
# (T-shirt/top, Trouser, Pullover, Dress, Coat, Sandal, Shirt, Sneaker, Bag, Ankle boot); they overlap, so an
# image carries 0 to 3 of them (decision 79)
FASHION_ATTRIBUTES = {
    "upper_body": (0, 2, 4, 6),
    "footwear": (5, 7, 9),
    "warm": (2, 4, 9),
    "summer": (0, 3, 5),
    "long_sleeves": (2, 4, 6),
}


def fashion_attributes(labels: torch.Tensor) -> torch.Tensor:
    """(N, 5) float 0/1 attribute targets of Fashion-MNIST class labels (:data:`FASHION_ATTRIBUTES`)."""
    table = torch.zeros(10, len(FASHION_ATTRIBUTES))
    for j, classes in enumerate(FASHION_ATTRIBUTES.values()):
        table[list(classes), j] = 1.0
    return table[labels]


def load_digits_28() -> Dataset:
    """scikit-learn's bundled digits (1,797 images of 8 × 8), rescaled to 1 × 28 × 28 in [0, 1] (bilinear)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    images = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    images = torch.nn.functional.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    return Dataset(images.clamp(0, 1), torch.tensor(y, dtype=torch.long))


def split_train_val(train: Dataset, val_size: int, seed: int = 1) -> tuple[Dataset, Dataset]:
    """The papers' split: indices 0..N-1 shuffled by ``numpy.random.RandomState(seed).shuffle`` (what the
    released code's ``np.random.seed(1); np.random.shuffle(indices)`` does), the first ``val_size`` for
    validation and the rest for training (SPEC §5: CIFAR 45,000 / 5,000 with seed 1)."""
    n = len(train)
    if not 0 < val_size < n:
        raise ValueError(f"`val_size` must be in (0, {n}), got {val_size}")
    indices = np.arange(n)
    np.random.RandomState(seed).shuffle(indices)
    perm = torch.from_numpy(indices)
    val_idx, train_idx = perm[:val_size], perm[val_size:]
    names, inputs = train.label_names, _in_memory(train, "split_train_val")
    return (
        Dataset(inputs[train_idx], train.targets[train_idx], label_names=names),
        Dataset(inputs[val_idx], train.targets[val_idx], label_names=names),
    )


def _in_memory(data: Dataset, what: str) -> torch.Tensor:
    """The inputs of a set held in memory; an image set decoded per batch (whose splits and shifts are fixed
    by its reader) is refused."""
    if not isinstance(data.inputs, torch.Tensor):
        raise ValueError(
            f"{what} takes a set held in memory, got images decoded per batch ({type(data.inputs).__name__})"
        )
    return data.inputs


# ----------------------------------------------------------------------------- CIFAR, SVHN, CIFAR-10-C


def _unpickle(path: Path, again: str) -> dict:
    """A CIFAR pickle (a dict); a file that does not unpickle to one is a :class:`DatasetError` naming it and
    ending with ``again`` (how to get the file anew)."""
    import pickle

    if not path.is_file():
        raise DatasetError(f"missing file {path}")
    try:
        with open(path, "rb") as fh:
            data = pickle.load(fh, encoding="bytes")  # the files are Python-2 pickles with byte-string keys
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError, IndexError,
            KeyError, MemoryError) as err:  # fmt: skip
        raise DatasetError(
            f"{path} is not a readable pickle ({type(err).__name__}: {err}): {again}"
        ) from None
    if not isinstance(data, dict):
        raise DatasetError(f"{path} holds a {type(data).__name__}, not a CIFAR batch (a dict): {again}")
    return data


def _cifar_batch(path: Path, label_key: bytes, again: str) -> tuple[np.ndarray, np.ndarray]:
    """(rows (n, 3072) uint8, labels (n,)) of one CIFAR pickle, checked to agree row by row."""
    part = _unpickle(path, again)
    if b"data" not in part or label_key not in part:
        raise DatasetError(f"{path} lacks {'data' if b'data' not in part else label_key.decode()}: {again}")
    rows, labels = np.asarray(part[b"data"]), np.asarray(part[label_key])
    if rows.ndim != 2 or rows.shape[1] != 3072:
        raise DatasetError(f"{path} holds data of shape {rows.shape}: CIFAR rows are 3072 values (3 × 32 × 32) "
                           f"each, shape (n, 3072); {again}")  # fmt: skip
    if labels.shape != (rows.shape[0],):
        raise DatasetError(f"{path} holds {rows.shape[0]} images but labels of shape {labels.shape}: {again}")
    return rows, labels


def _images_from_rows(rows: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(
        np.asarray(rows, dtype=np.uint8).reshape(-1, 3, 32, 32).astype(np.float32) / 255.0
    )


_CIFAR = {  # num_classes: (sub-folder, archive, training files, test files, label key)
    10: ("cifar-10-batches-py", "cifar-10-python.tar.gz", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"],
         b"labels"),
    100: ("cifar-100-python", "cifar-100-python.tar.gz", ["train"], ["test"], b"fine_labels"),
}  # fmt: skip


def load_cifar(root: str | Path, num_classes: int = 10) -> tuple[Dataset, Dataset]:
    """(train, test) of CIFAR-10 (``cifar-10-batches-py``: data_batch_1..5, test_batch) or CIFAR-100
    (``cifar-100-python``: train, test; fine labels) from the python pickles; 3 × 32 × 32 images. ``root``
    holds the sub-folder (or is it). Nothing is downloaded: a missing file is a :class:`DatasetError` that
    names the sub-folder, the path tried and the archive to unpack there."""
    if num_classes not in _CIFAR:
        raise ValueError(f"`num_classes` must be 10 or 100, got {num_classes}")
    sub, archive, train_files, test_files, label_key = _CIFAR[num_classes]
    root = Path(root)
    folder = root if root.name == sub else root / sub
    if not folder.is_dir() and (root / train_files[0]).is_file():  # the pickles directly in root
        folder = root
    missing = [name for name in (*train_files, *test_files) if not (folder / name).is_file()]
    if missing:
        found = f"{folder} lacks {', '.join(missing)}" if folder.is_dir() else f"{folder} does not exist"
        raise DatasetError(
            f"CIFAR-{num_classes} not found: looked for the folder {sub} (with {', '.join(train_files + test_files)}) "
            f"in data.root={str(root)!r} and {found}; download https://www.cs.toronto.edu/~kriz/{archive} "
            f"(the python version) and unpack it there (tar xzf {archive} -C {root}), or set data.root to the "
            f"folder that holds {sub} (nothing is downloaded automatically)"
        )
    again = (
        f"download https://www.cs.toronto.edu/~kriz/{archive} again and unpack it over the files in {folder}"
    )
    out = []
    for group in (train_files, test_files):
        parts = [_cifar_batch(folder / name, label_key, again) for name in group]
        x = _images_from_rows(np.concatenate([rows for rows, _ in parts]))
        y = torch.tensor(np.concatenate([labels for _, labels in parts]), dtype=torch.long)
        out.append(Dataset(x, y))
    return out[0], out[1]


SVHN_URL = "http://ufldl.stanford.edu/housenumbers/"


def load_svhn(root: str | Path, split: str = "test") -> Dataset:
    """SVHN's ``<split>_32x32.mat`` (``train`` or ``test``; X: 32 × 32 × 3 × N uint8, y: N × 1 with the digits
    1-9 as themselves and 0 as 10) as 3 × 32 × 32 images in [0, 1] and labels 0-9. Nothing is downloaded: a
    missing file is a :class:`DatasetError` that names the file, the folder and where to get it."""
    if split not in ("train", "test"):
        raise ValueError(f"`split` must be 'train' or 'test', got {split!r}")
    from scipy.io import loadmat
    from scipy.io.matlab import MatReadError

    root = Path(root)
    name = f"{split}_32x32.mat"
    path = root / name
    if not path.is_file():
        where = "" if root.is_dir() else " (the folder does not exist)"
        raise DatasetError(
            f"SVHN file {name} not found in the folder {root}{where}: download {SVHN_URL}{name} (the "
            f"cropped-digits format) into that folder, or set the folder's key (data.root for training on SVHN, "
            f"data.ood.root for SVHN as an OOD set) to the folder that holds it (nothing is downloaded "
            f"automatically)"
        )
    try:
        mat = loadmat(path)
    except (MatReadError, ValueError, TypeError, OSError) as err:
        raise DatasetError(f"{path} is not a readable MATLAB file: {err}") from None
    x, y = mat.get("X"), mat.get("y")
    if x is None or y is None or x.ndim != 4 or x.shape[:3] != (32, 32, 3) or y.size != x.shape[3]:
        shapes = {key: getattr(mat.get(key), "shape", None) for key in ("X", "y")}
        raise DatasetError(
            f"{path} holds {shapes}: SVHN's files hold X of shape (32, 32, 3, N) and y of shape (N, 1)"
        )
    labels = np.asarray(y).reshape(-1).astype(np.int64)
    if labels.size and (labels.min() < 1 or labels.max() > 10):
        raise DatasetError(
            f"{path} holds labels from {labels.min()} to {labels.max()}: SVHN's are 1-10 (10 for digit 0)"
        )
    images = torch.from_numpy(np.ascontiguousarray(x.transpose(3, 2, 0, 1)).astype(np.float32) / 255.0)
    return Dataset(images, torch.from_numpy(labels % 10))


def load_cifar10_c(root: str | Path, corruption: str = "gaussian_noise", severity: int = 5) -> Dataset:
    """CIFAR-10-C ``<corruption>.npy`` (50,000 × 32 × 32 × 3 uint8: severities 1-5 in five equal blocks,
    10,000 rows each in the released files) and ``labels.npy``. The block size is read from the file (rows / 5,
    checked), so subsets in the same layout work too."""
    if not 1 <= severity <= 5:
        raise ValueError(f"`severity` must be in 1..5, got {severity}")
    root = Path(root)
    images, labels = root / f"{corruption}.npy", root / "labels.npy"
    for path in (images, labels):
        if not path.is_file():
            raise DatasetError(
                f"missing file {path}: put CIFAR-10-C's {path.name} there (data.root=<folder>)"
            )
    x_all = np.load(images, mmap_mode="r")
    y_all = np.load(labels, mmap_mode="r")
    rows = x_all.shape[0]
    if rows == 0 or rows % 5 or x_all.shape[1:] != (32, 32, 3):
        raise DatasetError(f"{images} holds an array of shape {x_all.shape}: CIFAR-10-C files hold 5 severity "
                           "blocks of equal size, shape (5·n, 32, 32, 3)")  # fmt: skip
    if y_all.shape != (rows,):
        raise DatasetError(f"{labels} holds {y_all.shape} labels but {images} has {rows} rows")
    per = rows // 5
    block = slice((severity - 1) * per, severity * per)
    x, y = x_all[block], np.asarray(y_all[block])
    return Dataset(torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)).astype(np.float32) / 255.0),
                   torch.from_numpy(y.astype(np.int64)))  # fmt: skip


def load_tiny_imagenet(root: str | Path, val_per_class: int = 50) -> tuple[Dataset, Dataset, Dataset]:
    """(train, validation, test) of Tiny-ImageNet-200 from its folder layout: ``wnids.txt``,
    ``train/<wnid>/images/*.JPEG``, ``val/images/*.JPEG`` with ``val/val_annotations.txt``. Validation =
    the first ``val_per_class`` training images of every class (sorted file names), test = the official
    val split (SPEC §5). Images are 3 × 64 × 64 in [0, 1]; classes follow ``wnids.txt``'s order."""
    root = Path(root)
    if (root / "tiny-imagenet-200").is_dir():
        root = root / "tiny-imagenet-200"
    wnids_file = root / "wnids.txt"
    if not wnids_file.is_file():
        raise DatasetError(
            f"missing {wnids_file}: unpack tiny-imagenet-200 (wnids.txt, train/, val/) under data.root"
        )
    wnids = [w.strip() for w in wnids_file.read_text().split() if w.strip()]
    label = {w: i for i, w in enumerate(wnids)}
    tr_x, tr_y, va_x, va_y = [], [], [], []
    for w in wnids:
        files = sorted((root / "train" / w / "images").glob("*.JPEG"))
        if len(files) <= val_per_class:
            raise DatasetError(
                f"{root / 'train' / w / 'images'} holds {len(files)} images, need > {val_per_class}"
            )
        for i, f in enumerate(files):
            (va_x if i < val_per_class else tr_x).append(f)
            (va_y if i < val_per_class else tr_y).append(label[w])
    te_x, te_y = [], []
    annotations = root / "val" / "val_annotations.txt"
    if not annotations.is_file():
        raise DatasetError(f"missing {annotations}: the official val split is the test set")
    for number, line in enumerate(annotations.read_text().splitlines(), start=1):
        parts = line.split("\t")
        if len(parts) >= 2:
            path = root / "val" / "images" / parts[0]
            if not path.is_file():
                raise DatasetError(
                    f"{annotations} names {parts[0]}, which is not in {root / 'val' / 'images'}"
                )
            if parts[1] not in label:
                raise DatasetError(
                    f"{annotations}, line {number}: {parts[0]} has the class {parts[1]!r}, which is not in "
                    f"{wnids_file} ({len(wnids)} classes)"
                )
            te_x.append(path)
            te_y.append(label[parts[1]])

    def to_dataset(paths, ys):  # decoded per batch (decision 80): 100,000 images never sit in memory
        from .streaming import ImageFolderInputs

        return Dataset(ImageFolderInputs(paths, 64, resize="full"), torch.tensor(ys, dtype=torch.long))

    return to_dataset(tr_x, tr_y), to_dataset(va_x, va_y), to_dataset(te_x, te_y)


def load_moons(
    n_train: int = 1000, n_val: int = 500, n_test: int = 1000, noise: float = 0.2, seed: int = 0
) -> tuple[Dataset, Dataset, Dataset]:
    """(train, validation, test) of scikit-learn's two moons (``make_moons``): float32 points of shape (N, 2)
    and int64 labels 0 (the upper half circle) and 1 (the lower one), Gaussian noise of standard deviation
    ``noise`` on each coordinate. Each split is drawn on its own, from the random state
    ``SeedSequence([seed, split])`` (split 0, 1, 2), so it holds ⌊n/2⌋ points of class 0 and ⌈n/2⌉ of class
    1, and no seed's set is another seed's (decision 191).

    Example:
        >>> train, val, test = load_moons(10, 4, 6, noise=0.2, seed=0)
        >>> tuple(train.inputs.shape), train.inputs.dtype, train.targets.tolist().count(1), len(test)
        ((10, 2), torch.float32, 5, 6)
    """
    for name, n in (("n_train", n_train), ("n_val", n_val), ("n_test", n_test)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise ValueError(f"`{name}` must be an integer >= 2 (a point of each class), got {n!r}")
    if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not 0 <= noise < float("inf"):
        raise ValueError(f"`noise` must be a finite number >= 0, got {noise!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"`seed` must be an integer >= 0, got {seed!r}")
    from sklearn.datasets import make_moons

    out = []
    for split, n in enumerate((n_train, n_val, n_test)):
        state = np.random.RandomState(np.random.SeedSequence([seed, split]).generate_state(4))
        x, y = make_moons(n, noise=float(noise), random_state=state)
        inputs, labels = np.asarray(x, dtype=np.float32), np.asarray(y, dtype=np.int64)
        out.append(Dataset(torch.from_numpy(inputs), torch.from_numpy(labels)))
    return out[0], out[1], out[2]


def random_crop_flip(x: torch.Tensor, generator: torch.Generator, padding: int = 4) -> torch.Tensor:
    """RandomCrop(H, padding) + RandomHorizontalFlip on a batch of tensors (on their device), one draw per
    image from ``generator`` (a CPU generator, so the draws are identical on any device)."""
    b, c, h, w = x.shape
    padded = torch.nn.functional.pad(x, (padding, padding, padding, padding))
    oy = torch.randint(0, 2 * padding + 1, (b,), generator=generator).to(x.device)
    ox = torch.randint(0, 2 * padding + 1, (b,), generator=generator).to(x.device)
    flip = (torch.rand(b, generator=generator) < 0.5).to(x.device)
    rows = (oy[:, None] + torch.arange(h, device=x.device))[:, None, :, None]  # (B, 1, H, 1)
    cols = torch.arange(w, device=x.device).expand(b, w)
    cols = (torch.where(flip[:, None], cols.flip(1), cols) + ox[:, None])[:, None, None, :]  # (B, 1, 1, W)
    batch = torch.arange(b, device=x.device)[:, None, None, None]
    channel = torch.arange(c, device=x.device)[None, :, None, None]
    return padded[batch, channel, rows, cols]


def gaussian_noise(data: Dataset, std: float, seed: int = 0) -> Dataset:
    """A covariate-shifted copy: additive Gaussian noise of standard deviation ``std``, clipped to [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    inputs = _in_memory(data, "gaussian_noise")
    noise = torch.randn(inputs.shape, generator=g) * std
    return Dataset((inputs + noise).clamp(0, 1), data.targets.clone())


_DATASETS = DATASETS
_SHIFTS = SHIFTS
_OOD = OOD_SETS


def list_datasets() -> dict[str, str]:
    return dict(_DATASETS)


def load_splits(cfg, tokenizer=None) -> dict[str, Dataset]:
    """train / val / test (and shift / ood when configured) for a data config (one of the kinds of
    :data:`torchcal.experiments.config.DataConfig`); text datasets are
    encoded with a Hugging Face ``tokenizer`` when given (a transformer model), else with their own
    vocabulary."""
    fixed_val: Dataset | None = None  # the validation set of the datasets whose split fixes it
    if cfg.name == "moons":  # drawn, not read: the three splits come from the generator
        train, fixed_val, test = load_moons(cfg.n_train, cfg.val_size, cfg.n_test, cfg.noise, cfg.seed)
    elif cfg.name in ("fashion_mnist", "fashion_mnist_attributes"):
        train, test = load_fashion_mnist(
            cfg.root or os.environ.get("TORCHCAL_FASHION_MNIST", FASHION_MNIST_DIR)
        )
        if cfg.name == "fashion_mnist_attributes":
            names = list(FASHION_ATTRIBUTES)
            train = Dataset(train.inputs, fashion_attributes(train.targets), label_names=names)
            test = Dataset(test.inputs, fashion_attributes(test.targets), label_names=names)
    elif cfg.name in ("cifar10", "cifar100"):
        train, test = load_cifar(cfg.root or "data", 10 if cfg.name == "cifar10" else 100)
    elif cfg.name == "svhn":
        root = cfg.root or SVHN_DIR
        train, test = load_svhn(root, "train"), load_svhn(root, "test")
    elif cfg.name in TEXT_DATASETS:
        from .text import text_splits

        train, fixed_val, test, embeddings = text_splits(
            cfg.name,
            cfg.root or "data",
            cfg.glove,
            max_len=cfg.max_len,
            eval_max_len=cfg.eval_max_len,
            tokenizer=tokenizer,
        )
        train.embeddings = embeddings
    elif cfg.name == "tiny_imagenet":
        train, fixed_val, test = load_tiny_imagenet(cfg.root or "data")
    elif cfg.name == "imagenet":
        from .streaming import load_imagenet

        train, fixed_val, test = load_imagenet(
            cfg.root or "data/imagenet", cfg.image_size, cfg.val_size, cfg.split_seed, augment=cfg.augment
        )
    elif cfg.name == "chestxray14":
        from .chestxray import load_chestxray14

        # ten-crop evaluation: evaluated images at 256/224 of the crop size (CheXNet's 256 for crops of 224)
        eval_size = round(cfg.image_size * 256 / 224) if cfg.ten_crop else cfg.image_size
        train, fixed_val, test = load_chestxray14(
            cfg.root or "data", cfg.val_size, cfg.split_seed, cfg.image_size, eval_size
        )
    elif cfg.name == "digits":
        full = load_digits_28()
        perm = torch.randperm(len(full), generator=torch.Generator().manual_seed(0))
        test_idx, train_idx = perm[:497], perm[497:]
        inputs = _in_memory(full, "digits")
        train = Dataset(inputs[train_idx], full.targets[train_idx])
        test = Dataset(inputs[test_idx], full.targets[test_idx])
    else:
        raise ValueError(f"unknown dataset {cfg.name!r}; available: {sorted(_DATASETS)}")
    if tokenizer is not None and cfg.name not in TEXT_DATASETS:
        raise ValueError(
            f"model.name=transformer needs a text dataset ({', '.join(TEXT_DATASETS)}), not {cfg.name!r}"
        )
    embeddings, vocab_size = train.embeddings, train.vocab_size
    if cfg.name in POINT_DATASETS and fixed_val is not None:
        val = fixed_val  # drawn at data.val_size points
    elif cfg.name in FIXED_VALIDATION:
        if fixed_val is None:
            raise DatasetError(f"the reader of {cfg.name} gave no validation split")
        val = fixed_val
    else:
        train, val = split_train_val(train, min(cfg.val_size, len(train) // 5), cfg.split_seed)
    if cfg.limit_train:
        from .streaming import ImageFolderInputs

        inputs = train.inputs
        n = cfg.limit_train
        first = inputs.head(n) if isinstance(inputs, ImageFolderInputs) else inputs[:n]
        train = Dataset(first, train.targets[: cfg.limit_train], label_names=train.label_names)
    train.embeddings, train.vocab_size = embeddings, vocab_size
    splits = {"train": train, "val": val, "test": test}
    shift = getattr(cfg, "shift", None)  # in-memory image sets only (the config's kinds)
    ood = getattr(cfg, "ood", None)
    if shift is not None and shift.name == "gaussian_noise":
        splits["shift"] = gaussian_noise(test, shift.severity)
    elif shift is not None and shift.name == "cifar10_c":
        splits["shift"] = load_cifar10_c(shift.root or "data/CIFAR-10-C", "gaussian_noise", int(shift.severity))
    elif shift is not None and shift.name:
        raise ValueError(f"unknown shift {shift.name!r}; available: {sorted(_SHIFTS)}")
    ood_sets, ood_root = (ood.sets, ood.root) if ood is not None else ([], "")
    for i, name in enumerate(ood_sets):
        if name == "digits":
            ood_set = load_digits_28()
        elif name == "svhn":
            ood_set = load_svhn(ood_root or SVHN_DIR, "test")
        elif name == "cifar10_c":  # Gaussian noise at severity 5, the papers' OOD set beside SVHN
            root = shift.root if shift is not None else ""
            ood_set = load_cifar10_c(root or "data/CIFAR-10-C", "gaussian_noise", 5)
        else:
            raise ValueError(f"unknown OOD set {name!r}; available: {sorted(_OOD)}")
        if tuple(ood_set.inputs.shape[1:]) != tuple(test.inputs.shape[1:]):  # refused before training
            raise DatasetError(
                f"data.ood.sets: {name} holds images of shape {tuple(ood_set.inputs.shape[1:])}, the model of "
                f"data.name={cfg.name} takes {tuple(test.inputs.shape[1:])}: choose OOD sets of that shape (digits "
                "are 1 x 28 x 28, svhn and cifar10_c 3 x 32 x 32) or none (data.ood.sets=[])"
            )
        splits[f"ood_{name}"] = ood_set
        if i == 0:
            splits["ood"] = ood_set  # the first set is also "the" OOD set of single-set reports
    return splits

