"""The metrics of the papers' ablations: the root Brier score (Dual Focal App. G) one-shot and streamed,
against plain-Python float64 references and hand computations."""

import math

import pytest
import torch

import torchcal.functional as F
from tests.reference import metrics as R
from torchcal.metrics import CalibrationMetrics


def make(n=300, k=6, seed=0, sharpness=4.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = sharpness * torch.randn(n, k, generator=g, dtype=dtype)
    return torch.softmax(logits, 1), torch.randint(0, k, (n,), generator=g), logits


@pytest.mark.parametrize("k", [2, 6, 100])
def test_rbs_matches_float64_reference(k):
    probs, targets, _ = make(257, k, seed=k)
    want = math.sqrt(R.brier(probs, targets))
    # float64 sums over 257·k terms against a Python loop: a few ulps of accumulated rounding
    assert F.root_brier_score(probs, targets).item() == pytest.approx(want, rel=1e-12)
    assert F.rbs is F.root_brier_score


def test_rbs_by_hand_and_edges():
    # Brier = ((0.25² + 0.25²) + (0.5² + 0.5²)) / 2 = 0.3125
    probs = torch.tensor([[0.75, 0.25], [0.5, 0.5]], dtype=torch.float64)
    assert F.rbs(probs, torch.tensor([0, 1])).item() == pytest.approx(math.sqrt(0.3125), rel=1e-15)
    # perfect predictions: 0, never the NaN of a square root of a sum that rounded below 0
    perfect = torch.eye(4, dtype=torch.float64)
    assert F.rbs(perfect, torch.arange(4)).item() == 0.0
    # the worst: every sample sure of a wrong class, Brier 2
    assert F.rbs(perfect, torch.tensor([1, 0, 3, 2])).item() == pytest.approx(math.sqrt(2), rel=1e-15)
    # logits and ignored labels as every metric
    probs, targets, logits = make(50, 4, seed=3)
    torch.testing.assert_close(F.rbs(logits, targets, from_logits=True), F.rbs(probs, targets))
    t = targets.clone()
    t[:5] = -100
    torch.testing.assert_close(F.rbs(probs, t, ignore_index=-100), F.rbs(probs[5:], targets[5:]))


@pytest.mark.parametrize("batch", [1, 7, 300])
@pytest.mark.parametrize("equal_mass", [True, False])
def test_rbs_streams_from_the_brier_sums(batch, equal_mass):
    probs, targets, _ = make(300, 5, seed=batch, dtype=torch.float32)
    m = CalibrationMetrics(num_classes=5, equal_mass=equal_mass)
    for i in range(0, 300, batch):
        m.update(probs[i : i + batch], targets[i : i + batch])
    out = m.compute()
    # the streamed value is the square root of the streamed Brier score (same float64 sums)
    assert out["rbs"].item() == math.sqrt(out["brier"].item())
    assert out["rbs"].item() == pytest.approx(math.sqrt(R.brier(probs, targets)), rel=1e-6)  # float32 probs
    assert set(m.compute("rbs")) == {"rbs"}
