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


def _fmt_params(params: dict) -> str:
    return ", ".join(
        f"{k.rstrip('_').replace('temperature', 'T').replace('gamma', 'γ')}={v:.3g}"
        for k, v in params.items()
        if k != "num_classes_" and k != "objective_value_"
    )


def report(run_dirs, out_dir, calibrator: str = "ts") -> tuple[str, str]:
    """The papers' table, one row per run: each metric "pre / post (parameters)", shift ECE and OOD AUROC,
    values ×100. Writes ``report.md`` and ``report.csv`` to ``out_dir``; returns (markdown, csv)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    header = ["run", "loss", *METRIC_COLUMNS, "shift ece", "ood auroc"]
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["run", "loss", "calibrator", "parameters", *[f"{m}_pre" for m in METRIC_COLUMNS],
                     *[f"{m}_post" for m in METRIC_COLUMNS], "shift_ece_pre", "shift_ece_post", "ood_auroc_pre",
                     "ood_auroc_post"])  # fmt: skip
    for run_dir in run_dirs:
        run_dir = Path(run_dir)
        path = run_dir / RESULTS
        result = json.loads(path.read_text()) if path.exists() else evaluate_run(run_dir, (calibrator,))
        if calibrator not in result:
            result = evaluate_run(run_dir, (calibrator,))
        import yaml

        loss = yaml.safe_load((run_dir / "config.yaml").read_text())["loss"]["name"]
        pre, post = result["uncalibrated"], result[calibrator]
        params = _fmt_params(post["parameters"])
        cells = [run_dir.name, loss]
        for m in METRIC_COLUMNS:
            if m == "error":
                cells.append(f"{100 * pre['test'][m]:.2f}")
            else:
                cells.append(f"{100 * pre['test'][m]:.2f} / {100 * post['test'][m]:.2f}")
        shift_pre = pre.get("shift", {}).get("ece")
        shift_post = post.get("shift", {}).get("ece")
        cells.append(f"{100 * shift_pre:.2f} / {100 * shift_post:.2f}" if shift_pre is not None else "")
        ood_pre, ood_post = pre.get("ood_auroc"), post.get("ood_auroc")
        cells.append(f"{100 * ood_pre:.2f} / {100 * ood_post:.2f}" if ood_pre is not None else "")
        cells[2 + METRIC_COLUMNS.index("ece")] += f" ({params})"
        md.append("| " + " | ".join(cells) + " |")
        writer.writerow([run_dir.name, loss, calibrator, params, *[pre["test"][m] for m in METRIC_COLUMNS],
                         *[post["test"][m] for m in METRIC_COLUMNS], shift_pre, shift_post, ood_pre, ood_post])  # fmt: skip
    title = (f"Test metrics ×100, uncalibrated / after {calibrator} fitted on validation (its parameters in "
             "brackets); shift = Gaussian-noise test set; OOD AUROC by predictive entropy.\n\n")  # fmt: skip
    markdown = title + "\n".join(md) + "\n"
    atomic_write_bytes(out_dir / "report.md", lambda fh: fh.write(markdown.encode()))
    csv_text = buf.getvalue()
    atomic_write_bytes(out_dir / "report.csv", lambda fh: fh.write(csv_text.encode()))
    return markdown, csv_text
