"""End-to-end demo on real data (scikit-learn's bundled digits): train, measure, calibrate, plot.

Trains a small MLP with cross-entropy long enough to become over-confident, then prints every calibration
metric of torchcal on the test split before and after temperature scaling (TS, fitted on validation NLL and on
validation ECE like the papers) and focal temperature scaling (FTS), with bootstrap intervals for ECE, and
writes reliability diagrams to the output folder.

    python examples/demo_digits.py --out torchcal-demo
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from rich.console import Console
from rich.table import Table

import torchcal
import torchcal.functional as F
from torchcal.calibrators import FocalTemperatureScaling, TemperatureScaling
from torchcal.plotting import plot_reliability_diagram, save_figure


def load_digits_splits(seed: int = 1):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    # 1000 train / 300 validation / 497 test
    return (x[:1000], y[:1000]), (x[1000:1300], y[1000:1300]), (x[1300:], y[1300:])


def train(x, y, epochs: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(epochs):
        for idx in torch.randperm(len(y)).split(64):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.eval()


def metrics_row(probs, targets):
    return {
        "error": F.error_rate(probs, targets).item(),
        "NLL": F.nll(probs, targets).item(),
        "Brier": F.brier(probs, targets).item(),
        "ECE": F.ece(probs, targets).item(),
        "AdaECE": F.adaece(probs, targets).item(),
        "classwise": F.classwise_ece(probs, targets).item(),
        "MCE": F.mce(probs, targets).item(),
        "smECE": F.smece(probs, targets).item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="torchcal-demo", help="folder for the figures and results.json")
    parser.add_argument("--epochs", type=int, default=300)
    args = parser.parse_args()
    console = Console(width=max(Console().width, 132))
    start = time.time()

    (x_tr, y_tr), (x_val, y_val), (x_te, y_te) = load_digits_splits()
    console.print(f"digits: {len(y_tr)} train / {len(y_val)} validation / {len(y_te)} test, 10 classes")
    with console.status(f"training an MLP with cross-entropy for {args.epochs} epochs"):
        model = train(x_tr, y_tr, args.epochs)
    with torch.no_grad():
        val_logits, test_logits = model(x_val), model(x_te)

    ts_nll = TemperatureScaling().fit(val_logits, y_val)
    ts_ece = TemperatureScaling(objective="ece").fit(val_logits, y_val)
    with console.status("focal temperature scaling: full grid of 9 gammas x 500 temperatures"):
        fts = FocalTemperatureScaling().fit(val_logits, y_val)
    results = {
        "uncalibrated": (torch.softmax(test_logits, 1), ""),
        "TS (NLL)": (ts_nll.transform(test_logits), f"T={ts_nll.temperature_:.3f}"),
        "TS (ECE grid)": (ts_ece.transform(test_logits), f"T={ts_ece.temperature_:.1f}"),
        "FTS": (fts.transform(test_logits), f"γ={fts.gamma_:g}, T={fts.temperature_:.2f}"),
    }

    table = Table(title="digits test set (metrics ×100; ECE with 95% bootstrap interval)")
    table.add_column("method")
    table.add_column("parameters")
    names = list(metrics_row(*next(iter(results.values()))[:1], y_te))
    for name in names:
        table.add_column(name, justify="right")
    summary = {}
    for method, (probs, params) in results.items():
        row = metrics_row(probs, y_te)
        ci = F.bootstrap_ci(F.ece, probs, y_te, n_resamples=1000, seed=0)
        summary[method] = {"parameters": params, **row, "ECE_low": ci.low.item(), "ECE_high": ci.high.item()}
        cells = [f"{100 * v:.2f}" for v in row.values()]
        cells[names.index("ECE")] = f"{100 * row['ECE']:.2f} [{100 * ci.low:.1f}, {100 * ci.high:.1f}]"
        table.add_row(method, params, *cells)
    console.print(table)

    os.makedirs(args.out, exist_ok=True)
    for method, (probs, _) in results.items():
        slug = method.lower().replace(" ", "_").replace("(", "").replace(")", "")
        fig = plot_reliability_diagram(probs=probs, targets=y_te, title=f"digits, {method}")
        save_figure(fig, os.path.join(args.out, f"reliability_{slug}.png"), dpi=120)
    fd, tmp = tempfile.mkstemp(dir=args.out, suffix=".json")
    with os.fdopen(fd, "w") as fh:
        json.dump({"torchcal": torchcal.__version__, "results": summary}, fh, indent=2)
    os.replace(tmp, os.path.join(args.out, "results.json"))
    console.print(
        f"reliability diagrams and results.json written to {args.out}/ in {time.time() - start:.1f} s"
    )


if __name__ == "__main__":
    main()
