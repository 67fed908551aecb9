"""A Lightning run for tests/integrations/test_lightning.py: `python lightning_script.py OUT DEVICES`.

Lightning's DDP launcher runs this file once per process; each rank writes what it saw to OUT/rank<r>.json.
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from torchcal.integrations.lightning import CalibrationCallback
from torchcal.losses import AdaFocalLoss


def blobs(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.randn(n, 8, generator=g) + 1.5 * torch.nn.functional.one_hot(y, 8).float()
    return x, y


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 4)
        self.loss = AdaFocalLoss(n_bins=5)

    def training_step(self, batch, _):
        x, y = batch
        return self.loss(self.net(x), y)

    def validation_step(self, batch, _):
        x, y = batch
        return {"logits": self.net(x), "targets": y}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def multilabel_outputs(outputs, batch):
    """The 4 classes as 4 labels (one-hot), label 3 unknown (-1) where feature 7 exceeds 1: a multi-label
    callback on the same run, synchronised across ranks with unknown targets masked."""
    targets = torch.nn.functional.one_hot(outputs["targets"], 4)
    targets[:, 3] = torch.where(batch[0][:, 7] > 1, -1, targets[:, 3])
    return outputs["logits"], targets


def main(out: Path, devices: int):
    torch.manual_seed(0)
    train = DataLoader(TensorDataset(*blobs(256, 0)), batch_size=32)
    val = DataLoader(TensorDataset(*blobs(128, 1)), batch_size=32)
    callback = CalibrationCallback(num_classes=4, calibrator="ts", metrics=("ece", "adaece", "nll"))
    multilabel = CalibrationCallback(
        num_classes=4, task="multilabel", metrics=("ece", "adaece", "auroc"), prefix="val_ml/", ignore_index=-1,
        update_adafocal=False, outputs_fn=multilabel_outputs,
    )  # fmt: skip
    module = Module()
    trainer = pl.Trainer(
        max_epochs=2, accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        default_root_dir=str(out), callbacks=[callback, multilabel], enable_progress_bar=False, logger=False,
        num_sanity_val_steps=1, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, train, val)
    rank = trainer.global_rank
    state = {
        "logged": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "gamma_history": module.loss.gamma_history.tolist(),
        "temperature": float(callback.calibrator_.temperature_),
        "multilabel_temperatures": multilabel.calibrator_.temperature_.tolist(),
        "checkpoint": str(trainer.checkpoint_callback.best_model_path),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(state))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
