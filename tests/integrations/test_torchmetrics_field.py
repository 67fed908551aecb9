"""FieldCalibrationMetric: the SPEC §9 metrics as torchmetrics Metrics equal FieldMetrics and the one-shot
functions, across batches and inside a MetricCollection."""

import pytest
import torch

pytest.importorskip("torchmetrics")

from tests.conftest import make_probs  # noqa: E402
from torchcal.field_metrics import FieldMetrics  # noqa: E402
from torchcal.integrations.torchmetrics_field import FIELD_METRICS, FieldCalibrationMetric  # noqa: E402


def test_every_metric_equals_field_metrics():
    from torchmetrics import MetricCollection

    probs, targets = make_probs(301, 5, seed=2)
    coll = MetricCollection({name: FieldCalibrationMetric(5, name) for name in FIELD_METRICS})
    ref = FieldMetrics(5)
    for a, b in ((0, 3), (3, 100), (100, 301)):
        coll.update(probs[a:b], targets[a:b])
        ref.update(probs[a:b], targets[a:b])
    got, want = coll.compute(), ref.compute()
    assert set(got) == set(FIELD_METRICS) == set(want)
    for name in FIELD_METRICS:
        # the same float64 state, summed batch by batch in the same order
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-12, msg=name)


def test_errors_and_reset():
    with pytest.raises(ValueError, match="metric"):
        FieldCalibrationMetric(3, "ece_sideways")
    with pytest.raises(ValueError, match="needs logits"):
        FieldCalibrationMetric(3, "aurc", score="energy")
    m = FieldCalibrationMetric(3, "ks")
    probs, targets = make_probs(50, 3, seed=1)
    m.update(probs, targets)
    first = m.compute()
    m.reset()
    m.update(probs, targets)
    torch.testing.assert_close(m.compute(), first)
