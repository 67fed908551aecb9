"""CalibrationCallback with a real Lightning Trainer: 2 gloo processes (DDP) on CPU log the metrics of the
whole validation set (multiclass and multi-label), hold identical AdaFocal γ and save the calibrator fitted to
each checkpoint's weights; validate() measures without adapting the loss; stale calibrators are not saved."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")  # the `dev` extra installs it; CI runs these tests

import torchcal.functional as F  # noqa: E402
from torchcal.calibrators import BinaryTemperatureScaling, TemperatureScaling  # noqa: E402
from torchcal.integrations.lightning import CalibrationCallback  # noqa: E402
from torchcal.losses import (  # noqa: E402
    AdaFocalLoss,
    AvUCLoss,
    CALSLoss,
    LogitMarginL1Loss,
    MaxSupLoss,
    ScheduledFocalLoss,
)

SCRIPT = Path(__file__).with_name("lightning_script.py")
from tests.integrations.lightning_script import Module, blobs, multilabel_outputs  # noqa: E402


def _val_logits(checkpoint, n=128):
    module = Module()
    module.load_state_dict(torch.load(checkpoint, weights_only=False)["state_dict"])
    x, y = blobs(n, 1)
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
    # the multi-label callback of the same run: sums all-reduced, rows all-gathered, unknown labels masked
    x, _ = blobs(128, 1)
    _, targets = multilabel_outputs({"logits": logits, "targets": y}, (x, y))
    p = torch.sigmoid(logits.double())
    for name, fn in (
        ("ece", F.multilabel_ece),
        ("adaece", F.multilabel_adaece),
        ("auroc", F.multilabel_auroc),
    ):
        per_label = [fn(p[targets[:, j] >= 0, j], targets[targets[:, j] >= 0, j]) for j in range(4)]
        assert abs(state["logged"][f"val_ml/{name}"] - float(torch.stack(per_label).mean())) < 1e-5, name
    full = (targets >= 0).all(1)
    refit = BinaryTemperatureScaling().fit(logits[full], targets[full])
    torch.testing.assert_close(
        torch.tensor(state["multilabel_temperatures"], dtype=torch.float64),
        refit.temperature_,
        rtol=1e-4,
        atol=0,
    )


class _TupleModule(Module):
    def validation_step(self, batch, _):
        x, y = batch
        return self.net(x), y


class _BadModule(Module):
    def validation_step(self, batch, _):
        return self.net(batch[0]).sum()


def _trainer(callbacks, tmp_path, epochs=1, **kwargs):
    callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
    return pl.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path), **kwargs,
    )  # fmt: skip


def _loaders(data=blobs, n_val=48):
    from torch.utils.data import DataLoader, TensorDataset

    return (
        DataLoader(TensorDataset(*data(64, 0)), batch_size=16),
        DataLoader(TensorDataset(*data(n_val, 1)), batch_size=16),
    )


def _fit(module, callback, tmp_path, epochs=1, ckpt_path=None, **kwargs):
    trainer = _trainer(callback, tmp_path, epochs, **kwargs)
    trainer.fit(module, *_loaders(), ckpt_path=ckpt_path)
    return trainer


def test_one_process_tuple_outputs_and_restore(tmp_path):
    callback = CalibrationCallback(num_classes=4, calibrator="ts:objective=ece", metrics="ece")
    trainer = _fit(_TupleModule(), callback, tmp_path)
    assert set(trainer.callback_metrics) == {"val/ece"}
    first = float(callback.calibrator_.temperature_)
    assert callback.calibrator_.objective == "ece"
    # resuming restores the calibrator from the checkpoint before training goes on
    again = CalibrationCallback(num_classes=4, calibrator="ts:objective=ece", metrics="ece")
    again.load_state_dict(torch.load(trainer.checkpoint_callback.best_model_path, weights_only=True)[
        "callbacks"][again.state_key])  # fmt: skip
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


@pytest.mark.filterwarnings("ignore:temperature scaling hit the bound")  # the untrained model
def test_validate_measures_without_adapting_adafocal(tmp_path):
    """A stand-alone Trainer.validate (before fit, or after it) leaves γ as it is; fit's epochs update it."""
    callback = CalibrationCallback(num_classes=4, metrics="ece")
    module = Module()
    trainer = _trainer(callback, tmp_path, epochs=2)
    train, val = _loaders()
    before = module.loss.gamma_per_bin.clone()
    logged = trainer.validate(module, val, verbose=False)[0]
    assert module.loss.gamma_history.shape[0] == 0
    torch.testing.assert_close(module.loss.gamma_per_bin, before)
    assert "val/ece" in logged and callback.calibrator_ is not None  # metrics and calibrator as usual
    trainer.fit(module, train, val)
    assert module.loss.gamma_history.shape[0] == 2  # one update per validation epoch of fit
    gamma = module.loss.gamma_per_bin.clone()
    trainer.validate(module, val, verbose=False)
    assert module.loss.gamma_history.shape[0] == 2
    torch.testing.assert_close(module.loss.gamma_per_bin, gamma)


def test_checkpoint_of_later_weights_carries_no_calibrator(tmp_path):
    """check_val_every_n_epoch=2 with a checkpoint every epoch: epoch=2.ckpt once carried the temperature
    fitted to epoch 1's weights. Now it carries none (and says so); epoch=1.ckpt carries its own."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    callback = CalibrationCallback(num_classes=4, metrics="ece", update_adafocal=False)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{epoch}", every_n_epochs=1, save_top_k=-1,
                            save_on_train_epoch_end=True)  # fmt: skip
    torch.manual_seed(0)
    _fit(Module(), [callback, saver], tmp_path, epochs=3, check_val_every_n_epoch=2)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "epoch=0.ckpt",
        "epoch=1.ckpt",
        "epoch=2.ckpt",
    ]
    own = CalibrationCallback.calibrator_from_checkpoint(tmp_path / "ckpt" / "epoch=1.ckpt")
    logits, y = _val_logits(tmp_path / "ckpt" / "epoch=1.ckpt", n=48)
    refit = TemperatureScaling().fit(logits, y)
    # the same NLL fit on the same logits up to the optimiser's tolerance
    assert abs(float(own.temperature_) - float(refit.temperature_)) < 1e-4
    with pytest.warns(
        UserWarning, match=r"changed after the calibrator was fitted \(global step 8, epoch 1\)"
    ):
        assert CalibrationCallback.calibrator_from_checkpoint(tmp_path / "ckpt" / "epoch=2.ckpt") is None
    assert CalibrationCallback.calibrator_from_checkpoint(tmp_path / "ckpt" / "epoch=0.ckpt") is None
    assert callback.calibrator_fitted_at_ == {"global_step": 8, "epoch": 1}
    # resuming from it restores no calibrator either (with the same warning)
    again = CalibrationCallback(num_classes=4, metrics="ece", update_adafocal=False)
    state = torch.load(tmp_path / "ckpt" / "epoch=2.ckpt", weights_only=True)["callbacks"][again.state_key]
    with pytest.warns(UserWarning, match="changed after"):
        again.load_state_dict(state)
    assert again.calibrator_ is None


def test_state_keys_class_count_and_safe_loading(tmp_path):
    first = CalibrationCallback(num_classes=4, metrics="ece", prefix="val/")
    second = CalibrationCallback(num_classes=4, metrics="nll", prefix="val_b/", update_adafocal=False)
    assert first.state_key != second.state_key
    trainer = _fit(_TupleModule(), [first, second], tmp_path)
    path = trainer.checkpoint_callback.best_model_path
    states = torch.load(path, weights_only=True)["callbacks"]
    assert {first.state_key, second.state_key} <= set(states)
    loaded = CalibrationCallback.calibrator_from_checkpoint(path, "ts", prefix="val_b/")
    assert float(loaded.temperature_) == float(second.calibrator_.temperature_)
    # a calibrator fitted on 4 classes is refused by a 3-class callback at load time
    with pytest.raises(ValueError, match="with 4 classes, but this callback has task='multiclass' with 3"):
        CalibrationCallback(num_classes=3).load_state_dict(states[first.state_key])
    # a calibrator of unrecorded provenance (a state written before the fit step was recorded) is not saved
    # with a checkpoint of another step either
    legacy = dict(states[first.state_key], fitted_at=None)
    restored = CalibrationCallback(num_classes=4)
    restored.load_state_dict(legacy)
    checkpoint = {"callbacks": {restored.state_key: restored.state_dict()}, "global_step": 99}
    restored.on_save_checkpoint(None, None, checkpoint)
    with pytest.warns(UserWarning, match="at an unrecorded step"):
        assert (
            CalibrationCallback(num_classes=4).load_state_dict(checkpoint["callbacks"][restored.state_key])
            is None
        )
    # a checkpoint holding arbitrary objects is not unpickled unless the caller says it trusts the file
    module = _HparamsModule(Opaque(3))
    trainer = _fit(module, CalibrationCallback(num_classes=4), tmp_path / "h")
    path = trainer.checkpoint_callback.best_model_path
    with pytest.raises(ValueError, match="weights_only=False if you trust the file"):
        CalibrationCallback.calibrator_from_checkpoint(path)
    assert CalibrationCallback.calibrator_from_checkpoint(path, weights_only=False) is not None


class Opaque:
    def __init__(self, n):
        self.n = n


class _HparamsModule(Module):
    def __init__(self, opaque):
        super().__init__()
        self.save_hyperparameters()


def multilabel_blobs(n, seed, labels=3):
    """Features from which 3 overlapping labels are learnable; 15 % of the targets unknown (-1)."""
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(n, labels, generator=g) < 0.4).long()
    x = torch.randn(n, 8, generator=g)
    x[:, :labels] += y  # overlapping classes: the fitted temperatures stay inside their bounds
    y[torch.rand(n, labels, generator=g) < 0.15] = -1
    return x, y


class _MultilabelModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 3)

    def training_step(self, batch, _):
        x, y = batch
        known = y >= 0
        z = self.net(x)
        return torch.nn.functional.binary_cross_entropy_with_logits(z[known], y[known].float())

    def validation_step(self, batch, _):
        x, y = batch
        return {"logits": self.net(x), "targets": y}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.mark.filterwarnings("ignore:temperature scaling hit the bound")  # the first epochs' underfit labels
def test_multilabel_callback_with_unknown_targets(tmp_path):
    callback = CalibrationCallback(num_classes=3, task="multilabel", ignore_index=-1,
                                   metrics=("ece", "ece_micro", "adaece", "nll", "auroc"))  # fmt: skip
    module = _MultilabelModule()
    trainer = _trainer(callback, tmp_path, epochs=8)  # enough to learn every label's base rate
    trainer.fit(module, *_loaders(multilabel_blobs, n_val=200))
    x, y = multilabel_blobs(200, 1)
    with torch.no_grad():
        z = module.net(x).double()
    p = torch.sigmoid(z)
    per_label = {
        "ece": [F.multilabel_ece(p[y[:, j] >= 0, j], y[y[:, j] >= 0, j]) for j in range(3)],
        "adaece": [F.multilabel_adaece(p[y[:, j] >= 0, j], y[y[:, j] >= 0, j]) for j in range(3)],
        "nll": [F.multilabel_nll(p[y[:, j] >= 0, j], y[y[:, j] >= 0, j]) for j in range(3)],
        "auroc": [F.multilabel_auroc(p[y[:, j] >= 0, j], y[y[:, j] >= 0, j]) for j in range(3)],
    }
    logged = trainer.callback_metrics
    for name, values in per_label.items():  # logged as float32
        assert abs(float(logged[f"val/{name}"]) - float(torch.stack(values).mean())) < 1e-5, name
    known = y >= 0
    assert abs(float(logged["val/ece_micro"]) - float(F.multilabel_ece(p[known], y[known]))) < 1e-5
    # per-label temperature scaling on the samples whose labels are all known
    full = known.all(1)
    refit = BinaryTemperatureScaling().fit(z[full].float(), y[full])
    assert bool(((refit.temperature_ > 0.02) & (refit.temperature_ < 50)).all())  # an optimum, not a bound
    torch.testing.assert_close(callback.calibrator_.temperature_, refit.temperature_, rtol=1e-4, atol=0)
    with pytest.raises(ValueError, match="unknown names"):
        CalibrationCallback(num_classes=3, task="multilabel", metrics=("auroc_micro",))


class _CALSModule(Module):
    def __init__(self):
        super().__init__()
        self.loss = CALSLoss(margin=0.5)  # (a margin the blobs model exceeds: active constraints move λ)
        self.avuc = AvUCLoss()

    def training_step(self, batch, _):
        x, y = batch
        z = self.net(x)
        return self.loss(z, y) + 0.1 * self.avuc(z, y)


def test_fit_updates_cals_and_avuc_once_per_epoch(tmp_path):
    """The callback calls CALS's and AvUC's end-of-epoch update after each validation epoch of fit (from the
    training statistics they accumulated); a stand-alone validate leaves them as they are, and the
    checkpoint restores them."""
    module = _CALSModule()
    callback = CalibrationCallback(num_classes=4, metrics="ece", calibrator=None)
    trainer = _fit(module, callback, tmp_path, epochs=2)
    assert int(module.loss.updates) == 2 and int(module.avuc.updates) == 2
    assert (module.loss.lambdas > 1e-3).any() and float(module.avuc.threshold) != 1.0
    lambdas = module.loss.lambdas.clone()
    trainer.validate(module, _loaders()[1], verbose=False)
    torch.testing.assert_close(module.loss.lambdas, lambdas)
    assert int(module.loss.updates) == 2
    restored = _CALSModule()
    restored.load_state_dict(
        torch.load(trainer.checkpoint_callback.best_model_path, weights_only=True)["state_dict"]
    )
    torch.testing.assert_close(restored.loss.lambdas, lambdas)
    assert float(restored.avuc.threshold) == float(module.avuc.threshold)


# -- the loss hooks: scheduled and stateful losses epoch by epoch against a hand-written loop ------------------


class _HookedModule(Module):
    """Every kind of loss hook at once: AdaFocal (validation update), CALS and AvUC (end-of-epoch update from
    the training statistics), FLS (γ by epoch), MbLS's α schedule and MaxSup's ramp (set_epoch,
    set_total_epochs). It records the state of each training step and of each epoch's end."""

    def __init__(self):
        super().__init__()
        self.fls = ScheduledFocalLoss(gammas=(5.0, 3.0, 1.0), milestones=(1, 2))
        self.mbls = LogitMarginL1Loss(margin=1.0, schedule="add", mu=0.1)
        self.maxsup = MaxSupLoss()
        self.cals = CALSLoss(margin=2.0)
        self.avuc = AvUCLoss()
        self.steps, self.epochs = [], []

    def configure_optimizers(self):  # (a step that keeps the confidences below 1 in float32: no ties at 1)
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def training_step(self, batch, _):
        x, y = batch
        z = self.net(x)
        self.steps.append(
            (self.current_epoch, self.fls.gamma, self.mbls.current_alpha, self.maxsup.current_alpha)
        )
        losses = (self.loss, self.fls, self.mbls, self.maxsup, self.cals)
        return sum(f(z, y) for f in losses) + 0.1 * self.avuc(z, y)

    def on_train_epoch_end(self):  # after the epoch's validation run and the callback's update
        self.epochs.append(_loss_states(self))


def _loss_states(module):
    return {
        "gamma": module.loss.gamma_per_bin.clone(), "edges": module.loss.bin_edges.clone(),
        "lambdas": module.cals.lambdas.clone(), "rhos": module.cals.rhos.clone(),
        "threshold": module.avuc.threshold.clone(), "weight": module.net.weight.detach().clone(),
    }  # fmt: skip


def _hand_written_run(epochs=3):
    """The documented hooks with a plain loop: set_total_epochs(E) once, set_epoch(e) before epoch e's steps,
    after its steps AdaFocal.update(validation logits of the model in eval mode), CALS.update() and
    AvUC.update() (their training statistics)."""
    torch.manual_seed(0)
    module = _HookedModule()
    opt = module.configure_optimizers()
    train, val = _loaders()
    module.maxsup.set_total_epochs(epochs)
    for epoch in range(epochs):
        for m in (module.fls, module.mbls, module.maxsup):
            m.set_epoch(epoch)
        module.train()
        for x, y in train:
            module.steps.append(
                (epoch, module.fls.gamma, module.mbls.current_alpha, module.maxsup.current_alpha)
            )
            z = module.net(x)
            losses = (module.loss, module.fls, module.mbls, module.maxsup, module.cals)
            loss = sum(f(z, y) for f in losses) + 0.1 * module.avuc(z, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        module.eval()
        with torch.no_grad():
            z, y = map(torch.cat, zip(*[(module.net(x), y) for x, y in val]))
        module.loss.update(z, y, from_logits=True)
        module.cals.update()
        module.avuc.update()
        module.epochs.append(_loss_states(module))
    return module


def test_loss_hooks_follow_a_hand_written_loop_epoch_by_epoch(tmp_path):
    """Three epochs of fit with the callback give the hand-written loop's schedule in every step (FLS's γ
    5, 3, 1; MbLS's α 0.1, 0.2, 0.3; MaxSup's α 0.1, 0.15, 0.2) and its loss states after every epoch.
    Without the set_epoch / set_total_epochs calls the schedules stayed at their first value."""
    torch.manual_seed(0)
    module = _HookedModule()
    _fit(module, CalibrationCallback(num_classes=4, metrics="ece", calibrator=None), tmp_path, epochs=3)
    reference = _hand_written_run()
    expected = [(e, (5.0, 3.0, 1.0)[e], 0.1 + 0.1 * e, 0.1 + 0.05 * e) for e in range(3) for _ in range(4)]
    # (MbLS adds 0.1 in floating point: 0.1 + 0.1 + 0.1 differs from 0.3 in the last bit)
    for got, want in zip(module.steps, expected, strict=True):
        assert got[:2] == want[:2] and abs(got[2] - want[2]) < 1e-12 and abs(got[3] - want[3]) < 1e-12
    assert module.steps == reference.steps
    assert len(module.epochs) == 3 and int(module.cals.updates) == 3 and int(module.avuc.updates) == 3
    # The same operations in the same order on the same batches: equal, except AdaFocal's statistics. The
    # callback takes them from the metrics' float32 confidences where the loop passes the logits (float64
    # probabilities): the edges differ by the float32 rounding of a confidence (<= 2^-24 below 1; 2 ulps
    # allowed), the gaps by as much, so γ·exp(λ·gap) by ~6e-8 relative per update (3 updates, rtol 1e-6).
    tolerances = {"gamma": (1e-6, 0.0), "edges": (0.0, 2 * 2.0**-24)}
    for epoch, (got, want) in enumerate(zip(module.epochs, reference.epochs, strict=True)):
        for name in want:
            rtol, atol = tolerances.get(name, (0.0, 0.0))
            torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=f"{name} {epoch}")


def test_two_callbacks_update_the_loss_once_per_validation_run(tmp_path):
    """Two multiclass callbacks (two prefixes, both update_adafocal=True) on one module: one AdaFocal update
    and one CALS / AvUC update per validation run, not two."""
    module = _HookedModule()
    first = CalibrationCallback(num_classes=4, metrics="ece", calibrator=None)
    second = CalibrationCallback(num_classes=4, metrics="nll", calibrator=None, prefix="val_b/")
    _fit(module, [first, second], tmp_path, epochs=2)
    assert module.loss.gamma_history.shape[0] == 2
    assert int(module.cals.updates) == 2 and int(module.avuc.updates) == 2


@pytest.mark.filterwarnings("ignore:The dirpath has changed")  # the resumed fit writes its own folder
def test_resumed_fit_equals_the_uninterrupted_one(tmp_path):
    """A fit of 3 epochs resumed from the checkpoint of epoch 1 (a fresh module) ends with the uninterrupted
    fit's weights and loss states, bitwise: the module's state_dict carries every loss's state (AdaFocal's
    bins, CALS's multipliers, AvUC's threshold and sums, the schedules' epoch and count), and the callback
    gives the schedules the resumed epochs."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(root, ckpt_path=None):
        torch.manual_seed(0)
        module = _HookedModule()
        saver = ModelCheckpoint(dirpath=root / "ckpt", filename="{epoch}", save_top_k=-1)
        callback = CalibrationCallback(num_classes=4, metrics="ece", calibrator=None)
        _fit(module, [callback, saver], root, epochs=3, ckpt_path=ckpt_path)
        return module

    full = run(tmp_path / "full")
    resumed = run(tmp_path / "resumed", ckpt_path=tmp_path / "full" / "ckpt" / "epoch=1.ckpt")
    assert resumed.steps == full.steps[8:]  # the third epoch's steps, with the third epoch's schedules
    for name, value in full.state_dict().items():
        got = resumed.state_dict()[name]
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got, value, rtol=0, atol=0, msg=name)
        else:  # the schedules' extra state
            assert got == value, name
