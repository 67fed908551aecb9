"""No silent wrong result in the runner (issue 24 §1): a report counts each run and each seed once; a
transformer checkpoint without a usable tokenizer is refused; a calibrator's search that ends on a bound
is recorded in results.json and the report."""

import os
import shutil

import pytest
from typer.testing import CliRunner

from torchcal.experiments.cli import app
from torchcal.experiments.config import load_config
from torchcal.experiments.evaluation.evaluate import collect_groups, report
from torchcal.experiments.training.loop import train

runner = CliRunner()
TINY = ["data.name=digits", "data.ood.sets=[]", "data.val_size=260", "data.loader.batch_size=64", "model.width=16",
        "train.num_threads=1", "train.epochs=1", "train.calibrators=[ts]"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """ce with seeds 0 and 1 (one epoch each)."""
    root = tmp_path_factory.mktemp("runs")
    for seed in (0, 1):
        train(load_config(None, [*TINY, f"train.seed={seed}"]), root / f"ce-s{seed}")
    return root


# -- a report counts each run and each seed once -----------------------------------------------------------


def test_a_folder_given_twice_is_counted_once(runs, tmp_path):
    with pytest.warns(UserWarning, match="is given twice"):
        groups = collect_groups([runs / "ce-s0", runs / "ce-s0", runs / ".." / runs.name / "ce-s0"])
    assert len(groups) == 1 and groups[0].seeds == [0] and groups[0].stats["ece pre"][2] == 1
    os.symlink(runs / "ce-s0", tmp_path / "link")
    with pytest.warns(UserWarning, match="is given twice"):
        groups = collect_groups([runs / "ce-s0", tmp_path / "link", runs / "ce-s1"])
    assert groups[0].seeds == [0, 1] and groups[0].stats["ece pre"][2] == 2


def test_a_copied_run_is_left_out_of_its_row_naming_both(runs, tmp_path):
    shutil.copytree(runs / "ce-s0", tmp_path / "copy")
    with pytest.warns(UserWarning, match=r"copy repeats seed 0 of .*ce-s0 .* counts each seed once"):
        markdown, csv_text = report([runs / "ce-s0", tmp_path / "copy", runs / "ce-s1"], tmp_path / "rep")
    assert "| digits · mlp · ce | 0, 1 |" in markdown
    groups = collect_groups([runs / "ce-s0", runs / "ce-s1"])
    with pytest.warns(UserWarning):
        again = collect_groups([runs / "ce-s0", tmp_path / "copy", runs / "ce-s1"])
    assert again[0].stats == groups[0].stats  # the same mean, std and n = 2 as without the copy


def test_report_of_the_same_folder_twice_from_the_cli(runs, tmp_path):
    result = runner.invoke(
        app, ["report", str(runs / "ce-s0"), str(runs / "ce-s0"), "--out", str(tmp_path / "r")]
    )
    assert result.exit_code == 0, result.output
    assert "is given twice" in result.output
    rows = (tmp_path / "r" / "report.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert len(rows) == 2 and rows[1].split(",")[header.index("n_runs")] == "1"


# -- a calibrator's search that ends on a bound is recorded ------------------------------------------------


def test_a_search_on_a_bound_is_in_results_json_and_the_report(runs, tmp_path):
    import json

    import torch

    run = tmp_path / "sharp"
    shutil.copytree(runs / "ce-s0", run)
    saved = torch.load(run / "logits.pt", weights_only=True)
    for split in saved.values():  # a model 1000× over-confident: its ECE-optimal T lies beyond 10
        split["logits"] = 1000 * split["logits"]
    torch.save(saved, run / "logits.pt")
    spec = "ts:objective=ece:extend=false"
    result = runner.invoke(app, ["calibrate", str(run), "-m", spec])
    assert result.exit_code == 0, result.output
    assert (
        "warning: calibrator 'ts:objective=ece:extend=false'" in result.output
        and "an edge of its grid" in result.output
    )
    res = json.loads((run / "results.json").read_text())
    assert res[spec]["parameters"]["temperature_"] == 10.0
    assert len(res[spec]["warnings"]) == 1 and "an edge of its grid" in res[spec]["warnings"][0]
    result = runner.invoke(app, ["report", str(run), str(runs / "ce-s1"), "--out", str(tmp_path / "rep"),
                                 "--calibrator", spec])  # fmt: skip
    assert result.exit_code == 0, result.output
    markdown = (tmp_path / "rep" / "report.md").read_text()
    assert f"**Warnings of the {spec} fits** (1; also in each run's results.json):" in markdown
    assert f"- digits · mlp · ce: {run}: " in markdown and "an edge of its grid" in markdown
    page = (tmp_path / "rep" / "report.html").read_text()
    assert f"Warnings of the {spec} fits (1; also in each run's results.json)" in page
    # the search that follows the optimum beyond the grid (the default) says it left the grid, and records it
    result = runner.invoke(app, ["calibrate", str(run), "-m", "ts:objective=ece"])
    assert result.exit_code == 0 and "left its grid T in [0.1, 10]" in result.output
    res = json.loads((run / "results.json").read_text())["ts:objective=ece"]
    assert res["parameters"]["temperature_"] > 10 and res["search"]["T"]["grid"] == [0.1, 10.0]
    assert res["search"]["T"]["chosen"] == res["parameters"]["temperature_"]
