"""Venn-Abers (IVAP): against venn-abers 1.5.4 (golden values from benchmarks/conformance_venn_abers.py),
against literal isotonic refits with the test point added (tests/reference/venn_abers.py), hand-computed
cases and properties."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.reference.calibration_data import split, synthetic_logits
from tests.reference.venn_abers import (
    ivap_interval,
    ivap_one_vs_all,
    minmax_tables,
    minmax_tables_dense,
    threshold_value,
)
from torchcal.calibrators import VennAbers, create, from_json
from torchcal.calibrators.venn_abers import venn_abers_tables

GOLDENS = json.loads((Path(__file__).parent / "data" / "venn_abers_goldens.json").read_text())


def _case(name):
    c = GOLDENS["cases"][name]
    z, y = synthetic_logits(c["n"], c["k"], c["seed"], dtype=torch.float64)
    if c["round_logits"]:
        z = torch.round(z)
    return split(z, y), c


@pytest.mark.parametrize("name", sorted(GOLDENS["cases"]))
def test_matches_venn_abers_package(name):
    ((zc, yc), (zt, _)), c = _case(name)
    va = VennAbers().fit(zc, yc)
    p0, p1 = va.predict_interval(zt)
    # both compute the same rationals (label counts over block sizes) from the same float64 scores, with
    # the same ties; only the division and the merge round: a few ulps
    np.testing.assert_allclose(p0.numpy(), c["p0"], rtol=0, atol=1e-14)
    np.testing.assert_allclose(p1.numpy(), c["p1"], rtol=0, atol=1e-14)
    np.testing.assert_allclose(va.predict_proba(zt).numpy(), c["probs"], rtol=0, atol=1e-14)


@pytest.mark.parametrize("rounded", [False, True])
def test_matches_isotonic_refits_with_the_test_point_added(rounded):
    pytest.importorskip("sklearn")
    (zc, yc), (zt, _) = split(*synthetic_logits(240, 3, seed=11, dtype=torch.float64))
    if rounded:  # many tied calibration scores, and test scores equal to calibration scores
        zc, zt = torch.round(zc), torch.round(zt)
    zt = torch.cat([zt[:25], zc[:5], zc.amax(0, keepdim=True) + 20, zc.amin(0, keepdim=True) - 20])
    probs, r0, r1 = ivap_one_vs_all(torch.softmax(zc, 1).numpy(), yc.numpy(), torch.softmax(zt, 1).numpy())
    va = VennAbers().fit(zc, yc)
    p0, p1 = va.predict_interval(zt)
    # sklearn's PAV averages blocks in another order than our block sums: rounding only
    np.testing.assert_allclose(p0.numpy(), r0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(p1.numpy(), r1, rtol=0, atol=1e-12)
    np.testing.assert_allclose(va.predict_proba(zt).numpy(), probs, rtol=0, atol=1e-12)


def test_tables_by_hand():
    # sorted scores with labels 0, 1, 0, 1 (no ties); S = 0, 0, 1, 1, 2
    scores = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    labels = torch.tensor([[0, 1, 0, 1]])
    p0, p1 = venn_abers_tables(scores, labels)
    # position i: s inserted after the i lowest scores; PAV on the label sequence with s's label in place
    # i=0: with 0: 0 0 1 0 1 -> 0;        with 1: 1 0 1 0 1 -> (1 0)(1 0) 1 -> 1/2
    # i=1: with 0: 0 0 1 0 1 -> 0;        with 1: 0 1 1 0 1 -> 0 (1 1 0) 1 -> 2/3
    # i=2: with 0: 0 1 0 0 1 -> (1 0 0) = 1/3; with 1: 0 1 1 0 1 -> 2/3
    # i=3: with 0: 0 1 0 0 1 -> 1/3;      with 1: 0 1 0 1 1 -> 0 (1 0) 1 1 -> 1
    # i=4: with 0: 0 1 0 1 0 -> 0 (1 0)(1 0) -> 1/2; with 1: 1
    expected0 = torch.tensor([[0.0, 0.0, 1 / 3, 1 / 3, 1 / 2]], dtype=torch.float64)
    expected1 = torch.tensor([[1 / 2, 2 / 3, 2 / 3, 1.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(p0, expected0, rtol=0, atol=1e-15)
    torch.testing.assert_close(p1, expected1, rtol=0, atol=1e-15)
    for i in range(5):  # and the reference agrees at a score in each gap
        s = [0.05, 0.15, 0.25, 0.35, 0.45][i]
        r0, r1 = ivap_interval(scores[0].numpy(), labels[0].numpy(), [s])
        assert (r0[0], r1[0]) == pytest.approx((float(expected0[0, i]), float(expected1[0, i])), abs=1e-15)


def test_properties_interval_order_monotonicity_and_rows():
    (zc, yc), (zt, _) = split(*synthetic_logits(2000, 5, seed=2))
    va = create("ivap").fit(zc, yc)
    assert isinstance(va, VennAbers)
    p0, p1 = va.predict_interval(zt)
    assert p0.dtype == zt.dtype and p0.shape == zt.shape
    assert (p0 >= 0).all() and (p1 <= 1).all() and (p0 <= p1).all()
    assert (va.p0_[:, 1:] >= va.p0_[:, :-1]).all() and (va.p1_[:, 1:] >= va.p1_[:, :-1]).all()
    probs = va.predict_proba(zt)
    # float32 output of float64 rows summing to one: float32 rounding of 5 terms
    torch.testing.assert_close(probs.sum(1), torch.ones(len(zt)), rtol=0, atol=1e-6)


def test_class_absent_from_calibration_keeps_its_column():
    (zc, yc), (zt, _) = split(*synthetic_logits(600, 4, seed=7, dtype=torch.float64))
    keep = yc != 2
    va = VennAbers().fit(zc[keep], yc[keep])
    p0, p1 = va.predict_interval(zt)
    n_cal = int(keep.sum())
    assert (p0[:, 2] == 0).all()
    # isotonic fit on all-zero labels plus (s, 1): the 1 pools with every calibration score at or above s
    above = (torch.softmax(zc[keep], 1)[:, 2][None, :] >= torch.softmax(zt, 1)[:, 2][:, None]).sum(1)
    torch.testing.assert_close(p1[:, 2], 1 / (above + 1).double(), rtol=0, atol=1e-15)
    assert n_cal == va.scores_.shape[1]
    probs = va.predict_proba(zt)
    assert probs.shape == (300, 4) and (probs[:, 2] > 0).all()


def test_json_round_trip_and_device_agnostic_lookup():
    (zc, yc), (zt, _) = split(*synthetic_logits(400, 3, seed=8))
    va = VennAbers().fit(zc, yc)
    again = from_json(va.to_json())
    assert isinstance(again, VennAbers)
    assert torch.equal(again.predict_proba(zt), va.predict_proba(zt))
    assert all(torch.equal(a, b) for a, b in zip(again.predict_interval(zt), va.predict_interval(zt)))


@pytest.mark.parametrize("seed", range(6))
def test_tables_equal_the_min_max_formula_exactly(seed):
    """Every boundary of the fast tables against exact fractions from the O(N²)-per-position formula, with
    ties (scores rounded to a few levels), long runs of one label and all-zero / all-one rows."""
    g = torch.Generator().manual_seed(seed)
    n = 120
    levels = [4, 15, 60, 1000, 1000, 30][seed]
    scores = torch.sort((torch.rand(4, n, generator=g, dtype=torch.float64) * levels).floor() / levels, 1)[0]
    labels = (torch.rand(4, n, generator=g) < scores.float() * 0.8 + 0.1).long()
    labels[1] = (torch.arange(n) % 7 < 3).long()  # runs of one label
    labels[2] = 0 if seed % 2 else 1  # a single class
    p0, p1 = venn_abers_tables(scores, labels)
    for row in range(4):
        ref = minmax_tables(scores[row].numpy(), labels[row].tolist())
        for i, (r0, r1) in ref.items():
            # one division of exact integer counts on both sides: identical float64 values
            assert (float(p0[row, i]), float(p1[row, i])) == (float(r0), float(r1)), (row, i)


@pytest.mark.parametrize("seed", range(45))
def test_tables_equal_the_dense_min_max_formula(seed):
    """Random sizes up to 1,500 and label patterns (noisy monotone, constant, oscillating, convex,
    concave), with and without ties, against the formula over all pairs. Seeds 9, 24 and 40 are cases where
    stepping the bridge's left end several vertices against one tangent gives a smaller value (decision
    175); about one case in 30 of this generator is one."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(50, 1500, (1,), generator=g))
    kind = seed % 5
    scores = torch.sort(torch.rand(2, n, generator=g, dtype=torch.float64), 1)[0]
    if kind == 1:
        scores = (scores * int(torch.randint(2, 50, (1,), generator=g))).floor()
    x = torch.linspace(0, 1, n, dtype=torch.float64)[None].expand(2, n)
    prob = [
        scores,
        torch.rand(2, 1, generator=g, dtype=torch.float64).expand(2, n),
        0.5 + 0.45 * torch.sin(x * float(torch.randint(1, 20, (1,), generator=g)) * math.pi),
        x**3,
        1 - (1 - x) ** 0.3,
    ][kind]
    labels = (torch.rand(2, n, generator=g, dtype=torch.float64) < prob).long()
    p0, p1 = venn_abers_tables(scores, labels)
    for row in range(2):
        r0, r1 = minmax_tables_dense(scores[row].numpy(), labels[row].numpy())
        at = ~np.isnan(r0)
        # both divide the same integer counts once in float64: identical values
        np.testing.assert_array_equal(p0[row].numpy()[at], r0[at])
        np.testing.assert_array_equal(p1[row].numpy()[at], r1[at])


def test_large_calibration_set_against_the_threshold_formula():
    """N = 40,000 calibration scores with ties (the quadratic tables would need 1.6e9 entries per class):
    test scores at random, at calibration scores and outside their range, against a bisection on the
    min-max formula (tests/reference). Not against sklearn's refits: its IsotonicRegression pools X values
    closer than 1e-15 (``np.finfo(float64).resolution``), which 40,000 softmax scores have, and differs
    from the exact-tie pooling of IVAP here by up to 0.008."""
    z, y = synthetic_logits(40_040, 3, seed=21, dtype=torch.float64)
    zc, yc, zt = z[:40_000], y[:40_000], z[40_000:]
    zc[::3] = torch.round(zc[::3] * 4) / 4  # a third of the scores tied in runs
    zt = torch.cat([zt[:12], zc[:6], zc.amax(0, keepdim=True) + 20, zc.amin(0, keepdim=True) - 20])
    va = VennAbers().fit(zc, yc)
    p0, p1 = va.predict_interval(zt)
    pc, pt = torch.softmax(zc, 1).numpy(), torch.softmax(zt, 1).numpy()
    for k in range(3):
        order = np.argsort(pc[:, k], kind="stable")
        scores, labels = pc[order, k], (yc.numpy() == k)[order]
        for j, s in enumerate(pt[:, k]):
            r0 = threshold_value(scores, labels, int(np.searchsorted(scores, s, "right")), 0)
            r1 = threshold_value(scores, labels, int(np.searchsorted(scores, s, "left")), 1)
            # the bisection's error is the rounding of S_j − v·j (j ≤ 40,000): below 1e-11
            assert float(p0[j, k]) == pytest.approx(r0, abs=1e-10), (k, j)
            assert float(p1[j, k]) == pytest.approx(r1, abs=1e-10), (k, j)


def test_bad_input_is_refused():
    va = VennAbers().fit(torch.randn(50, 3), torch.randint(0, 3, (50,)))
    with pytest.raises(ValueError, match="has 4 classes"):
        va.predict_interval(torch.randn(5, 4))
    with pytest.raises(Exception, match="not fitted"):
        VennAbers().predict_interval(torch.randn(5, 3))
