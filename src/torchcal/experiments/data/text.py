"""Text classification data of the papers: 20 Newsgroups (the bydate folders, or the papers' split of the
20news-19997 folders), AG News (CSV) and FinSen (CSV), tokenised into padded index sequences, with GloVe vectors
for the global-pooling CNN (Mukhoti et al.'s 20 Newsgroups setup: 100-d GloVe, 1,000 tokens, 20,000 words)."""

from __future__ import annotations

import csv
import re
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from ..errors import DatasetError
from .dataset import Dataset

__all__ = [
    "tokenize",
    "Vocabulary",
    "load_20newsgroups",
    "load_20newsgroups_papers",
    "papers_20ng_split",
    "load_ag_news",
    "load_finsen",
    "load_sst",
    "parse_ptb_tree",
    "load_tokenizer",
    "encode_with_tokenizer",
    "load_glove",
    "encode",
]

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


PAPERS_20NG_VAL = 900  # validation documents of Mukhoti et al.'s split (also AdaFocal's, FCL's)


def papers_20ng_split(n: int, val: int = PAPERS_20NG_VAL) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(train, val, test) indices of the papers' 20 Newsgroups split of ``n`` documents (decision 71).

    The released code of Mukhoti et al. (``NewsGroup/ng_loader.py``, reused by AdaFocal and FCL) shuffles the
    documents with NumPy's legacy generator seeded with 1, takes the last ``int(0.2 n)`` as the test set and the
    ``val`` before them as the validation set; the 19,997 documents of 20news-19997 give 15,098 / 900 / 3,999.

    >>> [len(part) for part in papers_20ng_split(19997)]
    [15098, 900, 3999]
    """
    n_test = int(0.2 * n)
    if n - n_test - val < 1:
        raise DatasetError(
            f"the papers' 20 Newsgroups split needs more than {n_test + val} documents, got {n}"
        )
    order = np.random.RandomState(1).permutation(n)
    cut = n - n_test - val
    return order[:cut], order[cut : n - n_test], order[n - n_test :]


_19997_FOLDERS = (
    "20_newsgroups",
    "20_newsgroup",
)  # the tarball's name, the Keras example's (the papers' code)


def load_20newsgroups_papers(root: str | Path, val: int = PAPERS_20NG_VAL):
    """(train, val, test) (texts, labels) pairs in the papers' split of the 20news-19997 folders.

    ``root`` holds ``20_newsgroups/`` (as ``20news-19997.tar.gz`` unpacks; ``20_newsgroup/`` as the papers'
    code names it): one sub-folder per newsgroup, one file per message named by its number. As in the papers'
    code the groups and files are read in sorted order, files whose name is not a number are skipped, and a
    message's header (up to its first blank line) is dropped; labels follow the sorted newsgroup names.
    """
    root = Path(root)
    folder = next((root / f for f in _19997_FOLDERS if (root / f).is_dir()), None)
    if folder is None:
        raise DatasetError(
            f"missing folder {root / _19997_FOLDERS[0]}: unpack 20news-19997.tar.gz under data.root (one "
            "sub-folder per newsgroup, one file per message); data.name=20newsgroups reads the bydate folders"
        )
    texts, labels = [], []
    groups = sorted(p.name for p in folder.iterdir() if p.is_dir())
    for label, group in enumerate(groups):
        for doc in sorted((folder / group).iterdir(), key=lambda p: p.name):
            if not doc.name.isdigit():
                continue
            text = doc.read_text(encoding="latin-1")
            header_end = text.find("\n\n")
            texts.append(text[header_end:] if header_end > 0 else text)
            labels.append(label)
    parts = papers_20ng_split(len(texts), val)
    return tuple(([texts[i] for i in idx], [labels[i] for i in idx]) for idx in parts)


def load_finsen(root: str | Path):
    """(train, val, test) (texts, labels) pairs of FinSen (Liang et al. 2024), from ``finsen.csv`` under
    ``root``: a header row naming at least ``Content`` (the text) and ``Category`` (the class); labels follow the
    sorted category names (surrounding spaces removed). The split is the one of the dataset's released loader:
    70 / 15 / 15 %, scikit-learn's ``train_test_split`` with ``random_state=42`` twice (decision 72)."""
    from sklearn.model_selection import train_test_split

    path = Path(root) / "finsen.csv"
    if not path.is_file():
        raise DatasetError(
            f"missing file {path}: put FinSen's finsen.csv (columns Content, Category) under data.root"
        )
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        missing = {"Content", "Category"} - set(reader.fieldnames or ())
        if missing:
            raise DatasetError(
                f"{path}: the header must name Content and Category; missing {sorted(missing)}"
            )
        rows = [(row["Content"] or "", (row["Category"] or "").strip()) for row in reader]
    if len(rows) < 7:
        raise DatasetError(f"{path}: {len(rows)} articles; the 70/15/15 split needs at least 7")
    names = sorted({c for _, c in rows})
    if "" in names:
        raise DatasetError(f"{path}: an article has an empty Category")
    index = {c: i for i, c in enumerate(names)}
    texts, labels = [t for t, _ in rows], [index[c] for _, c in rows]
    train_idx, rest = train_test_split(np.arange(len(rows)), test_size=0.3, random_state=42)
    val_idx, test_idx = train_test_split(rest, test_size=0.5, random_state=42)
    return tuple(
        ([texts[i] for i in idx], [labels[i] for i in idx]) for idx in (train_idx, val_idx, test_idx)
    )


def _read_ag_csv(path: Path):
    if not path.is_file():
        raise DatasetError(f"missing file {path}: put AG News's train.csv and test.csv under data.root")
    texts, labels = [], []
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        for row in reader:
            if len(row) < 3:
                raise DatasetError(
                    f"{path}, line {reader.line_num}: rows must be class index (1-4), title, description; "
                    f"got {row}"
                )
            label = row[0].strip()
            if label not in AG_NEWS_CLASSES:
                raise DatasetError(
                    f"{path}, line {reader.line_num}: the class index must be 1, 2, 3 or 4 (AG News's World, "
                    f"Sports, Business, Sci/Tech), got {row[0]!r}"
                )
            labels.append(int(label) - 1)
            texts.append(row[1] + " " + " ".join(row[2:]))
    return texts, labels


AG_NEWS_CLASSES = ("1", "2", "3", "4")


def load_ag_news(root: str | Path):
    """(train texts, labels), (test texts, labels) from AG News's train.csv / test.csv (classes 1-4 → 0-3)."""
    root = Path(root)
    return _read_ag_csv(root / "train.csv"), _read_ag_csv(root / "test.csv")


_PTB_LEAF = re.compile(r"\(\d ([^()\s]+)\)")
_PTB_ESCAPES = {"-LRB-": "(", "-RRB-": ")", "-LSB-": "[", "-RSB-": "]", "-LCB-": "{", "-RCB-": "}"}


def parse_ptb_tree(line: str) -> tuple[int, str]:
    """(root sentiment 0-4, sentence) of one Stanford Sentiment Treebank line in PTB form, e.g.
    ``(3 (2 It) (4 (4 works) (2 .)))`` -> (3, "It works .") (the leaves in order, brackets unescaped).

    >>> parse_ptb_tree("(3 (2 It) (4 (4 works) (2 .)))")
    (3, 'It works .')
    """
    line = line.strip()
    if not (line.startswith("(") and line.endswith(")")) or len(line) < 4 or not line[1].isdigit():
        raise ValueError(f"not a PTB sentiment tree: {line[:60]!r}")
    leaves: list[str] = _PTB_LEAF.findall(line)
    words = [_PTB_ESCAPES.get(w, w) for w in leaves]
    if not words or line.count("(") != line.count(")"):
        raise ValueError(f"not a PTB sentiment tree: {line[:60]!r}")
    return int(line[1]), " ".join(words)


_SST_FILES = ("train.txt", "dev.txt", "test.txt")


def load_sst(root: str | Path, binary: bool):
    """(train, val, test) (texts, labels) of the Stanford Sentiment Treebank from the PTB tree files of
    ``trainDevTestTrees_PTB.zip`` (``trees/train.txt``, ``dev.txt``, ``test.txt`` under ``root``, or the
    three files in ``root`` itself). A sentence is the leaves of its tree and its label the root's.
    ``binary``: the papers' SST Binary, neutral sentences (2) dropped, 0-1 negative, 3-4 positive
    (6,920 / 872 / 1,821 sentences); otherwise the five fine-grained classes (8,544 / 1,101 / 2,210)."""
    root = Path(root)
    folder = root / "trees" if (root / "trees" / "train.txt").is_file() else root
    parts = []
    for name in _SST_FILES:
        path = folder / name
        if not path.is_file():
            raise DatasetError(
                f"missing file {root / 'trees' / name}: unzip the Stanford Sentiment Treebank's "
                "trainDevTestTrees_PTB.zip under data.root (trees/train.txt, dev.txt, test.txt)"
            )
        texts, labels = [], []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                label, text = parse_ptb_tree(line)
            except ValueError as err:
                raise DatasetError(f"{path}, line {number}: {err}") from None
            if label > 4:
                raise DatasetError(f"{path}, line {number}: the root sentiment must be 0-4, got {label}")
            if binary:
                if label == 2:
                    continue
                label = int(label > 2)
            texts.append(text)
            labels.append(label)
        parts.append((texts, labels))
    return tuple(parts)


TEXT_LOADERS = {
    "20newsgroups": load_20newsgroups,
    "20newsgroups_papers": load_20newsgroups_papers,
    "ag_news": load_ag_news,
    "finsen": load_finsen,
    "sst_binary": lambda root: load_sst(root, binary=True),
    "sst_fine": lambda root: load_sst(root, binary=False),
}


# A tokenizer's vocabulary on disk: the fast tokenizer's one file, WordPiece's, BPE's pair, or SentencePiece's.
_TOKENIZER_FILES_TEXT = (
    "tokenizer.json, or vocab.txt (WordPiece, BERT), or vocab.json and merges.txt (BPE, RoBERTa/GPT-2), or a "
    "SentencePiece *.model file, beside tokenizer_config.json"
)


def _has_tokenizer_files(path: Path) -> bool:
    if (path / "tokenizer.json").is_file() or (path / "vocab.txt").is_file():
        return True
    if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
        return True
    return any(p.is_file() for p in path.glob("*.model"))


def _embedding_rows(path: Path) -> int | None:
    """The model's vocabulary size (rows of its token embedding) from config.json, or None if it has none."""
    import json

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for part in (config, config.get("text_config") or {}):
        value = part.get("vocab_size") if isinstance(part, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def load_tokenizer(checkpoint: str | Path):
    """The tokenizer of a local Hugging Face checkpoint folder (nothing is downloaded).

    A folder without tokenizer files (tokenizer.json, vocab.txt, vocab.json and merges.txt, or a
    SentencePiece ``*.model``) is a :class:`ConfigError`: transformers then
    builds an empty tokenizer of a few special tokens that maps every word to [UNK] (a run at chance level).
    So is a tokenizer whose vocabulary does not fit the model's token embedding (``vocab_size`` in
    config.json): more tokens than embedding rows, or fewer than half of them (another model's tokenizer;
    checkpoints pad their embedding by a few per cent at most)."""
    from ..errors import ConfigError

    path = Path(checkpoint)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.checkpoint={str(checkpoint)!r}: {_CHECKPOINT_HELP}")
    if not _has_tokenizer_files(path):
        raise ConfigError(
            f"model.checkpoint={str(checkpoint)!r} holds no tokenizer files (a tokenizer needs "
            f"{_TOKENIZER_FILES_TEXT}): copy the model's tokenizer files into {path}"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(
            "model.name=transformer needs Hugging Face transformers: pip install 'torchcal[huggingface]'"
        ) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"model.checkpoint={str(checkpoint)!r} has no usable tokenizer files: {first}"
        ) from None
    rows, tokens = _embedding_rows(path), len(tokenizer)
    if rows is not None and not rows / 2 <= tokens <= rows:
        why = "more tokens than" if tokens > rows else "fewer than half the"
        raise ConfigError(
            f"model.checkpoint={str(checkpoint)!r}: its tokenizer has {tokens} tokens, {why} {rows} rows of the "
            f"model's token embedding (vocab_size in config.json), so it is not this model's tokenizer: copy "
            f"the model's own tokenizer files ({_TOKENIZER_FILES_TEXT}) into {path}"
        )
    return tokenizer


_CHECKPOINT_HELP = (
    "not a Hugging Face checkpoint folder (config.json, model.safetensors or pytorch_model.bin, and the "
    "tokenizer files): on a machine with internet, `huggingface-cli download bert-base-uncased --local-dir "
    "<folder>` (or `save_pretrained(<folder>)`), then point model.checkpoint at that folder"
)


def encode_with_tokenizer(texts, tokenizer, max_len: int) -> torch.Tensor:
    """(N, 2, L) int64: token ids and attention mask from the checkpoint's own tokenizer, truncated at
    ``max_len`` and padded to the longest document of the set (L <= max_len); the model trims every batch to
    its own longest document (dynamic padding), so the padding goes at the end of each document whatever the
    tokenizer's ``padding_side`` (a tokenizer that pads on the left would lose the tokens of short documents
    to the trim)."""
    side = getattr(tokenizer, "padding_side", "right")
    tokenizer.padding_side = "right"
    try:
        enc = tokenizer(
            list(texts), truncation=True, max_length=max_len, padding="longest", return_tensors="pt"
        )
    finally:
        tokenizer.padding_side = side
    return torch.stack([enc["input_ids"].long(), enc["attention_mask"].long()], dim=1)


def text_splits(
    name: str,
    root: str,
    glove: str,
    max_words: int = 20000,
    max_len: int = 1000,
    eval_max_len: int = 0,
    tokenizer=None,
):
    """Encoded train, validation and test Datasets and the GloVe embedding matrix for the vocabulary of the
    training texts; the validation set is None where the dataset has no fixed one (the runner splits it off
    the training set). The training texts are cut at ``max_len`` tokens, the others at ``eval_max_len`` (0:
    ``max_len``). With a Hugging Face ``tokenizer`` the inputs are (N, 2, L) ids and masks of its tokens and
    there is no vocabulary or GloVe matrix."""
    parts = TEXT_LOADERS[name](root)
    lengths = [max_len] + [eval_max_len or max_len] * (len(parts) - 1)
    if tokenizer is not None:
        if glove:
            raise ValueError("data.glove applies to text_cnn; a transformer uses its checkpoint's embeddings")
        encoded = [
            Dataset(encode_with_tokenizer(x, tokenizer, n), torch.tensor(y, dtype=torch.long))
            for (x, y), n in zip(parts, lengths)
        ]
        embeddings, vocab_size = None, None
    else:
        vocab = Vocabulary(parts[0][0], max_words)
        encoded = [
            Dataset(encode(x, vocab, n), torch.tensor(y, dtype=torch.long))
            for (x, y), n in zip(parts, lengths)
        ]
        embeddings = load_glove(glove, vocab) if glove else None
        vocab_size = len(vocab)
    train, test = encoded[0], encoded[-1]
    val = encoded[1] if len(encoded) == 3 else None
    train.vocab_size = vocab_size
    return train, val, test, embeddings
