"""The declared configuration: the data section's kinds, renamed keys, YAML 1.2 booleans, the JSON Schema
and `torchcal config schema / show`."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from torchcal.experiments.cli import app, list_presets
from torchcal.experiments.config import (
    ConfigError,
    ImageDataConfig,
    ImageNetDataConfig,
    TextDataConfig,
    config_from_dict,
    config_schema,
    config_to_dict,
    flatten_config,
    load_config,
    load_yaml,
    migrate_config_dict,
)

runner = CliRunner()
SCHEMA = Path(__file__).resolve().parents[2] / "configs" / "schema.json"


def test_each_dataset_kind_carries_only_its_keys():
    image = load_config(None, ["data.name=cifar10", "data.ood.sets=[svhn]"])
    assert isinstance(image.data, ImageDataConfig) and image.data.ood.sets == ["svhn"]
    text = load_config(None, ["data.name=ag_news", "model.name=text_cnn"])
    assert isinstance(text.data, TextDataConfig)
    assert not hasattr(text.data, "shift") and not hasattr(text.data, "image_size")
    net = load_config(None, ["data.name=imagenet", "data.augment_on=device"])
    assert isinstance(net.data, ImageNetDataConfig) and net.data.augment_on == "device"
    for override, message in [
        ("data.max_len=200", "data.max_len applies to text datasets, not data.name=fashion_mnist"),
        ("data.image_size=64", "data.image_size applies to the sets decoded per batch"),
        ("data.loader.batchsize=3", "unknown key data.loader.batchsize; valid keys of data.loader"),
        ("data.ood.sets=[mnist]", "unknown OOD set 'mnist'"),
        ("data.shift.name=fog", "unknown shift data.shift.name='fog'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [override])


def test_a_dataset_name_that_is_not_a_string_is_refused_by_name():
    # a mapping or list given as data.name is an unknown dataset, not a TypeError from looking it up
    for override in ("data.name={a: 1}", "data.name=[a]", "data.name=3"):
        with pytest.raises(ConfigError, match="unknown dataset data.name="):
            load_config(None, [override])
    with pytest.raises(ConfigError, match="unknown dataset data.name="):
        config_from_dict({"data": {"name": ["cifar10"]}})


def test_changing_the_dataset_drops_the_other_kinds_keys():
    # a config of an image set, overridden to a text set: the image set's shift and OOD sets do not follow
    from torchcal.experiments.config import apply_overrides

    image = load_config(None, ["data.name=cifar10", "data.shift.severity=0.2", "data.loader.batch_size=7"])
    text = apply_overrides(image, ["data.name=ag_news"])
    assert isinstance(text.data, TextDataConfig) and text.data.loader.batch_size == 7


def test_renamed_keys_load_with_a_warning_naming_the_new_key(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("data:\n  name: digits\n  batch_size: 32\n  shift_severity: 0.3\n  ood: ''\n  num_workers: 1\n")
    with pytest.warns(FutureWarning, match=r"data.batch_size -> data.loader.batch_size"):
        cfg = load_config(old)
    assert (cfg.data.loader.batch_size, cfg.data.shift.severity, cfg.data.ood.sets) == (32, 0.3, [])
    assert cfg.data.loader.num_workers == 1
    # the error names the key as the user wrote it
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="data.shift_severity must be >= 0"):
        load_config(None, ["data.shift_severity=-1"])
    # an empty shift/OOD of a text set (the old presets' way of saying "none") is dropped
    with pytest.warns(FutureWarning):
        text = load_config(None, ["data.name=sst_binary", "data.shift=", "data.ood="])
    assert isinstance(text.data, TextDataConfig)


def test_saved_flat_configs_are_read_quietly_and_group_with_new_ones():
    flat = {"data": {"name": "fashion_mnist", "root": "", "val_size": 5000, "split_seed": 1, "batch_size": 64,
                     "eval_batch_size": 1000, "augment": False, "limit_train": 0, "shift": "gaussian_noise",
                     "shift_severity": 0.5, "shift_root": "", "ood": "digits", "ood_root": "", "glove": "",
                     "image_size": 224, "num_workers": 0, "augment_on": "workers", "ten_crop": False,
                     "max_len": 1000, "eval_max_len": 0},
            "model": {"name": "mlp", "width": 256, "checkpoint": ""}}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a saved run is read without the renamed-key warning
        cfg = config_from_dict(flat, validate=False)
        keys = flatten_config(flat)
    assert cfg.data.loader.batch_size == 64 and cfg.data.ood.sets == ["digits"]
    new = load_config(None, ["data.loader.batch_size=64"])
    assert keys["data.loader.batch_size"] == 64 and {k: keys[k] for k in keys if k.startswith("data.")} == {
        k: v for k, v in flatten_config(new).items() if k.startswith("data.")
    }
    assert migrate_config_dict(flat)["data"]["loader"] == {"batch_size": 64, "eval_batch_size": 1000,
                                                           "num_workers": 0}  # fmt: skip


def test_yaml_12_booleans_and_python_numbers():
    assert load_yaml("[true, FALSE, yes, no, on, off, 1e-5, .5]") == [True, False, "yes", "no", "on", "off",
                                                                      1e-5, 0.5]  # fmt: skip
    with pytest.raises(ConfigError, match="data.augment must be true or false, got 'yes'"):
        load_config(None, ["data.augment=yes"])
    cfg = load_config(None, ["optim.lr=1E-3", "optim.weight_decay=5e-4", "data.augment=true"])
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.data.augment) == (1e-3, 5e-4, True)


def test_the_committed_schema_is_current_and_every_preset_validates():
    jsonschema = pytest.importorskip("jsonschema")  # the `dev` extra installs it
    schema = config_schema()
    assert json.loads(SCHEMA.read_text()) == schema, "run `torchcal config schema -o configs/schema.json`"
    validator = jsonschema.Draft202012Validator(schema)
    presets = list_presets()
    assert presets
    for name, path in presets.items():
        text = Path(path).read_text()
        assert text.startswith("# yaml-language-server: $schema=schema.json\n"), name
        errors = list(validator.iter_errors(load_yaml(text)))
        assert not errors, f"{name}: {errors[0].message}"
    # and the schema refuses what the config refuses
    assert list(validator.iter_errors({"data": {"name": "sst_binary", "shift": {"name": ""}}}))
    assert list(validator.iter_errors({"optim": {"lr": "fast"}}))
    assert list(validator.iter_errors({"train": {"epochs": 0}}))


def test_config_commands(tmp_path):
    out = tmp_path / "schema.json"
    result = runner.invoke(app, ["config", "schema", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text()) == config_schema()
    result = runner.invoke(app, ["config", "schema"])
    assert result.exit_code == 0 and json.loads(result.output) == config_schema()
    result = runner.invoke(app, ["config", "show", "cifar10_resnet110_fl3", "train.epochs=2"])
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.output)
    assert shown == config_to_dict(load_config(list_presets()["cifar10_resnet110_fl3"], ["train.epochs=2"]))
    assert shown["train"]["epochs"] == 2 and shown["data"]["loader"]["eval_batch_size"] == 1000  # defaults
    result = runner.invoke(app, ["config", "show", "no_such_preset"])
    assert result.exit_code == 2 and "neither a preset nor a file" in result.output
    result = runner.invoke(app, ["config", "show", "optim.lr=0"])
    assert result.exit_code == 2 and "optim.lr must be > 0" in result.output
    assert "Traceback" not in result.output
    result = runner.invoke(app, ["config", "schema", "-o", str(tmp_path / "missing" / "s.json")])
    assert result.exit_code == 2 and not (tmp_path / "missing").exists()
