"""Metrics take what the losses take (decision 97): (N, K, d1, ...) scores with (N, d1, ...) targets, each
position a sample, and ``ignore_index``; the functional metrics and the streaming CalibrationMetrics,
against the float64 references of tests/reference/metrics.py on the kept positions."""

import pytest
import torch

import torchcal.functional as F
from tests.reference import metrics as R
from torchcal.metrics import CalibrationMetrics

METRICS = {
    "ece": (F.expected_calibration_error, R.ece),
    "mce": (F.maximum_calibration_error, R.mce),
    "adaece": (F.adaptive_calibration_error, R.adaece),
    "classwise_ece": (F.classwise_calibration_error, R.classwise),
    "debiased_ece": (F.debiased_calibration_error, R.debiased),
    "brier": (F.brier_score, R.brier),
    "error": (F.error_rate, R.error),
}
# the functions without a reference here: compared with their own value on the kept rows
OTHERS = [F.negative_log_likelihood, F.smooth_calibration_error, F.ece_sweep, F.kde_calibration_error]


def segmentation(seed=0, k=4):
    """(2, K, 3, 5) probabilities and (2, 3, 5) labels with a few positions labelled −100."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(2 * torch.randn(2, k, 3, 5, generator=g, dtype=torch.float64), 1)
    y = torch.randint(0, k, (2, 3, 5), generator=g)
    y[0, 0, :3] = -100
    y[1, 2, 4] = -100
    return probs, y


def kept_rows(probs, y):
    rows, labels = probs.movedim(1, -1).reshape(-1, probs.shape[1]), y.reshape(-1)
    keep = labels != -100
    return rows[keep], labels[keep]


@pytest.mark.parametrize("name", sorted(METRICS))
def test_positions_and_ignored_labels_match_the_reference(name):
    fn, ref = METRICS[name]
    probs, y = segmentation()
    rows, labels = kept_rows(probs, y)
    want = torch.tensor(ref(rows, labels), dtype=torch.float64)
    # float64 sums in a different order than the reference's loops
    torch.testing.assert_close(fn(probs, y, ignore_index=-100), want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("fn", OTHERS, ids=lambda f: f.__name__)
def test_other_metrics_take_positions(fn):
    probs, y = segmentation()
    torch.testing.assert_close(fn(probs, y, ignore_index=-100), fn(*kept_rows(probs, y)))


def test_logits_and_s99_take_positions():
    probs, y = segmentation()
    logits = probs.log() + 0.3
    rows, labels = kept_rows(logits, y)
    for fn in (F.expected_calibration_error, F.negative_log_likelihood, F.brier_score):
        torch.testing.assert_close(
            fn(logits, y, from_logits=True, ignore_index=-100), fn(rows, labels, from_logits=True)
        )
    got = F.confidence_at_least(probs, y, 0.5, ignore_index=-100)
    assert got == F.confidence_at_least(*kept_rows(probs, y), 0.5)


def test_ignore_index_on_plain_rows_and_its_default():
    probs, y = segmentation()
    rows, labels = probs.movedim(1, -1).reshape(-1, 4), y.reshape(-1)
    torch.testing.assert_close(
        F.expected_calibration_error(rows, labels, ignore_index=-100),
        F.expected_calibration_error(*kept_rows(probs, y)),
    )
    # the default counts every label: −100 is out of range, a named error
    with pytest.raises(ValueError, match="targets"):
        F.expected_calibration_error(rows, labels)
    with pytest.raises(ValueError, match=r"`targets` must have shape \(2, 3, 5\)"):
        F.expected_calibration_error(probs, y[:, :2], ignore_index=-100)
    with pytest.raises(TypeError, match="`ignore_index` must be an integer or None"):
        F.brier_score(rows, labels, ignore_index=1.5)


def test_streaming_metrics_take_positions_and_ignored_labels():
    probs, y = segmentation()
    m = CalibrationMetrics(num_classes=4, ignore_index=-100)
    m.update(probs[:1], y[:1])
    m.update(probs[1:], y[1:])
    everything_ignored = torch.full_like(y[:1], -100)
    m.update(probs[:1], everything_ignored)  # adds nothing
    rows, labels = kept_rows(probs, y)
    assert m.num_samples == labels.numel()
    out = m.compute()
    for name in ("ece", "adaece", "classwise_ece", "brier", "error", "mce", "debiased_ece"):
        fn, ref = METRICS[name]
        torch.testing.assert_close(out[name], torch.tensor(ref(rows, labels), dtype=torch.float64))
    other = CalibrationMetrics(num_classes=4)
    with pytest.raises(ValueError, match="cannot merge"):
        m.merge(other)
