import pytest

from torchcal.experiments.config import ConfigError, RunConfig, apply_overrides, config_to_dict, load_config


def test_defaults_file_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("loss:\n  name: dfl\noptim:\n  name: sgd\n  lr: 1\n  milestones: [150, 250]\n")
    cfg = load_config(path, ["optim.lr=0.05", "train.epochs=2", "loss.kwargs.gamma=3", "data.augment=true"])
    assert cfg.loss.name == "dfl" and cfg.optim.name == "sgd"
    assert cfg.optim.lr == 0.05 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.milestones == [150, 250]
    assert cfg.train.epochs == 2 and cfg.loss.kwargs == {"gamma": 3}
    assert cfg.data.augment is True
    assert config_to_dict(RunConfig())["model"] == {"name": "mlp", "width": 256, "checkpoint": ""}


@pytest.mark.parametrize(
    "override,match",
    [
        (
            "optim.lrate=0.1",
            r"unknown key optim.lrate; valid keys of optim: \['gamma', 'grad_clip_norm', 'lr'",
        ),
        ("optimizer.lr=0.1", r"unknown config section 'optimizer'; valid sections: \['data', 'loss'"),
        ("train.epochs=two", "train.epochs must be an integer, got 'two'"),
        ("train.epochs", "must look like section.key=value"),
        ("epochs=3", "must name a section and a key"),
        ("optim.lr.x=1", "only loss.kwargs takes nested keys"),
    ],
)
def test_typos_fail_with_the_valid_choices(override, match):
    with pytest.raises(ConfigError, match=match):
        apply_overrides(RunConfig(), [override])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(bad)


def test_every_paper_preset_loads_and_names_real_components():
    from torchcal.experiments.cli import list_presets
    from torchcal.experiments.models.registry import list_models
    from torchcal.losses import create

    presets = list_presets()
    # CIFAR; Tiny-ImageNet, 20NG, AG News, FinSen; SST; BERT; CheXNet; ImageNet; Dual Focal Table 10; SVHN
    assert len(presets) == 72 + 36 + 9 + 4 + 3 + 5 + 12 + 3
    for name, path in presets.items():
        cfg = load_config(path)
        assert cfg.model.name in list_models(), name
        create(cfg.loss.name, reduction=cfg.loss.reduction, **cfg.loss.kwargs)
        if name.startswith("imagenet"):  # AdaFocal's ImageNet protocol (decision 80)
            assert (cfg.optim.lr, cfg.optim.milestones, cfg.train.epochs, cfg.data.val_size) == (
                0.01,
                [30, 60],
                90,
                25000,
            )
            assert cfg.model.name == "resnet50_imagenet" and cfg.data.loader.batch_size == 128, name
            continue
        if name.startswith("chestxray14"):  # CheXNet as the FCL paper trains it (decision 79)
            assert (cfg.optim.name, cfg.optim.lr, cfg.optim.schedule, cfg.data.loader.batch_size) == (
                "adam",
                1e-4,
                "plateau",
                32,
            )
            assert cfg.data.ten_crop and cfg.train.select == "best_val_nll" and cfg.train.epochs == 100
            continue
        if "_bert_" in name:  # fine-tuning: the Hugging Face recipe (decision 75)
            assert cfg.optim.grad_clip_norm == 1.0 and cfg.train.epochs == 10 and cfg.loss.reduction == "mean"
            continue
        assert cfg.optim.grad_clip_norm == 2.0 and cfg.train.epochs in (350, 100, 50, 25), name
        assert cfg.loss.reduction == ("mean" if cfg.loss.name == "brier" else "sum")
    fcl = load_config(presets["cifar10_resnet50_fcl"])
    assert fcl.loss.kwargs == {"gamma": 4.0, "lambda_": 1.5}
