"""The runner, reports and CLI never mislead (issue 12): report rows average only runs that differ in the
seed, resume never ignores an argument, the saved config is what ran, degenerate values and user errors
are refused before anything is written (one line, exit status 2), files follow the umask, calibrators are
saved and results accumulate, damaged files are named."""

import json
import os
import shutil
import stat

import pytest
import torch
import yaml
from typer.testing import CliRunner

from torchcal.experiments.cli import app
from torchcal.experiments.config import ConfigError, load_config
from torchcal.experiments.errors import RunError
from torchcal.experiments.evaluation.evaluate import collect_groups, evaluate_run, report
from torchcal.experiments.training.loop import read_metrics, train

runner = CliRunner()
TINY = ["data.name=digits", "data.ood.sets=[]", "data.val_size=260", "data.loader.batch_size=64", "model.width=16",
        "train.num_threads=1", "train.calibrators=[]"]  # fmt: skip  # calibrators: as each test asks


def tiny(*extra):
    return load_config(None, [*TINY, *extra])


def snapshot(folder):
    """Every file under ``folder`` with its bytes: what a refused command must leave unchanged."""
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """ce seeds 0 and 1 for 1 epoch, ce seed 0 for 2 epochs, and an unfinished run (1 of 2 epochs)."""
    root = tmp_path_factory.mktemp("runs")
    train(tiny("train.epochs=1", "train.seed=0"), root / "ce-e1-s0")
    train(tiny("train.epochs=1", "train.seed=1"), root / "ce-e1-s1")
    train(tiny("train.epochs=2", "train.seed=0"), root / "ce-e2-s0")
    train(tiny("train.epochs=2", "train.seed=0"), root / "unfinished", stop_after=1)
    (root / "not-a-run").mkdir()
    return root


# -- 1. silent wrong results -------------------------------------------------------------------------------


def test_report_rows_average_only_runs_that_differ_in_the_seed(runs, tmp_path):
    folders = [runs / n for n in ("ce-e1-s0", "ce-e1-s1", "ce-e2-s0", "unfinished", "not-a-run")]
    with pytest.warns(UserWarning) as caught:
        markdown, csv_text = report(folders, tmp_path / "rep")
    messages = " ".join(str(w.message) for w in caught)
    assert "unfinished" in messages and "not-a-run" in messages  # skipped, named, the report goes on
    assert "| digits · mlp · ce [train.epochs=1] | 0, 1 |" in markdown
    assert "| digits · mlp · ce [train.epochs=2] | 0 |" in markdown
    rows = {r.split(",")[0]: r for r in csv_text.splitlines()[1:]}
    assert len(rows) == 2
    one = rows["digits · mlp · ce [train.epochs=1]"]
    assert f"{runs / 'ce-e1-s0'};{runs / 'ce-e1-s1'}" in one and ",2,0, 1," in one.replace('"', "")
    assert f"- digits · mlp · ce [train.epochs=2]: {runs / 'ce-e2-s0'}" in markdown  # the runs of each row
    groups = collect_groups(folders[:3])
    by_label = {g.label: g for g in groups}
    ece = [evaluate_run(runs / n, ("ts",))["uncalibrated"]["test"]["ece"] for n in ("ce-e1-s0", "ce-e1-s1")]
    mean = by_label["digits · mlp · ce [train.epochs=1]"].stats["ece pre"]
    assert mean[2] == 2 and abs(mean[0] - 100 * sum(ece) / 2) < 1e-9


def test_report_of_only_unfinished_runs_is_refused_and_writes_nothing(runs, tmp_path):
    with pytest.warns(UserWarning, match="unfinished"), pytest.raises(RunError, match="no finished run"):
        report([runs / "unfinished"], tmp_path / "rep")
    assert not (tmp_path / "rep").exists()
    result = runner.invoke(app, ["report", str(runs / "unfinished"), "--out", str(tmp_path / "rep")])
    assert result.exit_code == 2 and "no finished run" in result.output and not (tmp_path / "rep").exists()


def test_resume_refuses_changes_and_never_ignores_an_argument(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs / "ce-e1-s0", run)
    before = snapshot(run)
    for args in (["loss.name=fl-3"], ["optim.lr=0.1"], ["train.epochs=2", "model.width=32"]):
        result = runner.invoke(app, ["train", "-o", str(run), "--resume", *args])
        assert result.exit_code == 2, result.output
        assert "cannot change what it computes" in result.output and args[-1].split("=")[0] in result.output
        assert snapshot(run) == before
    config = tmp_path / "other.yaml"
    config.write_text("loss:\n  name: dfl\n")
    result = runner.invoke(app, ["train", str(config), "-o", str(run), "--resume"])
    assert result.exit_code == 2 and "loss.name" in result.output and snapshot(run) == before


def test_resume_with_more_epochs_equals_the_longer_run(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs / "ce-e1-s0", run)
    evaluate_run(run, ("ts",))
    assert (run / "results.json").exists() and (run / "calibrators" / "ts.pt").exists()
    result = runner.invoke(app, ["train", "-o", str(run), "--resume", "train.epochs=2"])
    assert result.exit_code == 0, result.output
    assert "removed" in result.output  # the results of the 1-epoch model no longer apply
    assert not (run / "results.json").exists() and not (run / "calibrators").exists()
    longer = torch.load(runs / "ce-e2-s0" / "checkpoint.pt", weights_only=True)["model"]
    resumed = torch.load(run / "checkpoint.pt", weights_only=True)["model"]
    for name in longer:
        assert torch.equal(longer[name], resumed[name]), name
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["train"]["epochs"] == 2  # the saved config is what ran
    assert saved["meta"]["resumes"] == [{"from_epoch": 1, "changed": {"train.epochs": [1, 2]}}]
    assert [r["epoch"] for r in read_metrics(run)] == [0, 1]
    result = runner.invoke(app, ["train", "-o", str(run), "--resume", "train.epochs=1"])
    assert result.exit_code == 2 and "fewer than the 2 epochs" in result.output
    # the run's own config file, given again with --resume, is no change
    same = tmp_path / "same.yaml"
    same.write_text(yaml.safe_dump({k: v for k, v in saved.items() if k != "meta"}))
    before = snapshot(run)
    result = runner.invoke(app, ["train", str(same), "-o", str(run), "--resume"])
    assert result.exit_code == 0, result.output
    assert {p: b for p, b in snapshot(run).items() if p.name == "logits.pt"} == {
        p: b for p, b in before.items() if p.name == "logits.pt"
    }  # a finished run resumed without more epochs keeps its logits


def test_saved_config_is_what_ran(tmp_path):
    with pytest.warns(UserWarning, match="data.val_size=5000 adjusted to 260"):
        train(tiny("train.epochs=1", "data.val_size=5000"), tmp_path / "run")
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    logits = torch.load(tmp_path / "run" / "logits.pt", weights_only=True)
    assert saved["data"]["val_size"] == 260 == len(logits["val"]["targets"])
    assert saved["meta"]["adjusted"]["data.val_size"]["requested"] == 5000
    assert saved["meta"]["device"] == "cpu" and saved["meta"]["num_classes"] == 10
    # resuming with the original request is no change
    train(tiny("train.epochs=1", "data.val_size=5000"), tmp_path / "run", resume=True)


@pytest.mark.parametrize(
    "override, message",
    [
        (["train.epochs=0"], "train.epochs must be >= 1"),
        (["model.width=0"], "model.width must be >= 1"),
        (["data.loader.batch_size=0"], "data.loader.batch_size must be >= 1"),
        (["data.loader.eval_batch_size=-5"], "data.loader.eval_batch_size must be >= 1"),
        (["loss.name=adafocal", "loss.update_every=-1"], "loss.update_every must be >= 0"),
        (["loss.update_every=3"], "applies only to losses updated"),
        (["loss.update_schedule=[[2, 1]]"], "loss.update_schedule=[[2, 1]] applies only to losses updated"),
        (["loss.name=adafocal", "loss.update_schedule=[[2, 1], [1, 0]]"], "loss.update_schedule: the epochs"),
        (["loss.name=adafocal", "train.epochs=3", "loss.update_schedule=[[3, 1]]"], "would never apply"),
        (["loss.name=adafocal", "loss.update_schedule=[[1]]"], "loss.update_schedule[0]"),
        (["optim.lr=.nan"], "optim.lr must be a finite number"),
        (["optim.lr=0"], "optim.lr must be > 0"),
        (["optim.milestones=[5, 2]"], "optim.milestones must be increasing"),
        (["loss.reduction=none"], "loss.reduction must be 'mean' or 'sum'"),
        (["loss.name=fl-3", "loss.kwargs.gama=2"], "loss.kwargs"),
        (
            ["train.calibrators=[ts, nope]"],
            "train.calibrators (multiclass outputs): unknown calibrator 'nope'",
        ),
        (["data.shift.name=cifar10_c"], "severity 1-5"),
        (["data.limit_train=-1"], "data.limit_train must be >= 0"),
        (["train.device=gpu0"], "is not a device"),
    ],
)
def test_degenerate_values_are_refused_before_anything_is_written(tmp_path, override, message):
    with pytest.raises(
        ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        tiny(*override)
    result = runner.invoke(app, ["train", "-o", str(tmp_path / "run"), *TINY, *override])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []


# -- 2. ordinary calls that crash ------------------------------------------------------------------------


def test_damaged_files_are_named(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs / "ce-e1-s0", run)
    text = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(text[: len(text) // 2])
    with pytest.raises(RunError, match=r"metrics.jsonl is damaged: line 1"):
        read_metrics(run)
    result = runner.invoke(app, ["train", "-o", str(run), "--resume", "train.epochs=2"])
    assert result.exit_code == 2 and "metrics.jsonl is damaged" in result.output
    data = (run / "logits.pt").read_bytes()
    (run / "logits.pt").write_bytes(data[: len(data) // 3])
    result = runner.invoke(app, ["evaluate", str(run)])
    assert (
        result.exit_code == 2 and "logits.pt is damaged" in result.output and "Traceback" not in result.output
    )
    with pytest.warns(UserWarning, match="logits.pt is damaged"):
        markdown, _ = report([run, runs / "ce-e1-s1"], tmp_path / "rep")
    assert "| digits · mlp · ce | 1 |" in markdown


def test_a_model_that_does_not_fit_the_data_is_one_sentence(tmp_path, monkeypatch):
    from torchcal.experiments.models import registry as models

    # every registered image model takes every image size and channel count: a model for 5 features
    monkeypatch.setitem(models._MODELS, "small_cnn", (lambda k, s, w, stats=None: torch.nn.Linear(5, k), ""))
    result = runner.invoke(app, ["train", "-o", str(tmp_path / "run"), *TINY, "model.name=small_cnn"])
    assert (
        result.exit_code == 2
        and "model.name='small_cnn' does not fit the inputs of data.name='digits'" in (result.output)
    )
    assert not (tmp_path / "run").exists()


# -- 3. the CLI ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "BAD", "-o", "RUN"], "is not valid YAML"),
        (["train", "-o", "RUN", "optim.lrate=1"], "unknown key optim.lrate"),
        (["train", "-o", "RUN", "data.name=mnist"], "unknown dataset data.name='mnist'"),
        (
            ["train", "-o", "RUN", "data.name=cifar10", "data.root=EMPTY"],
            "CIFAR-10 not found: looked for the folder cifar-10-batches-py",
        ),
        (["train", "-o", "RUN", "loss.name=focal-9"], "loss.name='focal-9'"),
        (["train", "-o", "EXISTING", *TINY], "already holds a run"),
        (["train", "-o", "RUN", "--resume"], "cannot resume: RUN does not exist"),
        (["evaluate", "RUN"], "run folder RUN does not exist"),
        (["calibrate", "EXISTING", "-m", "platt"], "unknown calibrator 'platt'"),
        (["evaluate", "EXISTING", "--calibrators", "ts,nope"], "unknown calibrator 'nope'"),
        (["report", "RUN", "--out", "OUT"], "run folder RUN does not exist"),
        (["report", "EXISTING", "--out", "OUT", "--calibrator", "nope"], "unknown calibrator 'nope'"),
        (["list", "things"], "cannot list 'things'"),
        (["sweep", "NOSWEEP"], "does not exist"),
    ],
)
def test_user_errors_are_one_line_exit_2_and_write_nothing(runs, tmp_path, args, message):
    (tmp_path / "bad.yaml").write_text("optim: [\n")
    (tmp_path / "empty").mkdir()
    shutil.copytree(runs / "ce-e1-s1", tmp_path / "existing")
    places = {"BAD": tmp_path / "bad.yaml", "RUN": tmp_path / "run", "EMPTY": tmp_path / "empty",
              "EXISTING": tmp_path / "existing", "OUT": tmp_path / "out", "NOSWEEP": tmp_path / "s.yaml"}  # fmt: skip
    args = [str(places.get(a, a)) for a in args]
    message = message.replace("RUN", str(tmp_path / "run"))
    before = snapshot(tmp_path)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("torchcal: error: ") and message in lines[0], lines
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "bad.yaml", "empty", "existing"
    ]  # fmt: skip


def test_debug_shows_the_traceback(tmp_path, monkeypatch):
    result = runner.invoke(app, ["--debug", "train", "-o", str(tmp_path / "r"), "train.epochs=0"])
    assert isinstance(result.exception, ConfigError)
    monkeypatch.setenv("TORCHCAL_DEBUG", "1")
    result = runner.invoke(app, ["train", "-o", str(tmp_path / "r"), "train.epochs=0"])
    assert isinstance(result.exception, ConfigError)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_files_follow_the_users_umask(runs, tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        run = tmp_path / "run"
        train(tiny("train.epochs=1"), run)
        evaluate_run(run, ("ts",))
        report([run], tmp_path / "rep")
        from torchcal.experiments.reports.html import html_report

        html_report([run], tmp_path / "rep")
    finally:
        os.umask(old)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"config.yaml", "checkpoint.pt", "metrics.jsonl", "logits.pt",
                                       "results.json", "ts.pt", "ts.json", "report.md", "report.html"}  # fmt: skip
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {p.name: mode for p in files}


def test_calibrate_saves_the_calibrator_and_results_accumulate(runs, tmp_path):
    from torchcal.calibrators import from_json

    run = tmp_path / "run"
    shutil.copytree(runs / "ce-e1-s0", run)
    result = runner.invoke(app, ["calibrate", str(run), "-m", "ts"])
    assert result.exit_code == 0, result.output
    saved = torch.load(run / "calibrators" / "ts.pt", weights_only=True)
    t = saved["fitted"]["temperature_"]
    assert f"ts: T = {t:.4g}" in result.output
    rebuilt = from_json((run / "calibrators" / "ts.json").read_text())
    logits = torch.load(run / "logits.pt", weights_only=True)["test"]["logits"]
    torch.testing.assert_close(rebuilt.transform(logits), torch.softmax(logits / t, 1))
    assert runner.invoke(app, ["evaluate", str(run), "--calibrators", "ets"]).exit_code == 0
    assert runner.invoke(app, ["calibrate", str(run), "-m", "histogram"]).exit_code == 0
    res = json.loads((run / "results.json").read_text())
    assert {"uncalibrated", "ts", "ets", "histogram"} <= set(res)
    assert res["ts"]["parameters"]["temperature_"] == t
    assert {p.name for p in (run / "calibrators").iterdir()} == {f"{m}.{e}" for m in ("ts", "ets", "histogram")
                                                                 for e in ("pt", "json")}  # fmt: skip


# -- calibrator specs (issue 19: the papers' criterion from every entry point) ------------------------------


def test_calibrator_specs_from_the_cli_name_their_results_files_and_report(runs, tmp_path):
    import torchcal.functional as F

    run = tmp_path / "run"
    shutil.copytree(runs / "ce-e1-s0", run)
    result = runner.invoke(
        app, ["evaluate", str(run), "--calibrators", "ts:objective=ece,ts:objective=adaece"]
    )
    assert result.exit_code == 0, result.output
    res = json.loads((run / "results.json").read_text())
    assert {"ts:objective=ece", "ts:objective=adaece"} <= set(res)
    t = res["ts:objective=ece"]["parameters"]["temperature_"]
    assert round(t, 1) == pytest.approx(t)  # a value of the 0.1-step grid
    logits = torch.load(run / "logits.pt", weights_only=True)
    val = logits["val"]
    grid = [round(0.1 * i, 1) for i in range(1, 101)]
    eces = [F.ece(val["logits"] / g, val["targets"], from_logits=True).item() for g in grid]
    assert t == pytest.approx(grid[eces.index(min(eces))])  # the first minimiser of validation ECE
    assert (run / "calibrators" / "ts_objective-ece.json").exists()
    result = runner.invoke(app, ["calibrate", str(run), "-m", "ts:objective=nope"])
    assert result.exit_code == 2 and "`objective` must be one of" in result.output
    result = runner.invoke(app, ["calibrate", str(run), "-m", "ts:object=ece"])
    assert result.exit_code == 2 and "unexpected keyword argument 'object'" in result.output
    markdown, _ = report([run], tmp_path / "rep", "ts:objective=ece")
    assert "minimising validation ECE (15 equal-width bins)" in markdown


def test_calibrator_specs_are_validated_in_configs_and_presets():
    from tests.experiments.test_config import MARGIN_KEYS
    from torchcal.experiments.cli import list_presets

    cfg = tiny("train.calibrators=[ts:objective=ece, fts:objective=nll]")
    assert cfg.train.calibrators == ["ts:objective=ece", "fts:objective=nll"]
    with pytest.raises(ConfigError, match="unexpected keyword argument 'objectiv'"):
        tiny("train.calibrators=[ts:objectiv=ece]")
    for name, path in list_presets().items():  # the papers' criteria (decision 67) and selection (68)
        preset = load_config(path)
        if name.startswith("chestxray14"):  # multi-label: per-label temperature and Platt (decision 79)
            assert preset.train.calibrators == ["ts", "platt"] and preset.train.select == "best_val_nll", name
            continue
        assert preset.train.calibrators == ["ts:objective=ece", "ts:objective=adaece", "fts"], name
        # the margin and penalty losses' repositories keep the best validation model (their batch sizes are
        # checked in test_config.py)
        margin = name.rsplit("_", 1)[1] in MARGIN_KEYS
        best = margin or name.startswith(("tinyimagenet", "20newsgroups", "agnews", "finsen", "sstbinary"))
        assert preset.train.select == ("best_val_error" if best else "last"), name
        if name.startswith("tinyimagenet") and not margin:  # AdaFocal / FTS train at 64, the FCL paper at 128
            assert preset.data.loader.batch_size == (128 if name.endswith("_fcl") else 64), name
        text_sets = {"agnews": "ag_news", "20newsgroups": "20newsgroups_papers", "finsen": "finsen",
                     "sstbinary": "sst_binary"}  # fmt: skip
        for prefix, dataset in text_sets.items():  # the papers' splits (decisions 71, 72, 76)
            if name.startswith(prefix):
                model = "transformer" if "_bert_" in name else "text_cnn"
                assert preset.data.name == dataset and preset.model.name == model, name
        if "_bert_" in name:  # AdaFocal's BERT recipe (decision 75)
            assert (preset.optim.name, preset.optim.lr, preset.data.loader.batch_size) == ("adamw", 2e-5, 32), name
            assert (preset.data.max_len, preset.data.eval_max_len, preset.train.epochs) == (128, 512, 10), (
                name
            )
            assert preset.loss.update_every == (100 if name.endswith("adafocal100") else 0), name


def test_report_gives_standard_errors_and_s99(runs, tmp_path):
    import csv
    import io
    import math

    folders = [runs / "ce-e1-s0", runs / "ce-e1-s1"]
    markdown, csv_text = report(folders, tmp_path / "rep")
    assert "S99 (% with conf ≥ 0.99)" in markdown
    from torchcal.experiments.reports.html import html_report

    assert "S99 (% with conf ≥ 0.99) (pre → post)" in html_report(folders, tmp_path / "rep").read_text()
    row = next(csv.DictReader(io.StringIO(csv_text)))
    ece = [100 * evaluate_run(f, ("ts",))["uncalibrated"]["test"]["ece"] for f in folders]
    std = abs(ece[0] - ece[1]) / math.sqrt(2)  # sample std of two values
    assert float(row["ece_pre_std"]) == pytest.approx(std, rel=1e-9)
    assert float(row["ece_pre_sem"]) == pytest.approx(std / math.sqrt(2), rel=1e-9)
    s99 = [100 * evaluate_run(f, ("ts",))["uncalibrated"]["test"]["s99_fraction"] for f in folders]
    assert float(row["s99_fraction_pre_mean"]) == pytest.approx(sum(s99) / 2, abs=1e-9)


def test_train_fits_and_saves_train_calibrators(tmp_path):
    """train.calibrators was validated and then ignored by `torchcal train`; it is fitted on the final
    validation logits and saved as `torchcal evaluate` saves it."""
    from torchcal.calibrators import TemperatureScaling

    run = tmp_path / "run"
    result = runner.invoke(
        app, ["train", "-o", str(run), *TINY, "train.epochs=1", "train.calibrators=[ts, histogram]"]
    )
    assert result.exit_code == 0, result.output
    res = json.loads((run / "results.json").read_text())
    assert {"uncalibrated", "ts", "histogram"} <= set(res)
    assert {p.name for p in (run / "calibrators").iterdir()} == {
        "ts.pt",
        "ts.json",
        "histogram.pt",
        "histogram.json",
    }
    val = torch.load(run / "logits.pt", weights_only=True)["val"]
    refit = TemperatureScaling().fit(val["logits"], val["targets"])
    assert res["ts"]["parameters"]["temperature_"] == pytest.approx(float(refit.temperature_), rel=1e-6)
    # trained further: the earlier model's results are replaced by fits on the new model
    result = runner.invoke(app, ["train", "-o", str(run), "--resume", "train.epochs=2"])
    assert result.exit_code == 0 and "train.calibrators (ts, histogram) are fitted again" in result.output
    val = torch.load(run / "logits.pt", weights_only=True)["val"]
    refit = TemperatureScaling().fit(val["logits"], val["targets"])
    res = json.loads((run / "results.json").read_text())
    assert res["ts"]["parameters"]["temperature_"] == pytest.approx(float(refit.temperature_), rel=1e-6)
