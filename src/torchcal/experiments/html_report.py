"""A self-contained HTML report: the papers' table (mean ± std over seeds) and the figures — reliability
diagrams before and after calibration, confidence histograms, test ECE over epochs, AdaFocal's γ and
validation gap per bin over epochs. Figures are embedded as base64 PNG, so the page is one file."""

from __future__ import annotations

import base64
import html
import io
import json
from collections import defaultdict
from pathlib import Path

import torch
import yaml

from .evaluate import METRIC_COLUMNS, RESULTS, evaluate_run
from .train import atomic_write_bytes, read_metrics

__all__ = ["group_runs", "html_report", "summarise"]


def _run_key(run_dir: Path) -> str:
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    return f"{cfg['data']['name']} · {cfg['model']['name']} · {cfg['loss']['name']}"


def group_runs(run_dirs) -> dict[str, list[Path]]:
    """Runs that differ only in their seed share a group (dataset · model · loss)."""
    groups = defaultdict(list)
    for run_dir in map(Path, run_dirs):
        groups[_run_key(run_dir)].append(run_dir)
    return dict(groups)


def summarise(run_dirs, calibrator: str = "ts") -> dict[str, dict[str, tuple[float, float, int]]]:
    """Per group and column: (mean, std, number of seeds) of the test metrics ×100, pre and post."""
    out = {}
    for key, runs in group_runs(run_dirs).items():
        values = defaultdict(list)
        for run in runs:
            path = run / RESULTS
            res = json.loads(path.read_text()) if path.exists() else evaluate_run(run, (calibrator,))
            if calibrator not in res:
                res = evaluate_run(run, (calibrator,))
            for m in METRIC_COLUMNS:
                values[f"{m} pre"].append(100 * res["uncalibrated"]["test"][m])
                values[f"{m} post"].append(100 * res[calibrator]["test"][m])
            values["T"].append(res[calibrator]["parameters"].get("temperature_", float("nan")))
            if "shift" in res["uncalibrated"]:
                values["shift ece pre"].append(100 * res["uncalibrated"]["shift"]["ece"])
                values["shift ece post"].append(100 * res[calibrator]["shift"]["ece"])
            if "ood_auroc" in res["uncalibrated"]:
                values["ood auroc pre"].append(100 * res["uncalibrated"]["ood_auroc"])
                values["ood auroc post"].append(100 * res[calibrator]["ood_auroc"])
        out[key] = {}
        for col, vals in values.items():
            t = torch.tensor(vals, dtype=torch.float64)
            std = float(t.std()) if len(vals) > 1 else 0.0
            out[key][col] = (float(t.mean()), std, len(vals))
    return out


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
    rows = read_metrics(run_dir)
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


def html_report(run_dirs, out_dir, calibrator: str = "ts") -> Path:
    """Writes ``report.html`` (one file) to ``out_dir``; returns its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarise(run_dirs, calibrator)
    cols = [c for c in next(iter(summary.values())) if c != "T"]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in ["run group", "seeds", *cols, f"T ({calibrator})"])
    body = []
    for key, stats in summary.items():
        cells = [html.escape(key), str(stats[cols[0]][2])]
        cells += [f"{m:.2f} ± {s:.2f}" if n > 1 else f"{m:.2f}" for m, s, n in (stats[c] for c in cols)]
        cells.append(f"{stats['T'][0]:.2f}")
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    sections = []
    for key, runs in group_runs(run_dirs).items():
        figs = "".join(f'<figure><img src="{src}"><figcaption>{html.escape(t)}</figcaption></figure>'
                       for t, src in _figures(runs[0], calibrator))  # fmt: skip
        sections.append(f"<h2>{html.escape(key)} <small>({html.escape(runs[0].name)})</small></h2>{figs}")
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>torchcal report</title><style>
body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}} td:first-child{{text-align:left}}
figure{{display:inline-block;margin:6px}} figcaption{{text-align:center;font-size:12px}}</style></head><body>
<h1>torchcal report</h1><p>Test metrics ×100, mean ± std over seeds; "pre" uncalibrated, "post" after
{html.escape(calibrator)} fitted on the validation split.</p>
<table><tr>{head}</tr>{"".join(body)}</table>{"".join(sections)}</body></html>"""
    path = out_dir / "report.html"
    atomic_write_bytes(path, lambda fh: fh.write(page.encode()))
    return path
