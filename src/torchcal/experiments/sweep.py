"""Sweeps: a grid of runs (losses × models × datasets × seeds × overrides) executed locally (sequentially or
in a pool of worker processes) or on a Ray cluster, resumable, and aggregated into one report.

A sweep file::

    base: configs/cifar10_resnet50_ce.yaml      # optional: a run config the grid starts from
    out: runs/cifar10-resnet50                   # one sub-folder per run, plus sweep_state.json and report/
    grid:                                        # every combination of these dotted keys
      loss.name: [ce, fl-3, flsd-53]             # (the key `base` may list whole config files instead)
      train.seed: [0, 1, 2]
    overrides: [train.epochs=350]                # applied to every run
    resources: {cpus: 1, gpus: 1}                # per run (Ray backend)
    arena: all                                   # optional: the calibrator arena over the finished runs
                                                 # (all, or a list of calibrators), in report/arena.*

Every run is a separate ``torchcal train`` process, so a crash or kill affects that run only; its folder
resumes from its last checkpoint on the next ``torchcal sweep``. Finished runs (``logits.pt`` present) are
never redone; failed runs are recorded with the tail of their output and retried only with
``--retry-failed``.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .config import ConfigError, load_config, load_yaml
from .training.loop import atomic_write_bytes

__all__ = ["Sweep", "load_sweep", "expand", "run_sweep"]

STATE = "sweep_state.json"


@dataclass
class Sweep:
    out: Path
    base: str | None = None
    grid: dict = field(default_factory=dict)
    overrides: list = field(default_factory=list)
    resources: dict = field(default_factory=lambda: {"cpus": 1, "gpus": 0})
    evaluate: list = field(default_factory=lambda: ["ts", "fts"])
    arena: tuple | None = None


def load_sweep(path: str | Path) -> Sweep:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep file {str(path)!r} does not exist")
    raw = load_yaml(path.read_text()) or {}
    known = {"out", "base", "grid", "overrides", "resources", "evaluate", "arena"}
    if not isinstance(raw, dict) or set(raw) - known:
        raise ConfigError(f"unknown sweep keys {sorted(set(raw) - known)}; valid keys: {sorted(known)}")
    if "out" not in raw:
        raise ConfigError("a sweep needs `out`: the folder that holds its runs")
    grid = raw.get("grid", {})
    if not isinstance(grid, dict) or any(not isinstance(v, list) or not v for v in grid.values()):
        raise ConfigError("`grid` must map dotted keys to non-empty lists of values")
    sweep = Sweep(out=Path(raw["out"]), base=raw.get("base"), grid=grid, overrides=list(raw.get("overrides", [])),
                  resources={"cpus": 1, "gpus": 0, **raw.get("resources", {})},
                  evaluate=list(raw.get("evaluate", ["ts", "fts"])))  # fmt: skip
    from ..calibrators import from_spec

    if not sweep.evaluate:
        raise ConfigError("`evaluate` must list at least one calibrator spec (e.g. ts:objective=ece)")
    for spec in sweep.evaluate:  # specs such as "ts" or "ts:objective=ece"
        try:
            from_spec(spec)
        except ValueError as err:
            raise ConfigError(f"`evaluate`: {err}") from None
    if raw.get("arena") is not None:
        from .errors import UserError
        from .evaluation.arena import resolve_calibrators

        try:
            sweep.arena = resolve_calibrators(raw["arena"] if isinstance(raw["arena"], str | list) else "")
        except UserError as err:
            raise ConfigError(f"`arena`: {err}") from None
        if not sweep.arena:
            raise ConfigError("`arena` must be 'all' or a list of calibrator specs")
    for run in expand(sweep):  # validate every combination now, not hours later
        load_config(run["base"], run["overrides"])
    return sweep


def _slug(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return "".join(c if c.isalnum() or c in "-._" else "-" for c in text)


def expand(sweep: Sweep) -> list[dict]:
    """One entry per grid combination: its name (folder), the overrides and the grid values."""
    keys = list(sweep.grid)
    runs = []
    for values in itertools.product(*(sweep.grid[k] for k in keys)):
        chosen = dict(zip(keys, values, strict=True))
        base = chosen.pop("base", sweep.base)
        parts = [Path(base).stem] if "base" in keys else []
        last = [k.split(".")[-1] for k in chosen]
        labels = [k.split(".")[-1] if last.count(k.split(".")[-1]) == 1 else k for k in chosen]
        parts += [f"{label}-{_slug(v)}" for label, v in zip(labels, chosen.values(), strict=True)]
        overrides = [*sweep.overrides, *(f"{k}={json.dumps(v)}" for k, v in chosen.items())]
        runs.append({"name": "_".join(parts) or "run", "base": base, "overrides": overrides,
                     "values": dict(zip(keys, values, strict=True))})  # fmt: skip
    names = [r["name"] for r in runs]
    if len(set(names)) != len(names):
        raise ConfigError("two grid combinations map to the same run folder; make the grid values distinct")
    return runs


def _command(sweep: Sweep, run: dict, run_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "torchcal", "train"]
    if (run_dir / "config.yaml").exists():  # started before (perhaps killed before its first checkpoint)
        return [*cmd, "--resume", "-o", str(run_dir)]
    if run["base"]:
        cmd.append(str(run["base"]))
    return [*cmd, *run["overrides"], "-o", str(run_dir)]


def run_one(command: list[str], run_dir: str, evaluate: list[str], env: dict | None = None) -> dict:
    """Trains one run in its own process, then evaluates it; returns {"status", "log"}."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})})
    log = (proc.stdout + proc.stderr)[-4000:]
    if proc.returncode != 0:
        return {"status": "failed", "log": log, "returncode": proc.returncode}
    from .evaluation.evaluate import evaluate_run

    try:
        evaluate_run(run_dir, tuple(evaluate))
    except Exception as err:  # noqa: BLE001 - recorded in the sweep state, the sweep goes on
        return {"status": "failed", "log": f"evaluation failed: {err}"}
    return {"status": "done", "log": log[-500:]}


def _save_state(path: Path, state: dict) -> None:
    text = json.dumps(state, indent=2, sort_keys=True)
    atomic_write_bytes(path, lambda fh: fh.write(text.encode()))


def run_sweep(
    sweep: Sweep,
    *,
    backend: str = "local",
    workers: int = 1,
    address: str | None = None,
    retry_failed: bool = False,
    report_calibrator: str = "ts",
    log=print,
) -> dict:
    """Runs every pending combination and writes the aggregated report; returns the state per run."""
    sweep.out.mkdir(parents=True, exist_ok=True)
    state_path = sweep.out / STATE
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    runs = expand(sweep)
    todo = []
    for run in runs:
        run_dir = sweep.out / run["name"]
        if (run_dir / "logits.pt").exists() and (run_dir / "results.json").exists():
            state[run["name"]] = {**state.get(run["name"], {}), "status": "done"}
        elif state.get(run["name"], {}).get("status") == "failed" and not retry_failed:
            log(f"skip {run['name']}: failed before (use --retry-failed)")
        else:
            todo.append(run)
    log(f"{len(runs)} runs: {len(runs) - len(todo)} finished or skipped, {len(todo)} to run ({backend})")

    def record(run, result):
        state[run["name"]] = {"values": run["values"], **result}
        _save_state(state_path, state)
        log(f"{result['status']:>6}: {run['name']}")

    jobs = [
        (run, _command(sweep, run, sweep.out / run["name"]), str(sweep.out / run["name"])) for run in todo
    ]
    if backend == "local":
        env = (
            {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // max(1, workers)))}
            if workers > 1
            else None
        )
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            futures = [(run, pool.submit(run_one, cmd, d, sweep.evaluate, env)) for run, cmd, d in jobs]
            for run, future in futures:
                record(run, future.result())
    elif backend == "ray":
        import ray

        if not ray.is_initialized():
            ray.init(address=address) if address else ray.init(num_cpus=max(1, workers))
        remote = ray.remote(num_cpus=sweep.resources.get("cpus", 1), num_gpus=sweep.resources.get("gpus", 0))(
            run_one
        )
        refs = {remote.remote(cmd, d, sweep.evaluate): run for run, cmd, d in jobs}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            record(refs[ready[0]], ray.get(ready[0]))
    else:
        raise ValueError(f"unknown backend {backend!r}; choose 'local' or 'ray'")

    done = [sweep.out / name for name, s in state.items() if s.get("status") == "done"]
    if done:
        from .evaluation.evaluate import collect_groups, report
        from .reports.html import html_report

        groups = collect_groups(done, report_calibrator)
        report(done, sweep.out / "report", report_calibrator, groups=groups)
        html_report(done, sweep.out / "report", report_calibrator, groups=groups)
        if sweep.arena:
            from .evaluation.arena import run_arena, save_to_runs, tasks_from_runs
            from .reports.arena import write_arena

            tasks = tasks_from_runs(done)
            result = run_arena(tasks, sweep.arena)
            write_arena(result, sweep.out / "report", tasks)
            save_to_runs(result, tasks)
            log(f"arena over {len(tasks)} runs in {sweep.out / 'report'}/arena.md")
    failed = [name for name, s in state.items() if s.get("status") == "failed"]
    if failed:
        log(f"{len(failed)} failed runs: {failed}; their output is in {state_path}")
    return state
