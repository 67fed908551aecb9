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


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("p", [1, 2])
def test_equal_width_sweep_matches_float64_reference(seed, p):
    from tests.reference import ablations as A

    probs, targets, _ = make(200, 4, seed=seed, sharpness=1.5 + seed)
    value, b = F.ece_sweep(probs, targets, p=p, binning="equal_width", return_n_bins=True)
    want, want_b = A.sweep_equal_width(probs, targets, p)
    assert b == want_b
    # float64 bin sums against Python sums over 200 values: ~1e-15 relative
    assert value.item() == pytest.approx(want, rel=1e-12)
    # the equal-mass sweep is unchanged and stays the default
    torch.testing.assert_close(
        F.ece_sweep(probs, targets, p=p), F.ece_sweep(probs, targets, p=p, binning="equal_mass")
    )


def test_equal_width_sweep_by_hand_and_edges():
    # confidences 0.9 (right), 0.6 (wrong), 0.7 (right), 0.8 (wrong): b = 2, 3, 4 are monotone, the sweep
    # stops at b = N = 4 with bins (.5, .75] (0.6, 0.7; acc .5, conf .65) and (.75, 1] (0.8, 0.9; .5, .85)
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.2, 0.8]], dtype=torch.float64)
    value, b = F.ece_sweep(probs, torch.tensor([0, 1, 1, 0]), binning="equal_width", return_n_bins=True)
    assert b == 4 and value.item() == pytest.approx(0.5 * 0.15 + 0.5 * 0.35, rel=1e-12)
    # correctness that never decreases with confidence: monotone for every b, so b = N
    probs = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1]], dtype=torch.float64)
    assert F.ece_sweep(probs, torch.tensor([1, 0, 0]), binning="equal_width", return_n_bins=True)[1] == 3
    with pytest.raises(ValueError, match="`binning` must be one of"):
        F.ece_sweep(probs, torch.tensor([1, 0, 0]), binning="quantile")
