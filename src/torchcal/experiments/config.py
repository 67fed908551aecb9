"""The experiment configuration, declared: one pydantic model per section, YAML files, dotted overrides.

A run is a YAML file plus ``section.key=value`` overrides. Each constraint sits on its field (a range, a
choice, finite numbers); each rule across fields is one validator named for what it checks. The data
section is a choice by ``data.name``: in-memory image sets carry a shifted test set (``data.shift``) and OOD
sets (``data.ood``), text sets their token lengths and word vectors, the per-batch image sets their image
size, and every set its loader (``data.loader``). A value that cannot run is refused before anything is
written, with one sentence naming the key and what it accepts (:class:`ConfigError`).

Files written for the flat data section of earlier releases (``data.batch_size``, ``data.shift: ''``,
``data.ood_root``) still load: the renamed keys are moved to their new place with a ``FutureWarning``
naming both, and saved run folders are read the same way, without the warning.

Example:
    >>> cfg = load_config(None, ["data.name=digits", "data.ood.sets=[]", "optim.lr=1e-3"])
    >>> cfg.data.loader.batch_size, cfg.data.shift.name, cfg.optim.lr
    (128, 'gaussian_noise', 0.001)
    >>> load_config(None, ["optim.schedule=cosine"])
    Traceback (most recent call last):
    ...
    torchcal.experiments.errors.ConfigError: optim.schedule must be 'multistep', 'linear' or 'plateau', got 'cosine'
"""

from __future__ import annotations

import copy
import functools
import re
import warnings
from pathlib import Path
from typing import Annotated, Any, Generic, Literal, TypeVar, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .data.catalog import (
    DATASETS,
    IMAGE_DATASETS,
    LAZY_DATASETS,
    MULTILABEL_DATASETS,
    OOD_SETS,
    POINT_DATASETS,
    SHIFTS,
    TEXT_DATASETS,
    ImageDatasetName,
    TextDatasetName,
)
from .errors import ConfigError

__all__ = [
    "DataConfig",
    "ImageDataConfig",
    "MultilabelImageDataConfig",
    "TinyImageNetDataConfig",
    "ImageNetDataConfig",
    "ChestXray14DataConfig",
    "TextDataConfig",
    "MoonsDataConfig",
    "ShiftConfig",
    "OODConfig",
    "LoaderConfig",
    "ModelConfig",
    "LossConfig",
    "OptimConfig",
    "TrainConfig",
    "RunConfig",
    "ConfigError",
    "load_config",
    "load_yaml",
    "apply_overrides",
    "config_to_dict",
    "config_from_dict",
    "config_schema",
    "validate_config",
    "flatten_config",
    "migrate_config_dict",
    "RESUMABLE_KEYS",
    "EXECUTION_KEYS",
    "resume_config",
]

TEXT_CNN_MIN_LEN = 149

PositiveInt = Annotated[int, Field(ge=1)]
Count = Annotated[int, Field(ge=0)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class _Section(BaseModel):
    # strict: 3 is not "3" and 1.0 is not an integer; unknown keys fail; the docstring under each field is
    # its description in the JSON Schema (an editor's hover text)
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)


# -- data --------------------------------------------------------------------------------------------------


class ShiftConfig(_Section):
    """The shifted test set (in-memory image sets): synthetic Gaussian noise or CIFAR-10-C."""

    name: Literal["", "gaussian_noise", "cifar10_c"] = "gaussian_noise"
    """gaussian_noise (synthetic), cifar10_c, or "" for none"""
    severity: NonNegative = 0.5
    """noise σ for gaussian_noise; severity 1-5 for cifar10_c"""
    root: str = ""
    """folder of CIFAR-10-C (<corruption>.npy, labels.npy); also the cifar10_c OOD set's"""

    @model_validator(mode="after")
    def check_cifar10_c_severity(self) -> ShiftConfig:
        if self.name == "cifar10_c" and self.severity not in (1, 2, 3, 4, 5):
            raise ValueError(f"data.shift.severity must be a severity 1-5 for cifar10_c, got {self.severity}")
        return self


class OODConfig(_Section):
    """The out-of-distribution sets (multiclass in-memory image sets): AUROC of the predictive entropy for
    each; the first is the report's "ood auroc"."""

    sets: list[Literal["digits", "svhn", "cifar10_c"]] = Field(default_factory=lambda: ["digits"])
    """digits, svhn, cifar10_c (Gaussian noise, severity 5, from data.shift.root); [] for none"""
    root: str = ""
    """folder of SVHN's test_32x32.mat"""

    @field_validator("sets", mode="before")
    @classmethod
    def parse_comma_separated(cls, value: Any) -> Any:
        if isinstance(value, str):  # "digits,svhn" or "" (none)
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @field_validator("sets")
    @classmethod
    def check_no_set_twice(cls, sets: list[str]) -> list[str]:
        if len(set(sets)) != len(sets):
            raise ValueError(f"data.ood.sets lists a set twice: {sets}")
        return sets


class LoaderConfig(_Section):
    """How batches are formed and decoded."""

    batch_size: PositiveInt = 128
    """training batch size"""
    eval_batch_size: PositiveInt = 1000
    """batch size of the evaluation passes (validation, test, shift, OOD)"""
    num_workers: Count = 0
    """DataLoader worker processes decoding images of the per-batch sets (0: in the training process)"""


DatasetName = TypeVar("DatasetName", bound=str)


class _DataBase(_Section, Generic[DatasetName]):
    """The keys every dataset takes; each kind narrows ``name`` to its datasets (the union's tag)."""

    name: DatasetName
    """the dataset (torchcal list datasets); its kind decides which other keys the section takes"""
    root: str = ""
    """the dataset's folder (empty: its default location)"""
    val_size: PositiveInt = 5000
    """validation samples split off the training set (sets with a fixed split ignore it)"""
    split_seed: int = 1
    """seed of the train/validation split"""
    augment: bool = False
    """random crops and flips of the training images"""
    limit_train: Count = 0
    """0: all training samples; n > 0 takes the first n (smoke runs)"""
    loader: LoaderConfig = Field(default_factory=LoaderConfig)
    """batch sizes and decoding workers"""


class ImageDataConfig(_DataBase[ImageDatasetName]):
    """A small multiclass image set held in memory, with a shifted test set and OOD sets."""

    name: ImageDatasetName = "fashion_mnist"
    """the dataset (torchcal list datasets); its kind decides which other keys the section takes"""
    shift: ShiftConfig = Field(default_factory=ShiftConfig)
    """the shifted test set (corrupted images) evaluated beside the test set"""
    ood: OODConfig = Field(default_factory=OODConfig)
    """the out-of-distribution sets scored by predictive-entropy AUROC"""


class MultilabelImageDataConfig(_DataBase[Literal["fashion_mnist_attributes"]]):
    """Fashion-MNIST's attributes: a multi-label image set held in memory, with a shifted test set."""

    name: Literal["fashion_mnist_attributes"] = "fashion_mnist_attributes"
    """the dataset (torchcal list datasets); its kind decides which other keys the section takes"""
    shift: ShiftConfig = Field(default_factory=ShiftConfig)
    """the shifted test set (corrupted images) evaluated beside the test set"""


class TinyImageNetDataConfig(_DataBase[Literal["tiny_imagenet"]]):
    """Tiny-ImageNet-200, read per batch."""

    name: Literal["tiny_imagenet"] = "tiny_imagenet"
    """the dataset (torchcal list datasets); its kind decides which other keys the section takes"""


class ImageNetDataConfig(_DataBase[Literal["imagenet"]]):
    """ImageNet folders, decoded per batch."""

    name: Literal["imagenet"] = "imagenet"
    """the dataset (torchcal list datasets); its kind decides which other keys the section takes"""
    image_size: Annotated[int, Field(ge=8)] = 224
    """side of the training crops"""
    augment_on: Literal["workers", "device"] = "workers"
    """where the random crops are taken: workers (Pillow, on the CPU) or device (resampled on the GPU)"""


class ChestXray14DataConfig(_DataBase[Literal["chestxray14"]]):
    """ChestX-ray14, multi-label, decoded per batch."""

    name: Literal["chestxray14"] = "chestxray14"
    """the dataset (torchcal list datasets); its kind decides which other keys the section takes"""
    image_size: Annotated[int, Field(ge=8)] = 224
    """side of the training images"""
    ten_crop: bool = False
    """evaluate on ten crops of image_size from images at 256/224 of it"""


class TextDataConfig(_DataBase[TextDatasetName]):
    """A text classification set: word vectors or a transformer's tokenizer."""

    name: TextDatasetName
    """the dataset (torchcal list datasets); its kind decides which other keys the section takes"""
    glove: str = ""
    """GloVe vectors file (glove.6B.100d.txt); empty: embeddings learned from scratch"""
    max_len: PositiveInt = 1000
    """tokens per document of the training set"""
    eval_max_len: Count = 0
    """tokens per document of the evaluated sets (0: max_len)"""


SampleSize = Annotated[int, Field(ge=2)]


class MoonsDataConfig(_Section):
    """scikit-learn's two moons (``make_moons``): 2-D points of two classes, two interleaving half circles with
    Gaussian noise, the FCL paper's toy data (its App. A.11, Fig. 7). Nothing is read from disk: the
    training, validation and test sets are drawn on their own from ``seed``, each with as many points of one
    class as of the other (one more of class 1 when odd)."""

    name: Literal["moons"] = "moons"
    """the dataset (torchcal list datasets); its kind decides which other keys the section takes"""
    n_train: SampleSize = 1000
    """training points"""
    val_size: SampleSize = 500
    """validation points"""
    n_test: SampleSize = 1000
    """test points"""
    noise: NonNegative = 0.2
    """standard deviation of the Gaussian noise added to each coordinate (the paper's noise=0.2)"""
    seed: Count = 0
    """seed of the points drawn: the same seed and sizes give the same three sets"""
    limit_train: Count = 0
    """0: all training points; n > 0 takes the first n (smoke runs)"""
    loader: LoaderConfig = Field(default_factory=LoaderConfig)
    """batch sizes"""

    @property
    def augment(self) -> bool:
        """Points take no image augmentation (the training loop asks every dataset)."""
        return False


DataConfig = Annotated[
    Union[  # noqa: UP007 (pydantic's discriminated union)
        ImageDataConfig,
        MultilabelImageDataConfig,
        TinyImageNetDataConfig,
        ImageNetDataConfig,
        ChestXray14DataConfig,
        TextDataConfig,
        MoonsDataConfig,
    ],
    Field(discriminator="name"),
]
_DATA_KINDS: dict[str, type[_Section]] = {
    **dict.fromkeys(IMAGE_DATASETS, ImageDataConfig),
    "fashion_mnist_attributes": MultilabelImageDataConfig,
    "tiny_imagenet": TinyImageNetDataConfig,
    "imagenet": ImageNetDataConfig,
    "chestxray14": ChestXray14DataConfig,
    **dict.fromkeys(TEXT_DATASETS, TextDataConfig),
    **dict.fromkeys(POINT_DATASETS, MoonsDataConfig),
}
assert set(_DATA_KINDS) == set(DATASETS), "every dataset of the catalog has its settings"


# -- the other sections ------------------------------------------------------------------------------------


class ModelConfig(_Section):
    name: str = "mlp"
    """a registered model (torchcal list models)"""
    width: PositiveInt = 256
    """hidden width of the small models"""
    checkpoint: str = ""
    """model.name=transformer: a local Hugging Face checkpoint folder (config.json, weights, tokenizer files)"""


class LossConfig(_Section):
    name: str = "ce"
    """a registered loss (torchcal list losses)"""
    reduction: Literal["mean", "sum"] = "mean"
    """how the per-sample losses of a batch are combined (the papers' presets: sum)"""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """the loss's arguments, e.g. {gamma: 3}"""
    update_every: Count = 0
    """losses updated from the validation set: 0 = after every epoch's validation pass, n > 0 = every n batches"""
    update_schedule: list[Annotated[list[Count], Field(min_length=2, max_length=2)]] = Field(default_factory=list)
    """losses updated from the validation set: [[epoch, every], ...] changes update_every from that epoch (0-based)
    on, e.g. AdaFocal-schedule's [[25, 100], [40, 1]]: per epoch, then every 100 batches, then every batch"""

    @field_validator("update_schedule")
    @classmethod
    def _schedule_epochs_increase(cls, v: list[list[int]]) -> list[list[int]]:
        starts = [e for e, _ in v]
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise ValueError(f"loss.update_schedule: the epochs of [[epoch, every], ...] must increase, got {starts}")
        return v

    def update_every_at(self, epoch: int) -> int:
        """update_every in ``epoch`` (0-based): the last update_schedule entry that has started, else
        update_every."""
        every = self.update_every
        for start, n in self.update_schedule:
            if epoch >= start:
                every = n
        return every


class OptimConfig(_Section):
    name: Literal["adam", "adamw", "adagrad", "sgd"] = "adam"
    """the optimiser"""
    lr: Positive = 1e-3
    """the (peak) learning rate"""
    momentum: NonNegative = 0.9
    """SGD's momentum (the other optimisers ignore it)"""
    weight_decay: NonNegative = 0.0
    """L2 weight decay (AdamW: decoupled, and not on biases and normalisation weights)"""
    milestones: list[PositiveInt] = Field(default_factory=list)
    """epochs at which optim.schedule=multistep multiplies the learning rate by gamma"""
    gamma: Positive = 0.1
    """the factor of the multistep and plateau schedules"""
    grad_clip_norm: NonNegative = 0.0
    """0: no clipping"""
    schedule: Literal["multistep", "linear", "plateau"] = "multistep"
    """multistep (× gamma at each milestone, per epoch), linear (warm-up over warmup_epochs, then decay to 0
    at the last step) or plateau (× gamma when the validation NLL has not improved for `patience` epochs)"""
    warmup_epochs: NonNegative = 0.0
    """epochs (fractions allowed) of linear warm-up, optim.schedule=linear only"""
    patience: Count = 5
    """epochs without a better validation NLL before optim.schedule=plateau lowers the rate"""

    @model_validator(mode="after")
    def check_schedule_options(self) -> OptimConfig:
        if self.warmup_epochs and self.schedule != "linear":
            raise ValueError(
                f"optim.warmup_epochs={self.warmup_epochs} applies to optim.schedule=linear only"
            )
        if self.milestones and self.schedule != "multistep":
            raise ValueError(f"optim.milestones={self.milestones} apply to optim.schedule=multistep only")
        if list(self.milestones) != sorted(set(self.milestones)):
            raise ValueError(f"optim.milestones must be increasing positive epochs, got {self.milestones}")
        return self


class TrainConfig(_Section):
    epochs: PositiveInt = 5
    """training epochs"""
    seed: Count = 0
    """seed of the initialisation, the batch order and the augmentation"""
    device: str = "auto"
    """auto (CUDA when available), cpu, cuda, cuda:1, ..."""
    num_threads: Count = 0
    """0: torch's default"""
    calibrators: list[str] = Field(default_factory=lambda: ["ts", "fts"])
    """post-hoc calibrators fitted on the final validation logits (specs such as ts or ts:objective=ece); [] for
    none"""
    amp: Literal["auto", "bfloat16", "float16", "off"] = "auto"
    """autocast dtype: auto (bfloat16 on CUDA, off on CPU), bfloat16, float16, off"""
    channels_last: Literal["auto", True, False] = "auto"
    """auto (on for CUDA convolutional models), true, false"""
    compile: bool = False
    """torch.compile the model"""
    test_every: Count = 1
    """test-set metrics in metrics.jsonl every n epochs and at the last (0: none; logits are always saved)"""
    select: Literal["last", "best_val_error", "best_val_nll"] = "last"
    """the model whose logits are evaluated: the last epoch, or the one of lowest validation error or NLL"""
    accumulate: PositiveInt = 1
    """each batch of data.loader.batch_size runs as this many micro-batches"""
    dynamics: list[Literal["bins", "outputs", "weights", "logits", "gradients"]] = Field(default_factory=list)
    """training dynamics logged per epoch for the papers' analysis figures (torchcal figures): bins (train and
    validation confidence and accuracy per bin), outputs (test NLL, entropy, p_y of correct and wrong
    samples), weights (last-layer norm), logits (max-logit percentiles, q_j box plot), gradients (per-sample
    last-layer gradient norms over the training set); [] logs none and costs nothing"""
    dynamics_bins: PositiveInt = 15
    """equal-width confidence bins of train.dynamics=[bins] and of its test ECE"""

    @field_validator("device")
    @classmethod
    def check_device_name(cls, device: str) -> str:
        if device != "auto":
            import torch

            try:
                torch.device(device)
            except (RuntimeError, TypeError, ValueError):
                raise ValueError(
                    f"train.device={device!r} is not a device (auto, cpu, cuda, cuda:1, ...)"
                ) from None
        return device


def _checks_on(info: ValidationInfo) -> bool:
    return not (info.context or {}).get("skip_checks", False)


class RunConfig(_Section):
    """A run: what to train (data, model, loss), how (optim, train)."""

    data: DataConfig = Field(default_factory=ImageDataConfig)
    """the dataset, one of the *DataConfig kinds chosen by data.name"""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """the network"""
    loss: LossConfig = Field(default_factory=LossConfig)
    """the training loss"""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """the optimiser and its schedule"""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """the loop: epochs, device, precision, calibrators evaluated at the end"""

    @model_validator(mode="before")
    @classmethod
    def migrate_renamed_keys(cls, raw: Any) -> Any:
        # the entry points (load_config, apply_overrides, config_from_dict) announce renamed keys; a dict
        # validated directly is moved quietly
        if isinstance(raw, dict) and isinstance(raw.get("data"), dict):
            data = _migrate_data(raw["data"], saved=True)[0]
            data.setdefault("name", "fashion_mnist")
            raw = {**raw, "data": data}
        return raw

    @property
    def task(self) -> str:
        """multiclass (softmax outputs) or multilabel (sigmoid outputs), from the dataset."""
        return "multilabel" if self.data.name in MULTILABEL_DATASETS else "multiclass"

    @model_validator(mode="after")
    def check_model_is_registered(self, info: ValidationInfo) -> RunConfig:
        if _checks_on(info):
            from .models import list_models

            if self.model.name not in list_models():
                raise ValueError(
                    f"unknown model model.name={self.model.name!r}; available: {sorted(list_models())}"
                )
        return self

    @model_validator(mode="after")
    def check_model_fits_dataset(self, info: ValidationInfo) -> RunConfig:
        if not _checks_on(info):
            return self
        d, m = self.data, self.model
        if m.name in ("transformer", "text_cnn") and not isinstance(d, TextDataConfig):
            raise ValueError(
                f"model.name={m.name} needs a text dataset ({', '.join(TEXT_DATASETS)}), not data.name={d.name!r}"
            )
        if (m.name == "transformer") != bool(m.checkpoint):
            raise ValueError(
                "model.checkpoint (a local Hugging Face checkpoint folder) goes with model.name=transformer, and "
                f"model.name=transformer needs it; got model.name={m.name!r}, model.checkpoint={m.checkpoint!r}"
            )
        if m.name == "text_cnn" and isinstance(d, TextDataConfig):
            # three convolutions of 5 and two max-pools of 5 need 149 tokens
            for key, value in (("max_len", d.max_len), ("eval_max_len", d.eval_max_len or d.max_len)):
                if value < TEXT_CNN_MIN_LEN:
                    raise ValueError(
                        f"model.name=text_cnn needs data.{key} >= {TEXT_CNN_MIN_LEN} tokens (its three "
                        f"convolutions of 5 and two max-pools of 5), got {value}"
                    )
        return self

    @model_validator(mode="after")
    def check_loss_fits_task(self, info: ValidationInfo) -> RunConfig:
        if not _checks_on(info):
            return self
        from ..losses import create as create_loss
        from ..losses import list_losses, loss_task

        lo = self.loss
        try:
            loss = create_loss(lo.name, reduction=lo.reduction, **lo.kwargs)
        except (ValueError, TypeError) as err:
            raise ValueError(f"loss.name={lo.name!r} with loss.kwargs={lo.kwargs}: {err}") from None
        if loss_task(lo.name) != self.task:
            raise ValueError(
                f"loss.name={lo.name!r} is a loss for {loss_task(lo.name)} (softmax if multiclass, sigmoid if "
                f"multilabel) outputs, but data.name={self.data.name} is {self.task}: choose one of "
                f"{list_losses(self.task)}"
            )
        for key, value in (("update_every", lo.update_every), ("update_schedule", lo.update_schedule)):
            if value and not hasattr(loss, "update"):
                updated = [n for n in list_losses(self.task) if hasattr(create_loss(n), "update")]
                raise ValueError(
                    f"loss.{key}={value} applies only to losses updated during training "
                    f"({', '.join(updated) or f'none for {self.task} outputs'}), "
                    f"not {lo.name!r}"
                )
        late = [e for e, _ in lo.update_schedule if e >= self.train.epochs]
        if late:
            raise ValueError(
                f"loss.update_schedule starts at epoch {late[0]}, but train.epochs={self.train.epochs} ends at "
                f"epoch {self.train.epochs - 1} (epochs count from 0): that entry would never apply"
            )
        return self

    @model_validator(mode="after")
    def check_ood_is_not_the_training_set(self) -> RunConfig:
        d = self.data
        if isinstance(d, ImageDataConfig) and d.name in d.ood.sets:
            raise ValueError(
                f"data.ood.sets=[{d.name}] is the training dataset itself (data.name={d.name}): choose another "
                "OOD set or none (data.ood.sets=[])"
            )
        return self

    @model_validator(mode="after")
    def check_accumulate_fits_batch(self) -> RunConfig:
        t, bs = self.train, self.data.loader.batch_size
        if t.accumulate > bs:
            raise ValueError(
                f"train.accumulate={t.accumulate} splits a batch of data.loader.batch_size={bs}: at most that many"
            )
        return self

    @model_validator(mode="after")
    def check_dynamics_fit_task(self) -> RunConfig:
        multiclass_only = sorted(set(self.train.dynamics) - {"weights"})
        if self.task == "multilabel" and multiclass_only:
            raise ValueError(
                f"train.dynamics={multiclass_only} are defined for softmax outputs; data.name={self.data.name} "
                "is multi-label (only weights applies)"
            )
        on_train = sorted({"bins", "gradients"} & set(self.train.dynamics))
        if on_train and self.data.name in LAZY_DATASETS:
            raise ValueError(
                f"train.dynamics={on_train} score the whole training set every epoch, which data.name="
                f"{self.data.name} decodes per batch with its augmentation: use outputs, logits or weights"
            )
        return self

    @model_validator(mode="after")
    def check_calibrators_fit_task(self, info: ValidationInfo) -> RunConfig:
        if _checks_on(info):
            from ..calibrators import from_spec

            for spec in self.train.calibrators:  # specs such as "ts" or "ts:objective=ece"
                try:
                    from_spec(spec, self.task)
                except ValueError as err:
                    raise ValueError(f"train.calibrators ({self.task} outputs): {err}") from None
        return self


# -- renamed keys ------------------------------------------------------------------------------------------

# the flat data section of earlier releases: old key -> its place now
_RENAMED = {
    "batch_size": ("loader", "batch_size"),
    "eval_batch_size": ("loader", "eval_batch_size"),
    "num_workers": ("loader", "num_workers"),
    "shift": ("shift", "name"),
    "shift_severity": ("shift", "severity"),
    "shift_root": ("shift", "root"),
    "ood": ("ood", "sets"),
    "ood_root": ("ood", "root"),
}
# the flat section's values that meant "not used": a set without a shift or OOD set may still name them
_UNUSED = {("shift", "name"): ("",), ("shift", "severity"): (0.5,), ("shift", "root"): ("",),
           ("ood", "sets"): ("", []), ("ood", "root"): ("",)}  # fmt: skip
# a saved flat section lists every key; those a dataset does not take held their defaults
_FLAT_DEFAULTS = {"glove": "", "image_size": 224, "augment_on": "workers", "ten_crop": False, "max_len": 1000,
                  "eval_max_len": 0}  # fmt: skip


def _migrate_data(data: dict, *, saved: bool, name: str | None = None) -> tuple[dict, dict[str, str]]:
    """``data`` with the flat keys of earlier releases moved to their sections, and {new key: old key};
    ``name``: the dataset when ``data`` (overrides) does not name it."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    data_name = out.get("name", name or "fashion_mnist")
    kind = _DATA_KINDS.get(data_name) if isinstance(data_name, str) else None  # not a name: refused later
    fields = set(kind.model_fields) if kind is not None else None
    renamed: dict[str, str] = {}
    for old, (section, key) in _RENAMED.items():
        if old not in out or (old in ("shift", "ood") and isinstance(out[old], dict)):
            continue
        value = out.pop(old)
        if fields is not None and section not in fields and value in _UNUSED[(section, key)]:
            renamed[f"data.{section}.{key}"] = f"data.{old}"  # an "unused" value of a set without it: dropped
            continue
        target = out.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"data.{section} must be a mapping, got {target!r}")
        target[key] = value
        renamed[f"data.{section}.{key}"] = f"data.{old}"
    if saved and fields is not None:
        for key, default in _FLAT_DEFAULTS.items():
            if key in out and key not in fields and out[key] == default:
                del out[key]
    return out, renamed


def migrate_config_dict(raw: dict) -> dict:
    """A saved config's dict (``config.yaml`` of a run folder, a checkpoint's ``config``) in the current
    layout: the flat data keys of earlier releases moved to their sections, quietly."""
    if isinstance(raw, dict) and isinstance(raw.get("data"), dict):
        return {**raw, "data": _migrate_data(raw["data"], saved=True)[0]}
    return raw


# -- errors ------------------------------------------------------------------------------------------------

# keys of one kind of dataset named for another: what they apply to
_SCOPES = {
    "augment_on": "data.name=imagenet (its RandomResizedCrop)",
    "ten_crop": "chestxray14 (its evaluated images are larger than the crops)",
    "image_size": "the sets decoded per batch (imagenet, chestxray14)",
    "glove": "text datasets",
    "max_len": "text datasets",
    "eval_max_len": "text datasets",
}


def _data_key_message(key: str, name: str, raw_data: dict) -> str | None:
    if name in POINT_DATASETS and key in ("root", "split_seed", "augment", *_SCOPES):
        return (f"data.{key} does not apply to data.name={name} (2-D points drawn from data.seed, no files, no "
                f"images): its keys are {sorted(MoonsDataConfig.model_fields)}")  # fmt: skip
    if key in ("shift", "ood"):
        if name in POINT_DATASETS:
            return (f"data.shift and data.ood apply to in-memory image sets, not data.name={name} (2-D points): "
                    "remove data.shift and data.ood")  # fmt: skip
        if name in TEXT_DATASETS:
            return (f"data.name={name} is a text dataset: it has no shift or OOD sets (they are image sets); "
                    "remove data.shift and data.ood")  # fmt: skip
        if name in LAZY_DATASETS and (key == "shift" or name != "chestxray14"):
            return (f"data.shift and data.ood apply to in-memory image sets, not data.name={name} (decoded per "
                    "batch): remove data.shift and data.ood")  # fmt: skip
        return (f"data.ood applies to multiclass datasets (predictive-entropy AUROC); data.name={name} is "
                "multi-label: remove data.ood")  # fmt: skip
    if key in _SCOPES:
        value = raw_data.get(key)
        shown = f"data.{key}={value}" if key == "augment_on" else f"data.{key}"
        return f"{shown} applies to {_SCOPES[key]}, not data.name={name}"
    return None


def _section_model(loc: list[str], data_name: str) -> type[BaseModel] | None:
    model: type[BaseModel] | None = RunConfig
    for part in loc:
        if model is None:
            return None
        if model is RunConfig and part == "data":
            model = _DATA_KINDS.get(data_name, ImageDataConfig)
            continue
        field = model.model_fields.get(part)
        annotation = field.annotation if field is not None else None
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return model


def _translate(err: ValidationError, raw: dict, renamed: dict[str, str]) -> ConfigError:
    """One sentence for the first problem of a pydantic error, naming the key as the user wrote it."""
    e = err.errors(include_url=False)[0]
    data_name = raw.get("data", {}).get("name", "fashion_mnist") if isinstance(raw.get("data"), dict) else ""
    loc = [str(p) for p in e["loc"]]
    if len(loc) > 1 and loc[0] == "data" and loc[1] in DATASETS:
        loc = [loc[0], *loc[2:]]  # the union's tag
    index = ""
    while loc and loc[-1].isdigit():  # an item of a list
        index = f"[{loc.pop()}]{index}"
    path = ".".join(loc)
    path = renamed.get(path, path) + index
    kind, value, ctx = e["type"], e.get("input"), e.get("ctx") or {}
    if kind == "extra_forbidden":
        key, section = loc[-1], ".".join(loc[:-1])
        if not section:
            valid = sorted(RunConfig.model_fields)
            return ConfigError(f"unknown config section {key!r}; valid sections: {valid}")
        if section == "data":
            message = _data_key_message(key, data_name, raw.get("data", {}))
            if message:
                return ConfigError(message)
        model = _section_model(loc[:-1], data_name)
        valid = sorted(model.model_fields) if model is not None else []
        of = f"{section} (data.name={data_name})" if section.startswith("data") else section
        return ConfigError(f"unknown key {section}.{key}; valid keys of {of}: {valid}")
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        return ConfigError(f"unknown dataset data.name={ctx.get('tag')!r}; available: {sorted(DATASETS)}")
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return ConfigError(f"{path} must be an integer, got {value!r}")
    if kind in ("float_type", "float_parsing"):
        if isinstance(value, str) and value.strip().lower().lstrip("+-.") in ("nan", "inf", "infinity"):
            return ConfigError(f"{path} must be a finite number, got {value}")
        return ConfigError(f"{path} must be a number (e.g. 0.1, 1e-5), got {value!r}")
    if kind == "finite_number":
        return ConfigError(f"{path} must be a finite number, got {value}")
    if kind in ("bool_type", "bool_parsing"):
        return ConfigError(f"{path} must be true or false, got {value!r}")
    if kind == "string_type":
        return ConfigError(f"{path} must be a string, got {value!r}")
    if kind == "list_type":
        return ConfigError(f"{path} must be a list, got {value!r}")
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return ConfigError(f"{path or 'a config'} must be a mapping, got {value!r}")
    if kind == "literal_error":
        if path.startswith("data.ood.sets") or path.startswith("data.ood"):
            return ConfigError(f"unknown OOD set {value!r} in {path}; available: {sorted(OOD_SETS)}")
        if path in ("data.shift.name", "data.shift"):
            return ConfigError(f"unknown shift {path}={value!r}; available: {['', *sorted(SHIFTS)]}")
        return ConfigError(f"{path} must be {ctx.get('expected')}, got {value!r}")
    if kind == "greater_than_equal":
        return ConfigError(f"{path} must be >= {ctx.get('ge')}, got {value}")
    if kind == "greater_than":
        return ConfigError(f"{path} must be > {ctx.get('gt')}, got {value}")
    if kind in ("value_error", "assertion_error"):
        error = ctx.get("error")
        return ConfigError(str(error) if error is not None else e["msg"])
    return ConfigError(f"{path}: {e['msg']}, got {value!r}")


# -- building configs --------------------------------------------------------------------------------------


def _validate(raw: dict, *, checks: bool = True, renamed: dict[str, str] | None = None) -> RunConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(raw).__name__}")
    for section, values in raw.items():
        if section in RunConfig.model_fields and not isinstance(values, dict):
            raise ConfigError(f"section {section!r} must be a mapping, got {type(values).__name__}")
    try:
        return RunConfig.model_validate(raw, context={"skip_checks": not checks})
    except ValidationError as err:
        raise _translate(err, migrate_config_dict(raw), renamed or {}) from None


def _migrate(raw: dict, renamed: dict[str, str], *, saved: bool = False, name: str | None = None) -> dict:
    """``raw`` with its data section in the current layout; the renamed keys are added to ``renamed`` and
    announced with a ``FutureWarning`` (not for a saved run's config)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("data"), dict):
        return raw
    data, moved = _migrate_data(raw["data"], saved=saved, name=name)
    if moved and not saved:
        listing = ", ".join(f"{old} -> {new}" for new, old in moved.items())
        warnings.warn(
            f"renamed config keys ({listing}): the old names are read for now and will be refused in a later "
            "release; write the new ones",
            FutureWarning,
            stacklevel=3,
        )
    renamed.update(moved)
    return {**raw, "data": data}


def _combine(base: dict, top: dict) -> dict:
    """``top`` laid over ``base``: sections merged key by key; a ``loss.kwargs`` mapping given whole replaces
    the base's; another ``data.name`` keeps only the keys every dataset shares."""
    base = copy.deepcopy(base)
    if isinstance(top.get("loss"), dict) and top["loss"].pop(_REPLACE_KWARGS, False):
        base.setdefault("loss", {})["kwargs"] = {}
    top_data, base_data = top.get("data"), base.get("data")
    if isinstance(top_data, dict) and isinstance(base_data, dict) and "name" in top_data:
        if top_data["name"] != base_data.get("name", "fashion_mnist"):
            # the keys every dataset shares that the new kind takes (a set of points has no root or augment)
            kind = _DATA_KINDS.get(top_data["name"]) if isinstance(top_data["name"], str) else None
            shared = set(_DataBase.model_fields) & set((kind or _DataBase).model_fields)
            base["data"] = {k: v for k, v in base_data.items() if k in shared}
    return _merge(base, top)


def _merge(base: dict, top: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def config_to_dict(cfg: RunConfig) -> dict:
    """The config as nested plain dicts (what ``config.yaml`` of a run folder holds)."""
    return cfg.model_dump(mode="python")


def config_from_dict(raw: dict, base: RunConfig | None = None, *, validate: bool = True) -> RunConfig:
    """A RunConfig from nested dicts laid over ``base`` (defaults if None). Unknown keys and values of the
    wrong type fail. ``validate=False`` reads a saved run's config: its renamed keys are moved quietly and the
    rules that consult the registries (models, losses, calibrators) are skipped."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(raw).__name__}")
    renamed: dict[str, str] = {}
    raw = _migrate(raw, renamed, saved=not validate)
    if base is not None:
        whole = {**raw}
        if isinstance(raw.get("loss"), dict) and "kwargs" in raw["loss"]:
            whole["loss"] = {**raw["loss"], _REPLACE_KWARGS: True}
        raw = _combine(_explicit(base), whole)
    return _validate(raw, checks=validate, renamed=renamed)


def _explicit(cfg: RunConfig) -> dict:
    """The values of ``cfg`` that differ from the defaults, plus the dataset's name (overrides then re-derive
    the rest, so that changing data.name does not carry the other kind's keys)."""
    out = cfg.model_dump(mode="python", exclude_defaults=True)
    out.setdefault("data", {})["name"] = cfg.data.name
    return out


def validate_config(cfg: RunConfig) -> RunConfig:
    """``cfg`` checked again, all rules included (after code changed its fields); a :class:`ConfigError`
    names the first value that cannot run."""
    return _validate(_explicit(cfg))


# Python's exponent notation (1e-5, 1E-3, 5e4, 1.5e3): YAML 1.1 reads a number as a float only with a dot
# and a signed exponent, so these would stay strings; ints (1_000) and dotted floats (.5, 1.5) it reads already.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9](?:_?[0-9])*(?:\.(?:[0-9](?:_?[0-9])*)?)?|\.[0-9](?:_?[0-9])*)"
                             r"[eE][-+]?[0-9](?:_?[0-9])*$")  # fmt: skip
# YAML 1.2's booleans: true and false only (YAML 1.1 also reads yes/no/on/off, so `data.ood: no` would be False)
_BOOL_12 = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")


@functools.cache
def _number_loader():
    import yaml

    class NumberLoader(yaml.SafeLoader):
        """YAML's safe loader reading every number a Python user writes as a number, and booleans as YAML
        1.2 does."""

    resolvers = {
        first: [(tag, regexp) for tag, regexp in rules if tag != "tag:yaml.org,2002:bool"]
        for first, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    NumberLoader.yaml_implicit_resolvers = resolvers
    NumberLoader.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL_12, list("tTfF"))
    NumberLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789."))
    return NumberLoader


def load_yaml(stream):
    """``yaml.safe_load`` that reads every Python number literal (``1e-5``, ``1E-3``, ``.5``, ``1_000``) as a
    number, where YAML 1.1 leaves exponents without a dot as strings, and only ``true``/``false`` as booleans
    (YAML 1.2; ``yes``, ``no``, ``on``, ``off`` are strings).

    Example:
        >>> load_yaml("lr: 1e-5")
        {'lr': 1e-05}
        >>> load_yaml("[1E-3, .5, 1_000, 5e4]")
        [0.001, 0.5, 1000, 50000.0]
        >>> load_yaml("[true, False, yes, off]")
        [True, False, 'yes', 'off']
    """
    import yaml

    return yaml.load(stream, Loader=_number_loader())  # noqa: S506 (a subclass of SafeLoader)


_REPLACE_KWARGS = "__replace_kwargs__"


def _parse_overrides(overrides: list[str]) -> dict:
    """``section.key=value`` strings (values parsed as YAML: 0.1, true, [150, 250], {gamma: 3}) as nested
    dicts, later ones winning; ``loss.kwargs.gamma=3`` sets one loss argument, ``loss.kwargs={...}`` all."""
    import yaml

    out: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        path, text = item.split("=", 1)
        parts = path.strip().split(".")
        if len(parts) < 2:
            raise ConfigError(f"override {item!r} must name a section and a key, e.g. optim.lr=0.1")
        try:
            value = load_yaml(text) if text.strip() else ""
        except yaml.YAMLError as err:
            raise ConfigError(
                f"override {item!r}: the value is not valid YAML ({_yaml_problem(err)})"
            ) from None
        kwargs = parts[:2] == ["loss", "kwargs"]
        nested_ok = kwargs or (
            parts[0] == "data" and parts[1] in ("shift", "ood", "loader") and len(parts) == 3
        )
        if len(parts) > 2 and not nested_ok:
            raise ConfigError(
                f"override {item!r}: {'.'.join(parts[:2])} is a value, not a section; only loss.kwargs takes "
                "nested keys (loss.kwargs.gamma=3), and data.shift, data.ood and data.loader hold settings"
            )
        if kwargs and len(parts) == 2:  # the whole mapping
            loss = out.setdefault("loss", {})
            loss["kwargs"], loss[_REPLACE_KWARGS] = value, True
            continue
        keys = [*parts[:2], ".".join(parts[2:])] if kwargs else parts
        target = out
        for part in keys[:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"override {item!r} sets a key inside {part!r}, which is a value")
        target[keys[-1]] = value
    return out


def apply_overrides(cfg: RunConfig, overrides: list[str], *, validate: bool = True) -> RunConfig:
    """``cfg`` with ``section.key=value`` overrides applied (values parsed as YAML: 0.1, true, [150, 250],
    {gamma: 3}; ``loss.kwargs.gamma=3`` sets one loss argument); the caller's object is not changed."""
    renamed: dict[str, str] = {}
    raw = _combine(_explicit(cfg), _migrate(_parse_overrides(list(overrides)), renamed, name=cfg.data.name))
    return _validate(raw, checks=validate, renamed=renamed)


def _yaml_problem(err) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(err, 'problem', None) or err}{where}"


def read_config_file(path: str | Path) -> dict:
    """The YAML mapping of a config file, with a :class:`ConfigError` for a missing or malformed file."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        with open(p) as fh:
            raw = load_yaml(fh) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {_yaml_problem(err)}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {str(p)!r} must be a mapping of sections, got {type(raw).__name__}")
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults, then the YAML file (if given), then the overrides, validated once."""
    renamed: dict[str, str] = {}
    raw = _migrate(read_config_file(path), renamed) if path is not None else {}
    name = raw.get("data", {}).get("name") if isinstance(raw.get("data"), dict) else None
    raw = _combine(raw, _migrate(_parse_overrides(list(overrides or [])), renamed, name=name))
    return _validate(raw, renamed=renamed)


def flatten_config(cfg: RunConfig | dict) -> dict[str, Any]:
    """``{"section.key": value}`` of a config (or of its dict form, e.g. a saved ``config.yaml``), nested
    sections joined by dots (``data.loader.batch_size``); ``loss.kwargs`` stays one value."""
    if isinstance(cfg, RunConfig):
        raw = config_to_dict(cfg)
    else:  # a saved dict: read as a config (values normalised, e.g. data.ood: digits -> [digits]) if it is one
        try:
            raw = config_to_dict(config_from_dict({k: v for k, v in cfg.items() if k != "meta"}, validate=False))
        except ConfigError:
            raw = migrate_config_dict(cfg)
    out: dict[str, Any] = {}

    def walk(prefix: str, values: dict) -> None:
        for key, value in values.items():
            if isinstance(value, dict) and key != "kwargs":
                walk(f"{prefix}{key}.", value)
            else:
                out[f"{prefix}{key}"] = value

    walk("", {k: v for k, v in raw.items() if isinstance(v, dict)})
    return out


def config_schema() -> dict:
    """The JSON Schema of a run's YAML file (``torchcal config schema``), for an editor's completion and
    checking."""
    schema = RunConfig.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "torchcal run configuration"
    return schema


# -- resuming -----------------------------------------------------------------------------------------------

# Settings of how a run executes or is logged and evaluated, never of what it computes: a resumed run may
# change them, and runs that differ only in them (and the seed) share a report row.
EXECUTION_KEYS = (
    "data.loader.num_workers",
    "train.test_every",
    "train.device",
    "train.num_threads",
    "train.calibrators",
    "data.loader.eval_batch_size",
)
# What a resumed run may change: the number of epochs (to train further) and the execution settings.
# Everything else must equal the saved config.
RESUMABLE_KEYS = ("train.epochs", *EXECUTION_KEYS)


def _loss_spans_the_run(lo: LossConfig) -> bool:
    """Whether the configured loss has a schedule over the run's number of epochs (MaxSup's α ramp)."""
    from ..losses import create as create_loss

    return bool(getattr(create_loss(lo.name, reduction=lo.reduction, **lo.kwargs), "spans_the_run", False))


def resume_config(
    saved: RunConfig, requested: RunConfig, done_epochs: int, adjusted: dict | None = None
) -> RunConfig:
    """The config of a resumed run: ``saved`` with the changes of ``requested`` that resuming allows
    (:data:`RESUMABLE_KEYS`; ``train.epochs`` no fewer than the ``done_epochs`` already trained). Any other
    difference raises a :class:`ConfigError` naming the keys. ``adjusted`` maps keys the run adjusted at its
    start to ``{"requested": value, ...}``: asking for the originally requested value is no change."""
    adjusted = adjusted or {}
    old, new = flatten_config(saved), flatten_config(requested)
    keys = set(old) | set(new)
    changed = {
        k
        for k in keys
        if old.get(k) != new.get(k) and not (k in adjusted and new.get(k) == adjusted[k].get("requested"))
    }
    refused = sorted(changed - set(RESUMABLE_KEYS))
    if refused:
        detail = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in refused)
        raise ConfigError(
            f"--resume continues the saved run and cannot change what it computes ({detail}); only "
            f"{', '.join(RESUMABLE_KEYS)} may change: start a new run folder for the rest"
        )
    if "train.epochs" in changed and new.get("optim.schedule") == "linear" and done_epochs:
        raise ConfigError(
            "optim.schedule=linear decays the learning rate to 0 at train.epochs: a run trained with it cannot "
            "be extended to more epochs (it would not match a longer run); start a new run folder"
        )
    if "train.epochs" in changed and done_epochs and _loss_spans_the_run(saved.loss):
        raise ConfigError(
            f"loss.name={saved.loss.name} ramps its α over train.epochs={old['train.epochs']}: a run trained "
            "with it cannot be extended to more epochs (it would not match a longer run); start a new run folder"
        )
    if new["train.epochs"] < done_epochs:
        raise ConfigError(
            f"train.epochs={new['train.epochs']} is fewer than the {done_epochs} epochs this run has trained"
        )
    raw = config_to_dict(saved)
    for key in changed:
        *sections, name = key.split(".")
        target = raw
        for section in sections:
            target = target[section]
        target[name] = new[key]
    return _validate(raw)
