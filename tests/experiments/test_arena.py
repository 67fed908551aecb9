"""The calibrator arena: user logits in every format and every refusal, run folders, ranks and win rates
against hand computations, the paired bootstrap against a per-resample loop, and failing calibrators."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import torchcal.calibrators as calibrators
import torchcal.functional as F
from torchcal.calibrators import Calibrator
from torchcal.experiments.cli import app
from torchcal.experiments.evaluation.arena import SCORES, ArenaTask, rank_scores, run_arena, summarise
from torchcal.experiments.reports.arena import arena_csv, arena_markdown, write_arena

runner = CliRunner()
FAST = "ts,histogram"  # two quick calibrators of different kinds keep the CLI tests short


def _split(n, k=4, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    z = 1.5 * torch.randn(n, k, generator=g)
    y = torch.multinomial(torch.softmax(z, 1), 1, generator=g).squeeze(1)
    return scale * z, y  # over-confident by `scale`


def _task(name="toy", n=300, k=4, seed=0):
    (vz, vy), (tz, ty) = _split(n, k, seed), _split(n, k, seed + 100)
    return ArenaTask(name, vz, vy, tz, ty, source=name)


def _run_folder(path: Path, seed=0, k=4, multilabel=False) -> Path:
    """A finished run as the arena reads it: logits.pt with the validation and test splits."""
    path.mkdir(parents=True)
    (vz, vy), (tz, ty) = _split(200, k, seed), _split(200, k, seed + 50)
    if multilabel:
        vy, ty = (torch.rand(200, k) < 0.5).float(), (torch.rand(200, k) < 0.5).float()
    torch.save(
        {"val": {"logits": vz, "targets": vy}, "test": {"logits": tz, "targets": ty}}, path / "logits.pt"
    )
    return path


# ----------------------------------------------------------------------------- ranks and win rates


def test_rank_scores_by_hand():
    assert rank_scores([0.5, 0.2, 0.9]) == [2.0, 1.0, 3.0]
    assert rank_scores([0.5, 0.2, 0.9], lower_is_better=False) == [2.0, 3.0, 1.0]
    assert rank_scores([0.2, 0.2, 0.1, 0.3]) == [2.5, 2.5, 1.0, 4.0]  # a tie shares ranks 2 and 3
    assert rank_scores([None, 0.4, None, 0.1]) == [3.5, 2.0, 3.5, 1.0]  # failures share the last two ranks
    assert rank_scores([None, None]) == [1.5, 1.5]


def _fake_result(nll_by_task, accuracy_by_task):
    """A result with hand-chosen test NLL and accuracy per entrant (None: the calibrator failed)."""
    tasks = []
    for nll, acc in zip(nll_by_task, accuracy_by_task, strict=True):
        rows = {}
        for name in ("a", "b"):
            if nll[name] is None:
                rows[name] = {
                    "status": "failed",
                    "message": "boom",
                    "fit_seconds": None,
                    "predict_seconds": None,
                }
                continue
            test = {s: 0.1 for s in SCORES} | {"nll": nll[name], "accuracy": acc[name]}
            imp = {s: [0.0, -0.01, 0.01] for s in SCORES}
            imp["nll"] = [nll["uncalibrated"] - nll[name], 0.01, 0.02]
            rows[name] = {"status": "ok", "message": "", "fit_seconds": 1.0, "predict_seconds": 0.5, "test": test,
                          "improvement": imp}  # fmt: skip
        base = {s: 0.1 for s in SCORES} | {"nll": nll["uncalibrated"], "accuracy": acc["uncalibrated"]}
        tasks.append({"name": f"t{len(tasks)}", "source": "", "num_classes": 3, "n_val": 10, "n_test": 10,
                      "uncalibrated": {"test": base}, "rows": rows})  # fmt: skip
    return {"calibrators": ["a", "b"], "tasks": tasks, "n_resamples": 10, "seed": 0, "confidence_level": 0.95}


def test_mean_ranks_and_pairwise_win_rates_against_a_hand_computation():
    nll = [
        {"uncalibrated": 1.0, "a": 0.8, "b": 0.9},  # ranks: u 3, a 1, b 2
        {"uncalibrated": 1.0, "a": 0.7, "b": None},  # b failed: u 2, a 1, b 3
        {"uncalibrated": 0.6, "a": 0.7, "b": 0.7},  # a and b tie: u 1, a 2.5, b 2.5
    ]
    acc = [{"uncalibrated": 0.5, "a": 0.5, "b": 0.5}] * 2 + [{"uncalibrated": 0.4, "a": 0.6, "b": 0.5}]
    s = summarise(_fake_result(nll, acc))
    assert s["mean_rank"]["nll"] == pytest.approx({"uncalibrated": 2.0, "a": 4.5 / 3, "b": 7.5 / 3})
    # accuracy, higher is better: a three-way tie (rank 2 each) on t0; on t1 u and a tie (1.5 each) and b's
    # failure ranks 3; on t2 a 1, b 2, u 3
    assert s["mean_rank"]["accuracy"] == pytest.approx({"uncalibrated": 6.5 / 3, "a": 4.5 / 3, "b": 7 / 3})
    pair = s["pairwise"]["nll"]
    assert pair["a"]["b"] == pytest.approx((1 + 1 + 0.5) / 3)  # wins, beats a failure, ties
    assert pair["b"]["a"] == pytest.approx((0 + 0 + 0.5) / 3)
    assert pair["a"]["uncalibrated"] == pytest.approx(2 / 3)
    assert pair["uncalibrated"]["b"] == pytest.approx(2 / 3)  # loses t0, beats the failure and t2
    for x, y in (("a", "b"), ("a", "uncalibrated"), ("b", "uncalibrated")):
        assert pair[x][y] + pair[y][x] == pytest.approx(1.0)
    assert s["win_rate"]["nll"]["a"] == pytest.approx((2.5 / 3 + 2 / 3) / 2)
    assert s["order"] == ["a", "b"] and s["failures"] == {"a": 0, "b": 1}
    assert s["improvement"]["a"]["nll"]["mean"] == pytest.approx((0.2 + 0.3 - 0.1) / 3)
    assert s["improvement"]["b"]["nll"]["better"] == 2  # intervals above 0 on its two successful tasks
    assert s["fit_seconds"]["b"] == 1.0  # the failure has no time


def test_improvement_interval_equals_a_per_resample_loop():
    # independent oracle: the same index draws as bootstrap_ci's seed, the metrics evaluated on each resample;
    # float64 logits, so the vectorised and per-resample sums agree to rounding (float32 would differ by ~1e-7)
    task = _task(n=120)
    task.val_logits, task.test_logits = task.val_logits.double(), task.test_logits.double()
    res = run_arena([task], ["ts"], n_resamples=60, seed=7)
    row = res["tasks"][0]["rows"]["ts"]
    cal = calibrators.create("ts").fit(task.val_logits, task.val_targets)
    base, post = torch.softmax(task.test_logits, 1), cal.transform(task.test_logits)
    gen = torch.Generator().manual_seed(7)
    idx = torch.randint(120, (60, 120), generator=gen)
    y = task.test_targets
    # accuracy's improvement is post − base accuracy = base − post error: the same difference as the losses'
    for name, metric in (("nll", F.nll), ("classwise_ece", F.classwise_ece), ("accuracy", F.error_rate)):
        diffs = torch.stack([metric(base[i], y[i]) - metric(post[i], y[i]) for i in idx]).double()
        low, high = torch.quantile(diffs, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
        value, got_low, got_high = row["improvement"][name]
        assert got_low == pytest.approx(low, abs=1e-12) and got_high == pytest.approx(high, abs=1e-12)
        assert value == pytest.approx((metric(base, y) - metric(post, y)).item(), abs=1e-12)


def test_reports_name_the_confidence_level_the_arena_ran_with():
    """run_arena(confidence_level=0.9) gives 5-95 % intervals; the Markdown's column titles, the description
    and the recommendation name that level (they said "95%" whatever it was), and the recommendation's
    count of tasks "better by its interval" is the number of tasks whose 90 % interval lies above 0."""
    tasks = [_task(f"t{i}", n=150, seed=i) for i in range(2)]
    res = run_arena(tasks, ["ts"], n_resamples=40, confidence_level=0.9)
    md = arena_markdown(res)
    assert "95%" not in md
    assert "Δ NLL [90% CI]" in md and "[90% paired bootstrap interval" in md and "by its 90% interval" in md
    better = sum(t["rows"]["ts"]["improvement"]["nll"][1] > 0 for t in res["tasks"])
    assert f"better in {better} of 2 tasks by its 90% interval" in md
    assert "95%" not in arena_markdown(run_arena(tasks[:1], ["ts"], n_resamples=40, confidence_level=0.975))


# ----------------------------------------------------------------------------- failures and the registry


class _Boom(Calibrator):
    name = "boom"

    def _fit(self, logits, targets):
        raise RuntimeError("the solver diverged")


class _NaNProbs(Calibrator):
    name = "nanprobs"
    fitted_attributes = ()

    def _fit(self, logits, targets):
        pass

    def _transform(self, logits):
        return torch.full_like(logits, float("nan"))


class _Warns(Calibrator):
    name = "warns"

    def _fit(self, logits, targets):
        warnings.warn("did not converge in 3 iterations", RuntimeWarning, stacklevel=2)

    def _transform(self, logits):
        return torch.softmax(logits, 1)


@pytest.fixture
def extra_calibrators(monkeypatch):
    """Calibrators registered at run time: the arena's 'all' must include them."""
    registry = dict(calibrators._REGISTRY)
    registry.update({"boom": _Boom, "nanprobs": _NaNProbs, "warns": _Warns})
    monkeypatch.setattr(calibrators, "_REGISTRY", registry)


def test_failing_calibrators_are_reported_in_their_row_and_the_arena_goes_on(extra_calibrators, tmp_path):
    from torchcal.experiments.evaluation.arena import resolve_calibrators

    assert {"boom", "nanprobs", "warns", "ts"} <= set(resolve_calibrators("all"))
    res = run_arena([_task(), _task("other", seed=3)], ["boom", "ts", "nanprobs", "warns"], n_resamples=20)
    for task in res["tasks"]:
        rows = task["rows"]
        assert (
            rows["boom"]["status"] == "failed"
            and rows["boom"]["message"] == "RuntimeError: the solver diverged"
        )
        assert rows["nanprobs"]["status"] == "failed" and "not finite" in rows["nanprobs"]["message"]
        assert "test" not in rows["boom"] and "improvement" not in rows["nanprobs"]
        assert (
            rows["warns"]["status"] == "warning"
            and rows["warns"]["message"] == "did not converge in 3 iterations"
        )
        assert rows["ts"]["status"] == "ok" and rows["ts"]["improvement"]["nll"][1] > 0
    s = res["summary"]
    assert s["failures"] == {"boom": 2, "ts": 0, "nanprobs": 2, "warns": 0} and s["warnings"]["warns"] == 2
    # the two failures share the last two ranks of 5 on every score; warns is uncalibrated (ties it)
    assert s["mean_rank"]["nll"]["boom"] == s["mean_rank"]["nll"]["nanprobs"] == 4.5
    assert s["mean_rank"]["nll"]["warns"] == s["mean_rank"]["nll"]["uncalibrated"] == 2.5
    assert s["order"][0] == "ts"
    md = arena_markdown(res)
    assert "| boom | failed: RuntimeError: the solver diverged |" in md
    assert "warning: did not converge in 3 iterations" in md
    lines = arena_csv(res).splitlines()
    assert len(lines) == 1 + 2 * 5 and any(
        ",boom,failed,RuntimeError: the solver diverged," in x for x in lines
    )
    paths = write_arena(res, tmp_path / "out", [_task(), _task("other", seed=3)])
    page = paths["arena.html"].read_text()
    assert "boom" in page and page.count("data:image/png;base64,") == 2  # rank figure, reliability diagrams
    assert json.loads(paths["arena.json"].read_text())["summary"]["failures"]["boom"] == 2


def test_recommendation_never_names_a_calibrator_that_gave_nothing(extra_calibrators):
    """Failures rank last, so the best calibrator failed on every task only when every calibrator did: the
    sentence then says so instead of calling the failure "the closest"; a recommended calibrator that failed
    on some tasks has that count in the sentence, and its mean improvement is over the tasks it fitted."""
    from torchcal.experiments.reports.arena import recommendation

    tasks = [_task("t0", n=150), _task("t1", n=150, seed=3)]
    res = run_arena(tasks, ["boom", "nanprobs"], n_resamples=10)
    text = recommendation(res)
    assert text.startswith("Every calibrator failed on every task") and "boom" not in text
    # hand-made: ts fitted t0 only (t1 failed), yet ranks first; the nll improvement is t0's alone
    res = run_arena(tasks, ["ts", "boom"], n_resamples=10)
    row = res["tasks"][1]["rows"]["ts"]
    row.update(status="failed", message="RuntimeError: x")
    del row["test"], row["improvement"]
    res["summary"] = summarise(res)
    text = recommendation(res)
    t0 = res["tasks"][0]["rows"]["ts"]["improvement"]["nll"][0]
    assert "**ts**" in text and "failed on 1 of 2 tasks" in text
    assert f"NLL {t0:+.4f} on average over uncalibrated of the 1 task it fitted" in text
    assert "then" not in text  # boom gave nothing on any task


def test_failing_calibrator_row_through_the_cli(extra_calibrators, tmp_path):
    val, test = tmp_path / "val.npz", tmp_path / "test.npz"
    for path, seed in ((val, 0), (test, 1)):
        z, y = _split(150, 3, seed)
        np.savez(path, logits=z.numpy(), targets=y.numpy())
    out = tmp_path / "out"
    args = ["arena", "--val", str(val), "--test", str(test), "--calibrators", "boom,ts", "--resamples", "20",
            "--out", str(out)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "failed on 1" in result.output
    assert "| boom | failed: RuntimeError: the solver diverged |" in (out / "arena.md").read_text()


# ----------------------------------------------------------------------------- user logits


def _save(fmt: str, folder: Path, name: str, z: torch.Tensor, y: torch.Tensor) -> list[str]:
    """Saves one split in ``fmt``; returns the CLI arguments naming it."""
    if fmt == "pt":
        torch.save({"logits": z, "targets": y}, folder / f"{name}.pt")
        return [f"--{name}", str(folder / f"{name}.pt")]
    if fmt == "npz":
        np.savez(folder / f"{name}.npz", logits=z.numpy(), targets=y.numpy())
        return [f"--{name}", str(folder / f"{name}.npz")]
    np.save(folder / f"{name}.npy", z.numpy())
    np.save(folder / f"{name}_labels.npy", y.numpy())
    return [f"--{name}", str(folder / f"{name}.npy"), f"--{name}-targets", str(folder / f"{name}_labels.npy")]


def test_user_logits_in_every_format_give_the_same_arena(tmp_path):
    (vz, vy), (tz, ty) = _split(200, 5, 0), _split(200, 5, 1)
    results = {}
    for fmt in ("pt", "npz", "npy"):
        folder = tmp_path / fmt
        folder.mkdir()
        args = ["arena", *_save(fmt, folder, "val", vz, vy), *_save(fmt, folder, "test", tz, ty),
                "--calibrators", FAST, "--resamples", "30", "--out", str(folder / "out")]  # fmt: skip
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert sorted(p.name for p in (folder / "out").iterdir()) == ["arena.csv", "arena.html", "arena.json",
                                                                       "arena.md"]  # fmt: skip
        results[fmt] = json.loads((folder / "out" / "arena.json").read_text())
    for fmt in ("npz", "npy"):
        for spec in ("ts", "histogram"):
            assert (
                results[fmt]["tasks"][0]["rows"][spec]["test"]
                == results["pt"]["tasks"][0]["rows"][spec]["test"]
            )
    assert results["pt"]["tasks"][0]["n_val"] == 200 and results["pt"]["tasks"][0]["num_classes"] == 5


def _refusal(tmp_path, args, message):
    out = tmp_path / "never"
    result = runner.invoke(
        app, ["arena", *args, "--calibrators", FAST, "--resamples", "5", "--out", str(out)]
    )
    assert result.exit_code == 2, result.output
    lines = [x for x in result.output.strip().splitlines() if not x.startswith("torchcal: warning:")]
    assert len(lines) == 1 and lines[0].startswith("torchcal: error: "), result.output
    assert message in lines[0], lines[0]
    assert not out.exists()  # a refused command writes nothing


def test_user_logits_refusals_are_one_line_and_write_nothing(tmp_path):
    z, y = _split(50, 3, 0)
    good = tmp_path / "good.npz"
    np.savez(good, logits=z.numpy(), targets=y.numpy())
    cases = {
        "missing.npz": None,
        "wrong.txt": "text",
        "no_targets.npz": {"logits": z.numpy(), "labels": y.numpy()},
        "tensor.pt": z,
        "rows.npz": {"logits": z.numpy(), "targets": y[:40].numpy()},
        "range.npz": {"logits": z.numpy(), "targets": np.full(50, 3)},
        "negative.pt": {"logits": z, "targets": torch.full((50,), -1)},
        "fractional.npz": {"logits": z.numpy(), "targets": np.full(50, 0.5)},
        "vector.npz": {"logits": z[:, 0].numpy(), "targets": y.numpy()},
        "onehot.npz": {"logits": z.numpy(), "targets": np.eye(3)[y.numpy()]},
        "nan.pt": {"logits": torch.full((50, 3), float("nan")), "targets": y},
        "int_logits.npz": {"logits": np.ones((50, 3), dtype=np.int64), "targets": y.numpy()},
        "four.npz": {"logits": torch.randn(50, 4).numpy(), "targets": y.numpy()},
        "probs.pt": {"logits": torch.softmax(z, 1), "targets": y},
        "logits.pt": {"val": {"logits": z, "targets": y}, "test": {"logits": z, "targets": y}},
    }
    for name, content in cases.items():
        path = tmp_path / name
        if isinstance(content, str):
            path.write_text(content)
        elif isinstance(content, dict) and name.endswith(".npz"):
            np.savez(path, **content)
        elif content is not None:
            torch.save(content, path)
    expect = {
        "missing.npz": "--val " + str(tmp_path / "missing.npz") + " does not exist",
        "wrong.txt": "unknown file type '.txt'; use .pt, .npz or .npy",
        "no_targets.npz": "has no 'targets' (it holds 'logits', 'labels')",
        "tensor.pt": "holds a Tensor, not a dict with 'logits' and 'targets'",
        "rows.npz": "50 rows of logits but 40 targets",
        "range.npz": "target 3 is outside [0, 3) for logits with K = 3 classes",
        "negative.pt": "target -1 is outside [0, 3)",
        "fractional.npz": "targets are not integer class indices",
        "vector.npz": "logits have shape (50,)",
        "onehot.npz": "the arena takes class indices (N,)",
        "nan.pt": "logits hold NaN or infinite values",
        "int_logits.npz": "logits have dtype int64, not float",
        "probs.pt": "the logits are probabilities (in [0, 1], rows summing to 1); save their logarithm",
        "logits.pt": f"is a torchcal run's logits file; pass its run folder instead: torchcal arena {tmp_path}",
    }
    for name, message in expect.items():
        _refusal(tmp_path, ["--val", str(tmp_path / name), "--test", str(good)], message)
    _refusal(tmp_path, ["--val", str(good), "--test", str(tmp_path / "four.npz")],
             "--val has K = 3 classes but --test has 4")  # fmt: skip
    np.save(tmp_path / "z.npy", z.numpy())
    _refusal(tmp_path, ["--val", str(tmp_path / "z.npy"), "--test", str(good)],
             "is an .npy of logits: give its labels with --val-targets")  # fmt: skip
    _refusal(tmp_path, ["--val", str(good), "--val-targets", str(tmp_path / "z.npy"), "--test", str(good)],
             "--val-targets is only for .npy logits")  # fmt: skip
    _refusal(tmp_path, ["--val", str(good)], "give run folders, or both --val VAL and --test TEST")
    _refusal(tmp_path, [str(tmp_path), "--val", str(good), "--test", str(good)], "not both")
    result = runner.invoke(
        app, ["arena", "--val", str(good), "--test", str(good), "--calibrators", "ts,nope"]
    )
    assert result.exit_code == 2 and "unknown calibrator 'nope'" in result.output
    result = runner.invoke(app, ["arena", "--val", str(good), "--test", str(good), "--resamples", "0"])
    assert result.exit_code == 2 and "--resamples must be >= 1" in result.output


# ----------------------------------------------------------------------------- runs


def test_arena_over_runs_writes_the_report_and_each_runs_results(tmp_path):
    runs = [_run_folder(tmp_path / f"run{i}", seed=i) for i in range(2)]
    (tmp_path / "unfinished").mkdir()
    out = tmp_path / "arena"
    result = runner.invoke(app, ["arena", *map(str, runs), str(tmp_path / "unfinished"), "--calibrators", FAST,
                                 "--resamples", "20", "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "unfinished: skipped" in result.output
    res = json.loads((out / "arena.json").read_text())
    assert [t["name"] for t in res["tasks"]] == ["run0", "run1"] and res["summary"]["n_tasks"] == 2
    for run in runs:
        saved = json.loads((run / "results.json").read_text())["arena"]
        assert set(saved["rows"]) == {"ts", "histogram"} and saved["n_resamples"] == 20
    md = (out / "arena.md").read_text()
    assert "## Leaderboard" in md and "### run0" in md and "Pairwise win rate" in md
    # refusals: a missing folder, only unfinished runs, a multi-label run; nothing is written
    _refusal(tmp_path, [str(tmp_path / "nowhere")], "does not exist")
    _refusal(tmp_path, [str(tmp_path / "unfinished")], "no finished run for the arena")
    ml = _run_folder(tmp_path / "ml", multilabel=True)
    _refusal(tmp_path, [str(ml)], "is a multi-label run")
    assert not (ml / "results.json").exists()


def test_evaluate_runs_the_arena_for_a_sweep(tmp_path):
    runs = [_run_folder(tmp_path / "sweep" / f"loss-s{i}", seed=i) for i in range(2)]
    out = tmp_path / "arena"
    result = runner.invoke(app, ["evaluate", *map(str, runs), "--calibrators", "ts", "--arena",
                                 "--arena-calibrators", FAST, "--resamples", "10", "--arena-out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    for run in runs:
        saved = json.loads((run / "results.json").read_text())
        assert {"uncalibrated", "ts", "arena"} <= set(saved)
    assert (out / "arena.html").exists() and (out / "arena.csv").exists()
    result = runner.invoke(app, ["evaluate", str(runs[0]), str(tmp_path / "nowhere"), "--arena"])
    assert result.exit_code == 2 and not (runs[0] / "calibrators" / "fts.json").exists()


def test_cli_in_a_subprocess_exit_status_and_output(tmp_path):
    (vz, vy), (tz, ty) = _split(120, 3, 0), _split(120, 3, 1)
    torch.save({"logits": vz, "targets": vy}, tmp_path / "val.pt")
    torch.save({"logits": tz, "targets": ty}, tmp_path / "test.pt")
    env_src = str(Path(__file__).resolve().parents[2] / "src")
    cmd = [sys.executable, "-m", "torchcal", "arena", "--val", str(tmp_path / "val.pt"), "--test",
           str(tmp_path / "test.pt"), "--calibrators", "ts", "--resamples", "10", "--out", str(tmp_path / "out")]  # fmt: skip
    import os

    env = {**os.environ, "PYTHONPATH": env_src}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Start with ts" in proc.stdout or "the closest is ts" in proc.stdout
    assert (tmp_path / "out" / "arena.md").exists()
    bad = [*cmd[:5], str(tmp_path / "missing.pt"), *cmd[6:-1], str(tmp_path / "out2")]
    proc = subprocess.run(bad, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "missing.pt does not exist" in proc.stderr and not (tmp_path / "out2").exists()
