"""Consistency-resampling calibration test (SPEC §9.4) and the paired bootstrap comparison: the procedure
against a per-resample loop reference, the test's level on a perfectly calibrated simulator, power, and the
paired interval's behaviour."""

from __future__ import annotations

import math

import pytest
import torch

from tests.reference import metrics as RM
from torchcal.functional import significance as SG
from torchcal.functional.calibration import (
    brier_score,
    classwise_calibration_error,
    expected_calibration_error,
    negative_log_likelihood,
)
from torchcal.functional.cumulative import ks_calibration_error


def _calibrated(n, k, seed, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(scale * torch.randn(n, k, generator=g, dtype=torch.float64), 1)
    return p, torch.multinomial(p, 1, generator=g).squeeze(1)


def _reference_null(probs, n_resamples, seed, n_bins):
    """SPEC §9.4 step by step: per resample N indices, then N uniforms, labels by a loop over the CDF."""
    gen = torch.Generator().manual_seed(seed)
    n, k = probs.shape
    out = []
    for _ in range(n_resamples):
        idx = torch.randint(n, (n,), generator=gen).tolist()
        u = torch.rand(n, generator=gen, dtype=torch.float64).tolist()
        rows = [probs[i].tolist() for i in idx]
        labels = []
        for row, uj in zip(rows, u):
            total, label = 0.0, k - 1
            for c in range(k):
                total += row[c]
                if total >= uj:
                    label = c
                    break
            labels.append(label)
        out.append(RM.ece(rows, labels, n_bins))
    return out


def test_null_statistics_match_reference_loop():
    probs, targets = _calibrated(60, 4, seed=1)
    res = SG.calibration_test(probs, targets, n_bins=5, n_resamples=40, seed=3)
    want = _reference_null(probs, 40, 3, 5)
    # the cumulative sums of a row are taken in the same order; ECE sums differ by float64 ordering only
    torch.testing.assert_close(
        res.null_statistics, torch.tensor(want, dtype=torch.float64), atol=1e-12, rtol=0
    )
    assert float(res.statistic) == pytest.approx(RM.ece(probs, targets, 5), abs=1e-12)
    assert float(res.pvalue) == sum(t >= float(res.statistic) for t in want) / 40
    plus = SG.calibration_test(probs, targets, n_bins=5, n_resamples=40, seed=3, pvalue="plus_one")
    assert float(plus.pvalue) == (1 + sum(t >= float(res.statistic) for t in want)) / 41


def test_generic_statistic_path_equals_fast_path():
    probs, targets = _calibrated(80, 3, seed=2)
    fast = SG.calibration_test(probs, targets, n_resamples=30, seed=5)
    slow = SG.calibration_test(probs, targets, n_resamples=30, seed=5, statistic=expected_calibration_error)
    torch.testing.assert_close(fast.null_statistics, slow.null_statistics, atol=1e-12, rtol=0)
    cw = SG.calibration_test(probs, targets, kind="classwise", n_resamples=30, seed=5)
    assert float(cw.statistic) == pytest.approx(float(classwise_calibration_error(probs, targets)), abs=1e-15)
    ks = SG.calibration_test(probs, targets, statistic=ks_calibration_error, n_resamples=30)
    assert 0 <= float(ks.pvalue) <= 1


def test_level_on_a_calibrated_simulator_over_400_simulations():
    # H0 holds exactly (labels drawn from the model's probabilities): the rejection rate at 5 % must lie
    # within binomial noise of 0.05 over 400 simulations (sd = sqrt(.05·.95/400) = 0.011; 3 sd bounds).
    # All 400 × 200 resamples at once through the test's own null-statistic routine (the draws come from
    # one generator for the batch instead of one per simulation; the procedure is the same).
    sims, n, k, r = 400, 100, 3, 200
    g = torch.Generator().manual_seed(2024)
    probs = torch.softmax(1.5 * torch.randn(sims, n, k, generator=g, dtype=torch.float64), -1)
    targets = torch.multinomial(probs.view(-1, k), 1, generator=g).view(sims, n)
    observed = torch.stack([expected_calibration_error(p, y) for p, y in zip(probs, targets)])
    idx = torch.randint(n, (sims, r, n), generator=g)
    u = torch.rand(sims, r, n, generator=g, dtype=torch.float64)
    null = SG._top_label_null(probs, idx, u, 15)
    # the batched routine is the one calibration_test runs: spot-check one simulation against the public call
    one = SG._top_label_null(probs[0], idx[0], u[0], 15)
    torch.testing.assert_close(null[0], one, atol=0, rtol=0)
    pvalues = (null >= observed[:, None]).double().mean(1)
    rate = float((pvalues <= 0.05).double().mean())
    print(f"rejection rate {rate:.4f}")
    assert 0.05 - 3 * 0.0109 <= rate <= 0.05 + 3 * 0.0109, rate


def test_power_against_overconfidence():
    probs, targets = _calibrated(400, 4, seed=7)
    sharp = torch.softmax(3 * probs.log(), 1)
    assert float(SG.calibration_test(sharp, targets, n_resamples=200).pvalue) == 0.0


def test_calibration_test_errors():
    probs, targets = _calibrated(20, 3, seed=8)
    with pytest.raises(ValueError, match="kind"):
        SG.calibration_test(probs, targets, kind="binary")
    with pytest.raises(ValueError, match="pvalue"):
        SG.calibration_test(probs, targets, pvalue="exact")
    with pytest.raises(TypeError, match="statistic"):
        SG.calibration_test(probs, targets, statistic=3)
    with pytest.raises(ValueError, match="empty"):
        SG.calibration_test(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))


@pytest.mark.parametrize(
    "metric", [expected_calibration_error, negative_log_likelihood, ks_calibration_error]
)
def test_paired_bootstrap_matches_per_replicate_loop(metric):
    probs, targets = _calibrated(120, 4, seed=9)
    other = torch.softmax(2 * probs.log(), 1)
    res = SG.paired_bootstrap(metric, probs, other, targets, n_resamples=50, seed=4)
    gen = torch.Generator().manual_seed(4)
    idx = torch.randint(120, (50, 120), generator=gen)
    want = torch.stack([metric(other[r], targets[r]) - metric(probs[r], targets[r]) for r in idx]).double()
    # weighted (fast) path vs per-replicate evaluation: float64 summation order only
    torch.testing.assert_close(res.samples, want, atol=1e-12, rtol=0)
    assert float(res.difference) == pytest.approx(
        float(metric(other, targets) - metric(probs, targets)), abs=1e-15
    )
    extreme = ((want - res.difference).abs() >= abs(float(res.difference))).sum()
    assert float(res.pvalue) == pytest.approx((1 + int(extreme)) / 51)
    assert float(res.low) <= float(res.high)


def test_paired_bootstrap_identical_models_and_shared_noise():
    probs, targets = _calibrated(300, 3, seed=11)
    same = SG.paired_bootstrap(brier_score, probs, probs.clone(), targets, n_resamples=100)
    assert float(same.difference) == 0 and float(same.samples.abs().max()) == 0 and float(same.pvalue) == 1
    # a small, real difference: pairing makes the interval far narrower than the two unpaired spreads
    other = torch.softmax(1.3 * probs.log(), 1)
    res = SG.paired_bootstrap(brier_score, probs, other, targets, n_resamples=400, seed=1)
    unpaired = SG.paired_bootstrap(brier_score, probs, other[torch.randperm(300)], targets, n_resamples=400)
    assert float(res.high - res.low) < float(unpaired.high - unpaired.low)
    assert not math.isnan(float(res.pvalue))


def test_paired_bootstrap_errors():
    probs, targets = _calibrated(20, 3, seed=12)
    with pytest.raises(TypeError, match="metric"):
        SG.paired_bootstrap("ece", probs, probs, targets)
    with pytest.raises(ValueError, match="probs_b"):
        SG.paired_bootstrap(expected_calibration_error, probs, probs[:10], targets)
    with pytest.raises(ValueError, match="confidence_level"):
        SG.paired_bootstrap(expected_calibration_error, probs, probs, targets, confidence_level=1.0)


def _half(n, k, seed):
    """A float16 softmax and labels drawn from it: rounding each entry to float16 moves a row sum by up to a
    few 1e-4, beyond float32's row-sum tolerance (1e-4) and within float16's (1e-2)."""
    probs, targets = _calibrated(n, k, seed)
    probs = probs.half()
    assert 1e-4 < float((probs.double().sum(1) - 1).abs().max()) < 1e-2
    return probs, targets


def test_calibration_test_accepts_half_precision_probabilities():
    # the statistic is evaluated on the caller's float16 values (float16's tolerance), not on their float32
    # upcast; against the float64 references on the same values. The ECE sums exact copies of the float16
    # values in float64, so only the summation order differs: 1e-12
    probs, targets = _half(60, 4, seed=13)
    rows = probs.double()
    res = SG.calibration_test(probs, targets, n_bins=5, n_resamples=20, seed=3)
    assert float(res.statistic) == pytest.approx(RM.ece(rows, targets, 5), abs=1e-12)
    want = torch.tensor(_reference_null(rows, 20, 3, 5), dtype=torch.float64)
    torch.testing.assert_close(res.null_statistics, want, atol=1e-12, rtol=0)
    cw = SG.calibration_test(probs, targets, kind="classwise", n_resamples=5)
    assert float(cw.statistic) == pytest.approx(RM.classwise(rows, targets), abs=1e-12)
    ks = SG.calibration_test(probs, targets, statistic=ks_calibration_error, n_resamples=5)
    assert 0 <= float(ks.pvalue) <= 1
    bad = (rows * 1.05).half()  # rows summing to 1.05: beyond float16's tolerance, refused
    for kw in ({}, {"kind": "classwise"}, {"statistic": ks_calibration_error}):
        with pytest.raises(ValueError, match="must sum to 1"):
            SG.calibration_test(bad, targets, n_resamples=5, **kw)


def test_paired_bootstrap_accepts_half_precision_probabilities():
    # both the weighted path (ECE) and the per-replicate path (a function of its own) call the metric on the
    # caller's float16 values; float64 references on the same values and draws (summation order: 1e-12)
    probs, targets = _half(100, 3, seed=14)
    other = torch.softmax(2 * probs.double().log(), 1).half()
    pa, pb = probs.double(), other.double()
    idx = torch.randint(100, (20, 100), generator=torch.Generator().manual_seed(4))

    def brier(p, y):  # not a registered metric: evaluated on each replicate
        return brier_score(p, y)

    for metric, ref in ((expected_calibration_error, RM.ece), (brier, RM.brier)):
        res = SG.paired_bootstrap(metric, probs, other, targets, n_resamples=20, seed=4)
        assert float(res.difference) == pytest.approx(ref(pb, targets) - ref(pa, targets), abs=1e-12)
        want = [ref(pb[r], targets[r]) - ref(pa[r], targets[r]) for r in idx]
        torch.testing.assert_close(res.samples, torch.tensor(want, dtype=torch.float64), atol=1e-12, rtol=0)
        with pytest.raises(ValueError, match="must sum to 1"):
            SG.paired_bootstrap(metric, probs, (pb * 1.05).half(), targets, n_resamples=5)
