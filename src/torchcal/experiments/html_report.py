"""A self-contained HTML report: the papers' table (mean ± std over seeds) and the figures — reliability
diagrams before and after calibration, confidence histograms, test ECE over epochs, AdaFocal's γ and
validation gap per bin over epochs. Figures are embedded as base64 PNG, so the page is one file."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import torch

from .errors import RunError
from .evaluate import collect_groups
from .train import atomic_write_bytes, read_metrics

__all__ = ["group_runs", "html_report", "summarise"]


def group_runs(run_dirs, calibrator: str = "ts") -> dict[str, list[Path]]:
    """Row label -> run folders of the report's rows (:func:`torchcal.experiments.evaluate.collect_groups`:
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


def _figures(run_dir: Path, calibrator: str) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from ..calibrators import create
    from ..plotting import plot_reliability_diagram

    figs = []
    logits = torch.load(run_dir / "logits.pt", weights_only=True)
    test, val = logits["test"], logits["val"]
    cal = create(calibrator).fit(val["logits"], val["targets"])
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
    try:
        rows = read_metrics(run_dir)
    except RunError:  # a damaged log costs the training curves, not the report
        rows = []
    if rows:
        fig, ax = plt.subplots(figsize=(4.2, 3))
        for split in ("val", "test"):
            ax.plot([r["epoch"] for r in rows], [100 * r[f"{split}_ece"] for r in rows], label=f"{split} ECE")
        ax.set_xlabel("epoch")
        ax.set_ylabel("ECE ×100")
        ax.legend()
        figs.append(("ECE over epochs", _png(fig)))
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


def html_report(run_dirs, out_dir, calibrator: str = "ts", warn=None) -> Path:
    """Writes ``report.html`` (one file) to ``out_dir``; returns its path. Rows as in
    :func:`torchcal.experiments.evaluate.collect_groups`, each naming its seeds and run folders."""
    groups = collect_groups(run_dirs, calibrator, warn)
    cols = list(dict.fromkeys(c for g in groups for c in g.stats if c != "T"))
    names = ["run group", "seeds", *cols, f"T ({calibrator})", "runs"]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in names)
    body = []
    for group in groups:
        stats = group.stats
        cells = [html.escape(group.label), html.escape(group.seeds_text)]
        for c in cols:
            m, s, n = stats.get(c, (float("nan"), 0.0, 0))
            cells.append("-" if n == 0 else f"{m:.2f} ± {s:.2f}" if n > 1 else f"{m:.2f}")
        cells.append(f"{stats['T'][0]:.2f}")
        cells.append(f'<span class="runs">{html.escape(", ".join(str(r) for r in group.runs))}</span>')
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    sections = []
    for group in groups:
        run = group.runs[0]
        figs = "".join(f'<figure><img src="{src}"><figcaption>{html.escape(t)}</figcaption></figure>'
                       for t, src in _figures(run, calibrator))  # fmt: skip
        shown = f"figures of {run.name}, seed {group.seeds[0]}"
        sections.append(f"<h2>{html.escape(group.label)} <small>({html.escape(shown)})</small></h2>{figs}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>torchcal report</title><style>
body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}} td:first-child{{text-align:left}}
.runs{{font-size:11px;color:#555}}
figure{{display:inline-block;margin:6px}} figcaption{{text-align:center;font-size:12px}}</style></head><body>
<h1>torchcal report</h1><p>Test metrics ×100, mean ± std over the runs of a row (their configs differ only
in the seed); "pre" uncalibrated, "post" after {html.escape(calibrator)} fitted on the validation split.</p>
<table><tr>{head}</tr>{"".join(body)}</table>{"".join(sections)}</body></html>"""
    path = out_dir / "report.html"
    atomic_write_bytes(path, lambda fh: fh.write(page.encode()))
    return path
