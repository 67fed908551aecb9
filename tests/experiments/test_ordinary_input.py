"""Ordinary input is accepted or refused in one sentence (issue 24 §2): numbers as Python writes them on the
command line, in config files and sweeps; nan/inf refused naming the key; a loss name that fixes an
argument; missing CIFAR data; an unavailable device; every image model on 1- and 3-channel images."""

import pytest
import yaml
from typer.testing import CliRunner

from torchcal.experiments.cli import app
from torchcal.experiments.config import ConfigError, load_config, load_yaml
from torchcal.losses import create

runner = CliRunner()
TINY = ["data.name=digits", "data.ood.sets=[]", "data.val_size=260", "data.loader.batch_size=64", "model.width=16",
        "train.num_threads=1", "train.epochs=1", "train.calibrators=[ts]"]  # fmt: skip


def snapshot(folder):
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# -- numbers ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [
        ("1e-5", 1e-5),
        ("5e-4", 5e-4),
        ("1E-3", 1e-3),
        (".5", 0.5),
        ("1_000", 1000.0),
        ("2.5e+1", 25.0),
        ("-1e-2", -0.01),
        ("1_0.5e1", 105.0),
    ],  # fmt: skip
)
def test_python_number_literals_are_numbers(text, value):
    assert load_yaml(f"x: {text}") == {"x": value}


@pytest.mark.parametrize("text", ["e5", "1e", "abc", "1e-5x", "1.2.3", "nan", "inf"])
def test_words_stay_strings(text):
    assert load_yaml(f"x: {text}") == {"x": text}


def test_numbers_from_the_command_line_and_a_config_file_train(tmp_path):
    (tmp_path / "c.yaml").write_text(
        "optim:\n  lr: 5e-4\n  weight_decay: 1E-3\ndata:\n  limit_train: 1_000\n"
    )
    run = tmp_path / "run"
    result = runner.invoke(app, ["train", str(tmp_path / "c.yaml"), "-o", str(run), *TINY, "optim.momentum=.5",
                                 "loss.name=dfl", "loss.kwargs.gamma=3e0"])  # fmt: skip
    assert result.exit_code == 0, result.output
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["optim"]["lr"] == 5e-4 and saved["optim"]["weight_decay"] == 1e-3
    assert saved["optim"]["momentum"] == 0.5 and saved["data"]["limit_train"] == 1000
    assert saved["loss"]["kwargs"] == {"gamma": 3.0}
    run2 = tmp_path / "run2"
    result = runner.invoke(app, ["train", "-o", str(run2), *TINY, "optim.lr=1e-5"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((run2 / "config.yaml").read_text())["optim"]["lr"] == 1e-5


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", ".nan", ".inf"])
def test_nan_and_inf_are_refused_naming_the_key(tmp_path, value):
    result = runner.invoke(app, ["train", "-o", str(tmp_path / "r"), *TINY, f"optim.lr={value}"])
    assert result.exit_code == 2
    assert (
        "optim.lr must be a finite number" in result.output and len(result.output.strip().splitlines()) == 1
    )
    assert not (tmp_path / "r").exists()
    (tmp_path / "c.yaml").write_text(f"data:\n  shift_severity: {value}\n")
    with pytest.raises(ConfigError, match="data.shift_severity must be a finite number"):
        load_config(tmp_path / "c.yaml")


def test_a_word_where_a_number_is_expected_names_the_key():
    with pytest.raises(ConfigError, match=r"optim.lr must be a number \(e.g. 0.1, 1e-5\), got 'fast'"):
        load_config(None, ["optim.lr=fast"])
    with pytest.raises(ConfigError, match="train.epochs must be an integer, got 1000.0"):
        load_config(None, ["train.epochs=1e3"])


def test_sweep_grids_take_exponents(tmp_path):
    from torchcal.experiments.sweep import expand, load_sweep

    (tmp_path / "s.yaml").write_text(
        f"out: {tmp_path / 'o'}\noverrides: {TINY}\ngrid:\n  optim.lr: [1e-3, 5e-4]\n"
    )
    runs = expand(load_sweep(tmp_path / "s.yaml"))
    assert [load_config(None, r["overrides"]).optim.lr for r in runs] == [1e-3, 5e-4]


# -- a loss name that fixes an argument --------------------------------------------------------------------


def test_a_name_that_fixes_gamma_says_so_and_names_the_loss_to_use(tmp_path):
    with pytest.raises(
        ValueError, match=r"'fl-3' fixes gamma = 3 .* name it 'fl-2' .*losses.FocalLoss\(gamma=2\)"
    ):
        create("fl-3", gamma=2)
    with pytest.raises(ValueError, match=r"'ls-0.05' fixes label_smoothing = 0.05 .* 'ls-0.1'"):
        create("ls-0.05", label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"'binary-fl-2' fixes gamma = 2 .* 'binary-fl-1'"):
        create("binary-fl-2", gamma=1)
    with pytest.raises(ValueError, match=r"'flsd-53' is SampleDependentFocalLoss with gammas = \(5, 3\)"):
        create("flsd-53", gammas=(4, 2))
    assert create("fl-3", reduction="sum").gamma == 3.0  # other arguments still pass
    result = runner.invoke(app, ["train", "-o", str(tmp_path / "r"), *TINY, "loss.name=fl-3",
                                 "loss.kwargs.gamma=2"])  # fmt: skip
    assert result.exit_code == 2 and "fixes gamma = 3" in result.output and "'fl-2'" in result.output
    assert "multiple values" not in result.output and not (tmp_path / "r").exists()


# -- missing CIFAR data ------------------------------------------------------------------------------------


def test_missing_cifar_from_the_cli_names_the_sub_folder_path_and_archive(tmp_path):
    root = tmp_path / "nowhere"
    result = runner.invoke(app, ["train", "-o", str(tmp_path / "r"), "data.name=cifar10", f"data.root={root}",
                                 "model.name=resnet110", "data.ood.sets=[]"])  # fmt: skip
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert len(line.splitlines()) == 1
    assert "cifar-10-batches-py" in line and str(root / "cifar-10-batches-py") in line
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in line and "data.root" in line
    assert not (tmp_path / "r").exists()


# -- an unavailable device ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "mps"])
def test_an_unavailable_device_is_refused_before_the_data_loads(tmp_path, monkeypatch, device):
    import torch

    import torchcal.experiments.training.loop as train_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only build, whatever this host has
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)

    def no_data(*args, **kwargs):
        raise AssertionError("the data were loaded before the device was checked")

    monkeypatch.setattr(train_module, "load_splits", no_data)
    result = runner.invoke(app, ["train", "-o", str(tmp_path / "r"), *TINY, f"train.device={device}"])
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert len(line.splitlines()) == 1 and f"train.device={device} is not available here" in line
    assert "train.device=cpu" in line and not (tmp_path / "r").exists()


def test_a_gpu_index_beyond_the_machine_is_refused(monkeypatch):
    import torch

    from torchcal.experiments.training.loop import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(
        ConfigError, match=r"train.device=cuda:3 is not available here: .* 1 cuda device\(s\) \(cuda:0\)"
    ):
        resolve_device("cuda:3")
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")


# -- every image model on every image dataset --------------------------------------------------------------

IMAGE_MODELS = ["small_cnn", "mlp", "resnet50", "resnet110", "resnet110_he", "resnet110_sd", "wrn_26_10",
                "densenet121", "densenet40", "resnet50_imagenet", "densenet121_imagenet"]  # fmt: skip


def test_the_list_covers_every_registered_model():
    from torchcal.experiments.models.registry import list_models

    assert set(list_models()) - set(IMAGE_MODELS) == {"text_cnn", "transformer"}


@pytest.mark.parametrize("name", IMAGE_MODELS)
@pytest.mark.parametrize("channels", [1, 3])
def test_every_image_model_runs_on_one_and_three_channel_images(name, channels):
    import torch

    from torchcal.experiments.models.registry import create_model

    stats = ((0.3,), (0.2,)) if channels == 1 else None
    model = create_model(name, 7, (channels, 32, 32), 16, stats=stats)
    with torch.no_grad():
        out = model.eval()(torch.rand(2, channels, 32, 32))
    assert out.shape == (2, 7) and torch.isfinite(out).all()
    norm = getattr(model, "norm", None)
    if norm is not None and channels == 1:  # the data's own statistics, not CIFAR's three channels
        assert norm.mean.flatten().tolist() == pytest.approx([0.3]) and norm.std.flatten().tolist() == [
            pytest.approx(0.2)
        ]


def test_a_grey_dataset_trains_a_cifar_resnet_normalised_with_its_own_statistics(tmp_path):
    import torch

    from torchcal.experiments.data.readers import load_splits
    from torchcal.experiments.training.loop import _build_model

    cfg = load_config(None, [*TINY, "model.name=resnet110_he"])
    train_set = load_splits(cfg.data)["train"]
    model = _build_model(cfg, train_set, 10)
    x = train_set.inputs.double()
    torch.testing.assert_close(model.norm.mean.flatten().double(), x.mean((0, 2, 3)), rtol=1e-6, atol=1e-7)
    # the population standard deviation over every pixel, as float64 (float32 buffer: ~1e-7 relative)
    torch.testing.assert_close(
        model.norm.std.flatten().double(), x.std((0, 2, 3), correction=0), rtol=1e-6, atol=1e-7
    )
    result = runner.invoke(app, ["train", "-o", str(tmp_path / "r"), *TINY, "model.name=resnet110_he",
                                 "data.limit_train=64", "data.val_size=32"])  # fmt: skip
    assert result.exit_code == 0, result.output
