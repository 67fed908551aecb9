"""Signed ECE and its split, Brier/log-score decompositions, KS/Kuiper, selective prediction and OOD metrics
(SPEC §9.1-9.6): anchors, the float64 loop references of tests/reference/field.py, edge cases, properties.

Tolerances: the references sum the same float64 terms in another order; on these sizes (N <= 600) that moves a
result by at most ~N·1e-16, so 1e-12 is generous. Identities are checked to 1e-10 (the issue's bound)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.reference import field as R
from torchcal.functional import cumulative as CU
from torchcal.functional import decomposition as D
from torchcal.functional import selective as S
from torchcal.metrics import CalibrationMetrics

TOL = {"atol": 1e-12, "rtol": 0}


def _data(n, k, seed, ties=False, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = 2.5 * torch.randn(n, k, generator=g, dtype=torch.float64)
    probs = torch.softmax(logits, 1)
    if ties:  # coarse probabilities: many tied confidences and repeated rows
        probs = torch.round(probs * 8) + 1e-3
        probs = probs / probs.sum(1, keepdim=True)
    targets = torch.multinomial(probs, 1, generator=g).squeeze(1)
    return probs.to(dtype), targets


ANCHOR_CONF = [0.95, 0.9, 0.85, 0.7, 0.65, 0.6, 0.55, 0.3]
ANCHOR_CORRECT = [1, 0, 1, 1, 0, 0, 1, 0]


def _anchor(dtype):
    conf = torch.tensor(ANCHOR_CONF, dtype=dtype)
    probs = torch.cat([conf[:, None], ((1 - conf) / 3)[:, None].expand(-1, 3)], 1)  # class 0 predicted
    return probs, 1 - torch.tensor(ANCHOR_CORRECT)


# ----------------------------------------------------------------------------- §9.1 direction


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_direction_anchor_torchmetrics_bins(dtype):
    probs, targets = _anchor(dtype)
    d = D.calibration_error_direction(probs, targets, n_bins=5, convention="torchmetrics")
    torch.testing.assert_close([float(v) for v in d], [0.3, 0.1875, 0.24375, 0.05625], atol=1e-6, rtol=0)


def test_direction_anchor_default_bins_and_mass():
    probs, targets = _anchor(torch.float64)
    # SPEC §3 bins (m/M, (m+1)/M]: 0.6 falls in (0.4, 0.6], every bin over-confident (hand-computed)
    d = D.calibration_error_direction(probs, targets, n_bins=5)
    torch.testing.assert_close([float(v) for v in d], [0.1875, 0.1875, 0.1875, 0.0], atol=1e-12, rtol=0)
    d = D.calibration_error_direction(probs, targets, n_bins=3, binning="mass")
    torch.testing.assert_close([float(v) for v in d], [0.1875, 0.1875, 0.1875, 0.0], atol=1e-12, rtol=0)


def test_direction_singleton_bin_trap():
    # torchmetrics puts conf == 1.0 in its own bin: 0.525 (merged into the last bin it would be 0.475)
    probs = torch.tensor([[1.0, 0.0], [0.95, 0.05]])
    d = D.calibration_error_direction(probs, torch.tensor([1, 0]), n_bins=10, convention="torchmetrics")
    assert float(d.ece) == pytest.approx(0.525, abs=1e-6)


def test_direction_torchmetrics_bins_float32_confidences():
    # torchmetrics bins float32 confidences against float32 edges whatever the input dtype. The float64
    # confidence 0.5999999999999999 lies below the float64 edge 0.6 but rounds to the float32 edge 0.6: it
    # shares [0.6, 0.7) with 0.62 (hand-computed: acc 1/2, conf 0.61, ECE 0.11; in float64 bins it would be
    # 0.5·0.4 + 0.5·0.62 = 0.51)
    c = 0.5999999999999999
    probs = torch.tensor([[c, 1 - c], [c + 0.02, 0.98 - c]], dtype=torch.float64)
    d = D.calibration_error_direction(probs, torch.tensor([0, 1]), n_bins=10, convention="torchmetrics")
    assert float(d.ece) == pytest.approx(0.11, abs=1e-12)


def test_direction_torchmetrics_convention_equals_torchmetrics_at_bin_edges():
    # confidences on, just below and just above every edge, float64 and float32: torchmetrics' own ECE; it
    # sums in float32, so 1e-6 (SPEC §9.0)
    tm = pytest.importorskip("torchmetrics.functional.classification")
    for n_bins in (3, 7, 9, 10, 14, 15):
        edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64).tolist()
        for m in range(1, n_bins):
            for c in (m / n_bins, edges[m], np.nextafter(m / n_bins, 0), np.nextafter(m / n_bins, 1)):
                if c < 0.5:
                    continue
                for dtype in (torch.float64, torch.float32):
                    probs = torch.tensor([[c, 1 - c], [c + 0.02, 0.98 - c]], dtype=torch.float64).to(dtype)
                    y = torch.tensor([0, 1])
                    got = D.calibration_error_direction(probs, y, n_bins=n_bins, convention="torchmetrics")
                    want = tm.multiclass_calibration_error(probs, y, num_classes=2, n_bins=n_bins)
                    assert float(got.ece) == pytest.approx(float(want), abs=1e-6), (n_bins, c, dtype)


@pytest.mark.parametrize(
    "binning,convention", [("width", "torchcal"), ("width", "torchmetrics"), ("mass", "torchcal")]
)
@pytest.mark.parametrize("n,k,n_bins,ties", [(400, 5, 15, False), (300, 3, 7, True), (5, 4, 10, False)])
def test_direction_matches_reference(binning, convention, n, k, n_bins, ties):
    probs, targets = _data(n, k, seed=n + k, ties=ties)
    got = D.calibration_error_direction(probs, targets, n_bins=n_bins, binning=binning, convention=convention)
    want = R.direction(probs, targets, n_bins, binning, convention)
    torch.testing.assert_close([float(v) for v in got], list(want), **TOL)
    # identities: ECE = over + under, sECE = over − under = mean(conf) − accuracy for any binning
    assert float(got.ece) == pytest.approx(float(got.over + got.under), abs=1e-15)
    signed = D.signed_calibration_error(probs, targets)
    assert float(got.signed) == pytest.approx(float(signed), abs=1e-12)


def test_direction_from_logits_and_empty():
    probs, targets = _data(50, 4, seed=1)
    logits = probs.log()
    a = D.calibration_error_direction(logits, targets, from_logits=True)
    b = D.calibration_error_direction(probs, targets)
    torch.testing.assert_close(torch.stack(list(a)), torch.stack(list(b)), atol=1e-12, rtol=0)
    empty = D.calibration_error_direction(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    assert all(float(v) == 0 for v in empty)
    assert float(D.signed_calibration_error(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))) == 0


def test_direction_bad_arguments():
    probs, targets = _data(10, 3, seed=2)
    with pytest.raises(ValueError, match="binning"):
        D.calibration_error_direction(probs, targets, binning="quantile")
    with pytest.raises(ValueError, match="convention"):
        D.calibration_error_direction(probs, targets, convention="sklearn")
    with pytest.raises(ValueError, match="n_bins"):
        D.calibration_error_direction(probs, targets, n_bins=0)
    with pytest.raises(ValueError, match="targets"):
        D.calibration_error_direction(probs, targets + 5)


# ----------------------------------------------------------------------------- §9.3 decompositions


@pytest.mark.parametrize("n,k,ties", [(300, 4, True), (200, 10, False), (60, 2, True)])
def test_brier_decomposition_reference_and_identity(n, k, ties):
    probs, targets = _data(n, k, seed=3 * n + k, ties=ties)
    d = D.brier_decomposition(probs, targets)
    bs, rel, res, unc = R.brier_murphy(probs, targets)
    torch.testing.assert_close([float(v) for v in d[:4]], [bs, rel, res, unc], **TOL)
    assert float(d.within_variance) == 0 and float(d.within_covariance) == 0
    assert abs(float(d.reliability - d.resolution + d.uncertainty - d.score)) <= 1e-10


@pytest.mark.parametrize("n_bins", [1, 10, 15])
def test_brier_decomposition_binned_identity(n_bins):
    # with bins on the top-label confidence the three terms alone are not the score (SPEC §9.3: 0.7169 vs
    # 0.5297 on its example); the two within-bin terms restore it exactly
    probs, targets = _data(500, 10, seed=4)
    d = D.brier_decomposition(probs, targets, groups="width", n_bins=n_bins)
    total = d.reliability - d.resolution + d.uncertainty + d.within_variance - 2 * d.within_covariance
    assert abs(float(total - d.score)) <= 1e-10
    assert float(d.within_variance) > 0
    assert float(d.score) == pytest.approx(R.brier_murphy(probs, targets)[0], abs=1e-12)


@pytest.mark.parametrize("n,k,ties", [(300, 4, True), (200, 10, False), (60, 2, True)])
def test_log_score_decomposition_reference_and_identity(n, k, ties):
    probs, targets = _data(n, k, seed=5 * n + k, ties=ties)
    d = D.log_score_decomposition(probs, targets)
    torch.testing.assert_close([float(v) for v in d[:4]], list(R.log_murphy(probs, targets)), **TOL)
    assert float(d.within) == 0
    assert abs(float(d.calibration + d.refinement - d.score)) <= 1e-10
    binned = D.log_score_decomposition(probs, targets, groups="width", n_bins=10)
    assert (
        abs(float(binned.reliability - binned.resolution + binned.uncertainty + binned.within - binned.score))
        <= 1e-10
    )


def test_log_score_zero_probability_on_label_is_inf():
    probs = torch.tensor([[1.0, 0.0], [0.5, 0.5]], dtype=torch.float64)
    d = D.log_score_decomposition(probs, torch.tensor([1, 0]))
    assert math.isinf(float(d.score)) and math.isinf(float(d.reliability)) and float(d.within) == 0


def test_perfect_forecast_has_zero_reliability():
    # forecasts equal to the observed frequency of their group: REL = 0 for both scores
    probs = torch.tensor([[0.75, 0.25]] * 4 + [[0.5, 0.5]] * 2, dtype=torch.float64)
    targets = torch.tensor([0, 0, 0, 1, 0, 1])
    assert float(D.brier_decomposition(probs, targets).reliability) == pytest.approx(0, abs=1e-15)
    assert float(D.log_score_decomposition(probs, targets).reliability) == pytest.approx(0, abs=1e-15)


# ----------------------------------------------------------------------------- §9.2 KS / Kuiper


def test_ks_kuiper_binary_anchor():
    p1 = torch.tensor([0.1, 0.4, 0.35, 0.8, 0.9, 0.65, 0.2, 0.55], dtype=torch.float64)
    y = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1])
    assert float(CU.kuiper_calibration_error(p1, y, kind="binary")) == pytest.approx(0.13125, abs=1e-6)
    assert float(CU.ks_calibration_error(p1, y, kind="binary")) == pytest.approx(0.08125, abs=1e-6)


@pytest.mark.parametrize("n,k,ties", [(400, 6, False), (300, 3, True), (1, 3, False)])
def test_ks_kuiper_reference(n, k, ties):
    probs, targets = _data(n, k, seed=7 * n + k, ties=ties)
    pairs = R.top_pairs(probs, targets)
    ks, ku = R.cumulative([p for p, _ in pairs], [c for _, c in pairs])
    assert float(CU.ks_calibration_error(probs, targets)) == pytest.approx(ks, abs=1e-12)
    assert float(CU.kuiper_calibration_error(probs, targets)) == pytest.approx(ku, abs=1e-12)
    per_ks, per_ku = [], []
    for c in range(k):
        a, b = R.cumulative(probs[:, c].tolist(), (targets == c).double().tolist())
        per_ks.append(a)
        per_ku.append(b)
    got = CU.ks_calibration_error(probs, targets, kind="classwise", reduction="none")
    torch.testing.assert_close(got.tolist(), per_ks, **TOL)
    got = CU.kuiper_calibration_error(probs, targets, kind="classwise")
    assert float(got) == pytest.approx(sum(per_ku) / k, abs=1e-12)


def test_classwise_chunks_agree(monkeypatch):
    probs, targets = _data(200, 7, seed=8)
    whole = CU.kuiper_calibration_error(probs, targets, kind="classwise", reduction="none")
    monkeypatch.setattr(CU, "_CHUNK_ELEMENTS", 400)  # two classes per chunk
    torch.testing.assert_close(
        CU.kuiper_calibration_error(probs, targets, kind="classwise", reduction="none"), whole
    )


def test_ks_properties_and_edges():
    # N = 0 gives 0; Kuiper >= KS; a class absent from the targets still counts (t = 0)
    empty = torch.zeros(0, 3)
    assert float(CU.ks_calibration_error(empty, torch.zeros(0, dtype=torch.long))) == 0
    probs, targets = _data(100, 4, seed=9)
    targets[targets == 3] = 0
    ks = CU.ks_calibration_error(probs, targets, kind="classwise", reduction="none")
    ku = CU.kuiper_calibration_error(probs, targets, kind="classwise", reduction="none")
    assert bool((ku >= ks).all()) and float(ks[3]) > 0
    with pytest.raises(ValueError, match="2 classes"):
        CU.ks_calibration_error(probs, targets, kind="binary")


def test_ks_not_probmetrics_for_three_classes():
    # probmetrics reads column 1 whatever K is (1.0 on a 3-class toy); the top-label value here is small
    probs = torch.tensor([[0.8, 0.1, 0.1], [0.1, 0.8, 0.1], [0.1, 0.1, 0.8]], dtype=torch.float64)
    assert float(CU.ks_calibration_error(probs, torch.tensor([0, 1, 2]))) == pytest.approx(0.2, abs=1e-12)


# ----------------------------------------------------------------------------- §9.5 selective prediction


TU_PROBS = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.2])


def test_selective_anchors():
    targets = torch.tensor([0, 0, 1, 1, 0])
    assert float(S.aurc(TU_PROBS, targets)) == pytest.approx(0.1125, abs=1e-12)
    assert float(S.augrc(TU_PROBS, targets)) == pytest.approx(0.1, abs=1e-12)
    assert float(S.aurc(TU_PROBS, targets, ties="group")) == pytest.approx(0.09, abs=1e-12)
    assert float(S.augrc(TU_PROBS, targets, ties="group")) == pytest.approx(0.08, abs=1e-12)
    assert float(S.risk_at_coverage(TU_PROBS, torch.tensor([0, 0, 1, 1, 1]), 0.5)) == pytest.approx(1 / 3)


def test_risk_at_coverage_counts_the_decimal_coverage():
    # r_⌈N·c⌉ with ⌈N·c⌉ of the decimal c: 100 · 0.07 is 7.000000000000001 in float64, whose ceil (8) would
    # add a sample. The 8th most confident sample is the first error: r_7 = 0, r_8 = 1/8
    conf = torch.linspace(0.99, 0.5, 100, dtype=torch.float64)
    probs, targets = torch.stack([conf, 1 - conf], 1), torch.zeros(100, dtype=torch.long)
    targets[7] = 1
    assert float(S.risk_at_coverage(probs, targets, 0.07)) == 0.0
    # two-decimal coverages of N = 100 and three-decimal ones of N = 1000 and 300 against the exact rational
    # ⌈N·c⌉ (fractions) on the float64 loop reference's curve; both divide an exact count of errors by k, so
    # the values are equal
    from fractions import Fraction

    for n, digits in ((100, 2), (1000, 3), (300, 3)):
        probs, targets = _data(n, 3, seed=n)
        pairs = R.top_pairs(probs, targets)
        risks = [r for _, r, _ in R.selective_risks([p for p, _ in pairs], [1 - c for _, c in pairs])]
        for m in range(1, 10**digits + 1, 1 if digits == 2 else 7):
            k = math.ceil(Fraction(m, 10**digits) * n)
            assert float(S.risk_at_coverage(probs, targets, m / 10**digits)) == risks[k - 1], (n, m)


def test_coverage_at_risk_non_monotone_curve():
    # sorted errors [0, 1, 1, 1, 1] at ρ = 0.3: torch-uncertainty returns NaN, the answer is 0.2
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4], [0.55, 0.45]])
    assert float(S.coverage_at_risk(probs, torch.tensor([0, 1, 1, 1, 1]), 0.3)) == pytest.approx(0.2)
    # a later point can qualify after an earlier one failed: errors [1, 0, 0, 0] → r = 1, .5, .33, .25
    probs4 = probs[:4]
    assert float(S.coverage_at_risk(probs4, torch.tensor([1, 0, 0, 0]), 0.4)) == pytest.approx(1.0)
    assert math.isnan(float(S.coverage_at_risk(probs4, torch.tensor([1, 1, 1, 1]), 0.5)))


@pytest.mark.parametrize("score", ["max_prob", "entropy", "margin"])
@pytest.mark.parametrize("ties", [False, True])
def test_selective_matches_reference(score, ties):
    probs, targets = _data(300, 5, seed=11, ties=ties)
    conf = S.confidence_score(probs, score=score)
    errors = [1 - c for _, c in R.top_pairs(probs, targets)]
    cl = conf.tolist()
    for generalized, fn in [(False, S.aurc), (True, S.augrc)]:
        got = fn(probs, targets, score=score)
        assert float(got) == pytest.approx(R.aurc_per_sample(cl, errors, generalized), abs=1e-12)
        got = fn(probs, targets, score=score, ties="group")
        assert float(got) == pytest.approx(R.aurc_grouped(cl, errors, generalized), abs=1e-12)
    pts = R.selective_risks(cl, errors)
    for c in (0.01, 0.3, 0.5, 0.77, 1.0):
        want = pts[math.ceil(300 * c) - 1][1]
        assert float(S.risk_at_coverage(probs, targets, c, score=score)) == pytest.approx(want, abs=1e-12)
    for rho in (0.05, 0.2, 0.5):
        ok = [cov for cov, r, _ in pts if r <= rho]
        want = max(ok) if ok else math.nan
        got = float(S.coverage_at_risk(probs, targets, rho, score=score))
        assert (math.isnan(want) and math.isnan(got)) or got == pytest.approx(want, abs=1e-12)


@pytest.mark.usefixtures("cpu_backend")  # the radix sort (reversed input, read backwards) and torch.sort
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_selective_order_is_stable_descending_on_both_sort_paths(dtype):
    # tied confidences keep their input order (ties="sample" depends on it): a float32 or float64 input with
    # many ties, the curve against the float64 loop reference point by point, exact counts
    probs, targets = _data(500, 4, seed=21, ties=True, dtype=dtype)
    pairs = R.top_pairs(probs, targets)
    cl, errors = [c for c, _ in pairs], [1 - ok for _, ok in pairs]
    curve = S.risk_coverage_curve(probs, targets)
    want = R.selective_risks(cl, errors)
    torch.testing.assert_close(curve.risk, torch.tensor([r for _, r, _ in want], dtype=torch.float64),
                               rtol=0, atol=1e-15)  # fmt: skip
    torch.testing.assert_close(curve.threshold, torch.tensor(sorted(cl, reverse=True), dtype=torch.float64))
    assert float(S.aurc(probs, targets)) == pytest.approx(R.aurc_per_sample(cl, errors), abs=1e-12)
    assert float(S.augrc(probs, targets)) == pytest.approx(R.aurc_per_sample(cl, errors, True), abs=1e-12)
    m = CalibrationMetrics(4)
    m.update(probs, targets)
    assert float(m.compute("aurc")["aurc"]) == pytest.approx(R.aurc_per_sample(cl, errors), abs=1e-12)


def test_confidence_scores_and_explicit_confidence():
    probs, targets = _data(40, 4, seed=12)
    logits = probs.log() + 3.0  # logsumexp = 3: energy and max-logit differ from the probabilities
    torch.testing.assert_close(
        S.confidence_score(logits, score="energy", from_logits=True),
        torch.full((40,), 3.0, dtype=torch.float64),
    )
    torch.testing.assert_close(
        S.confidence_score(logits, score="max_logit", from_logits=True), probs.amax(1).log() + 3
    )
    ent = -(probs * probs.log()).sum(1)
    torch.testing.assert_close(S.confidence_score(probs, score="entropy"), -ent)
    a = S.aurc(probs, targets, confidence=-ent)
    torch.testing.assert_close(a, S.aurc(probs, targets, score="entropy"))
    with pytest.raises(ValueError, match="needs logits"):
        S.confidence_score(probs, score="energy")
    with pytest.raises(ValueError, match="confidence"):
        S.aurc(probs, targets, confidence=torch.ones(3))


def _half_softmax(n, seed, dtype=torch.float16):
    """Two-class probabilities rounded to ``dtype``, targets drawn from them, and the largest |row sum − 1|.
    Each entry moves by up to half an ulp (float16: 2.4e-4 near 1; bfloat16: 2e-3), beyond float32's row-sum
    tolerance (1e-4) and within the dtype's own (float16 1e-2, bfloat16 2e-2)."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(3 * torch.randn(n, 2, generator=g, dtype=torch.float64), 1)
    targets = torch.multinomial(probs, 1, generator=g).squeeze(1)
    probs = probs.to(dtype)
    return probs, targets, float((probs.double().sum(1) - 1).abs().max())


def _reference_confidence(probs, score):
    """Per-row confidence by plain float64 Python from the rows' values."""
    out = []
    for row in probs.double().tolist():
        if score == "entropy":
            out.append(sum(p * math.log(p) for p in row if p > 0))
        else:
            a, b = sorted(row, reverse=True)[:2]
            out.append(a - b)
    return out


@pytest.mark.parametrize("score", ["entropy", "margin"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_selective_scores_accept_half_precision_probabilities(score, dtype):
    # a valid float16 / bfloat16 softmax is validated in its own dtype (as every metric does), not again as
    # its float32 upcast: the selective metrics with score != "max_prob" and CalibrationMetrics accept it
    probs, targets, deviation = _half_softmax(80, seed=31, dtype=dtype)
    assert 1e-4 < deviation < (1e-2 if dtype == torch.float16 else 2e-2)
    conf = _reference_confidence(probs, score)
    errors = [1 - c for _, c in R.top_pairs(probs.double(), targets)]
    # the metrics depend on the ranking only; torchcal's confidences (float32 from the same values) keep the
    # reference's order when distinct reference values lie 1e-6 apart (float32 error here is ~1e-7), and
    # rows holding the same two values tie exactly in both
    gaps = [b - a for a, b in zip(sorted(set(conf)), sorted(set(conf))[1:])]
    assert min(gaps) > 1e-6
    pts = R.selective_risks(conf, errors)
    assert float(S.aurc(probs, targets, score=score)) == pytest.approx(
        R.aurc_per_sample(conf, errors), abs=1e-12
    )
    assert float(S.augrc(probs, targets, score=score)) == pytest.approx(
        R.aurc_per_sample(conf, errors, True), abs=1e-12
    )
    assert float(S.aurc(probs, targets, score=score, ties="group")) == pytest.approx(
        R.aurc_grouped(conf, errors), abs=1e-12
    )
    curve = S.risk_coverage_curve(probs, targets, score=score)
    torch.testing.assert_close(curve.risk.tolist(), [r for _, r, _ in pts], atol=1e-15, rtol=0)
    assert float(S.risk_at_coverage(probs, targets, 0.5, score=score)) == pytest.approx(pts[39][1], abs=1e-15)
    ok = [cov for cov, r, _ in pts if r <= 0.2]
    assert float(S.coverage_at_risk(probs, targets, 0.2, score=score)) == pytest.approx(max(ok), abs=1e-15)
    m = CalibrationMetrics(2, score=score)
    m.update(probs[:50], targets[:50])
    m.update(probs[50:], targets[50:])
    got = m.compute(["aurc", "augrc"])
    assert float(got["aurc"]) == pytest.approx(R.aurc_per_sample(conf, errors), abs=1e-12)
    assert float(got["augrc"]) == pytest.approx(R.aurc_per_sample(conf, errors, True), abs=1e-12)


@pytest.mark.parametrize("score", ["entropy", "margin"])
def test_selective_scores_refuse_half_probabilities_beyond_their_tolerance(score):
    # rows summing to 1.05 are outside float16's tolerance (1e-2): still refused, by every entry point
    probs, targets, _ = _half_softmax(40, seed=32)
    bad = (probs.double() * 1.05).half()
    for call in (
        lambda: S.aurc(bad, targets, score=score),
        lambda: S.risk_at_coverage(bad, targets, 0.5, score=score),
        lambda: S.coverage_at_risk(bad, targets, 0.5, score=score),
        lambda: S.confidence_score(bad, score=score),
        lambda: CalibrationMetrics(2, score=score).update(bad, targets),
    ):
        with pytest.raises(ValueError, match="must sum to 1"):
            call()


def test_selective_edges():
    one = torch.tensor([[0.6, 0.4]])
    assert math.isnan(float(S.aurc(one, torch.tensor([0]))))
    assert math.isnan(float(S.augrc(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long))))
    assert math.isnan(float(S.coverage_at_risk(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long), 0.1)))
    with pytest.raises(ValueError, match="coverage"):
        S.risk_at_coverage(TU_PROBS, torch.tensor([0, 0, 1, 1, 0]), 0.0)
    with pytest.raises(ValueError, match="ties"):
        S.aurc(TU_PROBS, torch.tensor([0, 0, 1, 1, 0]), ties="mean")
    curve = S.risk_coverage_curve(TU_PROBS, torch.tensor([0, 0, 1, 1, 0]))
    assert curve.coverage.tolist() == [0.2, 0.4, 0.6, 0.8, 1.0]
    torch.testing.assert_close(curve.generalized_risk, curve.risk * curve.coverage)


# ----------------------------------------------------------------------------- §9.6 OOD


def test_fpr95_anchor():
    scores = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.4, 0.2, 0.1])
    assert float(S.fpr_at_tpr(scores, torch.tensor([1, 0, 1, 0, 0, 1, 0]))) == pytest.approx(0.75)


def test_fpr95_plateau_rule():
    # a recall plateau at 0.95 spanning several thresholds: the TU rule takes its lowest threshold (largest FP)
    scores = torch.tensor([10.0] * 19 + [5.0, 4.0, 3.0, 2.0] + [1.0])
    is_ood = torch.tensor([1] * 19 + [0, 0, 0, 0] + [1])
    # recall 19/20 = 0.95 holds from threshold 10 (FP 0) down to 2 (FP 4): FPR = 4/4
    assert float(S.fpr_at_tpr(scores, is_ood)) == pytest.approx(1.0)
    assert float(S.fpr_at_tpr(scores, is_ood)) == pytest.approx(R.fpr_at_recall(scores, is_ood))
    # the first threshold whose recall reaches 0.95 (torch-uncertainty 0.13, scikit-learn): threshold 10
    assert float(S.fpr_at_tpr(scores, is_ood, rule="at_least")) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="rule"):
        S.fpr_at_tpr(scores, is_ood, rule="first")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ood_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.round(torch.randn(400, generator=g, dtype=torch.float64) * 4) / 4  # ties
    is_ood = (torch.rand(400, generator=g) < 0.3).long()
    scores = scores + is_ood
    assert float(S.fpr_at_tpr(scores, is_ood)) == pytest.approx(R.fpr_at_recall(scores, is_ood), abs=1e-12)
    assert float(S.average_precision(scores, is_ood)) == pytest.approx(
        R.average_precision(scores.tolist(), is_ood.tolist()), abs=1e-12
    )


def test_fpr_nearest_rule_matches_reference_at_every_level():
    # the nearest-recall block is found by two binary searches (the distance to the level falls, then rises):
    # against the reference's argmin over the reversed blocks, with heavy ties and recall plateaus, at
    # levels on and between the achievable recalls, 0 and 1 included
    g = torch.Generator().manual_seed(7)
    for _ in range(200):
        n = int(torch.randint(2, 60, (1,), generator=g))
        scores = torch.randint(0, 7, (n,), generator=g).double() / 6
        is_ood = torch.randint(0, 2, (n,), generator=g)
        if not 0 < int(is_ood.sum()) < n:  # (FPR needs both classes)
            continue
        for level in (0.0, 0.1, 0.25, 1 / 3, 0.5, 0.95, 0.999, 1.0):
            want = R.fpr_at_recall(scores, is_ood, level)
            for labels in (is_ood, is_ood.bool(), is_ood.float()):
                got = float(S.fpr_at_tpr(scores, labels, tpr=level))
                assert (math.isnan(want) and math.isnan(got)) or got == pytest.approx(want, abs=1e-15)


def test_ood_labels_are_checked_in_every_dtype():
    scores = torch.tensor([0.3, 0.2, 0.1])
    for bad in (torch.tensor([0, 2, 1]), torch.tensor([0, -1, 1]), torch.tensor([0.0, 0.5, 1.0])):
        with pytest.raises(ValueError, match="0/1"):
            S.fpr_at_tpr(scores, bad)
        with pytest.raises(ValueError, match="0/1"):
            S.average_precision(scores, bad)
    assert math.isnan(float(S.fpr_at_tpr(torch.zeros(0), torch.zeros(0, dtype=torch.long))))


def test_ood_scores_must_be_finite_floating_point():
    # NaN or inf scores have no place in a ranking (scikit-learn refuses them too): they used to give an FPR
    # and an AP silently; integer scores are refused for their dtype
    t = torch.tensor([1, 0, 1, 0])
    for value in (math.nan, math.inf, -math.inf):
        s = torch.tensor([0.9, value, 0.2, 0.5])
        for fn in (S.fpr_at_tpr, S.average_precision):
            with pytest.raises(ValueError, match="`scores` contains NaN or infinite values"):
                fn(s, t)
    for fn in (S.fpr_at_tpr, S.average_precision):
        with pytest.raises(TypeError, match="`scores` must be a floating-point tensor, got dtype torch.int"):
            fn(torch.tensor([3, 1, 2, 0]), t)
        with pytest.raises(ValueError, match=r"`scores` must have shape \(N,\)"):
            fn(torch.zeros(4, 1), t)
    with pytest.raises(ValueError, match="`labels` must hold 0/1"):
        S.average_precision(torch.tensor([0.3, 0.2]), torch.tensor([0, 2]))


def test_fpr_at_least_starts_at_the_infinite_threshold():
    # rule="at_least" takes the highest threshold whose recall reaches tpr among roc_curve's points, the
    # first of which is threshold +inf (nothing selected: recall 0, FPR 0). tpr = 0: FPR 0 (hand-computed);
    # tpr = 0.5: the block at 0.8 (one OOD of two, one ID of one selected): FPR 1
    scores, is_ood = torch.tensor([0.9, 0.8, 0.1]), torch.tensor([0, 1, 1])
    assert float(S.fpr_at_tpr(scores, is_ood, tpr=0.0, rule="at_least")) == 0.0
    assert float(S.fpr_at_tpr(scores, is_ood, tpr=0.5, rule="at_least")) == 1.0


def test_fpr_at_least_equals_sklearn_roc_curve():
    # scikit-learn's roc_curve (all points kept): the FPR of the first point whose TPR >= the level; ties and
    # every level from 0 to 1; the same float64 ratios, so equal exactly
    metrics = pytest.importorskip("sklearn.metrics")
    g = torch.Generator().manual_seed(41)
    for _ in range(30):
        scores = torch.randint(0, 9, (50,), generator=g).double() / 8
        is_ood = torch.randint(0, 2, (50,), generator=g)
        if not 0 < int(is_ood.sum()) < 50:
            continue
        fpr, tpr, _ = metrics.roc_curve(is_ood.numpy(), scores.numpy(), drop_intermediate=False)
        for level in (0.0, 0.05, 0.3, 0.5, 0.95, 1.0):
            want = float(fpr[np.argmax(tpr >= level)])
            assert float(S.fpr_at_tpr(scores, is_ood, tpr=level, rule="at_least")) == want


def test_average_precision_anchor_vs_sklearn_rule():
    # AP is the step rule (scikit-learn average_precision_score), not the trapezoid under the PR curve
    scores = torch.tensor([0.9, 0.8, 0.7, 0.1])
    assert float(S.average_precision(scores, torch.tensor([1, 0, 1, 0]))) == pytest.approx((1 + 2 / 3) / 2)


def test_ood_detection_metrics_scores():
    g = torch.Generator().manual_seed(3)
    z_in = 3 * torch.randn(300, 5, generator=g)
    z_out = torch.randn(200, 5, generator=g)
    for score in ("max_prob", "entropy", "margin", "max_logit", "energy"):
        m = S.ood_detection_metrics(z_in, z_out, score=score, from_logits=True)
        c_in = S.confidence_score(z_in, score=score, from_logits=True)
        c_out = S.confidence_score(z_out, score=score, from_logits=True)
        ood = -torch.cat([c_in, c_out])
        t = torch.cat([torch.zeros(300), torch.ones(200)]).double()
        pairs = (c_in[:, None] > c_out[None, :]).double() + 0.5 * (c_in[:, None] == c_out[None, :]).double()
        assert float(m.auroc) == pytest.approx(float(pairs.mean()), abs=1e-12)
        assert float(m.fpr95) == pytest.approx(R.fpr_at_recall(ood, t), abs=1e-12)
        assert float(m.aupr_out) == pytest.approx(R.average_precision(ood.tolist(), t.tolist()), abs=1e-12)
        assert float(m.aupr_in) == pytest.approx(
            R.average_precision((-ood).tolist(), (1 - t).tolist()), abs=1e-12
        )
        assert 0.5 < float(m.auroc) <= 1
    assert math.isnan(float(S.fpr_at_tpr(torch.tensor([0.1, 0.2]), torch.tensor([0, 0]))))


def test_numpy_inputs_accepted():
    probs, targets = _data(30, 3, seed=13)
    a = D.calibration_error_direction(probs.numpy(), targets.numpy())
    b = D.calibration_error_direction(probs, targets)
    assert float(a.ece) == float(b.ece)
    assert np.isfinite(float(S.aurc(probs.numpy(), targets.numpy())))


# ----------------------------------------------------------------------------- peers' values


def test_selective_ood_and_cumulative_equal_the_peers():
    """torch-uncertainty 0.13's AURC, AUGRC, FPR95 and probmetrics 1.3's Kuiper/KS (binary) on data without
    ties (tests/data/make_peer_selective.py). TU and probmetrics compute in float32 and report float32:
    1e-6 covers their rounding (SPEC §9.0)."""
    from pathlib import Path

    d = np.load(Path(__file__).parent / "data" / "peer_selective.npz")
    for i in range(3):
        probs, targets = torch.from_numpy(d[f"probs_{i}"]), torch.from_numpy(d[f"targets_{i}"])
        assert float(S.aurc(probs, targets)) == pytest.approx(float(d[f"tu_aurc_{i}"]), abs=1e-6)
        assert float(S.augrc(probs, targets)) == pytest.approx(float(d[f"tu_augrc_{i}"]), abs=1e-6)
        is_ood = torch.from_numpy((d[f"targets_{i}"] == 0).astype(np.int64))
        # torch-uncertainty 0.13 takes the first threshold with recall >= 0.95 (not the SPEC's nearest rule)
        fpr = S.fpr_at_tpr(torch.from_numpy(d[f"ood_scores_{i}"]), is_ood, rule="at_least")
        assert float(fpr) == pytest.approx(float(d[f"tu_fpr95_{i}"]), abs=1e-6)
        if f"pm_kuiper_{i}" in d:
            assert float(CU.kuiper_calibration_error(probs, targets, kind="binary")) == pytest.approx(
                float(d[f"pm_kuiper_{i}"]), abs=1e-6
            )
            assert float(CU.ks_calibration_error(probs, targets, kind="binary")) == pytest.approx(
                float(d[f"pm_ks_{i}"]), abs=1e-6
            )
