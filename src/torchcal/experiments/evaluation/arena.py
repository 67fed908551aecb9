"""The calibrator arena: which calibrator should I use?

Every calibrator of the registry (:func:`torchcal.calibrators.list_calibrators`, read when the arena runs, so
calibrators registered later take part) is fitted on the validation logits of each task and scored on its test
logits: NLL, Brier, ECE, classwise ECE and accuracy, the improvement over the uncalibrated model with a seeded
paired bootstrap 95% interval, and the fit and predict time. Across tasks (runs) it gives the mean rank per
score and the pairwise win rate, the presentation of CalArena (Berta et al. 2026). A calibrator that raises,
or returns probabilities that are not finite, is reported as failed in its row and ranked last; one that warns
while fitting (e.g. an optimum on a bound, no convergence) is reported with the warning and ranked by its
scores. Decision 111 states the conventions.

A task is one (validation, test) pair: a finished run's ``logits.pt`` (:func:`tasks_from_runs`) or a user's
own saved logits and labels (:func:`load_user_split`, ``.pt``, ``.npz`` or ``.npy``).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import functional as F
from ..errors import RunError, UserError

__all__ = [
    "SCORES",
    "ArenaTask",
    "load_user_split",
    "tasks_from_runs",
    "resolve_calibrators",
    "run_arena",
    "rank_scores",
    "summarise",
    "save_to_runs",
]

#: The scores of the arena, in report order, and whether lower is better.
SCORES = ("nll", "brier", "ece", "classwise_ece", "accuracy")
LOWER_IS_BETTER = {"nll": True, "brier": True, "ece": True, "classwise_ece": True, "accuracy": False}
SCORE_TITLES = {
    "nll": "NLL",
    "brier": "Brier",
    "ece": "ECE",
    "classwise_ece": "cw-ECE",
    "accuracy": "accuracy",
}
# shown ×100 in the tables (ECE and accuracy are rates); NLL and Brier as they are
PERCENT = {"ece", "classwise_ece", "accuracy"}
UNCALIBRATED = "uncalibrated"
_BOOTSTRAP = {
    "nll": F.negative_log_likelihood,
    "brier": F.brier_score,
    "ece": F.expected_calibration_error,
    "classwise_ece": F.classwise_calibration_error,
    "accuracy": F.error_rate,  # accuracy = 1 − error on every resample
}


@dataclass
class ArenaTask:
    """One (validation, test) pair: logits (N, K) and integer targets (N,) of each split."""

    name: str
    val_logits: torch.Tensor
    val_targets: torch.Tensor
    test_logits: torch.Tensor
    test_targets: torch.Tensor
    source: str = ""

    @property
    def num_classes(self) -> int:
        return int(self.test_logits.shape[1])


# ------------------------------------------------------------------------------------------- inputs


_LAYOUT = (
    "expected logits (N, K) float with K >= 2 and targets (N,) integer class indices in [0, K): a .pt file "
    "holding a dict {'logits': ..., 'targets': ...}, an .npz with arrays 'logits' and 'targets', or an .npy "
    "of logits with the labels in a second .npy (--val-targets / --test-targets)"
)


def _load_array(path: Path, what: str):
    """The object saved in ``path`` (.pt: torch.load with weights_only; .npz: dict of arrays; .npy: array)."""
    import numpy as np

    if not path.is_file():
        raise UserError(f"{what} {path} does not exist")
    suffix = path.suffix.lower()
    try:
        if suffix == ".pt":
            return torch.load(path, map_location="cpu", weights_only=True)
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as data:
                return {key: data[key] for key in data.files}
        if suffix == ".npy":
            return np.load(path, allow_pickle=False)
    except Exception as err:  # noqa: BLE001 - any reading failure means the same to the user
        raise UserError(f"{what} {path} cannot be read as {suffix} ({type(err).__name__}: {err})") from None
    raise UserError(f"{what} {path}: unknown file type {suffix!r}; use .pt, .npz or .npy ({_LAYOUT})")


def _as_tensor(value, what: str) -> torch.Tensor:
    import numpy as np

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise UserError(f"{what} is an array of Python objects; {_LAYOUT}")
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, list | tuple):
        try:
            return torch.tensor(value)
        except (TypeError, ValueError):
            pass
    raise UserError(f"{what} is a {type(value).__name__}, not an array; {_LAYOUT}")


def _check_split(logits: torch.Tensor, targets: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.ndim != 2 or logits.shape[1] < 2 or logits.shape[0] < 1:
        raise UserError(f"{what}: logits have shape {tuple(logits.shape)}; {_LAYOUT}")
    if not (logits.is_floating_point()):
        raise UserError(
            f"{what}: logits have dtype {str(logits.dtype).replace('torch.', '')}, not float; {_LAYOUT}"
        )
    if not torch.isfinite(logits).all():
        raise UserError(f"{what}: logits hold NaN or infinite values")
    rows = logits.double().sum(1)
    if logits.min() >= 0 and logits.max() <= 1 and torch.allclose(rows, torch.ones_like(rows), atol=1e-4):
        raise UserError(f"{what}: the logits are probabilities (in [0, 1], rows summing to 1); save their "
                        f"logarithm (torch.log(probs) or numpy.log(probs)) as the logits")  # fmt: skip
    if targets.ndim == 2 and targets.shape == logits.shape:
        raise UserError(f"{what}: targets have shape {tuple(targets.shape)} like the logits (one-hot or "
                        f"multi-label); the arena takes class indices (N,); for one-hot labels save argmax")  # fmt: skip
    if targets.ndim != 1:
        raise UserError(f"{what}: targets have shape {tuple(targets.shape)}; {_LAYOUT}")
    if targets.shape[0] != logits.shape[0]:
        raise UserError(f"{what}: {logits.shape[0]} rows of logits but {targets.shape[0]} targets")
    if targets.is_floating_point():
        if not torch.isfinite(targets).all() or not torch.equal(targets, targets.round()):
            raise UserError(f"{what}: targets are not integer class indices (e.g. {targets[0].item()!r})")
    elif targets.dtype == torch.bool or targets.is_complex():
        raise UserError(f"{what}: targets have dtype {str(targets.dtype).replace('torch.', '')}; {_LAYOUT}")
    targets = targets.long()
    k = logits.shape[1]
    bad = (targets < 0) | (targets >= k)
    if bad.any():
        raise UserError(f"{what}: target {targets[bad][0].item()} is outside [0, {k}) for logits with K = {k} "
                        f"classes")  # fmt: skip
    dtype = logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32
    return logits.to(dtype), targets


def load_user_split(path, targets_path=None, what: str = "--val") -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, targets) of one split saved by the user, checked; any problem is a one-line
    :class:`~torchcal.experiments.errors.UserError` naming the file and what was expected.

    Layouts: ``.pt`` — a dict ``{"logits": (N, K) float tensor, "targets": (N,) integer tensor}`` (what
    ``torch.save({"logits": z, "targets": y}, path)`` writes); ``.npz`` — arrays ``logits`` and ``targets``
    (``numpy.savez(path, logits=z, targets=y)``); ``.npy`` — the logits alone, with the targets in a second
    ``.npy`` given as ``targets_path``.
    """
    path = Path(path)
    obj = _load_array(path, what)
    if isinstance(obj, dict):
        if targets_path is not None:
            raise UserError(f"{what}-targets is only for .npy logits; {path} holds both logits and targets")
        missing = [key for key in ("logits", "targets") if key not in obj]
        if missing and {"val", "test"} <= set(obj):
            raise UserError(f"{what} {path} is a torchcal run's logits file; pass its run folder instead: "
                            f"torchcal arena {path.parent}")  # fmt: skip
        if missing:
            held = ", ".join(repr(k) for k in obj) or "nothing"
            raise UserError(f"{what} {path} has no {' or '.join(repr(m) for m in missing)} (it holds {held}); "
                            f"{_LAYOUT}")  # fmt: skip
        logits, targets = (
            _as_tensor(obj["logits"], f"{what} logits"),
            _as_tensor(obj["targets"], f"{what} targets"),
        )
    else:
        if path.suffix.lower() != ".npy":
            raise UserError(f"{what} {path} holds a {type(obj).__name__}, not a dict with 'logits' and 'targets'; "
                            f"{_LAYOUT}")  # fmt: skip
        if targets_path is None:
            raise UserError(
                f"{what} {path} is an .npy of logits: give its labels with {what}-targets LABELS.npy"
            )
        labels = _load_array(Path(targets_path), f"{what}-targets")
        if isinstance(labels, dict):
            raise UserError(f"{what}-targets {targets_path} must be an .npy array of labels")
        logits, targets = _as_tensor(obj, f"{what} logits"), _as_tensor(labels, f"{what}-targets")
    return _check_split(logits, targets, f"{what} {path}")


def user_task(val, test, val_targets=None, test_targets=None) -> ArenaTask:
    """The task of ``torchcal arena --val VAL --test TEST``: both splits loaded and checked against each other."""
    val_logits, val_y = load_user_split(val, val_targets, "--val")
    test_logits, test_y = load_user_split(test, test_targets, "--test")
    if val_logits.shape[1] != test_logits.shape[1]:
        raise UserError(f"--val has K = {val_logits.shape[1]} classes but --test has {test_logits.shape[1]}")
    dtype = torch.promote_types(val_logits.dtype, test_logits.dtype)
    return ArenaTask(Path(test).stem, val_logits.to(dtype), val_y, test_logits.to(dtype), test_y,
                     source=f"{val} → {test}")  # fmt: skip


def tasks_from_runs(run_dirs, warn=None) -> list[ArenaTask]:
    """One task per finished run (its saved validation and test logits). A missing folder, or a multi-label
    run, is a :class:`RunError`; unfinished or damaged runs are skipped with a warning; none left is an error."""
    from ..run_files import LOGITS
    from .evaluate import load_logits, run_task

    warn = warn or (lambda message: warnings.warn(message, UserWarning, stacklevel=3))
    run_dirs = [Path(r) for r in run_dirs]
    names = [r.name for r in run_dirs]
    tasks = []
    for run_dir in run_dirs:
        if not run_dir.is_dir():
            raise RunError(f"run folder {run_dir} does not exist")
        if not (run_dir / LOGITS).exists():
            warn(
                f"{run_dir}: skipped, unfinished (no {LOGITS}; resume it with torchcal train -o {run_dir} --resume)"
            )
            continue
        try:
            logits = load_logits(run_dir)
        except RunError as err:
            warn(f"{run_dir}: skipped, {err}")
            continue
        if run_task(logits) == "multilabel":
            raise RunError(f"{run_dir} is a multi-label run; the arena ranks softmax calibrators of multiclass "
                           f"runs (calibrate multi-label runs with torchcal evaluate)")  # fmt: skip
        name = run_dir.name if names.count(run_dir.name) == 1 else str(run_dir)
        val, test = logits["val"], logits["test"]
        tasks.append(ArenaTask(name, val["logits"], val["targets"].long(), test["logits"], test["targets"].long(),
                               source=str(run_dir)))  # fmt: skip
    if not tasks:
        raise RunError("no finished run for the arena among the given folders")
    return tasks


def resolve_calibrators(spec: str | list | tuple = "all") -> tuple[str, ...]:
    """``"all"`` (every multiclass calibrator registered now, sorted) or comma-separated specs, each checked
    against the registry (a :class:`UserError` names an unknown one)."""
    from ...calibrators import list_calibrators
    from .evaluate import check_calibrators

    names = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [n.strip() for n in names if n.strip()]
    if names == ["all"]:
        return tuple(list_calibrators("multiclass"))
    if "all" in names:
        raise UserError("--calibrators takes 'all' or a list of calibrators, not both")
    if len(set(names)) != len(names):
        raise UserError(f"--calibrators names a calibrator twice: {names}")
    return check_calibrators(names, "multiclass")


# ------------------------------------------------------------------------------------------- fitting


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _point_scores(probs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    return {
        "nll": F.negative_log_likelihood(probs, targets).item(),
        "brier": F.brier_score(probs, targets).item(),
        "ece": F.expected_calibration_error(probs, targets).item(),
        "classwise_ece": F.classwise_calibration_error(probs, targets).item(),
        "accuracy": 1.0 - F.error_rate(probs, targets).item(),
    }


def _replicates(probs, targets, counts, n_resamples: int, seed: int) -> dict[str, torch.Tensor]:
    """Bootstrap replicates of every score on the task's resamples (``counts``, drawn once per task by
    :func:`torchcal.functional.resample_counts`): every model gets the same resamples, so the replicates of
    two models are paired."""
    reps = F.bootstrap_replicates(
        _BOOTSTRAP, probs, targets, n_resamples=n_resamples, seed=seed, counts=counts
    )
    reps["accuracy"] = 1.0 - reps["accuracy"]
    return reps


def _improvement(
    base: dict, cal: dict, base_rep: dict, cal_rep: dict, level: float
) -> dict[str, list[float]]:
    """[improvement, low, high] per score: uncalibrated − calibrated for the losses, calibrated − uncalibrated
    for accuracy (positive is better), with the percentile interval of the paired replicates."""
    alpha = (1 - level) / 2
    out = {}
    for name in SCORES:
        sign = 1.0 if LOWER_IS_BETTER[name] else -1.0
        diff = sign * (base_rep[name] - cal_rep[name])
        q = torch.tensor([alpha, 1 - alpha], dtype=diff.dtype, device=diff.device)
        low, high = torch.quantile(diff, q).tolist()
        out[name] = [sign * (base[name] - cal[name]), low, high]
    return out


def _scalar_parameters(cal) -> dict:
    fitted = cal.state_dict().get("fitted", {})
    return {k: v for k, v in fitted.items() if isinstance(v, float | int) and not isinstance(v, bool)}


def _fit_one(spec: str, task: ArenaTask, device: torch.device) -> tuple[dict, torch.Tensor | None]:
    """(row without scores, calibrated test probabilities or None): the calibrator fitted on validation and
    applied to test, timed; any exception, or probabilities that are not finite, make the row "failed"."""
    from ...calibrators import from_spec

    row = {"status": "ok", "message": "", "fit_seconds": None, "predict_seconds": None}
    val_z, val_y = task.val_logits.to(device), task.val_targets.to(device)
    test_z = task.test_logits.to(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cal = from_spec(spec)
            _sync(device)
            start = time.perf_counter()
            cal.fit(val_z, val_y)
            _sync(device)
            row["fit_seconds"] = time.perf_counter() - start
            start = time.perf_counter()
            probs = cal.transform(test_z)
            _sync(device)
            row["predict_seconds"] = time.perf_counter() - start
        except Exception as err:  # noqa: BLE001 - the arena reports the failure and goes on
            row.update(status="failed", message=f"{type(err).__name__}: {err}".strip().splitlines()[0])
            return row, None
    if probs.ndim != 2 or probs.shape != test_z.shape or not torch.isfinite(probs).all():
        row.update(status="failed", message="returned probabilities that are not finite or not (N, K)")
        return row, None
    row["parameters"] = _scalar_parameters(cal)
    messages = list(dict.fromkeys(str(w.message).splitlines()[0] for w in caught))
    if messages:
        row.update(status="warning", message="; ".join(messages))
    return row, probs


def run_arena(
    tasks: list[ArenaTask],
    calibrators: str | list | tuple = "all",
    *,
    n_resamples: int = 1000,
    seed: int = 0,
    confidence_level: float = 0.95,
    device: str | torch.device = "cpu",
    progress=None,
) -> dict:
    """Fits every calibrator on each task's validation split and scores it on its test split; returns the
    arena's results (JSON-ready): per task the uncalibrated scores and a row per calibrator (status, message,
    scores, improvement [value, low, high], fit and predict seconds, scalar fitted parameters), and the
    summary across tasks (:func:`summarise`). ``progress(task, calibrator)`` is called after each fit.

    Example:
        >>> import torch
        >>> from torchcal.experiments.evaluation.arena import ArenaTask, run_arena
        >>> g = torch.Generator().manual_seed(0)
        >>> z = 2 * torch.randn(2000, 4, generator=g)
        >>> y = torch.multinomial(torch.softmax(z, 1), 1, generator=g).squeeze(1)
        >>> task = ArenaTask("toy", 3 * z[:1000], y[:1000], 3 * z[1000:], y[1000:])   # over-confident by 3
        >>> res = run_arena([task], ["ts", "histogram"], n_resamples=200)
        >>> row = res["tasks"][0]["rows"]["ts"]
        >>> row["status"], round(row["parameters"]["temperature_"], 1), row["improvement"]["nll"][1] > 0
        ('ok', 3.0, True)
        >>> res["summary"]["order"][0]
        'ts'
    """
    from ..._validation import check_float, check_positive_int

    n_resamples = check_positive_int(n_resamples, "n_resamples")
    seed = check_positive_int(seed, "seed", minimum=0)
    level = check_float(confidence_level, "confidence_level", low=0, high=1, low_open=True, high_open=True)
    calibrators = resolve_calibrators(calibrators)
    device = torch.device(device)
    if not tasks:
        raise UserError("the arena needs at least one task")
    out_tasks = []
    for task in tasks:
        targets = task.test_targets.to(device)
        base_probs = torch.softmax(task.test_logits.to(device), 1)
        base = _point_scores(base_probs, targets)
        counts = F.resample_counts(int(targets.shape[0]), n_resamples, seed, device)
        base_rep = _replicates(base_probs, targets, counts, n_resamples, seed)
        rows = {}
        for spec in calibrators:
            row, probs = _fit_one(spec, task, device)
            if probs is not None:
                scores = _point_scores(probs, targets)
                reps = _replicates(probs, targets, counts, n_resamples, seed)
                row["test"] = scores
                row["improvement"] = _improvement(base, scores, base_rep, reps, level)
            rows[spec] = row
            if progress is not None:
                progress(task, spec)
        out_tasks.append({
            "name": task.name, "source": task.source, "num_classes": task.num_classes,
            "n_val": int(task.val_logits.shape[0]), "n_test": int(task.test_logits.shape[0]),
            "uncalibrated": {"test": base}, "rows": rows,
        })  # fmt: skip
    result = {
        "scores": list(SCORES),
        "lower_is_better": dict(LOWER_IS_BETTER),
        "calibrators": list(calibrators),
        "n_resamples": n_resamples,
        "seed": seed,
        "confidence_level": level,
        "device": str(device),
        "tasks": out_tasks,
    }
    result["summary"] = summarise(result)
    return result


# ------------------------------------------------------------------------------------------- ranks


def _task_values(task: dict, names: list[str], score: str) -> list[float | None]:
    """The score of every entrant on one task (None for a failure or a non-finite value)."""
    values = []
    for name in names:
        entry = task["uncalibrated"] if name == UNCALIBRATED else task["rows"][name]
        value = entry.get("test", {}).get(score)
        values.append(value if value is not None and math.isfinite(value) else None)
    return values


def rank_scores(values: list[float | None], lower_is_better: bool = True) -> list[float]:
    """Ranks 1..n of one task's values (1 = best); equal values share the mean of their ranks, and missing
    values (failures) rank after every present one, sharing the mean of the last ranks.

    Example:
        >>> from torchcal.experiments.evaluation.arena import rank_scores
        >>> rank_scores([0.3, 0.1, 0.3, None, 0.2])
        [3.5, 1.0, 3.5, 5.0, 2.0]
        >>> rank_scores([0.9, 0.8, None, None], lower_is_better=False)
        [1.0, 2.0, 3.5, 3.5]
    """
    present = sorted({v for v in values if v is not None}, reverse=not lower_is_better)
    ranks, start = {}, 1
    for v in present:
        ties = sum(1 for x in values if x == v)
        ranks[v] = start + (ties - 1) / 2
        start += ties
    missing = sum(1 for v in values if v is None)
    last = start + (missing - 1) / 2
    return [ranks[v] if v is not None else last for v in values]


def _beats(a, b, lower_is_better: bool) -> float:
    """1 if value a beats b, ½ for a tie (equal values, or both failed), 0 otherwise; a failure loses."""
    if a is None or b is None:
        return 0.5 if a is None and b is None else float(b is None)
    if a == b:
        return 0.5
    return float(a < b) if lower_is_better else float(a > b)


def summarise(result: dict) -> dict:
    """Across tasks: per score the mean rank and the overall win rate of every entrant (the calibrators and
    "uncalibrated"), and the pairwise win rate ``pairwise[score][a][b]`` = share of tasks where a beats b
    (ties ½); the failures per calibrator, mean fit and predict seconds, the mean improvement per score and
    how many tasks' intervals lie above / below 0; ``order``: the calibrators by mean NLL rank."""
    tasks = result["tasks"]
    calibrators = list(result["calibrators"])
    names = [UNCALIBRATED, *calibrators]
    mean_rank, win_rate, pairwise = {}, {}, {}
    for score in SCORES:
        lower = LOWER_IS_BETTER[score]
        per_task = [_task_values(t, names, score) for t in tasks]
        ranks = [rank_scores(v, lower) for v in per_task]
        mean_rank[score] = {n: sum(r[i] for r in ranks) / len(tasks) for i, n in enumerate(names)}
        table = {a: {b: sum(_beats(v[i], v[j], lower) for v in per_task) / len(tasks)
                     for j, b in enumerate(names) if j != i} for i, a in enumerate(names)}  # fmt: skip
        pairwise[score] = table
        win_rate[score] = {a: sum(table[a].values()) / max(1, len(names) - 1) for a in names}
    rows = {c: [t["rows"][c] for t in tasks] for c in calibrators}

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    improvement = {
        c: {s: {"mean": mean([r["improvement"][s][0] for r in rs if "improvement" in r]),
                "better": sum(1 for r in rs if "improvement" in r and r["improvement"][s][1] > 0),
                "worse": sum(1 for r in rs if "improvement" in r and r["improvement"][s][2] < 0)}
            for s in SCORES}
        for c, rs in rows.items()
    }  # fmt: skip
    order = sorted(calibrators, key=lambda c: (mean_rank["nll"][c], mean_rank["brier"][c], c))
    return {
        "n_tasks": len(tasks),
        "mean_rank": mean_rank,
        "win_rate": win_rate,
        "pairwise": pairwise,
        "failures": {c: sum(r["status"] == "failed" for r in rs) for c, rs in rows.items()},
        "warnings": {c: sum(r["status"] == "warning" for r in rs) for c, rs in rows.items()},
        "fit_seconds": {
            c: mean([r["fit_seconds"] for r in rs if r["status"] != "failed"]) for c, rs in rows.items()
        },
        "predict_seconds": {
            c: mean([r["predict_seconds"] for r in rs if r["status"] != "failed"]) for c, rs in rows.items()
        },  # fmt: skip
        "improvement": improvement,
        "order": order,
    }


# ------------------------------------------------------------------------------------------- reports


def save_to_runs(result: dict, tasks: list[ArenaTask]) -> None:
    """Adds each run's rows to its ``results.json`` under ``"arena"`` (other entries are kept)."""
    from .evaluate import _merge_results

    for task, entry in zip(tasks, result["tasks"], strict=True):
        if task.source and Path(task.source).is_dir():
            keep = {
                k: result[k] for k in ("calibrators", "n_resamples", "seed", "confidence_level", "device")
            }
            _merge_results(Path(task.source), {"arena": {**keep, **entry}})
