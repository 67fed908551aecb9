"""torchcal losses and metrics in a real transformers.Trainer with tiny randomly initialised BERT models
(built from a config: nothing is downloaded)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `dev` extra installs it; CI runs these tests
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    BertForTokenClassification,
    TrainingArguments,
)

import torchcal.functional as F  # noqa: E402
from torchcal.integrations.huggingface import CalibrationTrainer, compute_metrics, loss_func  # noqa: E402
from torchcal.losses import (  # noqa: E402
    AdaFocalLoss,
    CALSLoss,
    LogitMarginL1Loss,
    MaxSupLoss,
    ScheduledFocalLoss,
    create,
)

CONFIG = dict(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
              max_position_embeddings=16)  # fmt: skip


class Texts(torch.utils.data.Dataset):
    """Random token sequences whose class is set by their first token (learnable); token labels padded -100."""

    def __init__(self, n, seed, tokens=False):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, 40, (n, 10), generator=g)
        self.ids[:, 0] = torch.randint(0, 3, (n,), generator=g)
        if tokens:
            self.labels = self.ids % 3
            self.labels[:, 7:] = -100  # padding positions
        else:
            self.labels = self.ids[:, 0].clone()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones(10, dtype=torch.long),
            "labels": self.labels[i],
        }


def args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, per_device_eval_batch_size=16,
                num_train_epochs=2, learning_rate=5e-3, eval_strategy="epoch", save_strategy="no",
                logging_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)  # fmt: skip
    base.update(kw)
    return TrainingArguments(**base)


def test_loss_func_is_the_torchcal_loss():
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_labels=3, **CONFIG)).eval()
    data = Texts(8, 0)
    batch = {
        k: torch.stack([data[i][k] for i in range(8)]) for k in ("input_ids", "attention_mask", "labels")
    }
    labels = batch.pop("labels")
    outputs = model(**batch)
    loss = create("flsd-53")
    torch.testing.assert_close(loss_func(loss)(outputs, labels), loss(outputs.logits, labels))
    # with the Trainer's item count (gradient accumulation): the sum over the batch divided by the count
    torch.testing.assert_close(
        loss_func(loss)(outputs, labels, num_items_in_batch=torch.tensor(20)),
        create("flsd-53", reduction="sum")(outputs.logits, labels) / 20,
    )
    assert loss.reduction == "mean"  # restored
    with pytest.raises(TypeError, match="torchcal loss module"):
        loss_func(F.focal_loss)
    with pytest.raises(ValueError, match="the batch has no `labels`"):
        loss_func(loss)(outputs, None)


def _weighted_focal_reference(logits, labels, weight, gamma):
    """Σ w_y (1 − p_y)^γ (−log p_y) / Σ w_y over the labels other than −100, a loop in float64."""
    num, den = 0.0, 0.0
    for row, y in zip(logits.detach().reshape(-1, logits.shape[-1]), labels.reshape(-1).tolist()):
        if y == -100:
            continue
        log_p = torch.log_softmax(row, 0)[y]
        num += float(weight[y]) * float((1 - log_p.exp()) ** gamma * -log_p)
        den += float(weight[y])
    return num / den


@pytest.mark.parametrize("gamma", [0.0, 3.0])
def test_class_weighted_loss_under_the_trainers_item_count(gamma):
    """The Trainer passes its label count with or without accumulation. A class-weighted loss is its own
    weighted mean Σ w_y ℓ / Σ w_y for a step of one batch (it was Σ w_y ℓ / N: 5.5 times CE's value with
    weights (1, 10, 1) on 8 rows) and, accumulated, each batch's mean times its share of the step's labels."""
    g = torch.Generator().manual_seed(4)
    weight = torch.tensor([1.0, 10.0, 1.0], dtype=torch.float64)
    logits = 2 * torch.randn(4, 6, 3, generator=g, dtype=torch.float64, requires_grad=True)  # (N, T, K)
    labels = torch.randint(0, 3, (4, 6), generator=g)
    labels[:, 4:] = -100
    labels[3] = -100  # the last sample is all padding
    loss = create("ce" if gamma == 0 else "fl-3", weight=weight)
    compute_loss = loss_func(loss)
    items = int((labels != -100).sum())
    # float64 throughout: the loop and the library differ only in summation order
    got = compute_loss({"logits": logits}, labels, num_items_in_batch=torch.tensor(items))
    assert abs(got.item() - _weighted_focal_reference(logits, labels, weight, gamma)) < 1e-12
    assert loss.reduction == "mean"  # restored
    # accumulated over two batches of 2 samples: each batch's weighted mean times its share of the labels
    first, second = slice(0, 2), slice(2, 4)
    step = sum(
        compute_loss({"logits": logits[part]}, labels[part], num_items_in_batch=torch.tensor(items))
        for part in (first, second)
    )
    share = [int((labels[part] != -100).sum()) / items for part in (first, second)]
    expected = sum(
        s * _weighted_focal_reference(logits[part], labels[part], weight, gamma)
        for s, part in zip(share, (first, second))
    )
    assert abs(step.item() - expected) < 1e-12
    # a batch whose labels are all ignored adds 0 and a zero gradient (its weighted mean is 0 / 0)
    empty = compute_loss({"logits": logits[3:]}, labels[3:], num_items_in_batch=torch.tensor(items))
    (gradient,) = torch.autograd.grad(empty, logits)
    assert empty.item() == 0.0 and bool((gradient == 0).all())
    # the fused head's step of one batch is the same weighted mean
    from torchcal.integrations.huggingface import _as_fused, _fused_from_hidden

    hidden, head = logits.detach(), torch.nn.Linear(3, 3, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(torch.eye(3)), head.bias.zero_()  # logits = hidden
    fused = _as_fused(create("ce" if gamma == 0 else "fl-3", weight=weight))
    got = _fused_from_hidden(fused, head, hidden, labels, torch.tensor(items), False)  # (N, T, H)
    assert abs(got.item() - _weighted_focal_reference(logits, labels, weight, gamma)) < 1e-12


def test_token_classification_ignores_padding_labels():
    torch.manual_seed(0)
    model = BertForTokenClassification(BertConfig(num_labels=3, **CONFIG)).eval()
    data = Texts(4, 1, tokens=True)
    ids = torch.stack([data[i]["input_ids"] for i in range(4)])
    labels = torch.stack([data[i]["labels"] for i in range(4)])
    outputs = model(input_ids=ids)
    logits = outputs.logits  # (N, T, K)
    keep = labels != -100
    expected = F.focal_loss(logits[keep], labels[keep], gamma=3.0)
    torch.testing.assert_close(loss_func(create("fl-3"))(outputs, labels), expected)
    # HF's own model loss is cross entropy with the same masking: γ = 0 gives it
    own = model(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(loss_func(create("ce"))(outputs, labels), own)


def test_trainer_trains_reports_metrics_and_updates_adafocal(tmp_path):
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_labels=3, **CONFIG))
    loss = AdaFocalLoss(n_bins=5)
    trainer = CalibrationTrainer(
        model=model, args=args(tmp_path), train_dataset=Texts(96, 0), eval_dataset=Texts(48, 1),
        calibration_loss=loss, compute_metrics=compute_metrics(num_classes=3, names=("ece", "adaece", "nll")),
    )  # fmt: skip
    trainer.train()
    assert loss.gamma_history.shape == (2, 5)  # one update per scheduled evaluation (epoch)
    gamma = loss.gamma_per_bin.clone()
    # evaluate() outside train(): the extra evaluation after training and the test set's metrics measure
    # without adapting the loss (it must not learn from test labels)
    trainer.evaluate()
    trainer.evaluate(eval_dataset=Texts(48, 2), metric_key_prefix="test")
    assert loss.gamma_history.shape == (2, 5)
    torch.testing.assert_close(loss.gamma_per_bin, gamma)
    result = trainer.evaluate(update_calibration_loss=True)  # the user opts in
    assert loss.gamma_history.shape == (3, 5)
    prediction = trainer.predict(Texts(48, 1))  # predict() does not update AdaFocal
    assert loss.gamma_history.shape == (3, 5)
    logits, labels = torch.as_tensor(prediction.predictions), torch.as_tensor(prediction.label_ids)
    assert (
        abs(result["eval_ece"] - float(F.expected_calibration_error(logits, labels, from_logits=True))) < 1e-6
    )
    assert (
        abs(result["eval_adaece"] - float(F.adaptive_calibration_error(logits, labels, from_logits=True)))
        < 1e-6
    )
    assert abs(result["eval_nll"] - float(torch.nn.functional.cross_entropy(logits, labels))) < 1e-5
    # the last update came from these logits: replay it from the γ before
    replay = AdaFocalLoss(n_bins=5)
    replay.gamma_per_bin.copy_(loss.gamma_history[1])
    replay.update(logits, labels, from_logits=True)
    torch.testing.assert_close(replay.gamma_per_bin, loss.gamma_history[2])
    # the eval loss is the AdaFocal loss (with the γ it had before the update of this evaluation)
    assert result["eval_loss"] > 0


def test_token_metrics_and_bad_arguments(tmp_path):
    torch.manual_seed(0)
    model = BertForTokenClassification(BertConfig(num_labels=3, **CONFIG))
    trainer = CalibrationTrainer(
        model=model, args=args(tmp_path, num_train_epochs=1), train_dataset=Texts(32, 0, tokens=True),
        eval_dataset=Texts(16, 1, tokens=True), calibration_loss=create("fcl", gamma=2.0, lambda_=0.5),
        compute_metrics=compute_metrics(num_classes=3, names="ece"),
    )  # fmt: skip
    trainer.train()
    prediction = trainer.predict(Texts(16, 1, tokens=True))
    logits = torch.as_tensor(prediction.predictions).reshape(-1, 3)
    labels = torch.as_tensor(prediction.label_ids).reshape(-1)
    keep = labels != -100
    expected = F.expected_calibration_error(logits[keep], labels[keep], from_logits=True)
    assert abs(prediction.metrics["test_ece"] - float(expected)) < 1e-6
    with pytest.raises(ValueError, match="either calibration_loss or compute_loss_func"):
        CalibrationTrainer(model=model, args=args(tmp_path), calibration_loss=create("ce"),
                           compute_loss_func=lambda *a, **k: 0)  # fmt: skip
    with pytest.raises(ValueError, match="unknown metrics"):
        compute_metrics(3, names=("ece", "ace"))


class LabelSets(torch.utils.data.Dataset):
    """Multi-label texts: label j is bit j of the first token (learnable); ``unknown`` of the labels -100."""

    def __init__(self, n, seed, unknown=0.0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(8, 40, (n, 10), generator=g)
        self.ids[:, 0] = torch.randint(0, 8, (n,), generator=g)
        self.labels = torch.stack([(self.ids[:, 0] >> j) & 1 for j in range(3)], dim=1).float()
        self.labels[torch.rand(n, 3, generator=g) < unknown] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def test_multilabel_model_loss_and_metrics_with_unknown_labels(tmp_path):
    """A problem_type="multi_label_classification" BERT trained with a sigmoid focal loss; the evaluation
    set marks 20 % of its labels unknown (-100): the loss and the metrics leave them out label by label."""
    torch.manual_seed(0)
    model = BertForSequenceClassification(
        BertConfig(num_labels=3, problem_type="multi_label_classification", **CONFIG)
    )
    names = ("ece", "ece_micro", "adaece", "nll", "brier", "auroc")
    trainer = CalibrationTrainer(
        model=model, args=args(tmp_path), train_dataset=LabelSets(96, 0), eval_dataset=LabelSets(64, 1, 0.2),
        calibration_loss=create("binary-fl-2"), compute_metrics=compute_metrics(3, names, task="multilabel"),
    )  # fmt: skip
    trainer.train()
    result = trainer.evaluate()
    prediction = trainer.predict(LabelSets(64, 1, 0.2))
    z, y = torch.as_tensor(prediction.predictions).double(), torch.as_tensor(prediction.label_ids)
    known = y != -100
    p = torch.sigmoid(z)

    def per_label(fn):
        return torch.stack([fn(p[known[:, j], j], y[known[:, j], j]) for j in range(3)])

    expected = {
        "ece": per_label(F.multilabel_ece).mean(),
        "ece_micro": F.multilabel_ece(p[known], y[known]),
        "adaece": per_label(F.multilabel_adaece).mean(),
        "nll": per_label(F.multilabel_nll).mean(),
        "brier": per_label(F.multilabel_brier_score).mean(),
        "auroc": per_label(F.multilabel_auroc).mean(),
    }
    for name, value in expected.items():  # float32 logits from the Trainer, float64 arithmetic on both sides
        assert abs(result[f"eval_{name}"] - float(value)) < 1e-6, name
    # eval_loss is the training loss (binary focal, γ = 2) over each batch's known labels, not cross entropy;
    # the Trainer averages the 4 equal batches' losses (float32 logits: agreement to ~1e-7)
    focal = [
        F.binary_focal_loss(z[i : i + 16][known[i : i + 16]], y[i : i + 16][known[i : i + 16]], gamma=2.0)
        for i in range(0, 64, 16)
    ]
    assert abs(prediction.metrics["test_loss"] - float(torch.stack(focal).mean())) < 1e-6
    # the loss of one batch, alone and as the Trainer calls it under gradient accumulation (its item count is
    # the labels other than -100, over the whole accumulated step)
    data = LabelSets(16, 3, 0.3)
    ids, labels = torch.stack([data[i]["input_ids"] for i in range(16)]), data.labels
    outputs = model.eval()(input_ids=ids.to(model.device))
    z16, known16 = outputs.logits.detach().cpu().double(), labels != -100
    expected = F.binary_cross_entropy(z16[known16], labels[known16].double())
    compute_loss = loss_func(create("bce"))
    torch.testing.assert_close(
        compute_loss(outputs, labels.to(model.device)).double().cpu(), expected, rtol=1e-5, atol=0
    )
    step_items = torch.tensor(int(known16.sum()) * 2)  # this batch is half of the step's labels
    torch.testing.assert_close(
        compute_loss(outputs, labels.to(model.device), num_items_in_batch=step_items).double().cpu(), expected / 2,
        rtol=1e-5, atol=0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="unknown metrics"):
        compute_metrics(3, ("ece", "auroc_micro"), task="multilabel")
    with pytest.raises(ValueError, match="`task` must be one of"):
        compute_metrics(3, task="multi-label")


def test_trainer_updates_cals_from_the_evaluation_logits(tmp_path):
    """CALS's multipliers follow each scheduled evaluation's logits (the released code's validation pass):
    an opted-in evaluation's update equals CALSLoss.update on the predicted logits from the state before."""
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_labels=3, **CONFIG))
    loss = CALSLoss(margin=2.0)
    trainer = CalibrationTrainer(
        model=model, args=args(tmp_path), train_dataset=Texts(96, 0), eval_dataset=Texts(48, 1),
        calibration_loss=loss, compute_metrics=compute_metrics(num_classes=3, names="ece"),
    )  # fmt: skip
    trainer.train()
    assert int(loss.updates) == 2
    before = {k: v.clone() for k, v in loss.state_dict().items()}
    trainer.evaluate()  # outside train(): no update
    assert int(loss.updates) == 2
    trainer.evaluate(update_calibration_loss=True)
    prediction = trainer.predict(Texts(48, 1))
    replay = CALSLoss(margin=2.0)
    replay.load_state_dict(before)
    replay.update(torch.as_tensor(prediction.predictions), torch.as_tensor(prediction.label_ids))
    torch.testing.assert_close(loss.lambdas, replay.lambdas, rtol=1e-5, atol=1e-12)
    assert int(loss.updates) == 3


def _adafocal_run(output_dir, epochs=3):
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_labels=3, **CONFIG))
    loss = AdaFocalLoss(n_bins=4)
    trainer = CalibrationTrainer(
        model=model, args=args(output_dir, num_train_epochs=epochs, save_strategy="epoch"),
        train_dataset=Texts(32, 0), eval_dataset=Texts(16, 1), calibration_loss=loss,
        compute_metrics=compute_metrics(num_classes=3, names=("ece",)),
    )  # fmt: skip
    return trainer, loss


def test_resumed_training_restores_the_calibration_loss(tmp_path):
    # 32 samples in batches of 8: 4 steps per epoch, a checkpoint and an AdaFocal update after each epoch
    full, full_loss = _adafocal_run(tmp_path / "full")
    full.train()
    assert full_loss.gamma_history.shape == (3, 4)
    # resumed after epoch 2 with a fresh loss: it continues from the checkpoint's γ, so the third epoch's
    # steps and update are the uninterrupted run's. On CPU the same operations run in the same order on the
    # same data (the Trainer restores the data order and RNG), so the results are equal, not merely close.
    resumed, resumed_loss = _adafocal_run(tmp_path / "full")
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-8"))
    for name, value in full_loss.state_dict().items():
        torch.testing.assert_close(resumed_loss.state_dict()[name], value, rtol=0, atol=0, msg=name)
    for (name, a), b in zip(resumed.model.named_parameters(), full.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    for step in (4, 8, 12):
        folder = tmp_path / "full" / f"checkpoint-{step}"
        saved = torch.load(folder / "calibration_loss.pt", weights_only=True)
        torch.testing.assert_close(
            saved["gamma_history"], full_loss.gamma_history[: step // 4], rtol=0, atol=0
        )
        assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]  # renamed into place
    # resume_from_checkpoint=True: the last checkpoint (epoch 3, nothing left to train)
    latest, latest_loss = _adafocal_run(tmp_path / "full")
    latest.train(resume_from_checkpoint=True)
    torch.testing.assert_close(latest_loss.gamma_per_bin, full_loss.gamma_per_bin, rtol=0, atol=0)
    # a checkpoint without the loss's state cannot resume a loss that has one
    (tmp_path / "full" / "checkpoint-8" / "calibration_loss.pt").unlink()
    again, _ = _adafocal_run(tmp_path / "full")
    with pytest.raises(FileNotFoundError, match="calibration_loss.pt"):
        again.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-8"))


def test_trainer_updates_the_loss_without_compute_metrics(tmp_path):
    """The Trainer keeps the evaluation logits only for compute_metrics; the scheduled evaluations that update
    the loss keep them anyway, so AdaFocal adapts without metrics (it stayed at γ = 1, FL-1, before)."""
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_labels=3, **CONFIG))
    loss = AdaFocalLoss(n_bins=5)
    trainer = CalibrationTrainer(
        model=model, args=args(tmp_path), train_dataset=Texts(96, 0), eval_dataset=Texts(48, 1),
        calibration_loss=loss,
    )  # fmt: skip
    trainer.train()
    assert loss.gamma_history.shape == (2, 5)
    # the last update came from the final model's evaluation logits: replay it from the γ before
    prediction = trainer.predict(Texts(48, 1))
    replay = AdaFocalLoss(n_bins=5)
    replay.gamma_per_bin.copy_(loss.gamma_history[0])
    replay.update(
        torch.as_tensor(prediction.predictions), torch.as_tensor(prediction.label_ids), from_logits=True
    )
    torch.testing.assert_close(replay.gamma_per_bin, loss.gamma_history[1], rtol=0, atol=0)


def test_eval_on_start_does_not_update_the_loss(tmp_path):
    """eval_on_start's evaluation of the untrained model is a sanity check (Lightning's is skipped too): the
    first epoch trains with γ = 1 and each epoch's evaluation updates once, as without it."""
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_labels=3, **CONFIG))
    loss = AdaFocalLoss(n_bins=5)
    trainer = CalibrationTrainer(
        model=model, args=args(tmp_path, eval_on_start=True), train_dataset=Texts(96, 0),
        eval_dataset=Texts(48, 1), calibration_loss=loss, compute_metrics=compute_metrics(3, names="ece"),
    )  # fmt: skip
    trainer.train()
    assert loss.gamma_history.shape == (2, 5)


class _Scheduled(torch.nn.Module):
    """FLS (γ 5, 3, 1 from epochs 0, 1, 2), MbLS with α + 0.1 after each epoch and MaxSup's ramp, summed;
    records the schedules in force at each training step."""

    def __init__(self):
        super().__init__()
        self.fls = ScheduledFocalLoss(gammas=(5.0, 3.0, 1.0), milestones=(1, 2))
        self.mbls = LogitMarginL1Loss(margin=1.0, schedule="add", mu=0.1)
        self.maxsup = MaxSupLoss()
        self.seen = []

    @property
    def reduction(self):
        return self.fls.reduction

    @reduction.setter
    def reduction(self, value):
        for module in (self.fls, self.mbls, self.maxsup):
            module.reduction = value

    def forward(self, logits, targets):
        if torch.is_grad_enabled():
            self.seen.append((self.fls.gamma, self.mbls.current_alpha, self.maxsup.current_alpha))
        return self.fls(logits, targets) + self.mbls(logits, targets) + self.maxsup(logits, targets)


def _scheduled_run(output_dir, resume=None):
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_labels=3, **CONFIG))
    loss = _Scheduled()
    trainer = CalibrationTrainer(
        model=model, args=args(output_dir, num_train_epochs=3, save_strategy="epoch"),
        train_dataset=Texts(32, 0), eval_dataset=Texts(16, 1), calibration_loss=loss,
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    return trainer, loss


def test_trainer_gives_scheduled_losses_the_epoch(tmp_path):
    """The steps of epoch e (0-based) train with FLS's γ of epoch e, MbLS's α after e updates and MaxSup's
    α_e = 0.1 + 0.1·e/(E − 1) with E = num_train_epochs (they stayed at 5, 0.1 and 0.1 before); a run
    resumed after epoch 1 continues the schedules."""
    full, loss = _scheduled_run(tmp_path / "full")
    expected = [((5.0, 3.0, 1.0)[e], 0.1 + 0.1 * e, 0.1 + 0.05 * e) for e in range(3) for _ in range(4)]
    assert len(loss.seen) == len(expected)
    for got, want in zip(loss.seen, expected):
        # (MbLS adds 0.1 in floating point: 0.1 + 0.1 + 0.1 differs from 0.3 in the last bit)
        assert got[0] == want[0] and abs(got[1] - want[1]) < 1e-12 and abs(got[2] - want[2]) < 1e-12
    resumed, resumed_loss = _scheduled_run(tmp_path / "full", resume=str(tmp_path / "full" / "checkpoint-4"))
    assert resumed_loss.seen == loss.seen[4:]
    for (name, a), b in zip(resumed.model.named_parameters(), full.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
