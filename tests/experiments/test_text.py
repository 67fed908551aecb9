"""Text readers on fixture files in their on-disk formats: 20 Newsgroups bydate folders, AG News CSV, GloVe."""

import pytest
import torch

from torchcal.experiments.config import load_config
from torchcal.experiments.data import DatasetError
from torchcal.experiments.text import (
    Vocabulary,
    encode,
    load_20newsgroups,
    load_ag_news,
    load_glove,
    tokenize,
)
from torchcal.experiments.train import train

GROUPS = {"comp.graphics": "pixels render shading polygon", "rec.autos": "engine wheels brakes torque",
          "sci.space": "orbit rocket launch moon"}  # fmt: skip


def write_20ng(root, per_group=12):
    for split, n in (("train", per_group), ("test", 3)):
        for group, words in GROUPS.items():
            folder = root / f"20news-bydate-{split}" / group
            folder.mkdir(parents=True)
            for i in range(n):
                (folder / str(50000 + i)).write_bytes(
                    f"From: x@y\nSubject: {i}\n\n{words} {i} caf\xe9\n".encode("latin-1")
                )


def write_glove(path, words, dim=100):
    lines = [f"{w} " + " ".join(f"{(i + j) / 100:.2f}" for j in range(dim)) for i, w in enumerate(words)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_tokenize_vocabulary_encode():
    assert tokenize("Don't PANIC, 42 times!") == ["don't", "panic", "42", "times"]
    vocab = Vocabulary(["b a b", "c b"], max_words=2)
    assert vocab.words == ["<pad>", "<unk>", "b", "a"]  # by frequency, ties by word
    assert encode(["a c b b"], vocab, max_len=3).tolist() == [[3, 1, 2]]
    assert encode([""], vocab, max_len=2).tolist() == [[0, 0]]


def test_20newsgroups_bydate(tmp_path):
    write_20ng(tmp_path)
    (tr_x, tr_y), (te_x, te_y) = load_20newsgroups(tmp_path)
    assert len(tr_x) == 36 and len(te_x) == 9
    assert sorted(set(tr_y)) == [0, 1, 2] and tr_y[0] == 0 and "pixels" in tr_x[0]
    with pytest.raises(DatasetError, match="20news-bydate-train"):
        load_20newsgroups(tmp_path / "nothing")


def test_ag_news_csv(tmp_path):
    (tmp_path / "train.csv").write_text(
        '"3","Wall St. Bears","Short-sellers, see green"\n"1","Title","Body"\n'
    )
    (tmp_path / "test.csv").write_text('"4","Space","Rocket"\n')
    (tr_x, tr_y), (te_x, te_y) = load_ag_news(tmp_path)
    assert tr_y == [2, 0] and te_y == [3] and tr_x[0] == "Wall St. Bears Short-sellers, see green"


def test_glove_matrix(tmp_path):
    vocab = Vocabulary(["orbit rocket zzz"])
    write_glove(tmp_path / "g.txt", ["rocket", "orbit", "other"])
    matrix = load_glove(tmp_path / "g.txt", vocab)
    assert matrix.shape == (len(vocab), 100)
    assert torch.allclose(matrix[vocab.index["rocket"]], torch.tensor([j / 100 for j in range(100)]))
    assert matrix[vocab.index["zzz"]].abs().sum() == 0 and matrix[0].abs().sum() == 0
    with pytest.raises(DatasetError, match="glove"):
        load_glove(tmp_path / "missing.txt", vocab)


def test_text_cnn_run(tmp_path):
    write_20ng(tmp_path / "data")
    write_glove(tmp_path / "glove.txt", [w for ws in GROUPS.values() for w in ws.split()])
    cfg = load_config(None, [f"data.root={tmp_path / 'data'}", "data.name=20newsgroups",
                             f"data.glove={tmp_path / 'glove.txt'}", "data.max_len=150", "data.shift=", "data.ood=",
                             "data.val_size=6", "data.batch_size=8", "model.name=text_cnn", "train.epochs=2",
                             "loss.name=flsd-53"])  # fmt: skip
    rows = train(cfg, tmp_path / "run")
    assert len(rows) == 2
    logits = torch.load(tmp_path / "run" / "logits.pt", weights_only=True)
    assert logits["test"]["logits"].shape == (9, 3)
    with pytest.raises(ValueError, match="text dataset"):
        train(load_config(None, [f"data.root={tmp_path / 'data'}", "data.name=20newsgroups", "model.name=text_cnn"]),
              tmp_path / "bad")  # fmt: skip
