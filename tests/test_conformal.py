"""Split-conformal sets (SPEC §9.7): scores and quantile against loop references, MAPIE's sets on the same
data (golden values written by tests/data/make_mapie_conformal.py with MAPIE 1.6.0), TorchCP's anchor values
from the SPEC, the marginal and class-conditional coverage guarantees over 1,000 random splits, set metrics."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.reference import field as R
from torchcal.conformal import SplitConformalClassifier, tune_raps
from torchcal.functional import conformal as FC

GOLDEN = Path(__file__).parent / "data" / "mapie_conformal.npz"


@pytest.fixture(scope="module")
def golden():
    d = np.load(GOLDEN)
    z, y, n = torch.from_numpy(d["logits"]), torch.from_numpy(d["targets"]), int(d["n_cal"])
    return d, z[:n], y[:n], z[n:], y[n:]


def _probs(n, k, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(n, k, generator=g, dtype=torch.float64), 1)
    if ties:
        p = torch.round(p * 6) + 1e-3
        p = p / p.sum(1, keepdim=True)
    return p, torch.multinomial(p, 1, generator=g).squeeze(1), torch.rand(n, generator=g, dtype=torch.float64)


# ----------------------------------------------------------------------------- scores and quantile


@pytest.mark.parametrize("method", ["lac", "aps", "raps"])
@pytest.mark.parametrize("randomized", [False, True])
@pytest.mark.parametrize("ties", [False, True])
def test_scores_match_reference(method, randomized, ties):
    p, _, u = _probs(40, 6, seed=1, ties=ties)
    got = FC.conformal_scores(p, method, u=u if randomized else None, lambda_=0.2, k_reg=2)
    rows = p.tolist()
    want = [
        [R.conformal_score(r, y, method, float(u[i]) if randomized else None, 0.2, 2) for y in range(6)]
        for i, r in enumerate(rows)
    ]
    # the cumulative sums run in the same order (stable descending); 1e-15 covers the last rounding
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-15, rtol=0)


@pytest.mark.parametrize("n,alpha", [(1, 0.5), (9, 0.1), (19, 0.1), (100, 0.05), (1000, 0.1), (37, 0.33)])
def test_quantile_matches_order_statistic(n, alpha):
    g = torch.Generator().manual_seed(n)
    s = torch.rand(n, generator=g, dtype=torch.float64)
    want = R.conformal_qhat(s.tolist(), alpha)
    if math.isinf(want):
        with pytest.warns(UserWarning, match="too few"):
            assert math.isinf(float(FC.conformal_quantile(s, alpha)))
    else:
        assert float(FC.conformal_quantile(s, alpha)) == want
        # numpy's "lower" quantile at k/n is the same order statistic (MAPIE's formula)
        k = math.ceil((n + 1) * (1 - alpha))
        assert float(np.quantile(s.numpy(), k / n, method="lower")) == want


def test_quantile_edges():
    with pytest.warns(UserWarning, match="too few"):
        assert math.isinf(float(FC.conformal_quantile(torch.zeros(0), 0.1)))
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="alpha"):
            FC.conformal_quantile(torch.rand(10), bad)


# ----------------------------------------------------------------------------- MAPIE and TorchCP anchors


def test_lac_equals_mapie(golden):
    d, zc, yc, zt, yt = golden
    cp = SplitConformalClassifier("lac").fit(zc, yc, float(d["alpha"]))
    assert float(cp.qhat_) == pytest.approx(float(d["lac_qhat"]), abs=1e-12)
    sets = cp.predict_sets(zt)
    assert torch.equal(sets, torch.from_numpy(d["lac_sets"]).bool())
    assert float(FC.set_coverage(sets, yt)) == pytest.approx(0.9110, abs=5e-5)
    assert float(FC.average_set_size(sets)) == pytest.approx(3.7237, abs=5e-5)
    # TorchCP's CovGap and SSCV on these sets (SPEC §9.7.4)
    assert float(FC.class_coverage_gap(sets, yt, 0.1)) == pytest.approx(1.168, abs=5e-4)
    assert float(FC.size_stratified_coverage(sets, yt, 0.1)[0]) == pytest.approx(0.0387, abs=5e-5)


def test_aps_threshold_and_sets_equal_mapie(golden):
    d, zc, yc, zt, yt = golden
    u = torch.from_numpy(d["aps_calibration_u"])
    cp = SplitConformalClassifier("aps", randomized=True).fit(zc, yc, 0.1, u=u)
    # MAPIE's randomized calibration score with its uniforms: the same order statistic (cumulative sums in
    # a different order: a few ulps)
    assert float(cp.qhat_) == pytest.approx(float(d["aps_last_false_qhat"]), abs=1e-12)
    ours = cp.predict_sets(zt, randomized=False)
    mapie = torch.from_numpy(d["aps_last_false_sets"]).bool()
    # include_last_label=False: {y : C(x, y) <= q̂}, except that MAPIE never returns an empty set; where
    # ours is empty (top probability above q̂) MAPIE keeps the top label alone
    empty = ours.sum(1) == 0
    assert torch.equal(ours[~empty], mapie[~empty])
    top = torch.nn.functional.one_hot(zt[empty].argmax(1), 10).bool()
    assert torch.equal(mapie[empty], top) and int(empty.sum()) > 0
    # include_last_label=True (MAPIE's default) adds the label that crosses q̂ to every set
    cum_sorted = torch.softmax(zt, 1).sort(1, descending=True).values.cumsum(1)
    crossing = (cum_sorted < float(cp.qhat_) - 1e-8).sum(1) + 1
    assert torch.equal(torch.from_numpy(d["aps_last_true_sets"]).sum(1), crossing.clamp(max=10))


def test_torchcp_anchors(golden):
    _, zc, yc, zt, yt = golden
    cases = [  # (score, options, q̂, coverage, mean size, empty share, CovGap %, SSCV) from SPEC §9.7.4
        ("aps", {"randomized": False}, 0.947458, 0.9040, 4.1903, 0.0150, 1.010, 0.2373),
        (
            "raps",
            {"randomized": False, "lambda_": 0.1, "k_reg": 1},
            1.295671,
            0.9063,
            4.1453,
            0.0,
            None,
            None,
        ),
    ]
    for score, opts, qhat, cov, size, empty, gap, sscv in cases:
        cp = SplitConformalClassifier(score, **opts).fit(zc, yc, 0.1)
        m = FC.conformal_set_metrics(cp.predict_sets(zt), yt, 0.1)
        assert float(cp.qhat_) == pytest.approx(qhat, abs=5e-7)
        assert float(m["coverage"]) == pytest.approx(cov, abs=5e-5)
        assert float(m["set_size"]) == pytest.approx(size, abs=5e-5)
        assert float(m["empty"]) == pytest.approx(empty, abs=5e-5)
        if gap is not None:
            assert float(m["coverage_gap"]) == pytest.approx(gap, abs=5e-4)
            assert float(m["sscv"]) == pytest.approx(sscv, abs=5e-5)
    mondrian = SplitConformalClassifier("lac", mondrian=True).fit(zc, yc, 0.1)
    assert mondrian.qhat_.shape == (10,)
    m = FC.conformal_set_metrics(mondrian.predict_sets(zt), yt, 0.1)
    assert float(m["coverage"]) == pytest.approx(0.9170, abs=5e-5)
    assert float(m["set_size"]) == pytest.approx(3.8560, abs=5e-5)
    assert float(m["coverage_gap"]) == pytest.approx(2.808, abs=5e-4)
    # randomized APS depends on the generator stream (TorchCP's: 0.9163 / 3.99); ±0.01 as the SPEC says
    m = FC.conformal_set_metrics(SplitConformalClassifier("aps").fit(zc, yc, 0.1).predict_sets(zt), yt, 0.1)
    assert abs(float(m["coverage"]) - 0.9163) < 0.01 and abs(float(m["set_size"]) - 3.99) < 0.15


# ----------------------------------------------------------------------------- the guarantee


def _split_true_scores(score, n_splits, seed):
    """True-label scores of a 1,500-sample pool, (n_splits, 1500), with fresh uniforms per split (APS)."""
    p, y, _ = _probs(1500, 10, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    if score == "lac":
        s = FC.conformal_scores(p, "lac").gather(1, y[:, None]).squeeze(1).expand(n_splits, -1)
    else:
        cum = FC.conformal_scores(p, "aps").gather(1, y[:, None]).squeeze(1)
        u = torch.rand(n_splits, 1500, generator=g, dtype=torch.float64)
        s = cum - u * p.gather(1, y[:, None]).squeeze(1)
    perm = torch.argsort(torch.rand(n_splits, 1500, generator=g), dim=1)
    return s.gather(1, perm), y[perm]


@pytest.mark.parametrize("score", ["lac", "aps"])
@pytest.mark.parametrize("alpha", [0.1, 0.2])
def test_marginal_coverage_guarantee_over_1000_splits(score, alpha):
    n_splits, n_cal = 1000, 500
    s, _ = _split_true_scores(score, n_splits, seed=int(alpha * 100))
    k = math.ceil((n_cal + 1) * (1 - alpha))
    qhat = torch.kthvalue(s[:, :n_cal], k, dim=1).values
    cov = (s[:, n_cal:] <= qhat[:, None]).double().mean(1)
    mean, se = float(cov.mean()), float(cov.std()) / math.sqrt(n_splits)
    assert abs(mean - (1 - alpha)) < 0.005  # the bound: within 0.5 points
    # finite-sample interval 1 − α <= E[coverage] <= 1 − α + 1/(n+1) (continuous scores), widened by 4
    # standard errors of the mean over splits (a false alarm has probability ~6e-5)
    assert 1 - alpha - 4 * se <= mean <= 1 - alpha + 1 / (n_cal + 1) + 4 * se
    # coverage given a calibration set is Beta(k, n+1−k); with 1,000 test points a split's coverage is
    # Beta-binomial: its spread matches (the sample std of 1,000 splits is within ~2.2 % of σ per SE; 15 %)
    a, b, m = k, n_cal + 1 - k, 1000
    var = a * b * (a + b + m) / ((a + b) ** 2 * (a + b + 1) * m)
    assert abs(float(cov.std()) / math.sqrt(var) - 1) < 0.15


def test_predict_sets_agree_with_the_true_score_rule():
    p, y, _ = _probs(600, 10, seed=5)
    cp = SplitConformalClassifier("raps", randomized=True, from_logits=False).fit(p[:300], y[:300], 0.1)
    u = torch.rand(300, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    sets = cp.predict_sets(p[300:], u=u)
    s = FC.conformal_scores(p[300:], "raps", u=u, lambda_=0.1, k_reg=1).gather(1, y[300:, None]).squeeze(1)
    assert torch.equal(FC.set_coverage(sets, y[300:]), (s <= cp.qhat_).double().mean())


def test_mondrian_class_conditional_coverage_over_splits():
    n_splits, n_cal, alpha = 400, 700, 0.1
    s, y = _split_true_scores("lac", n_splits, seed=21)
    cal, test = (slice(0, n_cal), slice(n_cal, None))
    for c in range(10):
        in_cal = y[:, cal] == c
        masked = torch.where(in_cal, s[:, cal], torch.full_like(s[:, cal], math.inf)).sort(1).values
        n_c = in_cal.sum(1)
        k = torch.ceil((n_c + 1).double() * (1 - alpha)).long()
        qhat = torch.where(k <= n_c, masked.gather(1, (k - 1).clamp(min=0)[:, None]).squeeze(1), math.inf)
        in_test = (y[:, test] == c).double()
        covered = ((s[:, test] <= qhat[:, None]).double() * in_test).sum() / in_test.sum()
        # per class, over 400 splits: at least 1 − α up to 4 standard errors (~sqrt(.09 / (400 · n_test_c)))
        se = math.sqrt(alpha * (1 - alpha) / float(in_test.sum()))
        assert float(covered) >= 1 - alpha - 4 * se - 0.002, c


# ----------------------------------------------------------------------------- API


def test_api_errors_and_warnings():
    p, y, _ = _probs(50, 4, seed=2)
    cp = SplitConformalClassifier("lac", from_logits=False)
    with pytest.raises(RuntimeError, match="before fit"):
        cp.predict_sets(p)
    with pytest.raises(ValueError, match="score"):
        SplitConformalClassifier("thr").fit(p, y, 0.1)
    with pytest.raises(ValueError, match="alpha"):
        cp.fit(p, y, 1.5)
    cp.fit(p, y, 0.1)
    with pytest.raises(ValueError, match="4"):
        cp.predict_sets(torch.softmax(torch.rand(3, 5), 1))
    with pytest.raises(ValueError, match="u"):
        SplitConformalClassifier("aps", from_logits=False).fit(p, y, 0.1, u=torch.rand(3))
    y_missing = y.clone()
    y_missing[y_missing == 3] = 0
    with pytest.warns(UserWarning, match="too few"):
        mondrian = SplitConformalClassifier("lac", mondrian=True, from_logits=False).fit(p, y_missing, 0.1)
    assert math.isinf(float(mondrian.qhat_[3])) and bool(mondrian.predict_sets(p)[:, 3].all())


def test_seed_reproducible_and_logits_equal_probs():
    p, y, _ = _probs(200, 5, seed=3)
    a = SplitConformalClassifier("aps", seed=7).fit(p.log(), y, 0.2)
    b = SplitConformalClassifier("aps", seed=7, from_logits=False).fit(p, y, 0.2)
    assert float(a.qhat_) == pytest.approx(float(b.qhat_), abs=1e-12)
    assert torch.equal(a.predict_sets(p.log()), b.predict_sets(p))


def test_set_metrics_hand_values():
    sets = torch.tensor(
        [[True, False, False], [True, True, False], [True, True, True], [False, False, False]]
    )
    y = torch.tensor([0, 2, 1, 1])
    assert float(FC.set_coverage(sets, y)) == 0.5
    # class 0: 1/1, class 1: 1/2, class 2: 0/1 → macro 0.5; CovGap 100·(0.1 + 0.4 + 0.9)/3
    assert float(FC.set_coverage(sets, y, coverage_type="macro")) == pytest.approx(0.5)
    assert float(FC.class_coverage_gap(sets, y, 0.1)) == pytest.approx(100 * 1.4 / 3)
    assert FC.violated_classes(sets, y, 0.1) == 2
    assert FC.set_size_distribution(sets).tolist() == [0.25, 0.25, 0.25, 0.25]
    sscv, per = FC.size_stratified_coverage(sets, y, 0.1, strata=((0, 0), (1, 3)))
    assert per == {(0, 0): 0.0, (1, 3): pytest.approx(2 / 3)} and float(sscv) == pytest.approx(0.9)
    assert float(FC.size_stratified_coverage(sets[:0], y[:0], 0.1)[0]) == -1
    with pytest.raises(TypeError, match="boolean"):
        FC.set_coverage(sets.long(), y)


def test_tune_raps_picks_from_grid():
    p, y, _ = _probs(400, 10, seed=4)
    lam, k_reg = tune_raps(p, y, 0.1, from_logits=False)
    rank0 = (p.argsort(dim=1, descending=True, stable=True) == y[:, None]).double().argmax(1)
    assert k_reg == int(np.quantile(rank0.numpy(), 0.9, method="higher")) + 1
    sizes = {
        lam_: float(SplitConformalClassifier("raps", lambda_=lam_, k_reg=k_reg, from_logits=False)
                    .fit(p, y, 0.1).predict_sets(p).sum(1).double().mean())
        for lam_ in (0.001, 0.01, 0.1, 0.2, 0.5)
    }  # fmt: skip
    assert sizes[lam] == min(sizes.values())


def test_tune_raps_refuses_an_empty_grid():
    # an empty grid used to return (None, k_reg): a lambda_ that no RAPS predictor accepts
    p, y, _ = _probs(50, 4, seed=5)
    with pytest.raises(ValueError, match="`lambdas` must hold at least one value"):
        tune_raps(p, y, 0.1, lambdas=(), from_logits=False)


def test_tune_raps_accepts_half_precision_probabilities():
    # float16 probabilities are validated with float16's row-sum tolerance once, not again as their float32
    # upcast (rounding to float16 moves a row sum by a few 1e-4, beyond float32's 1e-4)
    p, y, _ = _probs(300, 6, seed=6)
    half = p.half()
    assert 1e-4 < float((half.double().sum(1) - 1).abs().max()) < 1e-2
    lam, k_reg = tune_raps(half, y, 0.1, from_logits=False)
    rows = half.double()  # the float16 values, ranked by a stable descending sort (ties: lower index first)
    rank0 = (rows.argsort(dim=1, descending=True, stable=True) == y[:, None]).double().argmax(1)
    assert k_reg == int(np.quantile(rank0.numpy(), 0.9, method="higher")) + 1
    sizes = {
        lam_: float(SplitConformalClassifier("raps", lambda_=lam_, k_reg=k_reg, from_logits=False)
                    .fit(half, y, 0.1).predict_sets(half).sum(1).double().mean())
        for lam_ in (0.001, 0.01, 0.1, 0.2, 0.5)
    }  # fmt: skip
    assert sizes[lam] == min(sizes.values())
    with pytest.raises(ValueError, match="must sum to 1"):  # 1.05: beyond float16's tolerance (1e-2)
        tune_raps((rows * 1.05).half(), y, 0.1, from_logits=False)


def test_uniforms_must_be_finite_and_in_the_unit_interval():
    # NaN passes a test for values outside [0, 1] (both comparisons are false); it gave a NaN score, hence a
    # NaN threshold at fit and empty sets at prediction. Refused by fit and predict_sets, with the value named
    p, y, u = _probs(60, 4, seed=7)
    cp = SplitConformalClassifier("aps", from_logits=False).fit(p, y, 0.1, u=u)
    for value in (math.nan, math.inf, -math.inf, 1.5, -0.25):
        shown = re.escape(str(value))
        bad = u.clone()
        bad[7] = value
        with pytest.raises(ValueError, match=rf"`u` must hold uniforms in \[0, 1\], found {shown}"):
            SplitConformalClassifier("aps", from_logits=False).fit(p, y, 0.1, u=bad)
        with pytest.raises(ValueError, match=rf"`u` must hold uniforms in \[0, 1\], found {shown}"):
            cp.predict_sets(p, u=bad)
    edges = u.clone()
    edges[:2] = torch.tensor([0.0, 1.0])  # the closed interval's ends are uniforms
    assert torch.isfinite(SplitConformalClassifier("raps", from_logits=False).fit(p, y, 0.1, u=edges).qhat_)
    assert cp.predict_sets(p, u=edges).shape == (60, 4)
