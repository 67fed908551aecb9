"""CalibrationCallback with a real Lightning Trainer: 2 gloo processes (DDP) on CPU log the metrics of the
whole validation set, hold identical AdaFocal γ and save the calibrator fitted to each checkpoint's weights."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")  # the `dev` extra installs it; CI runs these tests

import torchcal.functional as F  # noqa: E402
from torchcal.calibrators import TemperatureScaling  # noqa: E402
from torchcal.integrations.lightning import CalibrationCallback  # noqa: E402
from torchcal.losses import AdaFocalLoss  # noqa: E402

SCRIPT = Path(__file__).with_name("lightning_script.py")
from tests.integrations.lightning_script import Module, blobs  # noqa: E402


def _val_logits(checkpoint):
    module = Module()
    module.load_state_dict(torch.load(checkpoint, weights_only=False)["state_dict"])
    x, y = blobs(128, 1)
    with torch.no_grad():
        return module.net(x), y


def test_two_ddp_processes(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "2"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]  # the same metrics, γ and calibrator on every rank
    state = ranks[0]
    logits, y = _val_logits(state["checkpoint"])  # the final weights, on the whole validation set
    expected = {
        "val/ece": F.expected_calibration_error(logits, y, from_logits=True),
        "val/adaece": F.adaptive_calibration_error(logits, y, from_logits=True),
        "val/nll": torch.nn.functional.cross_entropy(logits, y),
    }
    for name, value in expected.items():
        assert abs(state["logged"][name] - float(value)) < 1e-5, name
    # AdaFocal: one update per epoch (the sanity check is skipped), the last one from the global statistics
    history = torch.tensor(state["gamma_history"], dtype=torch.float64)
    assert history.shape == (2, 5)
    replay = AdaFocalLoss(n_bins=5)
    replay.gamma_per_bin.copy_(history[0])
    replay.update(logits, y, from_logits=True)
    torch.testing.assert_close(replay.gamma_per_bin, history[1], rtol=1e-5, atol=1e-6)
    # the checkpoint carries the calibrator fitted on the whole validation set with its weights
    saved = CalibrationCallback.calibrator_from_checkpoint(state["checkpoint"], "ts")
    refit = TemperatureScaling().fit(logits, y)
    assert abs(float(saved.temperature_) - float(refit.temperature_)) < 1e-4
    assert abs(float(saved.temperature_) - state["temperature"]) < 1e-12


class _TupleModule(Module):
    def validation_step(self, batch, _):
        x, y = batch
        return self.net(x), y


class _BadModule(Module):
    def validation_step(self, batch, _):
        return self.net(batch[0]).sum()


def _fit(module, callback, tmp_path, epochs=1, ckpt_path=None):
    from torch.utils.data import DataLoader, TensorDataset

    trainer = pl.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1, callbacks=[callback], logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(
        module,
        DataLoader(TensorDataset(*blobs(64, 0)), batch_size=16),
        DataLoader(TensorDataset(*blobs(48, 1)), batch_size=16),
        ckpt_path=ckpt_path,
    )
    return trainer


def test_one_process_tuple_outputs_and_restore(tmp_path):
    callback = CalibrationCallback(num_classes=4, calibrator="ts:objective=ece", metrics="ece")
    trainer = _fit(_TupleModule(), callback, tmp_path)
    assert set(trainer.callback_metrics) == {"val/ece"}
    first = float(callback.calibrator_.temperature_)
    assert callback.calibrator_.objective == "ece"
    # resuming restores the calibrator from the checkpoint before training goes on
    again = CalibrationCallback(num_classes=4, calibrator="ts:objective=ece", metrics="ece")
    again.load_state_dict(torch.load(trainer.checkpoint_callback.best_model_path, weights_only=False)[
        "callbacks"]["CalibrationCallback[ts:objective=ece]"])  # fmt: skip
    assert float(again.calibrator_.temperature_) == first


def test_outputs_fn_no_calibrator_and_bad_outputs(tmp_path):
    seen = []

    def outputs_fn(outputs, batch):
        seen.append(batch_size := batch[0].shape[0])
        assert batch_size == outputs["logits"].shape[0]
        return outputs["logits"], outputs["targets"]

    callback = CalibrationCallback(
        num_classes=4, calibrator=None, update_adafocal=False, outputs_fn=outputs_fn
    )
    module = Module()
    _fit(module, callback, tmp_path)
    assert callback.calibrator_ is None and sum(seen) >= 48
    assert module.loss.gamma_history.shape[0] == 0  # update_adafocal=False
    with pytest.raises(TypeError, match="validation_step must return"):
        _fit(_BadModule(), CalibrationCallback(num_classes=4), tmp_path / "bad")


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown names \\['ace'\\]"):
        CalibrationCallback(num_classes=3, metrics=("ece", "ace"))
    with pytest.raises(ValueError, match="unknown calibrator|calibrator"):
        CalibrationCallback(num_classes=3, calibrator="tss")
