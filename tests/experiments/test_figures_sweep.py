"""The figures over a set of runs: FCL Fig. 6 (test metrics before and after temperature scaling against the
loss argument a sweep varies) and focal temperature scaling Fig. 8 (the optimal T against γ_ev). The data
of each figure against the report's numbers, a float64 brute-force search and the calibrator; the x axis
found from the configs; the CLI's one-line errors."""

import csv
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.reference import metrics as R
from torchcal.calibrators import FocalTemperatureScaling
from torchcal.experiments.cli import app
from torchcal.experiments.config import load_config
from torchcal.experiments.errors import UserError
from torchcal.experiments.evaluation.evaluate import evaluate_run, report
from torchcal.experiments.reports.figures import (
    FIGURES,
    RunSet,
    draw_figures,
    find_runs,
    loss_arguments,
    optimal_temperatures,
    run_groups,
    sweep_lines,
)
from torchcal.experiments.sweep import Sweep, expand
from torchcal.experiments.training.loop import train

runner = CliRunner()
TINY = ["data.name=digits", "data.ood.sets=[]", "data.val_size=260", "model.width=8", "train.epochs=2",
        "train.num_threads=1", "train.calibrators=[]"]  # fmt: skip
COARSE_T = tuple(round(0.1 * i, 1) for i in range(1, 31))  # T = 0.1, ..., 3.0: the tests' grid


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A sweep over FCL's λ (folders named as `torchcal sweep` names them), FL runs beside it (FCL with
    λ = 0 is FL) and one cross-entropy run; nothing evaluated yet (no results.json)."""
    root = tmp_path_factory.mktemp("fig6")
    sweep = Sweep(out=root / "sweep", grid={"loss.kwargs.lambda_": [0, 1.5], "train.seed": [0, 1]},
                  overrides=[*TINY, "loss.name=fcl", "loss.kwargs.gamma=3"])  # fmt: skip
    for run in expand(sweep):
        train(load_config(None, run["overrides"]), sweep.out / run["name"])
    for seed in (0, 1):
        train(load_config(None, [*TINY, "loss.name=fl-3", f"train.seed={seed}"]), root / "fl" / f"s{seed}")
    train(load_config(None, [*TINY, "loss.name=ce"]), root / "ce" / "s0")
    return root


def listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_fig6_from_a_sweep_equals_the_report(runs, tmp_path):
    folders = find_runs([runs / "sweep", runs / "fl"])
    assert [p.name for p in folders[:4]] == ["lambda_-0_seed-0", "lambda_-0_seed-1", "lambda_-1.5_seed-0",
                                             "lambda_-1.5_seed-1"]  # fmt: skip
    before = listing(runs)
    # nothing evaluated yet: the metrics are computed as torchcal evaluate computes them, nothing is written
    fresh, skipped = draw_figures(run_groups(folders), ["fcl-fig6"], tmp_path / "a")
    assert not skipped and listing(runs) == before
    for run in folders:
        evaluate_run(run, ("ts",))
    written, _ = draw_figures(run_groups(folders), ["fcl-fig6"], tmp_path / "b")
    data = written["fcl-fig6"]
    assert data == fresh["fcl-fig6"]  # from results.json: the same numbers
    assert data["key"] == "lambda_" and list(data["lines"]) == ["FCL (γ = 3)", "FL (γ = 3)"]
    fcl, fl = data["lines"]["FCL (γ = 3)"], data["lines"]["FL (γ = 3)"]
    assert fcl["x"] == [0.0, 1.5] and fcl["n"] == [2, 2] and not fcl["reference"]
    assert fl["x"] == [None] and fl["n"] == [2] and fl["reference"]
    # each point: mean and std over its seeds of what results.json holds
    for x, seeds in zip(fcl["x"], fcl["runs"], strict=True):
        res = [json.loads((folder / "results.json").read_text()) for folder in map(Path, seeds)]
        for metric, when in (
            ("nll", "uncalibrated"),
            ("ece", "ts"),
            ("classwise_ece", "ts"),
            ("error", "uncalibrated"),
        ):
            values = [r[when]["test"][metric] for r in res]
            got = fcl["metrics"][f"{metric} {'pre' if when == 'uncalibrated' else 'post'}"]
            j = fcl["x"].index(x)
            assert got["mean"][j] == pytest.approx(sum(values) / 2, rel=1e-14)
            assert got["band"][j] == pytest.approx(abs(values[0] - values[1]) / math.sqrt(2), rel=1e-12)
    # the report's rows (×100): the same numbers
    report(folders, tmp_path / "rep", "ts")
    rows = list(csv.DictReader((tmp_path / "rep" / "report.csv").open()))
    lines = [(fcl, j) for j in range(2)] + [(fl, 0)]
    for line, j in lines:
        row = next(r for r in rows if set(r["runs"].split(";")) == set(line["runs"][j]))
        for col in ("nll", "ece", "adaece", "classwise_ece"):
            for when in ("pre", "post"):
                mean = line["metrics"][f"{col} {when}"]["mean"][j]
                assert 100 * mean == pytest.approx(float(row[f"{col}_{when}_mean"]), rel=1e-12)
        assert 100 * line["metrics"]["error pre"]["mean"][j] == pytest.approx(
            float(row["error_pre_mean"]), rel=1e-12
        )
    # FCL with λ = 0 is FL with the same γ: the same training, the same numbers
    assert fcl["metrics"]["ece pre"]["mean"][0] == pytest.approx(
        fl["metrics"]["ece pre"]["mean"][0], rel=1e-5
    )
    # the table beside the figure; the standard-error band
    table = list(csv.reader((tmp_path / "b" / "fcl-fig6.csv").open()))
    assert table[0] == ["line", "reference", "lambda_", "metric", "mean", "band", "n", "runs"]
    assert len(table) == 1 + 3 * 9  # three points (two λ and the reference) × nine panels
    sem, _ = draw_figures(run_groups(folders), ["fcl-fig6"], tmp_path / "c", band="sem")
    assert sem["fcl-fig6"]["lines"]["FCL (γ = 3)"]["metrics"]["nll pre"]["band"] == pytest.approx(
        [b / math.sqrt(2) for b in fcl["metrics"]["nll pre"]["band"]], rel=1e-12
    )
    index = json.loads((tmp_path / "b" / "figures.json").read_text())
    assert index["figures"][0]["name"] == "fcl-fig6" and "Fig. 6" in index["figures"][0]["caption"]
    assert (tmp_path / "b" / "fcl-fig6.png").stat().st_size > 0 and (tmp_path / "b" / "fcl-fig6.svg").exists()


def group(name, **kwargs):
    config = {"data.name": "digits", "model.name": "mlp", "loss.name": name, "loss.kwargs": kwargs}
    return RunSet(name, config, runs=[f"{name}-{sorted(kwargs.items())}"])  # type: ignore[list-item]


def test_the_x_axis_is_the_one_loss_argument_that_varies():
    assert loss_arguments({"loss.name": "fl-3", "loss.kwargs": {}}) == ("FocalLoss", {"gamma": 3.0})
    assert loss_arguments({"loss.name": "fcl", "loss.kwargs": {"lambda_": 0.5}}) == (
        "FocalCalibrationLoss",
        {"gamma": 4.0, "lambda_": 0.5},
    )  # the default γ of FCL
    key, lines = sweep_lines([group("fcl", lambda_=0.5), group("fcl", lambda_=2), group("fl-4")])
    assert key == "lambda_" and [(line.label, line.reference) for line in lines] == [
        ("FCL (γ = 4)", False),
        ("FL (γ = 4)", True),
    ]
    assert sorted(lines[0].points) == [0.5, 2.0] and list(lines[1].points) == [None]
    # γ in the loss's name (fl-1, fl-3) is a sweep over γ; cross entropy has no γ: a reference
    key, lines = sweep_lines([group("fl-1"), group("fl-3"), group("ce")])
    assert key == "gamma" and [line.label for line in lines] == ["FL", "CE"]
    assert sorted(lines[0].points) == [1.0, 3.0]
    both = [group("fcl", lambda_=a, gamma=b) for a in (1, 2) for b in (2, 3)]
    with pytest.raises(UserError, match=r"vary several loss arguments \(gamma, lambda_\); .*--sweep-key"):
        sweep_lines(both)
    key, lines = sweep_lines(both, "loss.kwargs.lambda_")
    assert key == "lambda_" and [line.label for line in lines] == ["FCL (γ = 2)", "FCL (γ = 3)"]
    key, lines = sweep_lines(both, "gamma")
    assert [line.label for line in lines] == ["FCL (λ = 1)", "FCL (λ = 2)"]
    assert sweep_lines([group("fl-3"), group("fcl")]) is None  # nothing varies within a loss
    with pytest.raises(UserError, match=r"--sweep-key beta: no run's loss takes it; .*gamma, lambda_"):
        sweep_lines(both, "beta")


def brute_force_temperatures(logits, targets, gammas, temps):
    """(T, ECE) per γ: the first T of the grid minimising the equal-mass ECE of the focal map (the reference
    formula) of softmax(z / T), by loops in float64."""
    out = []
    for gamma in gammas:
        eces = []
        for t in temps:
            probs = torch.softmax(logits.double() / t, 1).tolist()
            eces.append(R.adaece([R.focal_map(row, gamma) for row in probs], targets.tolist()))
        best = min(range(len(temps)), key=lambda i: (eces[i], i))
        out.append((temps[best], eces[best]))
    return out


@pytest.mark.parametrize("scale", [0.5, 3.0])  # an under- and an over-confident model
def test_the_optimal_temperature_minimises_the_ece_over_the_grid(scale):
    g = torch.Generator().manual_seed(int(10 * scale))
    z = 2 * torch.randn(150, 4, generator=g, dtype=torch.float64)
    y = torch.multinomial(torch.softmax(z, 1), 1, generator=g).squeeze(1)
    gammas, temps = [-0.5, 0.05, 0.5, 2.0], [0.25 * i for i in range(1, 17)]
    got = optimal_temperatures(scale * z, y, gammas, temps)
    expected = brute_force_temperatures(scale * z, y, gammas, temps)
    for row, (t, ece) in zip(got, expected, strict=True):
        # both in float64; the ECEs differ by rounding only (~1e-16 per sample), far below their gaps
        assert row["T"] == t and row["ece"] == pytest.approx(ece, rel=1e-11, abs=1e-14)
        assert row["edge"] == (t in (temps[0], temps[-1]))
        # the calibrator with γ fixed finds the same T (its own search of the same objective)
        fts = FocalTemperatureScaling(gammas=[row["gamma_ev"]], temperatures=temps, extend=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fts.fit(scale * z, y)
        assert fts.temperature_ == t and bool(caught) == row["edge"]  # it warns when T is an end of the grid


def test_fig8_one_line_per_training_loss(runs, tmp_path):
    folders = find_runs([runs / "sweep", runs / "fl", runs / "ce"])
    gammas = (-0.5, 0.5, 1.0)
    written, skipped = draw_figures(run_groups(folders), ["fts-fig8"], tmp_path / "f", gammas_ev=gammas,
                                    temperatures=COARSE_T)  # fmt: skip
    assert not skipped
    data = written["fts-fig8"]
    assert data["gammas_ev"] == list(gammas)
    lines = data["lines"]
    assert [(label, line["gamma_tr"], line["n"]) for label, line in lines.items()] == [
        ("CE, γ_tr = 0", 0.0, 1),
        ("FL, γ_tr = 3", 3.0, 2),
        ("FCL (γ = 3, λ = 0)", None, 2),
        ("FCL (γ = 3, λ = 1.5)", None, 2),
    ]
    fl = lines["FL, γ_tr = 3"]
    per_run = []
    for run in sorted(fl["runs"]):
        val = torch.load(f"{run}/logits.pt", weights_only=True)["val"]
        table = optimal_temperatures(val["logits"], val["targets"], gammas, COARSE_T)
        assert fl["runs"][run] == table
        per_run.append([r["T"] for r in table])
    assert fl["T"]["mean"] == pytest.approx([(a + b) / 2 for a, b in zip(*per_run, strict=True)], rel=1e-14)
    assert fl["T"]["band"] == pytest.approx(
        [abs(a - b) / math.sqrt(2) for a, b in zip(*per_run, strict=True)]
    )
    table = list(csv.reader((tmp_path / "f" / "fts-fig8.csv").open()))
    assert table[0] == ["line", "gamma_tr", "run", "gamma_ev", "T", "val_ece", "edge"]
    assert len(table) == 1 + 7 * len(gammas)  # every run × every γ_ev
    assert "Fig. 8" in FIGURES["fts-fig8"][0]


def test_a_curve_counts_each_run_and_each_seed_once(runs, tmp_path):
    """A run given twice (alone and in its folder), through a link, or copied to another folder is one seed
    of its curve, as in the report (decision 82): before, `figures fl fl/s0` averaged s0 twice (n = 3, the
    band shrunk). The curve's mean and std equal those of the two distinct runs' metrics.jsonl values."""
    import shutil

    from torchcal.experiments.reports.figures import curve

    fl = runs / "fl"
    copy = tmp_path / "copy-of-s1"
    shutil.copytree(fl / "s1", copy)
    (tmp_path / "link").symlink_to(fl / "s0")
    messages = []
    groups = run_groups(find_runs([fl, fl / "s0", tmp_path / "link", copy]), warn=messages.append)
    (group,) = groups
    assert group.runs == [fl / "s0", fl / "s1"] and group.seeds == [0, 1]
    assert len(messages) == 3 and "given twice" in messages[0] and "given twice" in messages[1]
    assert "repeats seed 1" in messages[2] and str(copy) in messages[2]
    logged = [
        [json.loads(line) for line in (fl / s / "metrics.jsonl").read_text().splitlines()] for s in ("s0", "s1")
    ]
    for epoch, (a, b) in enumerate(zip(*logged, strict=True)):
        got = curve(group, lambda r: r.get("test_nll"))
        assert got is not None and got.n == 2
        # mean and sample std of two float64 values: exact up to a few ulps of the sums
        assert float(got.mean[epoch]) == pytest.approx((a["test_nll"] + b["test_nll"]) / 2, rel=1e-14)
        spread = abs(a["test_nll"] - b["test_nll"]) / math.sqrt(2)
        assert float(got.band[epoch]) == pytest.approx(spread, rel=1e-12)
    args = ["figures", str(fl), str(fl / "s0"), "--only", "focal-fig1", "--out", str(tmp_path / "f")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "is given twice" in result.output and "(n=2)" not in result.output
    index = json.loads((tmp_path / "f" / "figures.json").read_text())
    assert index["figures"][0]["runs"] == [str(fl / "s0"), str(fl / "s1")]


def test_cli_draws_both_from_a_sweep_and_refuses_in_one_line(runs, tmp_path):
    out = tmp_path / "rep" / "figures"
    result = runner.invoke(app, ["figures", str(runs / "sweep"), str(runs / "fl"), "--out", str(out),
                                 "--only", "fcl-fig6,fts-fig8", "--gamma-ev", "0,1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    index = json.loads((out / "figures.json").read_text())
    assert [f["name"] for f in index["figures"]] == ["fcl-fig6", "fts-fig8"]
    assert all((out / f"{n}{s}").exists() for n in ("fcl-fig6", "fts-fig8") for s in (".png", ".svg", ".csv"))
    reported = runner.invoke(
        app, ["report", *map(str, find_runs([runs / "sweep"])), "--out", str(out.parent)]
    )
    assert reported.exit_code == 0, reported.output
    page = (out.parent / "report.html").read_text()
    assert '<img src="figures/fcl-fig6.png"' in page and '<img src="figures/fts-fig8.png"' in page
    # one group of runs, nothing varies: fcl-fig6 is skipped with what it needs
    alone = runner.invoke(app, ["figures", str(runs / "fl"), "--out", str(tmp_path / "g"), "--only", "fcl-fig6,fts-fig8",
                                "--gamma-ev", "0"])  # fmt: skip
    assert (
        alone.exit_code == 0
        and "skipped fcl-fig6: no run logged its data (train with a sweep over one loss argument, e.g. "
        in alone.output
    )
    for args, message in [
        (["--sweep-key", "beta"], "--sweep-key beta: no run's loss takes it"),
        (["--gamma-ev", "-1"], "--gamma-ev must be comma-separated numbers > -1"),
        (["--gamma-ev", "x"], "--gamma-ev must be comma-separated numbers > -1"),
        (["--calibrator", "tss"], "unknown calibrator 'tss'"),
    ]:
        bad = runner.invoke(app, ["figures", str(runs / "sweep"), "--out", str(tmp_path / "h"), "--only",
                                  "fcl-fig6,fts-fig8", *args])  # fmt: skip
        assert bad.exit_code == 2 and message in bad.output and len(bad.output.strip().splitlines()) == 1
    assert not (tmp_path / "h").exists()


def test_drawing_every_figure_skips_fig6_when_several_arguments_vary(runs, tmp_path):
    train(load_config(None, [*TINY, "loss.name=fl-1"]), tmp_path / "fl-1")  # γ varies too, beside FCL's λ
    paths = [str(runs / "sweep"), str(runs / "fl"), str(tmp_path / "fl-1")]
    result = runner.invoke(app, ["figures", *paths, "--out", str(tmp_path / "all"), "--gamma-ev", "0"])
    assert result.exit_code == 0, result.output
    assert "skipped fcl-fig6: the runs vary several loss arguments (gamma, lambda_)" in result.output
    assert (tmp_path / "all" / "fts-fig8.png").exists() and not (tmp_path / "all" / "fcl-fig6.png").exists()
    asked = runner.invoke(app, ["figures", *paths, "--out", str(tmp_path / "one"), "--only", "fcl-fig6"])
    assert asked.exit_code == 2 and "choose the x axis with --sweep-key" in asked.output
    assert len(asked.output.strip().splitlines()) == 1 and not (tmp_path / "one").exists()
    chosen = runner.invoke(app, ["figures", *paths, "--out", str(tmp_path / "two"), "--only", "fcl-fig6",
                                 "--sweep-key", "lambda_"])  # fmt: skip
    assert chosen.exit_code == 0, chosen.output
