"""Transformers in the runner: a tiny local BERT checkpoint fine-tunes on a 20 Newsgroups fixture (the papers'
split) with CE, FLSD-53 and AdaFocal-100 through `torchcal train`, resumes after SIGKILL bit for bit, reports;
the linear warm-up schedule, gradient accumulation and the checkpoint errors."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("transformers")  # the `dev` extra installs it; CI runs these tests
from typer.testing import CliRunner  # noqa: E402

from tests.experiments.test_text import GROUPS, write_19997  # noqa: E402
from tests.experiments.tiny_bert import make_tiny_bert  # noqa: E402
from torchcal.experiments.cli import app  # noqa: E402
from torchcal.experiments.config import load_config  # noqa: E402
from torchcal.experiments.training.loop import train  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert")
    write_19997(root / "data", per_group=400)  # 60 / 900 / 240 documents in the papers' split
    texts = [f"{words} doc{i}" for words in GROUPS.values() for i in range(20)]
    make_tiny_bert(root / "bert", texts)
    return root


def args(corpus, *extra):
    return [f"data.root={corpus / 'data'}", "data.name=20newsgroups_papers", "data.val_size=900",
            "data.max_len=12",
            "data.eval_max_len=24", "data.loader.batch_size=8", "data.loader.eval_batch_size=512", "model.name=transformer",
            f"model.checkpoint={corpus / 'bert'}", "optim.name=adamw", "optim.lr=0.03", "optim.weight_decay=0.01",
            "optim.schedule=linear", "optim.warmup_epochs=0.2", "train.epochs=3", "train.calibrators=[ts]",
            "train.select=best_val_error", "train.num_threads=1", *extra]  # fmt: skip


def weights(run):
    return torch.load(run / "checkpoint.pt", weights_only=True)["model"]


@pytest.mark.parametrize("loss", ["ce", "flsd-53"])
def test_fine_tunes_a_local_checkpoint(corpus, tmp_path, loss):
    rows = train(load_config(None, args(corpus, f"loss.name={loss}")), tmp_path / "run")
    assert len(rows) == 3 and all(r["train_loss"] == r["train_loss"] for r in rows)  # finite
    logits = torch.load(tmp_path / "run" / "logits.pt", weights_only=True)
    assert logits["val"]["logits"].shape == (900, 3) and logits["test"]["logits"].shape == (240, 3)
    assert min(r["val_error"] for r in rows) < 0.45  # it learns (chance: 2/3)


def test_adafocal_100_through_the_cli_then_report(corpus, tmp_path):
    """AdaFocal updated every 2 batches (the paper's AdaFocal-100 at fixture scale): 4 updates per epoch."""
    runner = CliRunner()
    run = tmp_path / "ada"
    result = runner.invoke(
        app, ["train", "-o", str(run), *args(corpus, "loss.name=adafocal", "loss.update_every=2")]
    )
    assert result.exit_code == 0, result.output
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert state["loss"]["gamma_history"].shape[0] == 3 * 4  # 60 documents: 8 batches an epoch, 4 updates
    result = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    assert "transformer" in (tmp_path / "report" / "report.md").read_text()


def test_sigkill_then_resume_is_identical(corpus, tmp_path):
    cfg_args = args(corpus, "loss.name=flsd-53", "train.epochs=3")
    train(load_config(None, cfg_args), tmp_path / "reference")
    run = tmp_path / "killed"
    code = (
        "from torchcal.experiments.config import load_config; from torchcal.experiments.training.loop import train;"
        f"train(load_config(None, {cfg_args!r}), {str(run)!r})"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while not (run / "checkpoint.pt").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # after the first checkpoint, during the second epoch
    proc.wait()
    assert proc.returncode == -signal.SIGKILL  # killed, not finished
    assert (run / "checkpoint.pt").exists() and not (run / "logits.pt").exists()
    train(load_config(None, cfg_args), run, resume=True)
    reference, resumed = weights(tmp_path / "reference"), weights(run)
    for name in reference:
        assert torch.equal(reference[name], resumed[name]), name
    assert (run / "metrics.jsonl").read_text() == (tmp_path / "reference" / "metrics.jsonl").read_text()
    assert (run / "selection.json").read_text() == (tmp_path / "reference" / "selection.json").read_text()


def test_linear_schedule_and_its_resume_rule(corpus, tmp_path):
    from torchcal.experiments.errors import ConfigError

    rows = train(load_config(None, args(corpus, "loss.name=ce", "train.epochs=2")), tmp_path / "run")
    # 8 steps an epoch, warm-up over round(0.2 * 8) = 2 steps, then linear decay to 0 at step 16
    lr = lambda step: 0.03 * (step / 2 if step < 2 else (16 - step) / 14)  # noqa: E731
    assert [r["lr"] for r in rows] == pytest.approx([lr(8), lr(16)])
    with pytest.raises(ConfigError, match="optim.schedule=linear decays the learning rate to 0"):
        train(
            load_config(None, args(corpus, "loss.name=ce", "train.epochs=3")), tmp_path / "run", resume=True
        )


def test_checkpoint_errors_are_one_line(corpus, tmp_path):
    runner = CliRunner()
    bad = args(corpus, "loss.name=ce")
    bad = [
        a if not a.startswith("model.checkpoint=") else f"model.checkpoint={tmp_path / 'nothing'}"
        for a in bad
    ]
    result = runner.invoke(app, ["train", "-o", str(tmp_path / "run"), *bad])
    assert result.exit_code == 2
    assert "huggingface-cli download bert-base-uncased" in result.output
    assert not (tmp_path / "run").exists()  # a refused command writes nothing
    result = runner.invoke(app, ["train", "-o", str(tmp_path / "r2"), "model.name=transformer", "data.name=digits", "data.ood.sets=[]",
                                 f"model.checkpoint={corpus / 'bert'}"])  # fmt: skip
    assert result.exit_code == 2 and "needs a text dataset" in result.output


def test_a_head_of_another_size_is_named(tmp_path):
    """A fine-tuned checkpoint whose head has 2 labels, trained on 4 classes: the head is replaced, and a
    warning names both sizes; a body without a head (the usual pre-trained checkpoint) gets one silently."""
    import warnings

    from transformers import BertConfig, BertForSequenceClassification

    from torchcal.experiments.models.registry import TransformerClassifier

    config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=2)  # fmt: skip
    BertForSequenceClassification(config).save_pretrained(tmp_path / "sst2")
    with pytest.warns(UserWarning, match="has a classification head for 2 labels; the dataset has 4"):
        model = TransformerClassifier(str(tmp_path / "sst2"), 4)
    assert model.hf.classifier.out_features == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TransformerClassifier(str(tmp_path / "sst2"), 2)  # the same size: its trained head is kept
        make_tiny_bert(tmp_path / "body", ["some words", "other words"])
        TransformerClassifier(str(tmp_path / "body"), 4)
