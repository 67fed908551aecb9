"""The streaming input pipeline: decode + augment throughput per DataLoader worker count, training throughput of
ImageNet ResNet-50 on this machine, and the peak memory of a run as the dataset grows (decision 80).

A synthetic ImageNet-style folder is written first: JPEGs of ImageNet's typical size (500 × 375, quality 90,
textured so that they compress like photographs). Rates are images per second over a second pass (persistent
workers already started), median of ``--repeats``. Peak memory is the maximum resident set size of a
training run in a fresh process (``resource.getrusage``), on N and 4N images.

    python benchmarks/bench_input.py [--images 400] [--repeats 3] [--device cuda]

With ``--device cuda`` it also times ResNet-50 training (bf16 autocast, channels_last) on random images of
the real size. Writes a CSV to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_metrics import hardware, write_results  # noqa: E402

from torchcal.experiments.data.streaming import EpochPlan, ImageFolderInputs, TrainBatches, sequential_batches  # noqa: E402


def write_folder(root: Path, n: int, size=(500, 375), classes: int = 4) -> list[Path]:
    from PIL import Image

    rng = np.random.default_rng(0)
    paths = []
    yy, xx = np.mgrid[0 : size[1], 0 : size[0]]
    for i in range(n):
        folder = root / "train" / f"n{i % classes:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        phase = rng.uniform(0, 6.28, 3)
        base = np.stack(
            [127 + 100 * np.sin(xx / (7 + 5 * c) + yy / (11 + 3 * c) + phase[c]) for c in range(3)], -1
        )
        noise = rng.normal(0, 18, base.shape)
        pixels = np.clip(base + noise, 0, 255).astype(np.uint8)
        path = folder / f"img_{i}.JPEG"
        Image.fromarray(pixels).save(path, quality=90)
        paths.append(path)
    return paths


def decode_rate(paths, workers: int, repeats: int, train: bool = True) -> float:
    inputs = ImageFolderInputs(paths, 224, train=train, seed=0)
    targets = torch.zeros(len(paths), dtype=torch.long)
    n_batches = math.ceil(len(paths) / 32)
    batches = TrainBatches(inputs, targets, EpochPlan(len(paths), 32, 0), n_batches, workers)
    for _ in batches.epoch(0):  # starts the workers
        pass
    rates = []
    for r in range(repeats):
        start = time.perf_counter()
        count = sum(len(y) for _, y in batches.epoch(r + 1))
        rates.append(count / (time.perf_counter() - start))
    return statistics.median(rates)


def eval_rate(paths, workers: int) -> float:
    inputs = ImageFolderInputs(paths, 224, train=False)
    start = time.perf_counter()
    count = sum(len(x) for x in sequential_batches(inputs, 64, workers))
    return count / (time.perf_counter() - start)


def train_rate(device: str, batch: int, steps: int) -> float:
    from torchcal.experiments.models.registry import create_model

    dev = torch.device(device)
    model = create_model("resnet50_imagenet", 1000, (3, 224, 224)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randint(0, 256, (batch, 3, 224, 224), dtype=torch.uint8, device=dev)
    y = torch.randint(0, 1000, (batch,), device=dev)
    cuda = dev.type == "cuda"
    if cuda:
        model = model.to(memory_format=torch.channels_last)

    def step():
        xf = x.float().div_(255)
        if cuda:
            xf = xf.contiguous(memory_format=torch.channels_last)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss = torch.nn.functional.cross_entropy(model(xf), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - start)


_RSS_RUN = """
import json, resource, sys
from torchcal.experiments.config import load_config
from torchcal.experiments.training.loop import train
train(load_config(None, json.loads(sys.argv[1])), sys.argv[2])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def peak_rss_mb(root: Path, val_size: int, run: Path) -> float:
    args = [f"data.root={root}", "data.name=imagenet", f"data.val_size={val_size}", "data.image_size=64",
            "data.shift.name=", "data.ood.sets=[]", "data.loader.batch_size=32", "data.loader.eval_batch_size=64", "model.name=small_cnn",
            "model.width=16", "train.epochs=1", "train.calibrators=[ts]", "train.num_threads=2"]  # fmt: skip
    out = subprocess.run([sys.executable, "-c", _RSS_RUN, json.dumps(args), str(run)], capture_output=True,
                         text=True, check=True)  # fmt: skip
    return int(out.stdout.strip().splitlines()[-1]) / 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = write_folder(root / "big", args.images)
        mean_kb = statistics.mean(p.stat().st_size for p in paths) / 1024
        print(f"{len(paths)} JPEGs of 500 x 375, {mean_kb:.0f} KB on average")
        for workers in (0, 1, 2):
            rate = decode_rate(paths, workers, args.repeats)
            rows.append({"measure": "decode+augment (train)", "workers": workers, "images_per_s": rate,
                         "images": len(paths), "mean_jpeg_kb": mean_kb})  # fmt: skip
            print(f"decode + RandomResizedCrop 224 + flip, {workers} workers: {rate:.0f} images/s")
        rate = eval_rate(paths, 0)
        rows.append(
            {"measure": "decode+resize+crop (eval)", "workers": 0, "images_per_s": rate, "images": len(paths)}
        )
        print(f"decode + resize 256 + centre crop 224, in process: {rate:.0f} images/s")
        device_rate = train_rate(
            args.device, 16 if args.device == "cpu" else 256, 3 if args.device == "cpu" else 30
        )
        rows.append(
            {"measure": f"resnet50 training ({args.device})", "workers": "", "images_per_s": device_rate}
        )
        print(f"ResNet-50 training on {args.device}: {device_rate:.1f} images/s")
        per_worker = rows[1]["images_per_s"]  # one worker's rate
        for gpu_rate in (1500, 3000):  # assumed ResNet-50 bf16 rates of one GPU (not measured here)
            need = math.ceil(gpu_rate / per_worker)
            rows.append({"measure": f"workers needed for {gpu_rate} images/s (assumed GPU rate)",
                         "workers": need, "images_per_s": gpu_rate})  # fmt: skip
            print(f"a GPU training at {gpu_rate} images/s needs {need} decoding workers of this CPU's speed")
        # peak memory as the dataset grows: N and 4N small images, the same run otherwise
        for n in (250, 1000):
            folder = root / f"mem{n}"
            write_folder(folder, n, size=(96, 80))
            val = folder / "val"
            for path in sorted((folder / "train").rglob("*.JPEG"))[::5]:  # a val/ folder of the same classes
                target = val / path.parent.name / path.name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(path.read_bytes())
            rss = peak_rss_mb(folder, n // 10, folder / "run")
            in_memory = n * 3 * 64 * 64 * 4 / 2**20
            rows.append({"measure": "peak RSS of a training run (MB)", "images": n, "peak_rss_mb": rss,
                         "float32_tensor_mb": in_memory})  # fmt: skip
            print(
                f"{n} images: peak RSS {rss:.0f} MB (the split as one float32 tensor would be {in_memory:.1f} MB)"
            )
    write_results(rows, f"bench_input-{hardware()}", first=("measure", "workers", "images_per_s"))


if __name__ == "__main__":
    main()
