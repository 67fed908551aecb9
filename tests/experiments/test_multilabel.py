"""Multi-label runs end to end on a Fashion-MNIST attributes fixture (IDX files in the exact format): training
with sigmoid losses, per-label metrics, calibrators, the Table 9 report (Markdown, CSV, HTML), and the errors
that keep softmax and sigmoid pieces apart."""

import csv
import io

import numpy as np
import pytest
import torch

from tests.experiments.test_data import write_idx
from torchcal.experiments.config import ConfigError, load_config
from torchcal.experiments.data.readers import FASHION_ATTRIBUTES, fashion_attributes
from torchcal.experiments.evaluation.evaluate import evaluate_run, report
from torchcal.experiments.reports.html import html_report
from torchcal.experiments.training.loop import train


def learnable_fashion(root, n_train=600, n_test=200):
    """Images whose class shows as a bright bar at row 2·class (so the attributes are learnable)."""
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        images = rng.integers(0, 60, size=(n, 28, 28), dtype=np.uint8)
        for i, c in enumerate(labels):
            images[i, 2 * c + 4, 4:24] = 250
        write_idx(root / f"{split}-images-idx3-ubyte", images, True)
        write_idx(root / f"{split}-labels-idx1-ubyte", labels, True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ml")
    (root / "data").mkdir()
    learnable_fashion(root / "data")
    out = {}
    for loss in ("bce", "binary-fcl"):
        for seed in (0, 1):
            cfg = load_config(None, [f"data.root={root / 'data'}", "data.name=fashion_mnist_attributes",
                                     "data.val_size=120", "data.loader.batch_size=32", "model.name=small_cnn", "model.width=32",
                                     "train.epochs=3", f"loss.name={loss}", f"train.seed={seed}",
                                     "train.calibrators=[ts, platt]", "train.num_threads=1"])  # fmt: skip
            train(cfg, root / f"{loss}-{seed}")
            out[(loss, seed)] = root / f"{loss}-{seed}"
    return root, out


def test_attributes_overlap():
    y = fashion_attributes(torch.arange(10))
    assert y.shape == (10, 5) and list(FASHION_ATTRIBUTES) == ["upper_body", "footwear", "warm", "summer",
                                                               "long_sleeves"]  # fmt: skip
    assert y.sum(1).tolist() == [2, 0, 3, 1, 3, 2, 2, 1, 0, 2]  # 0 to 3 attributes per image


def test_training_and_evaluation_use_the_multilabel_metrics(runs):
    import torchcal.functional as F

    _, out = runs
    run = out[("bce", 0)]
    logits = torch.load(run / "logits.pt", weights_only=True)
    assert logits["test"]["logits"].shape == (200, 5) and logits["test"]["targets"].shape == (200, 5)
    res = evaluate_run(run, ("ts", "platt", "fts", "isotonic"))
    z, y = logits["test"]["logits"], logits["test"]["targets"]
    assert res["task"] == "multilabel" and res["label_names"] == list(FASHION_ATTRIBUTES)
    pre = res["uncalibrated"]["test"]
    assert pre["ece"] == pytest.approx(
        float(F.multilabel_ece(z, y, from_logits=True)), abs=1e-6
    )  # float32 sigmoid in the run
    assert pre["mce"] == pytest.approx(
        float(F.multilabel_mce(z, y, from_logits=True)), abs=1e-6
    )  # float32 sigmoid in the run
    assert pre["auroc_per_label"] == pytest.approx(
        F.multilabel_auroc(z, y, average="none").tolist(), abs=1e-6
    )
    assert pre["auroc"] > 0.75  # the fixture is learnable (chance: 0.5)
    assert len(res["ts"]["test"]["ece_per_label"]) == 5
    from torchcal.calibrators import from_json

    platt = from_json((run / "calibrators" / "platt.json").read_text())
    assert platt.slope_.shape == (5,)
    post = platt.transform(z)
    assert res["platt"]["test"]["ece"] == pytest.approx(float(F.multilabel_ece(post, y)), abs=1e-12)


def test_table_9_report(runs, tmp_path):
    root, out = runs
    markdown, csv_text = report(list(out.values()), tmp_path / "rep", "ts")
    assert "| method | seeds | AUROC upper_body | AUROC footwear |" in markdown
    assert "mean AUROC | ECE | MCE |" in markdown
    assert "fashion_mnist_attributes · small_cnn · bce | 0, 1 |" in markdown
    rows = list(csv.DictReader(io.StringIO(csv_text)))
    assert [r["n_runs"] for r in rows] == ["2", "2"]
    assert {"auroc_warm_pre_mean", "ece_post_sem", "mce_pre_std"} <= set(rows[0])
    page = html_report(list(out.values()), tmp_path / "rep", "ts")
    text = page.read_text()
    assert "reliability per label, uncalibrated" in text and text.count("<img") >= 6


def test_softmax_and_sigmoid_pieces_are_kept_apart(runs, tmp_path):
    root, _ = runs
    base = [f"data.root={root / 'data'}", "data.name=fashion_mnist_attributes", "model.name=mlp"]
    with pytest.raises(
        ConfigError, match=r"loss.name='fl-3' is a loss for multiclass .* choose one of \['bce'"
    ):
        load_config(None, [*base, "loss.name=fl-3"])
    with pytest.raises(ConfigError, match="loss.name='bce' is a loss for multilabel"):
        load_config(None, ["data.name=digits", "data.ood.sets=[]", "loss.name=bce"])
    with pytest.raises(
        ConfigError, match=r"train.calibrators \(multilabel outputs\): unknown calibrator 'ets'"
    ):
        load_config(None, [*base, "loss.name=bce", "train.calibrators=[ets]"])
    with pytest.raises(ConfigError, match="data.ood applies to multiclass datasets"):
        load_config(None, [*base[:2], "data.ood.sets=[digits]", "loss.name=bce"])


def test_an_unknown_calibrator_names_both_registries(runs):
    from typer.testing import CliRunner

    from torchcal.experiments.cli import app

    _, out = runs
    result = CliRunner().invoke(app, ["report", str(out[("bce", 0)]), "--calibrator", "nope"])
    assert result.exit_code == 2
    assert "unknown calibrator 'nope'" in result.output and "'platt', 'ts'] (multi-label)" in result.output
    result = CliRunner().invoke(app, ["report", str(out[("bce", 0)]), "--calibrator", "platt:max_iter=0"])
    assert result.exit_code == 2 and "`max_iter` must be >= 1" in result.output
