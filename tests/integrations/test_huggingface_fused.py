"""The fused head in Hugging Face models (torchcal.integrations.huggingface.fused_loss and
FusedCalibrationTrainer): tiny randomly initialised Llama and BERT models built from a config."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `dev` extra installs it; CI runs these tests
from transformers import (  # noqa: E402
    BertConfig,
    BertForTokenClassification,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

from torchcal.integrations.huggingface import (  # noqa: E402
    FusedCalibrationTrainer,
    fused_loss,
    loss_func,
)
from torchcal.losses import AdaFocalLoss, FusedLinearLoss, create  # noqa: E402

VOCAB = 97


def tiny_llama(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    return LlamaForCausalLM(config).to(dtype)


class Sequences(torch.utils.data.Dataset):
    """Token sequences that count up modulo the vocabulary (learnable), the last 3 positions padded."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (start + torch.arange(12)) % VOCAB
        self.labels = self.ids.clone()
        self.labels[:, -3:] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def batch_of(data, n):
    return {k: torch.stack([data[i][k] for i in range(n)]) for k in ("input_ids", "labels")}


def shifted_unfused(loss):
    """The unfused loss of a causal LM's logits: position i against label i + 1 (HF's ForCausalLMLoss)."""
    base = loss_func(loss)

    def compute(outputs, labels, num_items_in_batch=None):
        labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        return base(outputs, labels, num_items_in_batch=num_items_in_batch)

    return compute


def grads_of(model, value):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(value, params)


@pytest.mark.parametrize("name", ["ce", "ls-0.1", "flsd-53", "dfl", "fcl", "adafocal"])
def test_causal_lm_fused_loss_equals_the_unfused_loss(name):
    # float64 model: fused and unfused differ by summation order only (1e-10 leaves orders of magnitude)
    model = tiny_llama(dtype=torch.float64)
    batch = batch_of(Sequences(4, 0), 4)
    loss = create(name)
    fused = fused_loss(model, batch, loss)
    outputs = model(input_ids=batch["input_ids"])
    unfused = shifted_unfused(loss)(outputs, batch["labels"])
    torch.testing.assert_close(fused, unfused, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads_of(model, fused), grads_of(model, unfused)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # the Trainer's token count: the batch's sum divided by it
    counted = fused_loss(model, batch, loss, num_items_in_batch=torch.tensor(17))
    total = fused_loss(model, batch, create(name, reduction="sum"))
    torch.testing.assert_close(counted, total / 17)


def test_the_logits_are_never_computed():
    model = tiny_llama()
    calls = []
    model.lm_head.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    batch = batch_of(Sequences(2, 0), 2)
    fused_loss(model, batch, create("flsd-53"))
    assert calls == [torch.Size([2, 12, 0])]  # the head's stand-in output: no class dimension
    assert "forward" not in vars(model.lm_head)  # the head is restored
    assert model(input_ids=batch["input_ids"]).logits.shape == (2, 12, VOCAB)


def test_token_classification_fused_loss():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=5)  # fmt: skip
    model = BertForTokenClassification(config).double().eval()  # eval: no dropout, the same forward twice
    ids = torch.randint(0, 40, (3, 10))
    labels = ids % 5
    labels[:, 8:] = -100
    loss = create("fl-3")
    fused = fused_loss(model, {"input_ids": ids, "labels": labels}, loss)
    unfused = loss_func(loss)(model(input_ids=ids), labels)  # no shift for token classification
    torch.testing.assert_close(fused, unfused, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads_of(model, fused), grads_of(model, unfused)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_models_that_transform_their_logits_are_refused():
    model = tiny_llama()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        fused_loss(model, batch_of(Sequences(2, 0), 2), create("ce"))
    with pytest.raises(TypeError, match="torch.nn.Linear"):
        fused_loss(tiny_llama(), batch_of(Sequences(2, 0), 2), create("ce"), head=torch.nn.Identity())
    with pytest.raises(ValueError, match="`labels`"):
        fused_loss(tiny_llama(), {"input_ids": torch.zeros(1, 3, dtype=torch.long)}, create("ce"))


def args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, per_device_eval_batch_size=16,
                num_train_epochs=2, learning_rate=1e-2, eval_strategy="no", save_strategy="no",
                logging_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)  # fmt: skip
    base.update(kw)
    return TrainingArguments(**base)


def test_fused_trainer_takes_the_unfused_trainers_steps(tmp_path):
    # the same model, data order and loss, fused and unfused: float32 parameters after 8 AdamW steps agree
    # to float32 rounding amplified by the steps (1e-4 absolute on parameters of order 0.1)
    model = tiny_llama()
    reference = copy.deepcopy(model)
    data = Sequences(32, 0)
    fused = FusedCalibrationTrainer(
        model=model,
        args=args(tmp_path / "fused"),
        train_dataset=data,
        calibration_loss="flsd-53",
        chunk_size=16,
    )
    fused.train()
    unfused = Trainer(
        model=reference, args=args(tmp_path / "unfused"), train_dataset=data,
        compute_loss_func=shifted_unfused(create("flsd-53")),
    )  # fmt: skip
    unfused.train()
    assert fused.state.global_step == unfused.state.global_step == 8
    moved = 0.0
    for (name, a), b, start in zip(
        model.named_parameters(), reference.parameters(), tiny_llama().parameters()
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=name)
        moved = max(moved, (a - start).abs().max().item())
    assert moved > 1e-2  # the models did train


def test_fused_trainer_updates_adafocal_from_shifted_logits(tmp_path):
    model = tiny_llama()
    loss = AdaFocalLoss(n_bins=4)
    trainer = FusedCalibrationTrainer(
        model=model, args=args(tmp_path, num_train_epochs=1, eval_strategy="epoch"), train_dataset=Sequences(32, 0),
        eval_dataset=Sequences(16, 1), calibration_loss=loss,
        compute_metrics=lambda prediction: {},  # the Trainer keeps the evaluation logits only with metrics
    )  # fmt: skip
    assert isinstance(trainer.fused_loss, FusedLinearLoss) and trainer.fused_loss.loss is loss
    trainer.train()
    assert loss.gamma_history.shape == (1, 4)
    before, edges_before = loss.gamma_per_bin.clone(), loss.bin_edges.clone()
    # CalibrationTrainer's rule: evaluate() outside train() leaves the loss as it is unless asked
    trainer.evaluate()
    trainer.evaluate(update_calibration_loss=False)
    assert loss.gamma_history.shape == (1, 4)
    torch.testing.assert_close(loss.gamma_per_bin, before, rtol=0, atol=0)
    result = trainer.evaluate(update_calibration_loss=True)
    prediction = trainer.predict(Sequences(16, 1))
    logits = torch.as_tensor(prediction.predictions)[:, :-1].reshape(-1, VOCAB)
    labels = torch.as_tensor(prediction.label_ids)[:, 1:].reshape(-1)
    keep = labels != -100
    replay = AdaFocalLoss(n_bins=4)
    replay.gamma_per_bin.copy_(before)
    replay.update(logits[keep], labels[keep], from_logits=True)
    torch.testing.assert_close(loss.gamma_per_bin, replay.gamma_per_bin)
    # the evaluation loss is the unfused AdaFocal loss on shifted labels (the state before this evaluation;
    # the 16 sequences are one evaluation batch)
    replay.gamma_per_bin.copy_(before)
    replay.bin_edges.copy_(edges_before)
    expected = replay(logits[keep], labels[keep])
    assert abs(result["eval_loss"] - expected.item()) < 1e-5


def test_fused_trainer_skips_the_update_of_an_evaluation_inside_train_when_asked(tmp_path):
    loss = AdaFocalLoss(n_bins=4)

    class NoUpdate(FusedCalibrationTrainer):
        def evaluate(self, *args, **kwargs):
            return super().evaluate(*args, update_calibration_loss=False, **kwargs)

    trainer = NoUpdate(
        model=tiny_llama(), args=args(tmp_path, num_train_epochs=1, eval_strategy="epoch"),
        train_dataset=Sequences(16, 0), eval_dataset=Sequences(16, 1), calibration_loss=loss,
        compute_metrics=lambda prediction: {},
    )  # fmt: skip
    trainer.train()
    assert loss.gamma_history.shape == (0, 4)


def _fused_adafocal_run(output_dir):
    loss = AdaFocalLoss(n_bins=4)
    trainer = FusedCalibrationTrainer(
        model=tiny_llama(), args=args(output_dir, eval_strategy="epoch", save_strategy="epoch"),
        train_dataset=Sequences(32, 0), eval_dataset=Sequences(16, 1), calibration_loss=loss, chunk_size=16,
        compute_metrics=lambda prediction: {},
    )  # fmt: skip
    return trainer, loss


def test_fused_trainer_resumes_the_calibration_loss(tmp_path):
    # 32 sequences in batches of 8: 4 steps per epoch, a checkpoint and an AdaFocal update after each epoch.
    # Resumed after epoch 1 with a fresh loss, the run continues from the checkpoint's γ: on CPU the same
    # operations run in the same order on the same data, so the results are equal, not merely close.
    full, full_loss = _fused_adafocal_run(tmp_path / "run")
    full.train()
    assert full_loss.gamma_history.shape == (2, 4)
    resumed, resumed_loss = _fused_adafocal_run(tmp_path / "run")
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    for name, value in full_loss.state_dict().items():
        torch.testing.assert_close(resumed_loss.state_dict()[name], value, rtol=0, atol=0, msg=name)
    for (name, a), b in zip(resumed.model.named_parameters(), full.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
