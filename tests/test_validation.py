"""Bad input raises a clear error naming the argument, for every public function."""

import numpy as np
import pytest
import torch

import torchcal.functional as F
from torchcal.metrics import CalibrationMetrics

# every test here runs on the C++ CPU operators and on the torch path
pytestmark = pytest.mark.usefixtures("cpu_backend")

METRICS = [
    F.expected_calibration_error,
    F.adaptive_calibration_error,
    F.classwise_calibration_error,
    F.maximum_calibration_error,
    F.negative_log_likelihood,
    F.brier_score,
    F.error_rate,
    F.smooth_calibration_error,
    F.debiased_calibration_error,
    F.ece_sweep,
    F.kde_calibration_error,
    F.confidence_at_least,
]
BINNED = [
    F.expected_calibration_error,
    F.adaptive_calibration_error,
    F.classwise_calibration_error,
    F.maximum_calibration_error,
    F.debiased_calibration_error,
]

GOOD_P = torch.tensor([[0.7, 0.3], [0.2, 0.8]])
GOOD_T = torch.tensor([0, 1])


@pytest.mark.parametrize("fn", METRICS)
@pytest.mark.parametrize(
    "probs,targets,exc,match",
    [
        (torch.tensor([0.7, 0.3]), GOOD_T, ValueError, r"`probs` must have shape \(N, K\)"),
        (torch.zeros(0, 2), torch.zeros(0, dtype=torch.long), ValueError, "`probs` is empty"),
        (torch.ones(2, 1), GOOD_T, ValueError, "at least 2 classes"),
        (GOOD_P, torch.tensor([0, 2]), ValueError, r"`targets` must lie in \[0, 2\), found label 2"),
        (GOOD_P, torch.tensor([-1, 0]), ValueError, r"found label -1"),
        (GOOD_P, torch.tensor([0.0, 1.0]), TypeError, "`targets` must hold integer class indices"),
        (GOOD_P, torch.tensor([True, False]), TypeError, "`targets` must hold integer"),
        (GOOD_P, torch.tensor([0, 1, 1]), ValueError, "`targets` has 3 entries but the scores have 2"),
        (GOOD_P, torch.tensor([[0], [1]]), ValueError, r"`targets` must have shape \(N,\)"),
        (torch.tensor([[0.7, float("nan")], [0.2, 0.8]]), GOOD_T, ValueError, "NaN or infinite"),
        (torch.tensor([[0.7, float("inf")], [0.2, 0.8]]), GOOD_T, ValueError, "NaN or infinite"),
        (torch.tensor([[0.7, 0.7], [0.2, 0.8]]), GOOD_T, ValueError, "must sum to 1"),
        (torch.tensor([[1.2, -0.2], [0.2, 0.8]]), GOOD_T, ValueError, "negative entries"),
        (torch.tensor([[1, 0], [0, 1]]), GOOD_T, TypeError, "`probs` must be a floating-point"),
        ("probs", GOOD_T, TypeError, "`probs` must be a torch.Tensor or numpy array"),
    ],
)
def test_bad_inputs(fn, probs, targets, exc, match):
    with pytest.raises(exc, match=match):
        fn(probs, targets)


@pytest.mark.parametrize("fn", BINNED)
@pytest.mark.parametrize(
    "n_bins,exc", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError)]
)
def test_bad_n_bins(fn, n_bins, exc):
    with pytest.raises(exc, match="`n_bins`"):
        fn(GOOD_P, GOOD_T, n_bins=n_bins)


def test_logits_need_from_logits_and_nan_logits_are_rejected():
    logits = torch.tensor([[2.0, -1.0], [0.5, 0.1]])
    with pytest.raises(ValueError, match="from_logits=True"):
        F.ece(logits, GOOD_T)
    with pytest.raises(ValueError, match="NaN or infinite"):
        F.ece(torch.tensor([[float("nan"), 0.0], [0.0, 1.0]]), GOOD_T, from_logits=True)
    with pytest.raises(TypeError, match="`from_logits` must be a bool"):
        F.ece(logits, GOOD_T, from_logits="yes")


def test_numpy_inputs_are_accepted():
    value = F.ece(np.array([[0.7, 0.3], [0.2, 0.8]]), np.array([0, 1]))
    assert value.item() == pytest.approx(F.ece(GOOD_P.double(), GOOD_T).item(), abs=1e-7)


def test_other_arguments():
    with pytest.raises(ValueError, match="`threshold`"):
        F.confidence_at_least(GOOD_P, GOOD_T, threshold=1.5)
    with pytest.raises(ValueError, match="`score` must be one of"):
        F.ood_auroc(GOOD_P, GOOD_P, score="energy")
    with pytest.raises(ValueError, match="`probs_in` has 2 classes but `probs_out` has 3"):
        F.ood_auroc(GOOD_P, torch.full((2, 3), 1 / 3))
    with pytest.raises(ValueError, match="`sigma`"):
        F.smece(GOOD_P, GOOD_T, sigma=0.0)
    with pytest.raises(ValueError, match="`bandwidth`"):
        F.kde_ece(GOOD_P, GOOD_T, bandwidth=-1.0)
    with pytest.raises(ValueError, match="at least 2 rows"):
        F.kde_ece(GOOD_P[:1], GOOD_T[:1])
    with pytest.raises(ValueError, match="`p`"):
        F.ece_sweep(GOOD_P, GOOD_T, p=0)
    with pytest.raises(ValueError, match="`gamma`"):
        F.focal_calibration_map(GOOD_P, -1.0)
    with pytest.raises(TypeError, match="`metric`"):
        F.bootstrap_ci("ece", GOOD_P, GOOD_T)
    with pytest.raises(ValueError, match="`confidence_level`"):
        F.bootstrap_ci(F.ece, GOOD_P, GOOD_T, confidence_level=1.0)


def test_streaming_validation():
    m = CalibrationMetrics(num_classes=3)
    with pytest.raises(ValueError, match="has 2 classes, this metric was built for 3"):
        m.update(GOOD_P, GOOD_T)
    with pytest.raises(RuntimeError, match="before any update"):
        m.compute()
    with pytest.raises(ValueError, match="`num_classes` must be >= 2"):
        CalibrationMetrics(num_classes=1)
    with pytest.raises(ValueError, match="cannot merge"):
        CalibrationMetrics(3).merge(CalibrationMetrics(3, n_bins=10))
