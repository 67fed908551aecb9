"""The focal calibration map: reference formula, identity at 0, extreme inputs, argmax preservation."""

import numpy as np
import pytest
import torch

from tests.conftest import make_probs
from tests.reference import metrics as R
from torchcal.functional import focal_calibration_map


@pytest.mark.parametrize("gamma", [-0.9, -0.5, -0.25, 0.05, 0.37, 1.0, 3.0, 5.0, 20.0])
def test_matches_reference_formula(gamma):
    probs, _ = make_probs(60, 5, seed=int(abs(gamma) * 100), sharpness=2)
    got = focal_calibration_map(probs, gamma)
    expected = torch.tensor([R.focal_map(row, gamma) for row in probs.tolist()], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-13)


def test_identity_at_zero_and_from_logits():
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(20, 4, generator=g, dtype=torch.float64)
    probs = torch.softmax(logits, 1)
    torch.testing.assert_close(focal_calibration_map(probs, 0.0), probs, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(
        focal_calibration_map(logits, 2.0, from_logits=True), focal_calibration_map(probs, 2.0)
    )


@pytest.mark.parametrize("gamma", [-0.5, 0.5, 5.0])
def test_top_probability_rounding_to_one_stays_finite_and_accurate(gamma):
    logits = torch.tensor([[30.0, 0.0, 0.0], [100.0, 0.0, -5.0], [1e4, 0.0, 0.0]])
    probs = torch.softmax(logits, 1)  # float32: the top entries round to 1.0
    assert (probs[:, 0] == 1.0).all()
    out = focal_calibration_map(logits, gamma, from_logits=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.sum(1), torch.ones(3))
    # float64 reference of the first row (1 - q = 2 e^-30, exactly representable in float64 arithmetic)
    ref = R.focal_map(torch.softmax(logits[:1].double(), 1)[0].tolist(), gamma)
    np.testing.assert_allclose(out[0].double().numpy(), ref, rtol=1e-5, atol=1e-30)


def test_one_hot_rows_map_to_themselves():
    probs = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    for gamma in (-0.5, 0.0, 3.0):
        torch.testing.assert_close(focal_calibration_map(probs, gamma), probs)


@pytest.mark.parametrize("gamma", [-0.99, -0.5, 0.05, 1.0, 5.0, 20.0])
def test_preserves_the_argmax(gamma):
    probs, _ = make_probs(5000, 10, seed=1, sharpness=3)
    assert torch.equal(focal_calibration_map(probs, gamma).argmax(1), probs.argmax(1))
    # and on the two-class simplex densely, where h(q) vs h(1 - q) decides
    q = torch.linspace(0.5001, 1 - 1e-9, 10_000, dtype=torch.float64)
    two = torch.stack([q, 1 - q], 1)
    assert (focal_calibration_map(two, gamma)[:, 0] >= 0.5).all()
