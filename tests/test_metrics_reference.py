"""Fast metrics against the slow float64 references, over shapes, dtypes and bin counts."""

import math

import pytest
import torch

import torchcal.functional as F
from tests.conftest import make_probs
from tests.reference import metrics as R

# every test here runs on the C++ CPU operators and on the torch path
pytestmark = pytest.mark.usefixtures("cpu_backend")

SHAPES = [(1, 2), (7, 2), (50, 3), (200, 10), (333, 7)]
BINS = [1, 2, 10, 15]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("n_bins", BINS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_binned_metrics_match_reference(n, k, n_bins, dtype):
    probs, targets = make_probs(n, k, seed=n * k + n_bins, dtype=dtype)
    tol = dict(rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-6)
    kw = dict(n_bins=n_bins)
    torch.testing.assert_close(F.ece(probs, targets, **kw).item(), R.ece(probs, targets, n_bins), **tol)
    torch.testing.assert_close(F.mce(probs, targets, **kw).item(), R.mce(probs, targets, n_bins), **tol)
    torch.testing.assert_close(F.adaece(probs, targets, **kw).item(), R.adaece(probs, targets, n_bins), **tol)
    torch.testing.assert_close(
        F.classwise_ece(probs, targets, **kw).item(), R.classwise(probs, targets, n_bins), **tol
    )
    torch.testing.assert_close(
        F.debiased_ece(probs, targets, **kw).item(), R.debiased(probs, targets, n_bins), **tol
    )


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_scores_match_reference(n, k, dtype):
    probs, targets = make_probs(n, k, seed=3 * n + k, dtype=dtype)
    tol = dict(rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=1e-6 if dtype == torch.float32 else 1e-12)
    tiny = torch.finfo(dtype).tiny
    torch.testing.assert_close(F.nll(probs, targets).item(), R.nll(probs, targets, tiny), **tol)
    torch.testing.assert_close(F.brier(probs, targets).item(), R.brier(probs, targets), **tol)
    assert F.error_rate(probs, targets).item() == pytest.approx(R.error(probs, targets), abs=1e-12)
    frac, acc = F.confidence_at_least(probs, targets, threshold=0.9)
    ref_frac, ref_acc = R.s99(probs, targets, 0.9)
    assert frac.item() == pytest.approx(ref_frac, abs=1e-12)
    assert (math.isnan(acc.item()) and math.isnan(ref_acc)) or acc.item() == pytest.approx(ref_acc, abs=1e-12)


@pytest.mark.parametrize("n,k,seed", [(2, 2, 0), (9, 3, 1), (60, 4, 2), (200, 3, 3), (157, 10, 4)])
@pytest.mark.parametrize("p", [1, 2])
def test_ece_sweep_matches_reference(n, k, seed, p):
    probs, targets = make_probs(n, k, seed=seed)
    value, b = F.ece_sweep(probs, targets, p=p, return_n_bins=True)
    ref_value, ref_b = R.sweep(probs, targets, p=p)
    assert b == ref_b
    assert value.item() == pytest.approx(ref_value, abs=1e-12)


@pytest.mark.parametrize("n,k,h", [(2, 2, 0.5), (12, 3, 0.1), (30, 4, 0.02), (25, 2, 1.0)])
def test_kde_ece_matches_reference(n, k, h):
    probs, targets = make_probs(n, k, seed=n + k)
    got = F.kde_ece(probs, targets, bandwidth=h, chunk_size=7)
    assert got.item() == pytest.approx(R.kde_canonical(probs, targets, h), abs=1e-10)


def test_kde_auto_bandwidth_maximises_loo_likelihood():
    from torchcal.functional.calibration import _KDE_BANDWIDTHS

    probs, targets = make_probs(40, 3, seed=5)
    auto = F.kde_ece(probs, targets)
    candidates = [F.kde_ece(probs, targets, bandwidth=h) for h in _KDE_BANDWIDTHS]
    assert any(torch.isclose(auto, c, rtol=0, atol=1e-14) for c in candidates)


@pytest.mark.parametrize("score", ["entropy", "max_prob"])
def test_ood_auroc_matches_pair_counting(score):
    p_in, _ = make_probs(40, 5, seed=1, sharpness=4)
    p_out, _ = make_probs(30, 5, seed=2, sharpness=1)
    p_out[:5] = p_in[:5]  # exact ties between groups
    if score == "entropy":
        s_in = [R.entropy(r) for r in p_in.tolist()]
        s_out = [R.entropy(r) for r in p_out.tolist()]
    else:
        s_in = [-max(r) for r in p_in.tolist()]
        s_out = [-max(r) for r in p_out.tolist()]
    got = F.ood_auroc(p_in, p_out, score=score)
    assert got.item() == pytest.approx(R.auroc(s_in, s_out), abs=1e-12)


def test_from_logits_equals_softmax_first():
    g = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(100, 6, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 6, (100,), generator=g)
    probs = torch.softmax(logits, 1)
    for fn in (
        F.ece,
        F.adaece,
        F.classwise_ece,
        F.mce,
        F.nll,
        F.brier,
        F.error_rate,
        F.smece,
        F.debiased_ece,
        F.ece_sweep,
    ):
        torch.testing.assert_close(
            fn(logits, targets, from_logits=True), fn(probs, targets), rtol=0, atol=1e-12
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_are_accepted_and_close(dtype):
    probs, targets = make_probs(500, 10, seed=7, dtype=torch.float64)
    low = probs.to(dtype)
    # the metric sees exactly the rounded probabilities, upcast to float32
    expected = R.ece(low.double(), targets, 15)
    assert F.ece(low, targets).item() == pytest.approx(expected, abs=1e-6)
