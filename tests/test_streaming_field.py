"""CalibrationMetrics streams the metrics of SPEC §9: 7 uneven batches, a merge, and a sync over 2 gloo
processes equal the one-shot functions."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torchcal.functional as F
from tests.conftest import free_port, make_probs
from torchcal import metrics as M
from torchcal.metrics import CalibrationMetrics

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


def _stream(m, probs, targets, cuts=CUTS):
    for a, b in zip(cuts[:-1], cuts[1:]):
        m.update(probs[a:b], targets[a:b])
    return m


def _check(got, want):
    got = {k: v for k, v in got.items() if k in want}
    assert set(got) == set(want)
    for name, value in want.items():
        # the same float64 terms summed batch by batch: differences of a few ulps of O(1) sums
        torch.testing.assert_close(got[name], value.double(), rtol=0, atol=1e-12, msg=name)


@pytest.mark.usefixtures("cpu_backend")  # the C++ scan and the torch one
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n_bins", [15, 4])
def test_seven_uneven_batches_equal_one_shot(dtype, n_bins):
    probs, targets = make_probs(301, 5, seed=3, dtype=dtype)
    m = _stream(CalibrationMetrics(5, n_bins), probs, targets)
    assert m.num_samples == 301
    _check(m.compute(), one_shot(probs, targets, n_bins))


@pytest.mark.parametrize("score", ["entropy", "energy"])
def test_ranking_scores_stream(score):
    g = torch.Generator().manual_seed(4)
    logits, targets = (
        2 * torch.randn(301, 4, generator=g, dtype=torch.float64),
        torch.randint(0, 4, (301,), generator=g),
    )
    m = _stream(CalibrationMetrics(4, score=score, from_logits=True), logits, targets)
    _check(m.compute(), one_shot(logits, targets, score=score, from_logits=True))


def test_binned_decomposition_identities_hold_in_the_stream():
    probs, targets = make_probs(500, 6, seed=5)
    m = CalibrationMetrics(6)
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
    a, b = CalibrationMetrics(3), CalibrationMetrics(3)
    a.update(probs[:40], targets[:40])
    b.update(probs[40:], targets[40:])
    _check(a.merge(b).compute(), one_shot(probs, targets))
    a.reset()
    with pytest.raises(RuntimeError, match="before any update"):
        a.compute()
    for other in (CalibrationMetrics(3, 10), CalibrationMetrics(3, decompositions=False),
                  CalibrationMetrics(3, score="entropy")):  # fmt: skip
        with pytest.raises(ValueError, match="settings"):
            a.merge(other)
    with pytest.raises(TypeError, match="CalibrationMetrics"):
        a.merge(object())
    with pytest.raises(ValueError, match="classes"):
        a.update(probs[:, :2] / probs[:, :2].sum(1, keepdim=True), targets.clamp(max=1))
    with pytest.raises(ValueError, match="needs logits"):
        CalibrationMetrics(3, score="energy")
    with pytest.raises(ValueError, match="score"):
        CalibrationMetrics(3, score="max_probability")
    lean = CalibrationMetrics(3, equal_mass=False, decompositions=False)
    lean.update(probs, targets)
    out = lean.compute()
    assert "aurc" not in out and "brier_reliability" not in out and "signed_ece" in out
    assert lean._sums.numel() == M.state_size(3, 15)  # no per-bin vectors: 3·M + 2·K·M + 7
    with pytest.raises(ValueError, match="decompositions=True"):
        lean.compute("log_within")
    with pytest.raises(ValueError, match="equal_mass=True"):
        lean.compute(["ks", "ece"])
    with pytest.raises(ValueError, match="unknown"):
        lean.compute("ece_sideways")


def _worker(rank, world, port, path):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    probs, targets = make_probs(301, 4, seed=11)
    m = CalibrationMetrics(4, score="entropy")
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
    want = one_shot(probs, targets, score="entropy")
    for rank in range(world):
        _check(torch.load(f"{path}.{rank}", weights_only=True), want)


def test_chunked_float32_vector_sums_equal_one_pass(monkeypatch):
    # float32 batches are upcast chunk by chunk for the per-bin vector sums; any chunking gives the same
    # float64 sums up to summation order (a few ulps), and float64 batches need no chunks
    probs, targets = make_probs(400, 6, seed=12, dtype=torch.float32)
    whole = CalibrationMetrics(6)
    whole.update(probs, targets)
    monkeypatch.setattr(M, "_VECTOR_CHUNK", 10)  # 1 row per chunk
    rows = CalibrationMetrics(6)
    rows.update(probs, targets)
    torch.testing.assert_close(rows._sums, whole._sums, rtol=1e-15, atol=1e-12)
    _check(rows.compute(), one_shot(probs, targets))
    vec = M.top_bin_vector_sums(probs, targets, probs.amax(1), 15)
    vec64 = M.top_bin_vector_sums(probs.double(), targets, probs.amax(1), 15)
    torch.testing.assert_close(vec, vec64, rtol=1e-15, atol=1e-13)


def test_vector_sums_match_a_loop_reference():
    # Σ P_i and Σ onehot(y_i) per top-label bin, by a float64 loop over the samples
    probs, targets = make_probs(97, 4, seed=13, dtype=torch.float32)
    got = M.top_bin_vector_sums(probs, targets, probs.amax(1), 5)
    want = torch.zeros(2, 5, 4, dtype=torch.float64)
    for p, y in zip(probs.double().tolist(), targets.tolist()):
        conf = max(p)
        b = max(0, min(4, -(-conf * 5 // 1) - 1)) if conf > 0 else 0  # bins (m/M, (m+1)/M], 0 in bin 0
        for k in range(4):
            want[0, int(b), k] += p[k]
        want[1, int(b), y] += 1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [2, 10, 16, 17, 33, 300])  # the scan's fixed-length, masked and long rows
def test_scan_vector_sums_equal_the_torch_ones(cpp_extension, dtype, k):
    # the C++ scan adds each row to its bin's vector in the same pass; the torch reference bins the
    # confidences and index_adds the upcast rows: the same float64 terms in another order, so a few ulps
    # of sums of up to 3001 terms of at most 1 (the label counts are integers: exact); 3001 rows make
    # several parts of the scan for K >= 16, summed in part order
    from torchcal.functional import use_cpu_extension
    from torchcal.functional._inputs import scan_inputs

    probs, targets = make_probs(3001, k, seed=k, dtype=dtype)
    with use_cpu_extension(True):
        scan = scan_inputs(probs, targets, False, n_bins=15, bin_vectors=True)[2]
    assert scan.vectors is not None and scan.vectors.shape == (2, 15, k)
    want = M.top_bin_vector_sums(probs, targets, probs.amax(1), 15)
    torch.testing.assert_close(scan.vectors[0], want[0], rtol=0, atol=1e-12)
    assert torch.equal(scan.vectors[1], want[1])
    with use_cpu_extension(False):  # the torch path leaves them to top_bin_vector_sums
        assert scan_inputs(probs, targets, False, n_bins=15, bin_vectors=True)[2].vectors is None


@pytest.mark.usefixtures("cpu_backend")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scan_row_bins_are_the_top_label_bins(dtype):
    # the decompositions group rows by the bins the scan already found (no second binning pass): on both
    # paths they equal equal_width_index of the confidence, confidences on the edges b/M (rounded into the
    # dtype) and one ulp either side included
    from torchcal.functional._binning import equal_width_edges, equal_width_index
    from torchcal.functional._inputs import scan_inputs

    m = 7
    edges = equal_width_edges(m, dtype)
    conf = torch.cat([edges, torch.nextafter(edges, edges + 1), torch.nextafter(edges, edges - 1)])
    conf = conf.clamp(0.5, 1)  # a top label of two classes is at least 1/2
    probs = torch.stack([conf, 1 - conf], 1)
    targets = torch.arange(conf.shape[0]) % 2
    scan = scan_inputs(probs, targets, False, n_bins=m, row_bins=True)[2]
    assert scan.bins is not None and scan.bins.dtype == torch.int64
    torch.testing.assert_close(scan.bins, equal_width_index(scan.conf, m), rtol=0, atol=0)
    probs, targets = make_probs(301, 5, seed=3, dtype=dtype)
    scan = scan_inputs(probs, targets, False, n_bins=15, row_bins=True)[2]
    torch.testing.assert_close(scan.bins, equal_width_index(scan.conf, 15), rtol=0, atol=0)
    assert torch.equal(torch.bincount(scan.bins, minlength=15).double(), scan.top[0])


@pytest.mark.usefixtures("cpu_backend")
def test_float32_brier_sums_squares_in_float64_on_both_paths():
    # regression: the torch path took the row norm in float32 (relative error ~1e-7 against the C++ scan's
    # float64 squares), which the decompositions' within-group variance inherited
    probs, targets = make_probs(301, 5, seed=3, dtype=torch.float32)
    want = (
        sum(
            sum((p - (k == y)) ** 2 for k, p in enumerate(row))
            for row, y in zip(probs.double().tolist(), targets.tolist())
        )
        / 301
    )
    torch.testing.assert_close(
        F.brier(probs, targets).double(), torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-14
    )
    m = CalibrationMetrics(5)
    m.update(probs, targets)
    torch.testing.assert_close(
        m.compute("brier")["brier"], torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-14
    )
