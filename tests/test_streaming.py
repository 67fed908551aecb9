"""CalibrationMetrics: k updates equal the one-shot functions; merge; sync over torch.distributed (gloo)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torchcal.functional as F
from tests.conftest import free_port, make_probs
from torchcal.metrics import CalibrationMetrics

# every test here runs on the C++ CPU operators and on the torch path
pytestmark = pytest.mark.usefixtures("cpu_backend")

ONE_SHOT = {
    "ece": F.ece,
    "mce": F.mce,
    "classwise_ece": F.classwise_ece,
    "nll": F.nll,
    "brier": F.brier,
    "rbs": F.rbs,
    "error": F.error_rate,
    "adaece": F.adaece,
    "debiased_ece": F.debiased_ece,
    "ece_sweep": F.ece_sweep,
    "smece": F.smece,
}


def one_shot(probs, targets, n_bins):
    out = {}
    for name, fn in ONE_SHOT.items():
        kw = {"n_bins": n_bins} if name in ("ece", "mce", "classwise_ece", "adaece", "debiased_ece") else {}
        out[name] = fn(probs, targets, **kw)
    frac, acc = F.confidence_at_least(probs, targets)
    out["s99_fraction"], out["s99_accuracy"] = frac, acc
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("batch", [1, 7, 64, 1000])
def test_streamed_equals_one_shot(dtype, batch):
    probs, targets = make_probs(300, 6, seed=batch, sharpness=6, dtype=dtype)
    m = CalibrationMetrics(num_classes=6, n_bins=10)
    for i in range(0, 300, batch):
        m.update(probs[i : i + batch], targets[i : i + batch])
    expected = one_shot(probs, targets, 10)
    got = m.compute(tuple(expected))  # (the metrics of SPEC §9: tests/test_streaming_field.py)
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-12, equal_nan=True, msg=name)
    assert m.num_samples == 300


def test_from_logits_and_reset():
    g = torch.Generator().manual_seed(1)
    logits, targets = 3 * torch.randn(100, 4, generator=g), torch.randint(0, 4, (100,), generator=g)
    m = CalibrationMetrics(4, from_logits=True)
    m.update(logits, targets)
    torch.testing.assert_close(m.compute()["ece"], F.ece(logits, targets, from_logits=True))
    m.reset()
    m.update(logits[:10], targets[:10])
    torch.testing.assert_close(m.compute()["ece"], F.ece(logits[:10], targets[:10], from_logits=True))


def test_merge_equals_single_accumulator():
    probs, targets = make_probs(200, 5, seed=3)
    a, b, whole = CalibrationMetrics(5), CalibrationMetrics(5), CalibrationMetrics(5)
    a.update(probs[:120], targets[:120])
    b.update(probs[120:], targets[120:])
    whole.update(probs, targets)
    merged = a.merge(b).compute()
    for name, value in whole.compute().items():
        torch.testing.assert_close(merged[name], value, rtol=0, atol=1e-12, equal_nan=True)


def test_without_equal_mass_state():
    probs, targets = make_probs(50, 3)
    m = CalibrationMetrics(3, equal_mass=False)
    m.update(probs, targets)
    assert "adaece" not in m.compute() and "ece" in m.compute()
    with pytest.raises(RuntimeError, match="equal_mass=False"):
        m.sorted_confidences()


def test_sync_without_distributed_is_a_no_op():
    probs, targets = make_probs(20, 3)
    m = CalibrationMetrics(3)
    m.update(probs, targets)
    before = m.compute()
    after = m.sync().compute()
    for k in before:
        torch.testing.assert_close(before[k], after[k], equal_nan=True)


def _worker(rank, world, port, path):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    probs, targets = make_probs(301, 4, seed=11)
    m = CalibrationMetrics(4)
    # uneven shards: rank r takes rows r, r + world, ...
    m.update(probs[rank::world], targets[rank::world])
    out = m.sync().compute()
    torch.save({k: v for k, v in out.items()}, f"{path}.{rank}")
    dist.destroy_process_group()


def test_sync_over_two_gloo_processes_equals_one_shot(tmp_path):
    world, path = 2, str(tmp_path / "out")
    mp.start_processes(_worker, args=(world, free_port(), path), nprocs=world, start_method="spawn")
    probs, targets = make_probs(301, 4, seed=11)
    expected = one_shot(probs, targets, 15)
    for rank in range(world):
        got = torch.load(f"{path}.{rank}", weights_only=True)
        for name, value in expected.items():
            # equal-mass estimators see the samples in another order: ties aside, the same sums
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-12, equal_nan=True, msg=name)


def test_compute_a_subset():
    probs, targets = make_probs(100, 4, seed=8)
    m = CalibrationMetrics(4)
    m.update(probs, targets)
    full = m.compute()
    part = m.compute(("ece", "smece"))
    assert set(part) == {"ece", "smece"}
    torch.testing.assert_close(part["smece"], full["smece"])
    with pytest.raises(ValueError, match="unknown metrics"):
        m.compute(("kde_ece",))
