"""Evaluation of a finished run: every metric before and after each post-hoc calibrator, and the papers'
table (Markdown and CSV)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import torch

from .. import functional as F
from ..calibrators import create as create_calibrator
from .train import LOGITS, atomic_write_bytes

__all__ = ["evaluate_run", "calibrate_run", "report", "METRIC_COLUMNS"]

RESULTS = "results.json"
METRIC_COLUMNS = ("error", "nll", "brier", "ece", "adaece", "classwise_ece", "mce", "smece")


def _metrics(probs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    return {
        "error": F.error_rate(probs, targets).item(),
        "nll": F.nll(probs, targets).item(),
        "brier": F.brier(probs, targets).item(),
        "ece": F.ece(probs, targets).item(),
        "adaece": F.adaece(probs, targets).item(),
        "classwise_ece": F.classwise_ece(probs, targets).item(),
        "mce": F.mce(probs, targets).item(),
        "smece": F.smece(probs, targets).item(),
        "debiased_ece": F.debiased_ece(probs, targets).item(),
        "ece_sweep": F.ece_sweep(probs, targets).item(),
        "s99_fraction": F.confidence_at_least(probs, targets).fraction.item(),
    }


def _load_logits(run_dir: Path) -> dict:
    path = Path(run_dir) / LOGITS
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: train the run to the end first (torchcal train ...)")
    return torch.load(path, map_location="cpu", weights_only=True)


def calibrate_run(run_dir, method: str, **kwargs) -> dict:
    """Fits calibrator ``method`` on the run's validation logits and evaluates test (and shift / OOD)."""
    logits = _load_logits(Path(run_dir))
    cal = create_calibrator(method, **kwargs).fit(logits["val"]["logits"], logits["val"]["targets"])
    out = {"calibrator": cal.state_dict()}
    params = {k: v for k, v in out["calibrator"]["fitted"].items() if isinstance(v, float | int)}
    out["parameters"] = params
    for split in ("test", "shift"):
        if split in logits:
            out[split] = _metrics(cal.transform(logits[split]["logits"]), logits[split]["targets"])
    if "ood" in logits:
        out["ood_auroc"] = F.ood_auroc(
            cal.transform(logits["test"]["logits"]), cal.transform(logits["ood"]["logits"])
        ).item()
    return out


def evaluate_run(run_dir, calibrators=("ts", "fts")) -> dict:
    """Metrics of the uncalibrated model and after each calibrator; written to ``results.json``."""
    run_dir = Path(run_dir)
    logits = _load_logits(run_dir)
    result = {"uncalibrated": {}}
    for split in ("val", "test", "shift"):
        if split in logits:
            result["uncalibrated"][split] = _metrics(
                torch.softmax(logits[split]["logits"], 1), logits[split]["targets"]
            )
    if "ood" in logits:
        result["uncalibrated"]["ood_auroc"] = F.ood_auroc(
            logits["test"]["logits"], logits["ood"]["logits"], from_logits=True
        ).item()
    for method in calibrators:
        out = calibrate_run(run_dir, method)
        out.pop("calibrator")
        result[method] = out
    text = json.dumps(result, indent=2, sort_keys=True)
    atomic_write_bytes(run_dir / RESULTS, lambda fh: fh.write(text.encode()))
    return result


def report(run_dirs, out_dir, calibrator: str = "ts") -> tuple[str, str]:
    """The papers' table: one row per method (dataset · model · loss; runs that differ only in the seed are
    averaged, mean ± std), each metric "pre / post" the calibrator with its temperature in brackets, plus the
    shifted-set ECE and the OOD AUROC; values ×100. Writes ``report.md`` and ``report.csv`` to ``out_dir``
    and returns (markdown, csv)."""
    from .html_report import summarise

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarise(run_dirs, calibrator)
    columns = [
        "error",
        "nll",
        "brier",
        "ece",
        "adaece",
        "classwise_ece",
        "mce",
        "smece",
        "shift ece",
        "ood auroc",
    ]

    def fmt(stat):
        mean, std, n = stat
        return f"{mean:.2f} ± {std:.2f}" if n > 1 else f"{mean:.2f}"

    md = ["| method | seeds | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 2)]
    buf = io.StringIO()
    writer = csv.writer(buf)
    stat_cols = [f"{c} {w}" for c in columns for w in ("pre", "post") if not (c == "error" and w == "post")]
    writer.writerow(["method", "calibrator", "seeds", "temperature_mean",
                     *[f"{c.replace(' ', '_')}_{k}" for c in stat_cols for k in ("mean", "std")]])  # fmt: skip
    for method, stats in summary.items():
        cells = [method, str(stats["ece pre"][2])]
        for col in columns:
            if col == "error":
                cells.append(fmt(stats["error pre"]))
            elif f"{col} pre" in stats:
                cell = f"{fmt(stats[f'{col} pre'])} / {fmt(stats[f'{col} post'])}"
                if col == "ece":
                    cell += f" ({stats['T'][0]:.2f})"
                cells.append(cell)
            else:
                cells.append("")
        md.append("| " + " | ".join(cells) + " |")
        row = [method, calibrator, stats["ece pre"][2], stats["T"][0]]
        for c in stat_cols:
            mean, std, _ = stats.get(c, (float("nan"), float("nan"), 0))
            row += [mean, std]
        writer.writerow(row)
    title = (f"Test metrics ×100: uncalibrated / after {calibrator} fitted on the validation split (its mean "
             "temperature in brackets after ECE); mean ± std over seeds; shift = the shifted test set; OOD "
             "AUROC by predictive entropy.\n\n")  # fmt: skip
    markdown = title + "\n".join(md) + "\n"
    atomic_write_bytes(out_dir / "report.md", lambda fh: fh.write(markdown.encode()))
    csv_text = buf.getvalue()
    atomic_write_bytes(out_dir / "report.csv", lambda fh: fh.write(csv_text.encode()))
    return markdown, csv_text
