"""Metrics and calibrators treat their inputs as data (issue 12): tensors that carry gradients, inference
tensors, probabilities passed as logits, setting validation shared by the streaming and functional APIs,
ambiguous AdaFocal updates, and the API the README promises (imports, scikit-learn protocol)."""

import warnings

import pytest
import torch

import torchcal
import torchcal.functional as F
from tests.reference import metrics as R
from torchcal.adafocal import AdaFocalLoss
from torchcal.calibrators import create, list_calibrators
from torchcal.metrics import CalibrationMetrics

FAST_KW = {"fts": {"temperatures": [0.5, 1.0, 2.0]}, "pts": {"steps": 30}, "iop": {"epochs": 2}}

# every metric function of torchcal.functional that takes (probs, targets)
METRICS = {
    "ece": F.ece,
    "adaece": F.adaece,
    "classwise_ece": F.classwise_ece,
    "mce": F.mce,
    "nll": F.nll,
    "brier": F.brier,
    "error_rate": F.error_rate,
    "smece": F.smece,
    "debiased_ece": F.debiased_ece,
    "ece_sweep": F.ece_sweep,
    "kde_ece": F.kde_ece,
    "s99": lambda p, y, **kw: F.confidence_at_least(p, y, **kw).fraction,
    "bootstrap": lambda p, y, **kw: F.bootstrap_ci(F.ece, p, y, n_resamples=20, **kw).estimate,
}


def model_logits(n=200, k=5, seed=0):
    """Logits of a tiny linear model: they carry an autograd graph, like ``model(x)`` outside no_grad."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(8, k, generator=g, requires_grad=True)
    x = torch.randn(n, 8, generator=g)
    logits = x @ weight
    targets = torch.multinomial(torch.softmax(logits.detach() / 2, 1), 1, generator=g).squeeze(1)
    return logits, targets


@pytest.mark.parametrize("name", sorted(METRICS))
@pytest.mark.parametrize("from_logits", [True, False])
def test_every_metric_takes_inputs_that_carry_gradients(name, from_logits, cpu_backend):
    logits, targets = model_logits()
    scores = logits if from_logits else torch.softmax(logits, 1)
    assert scores.requires_grad
    value = METRICS[name](scores, targets, from_logits=from_logits)
    assert not value.requires_grad and value.grad_fn is None  # no graph kept alive by a metric
    expected = METRICS[name](scores.detach(), targets, from_logits=from_logits)
    torch.testing.assert_close(value, expected, rtol=0, atol=0)


def test_ood_auroc_and_reliability_data_take_inputs_that_carry_gradients():
    from torchcal.plotting import reliability_diagram_data

    logits, targets = model_logits()
    value = F.ood_auroc(logits[:100], logits[100:], from_logits=True)
    assert value.grad_fn is None
    assert value == F.ood_auroc(logits[:100].detach(), logits[100:].detach(), from_logits=True)
    data = reliability_diagram_data(logits, targets, from_logits=True)
    tensors = [v for v in vars(data).values() if isinstance(v, torch.Tensor)]
    assert tensors and all(not t.requires_grad for t in tensors)


def test_streaming_accumulator_takes_inputs_that_carry_gradients(cpu_backend):
    logits, targets = model_logits(300)
    m = CalibrationMetrics(num_classes=5, from_logits=True)
    for i in range(0, 300, 100):
        m.update(logits[i : i + 100], targets[i : i + 100])
    out = m.compute()
    assert all(v.grad_fn is None for v in out.values())
    reference = R.ece(torch.softmax(logits.detach().double(), 1), targets)
    torch.testing.assert_close(out["ece"].item(), reference, rtol=1e-5, atol=1e-6)
    with torch.inference_mode():
        m2 = CalibrationMetrics(num_classes=5, from_logits=True)
        m2.update(logits, targets)
        torch.testing.assert_close(m2.compute("ece")["ece"], out["ece"])


@pytest.mark.parametrize("name", list_calibrators())
def test_every_calibrator_fits_and_transforms_inputs_that_carry_gradients(name, cpu_backend):
    logits, targets = model_logits(400)
    cal = create(name, **FAST_KW.get(name, {})).fit(logits, targets)
    probs = cal.transform(logits)
    assert not probs.requires_grad
    ref = create(name, **FAST_KW.get(name, {})).fit(logits.detach(), targets)
    torch.testing.assert_close(probs, ref.transform(logits.detach()))


@pytest.mark.parametrize("name", list_calibrators())
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_every_calibrator_fits_inside_inference_mode_and_no_grad(name, mode):
    logits, targets = model_logits(400)
    logits = logits.detach()
    ref = create(name, **FAST_KW.get(name, {})).fit(logits, targets).transform(logits)
    context = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with context:
        inner_logits = logits.clone()  # an inference tensor under inference_mode
        cal = create(name, **FAST_KW.get(name, {})).fit(inner_logits, targets)
        probs = cal.transform(inner_logits)
    torch.testing.assert_close(probs, ref)


def test_probabilities_passed_as_logits_warn():
    logits, targets = model_logits()
    probs = torch.softmax(logits.detach(), 1)
    with pytest.warns(UserWarning, match="look like probabilities"):
        F.ece(probs, targets, from_logits=True)
    with pytest.warns(UserWarning, match="look like probabilities"):
        F.nll(probs, targets, from_logits=True)
    with pytest.warns(UserWarning, match="look like probabilities"):
        CalibrationMetrics(5, from_logits=True).update(probs, targets)
    with pytest.warns(UserWarning, match="calibrators take logits"):
        create("ts").fit(probs, targets)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # real logits, even all non-negative ones, do not warn
        F.ece(logits.detach(), targets, from_logits=True)
        F.ece(logits.detach().abs(), targets, from_logits=True)
        create("ts").fit(logits.detach(), targets)


@pytest.mark.parametrize("bad, error", [(float("nan"), ValueError), (1.5, ValueError), (-0.1, ValueError),
                                        ("0.9", TypeError), (True, TypeError)])  # fmt: skip
def test_s99_threshold_is_validated_alike_in_the_streaming_and_functional_apis(bad, error):
    probs, targets = torch.softmax(torch.randn(20, 3), 1), torch.randint(0, 3, (20,))
    with pytest.raises(error) as functional:
        F.confidence_at_least(probs, targets, bad)
    with pytest.raises(error) as streaming:
        CalibrationMetrics(3, s99_threshold=bad)
    assert str(streaming.value).replace("s99_threshold", "threshold") == str(functional.value)


def test_accumulator_flags_are_checked():
    with pytest.raises(TypeError, match="from_logits"):
        CalibrationMetrics(3, from_logits="yes")
    with pytest.raises(TypeError, match="equal_mass"):
        CalibrationMetrics(3, equal_mass=1)


def test_compute_takes_one_name_or_several():
    probs, targets = torch.softmax(torch.randn(50, 3), 1), torch.randint(0, 3, (50,))
    m = CalibrationMetrics(3)
    m.update(probs, targets)
    assert set(m.compute("ece")) == {"ece"}
    assert set(m.compute(["ece", "adaece"])) == {"ece", "adaece"}
    torch.testing.assert_close(m.compute("adaece")["adaece"], F.adaece(probs, targets))
    with pytest.raises(ValueError, match=r"`names` has unknown metrics \[.ecee.\]; choose from"):
        m.compute("ecee")
    with pytest.raises(TypeError, match="`names`"):
        m.compute(15)


def test_adafocal_update_refuses_ambiguous_and_empty_calls():
    probs, targets = torch.softmax(3 * torch.randn(100, 3), 1), torch.randint(0, 3, (100,))
    m = CalibrationMetrics(3)
    m.update(probs, targets)
    ada = AdaFocalLoss(n_bins=5)
    with pytest.raises(ValueError, match="not both"):
        ada.update(probs, targets, metrics=m)
    with pytest.raises(ValueError, match="holds no samples"):
        ada.update(metrics=CalibrationMetrics(3))
    with pytest.raises(ValueError, match="equal_mass=False"):
        ada.update(metrics=CalibrationMetrics(3, equal_mass=False))
    with pytest.raises(ValueError, match="needs the validation set"):
        ada.update()
    with pytest.raises(TypeError, match="CalibrationMetrics"):
        ada.update(metrics={"ece": 0.1})
    assert torch.equal(ada.gammas, torch.ones(5, dtype=ada.gammas.dtype))  # nothing was changed
    ada.update(metrics=m)
    by_tensors = AdaFocalLoss(n_bins=5)
    by_tensors.update(probs, targets)
    torch.testing.assert_close(ada.gammas, by_tensors.gammas)


def test_import_torchcal_gives_losses_adafocal_and_functional_losses():
    import subprocess
    import sys

    code = ("import torchcal; torchcal.losses.FocalLoss; torchcal.adafocal.AdaFocalLoss; "
            "torchcal.functional.focal_loss; torchcal.functional.dual_focal_loss; print('ok')")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
    logits, targets = torch.randn(6, 4), torch.randint(0, 4, (6,))
    torch.testing.assert_close(
        F.focal_loss(logits, targets, gamma=0.0), torch.nn.functional.cross_entropy(logits, targets)
    )
    for name in F.LOSS_FUNCTIONS:
        assert callable(getattr(F, name)) and name in F.__all__
        assert not hasattr(torchcal, name) or name in F.METRIC_FUNCTIONS  # losses stay out of the top level


@pytest.mark.parametrize("name", list_calibrators())
def test_calibrators_follow_the_sklearn_estimator_protocol(name):
    from sklearn.base import clone

    cal = create(name, **FAST_KW.get(name, {}))
    params = cal.get_params(deep=True)
    assert params == cal.get_params(deep=False) == cal.get_params()
    twin = clone(cal)
    assert type(twin) is type(cal) and twin is not cal and twin.get_params() == params
    logits, targets = model_logits(300)
    logits = logits.detach()
    cal.fit(logits, targets)
    assert not clone(cal).is_fitted  # clone gives an unfitted copy with the same parameters
    torch.testing.assert_close(cal.predict_proba(logits), cal.transform(logits))
    assert cal.set_params(**params) is cal and cal.get_params() == params
    with pytest.raises(ValueError, match="has no parameter 'not_a_parameter'"):
        cal.set_params(not_a_parameter=1)


def test_set_params_changes_the_next_fit():
    logits, targets = model_logits(300)
    ts = create("ts").set_params(objective="ece")
    assert ts.objective == "ece"
    t_grid = ts.fit(logits, targets).temperature_
    assert round(t_grid, 1) == t_grid  # a value of the paper's 0.1-step grid


def test_kde_ece_warns_when_it_would_take_long(monkeypatch):
    import torchcal.functional.calibration as C

    probs, targets = torch.softmax(torch.randn(40, 3), 1), torch.randint(0, 3, (40,))
    monkeypatch.setattr(C, "KDE_WARN_PAIRS", 40 * 40 * 21 - 1)  # the threshold just below this call's cost
    with pytest.warns(UserWarning, match="kernel pairs"):
        F.kde_ece(probs, targets)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fixed bandwidth makes one pass: 21x cheaper, no warning
        F.kde_ece(probs, targets, bandwidth=0.1)
    assert C.KDE_WARN_PAIRS // 21 < 4500**2  # the real threshold: N of a few thousand with "auto"
