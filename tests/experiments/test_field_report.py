"""The runner's metrics beyond ECE: stored with every evaluation, conformal sets after each calibrator
(`evaluate --conformal`), the report's `--metrics` columns with the over/under-confidence words, and the
one-line refusals of bad specs."""

import json

import pytest
import torch
from typer.testing import CliRunner

import torchcal.functional as F
from torchcal.experiments.cli import app
from torchcal.experiments.config import load_config
from torchcal.experiments.evaluation.evaluate import evaluate_run, load_logits, report
from torchcal.experiments.evaluation.field_metrics import parse_conformal
from torchcal.experiments.training.loop import train

runner = CliRunner()
TINY = ["data.name=digits", "data.ood.sets=[]", "data.val_size=260", "data.loader.batch_size=64", "model.width=16",
        "train.num_threads=1", "train.epochs=1"]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("field") / "ce"
    train(load_config(None, TINY), folder)
    return folder


def test_evaluate_stores_field_metrics_and_conformal_sets(run):
    result = evaluate_run(run, ("ts",), ("aps:alpha=0.1", "lac:alpha=0.2,mondrian=true"))
    logits = load_logits(run)
    probs, targets = torch.softmax(logits["test"]["logits"], 1), logits["test"]["targets"]
    test = result["uncalibrated"]["test"]
    assert test["signed_ece"] == pytest.approx(float(F.signed_calibration_error(probs, targets)), abs=1e-12)
    assert test["aurc"] == pytest.approx(float(F.aurc(probs, targets)), abs=1e-12)
    assert test["ece_over"] + test["ece_under"] == pytest.approx(test["ece"], abs=1e-12)
    for method in ("uncalibrated", "ts"):
        sets = result[method]["conformal"]
        assert set(sets) == {"aps:alpha=0.1", "lac:alpha=0.2,mondrian=true"}
        aps = sets["aps:alpha=0.1"]
        # ~180 held-out samples: coverage within a few binomial standard errors of 0.9
        assert 0.8 < aps["coverage"] <= 1 and aps["set_size"] >= 0.5
        assert len(aps["size_distribution"]) == 11
    saved = json.loads((run / "results.json").read_text())
    assert saved["ts"]["conformal"]["aps:alpha=0.1"] == result["ts"]["conformal"]["aps:alpha=0.1"]


def test_report_metrics_columns_and_direction_words(run, tmp_path):
    evaluate_run(run, ("ts",), ("aps:alpha=0.1",))
    markdown, csv_text = report(
        [run], tmp_path / "rep", "ts", metrics=("signed_ece", "ks", "coverage", "set_size")
    )
    lines = markdown.splitlines()
    header = next(line for line in lines if line.startswith("| method"))
    assert "signed ECE" in header and "conformal coverage" in header and "mean set size" in header
    row = next(line for line in lines if line.startswith("| digits"))
    assert row.count("over-confident") + row.count("under-confident") == 2  # uncalibrated and after TS
    assert (
        "signed_ece_pre_mean" in csv_text.splitlines()[0] and "set_size_post_mean" in csv_text.splitlines()[0]
    )
    plain, _ = report([run], tmp_path / "plain", "ts")
    assert "-confident" not in next(line for line in plain.splitlines() if line.startswith("| digits"))


def test_bad_specs_are_refused_in_one_line_and_write_nothing(run, tmp_path):
    before = (run / "results.json").read_bytes() if (run / "results.json").exists() else None
    for spec, words in [("thr:alpha=0.1", "score"), ("aps:alpha=1.5", "alpha"), ("aps:beta=1", "keys"),
                        ("aps:randomized=maybe", "true or false")]:  # fmt: skip
        out = runner.invoke(app, ["evaluate", str(run), "--calibrators", "ts", "--conformal", spec])
        assert out.exit_code == 2 and words in out.output and len(out.output.strip().splitlines()) == 1, (
            out.output
        )
    after = (run / "results.json").read_bytes() if (run / "results.json").exists() else None
    assert before == after
    out = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "r"), "--metrics", "ece_sideways"])
    assert out.exit_code == 2 and "ece_sideways" in out.output and not (tmp_path / "r").exists()


def test_parse_conformal():
    assert parse_conformal("raps:alpha=0.05,lambda=0.2,k_reg=2,randomized=false") == (
        "raps:alpha=0.05,lambda=0.2,k_reg=2,randomized=false",
        {"score": "raps", "alpha": 0.05, "lambda_": 0.2, "k_reg": 2, "randomized": False},
    )
    assert parse_conformal("lac") == ("lac", {"score": "lac", "alpha": 0.1})


def test_html_report_shows_columns_and_figures_only_when_asked(run, tmp_path):
    from torchcal.experiments.reports.html import html_report

    evaluate_run(run, ("ts",), ("aps:alpha=0.1",))
    asked = html_report([run], tmp_path / "asked", "ts", extra_metrics=("signed_ece", "set_size")).read_text()
    assert "signed ECE" in asked and "mean set size" in asked and "ECE under" not in asked
    assert "risk-coverage (max probability)" in asked and "conformal set sizes (aps:alpha=0.1)" in asked
    plain = html_report([run], tmp_path / "plain", "ts").read_text()
    assert "signed ECE" not in plain and "risk-coverage" not in plain
    assert asked.count("data:image/png;base64,") == plain.count("data:image/png;base64,") + 2


def test_report_ranks_rows_with_a_paired_bootstrap(run, tmp_path):
    other = tmp_path / "fl"
    train(load_config(None, [*TINY, "loss.name=fl-3"]), other)
    evaluate_run(other, ("ts",))
    evaluate_run(run, ("ts",))
    markdown, _ = report([run, other], tmp_path / "rep", "ts", metrics=("signed_ece",))
    ranking = markdown.split("Rows ranked by ECE after ts")[1]
    assert "(best)" in ranking and "p = " in ranking
    # the difference printed is ECE(row) − ECE(best) on the same samples, recomputed here
    from torchcal.experiments.evaluation.evaluate import post_calibration_probs

    (pa, ya), (pb, yb) = post_calibration_probs(run, "ts"), post_calibration_probs(other, "ts")
    assert torch.equal(ya, yb)
    gap = abs(float(F.ece(pa, ya) - F.ece(pb, yb)))
    assert f"+{100 * gap:.2f} [" in ranking
    plain, _ = report([run, other], tmp_path / "plain", "ts")
    assert "Rows ranked" not in plain


def test_html_report_shows_a_missing_value_as_a_dash_not_nan(run, tmp_path):
    """A calibrator without a temperature (histogram binning) leaves the T column NaN in every run: the page
    shows "-" there (the Markdown's empty cells), never "nan" or "nan ± nan"; the other cells keep their
    numbers, which equal the saved results ×100 (one run: no ± std)."""
    import re

    from torchcal.experiments.reports.html import html_report

    evaluate_run(run, ("histogram",))
    page = html_report([run], tmp_path / "hist", "histogram").read_text()
    table = page[page.index("<table>") : page.index("</table>")]
    cells = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td>(.*?)</td>", table, re.S)]
    assert "nan" not in table.lower()
    assert cells[-2] == "-"  # the T (histogram) column, before the runs
    saved = json.loads((run / "results.json").read_text())
    ece_pre, ece_post = (100 * saved[k]["test"]["ece"] for k in ("uncalibrated", "histogram"))
    assert f"{ece_pre:.2f} → {ece_post:.2f}" in cells


def test_markdown_report_brackets_a_temperature_only_where_there_is_one(run, tmp_path):
    """report.md put "(nan)" after every ECE cell of a calibrator without a temperature (histogram binning)
    and said the brackets held its temperature; with ts the bracket is the fitted T of results.json."""
    from torchcal.experiments.evaluation.evaluate import report

    evaluate_run(run, ("histogram", "ts"))
    md_hist, _ = report([run], tmp_path / "hist", "histogram")
    assert "nan" not in md_hist.lower() and "temperature in brackets" not in md_hist
    md_ts, _ = report([run], tmp_path / "ts", "ts")
    saved = json.loads((run / "results.json").read_text())
    assert f"({saved['ts']['parameters']['temperature_']:.2f})" in md_ts
    assert "temperature in brackets" in md_ts
