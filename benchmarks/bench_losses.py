"""Forward + backward time and peak memory of every loss relative to ``F.cross_entropy`` in the same run.

Shapes: batch 128 x K in {10, 100, 1000} and 4096 x 32000 (vocabulary-sized). Time is the median of
repeats (10x more for the small shapes) of forward + backward from a leaf logits tensor; peak memory is the largest amount of tensor memory
alive during one forward + backward beyond the logits themselves (from the torch profiler's allocation
events on CPU, ``torch.cuda.max_memory_allocated`` on CUDA). Optionally times ``torch.compile`` of the
functional losses (compile time and steady-state ratio). Writes a CSV to benchmarks/results/.

    python benchmarks/bench_losses.py [--repeats 20] [--quick] [--compile] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as nnf

sys.path.insert(0, os.path.dirname(__file__))
from bench_metrics import hardware, write_results  # noqa: E402

from torchcal.losses import create, list_losses  # noqa: E402

SHAPES = [(128, 10), (128, 100), (128, 1000), (4096, 32000)]
FOCAL_FAMILY = {
    "fl-1",
    "fl-2",
    "fl-3",
    "ifl-1",
    "flsd-53",
    "flsd-532",
    "fls-531",
    "fls-532",
    "dfl",
    "dualflsd-53",
    "fcl",
    "adafocal",
    "adadualfocal",
    "calfocal",
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def fwd_bwd(loss_fn, logits, targets):
    logits.grad = None
    loss_fn(logits, targets).backward()


def median_time(fn, repeats, device):
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_memory(fn, device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.events() if e.cpu_memory_usage != 0), key=lambda e: e.time_range.start)
    alive = peak = 0
    for e in events:
        alive += e.cpu_memory_usage
        peak = max(peak, alive)
    return peak


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="small shapes only")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd losses")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    shapes = SHAPES[:3] if args.quick else SHAPES
    rows = []
    for n, k in shapes:
        g = torch.Generator().manual_seed(0)
        logits = (3 * torch.randn(n, k, generator=g)).to(device).requires_grad_(True)
        targets = torch.randint(0, k, (n,), generator=g).to(device)
        # sub-millisecond steps: many repeats, or the median is timer and scheduler noise
        reps = max(3, args.repeats if n * k < 10_000_000 else 5)
        if n * k <= 1_000_000:
            reps = max(reps, 10 * args.repeats)
        base_fn = lambda: fwd_bwd(nnf.cross_entropy, logits, targets)  # noqa: E731
        base_t = median_time(base_fn, reps, device)
        base_m = peak_memory(base_fn, device)
        print(f"{n} x {k}: cross_entropy {1e3 * base_t:.3f} ms, peak {base_m / 2**20:.1f} MiB", flush=True)
        for name in list_losses():
            loss_fn = create(name).to(device)
            fn = lambda: fwd_bwd(loss_fn, logits, targets)  # noqa: E731
            t = median_time(fn, reps, device)
            m = peak_memory(fn, device)
            goal_t = 2.0 if k == 10 else 1.5
            row = {
                "shape": f"{n}x{k}",
                "loss": name,
                "time_s": t,
                "time_ratio": t / base_t,
                "peak_bytes": m,
                "memory_ratio": m / base_m,
                "focal_family": name in FOCAL_FAMILY,
                "time_goal": goal_t if name in FOCAL_FAMILY else "",
                "memory_goal": 2.0 if name in FOCAL_FAMILY else "",
            }
            if args.compile:
                compiled = torch.compile(loss_fn)
                start = time.perf_counter()
                fwd_bwd(compiled, logits, targets)
                sync(device)
                row["compile_s"] = time.perf_counter() - start
                row["compiled_time_ratio"] = (
                    median_time(lambda: fwd_bwd(compiled, logits, targets), reps, device) / base_t
                )
            rows.append(row)
            flag = ""
            if name in FOCAL_FAMILY and (row["time_ratio"] > goal_t or row["memory_ratio"] > 2.0):
                flag = "  <- over goal"
            print(
                f"  {name:14s} time {row['time_ratio']:5.2f}x  memory {row['memory_ratio']:5.2f}x{flag}",
                flush=True,
            )

    tag = "quick-" if args.quick else ""
    dev = "cuda-" + torch.cuda.get_device_name().replace(" ", "-") if device.type == "cuda" else hardware()
    write_results(rows, f"bench_losses-{tag}{dev}", first=("shape", "loss"))


if __name__ == "__main__":
    main()
