"""Bootstrap intervals: seeded, vectorised path equals evaluating the metric on each resample."""

import numpy as np
import pytest
import torch

import torchcal.functional as F
from tests.conftest import make_probs


def loop_bootstrap(metric, probs, targets, n_resamples, seed, **kw):
    """Independent oracle: the same index draws, the metric called on every resample."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(probs.shape[0], (n_resamples, probs.shape[0]), generator=gen)
    return torch.stack([metric(probs[i], targets[i], **kw) for i in idx])


@pytest.mark.parametrize(
    "metric,kw",
    [
        (F.expected_calibration_error, {"n_bins": 10}),
        (F.maximum_calibration_error, {}),
        (F.adaptive_calibration_error, {"n_bins": 7}),
        (F.debiased_calibration_error, {}),
        (F.negative_log_likelihood, {}),
        (F.brier_score, {}),
        (F.error_rate, {}),
        (F.classwise_calibration_error, {}),
        (F.classwise_calibration_error, {"n_bins": 4}),
    ],
)
def test_vectorised_replicates_equal_per_resample_evaluation(metric, kw):
    # distinct confidences, so the equal-mass tie order cannot differ between the two paths
    probs, targets = make_probs(150, 4, seed=2, sharpness=4)
    res = F.bootstrap_ci(metric, probs, targets, n_resamples=40, seed=5, **kw)
    expected = loop_bootstrap(metric, probs, targets, 40, 5, **kw)
    torch.testing.assert_close(res.samples, expected, rtol=0, atol=1e-12)


def test_classwise_replicates_with_entries_on_bin_edges():
    # probabilities on the grid of tenths put many entries exactly on the edges of 10 or 5 bins (an entry on
    # an edge belongs to the bin below; 0 to bin 0), in float32 as calibrators return them
    g = torch.Generator().manual_seed(3)
    parts = torch.multinomial(torch.ones(4), 10 * 90, replacement=True, generator=g).view(90, 10)
    probs = torch.nn.functional.one_hot(parts, 4).sum(1).float() / 10
    targets = torch.randint(0, 4, (90,), generator=g)
    for n_bins in (10, 5, 15):
        res = F.bootstrap_ci(F.classwise_ece, probs, targets, n_resamples=25, seed=2, n_bins=n_bins)
        expected = loop_bootstrap(F.classwise_ece, probs, targets, 25, 2, n_bins=n_bins)
        torch.testing.assert_close(res.samples, expected, rtol=0, atol=1e-12)


def test_generic_path_for_other_estimators_and_tuple_results():
    probs, targets = make_probs(80, 3, seed=4)
    res = F.bootstrap_ci(F.ece_sweep, probs, targets, n_resamples=10, seed=1)
    expected = loop_bootstrap(F.ece_sweep, probs, targets, 10, 1)
    torch.testing.assert_close(res.samples, expected, rtol=0, atol=1e-12)


def test_seeded_and_interval_contains_estimate_and_has_coverage():
    probs, targets = make_probs(400, 5, seed=9)
    a = F.bootstrap_ci(F.ece, probs, targets, n_resamples=300, seed=3)
    b = F.bootstrap_ci(F.ece, probs, targets, n_resamples=300, seed=3)
    c = F.bootstrap_ci(F.ece, probs, targets, n_resamples=300, seed=4)
    torch.testing.assert_close(a.samples, b.samples)
    assert not torch.equal(a.samples, c.samples)
    assert a.low <= a.estimate <= a.high
    assert a.low.item() == pytest.approx(np.quantile(a.samples.numpy(), 0.025), abs=1e-14)
    assert a.high.item() == pytest.approx(np.quantile(a.samples.numpy(), 0.975), abs=1e-14)
    wider = F.bootstrap_ci(F.ece, probs, targets, n_resamples=300, seed=3, confidence_level=0.99)
    assert wider.high - wider.low >= a.high - a.low


def test_replicates_of_several_metrics_share_one_draw_and_equal_bootstrap_ci():
    probs, targets = make_probs(130, 5, seed=6, sharpness=4)
    metrics = {"ece": F.ece, "nll": F.nll, "brier": F.brier_score, "error": F.error_rate, "cw": F.classwise_ece,
               "ada": F.adaece}  # fmt: skip
    reps = F.bootstrap_replicates(metrics, probs, targets, n_resamples=30, seed=4, n_bins=9)
    for name, metric in metrics.items():
        kw = {"n_bins": 9} if name in ("ece", "cw", "ada") else {}
        expected = F.bootstrap_ci(metric, probs, targets, n_resamples=30, seed=4, **kw).samples
        torch.testing.assert_close(reps[name], expected, rtol=0, atol=0)
    counts = F.resample_counts(130, n_resamples=30, seed=4)  # drawn once, shared by two models
    assert [c.dtype for c in counts] == [torch.float32] and counts[0].sum().item() == 30 * 130
    again = F.bootstrap_replicates(metrics, probs, targets, n_resamples=30, seed=4, n_bins=9, counts=counts)
    for name in metrics:
        torch.testing.assert_close(again[name], reps[name], rtol=0, atol=0)
    with pytest.raises(ValueError, match="must be resample_counts"):
        F.bootstrap_replicates(metrics, probs[:100], targets[:100], n_resamples=30, counts=counts)
    with pytest.raises(ValueError, match="no vectorised bootstrap; use bootstrap_ci"):
        F.bootstrap_replicates({"sweep": F.ece_sweep}, probs, targets)


@pytest.mark.parametrize("limit", [0, 1 << 22])
@pytest.mark.parametrize("metric", [F.ece, F.mce, F.classwise_ece])
def test_binned_sums_by_matrix_product_and_by_scatter_agree_with_the_loop(monkeypatch, metric, limit):
    # limit 0 takes index_add (ECE, MCE) and the sparse product (classwise ECE), the paths of large N·K
    from torchcal.functional import bootstrap

    monkeypatch.setattr(bootstrap, "_DESIGN_LIMIT", limit)
    probs, targets = make_probs(140, 6, seed=8, sharpness=4)
    res = F.bootstrap_ci(metric, probs, targets, n_resamples=30, seed=3, n_bins=12)
    expected = loop_bootstrap(metric, probs, targets, 30, 3, n_bins=12)
    torch.testing.assert_close(res.samples, expected, rtol=0, atol=1e-12)


def _half(n, k, seed):
    """A float16 softmax and its targets: rounding each entry to float16 moves a row sum by up to a few 1e-4,
    beyond float32's row-sum tolerance (1e-4) and within float16's (1e-2)."""
    probs, targets = make_probs(n, k, seed=seed, sharpness=2)
    probs = probs.half()
    assert 1e-4 < float((probs.double().sum(1) - 1).abs().max()) < 1e-2
    return probs, targets


def test_bootstrap_ci_accepts_half_precision_probabilities():
    # the metric is called on the caller's float16 values (validated with float16's tolerance), not on the
    # float32 upcast: the float64 reference on the same values, over the same draws. Both metrics sum exact
    # float32 copies of the float16 values in float64 (ECE) or square and sum them in float64 (Brier), so
    # only the summation order differs from the reference's: 1e-12
    from tests.reference import metrics as RM

    probs, targets = _half(120, 4, seed=3)
    rows = probs.double()
    idx = torch.randint(120, (20, 120), generator=torch.Generator().manual_seed(5))
    res = F.bootstrap_ci(F.ece, probs, targets, n_resamples=20, seed=5, n_bins=10)
    assert float(res.estimate) == pytest.approx(RM.ece(rows, targets, 10), abs=1e-12)
    want = [RM.ece(rows[i], targets[i], 10) for i in idx]
    torch.testing.assert_close(res.samples, torch.tensor(want, dtype=torch.float64), atol=1e-12, rtol=0)

    def brier(p, y):  # not a registered metric: evaluated on each resample
        return F.brier_score(p, y)

    res = F.bootstrap_ci(brier, probs, targets, n_resamples=20, seed=5)
    assert float(res.estimate) == pytest.approx(RM.brier(rows, targets), abs=1e-12)
    want = [RM.brier(rows[i], targets[i]) for i in idx]
    torch.testing.assert_close(res.samples, torch.tensor(want, dtype=torch.float64), atol=1e-12, rtol=0)
    bad = (rows * 1.05).half()  # rows summing to 1.05: beyond float16's tolerance, refused
    for metric in (F.ece, brier):
        with pytest.raises(ValueError, match="must sum to 1"):
            F.bootstrap_ci(metric, bad, targets, n_resamples=5)
