"""FieldMetrics: 7 uneven batches, a merge, and a sync over 2 gloo processes equal the one-shot functions."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torchcal.functional as F
from tests.conftest import free_port, make_probs
from torchcal.field_metrics import FieldMetrics

CUTS = [0, 3, 50, 51, 120, 200, 260, 301]  # 7 uneven batches of 301 rows (one of a single row)


def one_shot(probs, targets, n_bins=15, score="max_prob", from_logits=False):
    kw = {"from_logits": from_logits}
    d = F.calibration_error_direction(probs, targets, n_bins=n_bins, **kw)
    mass = F.calibration_error_direction(probs, targets, n_bins=n_bins, binning="mass", **kw)
    b = F.brier_decomposition(probs, targets, groups="width", n_bins=n_bins, **kw)
    ls = F.log_score_decomposition(probs, targets, groups="width", n_bins=n_bins, **kw)
    return {
        "ece": d.ece, "signed_ece": d.signed, "ece_over": d.over, "ece_under": d.under,
        "adaece_over": mass.over, "adaece_under": mass.under,
        "brier": b.score, "brier_reliability": b.reliability, "brier_resolution": b.resolution,
        "brier_uncertainty": b.uncertainty, "brier_within_variance": b.within_variance,
        "brier_within_covariance": b.within_covariance,
        "nll": ls.score, "log_reliability": ls.reliability, "log_resolution": ls.resolution,
        "log_uncertainty": ls.uncertainty, "log_within": ls.within,
        "ks": F.ks_calibration_error(probs, targets, **kw), "kuiper": F.kuiper_calibration_error(probs, targets, **kw),
        "aurc": F.aurc(probs, targets, score=score, **kw), "augrc": F.augrc(probs, targets, score=score, **kw),
    }  # fmt: skip


def _check(got, want):
    assert set(got) == set(want)
    for name, value in want.items():
        # the same float64 terms summed batch by batch: differences of a few ulps of O(1) sums
        torch.testing.assert_close(got[name], value.double(), rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n_bins", [15, 4])
def test_seven_uneven_batches_equal_one_shot(dtype, n_bins):
    probs, targets = make_probs(301, 5, seed=3, dtype=dtype)
    m = FieldMetrics(5, n_bins)
    for a, b in zip(CUTS[:-1], CUTS[1:]):
        m.update(probs[a:b], targets[a:b])
    assert m.num_samples == 301
    _check(m.compute(), one_shot(probs, targets, n_bins))


@pytest.mark.parametrize("score", ["entropy", "energy"])
def test_ranking_scores_stream(score):
    g = torch.Generator().manual_seed(4)
    logits, targets = (
        2 * torch.randn(301, 4, generator=g, dtype=torch.float64),
        torch.randint(0, 4, (301,), generator=g),
    )
    m = FieldMetrics(4, score=score, from_logits=True)
    for a, b in zip(CUTS[:-1], CUTS[1:]):
        m.update(logits[a:b], targets[a:b])
    _check(m.compute(), one_shot(logits, targets, score=score, from_logits=True))


def test_binned_decomposition_identities_hold_in_the_stream():
    probs, targets = make_probs(500, 6, seed=5)
    m = FieldMetrics(6)
    m.update(probs, targets)
    o = m.compute()
    brier = o["brier_reliability"] - o["brier_resolution"] + o["brier_uncertainty"]
    brier = brier + o["brier_within_variance"] - 2 * o["brier_within_covariance"]
    assert abs(float(brier - o["brier"])) <= 1e-10
    log = o["log_reliability"] - o["log_resolution"] + o["log_uncertainty"] + o["log_within"]
    assert abs(float(log - o["nll"])) <= 1e-10
    assert float(o["ece_over"] - o["ece_under"]) == pytest.approx(float(o["signed_ece"]), abs=1e-15)


def test_merge_reset_and_errors():
    probs, targets = make_probs(120, 3, seed=6)
    a, b = FieldMetrics(3), FieldMetrics(3)
    a.update(probs[:40], targets[:40])
    b.update(probs[40:], targets[40:])
    _check(a.merge(b).compute(), one_shot(probs, targets))
    a.reset()
    with pytest.raises(RuntimeError, match="before any update"):
        a.compute()
    with pytest.raises(ValueError, match="settings"):
        a.merge(FieldMetrics(3, 10))
    with pytest.raises(TypeError, match="FieldMetrics"):
        a.merge(object())
    with pytest.raises(ValueError, match="classes"):
        a.update(probs[:, :2] / probs[:, :2].sum(1, keepdim=True), targets.clamp(max=1))
    with pytest.raises(ValueError, match="needs logits"):
        FieldMetrics(3, score="energy")
    lean = FieldMetrics(3, keep_rows=False)
    lean.update(probs, targets)
    assert "aurc" not in lean.compute() and "brier" in lean.compute()


def _worker(rank, world, port, path):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    probs, targets = make_probs(301, 4, seed=11)
    m = FieldMetrics(4)
    # uneven contiguous shards (rank 0: 120 rows in 3 batches, rank 1: 181 rows in 4): the gathered rows
    # come back in the one-shot order, so tie order is the same too
    cuts = [0, 7, 60, 120] if rank == 0 else [120, 121, 200, 250, 301]
    for a, b in zip(cuts[:-1], cuts[1:]):
        m.update(probs[a:b], targets[a:b])
    out = m.sync().compute()
    torch.save(dict(out), f"{path}.{rank}")
    dist.destroy_process_group()


def test_sync_over_two_gloo_processes_equals_one_shot(tmp_path):
    world, path = 2, str(tmp_path / "out")
    mp.start_processes(_worker, args=(world, free_port(), path), nprocs=world, start_method="spawn")
    probs, targets = make_probs(301, 4, seed=11)
    want = one_shot(probs, targets)
    for rank in range(world):
        _check(torch.load(f"{path}.{rank}", weights_only=True), want)


def test_large_batch_path_equals_small_batch_path(monkeypatch):
    # batches above _SMALL_BATCH entries sum each bin's rows in float64 without an (N, K) float64 copy
    import torchcal.field_metrics as FM

    probs, targets = make_probs(400, 6, seed=12, dtype=torch.float32)
    small = FieldMetrics(6)
    small.update(probs, targets)
    monkeypatch.setattr(FM, "_SMALL_BATCH", 10)
    large = FieldMetrics(6)
    large.update(probs, targets)
    # the same float64 sums in another order: a few ulps
    torch.testing.assert_close(large._sums, small._sums, rtol=1e-15, atol=1e-12)
    _check(large.compute(), one_shot(probs, targets))
