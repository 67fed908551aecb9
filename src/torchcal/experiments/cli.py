"""The ``torchcal`` command line (typer): demo, train, evaluate, calibrate, arena, report, config, list,
build-extension."""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

import typer
from rich.console import Console
from rich.markdown import Markdown
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .config import apply_overrides, load_config
from .errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Calibration experiments with torchcal. A user error (bad config, missing file or folder) prints one "
    "line and exits with status 2; --debug (or TORCHCAL_DEBUG=1) shows its traceback.",
)
console = Console(width=max(Console().width, 180))
_DEBUG = {"on": False}


def _debug() -> bool:
    return _DEBUG["on"] or os.environ.get("TORCHCAL_DEBUG", "") not in ("", "0")


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="show the traceback of user errors")):
    _DEBUG["on"] = debug


def _user_errors(command):
    """A command's :class:`UserError` becomes one line on stderr and exit status 2; warnings are printed as
    one line each (no source line)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            previous = warnings.showwarning
            warnings.showwarning = lambda message, *a, **k: typer.echo(
                f"torchcal: warning: {message}", err=True
            )
            try:
                return command(*args, **kwargs)
            except UserError as err:
                if _debug():
                    raise
                typer.echo(f"torchcal: error: {err}", err=True)
                raise typer.Exit(code=2) from None
            finally:
                warnings.showwarning = previous

    return wrapper


def _progress():
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False)  # fmt: skip


def _epoch_text(row: dict, total: int) -> str:
    """``epoch 3/10  loss 0.4123  val ECE 2.31  val error 12.40`` (ECE and error ×100, as the papers)."""
    parts = [f"epoch {row['epoch'] + 1}/{total}", f"loss {row['train_loss']:.4f}"]
    for key, label in (("val_ece", "val ECE"), ("val_error", "val error")):
        if key in row:
            parts.append(f"{label} {100 * row[key]:.2f}")
    return "  ".join(parts)


def _train_with_bar(cfg, run_dir, resume=False, label=None, total=None):
    from .training.loop import train

    total = total if total is not None else cfg.train.epochs
    bar = _progress()
    task = None

    def step(epoch, batch, n_batches):  # the bar appears with the first batch, after every check passed
        nonlocal task
        if task is None:
            bar.start()
            task = bar.add_task(label or f"train {run_dir}", total=total)
        bar.update(task, completed=epoch + batch / n_batches)

    def epoch_line(row):  # one line per epoch, printed above the live bar
        bar.console.print(_epoch_text(row, total))

    try:
        rows = train(cfg, run_dir, resume=resume, progress=step, on_epoch=epoch_line)
        if task is not None:
            bar.update(task, completed=total)
    finally:
        bar.stop()
    return rows


@app.command()
@_user_errors
def train(
    config: Path | None = typer.Argument(None, help="YAML config file (optional: defaults otherwise)"),
    overrides: list[str] | None = typer.Argument(None, help="section.key=value overrides, e.g. optim.lr=0.1"),
    run_dir: Path = typer.Option(Path("runs/run"), "--run-dir", "-o", help="folder of the run"),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="continue the run in --run-dir from its checkpoint, with its saved config; overrides may only "
        "ask for more train.epochs or change the execution settings train.device, train.num_threads, "
        "data.loader.num_workers, data.loader.eval_batch_size, train.test_every, train.calibrators (a finished "
        "run fits the calibrators added)",
    ),
):
    """Train a model with a calibration loss; the run folder holds config, metrics log, checkpoint, logits."""
    from .run_files import check_writable
    from .training.checkpoints import saved_run as _saved_run

    overrides = list(overrides or [])
    if config is not None and "=" in str(config) and not config.exists():  # only overrides were given
        overrides, config = [str(config), *overrides], None
    if resume:
        cfg = None
        if config is not None:  # the file must describe this run, up to the changes resuming allows
            cfg = load_config(config, overrides)
        elif overrides:
            cfg = apply_overrides(copy.deepcopy(_saved_run(run_dir)[0]), overrides)
        # the bar needs the epoch count: the saved one unless changed
        bar_cfg = cfg if cfg is not None else _saved_run(run_dir)[0]
        check_writable(run_dir)
        rows = _train_with_bar(cfg, run_dir, resume=True, total=bar_cfg.train.epochs)
    else:
        cfg = load_config(config, overrides)
        check_writable(run_dir)  # before the data are loaded
        rows = _train_with_bar(cfg, run_dir)
    last = {k: v for k, v in rows[-1].items() if k != "dynamics"} if rows else None
    console.print(f"trained {len(rows)} epochs; last: {json.dumps(last) if last else '-'}")


@app.command(name="build-extension")
def build_extension(verbose: bool = typer.Option(False, help="show the compiler's output")):
    """Compile (once, ~20-30 s) the C++ operator of the fused CPU losses; later processes load it."""
    from torchcal.functional import build_cpu_extension

    t0 = time.perf_counter()
    try:
        path = build_cpu_extension(verbose=verbose)
    except (RuntimeError, OSError) as err:
        console.print(f"[red]could not build the C++ operators[/red] (the torch path still works): {err}")
        raise typer.Exit(1) from None
    console.print(f"C++ operators (losses, metrics scan) ready in {time.perf_counter() - t0:.1f} s: {path}")


@app.command()
@_user_errors
def evaluate(
    run_dirs: list[Path] = typer.Argument(..., help="run folders (e.g. a sweep's runs/*)"),
    calibrators: str = typer.Option("ts,fts", help="comma-separated calibrators"),
    conformal: list[str] = typer.Option(
        [],
        "--conformal",
        help="conformal sets after each calibrator, e.g. aps:alpha=0.1 or raps:alpha=0.05,lambda=0.1,k_reg=1 "
        "(lac|aps|raps; keys alpha, randomized, mondrian, lambda, k_reg); repeatable",
    ),
    arena: bool = typer.Option(False, "--arena", help="then run the calibrator arena over the runs"),
    arena_calibrators: str = typer.Option("all", help="the arena's calibrators ('all' or specs)"),
    arena_out: Path = typer.Option(Path("arena"), "--arena-out", help="the arena's output folder"),
    resamples: int = typer.Option(1000, help="the arena's bootstrap resamples"),
):
    """Every metric before and after each calibrator (fitted on validation), added to results.json (other
    calibrators' results are kept); the fitted calibrators are saved in <run>/calibrators/. With
    --conformal, the coverage and set sizes of conformal sets on the test split after each calibrator; with
    --arena, the runs then go through the calibrator arena (torchcal arena)."""
    from .evaluation.evaluate import RESULTS, check_calibrators, check_run, evaluate_run
    from .evaluation.field_metrics import parse_conformal
    from .run_files import check_writable

    for spec in conformal:
        parse_conformal(spec)  # refused before anything is computed or written
    names = check_calibrators((c.strip() for c in calibrators.split(",") if c.strip()), None)
    tasks, arena_names = [], ()
    if arena:
        from .evaluation.arena import resolve_calibrators, tasks_from_runs

        arena_names = resolve_calibrators(arena_calibrators)
        _check_arena_options(resamples, 0, "cpu")
        check_writable(arena_out)
        tasks = tasks_from_runs(run_dirs)  # a missing folder or a multi-label run: refused before any write
    for run_dir in run_dirs:  # every run checked before the first is evaluated (and written to)
        check_run(run_dir, names, conformal)
    for run_dir in run_dirs:
        result = evaluate_run(run_dir, names, conformal)
        if len(run_dirs) > 1:
            console.print(f"[bold]{run_dir}[/bold]")
        console.print(_before_after_table(result, names))
        console.print(f"every metric (test, shift, OOD) in {Path(run_dir) / RESULTS}")
    if arena:
        _arena(tasks, arena_names, arena_out, resamples, 0, "cpu", save_runs=True)


def _arena(tasks, calibrators, out, resamples, seed, device, save_runs=False):
    """Runs the arena over ``tasks`` with a progress bar, writes its files and prints the leaderboard."""
    from .evaluation.arena import run_arena, save_to_runs
    from .reports.arena import recommendation, write_arena

    names = calibrators
    bar = _progress()
    with bar:
        job = bar.add_task(
            f"arena: {len(names)} calibrators × {len(tasks)} task(s)", total=len(names) * len(tasks)
        )
        result = run_arena(tasks, names, n_resamples=resamples, seed=seed, device=device,
                           progress=lambda task, spec: bar.advance(job))  # fmt: skip
    paths = write_arena(result, out, tasks, device)
    if save_runs:
        save_to_runs(result, tasks)
    summary = result["summary"]
    for name in summary["order"]:
        failed = f", failed on {summary['failures'][name]}" if summary["failures"][name] else ""
        console.print(f"{name:>14}: mean NLL rank {summary['mean_rank']['nll'][name]:.2f}, "
                      f"NLL win rate {100 * summary['win_rate']['nll'][name]:.0f}%{failed}")  # fmt: skip
    console.print(recommendation(result).replace("**", ""))
    console.print(f"{', '.join(paths)} in {out}/")
    return result


def _check_arena_options(resamples: int, seed: int, device: str) -> None:
    import torch

    if resamples < 1:
        raise UserError(f"--resamples must be >= 1, got {resamples}")
    if seed < 0:
        raise UserError(f"--seed must be >= 0, got {seed}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UserError(f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, mps)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available here")


@app.command()
@_user_errors
def arena(
    run_dirs: list[Path] | None = typer.Argument(None, help="finished run folders (each one task)"),
    val: Path | None = typer.Option(
        None, "--val", help="your validation logits+labels (.pt, .npz, or .npy logits)"
    ),
    test: Path | None = typer.Option(None, "--test", help="your test logits+labels, same layout as --val"),
    val_targets: Path | None = typer.Option(
        None, "--val-targets", help="labels .npy when --val is an .npy of logits"
    ),
    test_targets: Path | None = typer.Option(
        None, "--test-targets", help="labels .npy when --test is an .npy of logits"
    ),
    calibrators: str = typer.Option(
        "all", help="'all' (every registered calibrator) or comma-separated specs"
    ),
    out: Path = typer.Option(Path("arena"), "--out", help="output folder (arena.md, .csv, .html, .json)"),
    resamples: int = typer.Option(1000, help="bootstrap resamples of the test set for the 95% intervals"),
    seed: int = typer.Option(0, help="bootstrap seed"),
    device: str = typer.Option("cpu", help="device the calibrators are fitted on (cpu, cuda, ...)"),
):
    """Which calibrator should I use? Fits every calibrator on validation, scores it on test (NLL, Brier, ECE,
    classwise ECE, accuracy; improvement over uncalibrated with a bootstrap 95% interval; fit and predict
    time) and ranks them across tasks (mean rank, pairwise win rate). Tasks: finished runs, or your own
    saved logits with --val and --test. A calibrator that fails on a task is reported in its row."""
    from .evaluation.arena import resolve_calibrators, tasks_from_runs, user_task
    from .run_files import check_writable

    names = resolve_calibrators(calibrators)
    _check_arena_options(resamples, seed, device)
    check_writable(out)
    if run_dirs and (val or test):
        raise UserError("give run folders or --val/--test, not both")
    if run_dirs:
        if val_targets or test_targets:
            raise UserError("--val-targets and --test-targets go with --val and --test")
        tasks = tasks_from_runs(run_dirs)
    elif val is None or test is None:
        raise UserError("give run folders, or both --val VAL and --test TEST (torchcal arena --help)")
    else:
        tasks = [user_task(val, test, val_targets, test_targets)]
    _arena(tasks, names, out, resamples, seed, device, save_runs=bool(run_dirs))


def _parameters_text(parameters: dict) -> str:
    names = {"temperature_": "T", "gamma_": "γ"}
    shown = {k: v for k, v in parameters.items() if k != "num_classes_"}
    return (
        ", ".join(f"{names.get(k, k)} = {v:.4g}" for k, v in shown.items()) or "fitted (no scalar parameters)"
    )


@app.command()
@_user_errors
def calibrate(run_dir: Path, method: str = typer.Option("ts", "--method", "-m", help="ts, fts, ets, ...")):
    """Fit one post-hoc calibrator on the run's validation logits, evaluate it on test, save it in
    <run>/calibrators/<method>.pt and .json and add its results to results.json."""
    from .evaluation.evaluate import calibrate_run, read_results

    out = calibrate_run(run_dir, method)
    out.pop("calibrator")
    result = read_results(run_dir)
    console.print(
        _before_after_table({"uncalibrated": result.get("uncalibrated", {}), method: out}, [method])
    )
    from .evaluation.evaluate import calibrator_file_stem

    saved = Path(run_dir) / "calibrators" / calibrator_file_stem(method)
    typer.echo(f"{method}: {_parameters_text(out['parameters'])}; saved to {saved}.pt and .json")


@app.command()
@_user_errors
def gradcam(
    run_dirs: list[Path],
    out: Path = typer.Option(Path("gradcam.png"), "--out", help="figure file"),
    target: str = typer.Option(..., help="class index, or label name of a multi-label run"),
    images: str = typer.Option("0,1,2", help="comma-separated test-set indices"),
    layer: str = typer.Option("", help="module name (default: the last layer with a feature map)"),
    split: str = typer.Option("test", help="split the images come from"),
):
    """Grad-CAM heatmaps of the same images under each run's model, side by side (the FCL paper's Fig. 1)."""
    import torch

    from ..plotting import save_figure
    from .errors import UserError
    from .reports.gradcam import gradcam_figure, load_run_model
    from .run_files import check_writable

    if out.is_dir():
        raise UserError(f"cannot write {out}: it is a folder, not a file")
    check_writable(out.parent)
    for run in run_dirs:  # (every folder checked before any model is loaded)
        if not run.is_dir():
            raise UserError(f"run folder {run} does not exist" if not run.exists() else f"{run} is not a folder")
    models, data = {}, None
    for run in run_dirs:
        model, splits = load_run_model(run)
        models[run.name] = model
        data = data or splits
    if data is None:
        raise UserError("gradcam needs at least one run folder")
    if split not in data:
        raise UserError(
            f"--split {split!r}: the runs have {sorted(k for k in data if not k.startswith('ood'))}"
        )
    chosen = data[split]
    try:
        indices = [int(i) for i in images.split(",") if i.strip()]
    except ValueError:
        raise UserError(f"--images must be comma-separated integers, got {images!r}") from None
    if not indices or min(indices) < 0 or max(indices) >= len(chosen):
        raise UserError(f"--images must lie in [0, {len(chosen)}), got {images!r}")
    names = chosen.label_names or []
    if target in names:
        index = names.index(target)
    elif target.isdigit():
        index = int(target)
    else:
        raise UserError(f"--target must be a class index or one of the labels {names}, got {target!r}")
    batch = chosen.inputs[torch.tensor(indices)]
    if batch.ndim != 4:
        raise UserError("Grad-CAM needs image inputs (B, C, H, W); these runs' data are not images")
    fig = gradcam_figure(models, batch, index, layer=layer or None, titles=[f"{split}[{i}]" for i in indices])
    save_figure(fig, out, dpi=110)
    typer.echo(
        f"Grad-CAM of {len(indices)} {split} images for target {target} under {len(models)} models: {out}"
    )


@app.command()
@_user_errors
def figures(
    paths: list[Path] = typer.Argument(None, help="run folders, or folders of runs (a sweep's out)"),
    out: Path = typer.Option(Path("figures"), "--out", help="output folder (PNG, SVG, figures.json)"),
    only: str = typer.Option("", "--only", help="comma-separated figure names (default: all); see --list"),
    epochs: str = typer.Option("", "--epochs", help="epochs of the per-epoch histograms, e.g. 10,100,200"),
    band: str = typer.Option("std", "--band", help="band over seeds: std or sem (standard error)"),
    gammas: str = typer.Option("1,2,3,5,7", "--gammas", help="γ values of focal-fig4a's g(p, γ) curves"),
    sweep_key: str = typer.Option(
        "",
        "--sweep-key",
        help="fcl-fig6's x axis, a loss argument (e.g. lambda_); default: the one the runs vary",
    ),
    calibrator: str = typer.Option("ts", "--calibrator", help="fcl-fig6's post-calibration columns"),
    gamma_ev: str = typer.Option(
        "-0.5,-0.25,0.05,0.25,0.37,0.5,0.75,1,5",
        "--gamma-ev",
        help="fts-fig8's γ_ev grid (default: the paper's)",
    ),
    list_figures: bool = typer.Option(False, "--list", help="list the figures and what each needs, and exit"),
):
    """The papers' analysis figures from what the runs logged (no training): curves over epochs with bands
    over seeds, histograms, box plots, ROC curves. Turn on train.dynamics when training for the ones that
    need it."""
    from .reports.figures import FIGURES, draw_figures, find_runs, run_groups, sweep_lines

    if list_figures:
        for name, (caption, needs) in FIGURES.items():
            typer.echo(f"{name}: {caption} [needs {needs or 'any finished run'}]")
        return
    if not paths:
        raise UserError("figures needs run folders or folders of runs (a sweep's out); --list lists the figures")
    names = [n.strip() for n in only.split(",") if n.strip()] or list(FIGURES)
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        raise UserError(f"--only: unknown figure {unknown[0]!r}; choose from {', '.join(FIGURES)}")
    if band not in ("std", "sem"):
        raise UserError(f"--band must be std or sem, got {band!r}")
    try:
        chosen = tuple(int(e) for e in epochs.split(",") if e.strip())
        gamma_values = tuple(float(g) for g in gammas.split(",") if g.strip())
    except ValueError:
        raise UserError(f"--epochs must be integers and --gammas numbers, got {epochs!r} and {gammas!r}") from None
    if not all(math.isfinite(g) for g in gamma_values):
        raise UserError(f"--gammas must be finite numbers, got {gammas!r}")
    try:
        gammas_ev = tuple(float(g) for g in gamma_ev.split(",") if g.strip())
    except ValueError:
        gammas_ev = ()
    if not gammas_ev or not all(math.isfinite(g) and g > -1 for g in gammas_ev):
        raise UserError(
            f"--gamma-ev must be comma-separated numbers > -1 (the focal map's range), got {gamma_ev!r}"
        )
    if "fcl-fig6" in names:
        from .evaluation.evaluate import check_calibrators

        check_calibrators([calibrator], None)
    from .run_files import check_writable

    check_writable(out)
    groups = run_groups(find_runs(paths))
    if "fcl-fig6" in names and not only.strip() and not sweep_key.strip():
        try:  # drawing every figure: runs that vary several loss arguments skip fcl-fig6 only
            sweep_lines(groups)
        except UserError as err:
            names.remove("fcl-fig6")
            typer.echo(f"skipped {err}")
    written, skipped = draw_figures(groups, names, out, band=band, epochs=chosen, gammas=gamma_values,
                                    sweep_key=sweep_key.strip() or None, calibrator=calibrator,
                                    gammas_ev=gammas_ev)  # fmt: skip
    for name, needs in skipped.items():
        typer.echo(f"skipped {name}: no run logged its data (train with {needs})")
    if not written:
        raise UserError(f"no figure could be drawn from {len(groups)} run group(s); see the lines above")
    typer.echo(f"{len(written)} figures (PNG and SVG) and figures.json in {out}/: {', '.join(written)}")


@app.command()
@_user_errors
def report(
    run_dirs: list[Path],
    out: Path = typer.Option(Path("report"), "--out", help="output folder"),
    calibrator: str = typer.Option("ts", help="calibrator of the post columns"),
    metrics: str = typer.Option(
        "",
        "--metrics",
        "--columns",
        help="extra columns, comma-separated: signed_ece, ece_over, ece_under, ks, kuiper, classwise_ks, aurc, "
        "augrc, brier_reliability, brier_resolution, brier_uncertainty, log_reliability, log_resolution, "
        "coverage, set_size (the last two from `evaluate --conformal`), rbs, debiased_ece, ece_sweep, "
        "ece_sweep_ew",
    ),
):
    """The papers' table over runs (Markdown, CSV and HTML): runs whose configs differ only in the seed are
    averaged in one row; unfinished run folders are skipped with a warning. With cross-entropy runs among
    them, the report names the regime their fitted temperature shows."""
    from .demo import regime_note
    from .evaluation.evaluate import (
        OPTIONAL_COLUMNS,
        check_calibrators,
        check_columns,
        check_optional_columns,
        collect_groups,
    )
    from .evaluation.evaluate import report as make_report
    from .evaluation.field_metrics import REPORT_METRICS, check_report_metrics
    from .reports.html import html_report
    from .run_files import check_writable

    check_calibrators([calibrator], None)
    check_writable(out)
    names = [n.strip() for n in metrics.split(",") if n.strip()]
    unknown = [n for n in names if n not in OPTIONAL_COLUMNS and n not in REPORT_METRICS]
    if unknown:
        raise UserError(
            f"--metrics: unknown column {unknown[0]!r}; choose from {', '.join([*REPORT_METRICS, *OPTIONAL_COLUMNS])}"
        )
    columns = check_columns([n for n in names if n in OPTIONAL_COLUMNS])
    extra = check_report_metrics([n for n in names if n not in OPTIONAL_COLUMNS])
    groups = collect_groups(run_dirs, calibrator)  # warns once per skipped folder
    check_optional_columns(groups, columns)
    note = regime_note(groups)
    markdown, _ = make_report(
        run_dirs, out, calibrator, note=note, groups=groups, metrics=extra, columns=columns
    )
    page = html_report(
        run_dirs, out, calibrator, note=note, groups=groups, extra_metrics=extra, columns=columns
    )
    console.print(Markdown(markdown))
    console.print(f"report.md, report.csv and {page.name} (with figures) in {out}/")


@app.command()
@_user_errors
def sweep(
    sweep_file: Path = typer.Argument(..., help="sweep YAML (grid of runs)"),
    backend: str = typer.Option("local", help="local or ray"),
    workers: int = typer.Option(1, help="local: runs in parallel (each a process)"),
    address: str | None = typer.Option(
        None, help="ray: cluster address (e.g. auto); default starts a local Ray"
    ),
    retry_failed: bool = typer.Option(False, "--retry-failed", help="run failed runs again"),
    calibrator: str | None = typer.Option(
        None,
        help="calibrator spec of the report's post columns (default: the sweep's first `evaluate` entry)",
    ),
):
    """Run a grid of trainings (resumable: finished runs are kept) and aggregate them into one report."""
    from .evaluation.evaluate import check_calibrators
    from .sweep import load_sweep, run_sweep

    if backend not in ("local", "ray"):
        raise UserError(f"--backend must be local or ray, got {backend!r}")
    if workers < 1:
        raise UserError(f"--workers must be >= 1, got {workers}")
    from .run_files import check_writable

    spec = load_sweep(sweep_file)
    calibrator = calibrator or spec.evaluate[0]
    check_calibrators([calibrator])
    check_writable(spec.out)
    state = run_sweep(spec, backend=backend, workers=workers, address=address, retry_failed=retry_failed,
                      report_calibrator=calibrator, log=console.print)  # fmt: skip
    failed = [k for k, v in state.items() if v.get("status") == "failed"]
    console.print(f"report in {spec.out / 'report'}/" if len(failed) < len(state) else "no finished run")
    if failed:
        raise typer.Exit(code=1)


config_app = typer.Typer(
    no_args_is_help=True,
    help="The run configuration: its JSON Schema (for an editor's completion and checking) and the resolved "
    "config of a preset or file, with every default.",
)
app.add_typer(config_app, name="config")


@config_app.command("schema")
@_user_errors
def config_schema_command(
    out: Path | None = typer.Option(
        None, "--out", "-o", help="write the schema to this file (default: print it)"
    ),
):
    """Print (or write) the JSON Schema of a run's YAML file. Point an editor at it with a first line
    `# yaml-language-server: $schema=<path or URL of the schema>`."""
    from .config import config_schema
    from .run_files import atomic_write_bytes

    text = json.dumps(config_schema(), indent=2) + "\n"
    if out is None:
        typer.echo(text, nl=False)
        return
    if out.parent and not out.parent.is_dir():
        raise UserError(f"--out {str(out)!r}: the folder {str(out.parent)!r} does not exist")
    if out.is_dir():
        raise UserError(f"cannot write {out}: it is a folder, not a file")
    atomic_write_bytes(out, lambda fh: fh.write(text.encode()))
    console.print(f"schema written to {out}")


@config_app.command("show")
@_user_errors
def config_show(
    config: str | None = typer.Argument(
        None, help="a preset name (torchcal list presets) or a YAML file; none: defaults"
    ),
    overrides: list[str] | None = typer.Argument(None, help="section.key=value overrides, e.g. optim.lr=0.1"),
):
    """Print the resolved config (YAML, every default included) of a preset or file and overrides: what
    `torchcal train` would run."""
    import yaml

    from .config import config_to_dict

    overrides = list(overrides or [])
    if config is not None and "=" in config and not Path(config).exists():  # only overrides were given
        overrides, config = [config, *overrides], None
    path = None
    if config is not None:
        presets = list_presets()
        if config in presets:
            path = presets[config]
        elif Path(config).is_file():
            path = config
        else:
            raise UserError(
                f"{config!r} is neither a preset nor a file: torchcal list presets names the presets"
            )
    cfg = load_config(path, overrides)
    typer.echo(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), nl=False)


@app.command(name="list")
@_user_errors
def list_things(what: str = typer.Argument(..., help="models | datasets | losses | calibrators | presets")):
    """List the registered models, datasets, losses, calibrators or the paper presets (configs/*.yaml)."""
    from ..calibrators import list_calibrators
    from ..losses import list_losses
    from .data import list_datasets
    from .models import list_models

    def both(listing):  # softmax and sigmoid (multi-label) entries: the tasks each name serves
        def tasks():
            out = {}
            for task, kind in (("multiclass", "softmax"), ("multilabel", "sigmoid")):
                for name in listing(task):
                    out.setdefault(name, []).append(f"{task} ({kind})")
            return {name: ", ".join(out[name]) for name in sorted(out)}

        return tasks

    table = {
        "models": list_models,
        "datasets": list_datasets,
        "losses": both(list_losses),
        "calibrators": both(list_calibrators),
        "presets": list_presets,
    }
    if what not in table:
        raise UserError(f"cannot list {what!r}: choose one of {sorted(table)}")
    items = table[what]()
    for item in items:
        console.print(f"{item}: {items[item]}" if isinstance(items, dict) else item)


@app.command()
@_user_errors
def demo(
    out: Path = typer.Option(Path("torchcal-demo"), "--out", help="output folder"),
    protocol: str = typer.Option(
        "overfit", help="overfit (3,000 images, 40 epochs: the papers' regime) or short"
    ),
    seeds: int = typer.Option(3, min=1, help="seeds per loss (mean ± std over them)"),
    workers: int = typer.Option(0, min=0, help="runs in parallel, each a process (0: min(2, CPU cores))"),
    epochs: int = typer.Option(0, min=0, help="override the protocol's epochs (0: keep)"),
    limit_train: int = typer.Option(
        -1, min=-1, help="override the protocol's training images (0: all; -1: keep)"
    ),
):
    """Fashion-MNIST (or digits when it is missing): train with 9 losses × seeds, calibrate with TS and FTS,
    evaluate on test, a Gaussian-noise shifted test set and an OOD set, and write the reports."""
    from rich.progress import Progress

    from .data import FASHION_MNIST_DIR, load_fashion_mnist
    from .demo import DEMO_LOSSES, PROTOCOLS, demo_jobs, regime_note, run_jobs
    from .errors import DatasetError
    from .evaluation.evaluate import collect_groups
    from .evaluation.evaluate import report as make_report
    from .reports.html import html_report
    from .run_files import check_writable

    check_writable(out)
    start = time.time()
    calibrators = ("ts", "fts")
    extra = [f"train.epochs={epochs}"] if epochs else []
    extra += [f"data.limit_train={limit_train}"] if limit_train >= 0 else []
    jobs = demo_jobs(out, protocol, DEMO_LOSSES, range(seeds), extra)  # refuses an unknown protocol
    try:
        load_fashion_mnist(os.environ.get("TORCHCAL_FASHION_MNIST") or FASHION_MNIST_DIR)
        console.print(f"protocol {protocol}: {PROTOCOLS[protocol]['text']}; validation 5,000, test 10,000; shift: "
                      "Gaussian noise σ = 0.5; OOD: scikit-learn digits rescaled to 28 × 28")  # fmt: skip
    except DatasetError as err:
        console.print(f"[yellow]Fashion-MNIST not found ({err}); falling back to scikit-learn digits[/]")
        extra += ["data.name=digits", "data.ood.sets=[]", "data.val_size=260", "data.limit_train=0"]
        jobs = demo_jobs(out, protocol, DEMO_LOSSES, range(seeds), extra)
    load_config(None, list(jobs[0].overrides))  # a bad --epochs or --limit-train is refused before any run
    with Progress(*_progress().columns, console=console) as bar:
        task = bar.add_task(f"{len(DEMO_LOSSES)} losses × {seeds} seeds", total=len(jobs))
        run_jobs(jobs, calibrators, workers or None, on_done=lambda job: bar.advance(task))
    runs = [job.run_dir for job in jobs]
    groups = {c: collect_groups(runs, c) for c in calibrators}
    note = regime_note(groups["ts"])
    for calibrator in calibrators:
        make_report(runs, out / f"report-{calibrator}", calibrator, note=note, groups=groups[calibrator])
        html_report(runs, out / f"report-{calibrator}", calibrator, note=note, groups=groups[calibrator])
    console.print(_summary_table(groups, calibrators))
    if note:
        console.print(f"[bold]{note}[/bold]")
    console.print("MMCE uses the released code's normalisation, as the papers' numbers do; where losses depart from "
                  "the papers (AdaFocal's adaptation in a short run, FCL's Brier term) and why: docs/fidelity.md")  # fmt: skip
    console.print(
        f"reports (report-*/report.md, .csv, .html with the figures) in {out}/ ({time.time() - start:.0f} s)"
    )


# the rows of the before/after table: (results key, label, scale); fractions ×100 as the papers print them
_TABLE_ROWS = (
    ("error", "error", 100),
    ("ece", "ECE", 100),
    ("adaece", "AdaECE", 100),
    ("classwise_ece", "classwise ECE", 100),
    ("mce", "MCE", 100),
    ("smece", "smECE", 100),
    ("ece_micro", "ECE (micro)", 100),
    ("auroc", "AUROC", 100),
    ("nll", "NLL", 1),
    ("brier", "Brier", 1),
)


def _before_after_table(result: dict, calibrators) -> Table:
    """The test metrics before and after each calibrator (the columns), compact; results.json keeps all."""
    columns = [("uncalibrated", "uncal.")] + [(c, c.upper()) for c in calibrators]
    tests = {key: (result.get(key) or {}).get("test", {}) for key, _ in columns}
    table = Table(title="test set (error and ECEs ×100), calibrators fitted on validation")
    table.add_column("metric")
    for _, label in columns:
        table.add_column(label, justify="right")
    for key, label, scale in _TABLE_ROWS:
        if any(key in t for t in tests.values()):
            digits = 2 if scale == 100 else 4
            cells = [f"{scale * t[key]:.{digits}f}" if key in t else "-" for t in tests.values()]
            table.add_row(label, *cells)
    if any("ood_auroc" in (result.get(k) or {}) for k, _ in columns):
        table.add_row("OOD AUROC", *(_ood_cell(result.get(k) or {}) for k, _ in columns))
    params = [_parameters_text((result.get(c) or {}).get("parameters", {})) for c in calibrators]
    if any(params):
        table.caption = "; ".join(f"{c}: {p}" for c, p in zip(calibrators, params))
    return table


def _ood_cell(entry: dict) -> str:
    return f"{100 * entry['ood_auroc']:.1f}" if "ood_auroc" in entry else "-"


def _summary_table(groups, calibrators):
    from .demo import summary_rows

    def fmt(stat, scale=1.0, digits=2):
        mean, std, n = stat
        return f"{scale * mean:.{digits}f}" + (f" ± {scale * std:.{digits}f}" if n > 1 else "")

    arrows = " → ".join(["uncal.", *(c.upper() for c in calibrators)])
    table = Table(title=f"test set ×100, mean ± std over seeds ({arrows}, fitted on validation); full tables in "
                  "report-*/report.md")  # fmt: skip
    for col in ("loss", "seeds", "error", "ECE", f"ECE {arrows.split(' → ', 1)[1]}", "AdaECE", "NLL", "T (TS)",
                "shift ECE", "OOD AUROC"):  # fmt: skip
        table.add_column(col, justify="left" if col == "loss" else "right")
    for row in summary_rows(groups):
        post = " → ".join(fmt(row[f"ece post {c}"]) for c in calibrators)
        table.add_row(row["loss"], row["seeds"], fmt(row["error pre"]), fmt(row["ece pre"]), post,
                      fmt(row["adaece pre"]), fmt(row["nll pre"]), fmt(row["T ts"]),
                      fmt(row["shift ece pre"]) if "shift ece pre" in row else "-",
                      fmt(row["ood auroc pre"], digits=1) if "ood auroc pre" in row else "-")  # fmt: skip
    return table


def list_presets() -> dict[str, str]:
    """The paper presets: configs/*.yaml of the source checkout (or of the current folder)."""
    for folder in (Path(__file__).resolve().parents[3] / "configs", Path.cwd() / "configs"):
        if folder.is_dir():
            return {p.stem: str(p) for p in sorted(folder.glob("*.yaml"))}
    return {}


def main() -> None:  # console script entry point
    """Run the CLI. User errors exit with status 2 inside each command; the argument parser's usage errors (a
    missing argument, an unknown option or command) become the same one line, naming the help to read."""
    try:
        status = app(standalone_mode=False)
    except typer.Abort:
        sys.stderr.write("torchcal: aborted\n")
        sys.exit(1)
    except Exception as err:  # click's UsageError family (typer vendors click: matched by what it has)
        ctx = getattr(err, "ctx", None)
        if type(err).__name__ == "NoArgsIsHelpError" and ctx is not None:  # `torchcal` or a group alone
            sys.stderr.write(ctx.get_help() + "\n")
            sys.exit(2)
        if not (hasattr(err, "format_message") and isinstance(getattr(err, "exit_code", None), int)):
            raise
        where = ctx.command_path if ctx is not None else "torchcal"
        sys.stderr.write(f"torchcal: error: {err.format_message()} (see `{where} --help`)\n")  # type: ignore[attr-defined]
        sys.exit(err.exit_code)  # type: ignore[attr-defined]
    sys.exit(status if isinstance(status, int) else 0)


if __name__ == "__main__":
    main()
