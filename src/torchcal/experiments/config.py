"""Typed experiment configuration: one dataclass per component, YAML files, dotted command-line overrides.

Every component owns its defaults. A run is a YAML file plus ``section.key=value`` overrides; an unknown
section or key fails with the list of valid ones, values are parsed as YAML and checked against the field's
type, and :func:`validate_config` refuses values that cannot run (non-positive epochs, widths or batch
sizes, NaN rates, unknown datasets, models, losses or calibrators, loss arguments the loss does not take)
before anything is written.
"""

from __future__ import annotations

import copy
import functools
import math
import re
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import ConfigError

__all__ = [
    "DataConfig",
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
    "validate_config",
    "flatten_config",
    "RESUMABLE_KEYS",
    "EXECUTION_KEYS",
    "resume_config",
]


@dataclass
class DataConfig:
    name: str = "fashion_mnist"
    root: str = ""  # empty: the dataset's default location
    val_size: int = 5000
    split_seed: int = 1
    batch_size: int = 128
    eval_batch_size: int = 1000
    augment: bool = False
    limit_train: int = 0  # 0: all training samples (a positive value takes the first n, for smoke runs)
    shift: str = "gaussian_noise"  # shifted test set: gaussian_noise (synthetic), cifar10_c, or "" for none
    shift_severity: float = 0.5  # noise σ for gaussian_noise; severity 1-5 for cifar10_c
    shift_root: str = ""  # folder of CIFAR-10-C (<corruption>.npy, labels.npy)
    # out-of-distribution set(s): digits, svhn, cifar10_c (Gaussian noise, severity 5, from shift_root), a list
    # or comma-separated names (AUROC for each; the first is the report's "ood auroc"), or "" for none
    ood: str | list = "digits"
    ood_root: str = ""  # folder of SVHN's test_32x32.mat
    glove: str = (
        ""  # text datasets: GloVe vectors file (glove.6B.100d.txt); empty: embeddings learned from scratch
    )
    image_size: int = 224  # images decoded per batch (imagenet, chestxray14): side of the training images
    num_workers: int = 0  # DataLoader worker processes decoding those images (0: in the training process)
    # where ImageNet's random crops are taken: "workers" (Pillow, on the CPU) or "device" (the workers draw
    # and resize, the crops and flips are resampled on the GPU)
    augment_on: str = "workers"
    ten_crop: bool = False  # chestxray14: evaluate on ten crops of image_size from images at 256/224 of it
    max_len: int = 1000  # text datasets: tokens per document (training set)
    eval_max_len: int = 0  # text datasets: tokens per document of the evaluated sets (0: max_len)


@dataclass
class ModelConfig:
    name: str = "mlp"
    width: int = 256
    # model.name=transformer: a local Hugging Face checkpoint folder (config.json, weights, tokenizer files)
    checkpoint: str = ""


@dataclass
class LossConfig:
    name: str = "ce"
    reduction: str = "mean"
    kwargs: dict = field(default_factory=dict)
    update_every: int = 0  # AdaFocal: 0 = after every epoch's validation pass, n > 0 = every n batches


@dataclass
class OptimConfig:
    name: str = "adam"
    lr: float = 1e-3
    momentum: float = 0.9
    weight_decay: float = 0.0
    milestones: list = field(default_factory=list)
    gamma: float = 0.1
    grad_clip_norm: float = 0.0  # 0: no clipping
    # learning-rate schedule: "multistep" (× gamma at each of the milestones, per epoch), "linear" (linear
    # warm-up over warmup_epochs, then linear decay to 0 at the last step; per step) or "plateau" (× gamma
    # when the validation NLL has not improved for `patience` epochs)
    schedule: str = "multistep"
    warmup_epochs: float = 0.0
    patience: int = 5


@dataclass
class TrainConfig:
    epochs: int = 5
    seed: int = 0
    device: str = "auto"
    num_threads: int = 0  # 0: torch's default
    # post-hoc calibrators fitted on the final validation logits at the end of training and saved as
    # `torchcal evaluate` saves them (results.json, calibrators/); [] for none
    calibrators: list = field(default_factory=lambda: ["ts", "fts"])
    amp: str = "auto"  # autocast dtype: auto (bfloat16 on CUDA, off on CPU), bfloat16, float16, off
    channels_last: str | bool = "auto"  # auto (on for CUDA convolutional models), true, false
    compile: bool = False  # torch.compile the model
    # test-set metrics in metrics.jsonl every n epochs and at the last (0: none; the logits are always saved)
    test_every: int = 1
    # the model whose logits are evaluated: "last" epoch, "best_val_nll" (lowest validation loss, CheXNet's
    # rule), or "best_val_error" (lowest validation error; the
    # earliest such epoch; its weights kept in best.pt, resumable)
    select: str = "last"
    # gradient accumulation: each batch of data.batch_size runs as this many micro-batches (the same update
    # up to rounding; MMCE's batch term then belongs to the micro-batch)
    accumulate: int = 1


@dataclass
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def _type_ok(value, annotation) -> bool:
    origin = typing.get_origin(annotation)
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation in (str, bool):
        return isinstance(value, annotation)
    if origin in (list, dict) or annotation in (list, dict):
        return isinstance(value, origin or annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    return True


def _section_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def config_from_dict(raw: dict, base: RunConfig | None = None, *, validate: bool = True) -> RunConfig:
    """A RunConfig from nested dicts, starting from ``base`` (defaults if None); unknown keys fail, and so
    do values :func:`validate_config` refuses (unless ``validate=False``)."""
    cfg = base if base is not None else RunConfig()
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(raw).__name__}")
    sections = {f.name: f for f in fields(RunConfig)}
    for section, values in raw.items():
        if section not in sections:
            raise ConfigError(f"unknown config section {section!r}; valid sections: {sorted(sections)}")
        if not isinstance(values, dict):
            raise ConfigError(f"section {section!r} must be a mapping, got {type(values).__name__}")
        target = getattr(cfg, section)
        types_ = _section_types(type(target))
        for key, value in values.items():
            _set(target, section, key, value, types_)
    return validate_config(cfg) if validate else cfg


def _set(target, section, key, value, types_):
    if key not in types_:
        raise ConfigError(f"unknown key {section}.{key}; valid keys of {section}: {sorted(types_)}")
    annotation = types_[key]
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not _type_ok(value, annotation):
        if annotation is float and isinstance(value, str):
            try:
                parsed = float(value)
            except ValueError:
                parsed = None
            what = "a finite number" if parsed is not None and not math.isfinite(parsed) else "a number"
            raise ConfigError(f"{section}.{key} must be {what} (e.g. 0.1, 1e-5), got {value!r}")
        name = {int: "an integer", float: "a number"}.get(
            annotation, getattr(annotation, "__name__", annotation)
        )
        raise ConfigError(f"{section}.{key} must be {name}, got {value!r}")
    setattr(target, key, value)


# Python's exponent notation (1e-5, 1E-3, 5e4, 1.5e3): YAML 1.1 reads a number as a float only with a dot
# and a signed exponent, so these would stay strings; ints (1_000) and dotted floats (.5, 1.5) it reads already.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9](?:_?[0-9])*(?:\.(?:[0-9](?:_?[0-9])*)?)?|\.[0-9](?:_?[0-9])*)"
                             r"[eE][-+]?[0-9](?:_?[0-9])*$")  # fmt: skip


@functools.cache
def _number_loader():
    import yaml

    class NumberLoader(yaml.SafeLoader):
        """YAML's safe loader that also reads every number a Python user writes as a number."""

    NumberLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789."))
    return NumberLoader


def load_yaml(stream):
    """``yaml.safe_load`` that reads every Python number literal (``1e-5``, ``1E-3``, ``.5``, ``1_000``) as a
    number, where YAML 1.1 leaves exponents without a dot as strings.

    Example:
        >>> load_yaml("lr: 1e-5")
        {'lr': 1e-05}
        >>> load_yaml("[1E-3, .5, 1_000, 5e4]")
        [0.001, 0.5, 1000, 50000.0]
    """
    import yaml

    return yaml.load(stream, Loader=_number_loader())  # noqa: S506 (a subclass of SafeLoader)


def apply_overrides(cfg: RunConfig, overrides: list[str], *, validate: bool = True) -> RunConfig:
    """Applies ``section.key=value`` strings (values parsed as YAML: 0.1, true, [150, 250], {gamma: 3}),
    then validates the result (unless ``validate=False``)."""
    import yaml

    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        path, text = item.split("=", 1)
        parts = path.strip().split(".")
        if len(parts) < 2:
            raise ConfigError(f"override {item!r} must name a section and a key, e.g. optim.lr=0.1")
        section, key = parts[0], parts[1]
        try:
            value = load_yaml(text) if text.strip() else ""
        except yaml.YAMLError as err:
            raise ConfigError(
                f"override {item!r}: the value is not valid YAML ({_yaml_problem(err)})"
            ) from None
        if len(parts) > 2:  # loss.kwargs.gamma=3
            if key != "kwargs" and not (section == "loss" and key == "kwargs"):
                raise ConfigError(f"only loss.kwargs takes nested keys, got {path!r}")
            nested = dict(cfg.loss.kwargs)
            nested[".".join(parts[2:])] = value
            value, key = nested, "kwargs"
        config_from_dict({section: {key: value}}, cfg, validate=False)
    return validate_config(cfg) if validate else cfg


def _yaml_problem(err) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(err, 'problem', None) or err}{where}"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults, then the YAML file (if given), then the overrides. A text dataset has no shift or OOD set
    unless the file or an override names one (the defaults, ``gaussian_noise`` and ``digits``, are image
    sets)."""
    import yaml

    cfg = RunConfig()
    given: set[str] = set()  # data.shift / data.ood named by the file or an override
    if path is not None:
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
        cfg = config_from_dict(raw, cfg, validate=False)
        data = raw.get("data") if isinstance(raw, dict) else None
        given |= {key for key in ("shift", "ood") if isinstance(data, dict) and key in data}
    overrides = list(overrides or [])
    given |= {
        key
        for key in ("shift", "ood")
        for item in overrides
        if item.split("=", 1)[0].strip() == f"data.{key}"
    }
    cfg = apply_overrides(cfg, overrides, validate=False)
    from .data import TEXT_DATASETS

    if cfg.data.name in TEXT_DATASETS:
        for key in {"shift", "ood"} - given:
            setattr(cfg.data, key, "")
    return validate_config(cfg)


def config_to_dict(cfg: RunConfig) -> dict:
    return asdict(cfg)


def flatten_config(cfg: RunConfig | dict) -> dict[str, Any]:
    """``{"section.key": value}`` of a config (or of its dict form, e.g. a saved ``config.yaml``)."""
    raw = config_to_dict(cfg) if isinstance(cfg, RunConfig) else cfg
    return {f"{section}.{key}": value for section, values in raw.items() if isinstance(values, dict)
            for key, value in values.items()}  # fmt: skip


# -- validation ---------------------------------------------------------------------------------------------

TEXT_CNN_MIN_LEN = 149
_AMP = ("auto", "bfloat16", "float16", "off")
_OPTIMIZERS = ("adam", "adamw", "adagrad", "sgd")
_SHIFTS = ("", "gaussian_noise", "cifar10_c")
_OODS = ("", "digits", "svhn", "cifar10_c")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _finite(value: float, name: str, low: float | None = None, *, open_low: bool = False) -> None:
    _check(math.isfinite(value), f"{name} must be a finite number, got {value}")
    if low is not None:
        ok = value > low if open_low else value >= low
        _check(ok, f"{name} must be {'>' if open_low else '>='} {low}, got {value}")


def validate_config(cfg: RunConfig) -> RunConfig:
    """Refuses, with a :class:`ConfigError` naming the key, every value that cannot run: non-positive
    counts and sizes, NaN or negative rates, unknown names (dataset, model, loss, optimizer, calibrator,
    shift, OOD set, autocast mode), loss arguments the loss does not accept, and settings that would be
    ignored (``loss.update_every`` for a loss without a validation update). Returns ``cfg``."""
    from ..calibrators import from_spec
    from ..losses import create as create_loss
    from .data import list_datasets
    from .models import list_models

    d, m, lo, o, t = cfg.data, cfg.model, cfg.loss, cfg.optim, cfg.train
    _check(
        d.name in list_datasets(),
        f"unknown dataset data.name={d.name!r}; available: {sorted(list_datasets())}",
    )
    _check(d.val_size >= 1, f"data.val_size must be >= 1, got {d.val_size}")
    _check(d.batch_size >= 1, f"data.batch_size must be >= 1, got {d.batch_size}")
    _check(d.eval_batch_size >= 1, f"data.eval_batch_size must be >= 1, got {d.eval_batch_size}")
    _check(d.limit_train >= 0, f"data.limit_train must be >= 0 (0: all), got {d.limit_train}")
    _check(d.max_len >= 1, f"data.max_len must be >= 1, got {d.max_len}")
    _check(d.eval_max_len >= 0, f"data.eval_max_len must be >= 0 (0: data.max_len), got {d.eval_max_len}")
    if m.name == "text_cnn":  # three convolutions of 5 and two max-pools of 5 need 149 tokens
        for key, value in (("max_len", d.max_len), ("eval_max_len", d.eval_max_len or d.max_len)):
            _check(value >= TEXT_CNN_MIN_LEN,
                   f"model.name=text_cnn needs data.{key} >= {TEXT_CNN_MIN_LEN} tokens (its three convolutions "
                   f"of 5 and two max-pools of 5), got {value}")  # fmt: skip
    _check(d.image_size >= 8, f"data.image_size must be >= 8, got {d.image_size}")
    _check(d.num_workers >= 0, f"data.num_workers must be >= 0, got {d.num_workers}")
    _check(
        d.augment_on in ("workers", "device"),
        f"data.augment_on must be 'workers' or 'device', got {d.augment_on!r}",
    )
    _check(d.augment_on == "workers" or d.name == "imagenet",
           "data.augment_on=device applies to data.name=imagenet (its RandomResizedCrop)")  # fmt: skip
    from .data import LAZY_DATASETS

    _check(not d.ten_crop or d.name == "chestxray14",
           "data.ten_crop applies to chestxray14 (its evaluated images are larger than the crops)")  # fmt: skip
    _check(d.name not in LAZY_DATASETS or not (d.shift or d.ood),
           f"data.shift and data.ood apply to in-memory image sets, not data.name={d.name} (decoded per batch): "
           "set data.shift= and data.ood=")  # fmt: skip
    _check(d.shift in _SHIFTS, f"unknown shift data.shift={d.shift!r}; available: {list(_SHIFTS)}")
    from .data import ood_names

    oods = ood_names(d.ood)
    unknown = [o for o in oods if o not in _OODS or not o]
    _check(not unknown, f"unknown OOD set(s) {unknown} in data.ood; available: {list(_OODS[1:])}")
    _check(len(set(oods)) == len(oods), f"data.ood lists a set twice: {oods}")
    _check(not (d.name == "digits" and "digits" in oods),
           "data.ood=digits is the training dataset itself (data.name=digits): choose another OOD set or none "
           "(data.ood=)")  # fmt: skip
    _finite(d.shift_severity, "data.shift_severity", 0)
    if d.shift == "cifar10_c":
        _check(d.shift_severity in (1, 2, 3, 4, 5),
               f"data.shift_severity must be a severity 1-5 for cifar10_c, got {d.shift_severity}")  # fmt: skip
    _check(
        m.name in list_models(), f"unknown model model.name={m.name!r}; available: {sorted(list_models())}"
    )
    _check(m.width >= 1, f"model.width must be >= 1, got {m.width}")
    from .data import TEXT_DATASETS

    _check(d.name not in TEXT_DATASETS or not (d.shift or oods),
           f"data.name={d.name} is a text dataset: set data.shift= and data.ood= (the shift and OOD sets are "
           "image sets)")  # fmt: skip
    _check(m.name not in ("transformer", "text_cnn") or d.name in TEXT_DATASETS,
           f"model.name={m.name} needs a text dataset ({', '.join(TEXT_DATASETS)}), not data.name={d.name!r}")  # fmt: skip
    _check((m.name == "transformer") == bool(m.checkpoint),
           "model.checkpoint (a local Hugging Face checkpoint folder) goes with model.name=transformer, and "
           f"model.name=transformer needs it; got model.name={m.name!r}, model.checkpoint={m.checkpoint!r}")  # fmt: skip
    _check(lo.reduction in ("mean", "sum"),
           f"loss.reduction must be 'mean' or 'sum' for training, got {lo.reduction!r}")  # fmt: skip
    _check(
        lo.update_every >= 0, f"loss.update_every must be >= 0 (0: after every epoch), got {lo.update_every}"
    )
    try:
        loss = create_loss(lo.name, reduction=lo.reduction, **lo.kwargs)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"loss.name={lo.name!r} with loss.kwargs={lo.kwargs}: {err}") from None
    from ..losses import list_losses, loss_task
    from .data import MULTILABEL_DATASETS

    task = "multilabel" if d.name in MULTILABEL_DATASETS else "multiclass"
    _check(loss_task(lo.name) == task,
           f"loss.name={lo.name!r} is a loss for {loss_task(lo.name)} (softmax if multiclass, sigmoid if "
           f"multilabel) outputs, but data.name={d.name} is {task}: choose one of {list_losses(task)}")  # fmt: skip
    _check(task == "multiclass" or not oods,
           f"data.ood applies to multiclass datasets (predictive-entropy AUROC); data.name={d.name} is "
           "multi-label: set data.ood=")  # fmt: skip
    if lo.update_every:
        _check(hasattr(loss, "update"), f"loss.update_every={lo.update_every} applies only to losses updated "
               f"from the validation set (adafocal, adadualfocal, calfocal), not {lo.name!r}")  # fmt: skip
    _check(o.name in _OPTIMIZERS, f"unknown optimizer optim.name={o.name!r}; available: {list(_OPTIMIZERS)}")
    _finite(o.lr, "optim.lr", 0, open_low=True)
    _finite(o.momentum, "optim.momentum", 0)
    _finite(o.weight_decay, "optim.weight_decay", 0)
    _finite(o.gamma, "optim.gamma", 0, open_low=True)
    _finite(o.grad_clip_norm, "optim.grad_clip_norm", 0)
    _check(o.schedule in ("multistep", "linear", "plateau"),
           f"optim.schedule must be 'multistep', 'linear' or 'plateau', got {o.schedule!r}")  # fmt: skip
    _check(o.patience >= 0, f"optim.patience must be >= 0, got {o.patience}")
    _finite(o.warmup_epochs, "optim.warmup_epochs", 0)
    _check(o.warmup_epochs == 0 or o.schedule == "linear",
           f"optim.warmup_epochs={o.warmup_epochs} applies to optim.schedule=linear only")  # fmt: skip
    _check(not (o.schedule != "multistep" and o.milestones),
           f"optim.milestones={o.milestones} apply to optim.schedule=multistep only")  # fmt: skip
    ok = all(isinstance(e, int) and not isinstance(e, bool) and e >= 1 for e in o.milestones)
    _check(ok and list(o.milestones) == sorted(set(o.milestones)),
           f"optim.milestones must be increasing positive epochs, got {o.milestones}")  # fmt: skip
    _check(t.epochs >= 1, f"train.epochs must be >= 1, got {t.epochs}")
    _check(t.seed >= 0, f"train.seed must be >= 0, got {t.seed}")
    _check(t.accumulate >= 1, f"train.accumulate must be >= 1, got {t.accumulate}")
    _check(t.accumulate <= d.batch_size,
           f"train.accumulate={t.accumulate} splits a batch of data.batch_size={d.batch_size}: at most that many")  # fmt: skip
    _check(t.select in ("last", "best_val_error", "best_val_nll"),
           f"train.select must be 'last', 'best_val_error' or 'best_val_nll', got {t.select!r}")  # fmt: skip
    _check(
        t.test_every >= 0, f"train.test_every must be >= 0 (0: no per-epoch test pass), got {t.test_every}"
    )
    _check(t.num_threads >= 0, f"train.num_threads must be >= 0 (0: torch's default), got {t.num_threads}")
    _check(t.amp in _AMP, f"train.amp must be one of {list(_AMP)}, got {t.amp!r}")
    _check(t.channels_last in ("auto", True, False),
           f"train.channels_last must be auto, true or false, got {t.channels_last!r}")  # fmt: skip
    for spec in t.calibrators:  # specs such as "ts" or "ts:objective=ece"
        try:
            from_spec(spec, task)
        except ValueError as err:
            raise ConfigError(f"train.calibrators ({task} outputs): {err}") from None
    if t.device != "auto":
        import torch

        try:
            torch.device(t.device)
        except (RuntimeError, TypeError, ValueError):
            raise ConfigError(
                f"train.device={t.device!r} is not a device (auto, cpu, cuda, cuda:1, ...)"
            ) from None
    return cfg


# -- resuming -----------------------------------------------------------------------------------------------

# Settings of how a run executes or is logged and evaluated, never of what it computes: a resumed run may
# change them, and runs that differ only in them (and the seed) share a report row.
EXECUTION_KEYS = (
    "data.num_workers",
    "train.test_every",
    "train.device",
    "train.num_threads",
    "train.calibrators",
    "data.eval_batch_size",
)
# What a resumed run may change: the number of epochs (to train further) and the execution settings.
# Everything else must equal the saved config.
RESUMABLE_KEYS = ("train.epochs", *EXECUTION_KEYS)


def resume_config(
    saved: RunConfig, requested: RunConfig, done_epochs: int, adjusted: dict | None = None
) -> RunConfig:
    """The config of a resumed run: ``saved`` with the changes of ``requested`` that resuming allows
    (:data:`RESUMABLE_KEYS`; ``train.epochs`` no fewer than the ``done_epochs`` already trained). Any other
    difference raises a :class:`ConfigError` naming the keys. ``adjusted`` maps keys the run adjusted at its
    start to ``{"requested": value, ...}``: asking for the originally requested value is no change."""
    adjusted = adjusted or {}
    old, new = flatten_config(saved), flatten_config(requested)
    changed = {
        k for k in old if old[k] != new[k] and not (k in adjusted and new[k] == adjusted[k].get("requested"))
    }
    refused = sorted(changed - set(RESUMABLE_KEYS))
    if refused:
        detail = ", ".join(f"{k}: {old[k]!r} -> {new[k]!r}" for k in refused)
        raise ConfigError(
            f"--resume continues the saved run and cannot change what it computes ({detail}); only "
            f"{', '.join(RESUMABLE_KEYS)} may change: start a new run folder for the rest"
        )
    if "train.epochs" in changed and new.get("optim.schedule") == "linear" and done_epochs:
        raise ConfigError(
            "optim.schedule=linear decays the learning rate to 0 at train.epochs: a run trained with it cannot "
            "be extended to more epochs (it would not match a longer run); start a new run folder"
        )
    if new["train.epochs"] < done_epochs:
        raise ConfigError(
            f"train.epochs={new['train.epochs']} is fewer than the {done_epochs} epochs this run has trained"
        )
    out = copy.deepcopy(saved)
    for key in changed:
        section, name = key.split(".", 1)
        setattr(getattr(out, section), name, new[key])
    return validate_config(out)
