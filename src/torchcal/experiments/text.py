"""Text classification data of the papers: 20 Newsgroups (bydate folders) and AG News (CSV), tokenised into
padded index sequences, with GloVe vectors for the global-pooling CNN (Mukhoti et al.'s 20 Newsgroups setup:
100-d GloVe, 1,000 tokens, 20,000 words)."""

from __future__ import annotations

import csv
import re
from collections import Counter
from pathlib import Path

import torch

from .dataset import Dataset
from .errors import DatasetError

__all__ = ["tokenize", "Vocabulary", "load_20newsgroups", "load_ag_news", "load_glove", "encode"]

_TOKEN = re.compile(r"[a-z0-9']+")


def tokenize(text: str) -> list[str]:
    """Lower-cased runs of letters, digits and apostrophes."""
    return _TOKEN.findall(text.lower())


class Vocabulary:
    """Index 0 is padding, 1 is unknown; then the ``max_words`` most frequent training words (ties by word)."""

    def __init__(self, texts, max_words: int = 20000):
        counts = Counter(tok for t in texts for tok in tokenize(t))
        words = sorted(counts, key=lambda w: (-counts[w], w))[:max_words]
        self.words = ["<pad>", "<unk>", *words]
        self.index = {w: i for i, w in enumerate(self.words)}

    def __len__(self) -> int:
        return len(self.words)


def encode(texts, vocab: Vocabulary, max_len: int = 1000) -> torch.Tensor:
    """(N, max_len) int64 token indices, truncated at max_len and padded with 0 at the end."""
    out = torch.zeros(len(texts), max_len, dtype=torch.long)
    for i, text in enumerate(texts):
        ids = [vocab.index.get(tok, 1) for tok in tokenize(text)][:max_len]
        if ids:
            out[i, : len(ids)] = torch.tensor(ids)
    return out


def load_glove(path: str | Path, vocab: Vocabulary, dim: int = 100) -> torch.Tensor:
    """(len(vocab), dim) embedding matrix from a GloVe text file (``word v1 ... v_dim`` per line); words
    without a vector get zeros (padding and unknown too)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"missing GloVe file {path}: put glove.6B.{dim}d.txt there (data.glove=<file>)")
    matrix = torch.zeros(len(vocab), dim)
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            word, *values = line.rstrip().split(" ")
            i = vocab.index.get(word)
            if i is not None:
                if len(values) != dim:
                    raise DatasetError(
                        f"{path}: the vector of {word!r} has {len(values)} values, expected {dim}"
                    )
                matrix[i] = torch.tensor([float(v) for v in values])
    return matrix


def _read_bydate(folder: Path) -> tuple[list[str], list[int], list[str]]:
    if not folder.is_dir():
        raise DatasetError(
            f"missing folder {folder}: put the 20news-bydate-train and 20news-bydate-test folders of 20 Newsgroups "
            "(one sub-folder per newsgroup, one file per message) under data.root"
        )
    categories = sorted(p.name for p in folder.iterdir() if p.is_dir())
    texts, labels = [], []
    for label, cat in enumerate(categories):
        for doc in sorted((folder / cat).iterdir()):
            texts.append(doc.read_text(encoding="latin-1"))
            labels.append(label)
    return texts, labels, categories


def load_20newsgroups(root: str | Path):
    """(train texts, train labels), (test texts, test labels) from the bydate folders; labels follow the sorted
    newsgroup names."""
    root = Path(root)
    tr_texts, tr_labels, cats = _read_bydate(root / "20news-bydate-train")
    te_texts, te_labels, te_cats = _read_bydate(root / "20news-bydate-test")
    if cats != te_cats:
        raise DatasetError(f"train and test newsgroups differ: {cats} vs {te_cats}")
    return (tr_texts, tr_labels), (te_texts, te_labels)


def _read_ag_csv(path: Path):
    if not path.is_file():
        raise DatasetError(f"missing file {path}: put AG News's train.csv and test.csv under data.root")
    texts, labels = [], []
    with open(path, newline="", encoding="utf-8") as fh:
        for row in csv.reader(fh):
            if len(row) < 3:
                raise DatasetError(f"{path}: rows must be class index (1-4), title, description; got {row}")
            labels.append(int(row[0]) - 1)
            texts.append(row[1] + " " + " ".join(row[2:]))
    return texts, labels


def load_ag_news(root: str | Path):
    """(train texts, labels), (test texts, labels) from AG News's train.csv / test.csv (classes 1-4 → 0-3)."""
    root = Path(root)
    return _read_ag_csv(root / "train.csv"), _read_ag_csv(root / "test.csv")


def text_splits(name: str, root: str, glove: str, max_words: int = 20000, max_len: int = 1000):
    """Encoded (train, test) Datasets and the GloVe embedding matrix for the vocabulary of the training texts."""
    loader = {"20newsgroups": load_20newsgroups, "ag_news": load_ag_news}[name]
    (tr_x, tr_y), (te_x, te_y) = loader(root)
    vocab = Vocabulary(tr_x, max_words)
    train = Dataset(encode(tr_x, vocab, max_len), torch.tensor(tr_y, dtype=torch.long))
    test = Dataset(encode(te_x, vocab, max_len), torch.tensor(te_y, dtype=torch.long))
    embeddings = load_glove(glove, vocab) if glove else None
    train.vocab_size = len(vocab)
    return train, test, embeddings
