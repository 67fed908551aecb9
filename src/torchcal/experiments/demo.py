"""The demo and the fidelity benchmark's engine: a grid of runs (losses × seeds) trained and evaluated in
worker processes, resumable, then summarised per loss (mean ± std over seeds) with the regime it shows.

Protocols (``PROTOCOLS``; decision 63 says why):

* ``overfit`` (default): Fashion-MNIST, the first 3,000 images of the 55,000-image training split, 40 epochs
  of Adam 1e-3 at batch 128 on the MLP 784-256-256-10. Cross entropy fits the training set and keeps
  sharpening, so it ends over-confident on test (fitted T ≈ 2): the regime the papers study.
* ``short``: all 55,000 training images for 3 epochs (the demo of earlier versions). Cross entropy is then
  already calibrated (T ≈ 1) and the focal losses are under-confident: the opposite regime, kept to show it.
"""

from __future__ import annotations

import math
import os
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEMO_LOSSES",
    "PROTOCOLS",
    "DemoJob",
    "demo_jobs",
    "run_jobs",
    "regime",
    "regime_note",
    "summary_rows",
]

DEMO_LOSSES = ("ce", "ls-0.05", "brier", "mmce", "fl-3", "flsd-53", "dfl", "adafocal", "fcl")

PROTOCOLS: dict[str, dict] = {
    "overfit": {
        "overrides": ["data.limit_train=3000", "train.epochs=40", "model.width=256", "train.test_every=10"],
        "text": "Fashion-MNIST, 3,000 training images, 40 epochs (Adam 1e-3, MLP 784-256-256-10): cross "
        "entropy over-fits the small training set and becomes over-confident, the regime of the papers",
    },
    "short": {
        "overrides": ["train.epochs=3"],
        "text": "Fashion-MNIST, all 55,000 training images, 3 epochs (Adam 1e-3, MLP 784-256-256-10): "
        "too short to over-fit; cross entropy is already calibrated and focal losses turn under-confident",
    },
}


@dataclass(frozen=True)
class DemoJob:
    """One run of the grid: its folder, label (the loss), seed and config overrides."""

    run_dir: Path
    loss: str
    seed: int
    overrides: tuple[str, ...]


def demo_jobs(out: Path, protocol: str, losses=DEMO_LOSSES, seeds=(0, 1, 2), extra=()) -> list[DemoJob]:
    """The runs of a demo: every loss × seed under ``out/runs/<loss>-s<seed>``."""
    if protocol not in PROTOCOLS:
        from .errors import UserError

        raise UserError(f"unknown protocol {protocol!r}; choose one of {sorted(PROTOCOLS)}")
    base = [*PROTOCOLS[protocol]["overrides"], *extra]
    return [
        DemoJob(
            Path(out) / "runs" / f"{loss}-s{seed}",
            loss,
            seed,
            (*base, f"loss.name={loss}", f"train.seed={seed}"),
        )
        for loss in losses
        for seed in seeds
    ]


def _run_job(job: DemoJob, calibrators: tuple[str, ...], threads: int) -> DemoJob:
    """Trains (or resumes, or keeps) one run and evaluates it; runs in a worker process."""
    import torch

    from .config import load_config
    from .evaluation.evaluate import evaluate_run, read_results
    from .training.loop import LOGITS, train

    torch.set_num_threads(threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # adjusted values are recorded in the run's config.yaml
        if not (job.run_dir / LOGITS).exists():
            cfg = load_config(None, list(job.overrides))
            started = (job.run_dir / "config.yaml").exists()
            train(cfg, job.run_dir, resume=started)
        if not set(calibrators) <= set(read_results(job.run_dir)):
            evaluate_run(job.run_dir, calibrators)
    return job


def run_jobs(
    jobs: list[DemoJob], calibrators=("ts", "fts"), workers: int | None = None, on_done=None
) -> None:
    """Runs every job (``workers`` processes, each with ``cpu_count // workers`` torch threads; 1: in this
    process); finished runs are kept, interrupted ones resume. ``on_done(job)`` is called as each ends."""
    import multiprocessing

    cpus = os.cpu_count() or 1
    workers = max(1, min(workers or min(2, cpus), len(jobs)))
    threads = max(1, cpus // workers)
    if workers == 1:
        for job in jobs:
            _run_job(job, tuple(calibrators), threads)
            if on_done:
                on_done(job)
        return
    # spawn: the parent may already run torch's thread pools, which a fork would copy in a broken state
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_run_job, job, tuple(calibrators), threads) for job in jobs]
        for future in futures:
            job = future.result()
            if on_done:
                on_done(job)


def regime(ce_temperature: float) -> str:
    """What cross entropy's fitted temperature says about the regime of a run."""
    if ce_temperature > 1.1:
        return (f"over-confident regime: cross entropy's fitted temperature is {ce_temperature:.2f} > 1, so the "
                "papers' setting holds and the calibration losses are expected to help")  # fmt: skip
    if ce_temperature < 0.9:
        return (f"under-confident regime: cross entropy's fitted temperature is {ce_temperature:.2f} < 1; "
                "losses that lower confidence make it worse here")  # fmt: skip
    return (f"calibrated regime: cross entropy's fitted temperature is {ce_temperature:.2f} ≈ 1; there is "
            "little over-confidence for the calibration losses to remove")  # fmt: skip


def regime_note(groups) -> str:
    """The regime of each cross-entropy row among ``groups`` (from
    :func:`torchcal.experiments.evaluation.evaluate.collect_groups` with temperature scaling: its mean fitted T), or ""
    when there is none. One row: its :func:`regime`; several: each prefixed with its label."""
    ce = [g for g in groups if g.config.get("loss.name") == "ce" and math.isfinite(g.stats["T"][0])]
    if len(ce) == 1:
        return regime(ce[0].stats["T"][0])
    return "; ".join(f"{g.label}: {regime(g.stats['T'][0])}" for g in ce)


def summary_rows(groups_by_calibrator: dict[str, list]) -> list[dict]:
    """One row per loss from :func:`torchcal.experiments.evaluation.evaluate.collect_groups` of each calibrator:
    (mean, std, n) of error, ECE pre and post each calibrator, AdaECE, NLL, the temperature, shift ECE and
    OOD AUROC (×100 but T)."""
    rows = {}
    for calibrator, groups in groups_by_calibrator.items():
        for g in groups:
            row = rows.setdefault(g.label, {"label": g.label, "loss": g.config.get("loss.name"),
                                            "seeds": g.seeds_text, "runs": g.runs})  # fmt: skip
            s = g.stats
            for key in ("error pre", "ece pre", "adaece pre", "classwise_ece pre", "nll pre", "shift ece pre",
                        "ood auroc pre"):  # fmt: skip
                if key in s:
                    row[key] = s[key]
            for key in ("ece post", "adaece post", "classwise_ece post", "nll post"):
                row[f"{key} {calibrator}"] = s[key]
            row[f"T {calibrator}"] = s["T"]
    return list(rows.values())
