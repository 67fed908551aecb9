"""FCL's synthetic 2-D experiment (App. A.11 / Fig. 7, App. A.6 / Fig. 5): the two-moons reader and its config
kind, the 2 x 10 MLP, tiny CE / FCL runs, and `torchcal figures --only fcl-fig5,fcl-fig7` checked for its data:
the grid probabilities against the saved weights evaluated independently, h(q) against a float64 reference."""

import json
import math
import shutil

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from typer.testing import CliRunner

from torchcal.experiments.cli import app, list_presets
from torchcal.experiments.config import ConfigError, MoonsDataConfig, load_config
from torchcal.experiments.data import load_moons, load_splits
from torchcal.experiments.errors import UserError
from torchcal.experiments.reports.figures import (
    FIGURES,
    RunSet,
    draw_figures,
    fcl_h,
    fcl_h_root,
    find_runs,
    run_groups,
)
from torchcal.experiments.training.loop import _build_model, train

runner = CliRunner()
TINY = ["data.name=moons", "data.n_train=240", "data.val_size=80", "data.n_test=160", "model.width=10",
        "optim.lr=0.01", "data.loader.batch_size=32", "train.epochs=4", "train.num_threads=1",
        "train.calibrators=[]"]  # fmt: skip
FCL = ["loss.name=fcl", "loss.kwargs={gamma: 10, lambda_: 1.5}"]


def h_reference(q: float, gamma: float, lam: float) -> float:
    """Lemma A.3's h in plain float64 arithmetic: (1 − q)^γ/q − γ(1 − q)^(γ−1) log q − 2λq."""
    return (1 - q) ** gamma / q - gamma * (1 - q) ** (gamma - 1) * math.log(q) - 2 * lam * q


# ----------------------------------------------------------------------------- the reader


def test_the_reader_draws_balanced_float32_points_determined_by_the_seed():
    train, val, test = load_moons(301, 100, 7, noise=0.2, seed=3)
    for split, n in ((train, 301), (val, 100), (test, 7)):
        assert split.inputs.shape == (n, 2) and split.inputs.dtype == torch.float32
        assert split.targets.shape == (n,) and split.targets.dtype == torch.int64
        # make_moons puts floor(n/2) points on the upper moon (class 0), ceil(n/2) on the lower one
        assert int((split.targets == 0).sum()) == n // 2 and int((split.targets == 1).sum()) == (n + 1) // 2
    again = load_moons(301, 100, 7, noise=0.2, seed=3)
    for a, b in zip((train, val, test), again, strict=True):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    other = load_moons(301, 100, 7, noise=0.2, seed=4)
    assert not torch.equal(train.inputs, other[0].inputs)
    # the splits are drawn on their own: no point of the validation set is a training point
    assert not (torch.cdist(val.inputs, train.inputs) == 0).any()


def test_the_noise_key_is_the_standard_deviation_around_the_two_half_circles():
    clean, _, _ = load_moons(2000, 2, 2, noise=0.0, seed=0)
    x, y = clean.inputs.double().unbind(1)
    upper, lower = clean.targets == 0, clean.targets == 1
    # noise 0: on the unit half circle (upper) and on the one centred at (1, 0.5) (lower), up to float32
    # rounding of coordinates below 2.1 (2^-23 · 2.1 ≈ 2.5e-7 each)
    assert torch.allclose(x[upper] ** 2 + y[upper] ** 2, torch.ones(1, dtype=torch.float64), atol=2e-6)
    assert torch.allclose((x[lower] - 1) ** 2 + (y[lower] - 0.5) ** 2, torch.ones(1, dtype=torch.float64),
                          atol=2e-6)  # fmt: skip
    assert (y[upper] >= -1e-6).all() and (y[lower] <= 0.5 + 1e-6).all()
    noisy, _, _ = load_moons(2000, 2, 2, noise=0.2, seed=0)
    # the same seed draws the same points, then adds N(0, 0.2²) to each of the 4,000 coordinates: the sample
    # standard deviation is 0.2 within 5 standard errors (0.2 / sqrt(2 · 4000) each)
    residual = (noisy.inputs.double() - clean.inputs.double()).flatten()
    assert abs(float(residual.std()) - 0.2) < 5 * 0.2 / math.sqrt(2 * 4000)
    assert abs(float(residual.mean())) < 5 * 0.2 / math.sqrt(4000)


def test_the_reader_refuses_bad_arguments_by_name():
    for kwargs, name in [({"n_train": 1}, "n_train"), ({"n_test": 2.0}, "n_test"), ({"noise": -0.1}, "noise"),
                         ({"noise": float("nan")}, "noise"), ({"seed": -1}, "seed"), ({"n_val": True}, "n_val")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"`{name}`"):
            load_moons(**kwargs)


def test_the_config_kind_reads_the_splits_and_refuses_other_kinds_keys():
    cfg = load_config(None, ["data.name=moons", "data.n_train=50", "data.val_size=20", "data.n_test=30",
                             "data.noise=0.1", "data.seed=5"])  # fmt: skip
    assert isinstance(cfg.data, MoonsDataConfig) and cfg.task == "multiclass" and not cfg.data.augment
    splits = load_splits(cfg.data)
    assert sorted(splits) == ["test", "train", "val"]  # no shift or OOD set
    expected = load_moons(50, 20, 30, noise=0.1, seed=5)
    for name, want in zip(("train", "val", "test"), expected, strict=True):
        assert torch.equal(splits[name].inputs, want.inputs) and torch.equal(splits[name].targets, want.targets)
    limited = load_splits(load_config(None, ["data.name=moons", "data.limit_train=10"]).data)
    assert len(limited["train"]) == 10 and len(limited["val"]) == 500
    for override, message in [
        ("data.noise=-0.2", r"^data.noise must be >= 0.0, got -0.2$"),
        ("data.noise=.inf", "data.noise must be a finite number"),
        ("data.n_train=1", r"^data.n_train must be >= 2, got 1$"),
        ("data.val_size=1.5", "data.val_size must be an integer"),
        ("data.seed=-1", "data.seed must be >= 0"),
        ("data.augment=true", "data.augment does not apply to data.name=moons"),
        ("data.root=/data", "data.root does not apply to data.name=moons"),
        ("data.split_seed=2", "data.split_seed does not apply to data.name=moons"),
        ("data.max_len=200", "data.max_len does not apply to data.name=moons"),
        ("data.ood.sets=[]", "data.shift and data.ood apply to in-memory image sets, not data.name=moons"),
        ("data.shift.name=", "data.shift and data.ood apply to in-memory image sets, not data.name=moons"),
        ("data.n_points=3", r"unknown key data.n_points; valid keys of data \(data.name=moons\)"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, ["data.name=moons", override])
    # another kind's keys do not follow data.name=moons, nor the points' keys another dataset
    from torchcal.experiments.config import apply_overrides

    digits = load_config(None, ["data.name=digits", "data.ood.sets=[]", "data.augment=true",
                                "data.loader.batch_size=16"])  # fmt: skip
    moved = apply_overrides(digits, ["data.name=moons"]).data
    assert isinstance(moved, MoonsDataConfig) and moved.loader.batch_size == 16
    back = apply_overrides(load_config(None, ["data.name=moons", "data.noise=0.3"]), ["data.name=digits",
                                                                                       "data.ood.sets=[]"])  # fmt: skip
    assert back.data.name == "digits"


def test_mlp_of_width_10_is_the_papers_2_x_10_network():
    cfg = load_config(None, TINY)
    train_set = load_splits(cfg.data)["train"]
    model = _build_model(cfg, train_set, 2)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(2, 10), (10, 10), (10, 2)]
    assert sum(p.numel() for p in model.parameters()) == (2 * 10 + 10) + (10 * 10 + 10) + (10 * 2 + 2)
    assert model(train_set.inputs[:5]).shape == (5, 2)


def test_the_presets_are_the_papers_setting():
    presets = list_presets()
    losses = {"ce": ("ce", {}), "fl": ("fl-10", {}), "fcl": ("fcl", {"gamma": 10.0, "lambda_": 1.5})}
    for key, (name, kwargs) in losses.items():
        cfg = load_config(presets[f"moons_mlp_{key}"])
        assert isinstance(cfg.data, MoonsDataConfig) and cfg.data.noise == 0.2
        assert (cfg.model.name, cfg.model.width) == ("mlp", 10)
        assert (cfg.loss.name, cfg.loss.kwargs, cfg.loss.reduction) == (name, kwargs, "mean")
        assert (cfg.optim.name, cfg.optim.lr, cfg.train.epochs, cfg.train.select) == ("adam", 1e-3, 500, "last")
        assert cfg.data.loader.batch_size == 32


# ----------------------------------------------------------------------------- h(q) of Fig. 5


GAMMAS = (0.0, 0.1, 0.25, 0.5, 0.9, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 10.0)


@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("lam", (0.0, 0.5, 1.5, 4.5))
def test_h_is_strictly_decreasing_with_the_lemmas_limits(gamma, lam):
    q = torch.cat([torch.logspace(-8, -1, 400, dtype=torch.float64),
                   torch.linspace(0.1, 1 - 1e-6, 4000, dtype=torch.float64)[1:]])  # fmt: skip
    h = fcl_h(q, gamma, lam)
    reference = torch.tensor([h_reference(v, gamma, lam) for v in q.tolist()], dtype=torch.float64)
    assert torch.allclose(h, reference, rtol=1e-13, atol=1e-13)
    # strictly decreasing on the grid (h' = −f'' − 2λ with f'' > 0 for every γ >= 0: decision 190)
    assert (h[1:] < h[:-1]).all()
    # h' by autograd equals the closed form −f''(q) − 2λ
    qq = q[::50].clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(fcl_h(qq, gamma, lam).sum(), qq)
    t = 1 - qq.detach()
    x = qq.detach()
    f2 = gamma * (1 - gamma) * t ** (gamma - 2) * torch.log(x) + 2 * gamma * t ** (gamma - 1) / x + t**gamma / x**2
    assert torch.allclose(grad, -f2 - 2 * lam, rtol=1e-10)
    # limits: +∞ at 0; −2λ at 1 (1 − 2λ at γ = 0). At q = 1 − ε the distance to the limit is
    # ε^γ/q + γ ε^(γ−1)(−log q) + 2λε ≈ (1 + γ) ε^γ + 2λε (γ > 0), ε/q + 2λε (γ = 0): bounded with 1 % slack
    assert h_reference(1e-300, gamma, lam) > 1e299
    eps = 1e-12
    at_one = (1.0 if gamma == 0 else 0.0) - 2 * lam
    gap = (1 + gamma) * eps**gamma if gamma > 0 else eps
    assert 0 < h_reference(1 - eps, gamma, lam) - at_one <= 1.01 * (gap + 2 * lam * eps) + 1e-15


@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("lam", (0.25, 0.5, 1.5, 4.5))
def test_h_has_one_root_found_to_float64_precision(gamma, lam):
    root = fcl_h_root(gamma, lam)
    if gamma == 0 and lam <= 0.5:  # h = 1/q − 2λq >= 1 − 2λ >= 0 on (0, 1): no root
        assert root is None
        return
    assert root is not None and 0 < root < 1
    assert abs(h_reference(root, gamma, lam)) <= 1e-10
    # a sign change across the root, and the root of scipy's Brent method on the plain-float reference
    assert h_reference(root * (1 - 1e-9), gamma, lam) > 0 > h_reference(root * (1 + 1e-9), gamma, lam)
    assert root == pytest.approx(brentq(h_reference, 1e-12, 1 - 1e-12, args=(gamma, lam), xtol=1e-15), abs=1e-12)
    if gamma == 0:  # 1/q = 2λq: q* = 1/sqrt(2λ)
        assert root == pytest.approx(1 / math.sqrt(2 * lam), rel=1e-14)
    assert fcl_h_root(gamma, 0.0) is None


# ----------------------------------------------------------------------------- runs and figures


def _seed_of(run):
    import yaml

    return yaml.safe_load((run / "config.yaml").read_text())["train"]["seed"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moons")
    # CE with two seeds, the folder of seed 1 first in name order; FCL keeping its best validation model
    train(load_config(None, [*TINY, "train.seed=1"]), root / "a-ce-s1")
    train(load_config(None, [*TINY, "train.seed=0"]), root / "b-ce-s0")
    train(load_config(None, [*TINY, *FCL, "train.select=best_val_nll", "train.epochs=6"]), root / "c-fcl")
    return root


def independent_p1(run, xs, ys):
    """p(class 1) on the grid from the run's selected weights (selection.json: best.pt or checkpoint.pt),
    through a network built here, in float32 as trained, softmax in float64."""
    selection = json.loads((run / "selection.json").read_text())
    if selection["rule"] == "last":
        state = torch.load(run / "checkpoint.pt", weights_only=True)["model"]
    else:
        saved = torch.load(run / "best.pt", weights_only=True)
        assert saved["epoch"] == selection["epoch"]
        state = saved["model"]
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2, 10), torch.nn.ReLU(), torch.nn.Linear(10, 10),
                              torch.nn.ReLU(), torch.nn.Linear(10, 2))  # fmt: skip
    net.load_state_dict(state)
    grid = np.array([[x, y] for y in ys for x in xs], dtype=np.float32)
    with torch.no_grad():
        logits = net(torch.from_numpy(grid))
    return torch.softmax(logits.double(), 1)[:, 1].reshape(len(ys), len(xs))


def test_tiny_runs_train_and_the_fcl_run_keeps_its_best_validation_model(runs):
    for run in ("a-ce-s1", "b-ce-s0", "c-fcl"):
        logits = torch.load(runs / run / "logits.pt", weights_only=True)
        assert logits["test"]["logits"].shape == (160, 2) and sorted(logits) == ["test", "val"]
    assert (runs / "c-fcl" / "best.pt").exists() and not (runs / "b-ce-s0" / "best.pt").exists()


def test_figures_draw_fig5_and_fig7_from_the_saved_runs(runs, tmp_path):
    out = tmp_path / "figs"
    result = runner.invoke(app, ["figures", str(runs), "--out", str(out), "--only", "fcl-fig5,fcl-fig7"])
    assert result.exit_code == 0, result.output
    for name in ("fcl-fig5", "fcl-fig7"):
        assert (out / f"{name}.png").stat().st_size > 0 and (out / f"{name}.svg").stat().st_size > 0
    index = json.loads((out / "figures.json").read_text())
    assert [f["name"] for f in index["figures"]] == ["fcl-fig5", "fcl-fig7"] and not index["skipped"]
    assert "Fig. 7" in index["figures"][1]["caption"] and "Fig. 5" in index["figures"][0]["caption"]
    data = json.loads((out / "fcl-fig7.json").read_text())
    assert len(data["groups"]) == 2 and not data["left_out"]
    test_points = load_moons(240, 80, 160, noise=0.2, seed=0)[2].inputs.double()
    for label, panel in data["groups"].items():
        run = runs / panel["run"].rsplit("/", 1)[1]
        if "fcl" in label:
            assert panel["loss"] == "fcl (gamma=10, lambda_=1.5)" and run.name == "c-fcl"
        else:
            assert panel["loss"] == "ce" and run.name == "b-ce-s0" and _seed_of(run) == 0  # the first seed
        xs, ys, p1 = panel["xs"], panel["ys"], torch.tensor(panel["p1"], dtype=torch.float64)
        assert p1.shape == (len(ys), len(xs)) == (150, 150)
        # the grid spans the test points with a margin
        assert xs[0] < float(test_points[:, 0].min()) and xs[-1] > float(test_points[:, 0].max())
        assert ys[0] < float(test_points[:, 1].min()) and ys[-1] > float(test_points[:, 1].max())
        # the same float32 network on the same points, softmax in float64: equal to float64 rounding of the
        # logits' float32 ulps (|Δp| <= |Δlogit| / 4, Δlogit ~ 1e-6)
        assert torch.allclose(p1, independent_p1(run, xs, ys), rtol=0, atol=1e-6)
        # the ECE in the title is the 15-bin ECE of the saved test logits, recomputed here with loops
        saved = torch.load(run / "logits.pt", weights_only=True)["test"]
        probs = torch.softmax(saved["logits"].double(), 1)
        conf, pred = probs.max(1)
        total = 0.0
        for b in range(15):
            inside = (conf > b / 15) & (conf <= (b + 1) / 15)
            if inside.any():
                acc = (pred[inside] == saved["targets"][inside]).double().mean()
                total += float(inside.double().mean() * (conf[inside].mean() - acc).abs())
        assert panel["test_ece"] == pytest.approx(total, abs=1e-12)


def test_fig5_draws_the_fcl_runs_setting_else_the_papers(runs, tmp_path):
    groups = run_groups(find_runs([runs]))
    written, _ = draw_figures(groups, ["fcl-fig5"], tmp_path / "a")
    (curve,) = written["fcl-fig5"]["curves"]
    assert (curve["gamma"], curve["lambda"]) == (10.0, 1.5) and "fcl" in curve["source"]
    assert abs(h_reference(curve["root"], 10.0, 1.5)) <= 1e-10 and curve["h_at_1"] < 0
    ce_only = [g for g in groups if g.config["loss.name"] == "ce"]
    written, _ = draw_figures(ce_only, ["fcl-fig5"], tmp_path / "b")
    settings = [(c["gamma"], c["lambda"], c["source"]) for c in written["fcl-fig5"]["curves"]]
    assert settings == [(4.0, 1.5, "paper"), (2.0, 0.5, "paper"), (10.0, 1.5, "paper")]
    for c in written["fcl-fig5"]["curves"]:
        assert abs(h_reference(c["root"], c["gamma"], c["lambda"])) <= 1e-10


def test_fig7_leaves_out_runs_not_on_2d_points_and_refuses_when_none_is(runs, tmp_path):
    groups = run_groups(find_runs([runs]))
    other = RunSet("digits · mlp · ce", {"data.name": "digits", "loss.name": "ce"}, [runs / "b-ce-s0"], [[]])
    written, skipped = draw_figures([*groups, other], ["fcl-fig7"], tmp_path / "a")
    assert "data.name=digits is not a set of 2-D points" in written["fcl-fig7"]["left_out"]["digits · mlp · ce"]
    assert len(written["fcl-fig7"]["groups"]) == 2 and not skipped
    written, skipped = draw_figures([other], ["fcl-fig7"], tmp_path / "b")
    assert not written and skipped == {"fcl-fig7": FIGURES["fcl-fig7"][1]}
    assert "data.name=moons" in skipped["fcl-fig7"]


def test_figures_cli_refuses_fig7_on_image_runs(tmp_path):
    digits = tmp_path / "digits"
    train(load_config(None, ["data.name=digits", "data.ood.sets=[]", "data.val_size=260", "data.limit_train=200",
                             "model.width=8", "train.epochs=1", "train.num_threads=1", "train.calibrators=[]"]),
          digits)  # fmt: skip
    result = runner.invoke(app, ["figures", str(digits), "--out", str(tmp_path / "f"), "--only", "fcl-fig7"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert lines[0].startswith("skipped fcl-fig7:") and "data.name=moons" in lines[0]
    assert "no figure could be drawn" in lines[-1] and len(lines) == 2
    assert not (tmp_path / "f").exists()  # a refused command writes nothing, not even figures.json


def test_fig7_refuses_weights_that_do_not_reproduce_the_saved_logits(runs, tmp_path):
    copy = tmp_path / "runs" / "b-ce-s0"
    shutil.copytree(runs / "b-ce-s0", copy)
    state = torch.load(copy / "checkpoint.pt", weights_only=True)
    state["model"]["5.bias"] = state["model"]["5.bias"] + torch.tensor([1.0, -1.0])
    torch.save(state, copy / "checkpoint.pt")
    with pytest.raises(UserError, match="do not reproduce its logits.pt"):
        draw_figures(run_groups(find_runs([copy])), ["fcl-fig7"], tmp_path / "f")


def test_figures_list_needs_no_run():
    result = runner.invoke(app, ["figures", "--list"])
    assert result.exit_code == 0 and "fcl-fig5:" in result.output and "fcl-fig7:" in result.output
    bare = runner.invoke(app, ["figures"])
    assert bare.exit_code == 2 and "figures needs run folders" in bare.output
