"""Fused linear head + loss against the unfused head: peak memory and time of one forward + backward.

Shapes: N = 4,096 tokens, hidden 1,024, V = 32,000 and 128,000 (a language-model head with a bias), 5% of
the labels set to −100 (padding). The unfused path is ``logits = F.linear(hidden, weight, bias)`` followed by
``F.cross_entropy`` (CE) or the torchcal loss module (the others, on the default backend); the fused path is
:class:`torchcal.losses.FusedLinearLoss` with its default chunking. Every (loss, V, path) case runs in a fresh
subprocess: it runs a small warm-up step (so that one-time library set-up is not counted), builds the inputs,
reads its resident memory, runs forward + backward once, and reports the
time and the peak memory beyond the inputs (on CPU the process's peak RSS from ``getrusage`` minus the RSS
before the step; on CUDA ``torch.cuda.max_memory_allocated`` minus the memory before the step). The two paths
of a case run back to back, in alternating order from round to round, so the machine's drift cancels in their
ratio; the CSV keeps the median over rounds.

    flock /tmp/torchcal-bench.lock python benchmarks/bench_fused_head.py [--rounds 1] [--device cuda]
        [--vocab 32000 128000] [--losses ce flsd-53 ...] [--large-losses ce flsd-53 dfl fcl] [--quick] [--tag T]

``--large-losses`` are the losses timed at the largest vocabulary (every loss runs at the others).
``--quick`` runs N = 512, hidden 128, V = 4,000 (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as nnf

sys.path.insert(0, os.path.dirname(__file__))
from bench_metrics import hardware, write_results  # noqa: E402

LOSSES = ["ce", "ls-0.1", "fl-3", "flsd-53", "dfl", "fcl", "adafocal"]
LARGE_LOSSES = ["ce", "flsd-53", "dfl", "fcl"]


def _rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def child(loss_name, tokens, width, vocab, path, device, seed=0):
    """One forward + backward of one path in this (fresh) process: (seconds, peak bytes beyond the inputs)."""
    from torchcal.losses import FusedLinearLoss, create

    device = torch.device(device)
    loss_fn = create(loss_name)
    fused = FusedLinearLoss(loss_fn)

    def inputs(tokens, vocab):
        g = torch.Generator(device="cpu").manual_seed(seed)
        hidden = torch.randn(tokens, width, generator=g).to(device).requires_grad_()
        weight = torch.randn(vocab, width, generator=g).div_(width**0.5)  # in place: no transient copy
        weight = weight.to(device).requires_grad_()
        bias = torch.zeros(vocab).to(device).requires_grad_()
        labels = torch.randint(0, vocab, (tokens,), generator=g)
        labels[torch.rand(tokens, generator=g) < 0.05] = -100
        return hidden, weight, bias, labels.to(device)

    def step(hidden, weight, bias, labels):
        if path == "fused":
            loss = fused(hidden, weight, labels, bias)
        elif loss_name == "ce":
            loss = nnf.cross_entropy(nnf.linear(hidden, weight, bias), labels, ignore_index=-100)
        else:
            loss = loss_fn(nnf.linear(hidden, weight, bias), labels)
        loss.backward()

    # a small step first: one-time library set-up (thread pools, kernel selection) is not the step's memory
    step(*inputs(64, 1000))
    hidden, weight, bias, labels = inputs(tokens, vocab)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = _rss_bytes()
        setup_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if setup_peak > before + 2**24:  # the high-water mark must be the step's, not the setup's
            raise RuntimeError(f"setup peaked {(setup_peak - before) / 2**20:.0f} MiB above the step's start")
    start = time.perf_counter()
    step(hidden, weight, bias, labels)
    _sync(device)
    seconds = time.perf_counter() - start
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return seconds, peak


def run_case(loss_name, tokens, width, vocab, path, device):
    cmd = [sys.executable, __file__, "--child", loss_name, str(tokens), str(width), str(vocab), path, device]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128000])
    parser.add_argument("--losses", nargs="+", default=LOSSES)
    parser.add_argument("--large-losses", nargs="+", default=LARGE_LOSSES)
    parser.add_argument("--quick", action="store_true", help="N = 512, hidden 128, V = 4,000 (smoke run)")
    parser.add_argument("--tag", default="", help="added to the result file's name (a partial rerun's own file)")
    args = parser.parse_args()
    if args.child:
        loss_name, tokens, width, vocab, path, device = args.child
        seconds, peak = child(loss_name, int(tokens), int(width), int(vocab), path, device)
        print(json.dumps({"seconds": seconds, "peak_bytes": peak}))
        return
    if args.quick:
        args.tokens, args.hidden, args.vocab = 512, 128, [4000]
    stem = "bench_fused_head" + ("-quick" if args.quick else "")
    if not args.quick and args.vocab != [32000, 128000]:  # a partial run: its own file
        stem += "-v" + "-".join(map(str, args.vocab))
    if args.tag:
        stem += f"-{args.tag}"
    stem += f"-{hardware()}"
    if args.device != "cpu":
        stem += f"-{args.device}"
    rows = []
    largest = max(args.vocab)
    for vocab in args.vocab:
        names = args.losses if vocab != largest or len(args.vocab) == 1 else args.large_losses
        for name in names:
            results = {"fused": [], "unfused": []}
            for r in range(args.rounds):
                order = ("unfused", "fused") if r % 2 == 0 else ("fused", "unfused")
                for path in order:
                    results[path].append(run_case(name, args.tokens, args.hidden, vocab, path, args.device))
            med = {
                path: {key: statistics.median(x[key] for x in res) for key in ("seconds", "peak_bytes")}
                for path, res in results.items()
            }
            time_ratio = statistics.median(
                f["seconds"] / u["seconds"] for f, u in zip(results["fused"], results["unfused"])
            )
            memory_ratio = statistics.median(
                f["peak_bytes"] / u["peak_bytes"] for f, u in zip(results["fused"], results["unfused"])
            )
            row = {
                "loss": name,
                "tokens": args.tokens,
                "hidden": args.hidden,
                "vocab": vocab,
                "device": args.device,
                "rounds": args.rounds,
                "unfused_baseline": "F.cross_entropy" if name == "ce" else f"torchcal {name}",
                "unfused_s": round(med["unfused"]["seconds"], 3),
                "fused_s": round(med["fused"]["seconds"], 3),
                "time_ratio": round(time_ratio, 3),
                "unfused_peak_mb": round(med["unfused"]["peak_bytes"] / 2**20, 1),
                "fused_peak_mb": round(med["fused"]["peak_bytes"] / 2**20, 1),
                "memory_ratio": round(memory_ratio, 3),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            # rewritten (atomically) after every case, so that an interrupted run keeps what it measured
            write_results(rows, stem, first=("loss", "vocab", "time_ratio", "memory_ratio"))


if __name__ == "__main__":
    main()
