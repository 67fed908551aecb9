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
Fig. 53: ResNet-110 on SVHN with CE, FLSD-53 and AdaFocal (``svhn()``). The margin and penalty losses (SPEC §8):
CIFAR-10/100 and Tiny-ImageNet ResNet-50 in each released repository's protocol, MbLS's where it states none
(``margin()``, decision 187). FCL's synthetic 2-D experiment (App. A.11, Fig. 7): two moons, the 2 x 10 MLP,
Adam, 500 epochs, CE / FL / FCL with γ = 10 and FCL's λ = 1.5 (``moons()``, decision 191).
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


SVHN_LOSSES = ("ce", "flsd53", "adafocal", "adafocal_schedule")  # AdaFocal Fig. 53
# AdaFocal-schedule (Fig. 53's caption): gamma updated after every epoch for the first 25 epochs, every 100
# mini-batches from epoch 25 to 40, every mini-batch from epoch 40 to the end
SVHN_SCHEDULE = [[25, 100], [40, 1]]
SVHN_HEADER = """\
# svhn resnet110 {loss}: generated by configs/make_presets.py (see svhn()).
# AdaFocal, Fig. 53 (appendix O.13): ResNet-110 trained on SVHN with CE, FLSD-53, AdaFocal, AdaFocal-schedule
# (gamma updated per epoch, every 100 batches from epoch 25, every batch from epoch 40: loss.update_schedule).
# The paper states the model, the losses and 50 epochs (the schedule ends at epoch 50) and nothing else for
# SVHN: optimiser, learning-rate schedule, batch size, validation split and augmentation are torchcal's
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
    cfg = preset("cifar10", "resnet110", "adafocal" if loss_key == "adafocal_schedule" else loss_key)
    if loss_key == "adafocal_schedule":
        cfg["loss"]["update_schedule"] = SVHN_SCHEDULE
    cfg["data"] = {"name": "svhn", "root": "data/svhn", "val_size": 5000, "split_seed": 1, "augment": False,
                   "loader": {"batch_size": 128}, "shift": {"name": ""}, "ood": {"sets": []}}  # fmt: skip
    cfg["optim"]["milestones"] = [25, 40]
    cfg["train"]["epochs"] = 50
    return cfg


# FCL's synthetic 2-D experiment (App. A.11, Fig. 7): "the same γ = 10" for focal loss and FCL, λ = 1.5
MOONS_LOSSES = {"ce": ("ce", {}), "fl": ("fl-10", {}), "fcl": ("fcl", {"gamma": 10.0, "lambda_": 1.5})}


def moons(loss_key):
    """The FCL paper's decision-boundary experiment (its appendix A.11, Fig. 7): scikit-learn's two moons with
    noise 0.2, a feed-forward network with two hidden layers of 10 units (``mlp`` of width 10), Adam, 500
    epochs, focal loss and FCL at γ = 10, FCL's λ = 1.5, cross entropy beside them. What the paper leaves
    unstated (decision 191): 1,000 training, 500 validation and 1,000 test points, batches of 32, Adam's
    default rate 1e-3 without weight decay, the batch mean, the last epoch's model."""
    name, kwargs = MOONS_LOSSES[loss_key]
    return {
        "data": {"name": "moons", "n_train": 1000, "val_size": 500, "n_test": 1000, "noise": 0.2, "seed": 0,
                 "loader": {"batch_size": 32}},
        "model": {"name": "mlp", "width": 10},
        "loss": {"name": name, "reduction": "mean", "kwargs": kwargs},
        "optim": {"name": "adam", "lr": 1e-3, "weight_decay": 0.0},
        "train": {"epochs": 500, "seed": 0, "device": "auto", "select": "last", "calibrators": PAPER_CALIBRATORS},
    }  # fmt: skip


# the margin and penalty losses (SPEC §8): each paper's CIFAR-10/100 and Tiny-ImageNet protocol, read from its
# released repository; where the repository states none for a dataset, MbLS's protocol (decision 187)
MBLS_SOURCE = "by-liu/MbLS README, configs/{defaults,optim/sgd,scheduler/multi_step,data/*}.yaml"
MBLS_CIFAR = {"batch": 128, "epochs": 200, "milestones": [150, 250], "clip": 2.0}  # one decay in 200 epochs
MBLS_TINY = {"batch": 64, "epochs": 100, "milestones": [40, 60], "clip": 2.0}
MDCA_SOURCE = "mdca-loss/MDCA-Calibration scripts/{cifar10,cifar100,imagenet}.sh, utils/argparser.py"
MDCA_PROTOCOL = {  # SGD lr 0.1, momentum 0.9, weight decay 5e-4 (argparser defaults); no gradient clipping
    "cifar10": {"batch": 128, "epochs": 160, "milestones": [80, 120], "clip": 0.0},
    "cifar100": {"batch": 128, "epochs": 200, "milestones": [100, 150], "clip": 0.0},
    "tiny_imagenet": {"batch": 64, "epochs": 100, "milestones": [40, 60], "clip": 0.0},
}
MARGIN_DATASETS = {
    "cifar10": "cifar10_resnet50",
    "cifar100": "cifar100_resnet50",
    "tiny_imagenet": "tinyimagenet_resnet50",
}
# key -> (registry name, kwargs, {dataset: protocol} or None for MbLS's, source, what the header adds)
MARGIN_LOSSES = {
    "mbls": ("mbls", {}, {"cifar10": MBLS_CIFAR, "tiny_imagenet": MBLS_TINY},
             MBLS_SOURCE + ", configs/loss/logit_margin.yaml (m = 10, alpha = 0.1)",
             "MbLS releases CIFAR-10 and Tiny-ImageNet settings (no CIFAR-100)."),
    "acls": ("acls", {}, {"tiny_imagenet": MBLS_TINY},
             "cvlab-yonsei/ACLS tools/run_tiny.sh, configs/{defaults,optim/sgd,scheduler/multi_step,"
             "data/tiny_imagenet,loss/acls}.yaml",
             "ACLS releases a Tiny-ImageNet setting only; its CIFAR presets use MbLS's protocol."),
    "cals": ("cals", {}, {"tiny_imagenet": {**MBLS_TINY, "batch": 128}},
             "by-liu/CALS README (TinyImageNet command: batch 128, lag.margin=10), configs/{train/dist_lag,"
             "optim/sgd,lr_scheduler/multi_step,lag/aug_lagrangian_class}.yaml",
             "CALS releases Tiny-ImageNet, ImageNet and VOC settings; its CIFAR presets use MbLS's protocol. "
             "Lambda and rho are updated on the validation set after every epoch."),
    "mdca": ("mdca", {}, MDCA_PROTOCOL, MDCA_SOURCE + " (--loss NLL+MDCA --beta 1.0)",
             "The scripts train ResNet-56 (not a runner model): ResNet-50 here."),
    "flmdca": ("focal-mdca", {}, MDCA_PROTOCOL, MDCA_SOURCE + " (--loss FL+MDCA --gamma 1.0 --beta 1.0)",
               "The scripts train ResNet-56 (not a runner model): ResNet-50 here."),
    "lsmdca": ("ls-mdca", {}, MDCA_PROTOCOL, MDCA_SOURCE + " (--loss LS+MDCA --alpha 0.1 --beta 1.0)",
               "The scripts train ResNet-56 (not a runner model): ResNet-50 here."),
    "dca": ("dca", {}, None, "FOURM-LAB/DCA loss_fn.py (beta = 10, its default), README, demo_dca.ipynb",
            "DCA releases only an AlexNet demo on Mendeley V2 chest X-rays; MDCA's comparison trains DCA "
            "with beta = 1."),
    "sbece": ("sb-ece", {}, None,
              "hee-suk-yoon/ESD script/sbece.sh (M = 15, T = 0.01, lambda = 2; the SB-ECE authors release "
              "no training script)", "ESD's script trains ResNet-18 on ImageNet-100 only."),
    "savuc": ("s-avuc", {}, None, "google/uncertainty-baselines experimental/caltrain (loss functions only)",
              "No training setting or T, kappa is released: torchcal's defaults (T = 0.1, kappa = 0.5)."),
    "avuc": ("avuc", {}, None,
             "IntelLabs/AVUC src/avuc_loss.py, src/main_bayesian_cifar_avu.py (beta = 3, threshold from "
             "validation entropies over epochs 0-5)",
             "AVUC trains only a Bayesian (SVI) ResNet-20 on CIFAR-10 (Adam, batch 107), which the runner "
             "does not train."),
    "esd": ("esd", {}, None, "hee-suk-yoon/ESD script/esd.sh, imagenet/main.py (lambda = 4)",
            "ESD's script trains ResNet-18 on ImageNet-100 only, with a separate 10 % calibration set; here "
            "ESD is taken on the training batch (holdout 0, decision 166)."),
    "maxsup": ("maxsup", {}, None,
               "ZhouYuxuanYX/Maximum-Suppression-Regularization Conv/common_resnet/train.py (alpha 0.1 -> 0.2 "
               "over the run)", "MaxSup releases ImageNet and long-tailed CIFAR-10 settings only."),
    "poly1": ("poly1", {}, None, "Leng et al. ICLR 2022, the paper's listing (epsilon = 1; no repository)",
              "No repository with a training setting exists."),
    "confpen": ("confidence-penalty", {}, None,
                "ENSTA-U2IS-AI/torch-uncertainty ConfidencePenaltyLoss (beta = 1); Pereyra et al. release no "
                "code", "No authors' training setting exists."),
}  # fmt: skip


def margin(dataset, loss_key):
    """A margin or penalty loss (SPEC §8) in its paper's protocol on CIFAR-10/100 (ResNet-50) or Tiny-ImageNet
    (ResNet-50): SGD lr 0.1, momentum 0.9, weight decay 5e-4, the batch-mean loss, 5,000 validation images
    (Tiny-ImageNet: 50 per class), the model of lowest validation error (the released trainers keep the best
    validation accuracy); batch, epochs, milestones and gradient clipping per ``MARGIN_LOSSES`` (MbLS's where
    the repository states none: CIFAR batch 128, 200 epochs, milestones [150, 250], Tiny-ImageNet batch 64, 100
    epochs, [40, 60], gradient norm clipped at 2)."""
    name, kwargs, protocols, _, _ = MARGIN_LOSSES[loss_key]
    default = MBLS_TINY if dataset == "tiny_imagenet" else MBLS_CIFAR
    p = (protocols or {}).get(dataset, default)
    cfg = preset("cifar100" if dataset == "tiny_imagenet" else dataset, "resnet50", "ce")
    if dataset == "tiny_imagenet":
        cfg["data"] = {"name": "tiny_imagenet", "root": "data", "augment": True, "loader": {}}
    cfg["data"]["loader"]["batch_size"] = p["batch"]
    cfg["loss"] = {"name": name, "reduction": "mean", "kwargs": dict(kwargs)}
    cfg["optim"].update({"milestones": list(p["milestones"]), "grad_clip_norm": p["clip"]})
    cfg["train"]["epochs"] = p["epochs"]
    cfg["train"]["select"] = "best_val_error"
    return cfg


def margin_header(dataset, loss_key):
    name, _, protocols, source, note = MARGIN_LOSSES[loss_key]
    own = dataset in (protocols or {})
    lines = [f"{MARGIN_DATASETS[dataset]} {loss_key}: generated by configs/make_presets.py (see margin()).",
             f"{name}: {source}."]  # fmt: skip
    lines.append("Training protocol: " + ("that repository's." if own else "MbLS's (" + MBLS_SOURCE + "; "
                                            "decision 187), the source states none for this dataset."))  # fmt: skip
    if note:
        lines.append(note)
    out = []
    for line in lines:  # wrapped at 110 columns
        words, cur = line.split(), "#"
        for w in words:
            if len(cur) + 1 + len(w) > 110:
                out.append(cur)
                cur = "#"
            cur += " " + w
        out.append(cur)
    return "\n".join(out) + "\n"


def main():
    here = Path(__file__).parent
    for dataset, stem in MARGIN_DATASETS.items():
        for loss_key in MARGIN_LOSSES:
            text = yaml.safe_dump(margin(dataset, loss_key), sort_keys=False)
            header = margin_header(dataset, loss_key)
            (here / f"{stem}_{loss_key}.yaml").write_text(SCHEMA_LINE + header + text)
    for dataset in ("cifar10", "cifar100"):
        for short, model in TABLE10_MODELS.items():
            for loss_key in TABLE10_LOSSES:
                header = TABLE10_HEADER.format(dataset=dataset, model=model, loss=TABLE10_LOSSES[loss_key][0])
                (here / f"{dataset}_{short}_{loss_key}.yaml").write_text(
                    SCHEMA_LINE + header + yaml.safe_dump(table10(dataset, model, loss_key), sort_keys=False)
                )
    for loss_key in MOONS_LOSSES:
        header = f"# moons_mlp {loss_key}: generated by configs/make_presets.py (see moons())\n"
        (here / f"moons_mlp_{loss_key}.yaml").write_text(
            SCHEMA_LINE + header + yaml.safe_dump(moons(loss_key), sort_keys=False)
        )
    for loss_key in SVHN_LOSSES:
        (here / f"svhn_resnet110_{loss_key}.yaml").write_text(
            SCHEMA_LINE
            + SVHN_HEADER.format(loss="adafocal-schedule" if loss_key == "adafocal_schedule" else LOSSES[loss_key][0])
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
