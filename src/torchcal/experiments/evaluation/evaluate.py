"""Evaluation of a finished run: every metric before and after each post-hoc calibrator, and the papers'
table (Markdown and CSV)."""

from __future__ import annotations

import csv
import io
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ... import functional as F
from ...calibrators import from_spec
from ..config import EXECUTION_KEYS, flatten_config
from ..errors import RunError, UserError
from ..run_files import (
    CALIBRATORS,
    CONFIG,
    LOGITS,
    RESULTS,
    atomic_write_bytes,
    check_writable,
    make_dir,
    read_json_object,
)
from .field_metrics import COLUMN_HEADERS as FIELD_HEADERS
from .field_metrics import (
    check_report_metrics,
    conformal_metrics,
    direction_word,
    field_metrics,
    field_stats,
    paired_ranking,
    parse_conformal,
)

__all__ = [
    "evaluate_run",
    "calibrate_run",
    "check_calibrators",
    "collect_groups",
    "label_groups",
    "report",
    "load_logits",
    "read_results",
    "RunGroup",
    "GROUP_IGNORED_KEYS",
    "METRIC_COLUMNS",
    "OPTIONAL_COLUMNS",
    "RESULTS",
    "post_calibration_probs",
]
METRIC_COLUMNS = ("error", "nll", "brier", "ece", "adaece", "classwise_ece", "mce", "smece", "s99_fraction")


def _metrics(probs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    return {
        "error": F.error_rate(probs, targets).item(),
        "nll": F.nll(probs, targets).item(),
        "brier": F.brier(probs, targets).item(),
        "rbs": F.rbs(probs, targets).item(),
        "ece": F.ece(probs, targets).item(),
        "adaece": F.adaece(probs, targets).item(),
        "classwise_ece": F.classwise_ece(probs, targets).item(),
        "mce": F.mce(probs, targets).item(),
        "smece": F.smece(probs, targets).item(),
        "debiased_ece": F.debiased_ece(probs, targets).item(),
        "ece_sweep": F.ece_sweep(probs, targets).item(),
        "ece_sweep_ew": F.ece_sweep(probs, targets, binning="equal_width").item(),
        "s99_fraction": F.confidence_at_least(probs, targets).fraction.item(),
        **field_metrics(probs, targets),
    }


# the report's columns on request (``report(columns=...)``, ``torchcal report --columns``): the root Brier
# score (Dual Focal App. G), debiased ECE and the ECE sweeps, equal mass (AdaFocal App. F) and equal width
OPTIONAL_COLUMNS = ("rbs", "debiased_ece", "ece_sweep", "ece_sweep_ew")


def _optional_value(split: dict, name: str):
    """A :data:`OPTIONAL_COLUMNS` value of a results split, None when the run was evaluated before it existed
    (RBS is then the root of its Brier score)."""
    if name in split:
        return split[name]
    if name == "rbs" and "brier" in split:
        return math.sqrt(max(split["brier"], 0.0))
    return None


MULTILABEL_COLUMNS = ("error", "nll", "brier", "ece", "adaece", "mce", "ece_micro", "auroc")


def _multilabel_metrics(probs: torch.Tensor, targets: torch.Tensor) -> dict:
    """The multi-label metrics of a split (macro over labels unless named micro), with the per-label AUROC and
    ECE of Table 9 of the FCL paper."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a one-class label: its AUROC is missing (NaN), reported as such
        auroc = F.multilabel_auroc(probs, targets, average="none")
    kept = auroc[~torch.isnan(auroc)]
    return {
        "error": ((probs >= 0.5).double() != targets.double()).double().mean().item(),
        "nll": F.multilabel_nll(probs, targets).item(),
        "brier": F.multilabel_brier_score(probs, targets).item(),
        "ece": F.multilabel_ece(probs, targets).item(),
        "adaece": F.multilabel_adaece(probs, targets).item(),
        "mce": F.multilabel_mce(probs, targets).item(),
        "ece_micro": F.multilabel_ece(probs, targets, average="micro").item(),
        "auroc": kept.mean().item() if kept.numel() else float("nan"),
        "auroc_per_label": auroc.tolist(),
        "ece_per_label": F.multilabel_ece(probs, targets, average="none").tolist(),
    }


def run_task(logits: dict) -> str:
    """ "multilabel" when the run's targets are (N, L) 0/1 matrices, else "multiclass"."""
    return "multilabel" if logits["val"]["targets"].ndim == 2 else "multiclass"


def load_logits(run_dir) -> dict:
    """The run's ``logits.pt`` (split -> {"logits", "targets"}); a missing folder, a path that is not a folder,
    a folder that holds neither a run's config nor logits, an unfinished run and a damaged file are
    :class:`RunError` naming the path (a folder holding only ``logits.pt`` is read: logits saved by hand)."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise RunError(f"run folder {run_dir} does not exist")
    if not run_dir.is_dir():
        raise RunError(f"{run_dir} is not a folder: give the folder of a run (torchcal train -o FOLDER)")
    path = run_dir / LOGITS
    if not path.exists() and not (run_dir / CONFIG).exists():
        raise RunError(f"{run_dir} is not a run folder (no {CONFIG} and no {LOGITS}): train a run into it "
                       f"first (torchcal train -o {run_dir}) or give the folder of a finished run")  # fmt: skip
    if not path.exists():
        raise RunError(f"{path} not found: the run has not finished; train it to the end first "
                       f"(torchcal train -o {run_dir} --resume)")  # fmt: skip
    try:
        logits = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the same thing to the user
        raise RunError(f"{path} is damaged or not a torchcal logits file ({type(err).__name__}): delete it "
                       f"and run torchcal train -o {run_dir} --resume to write it again") from None  # fmt: skip
    ok = isinstance(logits, dict) and all(
        isinstance(logits.get(s), dict) and {"logits", "targets"} <= set(logits[s]) for s in ("val", "test")
    )
    if not ok:
        raise RunError(f"{path} is not a torchcal logits file (no val and test logits and targets)")
    return logits


def read_results(run_dir) -> dict:
    """The run's ``results.json`` ({} when there is none); a damaged file is a :class:`RunError`."""
    return read_json_object(Path(run_dir) / RESULTS, f"delete it and run torchcal evaluate {run_dir} again")


def _merge_results(run_dir: Path, entries: dict) -> dict:
    """Adds ``entries`` (calibrator name -> its results, "uncalibrated" -> ...) to ``results.json``, keeping
    the results of other calibrators already there; returns the whole file's content."""
    result = {**read_results(run_dir), **entries}
    text = json.dumps(result, indent=2, sort_keys=True)
    atomic_write_bytes(Path(run_dir) / RESULTS, lambda fh: fh.write(text.encode()))
    return result


def check_calibrators(names, task: str | None = "multiclass") -> tuple[str, ...]:
    """The calibrator specs (``ts``, ``ts:objective=ece``, ...; :func:`torchcal.calibrators.parse_spec`), each
    checked against the registry of ``task`` (None: valid for either) and the calibrator's arguments (a
    :class:`UserError` otherwise)."""
    names = tuple(n.strip() if isinstance(n, str) else n for n in names)
    for name in names:
        errors = []
        for t in (task,) if task else ("multiclass", "multilabel"):
            try:
                from_spec(name, t)
                break
            except ValueError as err:
                errors.append(err)
        else:
            raise UserError(_calibrator_error(name, task, errors)) from None
    if not names:
        raise UserError("no calibrator given")
    return names


def _calibrator_error(spec, task, errors) -> str:
    """The message for a spec no registry accepts: the error of the registry that knows its name, or, for a
    name neither knows (``task`` None), both registries' names."""
    from ...calibrators import get_calibrator_class, list_calibrators, parse_spec

    if task is not None:
        return str(errors[0])
    try:
        name = parse_spec(spec)[0]
    except ValueError as err:
        return str(err)
    for t, err in zip(("multiclass", "multilabel"), errors, strict=True):
        try:
            get_calibrator_class(name, t)
            return str(err)  # the name exists here: its argument is what is wrong
        except ValueError:
            pass
    return (f"unknown calibrator {name!r}; choose one of {list_calibrators()} (multiclass) or "
            f"{list_calibrators('multilabel')} (multi-label)")  # fmt: skip


def calibrator_file_stem(spec: str) -> str:
    """The file name (without suffix) of a fitted calibrator in ``<run>/calibrators/``: ``ts``,
    ``ts_objective-ece``."""
    return spec.replace(":", "_").replace("=", "-").replace("/", "-")


def describe_calibrator(spec: str) -> str:
    """How a calibrator spec chooses its parameters, for report titles: e.g. "ts (T minimising validation
    NLL)", "ts:objective=ece (T on the grid 0.1, 0.2, ..., 10 minimising validation ECE, 15 bins)"."""
    try:
        cal = from_spec(spec)
    except ValueError:
        cal = from_spec(spec, "multilabel")
    objective = str(getattr(cal, "objective", None))  # "None": a calibrator without one
    bins = getattr(cal, "n_bins", 15)
    criteria = {"nll": "validation NLL", "ece": f"validation ECE ({bins} equal-width bins)",
                "adaece": f"validation equal-mass ECE ({bins} bins)"}  # fmt: skip
    beyond = ", searched beyond its edge when the minimum lies there" if getattr(cal, "extend", False) else ""
    if cal.name == "temperature_scaling":
        how = (
            "T minimising "
            if objective == "nll"
            else f"T on the papers' grid 0.1, 0.2, ..., 10{beyond}, minimising "
        )
        return f"{spec} ({how}{criteria.get(objective, objective)})"
    if cal.name == "binary_temperature_scaling":
        return f"{spec} (T per label minimising validation binary NLL)"
    if cal.name == "platt":
        return f"{spec} (Platt's σ(a·z + b) per label, validation binary NLL)"
    if cal.name == "focal_temperature_scaling":
        return f"{spec} ((γ, T) on the grid of Komisarenko & Kull{beyond}, minimising {criteria.get(objective, objective)})"
    return spec


def _ood_sets(logits: dict) -> list[str]:
    """Names of the OOD sets in a run's logits (``ood_<name>``; runs from before several sets: none)."""
    return [k[4:] for k in logits if k.startswith("ood_")]


def _scores(logits: dict, to_probs) -> dict:
    """Test (and shift) metrics and OOD AUROCs of one model, ``to_probs`` mapping logits to probabilities
    (softmax, or a fitted calibrator), applied once per split."""
    probs = {split: to_probs(logits[split]["logits"]) for split in ("test", "shift") if split in logits}
    metrics = _multilabel_metrics if run_task(logits) == "multilabel" else _metrics
    out: dict[str, Any] = {split: metrics(p, logits[split]["targets"]) for split, p in probs.items()}
    if "ood" in logits:
        sets = _ood_sets(logits)  # ood_<name> per set; "ood" is the first (or the only one of older runs)
        by_set = {
            name: F.ood_auroc(probs["test"], to_probs(logits[f"ood_{name}"]["logits"])).item()
            for name in sets
        }
        out["ood_auroc"] = (
            by_set[sets[0]] if sets else F.ood_auroc(probs["test"], to_probs(logits["ood"]["logits"])).item()
        )
        out["ood_auroc_by_set"] = by_set
    return out


def _fit_and_score(logits: dict, method: str):
    """(fitted calibrator, its results): fitted on validation, scored on test (and shift / OOD)."""
    import warnings

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cal = from_spec(method, run_task(logits)).fit(logits["val"]["logits"], logits["val"]["targets"])
    except ValueError as err:  # an argument of the spec or the data it is fitted on (named in the message)
        raise UserError(f"calibrator {method!r} cannot be fitted: {err}") from None
    notes = list(dict.fromkeys(str(w.message) for w in caught))
    for note in notes:  # shown as they were, and kept with the results (a search that ended on a bound)
        warnings.warn(f"calibrator {method!r}: {note}", UserWarning, stacklevel=3)
    fitted = cal.state_dict()["fitted"]
    out: dict[str, Any] = {"parameters": {k: v for k, v in fitted.items() if isinstance(v, float | int)}}
    search = getattr(cal, "search_", None)  # the grids a grid-search calibrator searched (decision 81)
    if search:
        out["search"] = search
    if notes:
        out["warnings"] = notes
    return cal, {**out, **_scores(logits, cal.transform)}


def _save_calibrator(run_dir: Path, method: str, cal) -> None:
    folder = make_dir(run_dir / CALIBRATORS)
    state, text = cal.state_dict(), cal.to_json()
    stem = calibrator_file_stem(method)
    atomic_write_bytes(folder / f"{stem}.pt", lambda fh: torch.save(state, fh))
    atomic_write_bytes(folder / f"{stem}.json", lambda fh: fh.write(text.encode()))


def calibrate_run(run_dir, method: str, *, save: bool = True) -> dict:
    """Fits calibrator ``method`` on the run's validation logits and evaluates test (and shift / OOD);
    returns ``{"calibrator": state_dict, "parameters": ..., "test": ..., ...}``.

    With ``save`` the fitted calibrator is written to ``<run>/calibrators/<method>.pt`` (its
    ``state_dict()``, loadable with ``torch.load(weights_only=True)``) and ``<method>.json`` (``to_json()``;
    rebuild it with :func:`torchcal.calibrators.from_json`), and its results are added to ``results.json``
    (other calibrators' results are kept)."""
    run_dir = Path(run_dir)
    logits = load_logits(run_dir)
    check_calibrators([method], run_task(logits))
    cal, out = _fit_and_score(logits, method)
    if save:
        _save_calibrator(run_dir, method, cal)
        entries = {method: out}
        if "uncalibrated" not in read_results(run_dir):  # the "before" of the before/after table
            entries.update(_uncalibrated(run_dir, logits))
        _merge_results(run_dir, entries)
    return {"calibrator": cal.state_dict(), **out}


def _uncalibrated(run_dir: Path, logits: dict) -> dict:
    """The results.json entries of the uncalibrated model: "uncalibrated" (test, shift, OOD and validation
    metrics) and, for multi-label runs, "task" and "label_names"."""
    task = run_task(logits)

    def softmax(z):
        return torch.sigmoid(z) if task == "multilabel" else torch.softmax(z, 1)

    metrics = _multilabel_metrics if task == "multilabel" else _metrics
    result: dict[str, Any] = {"uncalibrated": _scores(logits, softmax)}
    result["uncalibrated"]["val"] = metrics(softmax(logits["val"]["logits"]), logits["val"]["targets"])
    if task == "multilabel":
        result["task"] = "multilabel"
        result["label_names"] = _label_names(run_dir, logits["val"]["targets"].shape[1])
    return result


def evaluate_run(run_dir, calibrators=("ts", "fts"), conformal=()) -> dict:
    """Metrics of the uncalibrated model and after each calibrator (each saved as by
    :func:`calibrate_run`), added to ``results.json``; returns the file's whole content.

    ``conformal``: specs such as ``"aps:alpha=0.1"`` (:func:`torchcal.experiments.evaluation.field_metrics.
    parse_conformal`); each adds ``"conformal": {spec: set metrics}`` to the uncalibrated and each
    calibrator's results: a seeded half of the test split calibrates the sets, the other half scores them."""
    run_dir = Path(run_dir)
    logits, calibrators, specs = check_run(run_dir, calibrators, conformal)
    result = _uncalibrated(run_dir, logits)
    test = logits["test"]
    if specs:
        result["uncalibrated"]["conformal"] = conformal_metrics(
            torch.softmax(test["logits"], 1), test["targets"], specs
        )
    fitted = {}
    for method in calibrators:  # every calibrator fitted before any file is written
        fitted[method], result[method] = _fit_and_score(logits, method)
        if specs:
            result[method]["conformal"] = conformal_metrics(
                fitted[method].transform(test["logits"]), test["targets"], specs
            )
    for method, cal in fitted.items():
        _save_calibrator(run_dir, method, cal)
    return _merge_results(run_dir, result)


def check_run(run_dir, calibrators=("ts", "fts"), conformal=()) -> tuple[dict, tuple[str, ...], list]:
    """What :func:`evaluate_run` checks before it computes or writes anything: the run's logits
    (:func:`load_logits`), its ``results.json`` (readable when present), the calibrators and conformal specs
    against the run's task, and that the run folder can be written. Returns (logits, calibrators, conformal
    specs); ``torchcal evaluate`` calls it for every run before evaluating the first."""
    run_dir = Path(run_dir)
    specs = [parse_conformal(s) for s in conformal]
    logits = load_logits(run_dir)
    task = run_task(logits)
    if specs and task == "multilabel":
        raise UserError(
            f"--conformal: conformal sets are defined for multiclass runs, {run_dir} is multi-label"
        )
    calibrators = check_calibrators(calibrators, task)
    read_results(run_dir)
    check_writable(run_dir)
    return logits, calibrators, specs


def _label_names(run_dir: Path, n: int) -> list[str]:
    """The label names the run saved in ``config.yaml``'s meta (else label 0, label 1, ...)."""
    import yaml

    try:
        meta = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("meta") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        meta = {}
    names = meta.get("label_names")
    return (
        [str(x) for x in names]
        if isinstance(names, list) and len(names) == n
        else [f"label {j}" for j in range(n)]
    )


# Report column titles where the results key is not self-explanatory
COLUMN_HEADERS = {
    "s99_fraction": "S99 (% with conf ≥ 0.99)",
    "rbs": "RBS",
    "debiased_ece": "debiased ECE",
    "ece_sweep": "ECE sweep (equal mass)",
    "ece_sweep_ew": "ECE sweep (equal width)",
}

# Runs that differ only in these (the seed and the execution settings) share a report row.
GROUP_IGNORED_KEYS = ("train.seed", *EXECUTION_KEYS)


@dataclass
class RunGroup:
    """One row of the report: runs whose resolved configs are equal except in :data:`GROUP_IGNORED_KEYS`
    (so, in practice, the seed). ``stats`` maps a column to (mean, std, number of runs) of test values ×100."""

    label: str
    runs: list[Path]
    seeds: list[int | None]  # None: a saved config without train.seed
    config: dict
    stats: dict[str, tuple[float, float, int]] = field(default_factory=dict)
    results: list[dict] = field(default_factory=list)
    # the :data:`OPTIONAL_COLUMNS` the row's runs have, shown when asked for (``report(columns=...)``)
    optional_stats: dict[str, tuple[float, float, int]] = field(default_factory=dict)

    @property
    def seeds_text(self) -> str:
        return ", ".join(str(s) for s in self.seeds)


def _finished_run(run_dir: Path, calibrator: str, warn):
    """(flattened config, results with ``calibrator``) of a finished run, or None (with a warning) for an
    unfinished or damaged one. A missing folder is a :class:`RunError`."""
    import yaml

    if not run_dir.is_dir():
        raise RunError(f"run folder {run_dir} does not exist")
    try:
        raw = yaml.safe_load((run_dir / "config.yaml").read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a mapping")
    except FileNotFoundError:
        warn(f"{run_dir}: skipped, not a run (no config.yaml)")
        return None
    except (ValueError, yaml.YAMLError, OSError) as err:
        warn(f"{run_dir}: skipped, config.yaml is damaged ({err})")
        return None
    if not (run_dir / LOGITS).exists():
        warn(
            f"{run_dir}: skipped, unfinished (no {LOGITS}; resume it with torchcal train -o {run_dir} --resume)"
        )
        return None
    try:
        load_logits(run_dir)  # the figures and any re-evaluation need them: a damaged file skips the run
        res = read_results(run_dir)
        if "uncalibrated" not in res or calibrator not in res:
            res = evaluate_run(run_dir, (calibrator,))
    except RunError as err:
        warn(f"{run_dir}: skipped, {err}")
        return None
    raw.pop("meta", None)
    return flatten_config(raw), res


def distinct_folders(run_dirs, warn):
    """The run folders of ``run_dirs`` with each folder once: one given twice (or through a link) is yielded
    the first time, with a warning (``warn``) naming both names.

    Example:
        >>> list(distinct_folders(["runs/a", "runs/b", "runs/./a"], print))
        runs/a is given twice (as runs/a): counted once
        [PosixPath('runs/a'), PosixPath('runs/b')]
    """
    import os

    seen: dict[str, Path] = {}
    for run_dir in map(Path, run_dirs):
        real = os.path.realpath(run_dir)
        if real in seen:
            warn(f"{run_dir} is given twice (as {seen[real]}): counted once")
            continue
        seen[real] = run_dir
        yield run_dir


def group_key(flat: dict) -> tuple[str, dict, str]:
    """(the grouping key, the config it is made of, the label dataset · model · loss) of a run's flattened
    config: runs with the same key differ only in :data:`GROUP_IGNORED_KEYS`.

    Example:
        >>> flat = {"data.name": "cifar10", "model.name": "resnet50", "loss.name": "fl-3", "train.seed": 1}
        >>> key, config, label = group_key(flat)
        >>> label, "train.seed" in config, key == group_key({**flat, "train.seed": 2})[0]
        ('cifar10 · resnet50 · fl-3', False, True)
    """
    config = {k: v for k, v in flat.items() if k not in GROUP_IGNORED_KEYS}
    label = f"{flat.get('data.name')} · {flat.get('model.name')} · {flat.get('loss.name')}"
    return json.dumps(config, sort_keys=True, default=str), config, label


def collect_groups(run_dirs, calibrator: str = "ts", warn=None) -> list[RunGroup]:
    """The report's rows. Runs are grouped by their whole resolved config except :data:`GROUP_IGNORED_KEYS`;
    a row is labelled dataset · model · loss, plus ``[key=value, ...]`` for the keys in which rows with
    the same dataset · model · loss differ. Unfinished or damaged run folders are skipped with a warning
    (``warn``, default :func:`warnings.warn`); when none is left a :class:`RunError` is raised.

    A row counts each run once and each seed once: a folder given twice (or through a link) is read once,
    and a run whose seed another run of its row already has (a copied folder, or the same training on
    another device) is left out with a warning naming both folders, so ``n`` is the number of seeds."""
    import warnings

    check_calibrators([calibrator], None)
    warn = warn or (lambda message: warnings.warn(message, UserWarning, stacklevel=3))
    by_key: dict[str, RunGroup] = {}
    for run_dir in distinct_folders(run_dirs, warn):
        found = _finished_run(run_dir, calibrator, warn)
        if found is None:
            continue
        flat, res = found
        key, config, base = group_key(flat)
        group = by_key.setdefault(key, RunGroup(base, [], [], config))
        seed = flat.get("train.seed")
        if seed in group.seeds:
            twin = group.runs[group.seeds.index(seed)]
            warn(f"{run_dir} repeats seed {seed} of {twin} with the same config (a copy, or the same training "
                 f"elsewhere): left out, a report row counts each seed once")  # fmt: skip
            continue
        group.runs.append(run_dir)
        group.seeds.append(flat.get("train.seed"))
        group.results.append(res)
    if not by_key:
        raise RunError("no finished run to report among the given folders")
    groups = list(by_key.values())
    label_groups(groups)
    for group in groups:
        group.stats = _group_stats(group.results, calibrator)
        group.optional_stats = _optional_stats(group.results, calibrator)
    return groups


def label_groups(groups) -> None:
    """Appends ``[key=value, ...]`` to the label (dataset · model · loss) of each group that shares it with
    another, naming the config keys in which those groups differ (``groups``: objects with ``label`` and
    ``config``)."""
    base = {id(g): g.label for g in groups}
    for group in groups:
        twins = [g for g in groups if base[id(g)] == base[id(group)]]
        if len(twins) > 1:
            differ = sorted(
                k for k in group.config if len({json.dumps(g.config.get(k), default=str) for g in twins}) > 1
            )
            group.label += " [" + ", ".join(f"{k}={group.config[k]}" for k in differ) + "]"


def fit_warnings(groups, calibrator: str) -> list[tuple[str, Path, str]]:
    """(row label, run folder, message) of every warning the calibrator's fit gave (saved in results.json),
    e.g. a temperature search that ended on a bound of its range."""
    return [(g.label, run, message) for g in groups for run, res in zip(g.runs, g.results, strict=True)
            for message in res.get(calibrator, {}).get("warnings", [])]  # fmt: skip


def fit_warning_lines(groups, calibrator: str) -> list[str]:
    """The report's paragraph on :func:`fit_warnings` (none when there is none)."""
    found = fit_warnings(groups, calibrator)
    if not found:
        return []
    head = f"**Warnings of the {calibrator} fits** ({len(found)}; also in each run's results.json):"
    return ["", head, "", *(f"- {label}: {run}: {message}" for label, run, message in found)]


def _group_stats(results: list[dict], calibrator: str) -> dict[str, tuple[float, float, int]]:
    if any(res.get("task") == "multilabel" for res in results):
        return _multilabel_stats(results, calibrator)
    values = defaultdict(list)
    for res in results:
        for m in METRIC_COLUMNS:
            values[f"{m} pre"].append(100 * res["uncalibrated"]["test"][m])
            values[f"{m} post"].append(100 * res[calibrator]["test"][m])
        values["T"].append(res[calibrator]["parameters"].get("temperature_", float("nan")))
        for m, (pre, post) in field_stats(res, calibrator).items():
            values[f"{m} pre"].append(pre)
            values[f"{m} post"].append(post)
        if "shift" in res["uncalibrated"]:
            values["shift ece pre"].append(100 * res["uncalibrated"]["shift"]["ece"])
            values["shift ece post"].append(100 * res[calibrator]["shift"]["ece"])
        if "ood_auroc" in res["uncalibrated"]:
            values["ood auroc pre"].append(100 * res["uncalibrated"]["ood_auroc"])
            values["ood auroc post"].append(100 * res[calibrator]["ood_auroc"])
            for name, value in res["uncalibrated"].get("ood_auroc_by_set", {}).items():
                values[f"ood auroc {name} pre"].append(100 * value)
                values[f"ood auroc {name} post"].append(100 * res[calibrator]["ood_auroc_by_set"][name])
    out = {}
    for col, vals in values.items():
        t = torch.tensor(vals, dtype=torch.float64)
        out[col] = (float(t.mean()), float(t.std()) if len(vals) > 1 else float("nan"), len(vals))
    return out


def _optional_stats(results: list[dict], calibrator: str) -> dict[str, tuple[float, float, int]]:
    """The :data:`OPTIONAL_COLUMNS` of a multiclass row as ``RunGroup.stats`` holds the others (×100), each
    kept only when every run of the row has it."""
    out = {}
    if any(res.get("task") == "multilabel" for res in results):
        return out
    for m in OPTIONAL_COLUMNS:
        for when, key in (("pre", "uncalibrated"), ("post", calibrator)):
            vals = [_optional_value(res[key]["test"], m) for res in results]
            if vals and all(v is not None for v in vals):
                t = 100 * torch.tensor(vals, dtype=torch.float64)
                out[f"{m} {when}"] = (float(t.mean()), float(t.std()) if len(vals) > 1 else float("nan"), len(vals))
    return out


def _multilabel_stats(results: list[dict], calibrator: str) -> dict[str, tuple[float, float, int]]:
    values = defaultdict(list)
    for res in results:
        if res.get("task") != "multilabel":
            raise RunError("a report row mixes multi-label and multiclass runs")
        for m in MULTILABEL_COLUMNS:
            values[f"{m} pre"].append(100 * res["uncalibrated"]["test"][m])
            values[f"{m} post"].append(100 * res[calibrator]["test"][m])
        for name, value in zip(
            res["label_names"], res["uncalibrated"]["test"]["auroc_per_label"], strict=True
        ):
            values[f"auroc {name} pre"].append(100 * value)
        for name, value in zip(res["label_names"], res[calibrator]["test"]["auroc_per_label"], strict=True):
            values[f"auroc {name} post"].append(100 * value)
        values["T"].append(res[calibrator]["parameters"].get("temperature_", float("nan")))
        for m, (pre, post) in field_stats(res, calibrator).items():
            values[f"{m} pre"].append(pre)
            values[f"{m} post"].append(post)
    out = {}
    for col, vals in values.items():
        t = torch.tensor(vals, dtype=torch.float64)
        out[col] = (float(t.mean()), float(t.std()) if len(vals) > 1 else float("nan"), len(vals))
    return out


def _multilabel_report(groups, out_dir: Path, calibrator: str, note: str) -> tuple[str, str]:
    """Table 9 of the FCL paper (CheXNet): per-label AUROC, their mean, then ECE and MCE (and AdaECE, NLL,
    Brier, error) uncalibrated / calibrated, mean ± std over each row's runs, ×100."""
    names = groups[0].results[0]["label_names"]
    if any(g.results[0]["label_names"] != names for g in groups):
        raise RunError("the runs of a multi-label report must share their labels")

    def fmt(stat):
        mean, std, n = stat
        return f"{mean:.2f} ± {std:.2f}" if n > 1 else f"{mean:.2f}"

    calibrated = ["ece", "mce", "adaece", "nll", "brier"]
    md = ["| method | seeds | " + " | ".join(f"AUROC {n}" for n in names) + " | mean AUROC | "
          + " | ".join(c.upper() if c in ("ece", "mce") else c for c in calibrated) + " | error |",
          "|" + "---|" * (len(names) + len(calibrated) + 4)]  # fmt: skip
    buf = io.StringIO()
    writer = csv.writer(buf)
    stat_cols = ([f"auroc {n} pre" for n in names] + ["auroc pre"]
                 + [f"{c} {w}" for c in calibrated for w in ("pre", "post")] + ["error pre"])  # fmt: skip
    writer.writerow(["method", "calibrator", "n_runs", "seeds", "runs",
                     *[f"{c.replace(' ', '_')}_{k}" for c in stat_cols for k in ("mean", "std", "sem")]])  # fmt: skip
    for group in groups:
        st = group.stats
        cells = [
            group.label,
            group.seeds_text,
            *(fmt(st[f"auroc {n} pre"]) for n in names),
            fmt(st["auroc pre"]),
        ]
        cells += [f"{fmt(st[f'{c} pre'])} / {fmt(st[f'{c} post'])}" for c in calibrated]
        cells.append(fmt(st["error pre"]))
        md.append("| " + " | ".join(cells) + " |")
        row = [group.label, calibrator, len(group.runs), group.seeds_text, ";".join(map(str, group.runs))]
        for c in stat_cols:
            mean, std, n = st.get(c, (float("nan"), float("nan"), 0))
            row += [mean, std, std / math.sqrt(n) if n > 1 else float("nan")]
        writer.writerow(row)
    title = (f"Multi-label test metrics ×100 (the layout of the FCL paper's CheXNet Table 9): AUROC per label and "
             f"their mean (labels with one class in the test set left out), then ECE, MCE, AdaECE (equal-width / "
             f"equal-mass, 15 bins, macro over labels), NLL and Brier: uncalibrated / after "
             f"{describe_calibrator(calibrator)}, fitted on the validation split; error = share of wrong 0/1 "
             f"decisions at p ≥ 0.5; mean ± std over the runs of a row (standard errors in report.csv).\n\n")  # fmt: skip
    sources = ["", "Runs of each row:", ""] + [f"- {g.label}: {', '.join(map(str, g.runs))}" for g in groups]
    sources += fit_warning_lines(groups, calibrator)
    markdown = title + (f"**{note}**\n\n" if note else "") + "\n".join(md + sources) + "\n"
    make_dir(out_dir)
    atomic_write_bytes(out_dir / "report.md", lambda fh: fh.write(markdown.encode()))
    csv_text = buf.getvalue()
    atomic_write_bytes(out_dir / "report.csv", lambda fh: fh.write(csv_text.encode()))
    return markdown, csv_text


def post_calibration_probs(run_dir, calibrator: str):
    """(test probabilities after the run's saved ``calibrator``, test targets); the calibrator is refitted on
    the validation split if its saved file is missing."""
    from ...calibrators import from_json

    logits = torch.load(run_dir / LOGITS, weights_only=True)
    test, val = logits["test"], logits["val"]
    try:
        cal = from_json((run_dir / CALIBRATORS / f"{calibrator_file_stem(calibrator)}.json").read_text())
    except (OSError, ValueError, KeyError):
        cal = from_spec(calibrator, "multiclass").fit(val["logits"], val["targets"])
    return cal.transform(test["logits"]), test["targets"]


def check_columns(columns) -> tuple[str, ...]:
    """The report's extra columns: names of :data:`OPTIONAL_COLUMNS` (a comma-separated string or a
    sequence), in the order given, each once."""
    if isinstance(columns, str):
        columns = [c.strip() for c in columns.split(",") if c.strip()]
    columns = tuple(dict.fromkeys(columns))
    unknown = [c for c in columns if c not in OPTIONAL_COLUMNS]
    if unknown:
        raise UserError(
            f"--columns: unknown column {unknown[0]!r}; choose from {', '.join(OPTIONAL_COLUMNS)}"
        )
    return columns


def check_optional_columns(groups, columns) -> None:
    """A :class:`RunError` naming the runs to evaluate again when a row lacks a requested column."""
    for col in columns:
        for group in groups:
            if f"{col} pre" not in group.optional_stats or f"{col} post" not in group.optional_stats:
                raise RunError(
                    f"column {col!r}: a run of row {group.label!r} was evaluated before it existed; run "
                    f"torchcal evaluate on {', '.join(map(str, group.runs))} again"
                )


def report(
    run_dirs, out_dir, calibrator: str = "ts", warn=None, note: str = "", groups=None, metrics=(), columns=()
) -> tuple[str, str]:
    """The papers' table: one row per group of runs (:func:`collect_groups`: equal configs but the seed,
    averaged, mean ± std, with the seeds and run folders named), each metric "pre / post" the calibrator
    with its temperature in brackets, plus the shifted-set ECE and the OOD AUROC; values ×100. Writes
    ``report.md`` and ``report.csv`` to ``out_dir`` (created only when there is something to report) and
    returns (markdown, csv). ``note`` (e.g. the regime the runs are in) is printed under the title; ``groups``
    (from :func:`collect_groups` with this calibrator) saves collecting them again. ``metrics`` adds columns
    of :data:`torchcal.experiments.evaluation.field_metrics.REPORT_METRICS` (runs evaluated before they existed leave the
    cell empty) and says next to each ECE whether the model is over- or under-confident (signed ECE);
    ``columns`` adds :data:`OPTIONAL_COLUMNS` after S99 (multiclass runs)."""
    metrics = check_report_metrics(metrics)
    columns_on_request = check_columns(columns)
    groups = collect_groups(run_dirs, calibrator, warn) if groups is None else groups
    out_dir = Path(out_dir)
    multilabel = [g.results[0].get("task") == "multilabel" for g in groups]
    if any(multilabel):
        if not all(multilabel):
            raise RunError("a report holds either multi-label or multiclass runs; report them separately")
        if columns_on_request:
            raise UserError(
                "--columns takes multiclass runs only (the multi-label report has its own layout)"
            )
        return _multilabel_report(groups, out_dir, calibrator, note)
    check_optional_columns(groups, columns_on_request)

    columns = [
        "error",
        "nll",
        "brier",
        "ece",
        "adaece",
        "classwise_ece",
        "mce",
        "smece",
        "s99_fraction",
        *columns_on_request,
        "shift ece",
        "ood auroc",
    ]
    columns += list(metrics)
    headers = {**COLUMN_HEADERS, **FIELD_HEADERS}
    ood_sets = sorted({c[len("ood auroc ") : -len(" pre")] for g in groups for c in g.stats
                       if c.startswith("ood auroc ") and c.endswith(" pre") and c != "ood auroc pre"})  # fmt: skip
    if len(ood_sets) > 1:  # one AUROC column per OOD set
        at = columns.index("ood auroc")
        columns = [*columns[:at], *(f"ood auroc {name}" for name in ood_sets), *columns[at + 1 :]]

    def fmt(stat):
        mean, std, n = stat
        return f"{mean:.2f} ± {std:.2f}" if n > 1 else f"{mean:.2f}"

    md = ["| method | seeds | " + " | ".join(headers.get(c, c) for c in columns) + " |",
          "|" + "---|" * (len(columns) + 2)]  # fmt: skip
    buf = io.StringIO()
    writer = csv.writer(buf)
    stat_cols = [f"{c} {w}" for c in columns for w in ("pre", "post") if not (c == "error" and w == "post")]
    writer.writerow(["method", "calibrator", "n_runs", "seeds", "runs", "temperature_mean",
                     *[f"{c.replace(' ', '_')}_{k}" for c in stat_cols for k in ("mean", "std", "sem")]])  # fmt: skip
    has_t = any(math.isfinite(group.stats["T"][0]) for group in groups)
    for group in groups:
        stats = {**group.stats, **{k: v for k, v in group.optional_stats.items()
                                   if k.rsplit(" ", 1)[0] in columns_on_request}}  # fmt: skip
        cells = [group.label, group.seeds_text]
        for col in columns:
            if col == "error":
                cells.append(fmt(stats["error pre"]))
            elif f"{col} pre" in stats:
                cell = f"{fmt(stats[f'{col} pre'])} / {fmt(stats[f'{col} post'])}"
                if col == "ece" and metrics and "signed_ece pre" in stats:
                    pre, post = (direction_word(stats[f"signed_ece {w}"][0]) for w in ("pre", "post"))
                    cell = f"{fmt(stats['ece pre'])} {pre} / {fmt(stats['ece post'])} {post}"
                if col == "ece" and math.isfinite(stats["T"][0]):  # (no bracket for a map without a temperature)
                    cell += f" ({stats['T'][0]:.2f})"
                cells.append(cell)
            else:
                cells.append("")
        md.append("| " + " | ".join(cells) + " |")
        row = [group.label, calibrator, len(group.runs), group.seeds_text, ";".join(map(str, group.runs)),
               stats["T"][0]]  # fmt: skip
        for c in stat_cols:
            mean, std, n = stats.get(c, (float("nan"), float("nan"), 0))
            row += [mean, std, std / math.sqrt(n) if n > 1 else float("nan")]  # standard error of the mean
        writer.writerow(row)
    title = (f"Test metrics ×100: uncalibrated / after {describe_calibrator(calibrator)}, fitted on the "
             "validation split" + (" (its mean temperature in brackets after ECE)" if has_t else "") + "; mean ± std over the runs of a row, "
             "which differ only in their seed (standard errors in report.csv); S99 = share of test samples with "
             "confidence ≥ 0.99 (Mukhoti et al., Table 6); shift = the shifted test set; OOD AUROC by "
             "predictive entropy (test set against each OOD set)"
             + ("; RBS = root Brier score (Gruber & Buettner 2022)" if "rbs" in columns_on_request else "")
             + ".\n\n")  # fmt: skip
    if metrics:
        title += ("Signed ECE = mean confidence − accuracy (> 0: over-confident, the word after each ECE); ECE "
                  "over/under = its over- and under-confident parts (15 equal-width bins); KS, Kuiper: "
                  "top-label, binning-free; AURC/AUGRC ranked by the maximum probability; Brier/log "
                  "reliability and resolution grouped by those bins; conformal coverage and mean set size: "
                  "the first `evaluate --conformal` spec, calibrated on a seeded half of the test set and "
                  "scored on the other half (docs/conventions.md).\n\n")  # fmt: skip
    sources = ["", "Runs of each row:", ""] + [f"- {g.label}: {', '.join(map(str, g.runs))}" for g in groups]
    sources += fit_warning_lines(groups, calibrator)
    markdown = title + (f"**{note}**\n\n" if note else "") + "\n".join(md + sources) + "\n"
    if metrics and len(groups) > 1:
        ranking = paired_ranking(groups, calibrator, lambda run: post_calibration_probs(run, calibrator))
    else:
        ranking = ""
    markdown += f"\n{ranking}" if ranking else ""
    make_dir(out_dir)
    atomic_write_bytes(out_dir / "report.md", lambda fh: fh.write(markdown.encode()))
    csv_text = buf.getvalue()
    atomic_write_bytes(out_dir / "report.csv", lambda fh: fh.write(csv_text.encode()))
    return markdown, csv_text
