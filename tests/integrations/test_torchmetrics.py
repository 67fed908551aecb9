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
    assert set(ece._defaults) == {"sums", "settings"} and ece.sums.shape == (3 * 15 + 2 * 10 * 15 + 7,)
    # (is set, value) of from_logits, ignore_index, s99_threshold, class_dim, score
    assert ece.settings.shape == (10,)
    rel = TM.CalibrationMetric(num_classes=10, metric="brier_reliability")  # + the per-bin vector sums
    assert set(rel._defaults) == {"sums", "settings"} and rel.sums.shape == (3 * 15 + 4 * 10 * 15 + 7,)
    ada = TM.AdaptiveCalibrationError(num_classes=10)
    assert set(ada._defaults) == {"sums", "settings", "samples"}


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
    z, y = multilabel_data(n=300, seed=3)
    for name in ML_NAMES:
        metric = TM.MultilabelCalibrationMetric(4, name, from_logits=True, ignore_index=-1)
        metric.update(z[shard], y[shard])
        out[f"multilabel_{name}"] = float(metric.compute())
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
        z, y = multilabel_data(n=300, seed=3)
        for name in ML_NAMES:
            expected = masked_reference(z, y, name)[0]
            assert abs(got[f"multilabel_{name}"] - float(expected)) < 1e-9, (rank, name)


def _all_ignored_worker(rank, world, port, path):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    logits, targets = data(n=300, k=4, seed=3)
    z, y = multilabel_data(n=300, seed=3)
    if rank == 0:  # every target of this rank's batch is ignore_index / unknown
        logits, targets, z, y = logits[:8], torch.full((8,), -100), z[:8], torch.full((8, 4), -1)
    metrics = {
        "adaece": TM.AdaptiveCalibrationError(4, from_logits=True, ignore_index=-100),
        "aurc_entropy": TM.CalibrationMetric(4, "aurc", from_logits=True, ignore_index=-100, score="entropy"),
    }
    for metric in metrics.values():
        metric.update(logits, targets)
    out = {name: float(m.compute()) for name, m in metrics.items()}  # compute() syncs across ranks
    for name in ("adaece", "auroc"):  # metrics that keep every row
        metric = TM.MultilabelCalibrationMetric(4, name, from_logits=True, ignore_index=-1)
        metric.update(z, y)
        out[f"multilabel_{name}"] = float(metric.compute())
    with open(f"{path}.{rank}", "w") as fh:
        json.dump(out, fh)
    dist.destroy_process_group()


def test_sync_with_a_rank_whose_targets_are_all_ignored(tmp_path):
    """A rank that saw only ignored targets still sends its (empty) rows in the rows' dtype and width, so the
    all-gather goes through and the value is the other rank's."""
    mp.start_processes(_all_ignored_worker, args=(2, free_port(), str(tmp_path / "out")), nprocs=2,
                       start_method="spawn")  # fmt: skip
    logits, targets = data(n=300, k=4, seed=3)
    z, y = multilabel_data(n=300, seed=3)
    expected = {"adaece": F.adaece(logits, targets, from_logits=True),
                "aurc_entropy": F.aurc(logits, targets, from_logits=True, score="entropy"),
                "multilabel_adaece": masked_reference(z, y, "adaece")[0],
                "multilabel_auroc": masked_reference(z, y, "auroc")[0]}  # fmt: skip
    for rank in range(2):
        got = json.loads((tmp_path / f"out.{rank}").read_text())
        for name, value in expected.items():
            assert abs(got[name] - float(value)) < 1e-9, (rank, name)


def _no_update_worker(rank, world, port, path):
    import datetime
    import warnings

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    logits, targets = data(n=300, k=4, seed=3)
    z, y = multilabel_data(n=300, seed=3)
    metrics = {
        "adaece": TM.AdaptiveCalibrationError(4, from_logits=True),
        "aurc_entropy": TM.CalibrationMetric(4, "aurc", from_logits=True, score="entropy"),
        "multilabel_auroc": TM.MultilabelCalibrationMetric(4, "auroc", from_logits=True, ignore_index=-1),
    }
    out = {}
    for epoch, start in enumerate((0, 100)):  # the second epoch after a reset
        for name, metric in metrics.items():
            if rank == 1:  # rank 0 never calls update
                batch = (z, y) if name.startswith("multilabel") else (logits, targets)
                metric.update(batch[0][start:], batch[1][start:])
            with warnings.catch_warnings():  # torchmetrics warns of compute before update on rank 0
                warnings.simplefilter("ignore")
                out[f"{name}_{epoch}"] = float(metric.compute())  # compute() syncs across ranks
            metric.reset()
    with open(f"{path}.{rank}", "w") as fh:
        json.dump(out, fh)
    dist.destroy_process_group()


def test_sync_with_a_rank_that_never_calls_update(tmp_path):
    """A rank that never calls update (before and after a reset) sends an empty block of rows in the rows'
    dtype and width; torchmetrics' placeholder for an empty list (a 1-D float32 tensor) aborted gloo."""
    mp.start_processes(_no_update_worker, args=(2, free_port(), str(tmp_path / "out")), nprocs=2,
                       start_method="spawn")  # fmt: skip
    logits, targets = data(n=300, k=4, seed=3)
    z, y = multilabel_data(n=300, seed=3)
    expected = {}
    for epoch, start in enumerate((0, 100)):  # the values of rank 1's rows alone, one-shot
        expected[f"adaece_{epoch}"] = F.adaece(logits[start:], targets[start:], from_logits=True)
        expected[f"aurc_entropy_{epoch}"] = F.aurc(logits[start:], targets[start:], from_logits=True,
                                                   score="entropy")  # fmt: skip
        expected[f"multilabel_auroc_{epoch}"] = masked_reference(z[start:], y[start:], "auroc")[0]
    for rank in range(2):
        got = json.loads((tmp_path / f"out.{rank}").read_text())
        for name, value in expected.items():  # the same rows, float64 sums in another order: rounding
            assert abs(got[name] - float(value)) < 1e-9, (rank, name)


# -- MetricCollection compute groups: settings that change update keep metrics apart ---------------------


def _confident_after_uniform(k=4):
    """A first batch of uniform rows (confidence 1/K: below every S99 threshold and equal for every
    setting), then batches of spread confidences."""
    g = torch.Generator().manual_seed(5)
    first = torch.zeros(32, k, dtype=torch.float64), torch.randint(0, k, (32,), generator=g)
    rest = 4 * torch.randn(256, k, generator=g, dtype=torch.float64), torch.randint(0, k, (256,), generator=g)
    return [first, (rest[0][:128], rest[1][:128]), (rest[0][128:], rest[1][128:])]


def test_collection_keeps_metrics_with_other_settings_apart():
    """Compute groups compare states after the first update; a first batch that gives equal sums once
    merged s99_threshold=0.8 / 0.95 / 0.99 into one value."""
    batches = _confident_after_uniform()
    thresholds = (0.8, 0.95, 0.99)
    collection = MetricCollection({
        f"s99_{int(100 * t)}": TM.CalibrationMetric(4, "s99_fraction", from_logits=True, s99_threshold=t) for t in thresholds
    })  # fmt: skip
    for logits, targets in batches:
        collection.update(logits, targets)
    out = collection.compute()
    logits = torch.cat([b[0] for b in batches])
    targets = torch.cat([b[1] for b in batches])
    values = []
    for t in thresholds:
        ref = CalibrationMetrics(4, from_logits=True, s99_threshold=t)
        ref.update(logits, targets)
        torch.testing.assert_close(out[f"s99_{int(100 * t)}"], ref.compute("s99_fraction")["s99_fraction"])
        values.append(float(out[f"s99_{int(100 * t)}"]))
    assert len(set(values)) == 3  # the data give three different values
    assert sorted(sorted(g) for g in collection.compute_groups.values()) == [
        [f"s99_{int(100 * t)}"] for t in thresholds
    ]


def test_collection_keeps_ignore_index_apart_and_still_shares_equal_settings():
    batches = _confident_after_uniform()
    batches[1][1][:40] = -100  # padding appears after the first batch
    collection = MetricCollection({
        "ece_ignore": TM.ExpectedCalibrationError(4, from_logits=True, ignore_index=-100),
        "mce_ignore": TM.MaxCalibrationError(4, from_logits=True, ignore_index=-100),
        "ece_logits": TM.ExpectedCalibrationError(4, from_logits=True),
    })  # fmt: skip
    collection.update(*batches[0])
    assert sorted(sorted(g) for g in collection.compute_groups.values()) == [["ece_ignore", "mce_ignore"],
                                                                           ["ece_logits"]]  # fmt: skip
    # the metric without ignore_index refuses the padding targets instead of merging silently
    with pytest.raises(ValueError, match="must lie in"):
        collection.update(*batches[1])


def test_token_layout_through_class_dim():
    """Hugging Face's (N, T, K) token logits with class_dim=-1; T == K without class_dim is refused."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 7, 3, generator=g, dtype=torch.float64)  # (N, T, K)
    targets = torch.randint(0, 3, (5, 7), generator=g)
    targets[:, 5:] = -100
    keep = targets.reshape(-1) != -100
    rows, flat = logits.reshape(-1, 3)[keep], targets.reshape(-1)[keep]
    metric = TM.ExpectedCalibrationError(3, from_logits=True, ignore_index=-100, class_dim=-1)
    metric.update(logits, targets)
    torch.testing.assert_close(metric.compute(), F.expected_calibration_error(rows, flat, from_logits=True))
    with pytest.raises(ValueError, match="pass class_dim=-1"):
        TM.ExpectedCalibrationError(3, from_logits=True, ignore_index=-100).update(logits, targets)
    square = torch.randn(4, 3, 3, generator=g, dtype=torch.float64)  # (N, T, K) with T == K
    square_targets = torch.randint(0, 3, (4, 3), generator=g)
    with pytest.raises(ValueError, match="ambiguous"):
        TM.ExpectedCalibrationError(3, from_logits=True).update(square, square_targets)
    for dim, rows in ((-1, square.reshape(-1, 3)), (1, square.movedim(1, -1).reshape(-1, 3))):
        metric = TM.ExpectedCalibrationError(3, from_logits=True, class_dim=dim)
        metric.update(square, square_targets)
        expected = F.expected_calibration_error(rows, square_targets.reshape(-1), from_logits=True)
        torch.testing.assert_close(metric.compute(), expected)
    with pytest.raises(ValueError, match="class_dim"):
        TM.ExpectedCalibrationError(3, class_dim=0).update(square, square_targets)


# -- multi-label -------------------------------------------------------------------------------------------

ML_NAMES = ("ece", "mce", "adaece", "brier", "nll", "error", "auroc")


def multilabel_data(n=300, labels=4, seed=0, unknown=0.2):
    """Sigmoid logits and 0/1 targets drawn from a miscalibrated model; a share of targets unknown (-1)."""
    g = torch.Generator().manual_seed(seed)
    z = 2 * torch.randn(n, labels, generator=g, dtype=torch.float64)
    y = (torch.rand(n, labels, generator=g, dtype=torch.float64) < torch.sigmoid(z / 2)).long()
    y[torch.rand(n, labels, generator=g) < unknown] = -1
    return z, y


def masked_reference(z, y, name):
    """The one-shot functional value of each label on its known targets, and their macro mean."""
    one_label = {
        "ece": lambda p, t: F.multilabel_ece(p, t),
        "mce": lambda p, t: F.multilabel_mce(p, t),
        "adaece": lambda p, t: F.multilabel_adaece(p, t),
        "brier": lambda p, t: F.multilabel_brier_score(p, t),
        "nll": lambda p, t: F.multilabel_nll(p, t),
        "error": lambda p, t: ((p >= 0.5).double() != t).double().mean(),
        "auroc": lambda p, t: F.multilabel_auroc(p, t),
    }[name]
    p = torch.sigmoid(z)
    per_label = torch.stack([one_label(p[y[:, j] >= 0, j], y[y[:, j] >= 0, j]) for j in range(z.shape[1])])
    return per_label.mean(), per_label


@pytest.mark.parametrize("name", ML_NAMES)
def test_multilabel_metric_masks_unknown_targets(name):
    z, y = multilabel_data()
    metric = TM.MultilabelCalibrationMetric(4, name, from_logits=True, ignore_index=-1)
    per_label = TM.MultilabelCalibrationMetric(4, name, average="none", from_logits=True, ignore_index=-1)
    for i in range(0, 300, 64):
        metric.update(z[i : i + 64], y[i : i + 64])
        per_label.update(z[i : i + 64], y[i : i + 64])
    macro, expected = masked_reference(z, y, name)
    # float64 sums in another order than the one-shot functions: a few ulps of values of order 1
    torch.testing.assert_close(per_label.compute(), expected, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(metric.compute(), macro, rtol=1e-9, atol=1e-12)


def test_multilabel_metric_equals_the_streaming_accumulator_and_micro():
    """Without unknown targets every value equals MultilabelCalibrationMetrics'; micro pools the pairs."""
    from torchcal.metrics import MultilabelCalibrationMetrics

    z, y = multilabel_data(unknown=0.0)
    ref = MultilabelCalibrationMetrics(4, from_logits=True)
    ref.update(z, y)
    expected = ref.compute()
    collection = MetricCollection(
        {f"{name}_{avg}": TM.MultilabelCalibrationMetric(4, name, avg, from_logits=True)
         for name in ("ece", "mce", "adaece", "brier", "nll", "error") for avg in ("macro", "micro", "none")}
    )  # fmt: skip
    for i in range(0, 300, 100):
        collection.update(z[i : i + 100], y[i : i + 100])
    out = collection.compute()
    for key in ("ece", "mce", "adaece", "brier", "nll", "error"):
        torch.testing.assert_close(out[f"{key}_macro"], expected[key], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(out[f"{key}_none"], expected[f"{key}_per_label"], rtol=1e-9, atol=1e-12)
    p = torch.sigmoid(z)
    torch.testing.assert_close(
        out["ece_micro"], F.multilabel_ece(p, y, average="micro"), rtol=1e-9, atol=1e-12
    )
    torch.testing.assert_close(
        out["adaece_micro"], F.multilabel_adaece(p, y, average="micro"), rtol=1e-9, atol=1e-12
    )
    torch.testing.assert_close(out["brier_micro"], ((p - y) ** 2).mean(), rtol=1e-9, atol=1e-12)
    # one state for every binned metric and average (their settings are equal)
    groups = [sorted(g) for g in collection.compute_groups.values()]
    assert sorted(f"{n}_{a}" for n in ("ece", "mce", "brier", "nll", "error")
                  for a in ("macro", "micro", "none")) in groups  # fmt: skip


def test_multilabel_token_layout_and_refusals():
    g = torch.Generator().manual_seed(7)
    z = torch.randn(3, 6, 2, generator=g, dtype=torch.float64)  # (N, T, L)
    y = torch.randint(0, 2, (3, 6, 2), generator=g)
    y[:, 4:] = -100
    metric = TM.MultilabelCalibrationMetric(
        2, "ece", "none", from_logits=True, ignore_index=-100, class_dim=-1
    )
    metric.update(z, y)
    rows, labels = z[:, :4].reshape(-1, 2), y[:, :4].reshape(-1, 2)  # the known tokens
    torch.testing.assert_close(
        metric.compute(), F.multilabel_ece(rows, labels, average="none", from_logits=True)
    )
    square = torch.randn(3, 2, 2, generator=g)
    with pytest.raises(ValueError, match="ambiguous"):
        TM.MultilabelCalibrationMetric(2).update(torch.sigmoid(square), torch.ones(3, 2, 2))
    unknown = y[:, 0].clone()
    unknown[0, 0] = -1
    with pytest.raises(ValueError, match="must be 0 or 1"):  # -1 without ignore_index is not a target
        TM.MultilabelCalibrationMetric(2, from_logits=True).update(z[:, 0], unknown)
    with pytest.raises(ValueError, match="`average` must be one of"):
        TM.MultilabelCalibrationMetric(2, "auroc", "micro")
    with pytest.raises(ValueError, match="expected num_labels=3"):
        TM.MultilabelCalibrationMetric(3).update(torch.rand(4, 2), torch.ones(4, 2))


def test_every_metric_of_the_accumulator_equals_calibration_metrics():
    # one wrapper for every metric of CalibrationMetrics, including the SPEC §9 ones: the same float64
    # state summed batch by batch in the same order, so equal to a few ulps
    from tests.conftest import make_probs
    from torchcal.metrics import METRICS

    probs, targets = make_probs(301, 5, seed=2)
    coll = MetricCollection({name: TM.CalibrationMetric(5, name) for name in METRICS})
    ranked = TM.CalibrationMetric(5, "aurc", score="entropy")
    ref, ref_ranked = CalibrationMetrics(5), CalibrationMetrics(5, score="entropy")
    for a, b in ((0, 3), (3, 100), (100, 301)):
        for m in (coll, ranked, ref, ref_ranked):
            m.update(probs[a:b], targets[a:b])
    got, want = coll.compute(), ref.compute()
    assert set(got) == set(METRICS) == set(want)
    for name in METRICS:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-12, msg=name)
    torch.testing.assert_close(ranked.compute(), ref_ranked.compute("aurc")["aurc"], rtol=0, atol=1e-12)
    assert not torch.isclose(ranked.compute(), want["aurc"])  # the ranking score changes the value


def test_field_metric_errors_and_reset():
    from tests.conftest import make_probs

    with pytest.raises(ValueError, match="metric"):
        TM.CalibrationMetric(3, "ece_sideways")
    with pytest.raises(ValueError, match="needs logits"):
        TM.CalibrationMetric(3, "aurc", score="energy")
    m = TM.CalibrationMetric(3, "ks")
    probs, targets = make_probs(50, 3, seed=1)
    m.update(probs, targets)
    first = m.compute()
    m.reset()
    m.update(probs, targets)
    torch.testing.assert_close(m.compute(), first)
