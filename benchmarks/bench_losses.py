"""Forward + backward time and peak memory of every loss relative to ``F.cross_entropy`` in the same run.

Shapes: batch 128 x K in {10, 100, 1000} and 4096 x 32000 (vocabulary-sized); with ``--margin``, the margin and
penalty losses (SPEC §8) at 4096 x K in {10, 100, 1000} and the segmentation batch 4 x 19 x 256 x 256 (labels
4 x 256 x 256), each with the goal of 1.5x cross entropy's time and 2x its peak memory. Each loss is timed in
rounds that alternate with cross entropy (forward + backward from a leaf logits tensor, many steps per round
for the small shapes); the ratio is the median over rounds of loss time / cross-entropy time of the same
round, so the VM's drift cancels; ``time_ratio_best`` is the fastest round of the loss over the fastest of
cross entropy (noise only adds time). Peak memory is the largest amount of tensor memory
alive during one forward + backward beyond the logits themselves (from the torch profiler's allocation
events on CPU, ``torch.cuda.max_memory_allocated`` on CUDA). Optionally times ``torch.compile`` of the
functional losses (compile time and steady-state ratio). Writes a CSV to benchmarks/results/.

    python benchmarks/bench_losses.py [--repeats 20] [--quick] [--compile] [--device cuda]
                                      [--path default|cpp|torch] [--losses mbls,acls --tag margin]
                                      [--margin]

On CPU the losses take the C++ operator when it is built (``--path cpp`` builds it), else torch;
``--path`` forces one (the CSV records it).
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
from bench_metrics import hardware, paired, timed, write_results  # noqa: E402

from torchcal.losses import create, list_losses  # noqa: E402

SHAPES = [(128, 10), (128, 100), (128, 1000), (4096, 32000)]
MARGIN_SHAPES = [(4096, 10), (4096, 100), (4096, 1000), (4, 19, 256, 256)]
MARGIN_FAMILY = ["mbls", "acls", "cals", "poly1", "confidence-penalty", "maxsup", "mdca", "focal-mdca", "ls-mdca",
                 "dca", "sb-ece", "avuc", "s-avuc", "esd", "hl1-ace", "sl1-ace"]  # fmt: skip
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


def cpu_path(name):
    """Context manager selecting the CPU path of the losses (and the name the CSV records)."""
    import contextlib

    from torchcal.functional import build_cpu_extension, cpu_extension_available, use_cpu_extension

    stack = contextlib.ExitStack()
    if name == "cpp":
        build_cpu_extension()
    elif name == "torch":
        stack.enter_context(use_cpu_extension(False))
    if name == "default":
        name = "cpp" if cpu_extension_available() else "torch"
    return stack, name


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
    parser.add_argument("--path", default="default", choices=["default", "cpp", "torch"])
    parser.add_argument("--losses", default="", help="comma-separated registry names (default: every loss)")
    parser.add_argument("--margin", action="store_true", help="the margin and penalty losses at their shapes")
    parser.add_argument(
        "--tag", default="", help="a word added to the CSV's name (e.g. for a --losses subset)"
    )
    args = parser.parse_args()
    stack, path = cpu_path(args.path)
    with stack:
        run(args, path)


def run(args, path):
    device = torch.device(args.device)
    shapes = MARGIN_SHAPES if args.margin else SHAPES[:3] if args.quick else SHAPES
    names = args.losses.split(",") if args.losses else MARGIN_FAMILY if args.margin else list_losses()
    goal_family = set(MARGIN_FAMILY) if args.margin else FOCAL_FAMILY
    rows = []
    for shape in shapes:
        n, k = shape[:2]
        g = torch.Generator().manual_seed(0)
        logits = (3 * torch.randn(*shape, generator=g)).to(device).requires_grad_(True)
        targets = torch.randint(0, k, (n, *shape[2:]), generator=g).to(device)
        # sub-millisecond steps: many steps per round, or the timings are timer and scheduler noise
        small = logits.numel() <= 1_000_000
        # above 1M entries a step is 5-30 ms, but its fresh allocations' page faults vary from step to step:
        # two steps a round and at least 5 rounds, so that the median is not one unlucky step
        steps, rounds = (max(10, args.repeats * 10), 9) if small else (2, max(5, min(2 * args.repeats, 9)))
        base_fn = lambda: fwd_bwd(nnf.cross_entropy, logits, targets)  # noqa: E731
        base_t = timed(lambda: (base_fn(), sync(device)), steps * 3 if small else 3)[0]
        base_m = peak_memory(base_fn, device)
        print(
            f"{' x '.join(map(str, shape))}: cross_entropy {1e3 * base_t:.3f} ms, peak {base_m / 2**20:.1f} MiB "
            f"({path} path)",
            flush=True,
        )
        for name in names:
            loss_fn = create(name).to(device)
            fn = lambda: fwd_bwd(loss_fn, logits, targets)  # noqa: E731
            t, pair_base_t, ratios, (best_t, best_base_t) = paired(
                fn, base_fn, rounds, steps, lambda: sync(device), with_best=True
            )
            ratio = statistics.median(ratios)
            m = peak_memory(fn, device)
            goal_t = 2.0 if k == 10 and not args.margin else 1.5
            row = {
                "shape": "x".join(map(str, shape)),
                "loss": name,
                "path": path if device.type == "cpu" else device.type,
                "time_s": t,
                "cross_entropy_time_s": pair_base_t,
                "time_ratio": ratio,
                # the fastest round of each: noise only adds time, so this is the ratio of their costs where
                # the rounds' spread (page faults of fresh large allocations, the VM) swamps the median
                "time_ratio_best": best_t / best_base_t,
                "peak_bytes": m,
                "memory_ratio": m / base_m,
                "focal_family": name in FOCAL_FAMILY,
                "time_goal": goal_t if name in goal_family else "",
                "memory_goal": 2.0 if name in goal_family else "",
            }
            if args.compile:
                compiled = torch.compile(loss_fn)
                start = time.perf_counter()
                fwd_bwd(compiled, logits, targets)
                sync(device)
                row["compile_s"] = time.perf_counter() - start
                row["compiled_time_ratio"] = statistics.median(
                    paired(
                        lambda: fwd_bwd(compiled, logits, targets),
                        base_fn,
                        rounds,
                        steps,
                        lambda: sync(device),
                    )[2]
                )
            rows.append(row)
            flag = ""
            if name in goal_family and (row["time_ratio"] > goal_t or row["memory_ratio"] > 2.0):
                flag = "  <- over goal"
            print(
                f"  {name:14s} time {row['time_ratio']:5.2f}x (best rounds {row['time_ratio_best']:5.2f}x)  "
                f"memory {row['memory_ratio']:5.2f}x{flag}",
                flush=True,
            )

    tag = (
        (f"{args.tag}-" if args.tag else "margin-" if args.margin else "")
        + ("quick-" if args.quick else "")
        + ("" if path in ("cpp", "cuda") or args.device == "cuda" else f"{path}-")
    )
    dev = "cuda-" + torch.cuda.get_device_name().replace(" ", "-") if device.type == "cuda" else hardware()
    write_results(rows, f"bench_losses-{tag}{dev}", first=("shape", "loss"))


if __name__ == "__main__":
    main()
