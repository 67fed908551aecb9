"""A self-contained HTML report (rendered from templates/report.html.j2): the papers' table (mean ± std over seeds) and the figures — reliability
diagrams before and after calibration, confidence histograms, test ECE over epochs, AdaFocal's γ and
validation gap per bin over epochs. Figures are embedded as base64 PNG, so the page is one file."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import torch

from ..errors import RunError
from ..evaluation.evaluate import (
    COLUMN_HEADERS,
    calibrator_file_stem,
    check_columns,
    check_optional_columns,
    collect_groups,
    describe_calibrator,
)
from ..evaluation.field_metrics import COLUMN_HEADERS as FIELD_HEADERS
from ..evaluation.field_metrics import REPORT_METRICS, field_figures
from ..run_files import CALIBRATORS, atomic_write_bytes, make_dir, read_metrics
from .templates import render

__all__ = ["group_runs", "html_report", "summarise"]


def group_runs(run_dirs, calibrator: str = "ts") -> dict[str, list[Path]]:
    """Row label -> run folders of the report's rows (:func:`torchcal.experiments.evaluation.evaluate.collect_groups`:
    runs whose configs differ only in the seed share a row)."""
    return {g.label: g.runs for g in collect_groups(run_dirs, calibrator)}


def summarise(run_dirs, calibrator: str = "ts") -> dict[str, dict[str, tuple[float, float, int]]]:
    """Per row and column: (mean, std, number of runs) of the test metrics ×100, pre and post."""
    return {g.label: g.stats for g in collect_groups(run_dirs, calibrator)}


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _figures(run_dir: Path, calibrator: str, extra_metrics=()) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from ...calibrators import from_json, from_spec
    from ...plotting import plot_reliability_diagram

    figs = []
    logits = torch.load(run_dir / "logits.pt", weights_only=True)
    test, val = logits["test"], logits["val"]
    multilabel = test["targets"].ndim == 2
    saved = run_dir / CALIBRATORS / f"{calibrator_file_stem(calibrator)}.json"
    try:  # the calibrator evaluate_run fitted and saved (the one whose numbers the table shows)
        cal = from_json(saved.read_text())
    except (OSError, ValueError, KeyError):
        task = "multilabel" if multilabel else "multiclass"
        cal = from_spec(calibrator, task).fit(val["logits"], val["targets"])
    if multilabel:
        return _multilabel_figures(run_dir, calibrator, test, cal)
    pre, post = torch.softmax(test["logits"], 1), cal.transform(test["logits"])
    figs.append(
        ("reliability, uncalibrated", _png(plot_reliability_diagram(probs=pre, targets=test["targets"])))
    )
    figs.append(
        (f"reliability, {calibrator}", _png(plot_reliability_diagram(probs=post, targets=test["targets"])))
    )
    fig, ax = plt.subplots(figsize=(4.2, 3))
    ax.hist([pre.max(1).values.numpy(), post.max(1).values.numpy()], bins=30, range=(0, 1),
            label=["uncalibrated", calibrator], histtype="step")  # fmt: skip
    ax.set_xlabel("confidence")
    ax.set_ylabel("test samples")
    ax.legend()
    figs.append(("confidence histogram", _png(fig)))
    if extra_metrics:  # report --metrics: the risk-coverage curves and the conformal set sizes
        figs += [(title, _png(f)) for title, f in field_figures(run_dir, test, pre, post, calibrator)]
    rows = _logged_rows(run_dir)
    if rows:
        figs.append(("ECE over epochs", _png(_ece_over_epochs(rows, "ECE"))))
    if rows and "gammas" in rows[0]:
        gammas = torch.tensor([r["gammas"] for r in rows])
        fig, ax = plt.subplots(figsize=(4.2, 3))
        for b in range(gammas.shape[1]):
            ax.plot(gammas[:, b].numpy(), linewidth=1)
        ax.set_xlabel("epoch")
        ax.set_ylabel("γ per bin (negative: inverse focal)")
        figs.append(("AdaFocal γ per bin", _png(fig)))
    if rows and "gaps" in rows[0]:
        gaps = torch.tensor([r["gaps"] for r in rows])
        fig, ax = plt.subplots(figsize=(4.2, 3))
        for b in range(gaps.shape[1]):
            ax.plot(100 * gaps[:, b].numpy(), linewidth=1)
        ax.axhline(0, color="black", linestyle="--", linewidth=0.8)
        ax.set_xlabel("epoch")
        ax.set_ylabel("validation gap per bin ×100 (conf − acc)")
        figs.append(("AdaFocal validation gap per bin", _png(fig)))
    return figs


def _multilabel_figures(run_dir: Path, calibrator: str, test: dict, cal) -> list[tuple[str, str]]:
    """A reliability diagram per label and pooled, before and after the calibrator, and ECE over epochs."""
    from ...plotting import plot_multilabel_reliability
    from ..evaluation.evaluate import _label_names

    names = _label_names(run_dir, test["targets"].shape[1])
    pre, post = torch.sigmoid(test["logits"]), cal.transform(test["logits"])
    figs = [
        ("reliability per label, uncalibrated",
         _png(plot_multilabel_reliability(pre, test["targets"], label_names=names, ncols=3))),
        (f"reliability per label, {calibrator}",
         _png(plot_multilabel_reliability(post, test["targets"], label_names=names, ncols=3))),
    ]  # fmt: skip
    rows = _logged_rows(run_dir)
    if rows:
        figs.append(("ECE over epochs", _png(_ece_over_epochs(rows, "ECE (macro)"))))
    return figs


def _logged_rows(run_dir: Path) -> list[dict]:
    try:
        return read_metrics(run_dir)
    except RunError:  # a damaged log costs the training curves, not the report
        return []


def _ece_over_epochs(rows: list[dict], name: str):
    """Validation and test ECE per logged epoch (test metrics may be logged every n epochs)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.2, 3))
    for split in ("val", "test"):
        logged = [r for r in rows if f"{split}_ece" in r]
        ax.plot([r["epoch"] for r in logged], [100 * r[f"{split}_ece"] for r in logged], marker=".",
                label=f"{split} {name}")  # fmt: skip
    ax.set_xlabel("epoch")
    ax.set_ylabel("ECE ×100")
    ax.legend()
    return fig


def _comparison_figures(groups, calibrator: str) -> list[tuple[str, str]]:
    """Across the report's rows: ECE before and after the calibrator (mean ± std over each row's runs), and
    the uncalibrated reliability curves of every row on one axis (test predictions of a row's runs pooled,
    15 equal-mass bins)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import numpy as np

    from ...plotting import multilabel_reliability_data, reliability_diagram_data

    short = [g.label.split(" · ")[-1] for g in groups]
    labels = short if len(set(short)) == len(short) else [g.label for g in groups]
    # a row of one run has no std (nan): no error bar
    pre = np.nan_to_num(np.array([g.stats["ece pre"][:2] for g in groups]))
    post = np.nan_to_num(np.array([g.stats["ece post"][:2] for g in groups]))
    x = np.arange(len(groups))
    fig, ax = plt.subplots(figsize=(max(5.0, 0.75 * len(groups) + 2), 3.4), constrained_layout=True)
    ax.bar(x - 0.2, pre[:, 0], 0.4, yerr=pre[:, 1], capsize=3, color="#C44E52", label="uncalibrated")
    ax.bar(x + 0.2, post[:, 0], 0.4, yerr=post[:, 1], capsize=3, color="#4C72B0", label=f"after {calibrator}")
    ax.set_xticks(x, labels, rotation=30 if max(map(len, labels)) > 8 else 0, ha="right")
    ax.set_ylabel("test ECE ×100 (mean ± std)")
    ax.legend(fontsize=8)
    figs = [(f"test ECE per method, before and after {calibrator} (error bars: std over the runs of a row)",
             _png(fig))]  # fmt: skip
    fig, ax = plt.subplots(figsize=(4.6, 4.2), constrained_layout=True)
    ax.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
    for label, group in zip(labels, groups, strict=True):
        pooled = [
            torch.load(r / "logits.pt", map_location="cpu", weights_only=True)["test"] for r in group.runs
        ]
        logits = torch.cat([p["logits"] for p in pooled])
        targets = torch.cat([p["targets"] for p in pooled])
        if targets.ndim == 2:  # multi-label: all labels' p pooled
            _, data = multilabel_reliability_data(logits, targets, binning="equal_mass", from_logits=True)
        else:
            data = reliability_diagram_data(
                logits, targets, n_bins=15, binning="equal_mass", from_logits=True
            )
        ax.plot(data.confidence.numpy(), data.accuracy.numpy(), marker=".", linewidth=1.2, label=label)
    multilabel = any(g.results[0].get("task") == "multilabel" for g in groups)
    ax.set_xlabel(f"mean {'p, all labels pooled' if multilabel else 'confidence'} (15 equal-mass bins)")
    ax.set_ylabel("fraction positive" if multilabel else "accuracy")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, loc="upper left")
    figs.append(("reliability curves, uncalibrated (below the diagonal: over-confident)", _png(fig)))
    return figs


def _paper_figures(out_dir: Path) -> list[dict]:
    """The figures ``torchcal figures --out OUT/figures`` listed in ``figures.json`` (files that exist)."""
    import json

    try:
        index = json.loads((out_dir / "figures" / "figures.json").read_text())["figures"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [f for f in index if isinstance(f, dict) and (out_dir / "figures" / str(f.get("png"))).exists()]


def html_report(
    run_dirs,
    out_dir,
    calibrator: str = "ts",
    warn=None,
    note: str = "",
    groups=None,
    extra_metrics=(),
    columns=(),
) -> Path:
    """Writes ``report.html`` (one file) to ``out_dir``; returns its path. It opens with the table (rows as in
    :func:`torchcal.experiments.evaluation.evaluate.collect_groups`, each naming its seeds and run folders) and the
    comparison across rows (ECE before/after the calibrator with error bars; every row's reliability curve
    on one axis), then one section of figures per row. ``note`` (e.g. the regime) is shown under the title;
    ``groups`` (from ``collect_groups`` with this calibrator) saves collecting them again. ``extra_metrics``
    (``report --metrics``) adds those columns and each row's risk-coverage and set-size figures; ``columns``
    adds the report's columns on request (:data:`~torchcal.experiments.evaluation.evaluate.OPTIONAL_COLUMNS`).
    The papers' figures that ``torchcal figures --out OUT/figures`` drew are linked in a section of their own."""
    columns = check_columns(columns)
    groups = collect_groups(run_dirs, calibrator, warn) if groups is None else groups
    check_optional_columns(groups, columns)
    row_stats = {id(g): {**g.stats, **{k: v for k, v in g.optional_stats.items() if k.rsplit(" ", 1)[0] in columns}}
                 for g in groups}  # fmt: skip
    # one column per metric, "uncalibrated → calibrated" in one cell (the error does not change for the
    # argmax-preserving calibrators, so it is shown once)
    metrics = list(dict.fromkeys(c.rsplit(" ", 1)[0] for g in groups for c in row_stats[id(g)] if c != "T"))
    per_set = [m for m in metrics if m.startswith("ood auroc ")]  # one column per OOD set when several
    metrics = [m for m in metrics if m not in (per_set if len(per_set) < 2 else ["ood auroc"])]
    metrics = [m for m in metrics if m not in REPORT_METRICS or m in extra_metrics]  # asked for only

    headers = {**COLUMN_HEADERS, **FIELD_HEADERS}
    columns_shown = ["run group", "seeds"]
    columns_shown += [f"{headers.get(m, m)} (pre → post)" if m != "error" else "error" for m in metrics]
    columns_shown += [f"T ({calibrator})", "runs"]
    rows = []
    for group in groups:
        stats = row_stats[id(group)]
        cells = []
        for m in metrics:
            pre, post = stats.get(f"{m} pre"), stats.get(f"{m} post")
            cells.append(None if pre is None else {"pre": pre, "post": None if m == "error" else post})
        rows.append({"label": group.label, "seeds": group.seeds_text, "cells": cells, "temperature": stats["T"],
                     "paths": "\n".join(str(r) for r in group.runs),
                     "names": ", ".join(r.name for r in group.runs)})  # fmt: skip
    sections = [{"label": group.label, "shown": f"figures of {group.runs[0].name}, seed {group.seeds[0]}",
                 "figures": _figures(group.runs[0], calibrator, extra_metrics)} for group in groups]  # fmt: skip
    from ..evaluation.evaluate import fit_warnings

    page = render(
        "report.html.j2",
        calibrator=describe_calibrator(calibrator),
        calibrator_name=calibrator,
        note=note,
        fit_warnings=[(label, str(run), message) for label, run, message in fit_warnings(groups, calibrator)],
        columns=columns_shown,
        rows=rows,
        comparison=_comparison_figures(groups, calibrator),
        sections=sections,
        paper_figures=_paper_figures(Path(out_dir)),
    )
    out_dir = Path(out_dir)
    make_dir(out_dir)
    path = out_dir / "report.html"
    atomic_write_bytes(path, lambda fh: fh.write(page.encode()))
    return path
