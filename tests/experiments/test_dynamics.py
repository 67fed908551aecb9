"""Training-dynamics logging (train.dynamics) and `torchcal figures`: every logged quantity against an
independent float64 recomputation from what the run saved (logits.pt, the checkpoint), the figures' data
against hand computations and scikit-learn, refusals and the CLI's one-line errors."""

import json
import math

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score
from sklearn.metrics import roc_curve as sk_roc_curve
from typer.testing import CliRunner

from torchcal.experiments.cli import app
from torchcal.experiments.config import ConfigError, load_config
from torchcal.experiments.errors import UserError
from torchcal.experiments.reports.figures import (
    FIGURES,
    draw_figures,
    ema,
    find_runs,
    g_focal,
    roc_curve,
    run_groups,
)
from torchcal.experiments.training.checkpoints import load_checkpoint
from torchcal.experiments.training.dynamics import check_dynamics, gradient_norms, last_linear
from torchcal.experiments.training.loop import train
from torchcal.losses import create

runner = CliRunner()
ALL = "train.dynamics=[bins,outputs,weights,logits,gradients]"
TINY = ["data.name=digits", "data.ood.sets=[]", "data.val_size=260", "model.width=8", "train.epochs=3",
        "train.num_threads=1", "train.calibrators=[]"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dyn")
    for loss in ("ce", "fl-3"):
        for seed in (0, 1):
            train(
                load_config(None, [*TINY, ALL, f"loss.name={loss}", f"train.seed={seed}"]),
                root / f"{loss}-s{seed}",
            )
    train(load_config(None, TINY), root / "plain")
    return root


def rows_of(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_logged_outputs_bins_and_logits_equal_a_recomputation_from_the_saved_logits(runs):
    run = runs / "ce-s0"
    last = rows_of(run)[-1]["dynamics"]
    saved = torch.load(run / "logits.pt", weights_only=True)  # the last epoch's model (train.select=last)
    z, y = saved["test"]["logits"].double(), saved["test"]["targets"]
    n, k = z.shape
    # outputs: per-sample loops in float64
    nll, ent, py, correct = [], [], [], []
    for i in range(n):
        row = z[i].tolist()
        m = max(row)
        lse = m + math.log(sum(math.exp(v - m) for v in row))
        p = [math.exp(v - lse) for v in row]
        nll.append(lse - row[int(y[i])])
        ent.append(-sum(q * math.log(q) for q in p))
        py.append(p[int(y[i])])
        correct.append(max(range(k), key=lambda j: row[j]) == int(y[i]))
    out = last["outputs"]
    # the run's softmax/log_softmax reduce in another order than these loops: float64 rounding, ~1e-15 per
    # sample, averaged
    assert out["nll"] == pytest.approx(sum(nll) / n, rel=1e-12)
    for name, flag in (("correct", True), ("wrong", False)):
        chosen = [i for i in range(n) if correct[i] == flag]
        assert out[f"n_{name}"] == len(chosen)
        assert out[f"nll_{name}"] == pytest.approx(sum(nll[i] for i in chosen) / len(chosen), rel=1e-12)
        assert out[f"entropy_{name}"] == pytest.approx(sum(ent[i] for i in chosen) / len(chosen), rel=1e-12)
        assert out[f"p_y_{name}"] == pytest.approx(sum(py[i] for i in chosen) / len(chosen), rel=1e-12)
    # bins of the validation set: SPEC §3's edges (m/M, (m+1)/M], 0 in bin 0, by a loop
    zv, yv = saved["val"]["logits"].double(), saved["val"]["targets"]
    pv = torch.softmax(zv, 1)
    count, conf_sum, hits = [0] * 15, [0.0] * 15, [0] * 15
    for i in range(len(yv)):
        c = float(pv[i].max())
        b = max(0, math.ceil(c * 15) - 1)
        count[b] += 1
        conf_sum[b] += c
        hits[b] += int(int(pv[i].argmax()) == int(yv[i]))
    val = last["bins"]["val"]
    assert val["count"] == count
    for b in range(15):
        if count[b]:
            assert val["confidence"][b] == pytest.approx(conf_sum[b] / count[b], rel=1e-12)
            assert val["accuracy"][b] == pytest.approx(hits[b] / count[b], rel=1e-15)
        else:
            assert val["confidence"][b] is None and val["accuracy"][b] is None
    assert sum(last["bins"]["train"]["count"]) == last_train_size(run)  # the whole training set, once
    # logits: numpy's linear percentiles of the max logit; q_j's box by a loop
    top = z.max(1).values.numpy()
    np.testing.assert_allclose(
        last["logits"]["max_logit_percentiles"], np.percentile(top, np.arange(101)), rtol=1e-12
    )
    qj = []
    for i in range(n):
        p = torch.softmax(z[i], 0).tolist()
        below = [q for q in p if q < p[int(y[i])]]
        qj.append(max(below) if below else 0.0)
    q1, med, q3 = np.percentile(qj, [25, 50, 75])
    inside = [v for v in qj if q1 - 1.5 * (q3 - q1) <= v <= q3 + 1.5 * (q3 - q1)]
    box = last["logits"]["q_j"]
    assert box["med"] == pytest.approx(med, rel=1e-12) and box["q1"] == pytest.approx(q1, rel=1e-12)
    assert box["whislo"] == pytest.approx(min(inside), rel=1e-12) and box["whishi"] == pytest.approx(
        max(inside)
    )


def last_train_size(run):
    """The training set's size as the run loaded it."""
    import yaml

    from torchcal.experiments.config import config_from_dict
    from torchcal.experiments.data import load_splits

    raw = yaml.safe_load((run / "config.yaml").read_text())
    raw.pop("meta", None)
    return len(load_splits(config_from_dict(raw).data)["train"])


def test_the_weight_norm_is_the_checkpoint_models_last_linear_layer(runs):
    run = runs / "fl-3-s1"
    state = load_checkpoint(run / "checkpoint.pt")["model"]
    weights = [k for k, v in state.items() if k.endswith("weight") and v.ndim == 2]
    expected = float(state[weights[-1]].double().norm())
    assert rows_of(run)[-1]["dynamics"]["weights"]["last_linear_norm"] == pytest.approx(expected, rel=1e-14)


def test_a_run_without_dynamics_logs_none(runs):
    assert all("dynamics" not in r for r in rows_of(runs / "plain"))


@pytest.mark.parametrize(
    "loss_name, reduction, batch_size", [("ce", "mean", 12), ("fl-3", "sum", 5), ("dfl", "mean", 5)]
)
def test_gradient_norms_equal_per_sample_autograd(loss_name, reduction, batch_size):
    """‖∂L_i/∂W‖ of the last linear layer by one backward pass per sample (the sample alone in its batch,
    reduction sum, so L is L_i) against gradient_norms' ‖g‖‖h‖ from one batched pass."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4)).double()
    x, y = torch.randn(12, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (12,), generator=g)
    loss = create(loss_name, reduction=reduction)
    got = gradient_norms(model, loss, x, y, lambda inputs: model(inputs).detach(), batch_size)
    single = create(loss_name, reduction="sum")
    for i in range(12):
        model.zero_grad()
        single(model(x[i : i + 1]), y[i : i + 1]).backward()
        # a batch-mean loss of one sample is its own loss: both reductions give L_i here
        assert float(got[i]) == pytest.approx(float(model[2].weight.grad.norm()), rel=1e-12)


def test_a_batch_level_loss_sees_training_sized_batches():
    """MMCE's pair term over consecutive batches of 4 rows (the training batch), not over the whole set: each
    sample's ‖∂L/∂z‖ equals a backward pass through its own batch's loss, times the batch size (mean)."""
    g = torch.Generator().manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4)).double()
    x, y = torch.randn(10, 3, generator=g, dtype=torch.float64), torch.randint(0, 4, (10,), generator=g)
    loss = create("mmce")
    got = gradient_norms(model, loss, x, y, lambda inputs: model(inputs).detach(), 4)
    z = model(x).detach()
    want = []
    for zb, yb in zip(z.split(4), y.split(4), strict=True):
        zb = zb.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(loss(zb, yb), zb)
        want.append(grad.norm(dim=1) * len(yb))
    h = x.norm(dim=1)  # the head's input is x itself
    torch.testing.assert_close(got, torch.cat(want) * h, rtol=1e-12, atol=0)


def test_refusals_name_the_key():
    with pytest.raises(ConfigError, match=r"train.dynamics=\['bins'\] are defined for softmax outputs"):
        load_config(
            None, ["data.name=fashion_mnist_attributes", "train.dynamics=[bins, weights]", "loss.name=bce"]
        )
    with pytest.raises(ConfigError, match=r"train.dynamics=\['gradients'\] score the whole training set"):
        load_config(None, ["data.name=imagenet", "train.dynamics=[gradients]"])
    with pytest.raises(ConfigError, match="train.dynamics"):
        load_config(None, ["train.dynamics=[everything]"])
    with pytest.raises(ConfigError, match="need a model with a final nn.Linear"):
        check_dynamics(["weights"], torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3)))
    net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 4))
    assert last_linear(net) is net[2]


def test_g_and_ema_by_hand():
    # g(0.5, 1) = 0.5 − 0.5·log 0.5 = 0.5 + 0.5 ln 2; g(p, 0) = 1 (cross entropy)
    assert float(g_focal(torch.tensor(0.5), 1.0)) == pytest.approx(0.5 + 0.5 * math.log(2), rel=1e-15)
    assert torch.allclose(g_focal(torch.tensor([0.1, 0.9]), 0.0), torch.ones(2, dtype=torch.float64))
    # s = [1, 0.5·3 + 0.5·1 = 2, 0.5·0 + 0.5·2 = 1]
    assert ema(torch.tensor([1.0, 3.0, 0.0])).tolist() == [1.0, 2.0, 1.0]


def test_roc_curve_and_per_class_auroc_equal_scikit_learn():
    g = torch.Generator().manual_seed(3)
    s = torch.rand(200, generator=g, dtype=torch.float64).round(decimals=1)  # ties
    y = (torch.rand(200, generator=g) < s).long()
    fpr, tpr = roc_curve(s, y)
    sk_fpr, sk_tpr, _ = sk_roc_curve(y.numpy(), s.numpy(), drop_intermediate=False)
    np.testing.assert_allclose(fpr, sk_fpr, atol=1e-15)
    np.testing.assert_allclose(tpr, sk_tpr, atol=1e-15)


def test_figures_from_the_runs(runs, tmp_path):
    groups = run_groups(find_runs([runs]))
    assert sorted(len(gr.runs) for gr in groups) == [1, 2, 2]
    written, skipped = draw_figures(groups, list(FIGURES), tmp_path / "f")
    # every figure but those needing data these digits runs do not have: OOD sets (tested on their own below),
    # 2-D points for the decision boundaries (test_moons.py) and runs that differ in one loss argument
    # (test_figures_sweep.py)
    elsewhere = {"adafocal-fig6", "fcl-fig7", "fcl-fig6"}
    assert set(written) == set(FIGURES) - elsewhere and set(skipped) == elsewhere
    assert all(skipped[n] == FIGURES[n][1] for n in ("adafocal-fig6", "fcl-fig7"))
    index = json.loads((tmp_path / "f" / "figures.json").read_text())
    assert [f["name"] for f in index["figures"]] == [n for n in FIGURES if n not in elsewhere]
    assert all((tmp_path / "f" / f"{n}.png").stat().st_size > 0 and (tmp_path / "f" / f"{n}.svg").exists()
               for n in written)  # fmt: skip
    ce = next(gr for gr in groups if gr.runs[0].name.startswith("ce-"))
    # focal-fig3: the mean over the two seeds of what each logged, per epoch
    logged = [[r["dynamics"]["outputs"]["nll_wrong"] for r in rows_of(run)] for run in ce.runs]
    curve = written["focal-fig3"]["NLL, wrong"][ce.label]
    assert curve["mean"] == pytest.approx([(a + b) / 2 for a, b in zip(*logged, strict=True)], rel=1e-14)
    assert curve["band"] == pytest.approx(
        [abs(a - b) / math.sqrt(2) for a, b in zip(*logged, strict=True)], rel=1e-12
    )
    # dualfocal-fig4a: the EMA (0.5) of the seeds' mean test ECE
    eces = [[r["test_ece"] for r in rows_of(run)] for run in ce.runs]
    mean = [(a + b) / 2 for a, b in zip(*eces, strict=True)]
    smooth = [mean[0]]
    for v in mean[1:]:
        smooth.append(0.5 * v + 0.5 * smooth[-1])
    assert written["dualfocal-fig4a"][ce.label] == pytest.approx(smooth, rel=1e-14)
    # fcl-table9: each class's AUROC against scikit-learn on the first run's saved test logits
    saved = torch.load(ce.runs[0] / "logits.pt", weights_only=True)["test"]
    probs = torch.softmax(saved["logits"].double(), 1)
    for k, entry in enumerate(written["fcl-table9"][ce.label]):
        assert entry["auroc"] == pytest.approx(
            roc_auc_score((saved["targets"] == k).numpy(), probs[:, k].numpy())
        )
    csv = (tmp_path / "f" / "fcl-table9.csv").read_text().splitlines()
    assert csv[0] == "run,class,auroc,ece,mce" and len(csv) == 1 + 3 * 10


def test_figures_cli_skips_what_was_not_logged_and_errors_are_one_line(runs, tmp_path):
    result = runner.invoke(app, ["figures", str(runs / "plain"), "--out", str(tmp_path / "f")])
    assert result.exit_code == 0, result.output
    assert "skipped focal-fig3: no run logged its data (train with train.dynamics=[outputs])" in result.output
    assert (tmp_path / "f" / "focal-fig1.png").exists() and not (tmp_path / "f" / "focal-fig3.png").exists()
    for args, message in [
        (["--only", "fig9"], "--only: unknown figure 'fig9'"),
        (["--band", "iqr"], "--band must be std or sem"),
        (["--epochs", "x"], "--epochs must be integers"),
    ]:
        bad = runner.invoke(app, ["figures", str(runs / "ce-s0"), "--out", str(tmp_path / "g"), *args])
        assert bad.exit_code == 2 and message in bad.output and len(bad.output.strip().splitlines()) == 1
    assert not (tmp_path / "g").exists()
    missing = runner.invoke(app, ["figures", str(tmp_path / "nowhere"), "--out", str(tmp_path / "g")])
    assert missing.exit_code == 2 and "is not a folder" in missing.output
    with pytest.raises(UserError, match=r"--epochs \[7\]: not logged"):
        draw_figures(run_groups(find_runs([runs / "ce-s0"])), ["focal-fig2"], tmp_path / "h", epochs=(7,))


def test_the_report_links_the_figures(runs, tmp_path):
    out = tmp_path / "rep"
    assert (
        runner.invoke(
            app, ["figures", str(runs), "--out", str(out / "figures"), "--only", "focal-fig3"]
        ).exit_code
        == 0
    )
    result = runner.invoke(app, ["report", str(runs / "ce-s0"), str(runs / "ce-s1"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    page = (out / "report.html").read_text()
    assert '<img src="figures/focal-fig3.png"' in page and "The papers' figures" in page


def test_ood_roc_figure_from_a_runs_saved_ood_logits(runs, tmp_path):
    """adafocal-fig6: the ROC curves of entropy-based OOD detection before and after TS (ECE-fitted on the
    validation logits), from the logits a run saved for its OOD sets; AUROCs against scikit-learn."""
    import shutil

    from torchcal.calibrators import from_spec

    run = tmp_path / "ood-run"
    shutil.copytree(runs / "plain", run)
    saved = torch.load(run / "logits.pt", weights_only=True)
    g = torch.Generator().manual_seed(0)
    n_out = 300  # flatter logits than the test set's: an OOD set the entropy separates partly
    saved["ood_noise"] = {"logits": 0.3 * torch.randn(n_out, 10, generator=g), "targets": torch.zeros(n_out)}
    torch.save(saved, run / "logits.pt")
    written, skipped = draw_figures(run_groups(find_runs([run])), ["adafocal-fig6"], tmp_path / "f")
    assert not skipped and (tmp_path / "f" / "adafocal-fig6.png").exists()
    (label,) = {k.rsplit(" ", 2)[0] for k in written["adafocal-fig6"]["noise"]}
    cal = from_spec("ts:objective=ece").fit(saved["val"]["logits"], saved["val"]["targets"])
    # post T: the calibrator's own probabilities (float32 for float32 logits, as the report scores them: in
    # float32 many confident samples tie at entropy 0, so float64 probabilities would rank them otherwise)
    for stage, to_probs in (("pre T", lambda z: torch.softmax(z.double(), 1)), ("post T", cal.transform)):
        entry = written["adafocal-fig6"]["noise"][f"{label} {stage}"]
        assert entry["temperature"] == pytest.approx(cal.temperature_, rel=1e-12)

        def entropy(z, to_probs=to_probs):
            p = to_probs(z).double()
            return -(p * p.clamp_min(1e-300).log()).sum(1)

        scores = torch.cat([entropy(saved["test"]["logits"]), entropy(saved["ood_noise"]["logits"])])
        labels = torch.cat([torch.zeros(len(saved["test"]["logits"])), torch.ones(n_out)])
        # the rank statistic over the same float64 entropies: equal up to ties broken by rounding
        assert entry["auroc"] == pytest.approx(roc_auc_score(labels.numpy(), scores.numpy()), abs=1e-12)
    assert 0.5 < written["adafocal-fig6"]["noise"][f"{label} pre T"]["auroc"] <= 1
    # a run without OOD sets: skipped with the key that adds them
    _, skipped = draw_figures(run_groups(find_runs([runs / "plain"])), ["adafocal-fig6"], tmp_path / "g")
    assert skipped == {"adafocal-fig6": FIGURES["adafocal-fig6"][1]} and "data.ood.sets" in skipped["adafocal-fig6"]
