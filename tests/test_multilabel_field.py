"""The metrics of SPEC §9 defined per label, for sigmoid outputs: the direction of each label's ECE, its
Brier decomposition, KS and Kuiper, in MultilabelCalibrationMetrics and the adapters' masked state, against
float64 loop references and the one-shot binary functions."""

from __future__ import annotations

import pytest
import torch

import torchcal.functional as F
from tests.reference import field as R
from torchcal.integrations import _multilabel as ML
from torchcal.metrics import MultilabelCalibrationMetrics

CUTS = [0, 3, 50, 51, 120, 200, 260, 301]  # 7 uneven batches
TERMS = ("signed_ece", "ece_over", "ece_under", "brier_reliability", "brier_resolution", "brier_uncertainty",
         "brier_within_variance", "brier_within_covariance", "brier")  # fmt: skip


def _data(n=301, labels=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n, labels, generator=g, dtype=torch.float64)
    y = (torch.rand(n, labels, generator=g, dtype=torch.float64) < p**1.5).long()  # miscalibrated
    return p.to(dtype), y


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n_bins", [15, 4])
def test_per_label_terms_stream_and_equal_the_loop_reference(dtype, n_bins):
    p, y = _data(dtype=dtype)
    m = MultilabelCalibrationMetrics(3, n_bins)
    for a, b in zip(CUTS[:-1], CUTS[1:]):
        m.update(p[a:b], y[a:b])
    out = m.compute()
    for j in range(3):
        want = R.binary_binned(p[:, j].double().tolist(), y[:, j].tolist(), n_bins)
        for name, value in zip(TERMS, want):
            # float64 sums of 301 terms of O(1), in another order than the loop's: a few ulps
            assert float(out[f"{name}_per_label"][j]) == pytest.approx(value, abs=1e-12), (name, j)
        ks, kuiper = R.cumulative(p[:, j].double().tolist(), y[:, j].tolist())
        assert float(out["ks_per_label"][j]) == pytest.approx(ks, abs=1e-12)
        assert float(out["kuiper_per_label"][j]) == pytest.approx(kuiper, abs=1e-12)
        one_shot = F.ks_calibration_error(p[:, j], y[:, j], kind="binary")  # the 1-D functional path
        torch.testing.assert_close(out["ks_per_label"][j], one_shot, rtol=0, atol=1e-12)
    for name in ("signed_ece", "brier_reliability", "ks", "kuiper"):
        torch.testing.assert_close(out[name], out[f"{name}_per_label"].mean())


def test_identities_hold_per_label():
    p, y = _data(500, 4, seed=1)
    m = MultilabelCalibrationMetrics(4)
    m.update(p, y)
    o = m.compute()
    g = "_per_label"
    total = o["brier_reliability" + g] - o["brier_resolution" + g] + o["brier_uncertainty" + g]
    total = total + o["brier_within_variance" + g] - 2 * o["brier_within_covariance" + g]
    assert (total - o["brier" + g]).abs().max() <= 1e-10  # exact up to float64 rounding of O(1) terms
    torch.testing.assert_close(
        o["ece_over" + g] - o["ece_under" + g], o["signed_ece" + g], rtol=0, atol=1e-15
    )
    torch.testing.assert_close(o["ece_over" + g] + o["ece_under" + g], o["ece" + g], rtol=0, atol=1e-15)
    # the signed ECE needs no bins: mean p − mean y per label
    torch.testing.assert_close(o["signed_ece" + g], p.mean(0) - y.double().mean(0), rtol=0, atol=1e-14)
    assert bool((o["kuiper" + g] >= o["ks" + g]).all())


def test_perfectly_calibrated_labels_have_no_reliability_term():
    # each bin's outcomes match its probability exactly: REL = 0 and the signed ECE is 0
    p = torch.tensor([[0.25], [0.25], [0.25], [0.25], [0.75], [0.75], [0.75], [0.75]], dtype=torch.float64)
    y = torch.tensor([[1], [0], [0], [0], [1], [1], [1], [0]])
    m = MultilabelCalibrationMetrics(1, 4)
    m.update(p, y)
    o = m.compute()
    assert float(o["brier_reliability"]) == 0.0 and float(o["signed_ece"]) == 0.0
    assert float(o["brier_within_variance"]) == 0.0  # one value per bin


def test_masked_adapter_state_leaves_out_unknown_targets_label_by_label():
    p, y = _data(200, 3, seed=2)
    masked = y.clone()
    masked[::5, 1] = -1  # unknown second label on every fifth sample
    sums, rows = ML.batch_state(p, masked, 3, 15, False, -1, True)
    out = ML.compute(sums, rows, 3, 15, ("signed_ece", "ece_over", "ece_under", "ks", "kuiper"))
    keep = masked[:, 1] >= 0
    for j, rows_j in ((0, slice(None)), (1, keep), (2, slice(None))):
        want = R.binary_binned(p[rows_j, j].tolist(), y[rows_j, j].tolist(), 15)
        for name, value in zip(TERMS[:3], want[:3]):
            assert float(out[f"{name}_per_label"][j]) == pytest.approx(value, abs=1e-12), (name, j)
        ks, kuiper = R.cumulative(p[rows_j, j].tolist(), y[rows_j, j].tolist())
        assert float(out["ks_per_label"][j]) == pytest.approx(ks, abs=1e-12)
        assert float(out["kuiper_per_label"][j]) == pytest.approx(kuiper, abs=1e-12)
    # without masked targets the adapters' values equal the accumulator's
    sums, rows = ML.batch_state(p, y, 3, 15, False, None, True)
    got = ML.compute(sums, rows, 3, 15, ("signed_ece", "ks"))
    m = MultilabelCalibrationMetrics(3)
    m.update(p, y)
    want = m.compute()
    for name in ("signed_ece", "signed_ece_micro", "ks", "ks_per_label"):
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-12)


def test_torchmetrics_multilabel_metric_takes_the_new_names():
    pytest.importorskip("torchmetrics")
    from torchcal.integrations.torchmetrics import MultilabelCalibrationMetric

    p, y = _data(120, 2, seed=3)
    m = MultilabelCalibrationMetric(2, "kuiper", average="none")
    for a in range(0, 120, 50):
        m.update(p[a : a + 50], y[a : a + 50])
    want = [R.cumulative(p[:, j].tolist(), y[:, j].tolist())[1] for j in range(2)]
    torch.testing.assert_close(m.compute(), torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="average"):
        MultilabelCalibrationMetric(2, "ks", average="micro")
    signed = MultilabelCalibrationMetric(2, "signed_ece", average="micro")
    signed.update(p, y)
    torch.testing.assert_close(signed.compute(), p.mean() - y.double().mean(), rtol=0, atol=1e-14)


def test_a_label_without_known_targets_is_nan_without_a_numpy_warning():
    # every target of label 1 unknown: its binned ECE was numpy's 0/0, NaN with a RuntimeWarning
    # ("invalid value encountered in scalar divide") on every compute of the adapters
    import warnings

    p, y = _data(60, 3, seed=4)
    masked = y.clone()
    masked[:, 1] = -100
    sums, rows = ML.batch_state(p, masked, 3, 15, False, -100, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = ML.compute(sums, rows, 3, 15, ("ece", "mce", "adaece", "auroc"))
    for name in ("ece", "mce", "adaece", "auroc"):
        assert bool(torch.isnan(out[f"{name}_per_label"][1])), name
    for j in (0, 2):  # the other labels: the float64 loop over their bins
        ece = R.binary_binned(p[:, j].tolist(), y[:, j].tolist(), 15)
        # signed split: ECE = over + under; a few ulps from the summation order
        assert float(out["ece_per_label"][j]) == pytest.approx(ece[1] + ece[2], abs=1e-12)
    assert float(out["ece"]) == pytest.approx(float(out["ece_per_label"][[0, 2]].mean()), abs=1e-15)
