"""What a user without a C++ compiler gets: ECE, one streaming update and one focal-loss step on the torch path
(the C++ operators switched off), against torchmetrics' ECE and PyTorch's cross entropy measured in the same
run; with ``--cpp`` the same with the operators on.

    python benchmarks/bench_no_compiler.py [--cpp] [--label after]

Decision 65 quotes the before/after numbers of retiring the numba kernels (``--label`` names the row set).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_metrics import hardware, timed, write_results  # noqa: E402

import torchcal  # noqa: E402
import torchcal.functional as F  # noqa: E402
import torchcal.functional.losses as L  # noqa: E402


def median_time(fn, reps):
    return timed(fn, reps)[0]  # bench_metrics' timer: median over repeats after a warm-up call


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpp", action="store_true", help="with the C++ operators on (built first)")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    from torchmetrics.functional.classification import multiclass_calibration_error

    warnings.simplefilter("ignore")
    if args.cpp:
        F.build_cpu_extension()
    switch = contextlib.nullcontext() if args.cpp else F.use_cpu_extension(False)
    path = "cpp" if args.cpp else "torch"
    rows = []
    g = torch.Generator().manual_seed(0)
    with switch:
        for n, k, reps in ((10_000, 10, 30), (50_000, 1000, 5), (1_000_000, 10, 5)):
            logits = 3 * torch.randn(n, k, generator=g)
            probs = torch.softmax(logits, 1)
            y = torch.randint(0, k, (n,), generator=g)
            ours = median_time(lambda: F.ece(probs, y), reps)
            tm = median_time(lambda: multiclass_calibration_error(probs, y, num_classes=k, n_bins=15), reps)
            update = median_time(lambda: torchcal.CalibrationMetrics(k).update(probs, y), max(3, reps // 2))
            rows.append({"label": args.label, "path": path, "case": f"ece {n}x{k}", "torchcal_s": ours,
                         "baseline": "torchmetrics ece", "baseline_s": tm, "speedup": tm / ours,
                         "update_s": update})  # fmt: skip
            print(f"{path} ece {n}x{k}: {1e3 * ours:.2f} ms, torchmetrics {1e3 * tm:.2f} ms ({tm / ours:.2f}x); "
                  f"CalibrationMetrics.update {1e3 * update:.2f} ms", flush=True)  # fmt: skip
        for n, k in ((128, 10), (128, 1000)):
            z = torch.randn(n, k, requires_grad=True)
            t = torch.randint(0, k, (n,))
            focal = median_time(lambda: L.focal_loss(z, t, 3.0).backward(), 200)
            ce = median_time(lambda: torch.nn.functional.cross_entropy(z, t).backward(), 200)
            rows.append({"label": args.label, "path": path, "case": f"focal step {n}x{k}", "torchcal_s": focal,
                         "baseline": "cross entropy step", "baseline_s": ce, "speedup": ce / focal})  # fmt: skip
            print(f"{path} focal step {n}x{k}: {1e6 * focal:.0f} µs, cross entropy {1e6 * ce:.0f} µs "
                  f"({focal / ce:.2f}x its time)", flush=True)  # fmt: skip
    write_results(rows, f"bench_no_compiler-{path}-{hardware()}", first=("label", "path", "case"))


if __name__ == "__main__":
    main()
