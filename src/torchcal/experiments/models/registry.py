"""Model registry of the runner: the demo models and the papers' CIFAR models (SPEC §5)."""

from __future__ import annotations

import torch
from torch import nn

from .cifar import (
    BasicBlock,
    Bottleneck,
    CifarDenseNet,
    CifarResNet,
    DenseNet,
    StochasticDepthResNet,
    WideResNet,
)

__all__ = ["create_model", "list_models"]


def _mlp(num_classes: int, in_shape, width: int, stats=None) -> nn.Module:
    size = 1
    for d in in_shape:
        size *= d
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(size, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, num_classes),
    )


def _small_cnn(num_classes: int, in_shape, width: int, stats=None) -> nn.Module:
    c, h, w_in = in_shape
    w = max(8, width // 8)
    return nn.Sequential(
        nn.Conv2d(c, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * w * (h // 4) * (w_in // 4), width), nn.ReLU(), nn.Linear(width, num_classes),
    )  # fmt: skip


# The image models take images of any channel count: 3-channel images are normalised with the papers'
# constants, others with the training data's own ``stats`` (cifar_models.input_norm).
def _resnet50(num_classes, in_shape, width, stats=None):
    return CifarResNet(Bottleneck, (3, 4, 6, 3), num_classes, in_channels=in_shape[0], stats=stats)


def _resnet110(num_classes, in_shape, width, stats=None):
    return CifarResNet(Bottleneck, (3, 4, 26, 3), num_classes, in_channels=in_shape[0], stats=stats)


def _resnet110_he(num_classes, in_shape, width, stats=None):
    return CifarResNet(
        BasicBlock, (18, 18, 18), num_classes, widths=(16, 32, 64), in_channels=in_shape[0], stats=stats
    )


class TextCNN(nn.Module):
    """Mukhoti et al.'s global-pooling CNN for 20 Newsgroups: 100-d embeddings (GloVe when given, frozen),
    three Conv1d(128, 5) + ReLU, max-pools of 5 after the first two, global max pool, 128-unit dense layer."""

    def __init__(self, num_classes, vocab_size, embeddings=None, dim=100, width=128):
        super().__init__()
        if embeddings is not None:
            self.embed = nn.Embedding.from_pretrained(embeddings, freeze=True, padding_idx=0)
            dim = embeddings.shape[1]
        else:
            self.embed = nn.Embedding(vocab_size, dim, padding_idx=0)
        self.convs = nn.Sequential(
            nn.Conv1d(dim, width, 5), nn.ReLU(), nn.MaxPool1d(5), nn.Conv1d(width, width, 5), nn.ReLU(),
            nn.MaxPool1d(5), nn.Conv1d(width, width, 5), nn.ReLU(),
        )  # fmt: skip
        self.head = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, num_classes))

    def forward(self, tokens):
        x = self.convs(self.embed(tokens).transpose(1, 2))
        return self.head(x.amax(dim=2))


def _text_cnn(
    num_classes, in_shape, width, embeddings: torch.Tensor | None = None, vocab_size: int | None = None
):
    if not vocab_size:  # the vocabulary's size: given, or the rows of its embedding matrix
        if embeddings is None:
            raise ValueError(
                "text_cnn needs the vocabulary: train it on a text dataset (20newsgroups, "
                "20newsgroups_papers, ag_news, finsen)"
            )
        vocab_size = int(embeddings.shape[0])
    if in_shape[0] < 149:  # three convolutions of 5 and two max-pools of 5 need 149 tokens
        raise ValueError(f"text_cnn needs data.max_len >= 149, got {in_shape[0]}")
    return TextCNN(num_classes, vocab_size, embeddings)


class TransformerClassifier(nn.Module):
    """A Hugging Face sequence-classification model from a local checkpoint folder, fed the runner's (B, 2, L)
    token ids and attention masks; each batch is cut to its longest document (dynamic padding)."""

    def __init__(self, checkpoint: str, num_classes: int):
        super().__init__()
        from pathlib import Path

        path = Path(checkpoint)
        if not (path / "config.json").is_file():
            from ..data.text import _CHECKPOINT_HELP

            raise ValueError(f"model.checkpoint={checkpoint!r}: {_CHECKPOINT_HELP}")
        try:
            from transformers import AutoModelForSequenceClassification
            from transformers.utils import logging as hf_logging
        except ImportError:
            raise ValueError(
                "model.name=transformer needs Hugging Face transformers: pip install 'torchcal[huggingface]'"
            ) from None
        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()  # the expected "newly initialised classifier" notice
        hf_logging.disable_progress_bar()
        try:
            self.hf, info = AutoModelForSequenceClassification.from_pretrained(
                str(path), num_labels=num_classes, local_files_only=True, ignore_mismatched_sizes=True,
                output_loading_info=True,
            )  # fmt: skip
        except OSError as err:
            first = str(err).strip().splitlines()[0]
            raise ValueError(f"model.checkpoint={checkpoint!r} cannot be loaded: {first}") from None
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
        # a checkpoint without a classification head (a pre-trained body) gets a new one, as expected; a head
        # of another size is replaced too, and that is said
        old = sorted(
            (tuple(entry[1]), tuple(entry[2])) for entry in info.get("mismatched_keys", ()) if len(entry) == 3
        )
        if old:
            old_labels = old[0][0][0]  # the bias (K_old,) sorts before the weight (K_old, hidden)
            import warnings

            warnings.warn(
                f"model.checkpoint={checkpoint!r} has a classification head for {old_labels} labels; the dataset "
                f"has {num_classes}: that head is replaced by a new, randomly initialised one",
                UserWarning,
                stacklevel=2,
            )

    def forward(self, x):
        if x.ndim != 3 or x.shape[1] != 2:
            raise ValueError(f"a transformer takes (B, 2, L) token ids and masks, got shape {tuple(x.shape)}")
        ids, mask = x[:, 0], x[:, 1]
        length = int(mask.sum(1).max())  # dynamic padding (one host sync per batch)
        return self.hf(input_ids=ids[:, :length], attention_mask=mask[:, :length]).logits


_MODELS = {
    "mlp": (_mlp, "two hidden ReLU layers of `width` units"),
    "small_cnn": (_small_cnn, "two conv + pool blocks and a `width`-unit head"),
    "resnet50": (_resnet50, "CIFAR ResNet-50: bottleneck blocks (3, 4, 6, 3), 3 x 3 stem"),
    "resnet110": (_resnet110, "the papers' 'ResNet-110': bottleneck blocks (3, 4, 26, 3) at ImageNet widths"),
    "resnet110_he": (_resnet110_he, "He et al.'s CIFAR ResNet-110: basic blocks 3 x 18, widths 16/32/64"),
    "resnet110_sd": (
        lambda k, s, w, stats=None: StochasticDepthResNet((18, 18, 18), k, in_channels=s[0], stats=stats),
        "resnet110_he with stochastic depth: survival 1 -> 0.5 linearly over the 54 blocks (Huang et al. 2016)",
    ),
    "wrn_26_10": (
        lambda k, s, w, stats=None: WideResNet(26, 10, k, in_channels=s[0], stats=stats),
        "WRN-26-10 without dropout",
    ),
    "densenet121": (
        lambda k, s, w, stats=None: DenseNet((6, 12, 24, 16), 32, k, in_channels=s[0], stats=stats),
        "DenseNet-121 (growth 32) for CIFAR",
    ),
    "densenet40": (
        lambda k, s, w, stats=None: CifarDenseNet(40, 12, k, in_channels=s[0], stats=stats),
        "DenseNet-40 (growth 12): 3 blocks of 12 BN-ReLU-conv 3 x 3 layers, no bottleneck or compression",
    ),
    "resnet50_imagenet": (
        lambda k, s, w, stats=None: CifarResNet(
            Bottleneck, (3, 4, 6, 3), k, in_channels=s[0], stem="imagenet", stats=stats
        ),
        "ResNet-50 with the ImageNet stem, 224 x 224 inputs (the papers' ImageNet runs)",
    ),
    "densenet121_imagenet": (
        lambda k, s, w, stats=None: DenseNet(
            (6, 12, 24, 16), 32, k, stem="imagenet", in_channels=s[0], stats=stats
        ),
        "DenseNet-121 with the ImageNet stem, 224 x 224 inputs (CheXNet)",
    ),
    "text_cnn": (_text_cnn, "global-pooling CNN over (GloVe) word embeddings, for text datasets"),
    "transformer": (
        None,
        "a Hugging Face sequence classifier from the local folder model.checkpoint (BERT, ...)",
    ),
}


class TenCrop(nn.Module):
    """Ten-crop evaluation (CheXNet): in eval mode an input larger than ``crop`` is cut into its four corner
    and centre crops and their mirror images; the ten outputs' probabilities (sigmoid for ``multilabel``,
    else softmax) are averaged and returned as logits of the average (log-odds / log-probabilities, clamped
    at 1e-7 from 0 and 1). In training mode, or for inputs of the crop size, the model runs as it is."""

    def __init__(self, model: nn.Module, crop: int, multilabel: bool):
        super().__init__()
        self.model, self.crop, self.multilabel = model, crop, multilabel

    def forward(self, x):
        h, w = x.shape[-2:]
        c = self.crop
        if self.training or (h, w) == (c, c):
            return self.model(x)
        tops = [(0, 0), (0, w - c), (h - c, 0), (h - c, w - c), ((h - c) // 2, (w - c) // 2)]
        crops = [x[..., t : t + c, l : l + c] for t, l in tops]
        crops += [v.flip(-1) for v in crops]
        outs = [self.model(v).float() for v in crops]
        if self.multilabel:
            p = torch.stack([torch.sigmoid(o) for o in outs]).mean(0).clamp(1e-7, 1 - 1e-7)
            return torch.log(p) - torch.log1p(-p)
        p = torch.stack([torch.softmax(o, 1) for o in outs]).mean(0)
        return torch.log(p.clamp(min=1e-7))


def list_models() -> dict[str, str]:
    return {k: v[1] for k, v in _MODELS.items()}


def create_model(name: str, num_classes: int, in_shape, width: int = 256, **extra) -> nn.Module:
    """A model by registry name; ``extra`` carries data-dependent pieces (``embeddings``, ``vocab_size`` of
    text models; ``stats``, the training images' per-channel (mean, std), of image models)."""
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; available: {sorted(_MODELS)}")
    if name == "text_cnn":
        return _text_cnn(num_classes, tuple(in_shape), width, **extra)
    if name == "transformer":
        return TransformerClassifier(extra["checkpoint"], num_classes)
    return _MODELS[name][0](num_classes, tuple(in_shape), width, stats=extra.get("stats"))
