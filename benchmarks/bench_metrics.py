"""Metric and calibrator speed, as ratios against baselines measured in the same run.

Side by side on probabilities of shape (10k, 10), (10k, 100), (50k, 1000), (1M, 10): torchcal's ECE,
torchmetrics' ``multiclass_calibration_error`` (default validation on), netcal's ``ECE`` and one full
``CalibrationMetrics`` pass (update on the whole set + compute of every metric), with and without the
equal-mass estimators, and its parts: the update alone, the sort of the equal-mass estimators and smECE. Also the largest single allocation made by torchcal's ECE (to check there is no
(N, K) float64 copy) and the fitting time of TemperatureScaling (NLL, 25k x 1000) and of the full
FocalTemperatureScaling grid (5k x 100). Writes a CSV named by hardware and torch version to
benchmarks/results/ and prints the ratios.

    python benchmarks/bench_metrics.py [--repeats 7] [--quick]

The scan takes the C++ operator when it is built (``make bench`` builds it), else torch; the CSV records
the path, and with the operator also the torch path's ratio to torchmetrics (a user without a compiler).
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import tempfile
import time
import warnings

import torch

import torchcal.functional as F
from torchcal.calibrators import FocalTemperatureScaling, TemperatureScaling
from torchcal.functional.calibration import smooth_ece_from_conf
from torchcal.metrics import CalibrationMetrics

SIZES = [(10_000, 10), (10_000, 100), (50_000, 1000), (1_000_000, 10)]


def timed(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    q1, q3 = times[len(times) // 4], times[(3 * len(times)) // 4]
    return statistics.median(times), q3 - q1


def paired(fn, base_fn, rounds, steps=None, sync=lambda: None, with_best=False):
    """(median time of fn, median time of base_fn, [fn time / base_fn time per round]): rounds alternate the
    two, each timing ``steps`` calls (by default as many as take ~20 ms), so that a ratio is not the VM's
    drift between two blocks. ``sync`` waits for queued device work (CUDA). ``with_best`` adds a fourth
    element, (the fastest round of fn, the fastest round of base_fn)."""
    fn()
    base_fn()
    if steps is None:
        start = time.perf_counter()
        fn()
        steps = max(1, min(500, int(0.02 / max(time.perf_counter() - start, 1e-6))))

    def per_call(f):
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            f()
        sync()
        return (time.perf_counter() - start) / steps

    pairs = [(per_call(base_fn), per_call(fn)) for _ in range(rounds)]
    out = (
        statistics.median(p[1] for p in pairs),
        statistics.median(p[0] for p in pairs),
        [p[1] / p[0] for p in pairs],
    )
    if with_best:
        return (*out, (min(p[1] for p in pairs), min(p[0] for p in pairs)))
    return out


def peak_allocation(fn):
    """Largest single CPU allocation (bytes) made while ``fn`` runs, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((abs(e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage > 0), default=0)


def data(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = 4 * torch.randn(n, k, generator=g)
    probs = torch.softmax(logits, 1)
    targets = torch.multinomial(torch.softmax(logits / 2, 1), 1, generator=g).squeeze(1)
    return logits, probs, targets


def hardware():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    slug = "".join(c if c.isalnum() else "-" for c in cpu).strip("-").lower()
    return f"{slug}-{os.cpu_count()}cpu"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="small sizes only (smoke run)")
    args = parser.parse_args()
    sizes = SIZES[:2] if args.quick else SIZES
    rows = []

    from torchmetrics.functional.classification import multiclass_calibration_error

    try:
        from netcal.metrics import ECE as NetcalECE
    except ImportError:  # optional peer
        NetcalECE = None

    from torchcal.functional import _extension

    for n, k in sizes:
        logits, probs, targets = data(n, k)
        # the scan's path: the C++ operator (`make bench` builds it), else torch
        path = "cpp" if _extension.scan_applies(probs) else "torch"
        reps = max(3, args.repeats if n * k <= 10_000_000 else args.repeats // 2)
        ours, ours_iqr = timed(lambda: F.ece(probs, targets), reps)
        # ECE against torchmetrics in alternating rounds (the ratio the goal is about)
        paired_ours, paired_tm, ratios = paired(
            lambda: F.ece(probs, targets),
            lambda: multiclass_calibration_error(probs, targets, num_classes=k, n_bins=15),
            max(5, reps),
        )
        paired_ratio = statistics.median(1 / r for r in ratios)  # torchmetrics time / ours, per round
        # from logits (issue 14's goal: at least 2x torchmetrics at every size; no softmax matrix on CPU)
        logits_ours, logits_tm, logits_ratios = paired(
            lambda: F.ece(logits, targets, from_logits=True),
            lambda: multiclass_calibration_error(logits, targets, num_classes=k, n_bins=15),
            max(5, reps),
        )
        logits_ratio = statistics.median(1 / r for r in logits_ratios)
        print(f"  from logits {n}x{k}: {1e3 * logits_ours:.2f} ms, torchmetrics {1e3 * logits_tm:.2f} ms "
              f"({logits_ratio:.2f}x)", flush=True)  # fmt: skip
        torch_ratio = float("nan")
        if path == "cpp":  # the torch path against torchmetrics: what a user without a compiler gets
            with F.use_cpu_extension(False):
                torch_ratio = statistics.median(
                    1 / r
                    for r in paired(
                        lambda: F.ece(probs, targets),
                        lambda: multiclass_calibration_error(probs, targets, num_classes=k, n_bins=15),
                        max(5, reps),
                    )[2]
                )
        with F.use_cpu_extension(False):
            torch_path, torch_path_iqr = timed(lambda: F.ece(probs, targets), reps)
        tm, tm_iqr = timed(
            lambda: multiclass_calibration_error(probs, targets, num_classes=k, n_bins=15), reps
        )
        nc = nc_iqr = float("nan")
        if NetcalECE is not None:
            p_np, t_np = probs.numpy(), targets.numpy()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                nc, nc_iqr = timed(lambda: NetcalECE(bins=15).measure(p_np, t_np), max(3, reps // 2))

        def full_pass(equal_mass):
            m = CalibrationMetrics(num_classes=k, equal_mass=equal_mass)
            m.update(probs, targets)
            return m.compute()

        full, full_iqr = timed(lambda: full_pass(True), max(3, reps // 2))
        sums, sums_iqr = timed(lambda: full_pass(False), reps)
        # where the pass spends its time: the update (the one pass over the data), then the parts of compute
        # that one ECE does not do (the sort of the equal-mass estimators, smECE's bandwidth search)
        seen = CalibrationMetrics(num_classes=k)
        seen.update(probs, targets)
        conf_s, corr_s = seen.sorted_confidences()
        update_s, _ = timed(lambda: CalibrationMetrics(num_classes=k).update(probs, targets), reps)
        sort_s, _ = timed(seen.sorted_confidences, reps)
        smece_s, _ = timed(lambda: smooth_ece_from_conf(conf_s, corr_s), max(3, reps // 2))
        with F.use_cpu_extension(False):
            # the C++ scan allocates only (N,) outputs; the profiler sees torch allocations, so measure the
            # torch path, the one with (N, K) temporaries if any
            peak = peak_allocation(lambda: F.ece(probs, targets))
            full_torch, _ = timed(lambda: full_pass(True), max(3, reps // 2))
        rows.append(
            {
                "case": f"metrics {n}x{k}",
                "torchcal_ece_s": ours,
                "torchcal_ece_iqr_s": ours_iqr,
                "cpp_operators": F.cpu_extension_available(),
                "torchcal_ece_torch_path_s": torch_path,
                "torchcal_ece_torch_path_iqr_s": torch_path_iqr,
                "all_metrics_torch_path_s": full_torch,
                "torchmetrics_ece_s": tm,
                "torchmetrics_ece_iqr_s": tm_iqr,
                "netcal_ece_s": nc,
                "netcal_ece_iqr_s": nc_iqr,
                "all_metrics_s": full,
                "all_metrics_iqr_s": full_iqr,
                "all_metrics_no_equal_mass_s": sums,
                "all_metrics_no_equal_mass_iqr_s": sums_iqr,
                "scan_path": path,
                "speedup_vs_torchmetrics": paired_ratio,
                "logits_torchcal_ece_s": logits_ours,
                "logits_torchmetrics_ece_s": logits_tm,
                "logits_speedup_vs_torchmetrics": logits_ratio,
                "paired_torch_path_speedup_vs_torchmetrics": torch_ratio,
                "paired_torchcal_ece_s": paired_ours,
                "paired_torchmetrics_ece_s": paired_tm,
                "unpaired_speedup_vs_torchmetrics": tm / ours,
                "torch_path_speedup_vs_torchmetrics": tm / torch_path,
                "speedup_vs_netcal": nc / ours,
                "all_metrics_over_ece": full / ours,
                "all_metrics_no_equal_mass_over_ece": sums / ours,
                "update_s": update_s,
                "update_over_ece": update_s / ours,
                "sort_over_ece": sort_s / ours,
                "smece_over_ece": smece_s / ours,
                "ece_peak_alloc_over_NK_float64": peak / (n * k * 8),
            }
        )
        r = rows[-1]
        print(
            f"{n:>8} x {k:<5} ECE {1e3 * ours:8.2f} ms ({path}; torch path {1e3 * torch_path:8.2f} ms)"
            f" | torchmetrics {r['speedup_vs_torchmetrics']:5.1f}x slower (alternating rounds;"
            f" {r['unpaired_speedup_vs_torchmetrics']:.1f}x in separate blocks)"
            f" | netcal {r['speedup_vs_netcal']:7.1f}x slower | all metrics {r['all_metrics_over_ece']:5.2f}x ECE"
            f" (without equal-mass {r['all_metrics_no_equal_mass_over_ece']:4.2f}x; update"
            f" {r['update_over_ece']:4.2f}x, sort {r['sort_over_ece']:4.2f}x, smECE {r['smece_over_ece']:4.2f}x)"
            f" | ECE peak alloc {r['ece_peak_alloc_over_NK_float64']:.3f} of an (N,K) float64 copy",
            flush=True,
        )

    fits = [
        ("TemperatureScaling nll 25000x1000", 25_000, 1000, lambda z, y: TemperatureScaling().fit(z, y)),
        (
            "FocalTemperatureScaling full grid 5000x100",
            5_000,
            100,
            lambda z, y: FocalTemperatureScaling().fit(z, y),
        ),
    ]
    if args.quick:
        fits = fits[:1]
    for name, n, k, fit in fits:
        logits, _, targets = data(n, k, seed=1)
        seconds, iqr = timed(lambda: fit(logits, targets), 3)
        rows.append({"case": name, "fit_s": seconds, "fit_iqr_s": iqr})
        print(f"{name}: {seconds:.2f} s (IQR {iqr:.2f} s)", flush=True)

    tag = "quick-" if args.quick else ""
    write_results(rows, f"bench_metrics-{tag}{hardware()}", first=("case",))


def write_results(rows, stem, first=()):
    """Writes ``rows`` atomically to results/<stem>-torch<version>.csv, columns ``first`` first."""
    out_dir = os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{stem}-torch{torch.__version__.split('+')[0]}.csv")
    fields = sorted({key for row in rows for key in row}, key=lambda f: (f not in first, f))
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".csv")
    with os.fdopen(fd, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
