"""Top-label metrics from logits without the softmax matrix (issue 14): the same values, errors and
conventions as the probability path, on the C++ operator and on torch."""

import math

import pytest
import torch

import torchcal.functional as F
from tests.reference import metrics as R

TOP_LABEL = {
    "ece": F.ece,
    "mce": F.mce,
    "adaece": F.adaece,
    "smece": F.smece,
    "debiased_ece": F.debiased_ece,
    "ece_sweep": F.ece_sweep,
    "error_rate": F.error_rate,
}


def logits_and_targets(n, k, scale=3.0, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(n, k, generator=g, dtype=torch.float64)).to(dtype)
    targets = torch.multinomial(torch.softmax(logits.double() / 2, 1), 1, generator=g).squeeze(1)
    return logits, targets


@pytest.mark.parametrize("name", sorted(TOP_LABEL))
@pytest.mark.parametrize("n,k", [(1, 2), (257, 2), (1000, 10), (300, 33), (200, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logits_path_equals_the_probability_path(name, n, k, dtype, cpu_backend):
    logits, targets = logits_and_targets(n, k, dtype=dtype, seed=n + k)
    fn = TOP_LABEL[name]
    from_logits = fn(logits, targets, from_logits=True)
    from_probs = fn(torch.softmax(logits.double(), 1), targets)  # float64 softmax: the exact values
    # the top-label confidence 1/Σexp(z − max) and the softmax maximum agree to the input's rounding
    tol = 2e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(from_logits, from_probs, rtol=tol, atol=tol)


@pytest.mark.parametrize("n_bins", [1, 15, 40])
def test_logits_ece_against_the_float64_reference(n_bins, cpu_backend):
    logits, targets = logits_and_targets(2000, 7, scale=4.0, dtype=torch.float64)
    expected = R.ece(torch.softmax(logits, 1), targets, n_bins=n_bins)
    assert F.ece(logits, targets, from_logits=True, n_bins=n_bins).item() == pytest.approx(
        expected, abs=1e-12
    )


def test_ties_in_the_maximum_predict_the_lowest_class(cpu_backend):
    logits = torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0], [0.0, 5.0, 5.0], [4.0, 1.0, 4.0]])
    targets = torch.tensor([1, 0, 2, 2])  # correct, correct, wrong (predicts 1), wrong (predicts 0)
    assert F.error_rate(logits, targets, from_logits=True).item() == pytest.approx(0.5)
    assert F.error_rate(torch.softmax(logits, 1), targets).item() == pytest.approx(0.5)


def test_extreme_logits_give_confidence_one_and_finite_values(cpu_backend):
    logits = torch.tensor([[1e4, -1e4, 0.0], [-1e4, 1e4, 1e4 - 1.0]], dtype=torch.float32)
    targets = torch.tensor([0, 1])
    value = F.ece(logits, targets, from_logits=True)
    probs = torch.softmax(logits.double(), 1)
    assert math.isfinite(value.item()) and value.item() == pytest.approx(
        F.ece(probs, targets).item(), abs=1e-6
    )


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_logits_are_refused_on_both_paths(bad, cpu_backend):
    logits, targets = logits_and_targets(100, 5)
    logits[37, 2] = bad
    for fn in (F.ece, F.adaece, F.error_rate):
        with pytest.raises(ValueError, match="contains NaN or infinite values"):
            fn(logits, targets, from_logits=True)


def test_labels_out_of_range_are_named(cpu_backend):
    logits, targets = logits_and_targets(50, 4)
    targets[11] = 9
    with pytest.raises(ValueError, match=r"`targets` must lie in \[0, 4\), found label 9"):
        F.ece(logits, targets, from_logits=True)


def test_half_precision_logits(cpu_backend):
    logits, targets = logits_and_targets(500, 10)
    value = F.ece(logits.half(), targets, from_logits=True)
    expected = F.ece(torch.softmax(logits.half().float(), 1), targets)
    torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-6)


def test_no_softmax_matrix_is_built(monkeypatch, cpp_extension):
    """The C++ path computes the confidence from the row maximum and exp-sum: torch.softmax never runs."""
    logits, targets = logits_and_targets(300, 10)
    expected = F.ece(torch.softmax(logits, 1), targets)

    def forbidden(*args, **kwargs):
        raise AssertionError("the softmax matrix was built")

    monkeypatch.setattr(torch, "softmax", forbidden)
    monkeypatch.setattr(torch.Tensor, "softmax", forbidden)
    with F.use_cpu_extension(True):
        for fn in (F.ece, F.mce, F.adaece, F.error_rate):
            fn(logits, targets, from_logits=True)
        torch.testing.assert_close(F.ece(logits, targets, from_logits=True), expected, rtol=2e-6, atol=2e-6)
