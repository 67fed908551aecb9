"""Text readers on fixture files in their on-disk formats: 20 Newsgroups bydate and 20news-19997 folders,
AG News CSV, FinSen CSV, GloVe."""

import csv

import numpy as np
import pytest
import torch

from torchcal.experiments.config import load_config
from torchcal.experiments.data.readers import DatasetError
from torchcal.experiments.data.text import (
    Vocabulary,
    encode,
    load_20newsgroups,
    load_20newsgroups_papers,
    load_ag_news,
    load_finsen,
    load_glove,
    papers_20ng_split,
    tokenize,
)
from torchcal.experiments.training.loop import train

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
                             f"data.glove={tmp_path / 'glove.txt'}", "data.max_len=150",
                             "data.val_size=6", "data.loader.batch_size=8", "model.name=text_cnn", "train.epochs=2",
                             "loss.name=flsd-53"])  # fmt: skip
    rows = train(cfg, tmp_path / "run")
    assert len(rows) == 2
    logits = torch.load(tmp_path / "run" / "logits.pt", weights_only=True)
    assert logits["test"]["logits"].shape == (9, 3)
    with pytest.raises(ValueError, match="text dataset"):
        train(load_config(None, [f"data.root={tmp_path / 'data'}", "data.name=20newsgroups", "data.ood=digits",
                                 "model.name=text_cnn"]), tmp_path / "bad")  # fmt: skip


def test_text_datasets_default_to_no_shift_or_ood_set(tmp_path):
    """The shift and OOD sets are image sets: a text dataset's config has no such keys (naming one is refused);
    the text_cnn's shortest document length is checked by name at config time."""
    from torchcal.experiments.config import ConfigError

    cfg = load_config(None, ["data.name=ag_news", "model.name=text_cnn"])
    assert not hasattr(cfg.data, "shift") and not hasattr(cfg.data, "ood")
    (tmp_path / "run.yaml").write_text("data: {name: sst_fine, shift: gaussian_noise}\n")
    with pytest.raises(ConfigError, match="is a text dataset"):
        load_config(tmp_path / "run.yaml")
    image = load_config(None, ["data.name=fashion_mnist"])
    assert (image.data.shift.name, image.data.ood.sets) == ("gaussian_noise", ["digits"])  # image sets keep theirs
    with pytest.raises(ConfigError, match=r"model.name=text_cnn needs data.max_len >= 149 tokens .*got 100"):
        load_config(None, ["data.name=ag_news", "model.name=text_cnn", "data.max_len=100"])
    with pytest.raises(ConfigError, match=r"needs data.eval_max_len >= 149 tokens .*got 148"):
        load_config(None, ["data.name=ag_news", "model.name=text_cnn", "data.eval_max_len=148"])


def test_text_cnn_without_a_vocabulary_is_refused_by_name():
    # an empty vocabulary size with no embedding matrix once fell through to embeddings.shape (AttributeError)
    from torchcal.experiments.models import create_model

    for extra in ({}, {"vocab_size": 0}):
        with pytest.raises(ValueError, match="text_cnn needs the vocabulary"):
            create_model("text_cnn", 4, (200,), **extra)
    embeddings = torch.zeros(7, 100)
    assert create_model("text_cnn", 4, (200,), embeddings=embeddings).embed.num_embeddings == 7
    assert create_model("text_cnn", 4, (200,), vocab_size=9).embed.num_embeddings == 9
@pytest.mark.parametrize("split,bad", [("train", "0"), ("test", "5")])
def test_ag_news_class_outside_1_to_4_is_refused_before_anything_is_written(tmp_path, split, bad):
    """A class 0 once crashed inside the loss (exit 1, a run folder left); a class 5 silently trained a
    5-class model. Both are refused at load time in one line naming the file and line, exit 2."""
    from typer.testing import CliRunner

    from torchcal.experiments.cli import app

    rows = {
        "train": ['"3","A","a"', '"1","B","b"', '"2","C","c"', '"4","D","d"'],
        "test": ['"4","E","e"', '"1","F","f"'],
    }
    rows[split][1] = f'"{bad}","X","x"'
    for name, lines in rows.items():
        (tmp_path / f"{name}.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match=rf"{split}.csv, line 2: the class index must be 1, 2, 3 or 4"):
        load_ag_news(tmp_path)
    result = CliRunner().invoke(app, ["train", "-o", str(tmp_path / "run"), "data.name=ag_news",
                                      f"data.root={tmp_path}", "model.name=text_cnn", "data.max_len=150",
                                      "data.val_size=1", "train.epochs=1"])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert f"{split}.csv, line 2: the class index must be 1, 2, 3 or 4" in result.output
    assert not (tmp_path / "run").exists()


def write_19997(root, per_group=400, folder="20_newsgroups"):
    """The 20news-19997 layout: <folder>/<group>/<message number>, headers up to the first blank line."""
    for group, words in GROUPS.items():
        (root / folder / group).mkdir(parents=True)
        for i in range(per_group):
            (root / folder / group / str(51000 + i)).write_bytes(
                f"Newsgroups: {group}\nPath: x\n\n{words} doc{i} caf\xe9\n".encode("latin-1")
            )
        (root / folder / group / "README.txt").write_text("not a message")  # skipped: not a number


def test_papers_20ng_split_is_the_papers_code():
    """The released loader's procedure, written out literally: seed NumPy's global generator with 1, shuffle
    the indices in place, last int(0.2 n) = test, the 900 before = validation, the rest = train."""
    n = 19997
    state = np.random.get_state()  # noqa: NPY002 (the papers' code, literally)
    try:
        indices = np.arange(n)
        np.random.seed(1)  # noqa: NPY002
        np.random.shuffle(indices)  # noqa: NPY002
    finally:
        np.random.set_state(state)  # noqa: NPY002
    n_test = int(0.2 * n)
    train, val, test = papers_20ng_split(n)
    assert (len(train), len(val), len(test)) == (15098, 900, 3999)  # the papers' sizes
    assert np.array_equal(train, indices[: -(n_test + 900)])
    assert np.array_equal(val, indices[n - n_test - 900 : n - n_test])
    assert np.array_equal(test, indices[-n_test:])
    with pytest.raises(DatasetError, match="more than 1120 documents, got 1100"):
        papers_20ng_split(1100)


def test_20newsgroups_papers_reader(tmp_path):
    write_19997(tmp_path, per_group=400)
    (tr_x, tr_y), (va_x, va_y), (te_x, te_y) = load_20newsgroups_papers(tmp_path)
    assert (len(tr_x), len(va_x), len(te_x)) == (60, 900, 240)
    # every message once, headers dropped (the text starts at the blank line, as in the papers' code)
    assert sorted(tr_x + va_x + te_x) == sorted(
        f"\n\n{w} doc{i} caf\xe9\n" for w in GROUPS.values() for i in range(400)
    )
    labels = {w: k for k, w in enumerate(GROUPS.values())}  # GROUPS is in sorted order
    for x, y in zip(tr_x + va_x + te_x, tr_y + va_y + te_y):
        assert labels[x.split(" doc")[0].strip()] == y
    order = np.random.RandomState(1).permutation(1200)  # document k = group k // 400, message k % 400
    assert te_x[0] == f"\n\n{list(GROUPS.values())[order[-240] // 400]} doc{order[-240] % 400} caf\xe9\n"
    with pytest.raises(DatasetError, match="20news-19997.tar.gz"):
        load_20newsgroups_papers(tmp_path / "nothing")
    write_19997(tmp_path / "keras", per_group=400, folder="20_newsgroup")  # the papers' code's folder name
    assert load_20newsgroups_papers(tmp_path / "keras")[2][0] == te_x


def write_finsen(path, n=40):
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["Country", "Title", "Content", "Category", "Time"])
        for i in range(n):
            cat = [" Stock Market ", "Economy", "Bonds"][i % 3]
            w.writerow(["US", f"t{i}", f"article {i}, about {cat.strip().lower()}", cat, "2024-01-01"])


def test_finsen_reader(tmp_path):
    from sklearn.model_selection import train_test_split

    write_finsen(tmp_path / "finsen.csv", n=40)
    (tr_x, tr_y), (va_x, va_y), (te_x, te_y) = load_finsen(tmp_path)
    # the released loader: 30 % held out with random_state 42, then halved with random_state 42
    tr_idx, rest = train_test_split(list(range(40)), test_size=0.3, random_state=42)
    va_idx, te_idx = train_test_split(rest, test_size=0.5, random_state=42)
    assert tr_x == [f"article {i}, about {['stock market', 'economy', 'bonds'][i % 3]}" for i in tr_idx]
    assert va_x[0] == f"article {va_idx[0]}, about {['stock market', 'economy', 'bonds'][va_idx[0] % 3]}"
    assert (len(tr_x), len(va_x), len(te_x)) == (28, 6, 6)
    names = ["Bonds", "Economy", "Stock Market"]  # sorted, stripped: LabelEncoder's order
    for i, y in zip(te_idx, te_y):
        assert names[y] == ["Stock Market", "Economy", "Bonds"][i % 3]
    with pytest.raises(DatasetError, match="finsen.csv"):
        load_finsen(tmp_path / "nothing")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "finsen.csv").write_text("Title,Text\na,b\n")
    with pytest.raises(DatasetError, match=r"missing \['Category', 'Content'\]"):
        load_finsen(tmp_path / "bad")


@pytest.mark.parametrize("dataset", ["20newsgroups_papers", "finsen"])
def test_fixed_split_text_runs(tmp_path, dataset):
    if dataset == "finsen":
        (tmp_path / "data").mkdir()
        write_finsen(tmp_path / "data" / "finsen.csv", n=60)
        n_val, n_test = 9, 9
    else:
        write_19997(tmp_path / "data", per_group=400)
        n_val, n_test = 900, 240
    cfg = load_config(None, [f"data.root={tmp_path / 'data'}", f"data.name={dataset}", "data.max_len=150",
                             "data.loader.batch_size=32", "data.loader.eval_batch_size=2000",
                             "model.name=text_cnn", "train.epochs=1", "train.calibrators=[]"])  # fmt: skip
    with pytest.warns(UserWarning, match="data.val_size=5000 adjusted"):
        train(cfg, tmp_path / "run")
    logits = torch.load(tmp_path / "run" / "logits.pt", weights_only=True)
    assert logits["val"]["logits"].shape[0] == n_val and logits["test"]["logits"].shape[0] == n_test
    import yaml

    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["data"]["val_size"] == n_val and saved["meta"]["adjusted"]["data.val_size"]["used"] == n_val


SST_LINES = {
    "train.txt": ["(3 (2 It) (4 (4 works) (2 .)))", "(0 (1 Dull) (1 (2 and) (0 slow)))", "(2 (2 It) (2 exists))",
                  "(4 (4 (2 -LRB-) (4 (4 Great) (2 -RRB-))) (3 fun))", "(1 (1 Not) (2 good))", "(3 (3 Nice) (2 film))"],
    "dev.txt": ["(4 (4 Superb) (2 .))", "(2 (2 A) (2 film))", "(0 (0 Awful) (2 .))"],
    "test.txt": ["(1 (1 Weak) (2 plot))", "(3 (3 Fine) (2 .))", "(2 (2 Some) (2 film))"],
}  # fmt: skip


def write_sst(root, nested=True):
    folder = root / "trees" if nested else root
    folder.mkdir(parents=True)
    for name, lines in SST_LINES.items():
        (folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_sst_reader_binary_and_fine(tmp_path):
    from torchcal.experiments.data.text import load_sst, parse_ptb_tree

    write_sst(tmp_path)
    (tr_x, tr_y), (va_x, va_y), (te_x, te_y) = load_sst(tmp_path, binary=True)
    assert tr_x == [
        "It works .",
        "Dull and slow",
        "( Great ) fun",
        "Not good",
        "Nice film",
    ]  # neutral dropped
    assert tr_y == [1, 0, 1, 0, 1] and va_y == [1, 0] and te_y == [0, 1]
    (tr_x, tr_y), _, (te_x, te_y) = load_sst(tmp_path, binary=False)
    assert tr_y == [3, 0, 2, 4, 1, 3] and te_x[2] == "Some film" and te_y == [1, 3, 2]
    write_sst(tmp_path / "flat", nested=False)  # the three files straight in data.root
    assert load_sst(tmp_path / "flat", binary=True)[0][1] == [1, 0, 1, 0, 1]
    with pytest.raises(DatasetError, match="trainDevTestTrees_PTB.zip"):
        load_sst(tmp_path / "nothing", binary=True)
    (tmp_path / "bad" / "trees").mkdir(parents=True)
    for name in ("train.txt", "dev.txt", "test.txt"):
        (tmp_path / "bad" / "trees" / name).write_text("(3 (2 It) (4 works)\n")  # unbalanced
    with pytest.raises(DatasetError, match=r"train.txt, line 1: not a PTB sentiment tree"):
        load_sst(tmp_path / "bad", binary=True)
    with pytest.raises(ValueError, match="not a PTB sentiment tree"):
        parse_ptb_tree("It works")


def test_sst_runs_with_the_text_cnn(tmp_path):
    write_sst(tmp_path / "data")
    cfg = load_config(None, [f"data.root={tmp_path / 'data'}", "data.name=sst_binary", "data.max_len=150",
                             "data.loader.batch_size=4", "model.name=text_cnn", "train.epochs=1",
                             "train.calibrators=[]", "optim.name=adagrad", "optim.lr=0.05"])  # fmt: skip
    with pytest.warns(UserWarning, match="dev split is the validation set"):
        train(cfg, tmp_path / "run")
    logits = torch.load(tmp_path / "run" / "logits.pt", weights_only=True)
    assert logits["val"]["logits"].shape == (2, 2) and logits["test"]["logits"].shape == (2, 2)
