"""A transformer checkpoint folder whose tokenizer cannot be this model's is refused before training (issue
24): without tokenizer files transformers builds an empty tokenizer of 5 special tokens, every word becomes
[UNK] and the run trains at chance level without a word."""

import json
import shutil

import pytest

pytest.importorskip("transformers")  # the `dev` extra installs it
from typer.testing import CliRunner  # noqa: E402

from tests.experiments.test_text import GROUPS, write_19997  # noqa: E402
from tests.experiments.tiny_bert import make_tiny_bert  # noqa: E402
from torchcal.experiments.cli import app  # noqa: E402
from torchcal.experiments.config import ConfigError  # noqa: E402
from torchcal.experiments.data.text import load_tokenizer  # noqa: E402

runner = CliRunner()


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    texts = [f"{words} doc{i}" for words in GROUPS.values() for i in range(20)]
    write_19997(root / "data", per_group=40)
    return make_tiny_bert(root / "bert", texts)


def copy_without_tokenizer(bert, folder):
    shutil.copytree(bert, folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        (folder / name).unlink(missing_ok=True)
    return folder


def test_a_checkpoint_without_tokenizer_files_is_refused_before_training(bert, tmp_path):
    assert len(load_tokenizer(bert)) == 120  # the folder as saved: its own tokenizer
    bare = copy_without_tokenizer(bert, tmp_path / "bare")
    with pytest.raises(
        ConfigError, match=r"holds no tokenizer files \(a tokenizer needs tokenizer.json, or vocab.txt"
    ):
        load_tokenizer(bare)
    args = ["train", "-o", str(tmp_path / "run"), f"data.root={bert.parent / 'data'}", "data.name=20newsgroups_papers",
            "data.val_size=900", "data.max_len=12", "model.name=transformer",
            f"model.checkpoint={bare}", "train.epochs=1", "train.num_threads=1"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert (
        len(line.splitlines()) == 1 and str(bare) in line and "tokenizer.json" in line and "vocab.txt" in line
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("rows, message", [(60, "120 tokens, more tokens than 60 rows"),
                                           (30522, "120 tokens, fewer than half the 30522 rows")])  # fmt: skip
def test_a_tokenizer_that_does_not_fit_the_embedding_is_refused(bert, tmp_path, rows, message):
    folder = tmp_path / "other"
    shutil.copytree(bert, folder)
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = rows  # as if the tokenizer files came from another model
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message + r" of the model's token embedding"):
        load_tokenizer(folder)


def test_an_embedding_padded_beyond_the_tokenizer_is_accepted(bert, tmp_path):
    folder = tmp_path / "padded"
    shutil.copytree(bert, folder)
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = 128  # checkpoints round their embedding up (to a multiple of 64 or 128)
    (folder / "config.json").write_text(json.dumps(config))
    assert len(load_tokenizer(folder)) == 120


def test_a_left_padding_tokenizer_pads_on_the_right(bert):
    """The model cuts each batch to its longest document (ids[:, :length]), which needs the padding at the
    end; a tokenizer saved with padding_side="left" put it first, so the cut kept the padding and dropped
    the short documents' tokens. Reference: each document tokenised alone, without padding."""
    import torch

    from torchcal.experiments.data.text import encode_with_tokenizer

    tokenizer = load_tokenizer(bert)
    tokenizer.padding_side = "left"
    texts = ["alpha beta gamma delta epsilon doc1", "alpha", "beta gamma doc2"]
    out = encode_with_tokenizer(texts, tokenizer, max_len=32)
    assert tokenizer.padding_side == "left"  # the tokenizer's own setting is left as it was
    for row, text in zip(out, texts):
        alone = tokenizer(text)["input_ids"]
        assert row[0, : len(alone)].tolist() == alone and row[1, : len(alone)].tolist() == [1] * len(alone)
        assert row[1, len(alone) :].sum() == 0 and (row[0, len(alone) :] == tokenizer.pad_token_id).all()
    length = int(out[:, 1].sum(1).max())  # the model's dynamic padding keeps every document's tokens
    assert torch.equal(out[:, 1, :length].sum(1), out[:, 1].sum(1))
