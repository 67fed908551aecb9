"""No silent wrong result in the runner (issue 24 §1): a report counts each run and each seed once; a
transformer checkpoint without a usable tokenizer is refused; a calibrator's search that ends on a bound
is recorded in results.json and the report."""

import os
import shutil

import pytest
from typer.testing import CliRunner

from torchcal.experiments.cli import app
from torchcal.experiments.config import load_config
from torchcal.experiments.evaluate import collect_groups, report
from torchcal.experiments.train import train

runner = CliRunner()
TINY = ["data.name=digits", "data.ood=", "data.val_size=260", "data.batch_size=64", "model.width=16",
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
