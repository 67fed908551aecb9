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
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .config import EXECUTION_KEYS, ConfigError, config_from_dict, flatten_config, load_config, load_yaml
from .errors import RunError
from .run_files import CONFIG, atomic_write_bytes, make_dir, read_json_object

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
    import yaml

    try:
        raw = load_yaml(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"sweep file {str(path)!r} is not valid YAML: {_yaml_problem(err)}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"sweep file {str(path)!r} cannot be read: {err}") from None
    known = {"out", "base", "grid", "overrides", "resources", "evaluate", "arena"}
    if not isinstance(raw, dict):
        raise ConfigError(f"sweep file {str(path)!r} must be a mapping of keys {sorted(known)}, "
                          f"got {type(raw).__name__}")  # fmt: skip
    if set(raw) - known:
        raise ConfigError(f"unknown sweep keys {sorted(set(raw) - known)}; valid keys: {sorted(known)}")
    if "out" not in raw:
        raise ConfigError("a sweep needs `out`: the folder that holds its runs")
    for key, kind, example in (("resources", dict, "{cpus: 1, gpus: 1}"), ("overrides", list, "[train.epochs=350]"),
                               ("evaluate", list, "[ts, fts]")):  # fmt: skip
        if key in raw and not isinstance(raw[key], kind):
            raise ConfigError(f"sweep file {str(path)!r}: `{key}` must be a {'mapping' if kind is dict else 'list'} "
                              f"(e.g. {key}: {example}), got {raw[key]!r}")  # fmt: skip
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


def _yaml_problem(err) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(err, 'problem', None) or err}{where}"


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
    make_dir(Path(run_dir))
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
    """Runs every pending combination of the grid and writes the aggregated report of the grid's finished
    runs; returns the state of each run of the grid.

    A run folder already there must hold the run the grid asks for: a saved config that differs from it
    (other than in :data:`~torchcal.experiments.config.EXECUTION_KEYS`) is a :class:`ConfigError` naming
    the run and the keys, before anything runs. Runs of an earlier version of the sweep file that the grid no
    longer holds stay on disk and in the state file, out of the report (a warning names them)."""
    state_path = sweep.out / STATE
    state = _read_state(state_path)
    runs = expand(sweep)
    for run in runs:
        _check_saved_run(sweep.out / run["name"], run)
    folders = {p.name for p in sweep.out.iterdir() if (p / CONFIG).exists()} if sweep.out.is_dir() else set()
    left_over = sorted((set(state) | folders) - {run["name"] for run in runs})
    if left_over:
        warnings.warn(
            f"{sweep.out}: {len(left_over)} run(s) of an earlier grid are not in the sweep file now and are left "
            f"out of the report: {', '.join(left_over)}",
            UserWarning,
            stacklevel=2,
        )
    make_dir(sweep.out)
    todo = []
    for run in runs:
        run_dir = sweep.out / run["name"]
        if (run_dir / "logits.pt").exists() and (run_dir / "results.json").exists():
            state[run["name"]] = {**state.get(run["name"], {}), "status": "done"}
        elif state.get(run["name"], {}).get("status") == "failed" and not retry_failed:
            log(f"skip {run['name']}: failed before (use --retry-failed)")
        else:
            todo.append(run)
    _save_state(state_path, state)
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

    current = {run["name"]: state[run["name"]] for run in runs if run["name"] in state}
    done = [sweep.out / name for name, s in current.items() if s.get("status") == "done"]
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
    failed = [name for name, s in current.items() if s.get("status") == "failed"]
    if failed:
        log(f"{len(failed)} failed runs: {failed}; their output is in {state_path}")
    return current


def _read_state(path: Path) -> dict:
    """The sweep's state file ({} when there is none); a damaged one is a :class:`RunError` saying to delete
    it (finished runs are found again from their folders)."""
    damaged = ("delete it and run the sweep again (finished runs are kept and found from their folders; failed "
               "runs are tried again)")  # fmt: skip
    state = read_json_object(path, damaged)
    if not all(isinstance(v, dict) for v in state.values()):
        raise RunError(f"{path} is damaged: {damaged}")
    return state


def _check_saved_run(run_dir: Path, run: dict) -> None:
    """Refuses a run folder whose saved config is not the one the grid now asks for (execution settings
    such as train.device may differ: they never change what a run computes)."""
    import yaml

    path = run_dir / CONFIG
    if not path.exists():
        return
    try:
        raw = yaml.safe_load(path.read_text()) or {}
        adjusted = (raw.pop("meta", None) or {}).get("adjusted") or {}
        saved = config_from_dict(raw, validate=False)
    except (yaml.YAMLError, ConfigError, AttributeError, OSError) as err:
        raise RunError(f"{path} is damaged ({err}): delete the run folder {run_dir} to run it again") from None
    old, new = flatten_config(saved), flatten_config(load_config(run["base"], run["overrides"]))
    differ = sorted(
        k for k in old.keys() | new.keys()
        if old.get(k) != new.get(k) and k not in EXECUTION_KEYS
        and not (k in adjusted and new.get(k) == adjusted[k].get("requested"))
    )  # fmt: skip
    if differ:
        detail = ", ".join(f"{k}: saved {old.get(k)!r}, grid {new.get(k)!r}" for k in differ)
        raise ConfigError(f"run {run['name']} in {run_dir.parent} was made with another config than the sweep "
                          f"file asks for now ({detail}): move or delete {run_dir}, or restore the sweep file")  # fmt: skip
