"""Parameterized probability adjustment (PPA): the closed-form coefficient and the map against a float64 loop
reference (tests/reference/ppa.py) and a bounded scalar minimiser of the Brier score, a hand-computed case,
tied top classes, the identity on over-confident inputs, and the kept argmax."""

import math

import numpy as np
import pytest
import torch

from tests.reference.calibration_data import synthetic_logits
from tests.reference.ppa import ppa_fit, ppa_probs
from torchcal.calibrators import ParameterizedProbabilityAdjustment, create, from_json
from torchcal.calibrators.ppa import ppa_coefficient


def _underconfident(n, k, seed, dtype=torch.float64):
    """Logits divided by 10 after the over-confident generator's sharpening: too flat."""
    z, y = synthetic_logits(n, k, seed, dtype=dtype)
    return z / 10.0, y


def _brier(probs, y):
    onehot = torch.nn.functional.one_hot(y, probs.shape[1]).to(probs.dtype)
    return float((probs - onehot).square().sum(1).mean())


def test_hand_computed_case_with_a_tie():
    # rows p = (.5, .3, .2) y=0; (.4, .4, .2) y=1 (two top classes share t = (.5, .5, 0)); (.6, .3, .1) y=2
    # Σ a·d = −.38 − .06 + .24 = −.20 and Σ‖d‖² = .38 + .06 + .26 = .70, so r* = 2/7
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.4, 0.2], [0.6, 0.3, 0.1]], dtype=torch.float64)
    ppa = ParameterizedProbabilityAdjustment().fit(probs.log(), torch.tensor([0, 1, 2]))
    # the softmax of ln p returns p to a few ulps (the tie in row 2 survives: equal inputs, equal outputs)
    assert ppa.r_ == pytest.approx(2 / 7, abs=1e-14) and ppa.r_unconstrained_ == ppa.r_
    expected = torch.tensor(
        [[4.5 / 7, 1.5 / 7, 1 / 7], [(2 + 1) / 7, (2 + 1) / 7, 1 / 7], [(3 + 2) / 7, 1.5 / 7, 0.5 / 7]],
        dtype=torch.float64,
    )
    torch.testing.assert_close(ppa.transform(probs.log()), expected, rtol=0, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [2, 10])
def test_matches_the_loop_reference(k, dtype):
    z, y = _underconfident(600, k, seed=k)
    z = z.to(dtype)
    ppa = create("ppa").fit(z, y)
    r, r_star = ppa_fit(z.double().tolist(), y.tolist())
    assert 0 < r < 1  # an interior optimum: the flattened logits ask for sharpening, not for the identity
    # float32: the softmax and the tie test run in float32 (relative error ~1e-7 per probability) before the
    # float64 sums; float64: only the order of summation differs
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert ppa.r_ == pytest.approx(r, abs=tol) and ppa.r_unconstrained_ == pytest.approx(r_star, abs=tol)
    expected = torch.tensor(ppa_probs(z.double().tolist(), ppa.r_), dtype=torch.float64)
    torch.testing.assert_close(
        ppa.transform(z).double(), expected, rtol=0, atol=1e-6 if tol > 1e-6 else 1e-14
    )


def test_coefficient_minimises_the_brier_score():
    optimize = pytest.importorskip("scipy.optimize")
    z, y = _underconfident(2000, 7, seed=3)
    ppa = create("ppa").fit(z, y)
    probs = torch.softmax(z, 1)
    t = torch.zeros_like(probs).scatter_(1, probs.argmax(1, keepdim=True), 1.0)  # no ties in random data

    def brier(r):
        return _brier((1 - r) * probs + r * t, y)

    ref = optimize.minimize_scalar(brier, bounds=(0.0, 1.0), method="bounded", options={"xatol": 1e-12})
    # the Brier score is a quadratic in r: the bounded minimiser finds its vertex to its tolerance
    assert ppa.r_ == pytest.approx(ref.x, abs=1e-7)
    assert _brier(ppa.transform(z), y) <= brier(0.0) and _brier(ppa.transform(z), y) <= brier(1.0)


def test_over_confident_inputs_give_the_identity():
    z, y = synthetic_logits(3000, 10, seed=4, dtype=torch.float64)  # 2.5 times too sharp
    ppa = create("ppa").fit(z, y)
    assert ppa.r_unconstrained_ < 0 and ppa.r_ == 0.0
    assert torch.equal(ppa.transform(z), torch.softmax(z, 1))


def test_degenerate_inputs_uniform_rows_give_r_zero():
    z = torch.zeros(5, 4)  # uniform rows: t = p, d = 0
    ppa = create("ppa").fit(z, torch.tensor([0, 1, 2, 3, 0]))
    assert ppa.r_ == 0.0 and ppa.r_unconstrained_ == 0.0
    torch.testing.assert_close(ppa.transform(z), torch.full((5, 4), 0.25))


def test_all_correct_and_confident_gives_r_one():
    z = torch.tensor([[3.0, 0.0, 0.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    ppa = create("ppa").fit(z, torch.tensor([0, 1]))
    # every top class is right: a = −d row by row, so r* = 1 (to rounding) and the clip gives exactly 1
    assert ppa.r_unconstrained_ == pytest.approx(1.0, abs=1e-15) and ppa.r_ == 1.0
    assert torch.equal(
        ppa.transform(z), torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    )
    assert torch.isneginf(ppa.transform_logits(z)[0, 1:]).all()


@pytest.mark.parametrize("seed", range(5))
def test_the_unconstrained_coefficient_never_exceeds_one(seed):
    """r* = 1 − Σ (t − e_y)·d / Σ ‖d‖², and each row's (t − e_y)·(t − p) is 0 (y in A) or 1/|A| − p_max + p_y
    ≥ 0 (y not in A, as p_max ≤ 1/|A|): only the lower clip can act."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(300, 5, generator=g, dtype=torch.float64) * (seed + 1)
    z[:30, 1] = z[:30, 0]
    y = torch.randint(0, 5, (300,), generator=g)
    _, r_star = ppa_coefficient(torch.softmax(z, 1), y)
    assert r_star <= 1.0 + 1e-12


@pytest.mark.parametrize("r", [0.0, 0.3, 0.999, 1.0])
def test_the_argmax_set_is_kept(r):
    """(1 − r)·p_j ≤ (1 − r)·p_max < (1 − r)·p_max + r/|A|: every input top class stays a top class."""
    z, y = _underconfident(4000, 6, seed=5, dtype=torch.float32)
    z[:50, 1] = z[:50, 0]  # exact ties between the first two classes
    ppa = create("ppa").fit(z, y)
    ppa.r_ = r
    probs = ppa.transform(z)
    p = torch.softmax(z, 1)
    top_in = p == p.amax(1, keepdim=True)
    top_out = probs == probs.amax(1, keepdim=True)
    assert (top_out | ~top_in).all()  # each input top class has the highest output
    if r > 0:  # and only those: with r t ≥ 1e-3 no other class can round up to the top
        assert torch.equal(top_in, top_out)
    assert torch.equal(probs.argmax(1), p.argmax(1))


def test_ties_share_the_mass():
    z = torch.tensor([[1.0, 1.0, 0.0, 1.0]], dtype=torch.float64)
    ppa = create("ppa").fit(z, torch.tensor([0]))
    ppa.r_ = 0.5
    p = torch.softmax(z, 1)[0]
    expected = 0.5 * p + 0.5 * torch.tensor([1 / 3, 1 / 3, 0.0, 1 / 3], dtype=torch.float64)
    torch.testing.assert_close(ppa.transform(z)[0], expected, rtol=0, atol=1e-15)


def test_round_trip_and_the_coefficient_is_computed_on_the_input_device():
    z, y = _underconfident(500, 4, seed=6)
    ppa = create("ppa").fit(z, y)
    again = from_json(ppa.to_json())
    assert again.r_ == ppa.r_ and torch.equal(again.transform(z), ppa.transform(z))
    r, _ = ppa_coefficient(torch.softmax(z, 1), y)
    assert r == ppa.r_ and not math.isnan(r)
    assert np.isfinite(ppa.transform_logits(z).numpy()).all()
