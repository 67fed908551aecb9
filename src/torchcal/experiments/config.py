"""Typed experiment configuration: one dataclass per component, YAML files, dotted command-line overrides.

Every component owns its defaults. A run is a YAML file plus ``section.key=value`` overrides; an unknown
section or key fails with the list of valid ones, and values are parsed as YAML and checked against the
field's type.
"""

from __future__ import annotations

import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = [
    "DataConfig",
    "ModelConfig",
    "LossConfig",
    "OptimConfig",
    "TrainConfig",
    "RunConfig",
    "ConfigError",
    "load_config",
    "apply_overrides",
    "config_to_dict",
    "config_from_dict",
]


class ConfigError(ValueError):
    """A configuration file or override that does not fit the schema."""


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
    ood: str = "digits"  # out-of-distribution set: digits, svhn, or "" for none
    ood_root: str = ""  # folder of SVHN's test_32x32.mat
    glove: str = (
        ""  # text datasets: GloVe vectors file (glove.6B.100d.txt); empty: embeddings learned from scratch
    )
    max_len: int = 1000  # text datasets: tokens per document


@dataclass
class ModelConfig:
    name: str = "mlp"
    width: int = 256


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


@dataclass
class TrainConfig:
    epochs: int = 5
    seed: int = 0
    device: str = "auto"
    num_threads: int = 0  # 0: torch's default
    calibrators: list = field(default_factory=lambda: ["ts", "fts"])
    amp: str = "auto"  # autocast dtype: auto (bfloat16 on CUDA, off on CPU), bfloat16, float16, off
    channels_last: str | bool = "auto"  # auto (on for CUDA convolutional models), true, false
    compile: bool = False  # torch.compile the model


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


def config_from_dict(raw: dict, base: RunConfig | None = None) -> RunConfig:
    """A RunConfig from nested dicts, starting from ``base`` (defaults if None); unknown keys fail."""
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
    return cfg


def _set(target, section, key, value, types_):
    if key not in types_:
        raise ConfigError(f"unknown key {section}.{key}; valid keys of {section}: {sorted(types_)}")
    annotation = types_[key]
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not _type_ok(value, annotation):
        name = getattr(annotation, "__name__", str(annotation))
        raise ConfigError(f"{section}.{key} must be {name}, got {value!r}")
    setattr(target, key, value)


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Applies ``section.key=value`` strings (values parsed as YAML: 0.1, true, [150, 250], {gamma: 3})."""
    import yaml

    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        path, text = item.split("=", 1)
        parts = path.strip().split(".")
        if len(parts) < 2:
            raise ConfigError(f"override {item!r} must name a section and a key, e.g. optim.lr=0.1")
        section, key = parts[0], parts[1]
        value = yaml.safe_load(text) if text.strip() else ""
        if len(parts) > 2:  # loss.kwargs.gamma=3
            if key != "kwargs" and not (section == "loss" and key == "kwargs"):
                raise ConfigError(f"only loss.kwargs takes nested keys, got {path!r}")
            nested = dict(cfg.loss.kwargs)
            nested[".".join(parts[2:])] = value
            value, key = nested, "kwargs"
        config_from_dict({section: {key: value}}, cfg)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults, then the YAML file (if given), then the overrides."""
    import yaml

    cfg = RunConfig()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        with open(p) as fh:
            raw = yaml.safe_load(fh) or {}
        cfg = config_from_dict(raw, cfg)
    return apply_overrides(cfg, overrides or [])


def config_to_dict(cfg: RunConfig) -> dict:
    return asdict(cfg)
