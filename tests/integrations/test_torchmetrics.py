"""torchcal's metrics as torchmetrics.Metric classes, against the one-shot functions, torchmetrics' own
MulticlassCalibrationError, inside a MetricCollection, and synchronised over 2 gloo processes."""

import json

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("torchmetrics")  # the `dev` extra installs it; CI runs these tests
from torchmetrics import MetricCollection  # noqa: E402
from torchmetrics.classification import MulticlassCalibrationError  # noqa: E402

import torchcal.functional as F  # noqa: E402
from tests.conftest import free_port
from torchcal.integrations import torchmetrics as TM  # noqa: E402
from torchcal.metrics import CalibrationMetrics  # noqa: E402

CLASSES = [
    (TM.ExpectedCalibrationError, "ece"),
    (TM.MaxCalibrationError, "mce"),
    (TM.ClasswiseCalibrationError, "classwise_ece"),
    (TM.AdaptiveCalibrationError, "adaece"),
    (TM.DebiasedCalibrationError, "debiased_ece"),
    (TM.SmoothCalibrationError, "smece"),
    (TM.BrierScore, "brier"),
    (TM.NegativeLogLikelihood, "nll"),
]


def data(n=400, k=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(n, k, generator=g, dtype=torch.float64)
    return logits, torch.randint(0, k, (n,), generator=g)


@pytest.mark.parametrize("cls,name", CLASSES, ids=[c[1] for c in CLASSES])
def test_batches_equal_the_one_shot_accumulator(cls, name):
    logits, targets = data()
    metric = cls(num_classes=5, from_logits=True)
    for i in range(0, 400, 64):
        metric.update(logits[i : i + 64], targets[i : i + 64])
    expected = CalibrationMetrics(5, from_logits=True)
    expected.update(logits, targets)
    torch.testing.assert_close(metric.compute(), expected.compute(name)[name])
    probs_metric = cls(num_classes=5)
    probs_metric.update(torch.softmax(logits, 1), targets)
    torch.testing.assert_close(probs_metric.compute(), expected.compute(name)[name], rtol=1e-6, atol=1e-9)


def test_ece_matches_the_functional_and_torchmetrics():
    """Same 15 equal-width bins; torchmetrics' MulticlassCalibrationError agrees away from bin edges."""
    logits, targets = data(n=1000, k=10, seed=1)
    probs = torch.softmax(logits, 1).float()
    ours = TM.ExpectedCalibrationError(num_classes=10)
    theirs = MulticlassCalibrationError(num_classes=10, n_bins=15, norm="l1")
    ours.update(probs, targets)
    theirs.update(probs, targets)
    assert abs(float(ours.compute()) - float(theirs.compute())) < 1e-6
    assert abs(float(ours.compute()) - float(F.expected_calibration_error(probs, targets))) < 1e-6
    mce = TM.MaxCalibrationError(num_classes=10)
    mce.update(probs, targets)
    peer_mce = MulticlassCalibrationError(num_classes=10, n_bins=15, norm="max")
    peer_mce.update(probs, targets)
    assert abs(float(mce.compute()) - float(peer_mce.compute())) < 1e-6


def test_metric_collection_shares_one_update():
    logits, targets = data()
    collection = MetricCollection(
        {name: cls(num_classes=5, from_logits=True) for cls, name in CLASSES}, compute_groups=True
    )
    for i in range(0, 400, 100):
        collection.update(logits[i : i + 100], targets[i : i + 100])
    out = collection.compute()
    expected = CalibrationMetrics(5, from_logits=True)
    expected.update(logits, targets)
    ref = expected.compute()
    for _, name in CLASSES:
        torch.testing.assert_close(out[name], ref[name])
    # the equal-width metrics have identical state: torchmetrics computes it once for all of them
    groups = [sorted(g) for g in collection.compute_groups.values()]
    assert ["brier", "classwise_ece", "ece", "mce", "nll"] in groups
    collection.reset()
    with (
        pytest.raises(RuntimeError, match="before any update"),
        pytest.warns(UserWarning, match="before the"),
    ):
        TM.ExpectedCalibrationError(num_classes=5).compute()


def test_state_is_constant_size_for_equal_width_metrics():
    ece = TM.ExpectedCalibrationError(num_classes=10, n_bins=15)
    assert set(ece._defaults) == {"sums"} and ece.sums.shape == (3 * 15 + 2 * 10 * 15 + 6,)
    ada = TM.AdaptiveCalibrationError(num_classes=10)
    assert set(ada._defaults) == {"sums", "samples"}


def test_ignore_index_and_extra_dimensions():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 3, 6, generator=g, dtype=torch.float64)  # (N, K, T): token classification
    targets = torch.randint(0, 3, (4, 6), generator=g)
    targets[:, 4:] = -100  # padding
    rows = logits.movedim(1, -1).reshape(-1, 3)
    flat = targets.reshape(-1)
    keep = flat != -100
    for cls, name in CLASSES:
        metric = cls(num_classes=3, from_logits=True, ignore_index=-100)
        metric.update(logits, targets)
        expected = CalibrationMetrics(3, from_logits=True)
        expected.update(rows[keep], flat[keep])
        torch.testing.assert_close(metric.compute(), expected.compute(name)[name])
    with pytest.raises(ValueError, match="must lie in"):  # -100 without ignore_index is a bad label
        m = TM.ExpectedCalibrationError(num_classes=3, from_logits=True)
        m.update(logits, targets)
    with pytest.raises(ValueError, match=r"`target` must have shape \(4, 6\)"):
        TM.ExpectedCalibrationError(num_classes=3, from_logits=True).update(logits, targets[:, :5])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="`metric` must be one of"):
        TM.CalibrationMetric(num_classes=3, metric="ace")
    with pytest.raises(ValueError, match="`num_classes` must be >= 2"):
        TM.ExpectedCalibrationError(num_classes=1)
    with pytest.raises(TypeError, match="`ignore_index` must be an integer or None"):
        TM.ExpectedCalibrationError(num_classes=3, ignore_index=0.5)
    with pytest.raises(ValueError, match="`probs_or_logits` has negative entries"):
        TM.ExpectedCalibrationError(num_classes=3).update(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))


def _worker(rank, world, port, path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    logits, targets = data(n=300, k=4, seed=3)
    shard = slice(0, 200) if rank == 0 else slice(200, 300)  # uneven shards
    metrics = {name: cls(num_classes=4, from_logits=True) for cls, name in CLASSES}
    for metric in metrics.values():
        metric.update(logits[shard], targets[shard])
    out = {name: float(m.compute()) for name, m in metrics.items()}  # compute() syncs across ranks
    with open(f"{path}.{rank}", "w") as fh:
        json.dump(out, fh)
    dist.destroy_process_group()


def test_sync_over_two_gloo_processes(tmp_path):
    mp.start_processes(_worker, args=(2, free_port(), str(tmp_path / "out")), nprocs=2, start_method="spawn")
    logits, targets = data(n=300, k=4, seed=3)
    expected = CalibrationMetrics(4, from_logits=True)
    expected.update(logits, targets)
    ref = expected.compute()
    for rank in range(2):
        got = json.loads((tmp_path / f"out.{rank}").read_text())
        for _, name in CLASSES:
            assert abs(got[name] - float(ref[name])) < 1e-9, (rank, name)
