"""Writes the paper presets in this folder: CIFAR-10/100 x ResNet-50/110, WRN-26-10, DenseNet-121 x the nine
losses of the papers' tables. Run `python configs/make_presets.py` after changing a protocol here.

Protocol (SPEC §1 and §5): SGD momentum 0.9, weight decay 5e-4, batch 128, lr 0.1 divided by 10 at epochs
150 and 250, 350 epochs, random crop + flip, 45k/5k split with seed 1; the released training scripts sum the
loss over the batch and clip the gradient norm at 2 (Brier alone was averaged); MMCE uses the released
code's normalisation and λ = 2; FCL's (γ, λ) per setting from its appendix A.10; DFL γ = 5 (Tao et al. chose
γ by cross-validation; 5 is their CIFAR-10 ResNet-50 choice, Table 13). OOD: SVHN test and CIFAR-10-C Gaussian noise at severity 5
(AUROC for each); shift: CIFAR-10-C Gaussian noise, severity 5 (CIFAR-10 only). Tiny-ImageNet: ResNet-50, batch 64, lr 0.1/0.01/0.001 switching
at epochs 40 and 60, 100 epochs. 20 Newsgroups: global-pooling CNN on GloVe-100d, Adam lr 1e-3, 50 epochs,
the papers' split of 20news-19997 (15,098 / 900 / 3,999; decision 71), MMCE λ = 8. AG News: the 20 Newsgroups protocol (FCL paper), 5,000 validation
articles. FinSen: the same protocol on the split of its released loader (decision 72). SST Binary: the text CNN in
place of the Tree-LSTM (decision 76). BERT on 20 Newsgroups: AdaFocal's fine-tuning recipe (``bert()``). Tiny-ImageNet batch 64 (AdaFocal, FTS), 128 for the FCL preset (the FCL paper's batch size). Post-hoc calibration: temperature by the papers' grid on validation
ECE (Mukhoti et al., DFL, FCL) and on equal-mass ECE (AdaFocal), and FTS (``PAPER_CALIBRATORS``). Tiny-ImageNet and the text sets keep the model of the epoch with the lowest
validation error (``train.select: best_val_error``, AdaFocal §6); the CIFAR presets the last epoch. Dual Focal's
Table 10: ResNet-110 (SD) and DenseNet-40 on CIFAR-10/100 with CE, KDE-XE and DFL (``table10()``). AdaFocal's
Fig. 53: ResNet-110 on SVHN with CE, FLSD-53 and AdaFocal (``svhn()``).
"""

from pathlib import Path

import yaml

# editors with the YAML language server complete and check the presets against the config's JSON Schema
# (`torchcal config schema > configs/schema.json`)
SCHEMA_LINE = "# yaml-language-server: $schema=schema.json\n"

# the papers' post-hoc criteria: T on the grid 0.1..10 minimising validation ECE (Mukhoti et al., DFL, FCL),
# the same on equal-mass ECE (AdaFocal), and focal temperature scaling on equal-mass ECE (Komisarenko & Kull)
PAPER_CALIBRATORS = ["ts:objective=ece", "ts:objective=adaece", "fts"]
MODELS = {"resnet50": "resnet50", "resnet110": "resnet110", "wrn": "wrn_26_10", "densenet121": "densenet121"}
FCL = {  # (gamma, lambda) from the FCL paper, appendix A.10
    ("cifar100", "resnet50"): (2.0, 0.5), ("cifar100", "resnet110"): (4.0, 1.5),
    ("cifar100", "wrn_26_10"): (3.0, 0.5), ("cifar100", "densenet121"): (3.0, 0.5),
    ("cifar10", "resnet50"): (4.0, 1.5), ("cifar10", "resnet110"): (4.0, 1.5),
    ("cifar10", "wrn_26_10"): (2.0, 0.5), ("cifar10", "densenet121"): (2.0, 0.5),
}  # fmt: skip
LOSSES = {
    "ce": ("ce", {}), "brier": ("brier", {}), "mmce": ("mmce", {"lambda_": 2.0, "normalization": "code"}),
    "ls0.05": ("ls-0.05", {}), "fl3": ("fl-3", {}), "flsd53": ("flsd-53", {}), "dfl": ("dfl", {"gamma": 5.0}),
    "adafocal": ("adafocal", {}), "fcl": ("fcl", None),
}  # fmt: skip


def preset(dataset, model, loss_key):
    name, kwargs = LOSSES[loss_key]
    if kwargs is None:
        gamma, lam = FCL[(dataset, model)]
        kwargs = {"gamma": gamma, "lambda_": lam}
    return {
        "data": {"name": dataset, "root": "data", "val_size": 5000, "split_seed": 1, "augment": True,
                 "loader": {"batch_size": 128},
                 "shift": {"name": "cifar10_c" if dataset == "cifar10" else "", "severity": 5,
                           "root": "data/CIFAR-10-C"},
                 "ood": {"sets": ["svhn", "cifar10_c"] if dataset == "cifar10" else [], "root": "data/svhn"}},
        "model": {"name": model},
        "loss": {"name": name, "reduction": "mean" if name == "brier" else "sum", "kwargs": kwargs},
        "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4, "milestones": [150, 250],
                  "gamma": 0.1, "grad_clip_norm": 2.0},
        "train": {"epochs": 350, "seed": 0, "device": "auto", "calibrators": PAPER_CALIBRATORS},
    }  # fmt: skip


def tiny_imagenet(loss_key):
    cfg = preset("cifar100", "resnet50", loss_key)
    if loss_key == "fcl":
        cfg["loss"]["kwargs"] = {"gamma": 3.0, "lambda_": 0.5}  # FCL appendix A.10, Tiny-ImageNet ResNet-50
    cfg["data"] = {
        "name": "tiny_imagenet",
        "root": "data",
        "augment": True,
        "loader": {"batch_size": 64},
    }
    if loss_key == "fcl":
        cfg["data"]["loader"]["batch_size"] = 128  # the FCL paper trains every dataset but CheXNet at batch 128
    cfg["optim"].update({"milestones": [40, 60]})
    cfg["train"]["epochs"] = 100
    cfg["train"]["select"] = "best_val_error"  # AdaFocal §6: the model with the lowest validation error
    return cfg


def newsgroups(loss_key):
    cfg = preset("cifar100", "resnet50", loss_key)
    if loss_key == "fcl":
        cfg["loss"]["kwargs"] = {"gamma": 5.0, "lambda_": 4.5}  # FCL appendix A.10, 20 Newsgroups
    if loss_key == "mmce":
        cfg["loss"]["kwargs"]["lambda_"] = 8.0  # λ = 8 for text (SPEC §1)
    cfg["data"] = {"name": "20newsgroups_papers", "root": "data", "glove": "data/glove.6B.100d.txt", "max_len": 1000,
                   "val_size": 900, "augment": False, "loader": {"batch_size": 128}}  # fmt: skip
    cfg["model"] = {"name": "text_cnn"}
    cfg["optim"] = {"name": "adam", "lr": 0.001, "weight_decay": 0.0, "milestones": [], "grad_clip_norm": 2.0}
    cfg["train"]["epochs"] = 50
    cfg["train"]["select"] = "best_val_error"  # AdaFocal §6: the model with the lowest validation error
    return cfg


def ag_news(loss_key):
    """AG News as in the FCL paper's table: the 20 Newsgroups protocol (global-pooling CNN on GloVe-100d,
    Adam 1e-3, 50 epochs, best validation model); the paper is silent on the validation split: 5,000 of the
    120,000 training articles (seed 1); FCL's (γ, λ) = (4.0, 3.0) from its appendix A.10."""
    cfg = newsgroups(loss_key)
    if loss_key == "fcl":
        cfg["loss"]["kwargs"] = {"gamma": 4.0, "lambda_": 3.0}
    cfg["data"].update({"name": "ag_news", "val_size": 5000, "max_len": 200})
    return cfg


def finsen(loss_key):
    """FinSen as in the FCL paper's table: the 20 Newsgroups protocol on the split of FinSen's released loader
    (70 / 15 / 15 %, seed 42; decision 72); FCL's (γ, λ) = (4.0, 4.0) from its appendix A.10."""
    cfg = newsgroups(loss_key)
    if loss_key == "fcl":
        cfg["loss"]["kwargs"] = {"gamma": 4.0, "lambda_": 4.0}
    cfg["data"].update({"name": "finsen"})
    del cfg["data"]["val_size"]  # fixed by the split
    return cfg


BERT_LOSSES = {  # AdaFocal §6 / Fig. 17: CE, FLSD-53 and AdaFocal, per epoch and every 100 batches
    "ce": ("ce", {}, 0), "flsd53": ("flsd-53", {}, 0), "adafocal": ("adafocal", {}, 0),
    "adafocal100": ("adafocal", {}, 100),
}  # fmt: skip


def bert(loss_key):
    """AdaFocal's BERT protocol (its appendix D): bert-base-uncased + one linear layer, AdamW lr 2e-5, weight
    decay 0.01, batch 32, warm-up over 0.2 of an epoch's batches, 128 tokens for training and 512 for
    evaluation, 10 epochs, the model of lowest validation error; the papers' 20 Newsgroups split. Where the
    paper is silent (decision 75): linear decay to 0 after the warm-up, no decay of biases and LayerNorm
    weights, gradient norm clipped at 1.0, the batch mean of the loss."""
    name, kwargs, every = BERT_LOSSES[loss_key]
    return {
        "data": {"name": "20newsgroups_papers", "root": "data", "val_size": 900, "max_len": 128,
                 "eval_max_len": 512, "augment": False, "loader": {"batch_size": 32, "eval_batch_size": 64}},
        "model": {"name": "transformer", "checkpoint": "data/bert-base-uncased"},
        "loss": {"name": name, "reduction": "mean", "kwargs": kwargs, "update_every": every},
        "optim": {"name": "adamw", "lr": 2e-5, "weight_decay": 0.01, "schedule": "linear", "warmup_epochs": 0.2,
                  "milestones": [], "grad_clip_norm": 1.0},
        "train": {"epochs": 10, "seed": 0, "device": "auto", "calibrators": PAPER_CALIBRATORS,
                  "select": "best_val_error"},
    }  # fmt: skip


def sst(loss_key):
    """SST Binary (Mukhoti et al., appendix C-D) with the global-pooling CNN on GloVe in place of their
    Tree-LSTM (decision 76): AdaGrad lr 0.05, weight decay 1e-4, batch 25, 25 epochs, the model of best
    validation accuracy; MMCE λ = 8 (text); FCL with its 20 Newsgroups CNN setting (the FCL paper has no SST)."""
    cfg = newsgroups(loss_key)
    cfg["data"] = {"name": "sst_binary", "root": "data", "glove": "data/glove.6B.100d.txt", "max_len": 150,
                   "augment": False, "loader": {"batch_size": 25}}  # fmt: skip
    cfg["optim"] = {
        "name": "adagrad",
        "lr": 0.05,
        "weight_decay": 1e-4,
        "milestones": [],
        "grad_clip_norm": 2.0,
    }
    cfg["train"]["epochs"] = 25
    return cfg


CHEXNET_LOSSES = {"bce": ("bce", {}), "binaryfl2": ("binary-fl-2", {}), "fcl": ("binary-fcl", {})}


def chexnet(loss_key):
    """CheXNet (Rajpurkar et al. 2017) as the FCL paper trains it (its appendix A.16 and setup): DenseNet-121
    with the ImageNet stem on 224 × 224 ChestX-ray14 images, 14 sigmoid outputs, ten-crop evaluation of
    validation and test, Adam lr 1e-4, batch 32, 100 epochs, the learning rate × 0.1 when the validation loss
    stalls for 5 epochs, the model of lowest validation loss (decision 79). The paper leaves the weight decay
    and FCL's (γ, λ) for CheXNet unstated: 1e-5 and torchcal's FCL default (4.0, 1.5)."""
    name, kwargs = CHEXNET_LOSSES[loss_key]
    return {
        "data": {"name": "chestxray14", "root": "data/ChestX-ray14", "val_size": 8650, "split_seed": 1,
                 "image_size": 224, "ten_crop": True, "augment": True,
                 "loader": {"batch_size": 32, "eval_batch_size": 64}},
        "model": {"name": "densenet121_imagenet"},
        "loss": {"name": name, "reduction": "mean", "kwargs": kwargs},
        "optim": {"name": "adam", "lr": 1e-4, "weight_decay": 1e-5, "schedule": "plateau", "patience": 5,
                  "gamma": 0.1, "milestones": [], "grad_clip_norm": 0.0},
        "train": {"epochs": 100, "seed": 1, "device": "auto", "calibrators": ["ts", "platt"],
                  "select": "best_val_nll"},
    }  # fmt: skip


IMAGENET_LOSSES = {
    "ce": ("ce", {}), "flsd53": ("flsd-53", {}), "dfl": ("dfl", {"gamma": 5.0}), "adafocal": ("adafocal", {}),
    "fcl": ("fcl", {"gamma": 4.0, "lambda_": 1.5}),
}  # fmt: skip


def imagenet(loss_key):
    """ImageNet ResNet-50 in AdaFocal's protocol (its appendix D, the one paper of the five that states it):
    SGD momentum 0.9, weight decay 1e-4, batch 128, lr 0.01 / 0.001 / 0.0001 switching at epochs 30 and 60,
    90 epochs, the last epoch's model; the 50,000 validation images halved into validation and test (split
    seed 1); RandomResizedCrop 224 + flip for training, resize 256 + centre crop 224 for evaluation. Where it
    is silent (decision 80): the batch-mean loss (PyTorch's ImageNet example), 8 decoding workers per GPU,
    DFL γ = 5 and FCL (4.0, 1.5) as on CIFAR-10 ResNet-50."""
    name, kwargs = IMAGENET_LOSSES[loss_key]
    return {
        "data": {"name": "imagenet", "root": "data/imagenet", "val_size": 25000, "split_seed": 1,
                 "image_size": 224, "augment": True,
                 "loader": {"batch_size": 128, "eval_batch_size": 256, "num_workers": 8}},
        "model": {"name": "resnet50_imagenet"},
        "loss": {"name": name, "reduction": "mean", "kwargs": kwargs},
        "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4, "milestones": [30, 60],
                  "gamma": 0.1, "grad_clip_norm": 0.0},
        "train": {"epochs": 90, "seed": 0, "device": "auto", "calibrators": PAPER_CALIBRATORS},
    }  # fmt: skip


TABLE10_MODELS = {"resnet110sd": "resnet110_sd", "densenet40": "densenet40"}
TABLE10_LOSSES = {  # Dual Focal's Table 10 (its appendix F) compares cross entropy, KDE-XE and Dual Focal
    "ce": ("ce", {}), "kdexe": ("kde-xe", {"lambda_": 1.0, "bandwidth": "auto"}), "dfl": ("dfl", {"gamma": 5.0}),
}  # fmt: skip
TABLE10_HEADER = """\
# {dataset} {model} {loss}: generated by configs/make_presets.py (see table10()).
# Dual Focal Loss, Table 10 (appendix F): {model} on {dataset}, cross entropy vs KDE-XE vs Dual Focal. The paper
# says only that it uses "the same training setting provided in (Popordanoska et al., 2022)" and states none of
# it; this preset trains with the paper's own CIFAR protocol (decision 184). KDE-XE's lambda is not stated: 1.0.
"""


def table10(dataset, model, loss_key):
    """Dual Focal Loss's Table 10 (appendix F): ResNet-110 with stochastic depth and DenseNet-40 on CIFAR-10/100,
    trained with cross entropy, KDE-XE (cross entropy + λ·ECE_KDE of the batch) and Dual Focal. The paper
    defers the training setting to Popordanoska et al. (2022) without stating it; these presets use the Dual
    Focal paper's own CIFAR protocol (``preset()``: 350 epochs, lr 0.1 / 0.01 / 0.001 switching at 150 and 250,
    batch 128, weight decay 5e-4, the summed loss, gradient norm clipped at 2), DFL γ = 5 as on every CIFAR
    preset, KDE-XE λ = 1.0 (unstated; decision 144) with the bandwidth by leave-one-out likelihood per batch
    (decision 184)."""
    cfg = preset(dataset, model, "ce")
    name, kwargs = TABLE10_LOSSES[loss_key]
    cfg["loss"] = {"name": name, "reduction": "sum", "kwargs": dict(kwargs)}
    return cfg


SVHN_LOSSES = ("ce", "flsd53", "adafocal")  # AdaFocal Fig. 53 (its AdaFocal-schedule is not a preset)
SVHN_HEADER = """\
# svhn resnet110 {loss}: generated by configs/make_presets.py (see svhn()).
# AdaFocal, Fig. 53 (appendix O.13): ResNet-110 trained on SVHN with CE, FLSD-53 and AdaFocal. The paper states
# the model, the losses and 50 epochs (the caption's gamma-update schedule ends at epoch 50) and nothing else
# for SVHN: optimiser, learning-rate schedule, batch size, validation split and augmentation are torchcal's
# choices (decision 185): SGD as on CIFAR, lr 0.1 / 0.01 / 0.001 switching at epochs 25 and 40, batch 128,
# 5,000 validation images (seed 1), no augmentation, the last epoch's model (AdaFocal appendix D.3).
"""


def svhn(loss_key):
    """AdaFocal's SVHN runs (Fig. 53): the papers' ResNet-110 on SVHN's train_32x32.mat (73,257 digits, 5,000
    of them for validation, seed 1) and test_32x32.mat, 50 epochs (the figure's stated length). The paper states
    nothing else for SVHN (decision 185): SGD momentum 0.9, weight decay 5e-4, batch 128, summed loss and
    gradient clipping at 2 as on its CIFAR runs; lr 0.1, 0.01 from epoch 25, 0.001 from epoch 40 (the epochs
    where the figure's AdaFocal-schedule changes its update frequency); no augmentation (flips do not preserve
    digits); the last epoch's model (appendix D.3); no shift or OOD set."""
    cfg = preset("cifar10", "resnet110", loss_key)
    cfg["data"] = {"name": "svhn", "root": "data/svhn", "val_size": 5000, "split_seed": 1, "augment": False,
                   "loader": {"batch_size": 128}, "shift": {"name": ""}, "ood": {"sets": []}}  # fmt: skip
    cfg["optim"]["milestones"] = [25, 40]
    cfg["train"]["epochs"] = 50
    return cfg


def main():
    here = Path(__file__).parent
    for dataset in ("cifar10", "cifar100"):
        for short, model in TABLE10_MODELS.items():
            for loss_key in TABLE10_LOSSES:
                header = TABLE10_HEADER.format(dataset=dataset, model=model, loss=TABLE10_LOSSES[loss_key][0])
                (here / f"{dataset}_{short}_{loss_key}.yaml").write_text(
                    SCHEMA_LINE + header + yaml.safe_dump(table10(dataset, model, loss_key), sort_keys=False)
                )
    for loss_key in SVHN_LOSSES:
        (here / f"svhn_resnet110_{loss_key}.yaml").write_text(
            SCHEMA_LINE
            + SVHN_HEADER.format(loss=LOSSES[loss_key][0])
            + yaml.safe_dump(svhn(loss_key), sort_keys=False)
        )
    for loss_key in IMAGENET_LOSSES:
        header = f"# imagenet_resnet50 {loss_key}: generated by configs/make_presets.py (see imagenet())\n"
        (here / f"imagenet_resnet50_{loss_key}.yaml").write_text(
            SCHEMA_LINE + header + yaml.safe_dump(imagenet(loss_key), sort_keys=False)
        )
    for loss_key in CHEXNET_LOSSES:
        header = (
            f"# chestxray14_densenet121 {loss_key}: generated by configs/make_presets.py (see chexnet())\n"
        )
        (here / f"chestxray14_densenet121_{loss_key}.yaml").write_text(
            SCHEMA_LINE + header + yaml.safe_dump(chexnet(loss_key), sort_keys=False)
        )
    for loss_key in BERT_LOSSES:
        header = f"# 20newsgroups_bert {loss_key}: generated by configs/make_presets.py (see bert())\n"
        (here / f"20newsgroups_bert_{loss_key}.yaml").write_text(
            SCHEMA_LINE + header + yaml.safe_dump(bert(loss_key), sort_keys=False)
        )
    for loss_key in LOSSES:
        for name, make in (("tinyimagenet_resnet50", tiny_imagenet), ("20newsgroups_textcnn", newsgroups),
                           ("agnews_textcnn", ag_news), ("finsen_textcnn", finsen),
                           ("sstbinary_textcnn", sst)):  # fmt: skip
            header = f"# {name} {loss_key}: generated by configs/make_presets.py (see its docstring)\n"
            (here / f"{name}_{loss_key}.yaml").write_text(
                SCHEMA_LINE + header + yaml.safe_dump(make(loss_key), sort_keys=False)
            )
    for dataset in ("cifar10", "cifar100"):
        for short, model in MODELS.items():
            for loss_key in LOSSES:
                path = here / f"{dataset}_{short}_{loss_key}.yaml"
                header = f"# {dataset} {model} {loss_key}: generated by configs/make_presets.py (see its docstring)\n"
                path.write_text(SCHEMA_LINE + header + yaml.safe_dump(preset(dataset, model, loss_key), sort_keys=False))


if __name__ == "__main__":
    main()
