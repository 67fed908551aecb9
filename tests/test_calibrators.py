"""Post-hoc calibrators: the estimator contract over the registry, and each method against a reference."""

import io
import math
import warnings

import numpy as np
import pytest
import torch

import torchcal.functional as F
from tests.reference import metrics as R
from torchcal.calibrators import (
    EnsembleTemperatureScaling,
    FocalTemperatureScaling,
    HistogramBinning,
    IsotonicCalibration,
    MatrixScaling,
    NotFittedError,
    SplineCalibration,
    TemperatureScaling,
    VectorScaling,
    create,
    from_json,
    list_calibrators,
)

# calibrators that never change the argmax; the others are documented to (one-vs-rest and affine maps)
ARGMAX_PRESERVING = {"ts", "fts", "ets", "spline"}
# these keep the order, but two calibrated values can round to one float32 number (decisions 172, 173)
ARGMAX_PRESERVING_BUT_TIES = {"pts", "iop"}
# the network calibrators' defaults train for 100,000 steps (PTS) / 40 epochs (IOP): shorter here
FAST_KW = {
    "fts": {"temperatures": [0.5, 1.0, 2.0, 3.0]},
    "pts": {"steps": 300, "lr": 1e-2},
    "iop": {"epochs": 5},
}


def synthetic(n=3000, k=5, sharpen=2.5, seed=0, dtype=torch.float32):
    """Targets sampled from a calibrated model, logits sharpened by a known factor."""
    g = torch.Generator().manual_seed(seed)
    true_logits = 1.5 * torch.randn(n, k, generator=g, dtype=torch.float64)
    targets = torch.multinomial(torch.softmax(true_logits, 1), 1, generator=g).squeeze(1)
    return (sharpen * true_logits).to(dtype), targets


@pytest.fixture(scope="module")
def data():
    return synthetic()


@pytest.mark.parametrize("name", list_calibrators())
class TestContract:
    def test_init_only_stores_arguments(self, name):
        cal = create(name, **FAST_KW.get(name, {}))
        assert not cal.is_fitted
        assert not [a for a in vars(cal) if a.endswith("_")]
        assert set(cal.get_params()) == set(vars(cal))

    def test_unfitted_use_is_a_clear_error(self, name, data):
        with pytest.raises(NotFittedError, match="not fitted yet"):
            create(name).transform(data[0])

    def test_fit_transform_output(self, name, data):
        logits, targets = data
        cal = create(name, **FAST_KW.get(name, {}))
        assert cal.fit(logits, targets) is cal
        assert cal.num_classes_ == 5
        for attr in cal.fitted_attributes:
            assert attr.endswith("_") and hasattr(cal, attr)
        probs = cal.transform(logits[:500])
        assert probs.shape == (500, 5) and probs.dtype == logits.dtype
        assert torch.isfinite(probs).all() and (probs >= 0).all()
        torch.testing.assert_close(probs.sum(1), torch.ones(500), rtol=0, atol=1e-5)
        torch.testing.assert_close(cal.fit_transform(logits, targets), cal.transform(logits))
        if name in ARGMAX_PRESERVING:
            assert torch.equal(probs.argmax(1), logits[:500].argmax(1))
        if name in ARGMAX_PRESERVING_BUT_TIES:  # the input's top class keeps the highest probability
            top = logits[:500].argmax(1, keepdim=True)
            assert torch.equal(probs.gather(1, top)[:, 0], probs.amax(1))
        # calibrating miscalibrated logits must reduce ECE
        assert F.ece(cal.transform(logits), targets) < F.ece(logits, targets, from_logits=True)

    def test_wrong_number_of_classes_is_refused(self, name, data):
        cal = create(name, **FAST_KW.get(name, {})).fit(*data)
        with pytest.raises(ValueError, match="has 4 classes but this .* was fitted on 5"):
            cal.transform(torch.randn(3, 4))

    def test_bad_fit_input(self, name):
        cal = create(name)
        with pytest.raises(ValueError, match="`targets` must lie in"):
            cal.fit(torch.randn(4, 3), torch.tensor([0, 1, 2, 3]))
        with pytest.raises(ValueError, match="NaN"):
            cal.fit(torch.tensor([[float("nan"), 0.0]]), torch.tensor([0]))

    def test_state_dict_torch_save_and_json_round_trip(self, name, data):
        logits, targets = data
        cal = create(name, **FAST_KW.get(name, {})).fit(logits, targets)
        expected = cal.transform(logits[:100])
        buffer = io.BytesIO()
        torch.save(cal.state_dict(), buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
        restored = type(cal)().load_state_dict(state)
        torch.testing.assert_close(restored.transform(logits[:100]), expected)
        again = from_json(cal.to_json())
        assert type(again) is type(cal)
        torch.testing.assert_close(again.transform(logits[:100]), expected)

    def test_load_state_of_another_calibrator_is_refused(self, name, data):
        other = "ts" if name != "ts" else "ets"
        state = create(other).fit(*data).state_dict()
        with pytest.raises(ValueError, match="belongs to calibrator"):
            create(name).load_state_dict(state)


def test_registry_errors_and_aliases():
    with pytest.raises(ValueError, match="unknown calibrator 'platt'"):
        create("platt")
    assert isinstance(create("temperature_scaling"), TemperatureScaling)


# ----------------------------------------------------------------------------- temperature scaling


def test_ts_nll_matches_scipy_bounded_minimiser():
    optimize = pytest.importorskip("scipy.optimize")
    logits, targets = synthetic(n=2000, k=7, sharpen=1.7, seed=3, dtype=torch.float64)
    z, y = logits.numpy(), targets.numpy()

    def nll(log_t):
        s = z / math.exp(log_t)
        s = s - s.max(1, keepdims=True)
        return float(np.mean(np.log(np.exp(s).sum(1)) - s[np.arange(len(y)), y]))

    ref = optimize.minimize_scalar(
        nll, bounds=(math.log(0.01), math.log(100)), method="bounded", options={"xatol": 1e-10}
    )
    ts = TemperatureScaling().fit(logits, targets)
    assert ts.temperature_ == pytest.approx(math.exp(ref.x), rel=1e-6)


@pytest.mark.parametrize("sharpen", [0.5, 1.0, 2.5, 4.0])
def test_ts_recovers_a_known_temperature(sharpen):
    logits, targets = synthetic(n=40_000, k=10, sharpen=sharpen, seed=1)
    assert TemperatureScaling().fit(logits, targets).temperature_ == pytest.approx(sharpen, rel=0.04)


def test_ts_float32_fit_stops_at_the_slope_noise_floor(monkeypatch):
    # float32 slopes at K = 300 are noisy at ~1e-6: Newton used to wander around the root for a dozen
    # extra passes over the logits; now it stops once the slope is noise, at the float64 answer
    import torchcal.calibrators.temperature as T

    logits, targets = synthetic(n=4000, k=300, sharpen=2.5, seed=21)
    calls = []
    original = T._nll_slope
    monkeypatch.setattr(T, "_nll_slope", lambda *a: calls.append(1) or original(*a))
    t32 = T.fit_temperature_nll(logits, targets)
    assert len(calls) <= 8
    assert t32 == pytest.approx(T.fit_temperature_nll(logits.double(), targets), rel=1e-5)


def test_ts_ece_objective_is_the_first_grid_minimiser():
    logits, targets = synthetic(n=800, k=4, sharpen=2.0, seed=2, dtype=torch.float64)
    grid = [0.5 + 0.25 * i for i in range(12)]
    values = [R.ece(torch.softmax(logits / t, 1), targets, 15) for t in grid]
    expected = grid[int(np.argmin(values))]
    assert TemperatureScaling(objective="ece", grid=grid).fit(logits, targets).temperature_ == expected
    values = [R.adaece(torch.softmax(logits / t, 1), targets, 15) for t in grid]
    ts = TemperatureScaling(objective="adaece", grid=grid).fit(logits, targets)
    assert ts.temperature_ == grid[int(np.argmin(values))]


def test_ts_grid_ties_pick_the_first_temperature():
    logits = torch.tensor([[5.0, 0.0], [0.0, 5.0]])
    targets = torch.tensor([0, 1])
    # large temperatures all give ECE = 1 - conf, ...; with a grid of repeated values the first wins
    ts = TemperatureScaling(objective="ece", grid=[3.0, 3.0, 3.0], extend=False).fit(logits, targets)
    assert ts.temperature_ == 3.0


def test_ts_separable_data_hits_the_bound_with_a_warning():
    logits = torch.tensor([[3.0, 0.0], [0.0, 3.0], [2.0, 0.0]])
    with pytest.warns(UserWarning, match="hit the bound"):
        ts = TemperatureScaling(bounds=(0.05, 20.0)).fit(logits, torch.tensor([0, 1, 0]))
    assert ts.temperature_ == pytest.approx(0.05, rel=1e-6)


def test_ts_calibrated_logits_and_bad_objective():
    logits, targets = synthetic(n=500)
    ts = TemperatureScaling().fit(logits, targets)
    torch.testing.assert_close(ts.transform_logits(logits), logits / ts.temperature_)
    with pytest.raises(ValueError, match="`objective` must be one of"):
        TemperatureScaling(objective="brier").fit(logits, targets)


# ----------------------------------------------------------------------------- focal temperature scaling


@pytest.mark.parametrize("objective", ["adaece", "nll"])
def test_fts_grid_equals_brute_force(objective):
    logits, targets = synthetic(n=600, k=6, sharpen=2.0, seed=4, dtype=torch.float64)
    gammas, temps = [-0.5, 0.05, 1.0, 5.0], [0.5, 1.0, 1.5, 2.0, 3.0]
    scores = np.empty((len(gammas), len(temps)))
    for i, g in enumerate(gammas):
        for j, t in enumerate(temps):
            p = torch.tensor([R.focal_map(row, g) for row in torch.softmax(logits / t, 1).tolist()])
            scores[i, j] = R.adaece(p, targets, 15) if objective == "adaece" else R.nll(p, targets, 1e-300)
    i, j = np.unravel_index(np.argmin(scores), scores.shape)
    fts = FocalTemperatureScaling(gammas=gammas, temperatures=temps, objective=objective).fit(logits, targets)
    assert (fts.gamma_, fts.temperature_) == (gammas[i], temps[j])
    assert fts.objective_value_ == pytest.approx(scores[i, j], abs=1e-9)
    p = fts.transform(logits)
    value = F.adaece(p, targets) if objective == "adaece" else F.nll(p, targets)
    assert value.item() == pytest.approx(scores[i, j], abs=1e-9)


def test_fts_float32_fit_matches_float64_fit():
    logits, targets = synthetic(n=2000, k=10, sharpen=3.0, seed=6)
    kw = dict(temperatures=[round(0.25 * i, 2) for i in range(1, 17)])
    a = FocalTemperatureScaling(**kw).fit(logits, targets)
    b = FocalTemperatureScaling(**kw).fit(logits.double(), targets)
    assert (a.gamma_, a.temperature_) == (b.gamma_, b.temperature_)
    assert a.objective_value_ == pytest.approx(b.objective_value_, abs=1e-5)


def test_fts_extreme_logits_stay_finite():
    logits = torch.tensor([[200.0, 0.0, -50.0], [0.0, 90.0, 0.0], [1.0, 0.0, 0.5]])
    fts = FocalTemperatureScaling(temperatures=[0.01, 1.0]).fit(logits, torch.tensor([0, 1, 2]))
    assert math.isfinite(fts.objective_value_)
    assert torch.isfinite(fts.transform(logits)).all()


# ----------------------------------------------------------------------------- ensemble temperature scaling


def test_ets_weights_match_a_generic_constrained_optimiser():
    optimize = pytest.importorskip("scipy.optimize")
    logits, targets = synthetic(n=2000, k=5, sharpen=2.0, seed=7, dtype=torch.float64)
    ets = EnsembleTemperatureScaling().fit(logits, targets)
    p1 = torch.softmax(logits / ets.temperature_, 1).numpy()
    p0 = torch.softmax(logits, 1).numpy()
    onehot = np.eye(5)[targets.numpy()]

    def mse(w):
        return float((((w[0] * p1 + w[1] * p0 + w[2] / 5) - onehot) ** 2).sum(1).mean())

    ref = optimize.minimize(
        mse,
        x0=np.ones(3) / 3,
        method="SLSQP",
        bounds=[(0, 1)] * 3,
        constraints={"type": "eq", "fun": lambda w: w.sum() - 1},
        options={"ftol": 1e-14},
    )
    assert mse(ets.weights_.numpy()) <= ref.fun + 1e-10
    np.testing.assert_allclose(ets.weights_.numpy(), ref.x, atol=1e-4)
    assert ets.temperature_ == pytest.approx(TemperatureScaling().fit(logits, targets).temperature_)


# ----------------------------------------------------------------------------- non-parametric


def test_histogram_binning_matches_reference_frequencies():
    logits, targets = synthetic(n=700, k=3, seed=8, dtype=torch.float64)
    hb = HistogramBinning(n_bins=6).fit(logits, targets)
    probs = torch.softmax(logits, 1).tolist()
    for k in range(3):
        for m in range(6):
            members = [int(t) == k for row, t in zip(probs, targets) if R.equal_width_bin(row[k], 6) == m]
            got = hb.frequencies_[k, m].item()
            if members:
                assert got == pytest.approx(sum(members) / len(members), abs=1e-15)
            else:
                assert math.isnan(got)
    out = hb.transform(logits[:50])
    for row, p in zip(probs[:50], out.tolist()):
        raw = [hb.frequencies_[k, R.equal_width_bin(row[k], 6)].item() for k in range(3)]
        raw = [row[k] if math.isnan(v) else v for k, v in enumerate(raw)]
        expected = [v / sum(raw) for v in raw] if sum(raw) > 0 else [1 / 3] * 3
        np.testing.assert_allclose(p, expected, atol=1e-12)


def test_isotonic_matches_sklearn_per_class():
    isotonic = pytest.importorskip("sklearn.isotonic")
    logits, targets = synthetic(n=1500, k=4, seed=9, dtype=torch.float64)
    logits[:20] = logits[20:40]  # ties in the scores
    iso = IsotonicCalibration().fit(logits, targets)
    probs = torch.softmax(logits, 1).numpy()
    test = torch.softmax(synthetic(n=300, k=4, seed=10, dtype=torch.float64)[0], 1).numpy()
    cols = []
    for k in range(4):
        reg = isotonic.IsotonicRegression(out_of_bounds="clip").fit(probs[:, k], targets.numpy() == k)
        cols.append(reg.predict(test[:, k]))
    raw = np.stack(cols, 1)
    expected = raw / raw.sum(1, keepdims=True)
    got = iso.transform(torch.log(torch.from_numpy(test))).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-10)


def _sklearn_isotonic_ovr(probs, targets, test):
    """scikit-learn's IsotonicRegression(out_of_bounds="clip") per class, then rows divided by their sum."""
    isotonic = pytest.importorskip("sklearn.isotonic")
    cols = [
        isotonic.IsotonicRegression(out_of_bounds="clip").fit(probs[:, k], targets == k).predict(test[:, k])
        for k in range(probs.shape[1])
    ]
    raw = np.stack(cols, 1)
    return raw / raw.sum(1, keepdims=True)


def test_isotonic_pools_near_ties_as_sklearn_does():
    """Softmax scores equal in exact arithmetic (rows whose logits are permutations of each other) differ by
    an ulp; scikit-learn pools x values within 1e-15 of a run's first value (``_make_unique``), so these
    get one fitted value. Exact-tie pooling gives class 0 the values 0 and 1 here."""
    z = torch.tensor([[2.0, 0.0, 1.0, -3.0], [2.0, -3.0, 0.0, 1.0], [2.0, 1.0, -3.0, 0.0],
                      [-1.0, 0.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0]], dtype=torch.float64)  # fmt: skip
    y = np.array([1, 0, 0, 1, 0])
    p = torch.softmax(z, 1).numpy()
    assert len(set(p[:3, 0].tolist())) == 2  # the near-tie this is about
    got = IsotonicCalibration().fit(z, torch.from_numpy(y)).transform(z).numpy()
    # both average 0/1 labels and interpolate in float64: rounding only
    np.testing.assert_allclose(got, _sklearn_isotonic_ovr(p, y, p), rtol=0, atol=1e-12)


def test_isotonic_matches_sklearn_on_permuted_rows_and_random_data():
    """Random logits, a third of the rows repeated with their logits permuted (near-ties in every class),
    and some exact ties: predictions at the calibration scores and at new scores agree with sklearn's."""
    g = torch.Generator().manual_seed(5)
    logits, targets = synthetic(n=1200, k=4, seed=5, dtype=torch.float64)
    perm = torch.stack([torch.randperm(4, generator=g) for _ in range(400)])
    logits[800:] = logits[:400].gather(1, perm)
    logits[:30] = logits[30:60]
    cal = torch.softmax(logits, 1).numpy()
    y = targets.numpy()
    near = sum(len(set(np.round(cal[:, k], 14))) < len(set(cal[:, k])) for k in range(4))
    assert near == 4  # every class has scores within 1e-14 that are not equal
    iso = IsotonicCalibration().fit(logits, targets)
    new = synthetic(n=300, k=4, seed=6, dtype=torch.float64)[0]
    for test in (logits, new):
        expected = _sklearn_isotonic_ovr(cal, y, torch.softmax(test, 1).numpy())
        np.testing.assert_allclose(iso.transform(test).numpy(), expected, rtol=0, atol=1e-10)


def test_binary_isotonic_pools_near_ties_as_sklearn_does():
    from sklearn.isotonic import IsotonicRegression

    from torchcal.calibrators import BinaryIsotonicCalibration

    # σ(0.3) and σ(0.3 + 2e-15) differ by a few ulps (< 1e-15): one pool for sklearn, so the labels 0 and
    # 1 there give 0.5 and 0.5 (exact-tie pooling: 0 and 1)
    z = torch.tensor([-1.0, 0.3, 0.3 + 2e-15, 1.5], dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 1])
    p = torch.sigmoid(z).numpy()
    assert p[1] < p[2]
    expected = IsotonicRegression(out_of_bounds="clip").fit(p, y.numpy()).predict(p)
    # (p[2] lies a few ulps beyond the pool's x, p[1]: interpolated towards 1 by ~1e-15)
    np.testing.assert_allclose(expected, [0.0, 0.5, 0.5, 1.0], rtol=0, atol=1e-12)
    got = BinaryIsotonicCalibration().fit(z, y).transform(z).numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)


def test_repeated_fits_are_bitwise_identical():
    """ETS's simplex QP and the spline's least squares give the same bits on every fit (a solver whose
    result depends on the alignment of its work buffers would not; the allocations in between move them)."""
    logits, targets = synthetic(n=600, k=4, seed=12, dtype=torch.float64)
    ets, spline = set(), set()
    for i in range(10):
        _ = [torch.empty(1000 * (i + 1) + 7 * j, dtype=torch.float64) for j in range(3)]
        ets.add(tuple(EnsembleTemperatureScaling().fit(logits, targets).weights_.tolist()))
        spline.add(tuple(SplineCalibration().fit(logits, targets).coef_.tolist()))
    assert len(ets) == 1 and len(spline) == 1


def test_spline_fit_tracks_the_cumulative_accuracy_and_leaves_calibrated_data_nearly_alone():
    logits, targets = synthetic(n=20_000, k=5, sharpen=1.0, seed=11)  # calibrated already
    cal = SplineCalibration().fit(logits, targets)
    before = torch.softmax(logits, 1).max(1).values
    after = cal.transform(logits).max(1).values
    assert (after - before).abs().mean() < 0.02
    # the fitted spline reproduces the empirical cumulative accuracy curve
    from torchcal.calibrators.nonparametric import _natural_spline_basis

    conf, pred = torch.softmax(logits.double(), 1).max(1)
    order = torch.sort(conf, stable=True).indices
    cum = (pred == targets).double()[order].cumsum(0) / len(targets)
    s = torch.arange(1, len(targets) + 1, dtype=torch.float64) / len(targets)
    fit = _natural_spline_basis(s, cal.knots_) @ cal.coef_
    assert (fit - cum).abs().max() < 0.01


# ----------------------------------------------------------------------------- vector / matrix scaling


@pytest.mark.parametrize("cls", [VectorScaling, MatrixScaling])
def test_affine_scaling_reaches_the_nll_optimum(cls):
    optimize = pytest.importorskip("scipy.optimize")
    logits, targets = synthetic(n=1500, k=3, sharpen=2.0, seed=12, dtype=torch.float64)
    z, y = logits.numpy(), targets.numpy()
    k = 3
    matrix = cls is MatrixScaling

    def nll(theta):
        w = theta[: k * k].reshape(k, k) if matrix else theta[:k]
        b = theta[k * k :] if matrix else theta[k:]
        s = z @ w.T + b if matrix else z * w + b
        s = s - s.max(1, keepdims=True)
        return float(np.mean(np.log(np.exp(s).sum(1)) - s[np.arange(len(y)), y]))

    x0 = np.r_[np.eye(k).ravel(), np.zeros(k)] if matrix else np.r_[np.ones(k), np.zeros(k)]
    ref = optimize.minimize(nll, x0, method="BFGS", options={"gtol": 1e-10})
    cal = cls().fit(logits, targets)
    ours = F.nll(cal.transform(logits), targets).item()
    assert ours <= ref.fun + 1e-7


def test_vector_scaling_recovers_scale():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(20_000, 3, generator=g, dtype=torch.float64)
    y = torch.multinomial(torch.softmax(z * torch.tensor([2.0, 1.0, 0.5]), 1), 1, generator=g).squeeze(1)
    vs = VectorScaling().fit(z, y)
    # the softmax is invariant to a common shift of the bias only; weights are identified
    np.testing.assert_allclose(vs.weight_.numpy(), [2.0, 1.0, 0.5], atol=0.1)


@pytest.mark.parametrize("cls", [VectorScaling, MatrixScaling])
def test_affine_scaling_warns_when_a_class_is_absent_from_the_validation_labels(cls):
    """Class 2 never appears: its fitted probability collapses on every input (the issue's ~4e-9), which the
    warning names; with every class present there is no warning."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(400, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (400,), generator=g)
    y[y == 2] = 0
    with pytest.warns(
        RuntimeWarning, match=r"class 2 \(1 of 4\) never appear in the validation labels"
    ) as rec:
        cal = cls().fit(z, y)
    assert rec[0].filename == __file__  # points at the caller of fit()
    assert cal.transform(z)[:, 2].max() < 1e-3
    y[:4] = torch.arange(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cls().fit(z, y)


def test_warnings_are_not_raised_on_normal_fits(data):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TemperatureScaling().fit(*data)
        EnsembleTemperatureScaling().fit(*data)


def test_calibrator_specs_parse_and_name_their_errors():
    from torchcal.calibrators import from_spec, parse_spec

    assert parse_spec("ts") == ("ts", {})
    assert parse_spec(" fts : objective=nll : n_bins=10 ") == ("fts", {"objective": "nll", "n_bins": 10})
    assert parse_spec("spline:x=true") == ("spline", {"x": True})
    assert parse_spec("ts:bounds=0.5")[1] == {"bounds": 0.5}
    cal = from_spec("ts:objective=ece:n_bins=10")
    assert isinstance(cal, TemperatureScaling) and (cal.objective, cal.n_bins) == ("ece", 10)
    for bad, message in [("", "non-empty string"), ("ts:objective", "must look like key=value"),
                         ("ts:=ece", "must look like key=value"), ("platt", "unknown calibrator 'platt'"),
                         ("ts:objectiv=ece", "unexpected keyword argument 'objectiv'")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            from_spec(bad)
    with pytest.raises(ValueError, match="non-empty string"):
        parse_spec(None)


@pytest.mark.parametrize("task", ["multiclass", "multilabel"])
def test_check_params_refuses_without_data_what_fit_refuses(task):
    """``check_params`` runs fit's checks of the constructor arguments without data; ``from_spec`` calls it, so
    a spec's wrong value fails when the spec is read, naming the spec and the argument."""
    from torchcal.calibrators import from_spec

    for name in list_calibrators(task):  # the defaults are valid
        cal = create(name, task)
        assert cal.check_params() is cal, name
    bad = {"multiclass": [("ts:objective=foo", "`objective` must be one of"), ("ts:objective=ece:n_bins=0", "`n_bins`"),
                          ("fts:n_bins=0", "`n_bins`"), ("histogram:n_bins=-1", "`n_bins`"),
                          ("spline:n_knots=2", "`n_knots`"), ("vector:solver=adam", "`solver`"),
                          ("dirichlet:reg_lambda=-1", "`reg_lambda`"), ("svs:lambda_diagonal=-1", "`lambda_diagonal`"),
                          ("bbq:c=0", "`c`"), ("pts:lr=0", "`lr`"), ("iop:epochs=0", "`epochs`"),
                          ("beta:max_iter=0", "`max_iter`")],
           "multilabel": [("fts:objective=ece", "`objective`"), ("platt:max_iter=0", "`max_iter`"),
                          ("histogram:n_bins=0", "`n_bins`"), ("ts:per_label=2", "`per_label`")]}[task]  # fmt: skip
    logits, targets = torch.randn(50, 3), torch.randint(0, 3, (50,))
    for spec, message in bad:
        with pytest.raises(ValueError, match=f"calibrator spec '{spec}': {message}"):
            from_spec(spec, task)
        if task == "multiclass" and spec.startswith(("ts:", "fts:", "histogram:")):  # fit refuses it as well
            from torchcal.calibrators import get_calibrator_class, parse_spec

            name, kwargs = parse_spec(spec)
            with pytest.raises(ValueError, match=message):
                get_calibrator_class(name)(**kwargs).fit(logits, targets)


@pytest.mark.parametrize("solver", ["newton", "lbfgs"])
def test_non_convergence_names_the_iterations_taken(solver):
    """The warning states the iterations the solver ran (Newton is capped below ``max_iter``), not the
    setting: here 3 of 3."""
    g = torch.Generator().manual_seed(0)
    z = 3 * torch.randn(400, 4, generator=g, dtype=torch.float64)
    y = torch.multinomial(torch.softmax(z / 3, 1), 1, generator=g).squeeze(1)
    cal = create("matrix").set_params(solver=solver, max_iter=3)
    with pytest.warns(UserWarning, match=f"stopped after 3 {solver} iterations"):
        cal.fit(z, y)
    assert cal.n_iter_ == 3
