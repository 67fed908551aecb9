"""Runner throughput: training images/s of the demo model (Fashion-MNIST MLP) and of CIFAR ResNet-50, the
runner's overhead against a plain PyTorch loop doing the same work (training + the per-epoch validation and
test pass), and the cost of AdaFocal's γ update beyond that validation pass.

    python benchmarks/bench_runner.py [--epochs 2] [--resnet-batches 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_metrics import hardware, write_results  # noqa: E402

from torchcal.experiments.config import load_config  # noqa: E402
from torchcal.experiments.data.readers import load_splits  # noqa: E402
from torchcal.experiments.models.registry import create_model  # noqa: E402
from torchcal.experiments.training.loop import predict_logits, train  # noqa: E402
from torchcal.losses import create as create_loss  # noqa: E402
from torchcal.metrics import CalibrationMetrics  # noqa: E402


def plain_loop(cfg):
    """What a user would write: the same data, model, data order, loss and per-epoch evaluation, nothing
    else (no checkpoints, no metrics log)."""
    splits = load_splits(cfg.data)
    x, y = splits["train"].inputs, splits["train"].targets
    torch.manual_seed(cfg.train.seed)
    model = create_model(cfg.model.name, 10, x.shape[1:], cfg.model.width)
    loss_fn = create_loss(cfg.loss.name)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.optim.lr)
    for epoch in range(cfg.train.epochs):
        model.train()
        order = torch.randperm(
            len(y), generator=torch.Generator().manual_seed(cfg.train.seed * 100_003 + epoch)
        )
        for idx in order.split(cfg.data.loader.batch_size):
            opt.zero_grad()
            loss_fn(model(x[idx]), y[idx]).backward()
            opt.step()
        for name in ("val", "test"):
            predict_logits(model, splits[name].inputs, cfg.data.loader.eval_batch_size, "cpu")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resnet-batches", type=int, default=5)
    args = parser.parse_args()
    rows = []
    cfg = load_config(None, [f"train.epochs={args.epochs}", "data.shift.name=", "data.ood.sets=[]"])
    splits = load_splits(cfg.data)
    n_train = len(splits["train"])

    plain_times, runner_times = [], []
    for _ in range(3):  # alternate, keep the best of each: the first run also pays one-off warm-up costs
        start = time.perf_counter()
        plain_loop(cfg)
        plain_times.append(time.perf_counter() - start)
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            train(cfg, os.path.join(tmp, "run"))
            runner_times.append(time.perf_counter() - start)
    plain, runner = min(plain_times), min(runner_times)
    rows.append({"case": "demo MLP, Fashion-MNIST, CE", "plain_s": plain, "runner_s": runner,
                 "runner_overhead": runner / plain - 1, "runner_images_per_s": args.epochs * n_train / runner})  # fmt: skip
    print(f"demo MLP: plain loop {plain:.2f} s, runner {runner:.2f} s -> overhead {100 * (runner / plain - 1):+.1f}% "
          f"({args.epochs * n_train / runner:.0f} training images/s incl. evaluation)", flush=True)  # fmt: skip

    # AdaFocal: the γ update from the validation pass's streaming metrics vs one epoch
    ada = create_loss("adafocal")
    val_logits = predict_logits(create_model("mlp", 10, (1, 28, 28), 256), splits["val"].inputs, 1000, "cpu")
    metrics = CalibrationMetrics(10, from_logits=True)
    metrics.update(val_logits, splits["val"].targets)
    start = time.perf_counter()
    for _ in range(20):
        ada.update(metrics=metrics)
    update = (time.perf_counter() - start) / 20
    epoch = runner / args.epochs
    rows.append(
        {
            "case": "AdaFocal update per epoch",
            "update_s": update,
            "epoch_s": epoch,
            "fraction": update / epoch,
        }
    )
    print(f"AdaFocal update {1e3 * update:.2f} ms = {100 * update / epoch:.3f}% of a demo epoch", flush=True)

    model = create_model("resnet50", 10, (3, 32, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    loss_fn = create_loss("flsd-53", reduction="sum")
    x, y = torch.rand(128, 3, 32, 32), torch.randint(0, 10, (128,))
    times = []
    for i in range(args.resnet_batches + 1):
        start = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        if i:  # the first batch warms up
            times.append(time.perf_counter() - start)
    per_batch = sorted(times)[len(times) // 2]
    rows.append({"case": "CIFAR ResNet-50 train step, batch 128, CPU", "step_s": per_batch,
                 "images_per_s": 128 / per_batch, "epoch_45k_s_estimate": 45000 / 128 * per_batch})  # fmt: skip
    print(f"CIFAR ResNet-50 (CPU): {128 / per_batch:.0f} images/s, ~{45000 / 128 * per_batch / 60:.0f} min per "
          "45k-image epoch", flush=True)  # fmt: skip
    write_results(rows, f"bench_runner-{hardware()}", first=("case",))


if __name__ == "__main__":
    main()
