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
from torchcal.losses import AdaFocalLoss, create  # noqa: E402

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
    assert loss.gamma_history.shape == (2, 5)  # one update per evaluation (epoch)
    result = trainer.evaluate()
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
