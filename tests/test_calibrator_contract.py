"""The persistence contract of every calibrator: loading a state replaces all fitted values (an unfitted
state unfits), strict JSON with non-finite numbers restored, and the grid record ``search_`` kept."""

import io
import json
import math
import warnings

import pytest
import torch

from torchcal.calibrators import (
    BiasCorrectedTemperatureScaling,
    BinaryHistogramBinning,
    FocalTemperatureScaling,
    HistogramBinning,
    NotFittedError,
    TemperatureScaling,
    create,
    from_json,
    list_calibrators,
)

# the network calibrators train for 100,000 steps (PTS) / 40 epochs (IOP) by default: shorter here
FAST_KW = {
    ("multiclass", "fts"): {"temperatures": [0.5, 1.0, 2.0]},
    ("multiclass", "pts"): {"steps": 5},
    ("multiclass", "iop"): {"epochs": 1},
}
# a parameter value other than the default, per calibrator with parameters
OTHER_PARAMS = {
    ("multiclass", "ts"): {"objective": "ece"},
    ("multiclass", "fts"): {"n_bins": 10},
    ("multiclass", "ets"): {"bounds": (0.05, 20.0)},
    ("multiclass", "spline"): {"n_knots": 5},
    ("multiclass", "histogram"): {"n_bins": 7},
    ("multiclass", "vector"): {"weight_decay": 0.5},
    ("multiclass", "matrix"): {"weight_decay": 0.5},
    ("multiclass", "bcts"): {"max_iter": 50},
    ("multiclass", "nbvs"): {"max_iter": 50},
    ("multiclass", "pts"): {"top_k": 3},
    ("multiclass", "iop"): {"epochs": 2},
    ("multilabel", "ts"): {"per_label": False},
    ("multilabel", "fts"): {"n_bins": 10},
    ("multilabel", "platt"): {"max_iter": 50},
    ("multilabel", "histogram"): {"n_bins": 7},
}


def _strict_loads(text):
    """json.loads that refuses the non-standard constants NaN, Infinity and -Infinity."""

    def refuse(token):
        raise ValueError(f"non-standard JSON constant {token}")

    return json.loads(text, parse_constant=refuse)


def _data(task):
    g = torch.Generator().manual_seed(0)
    if task == "multiclass":
        z = 3 * torch.randn(300, 4, generator=g, dtype=torch.float64)
        return z, torch.multinomial(torch.softmax(z / 3, 1), 1, generator=g)[:, 0]
    z = 2 * torch.randn(300, 2, generator=g, dtype=torch.float64)
    return z, (torch.rand(300, 2, generator=g, dtype=torch.float64) < torch.sigmoid(z / 2)).long()


@pytest.mark.parametrize(
    "task, name",
    [("multiclass", n) for n in list_calibrators()]
    + [("multilabel", n) for n in list_calibrators("multilabel")],
)
def test_loading_an_unfitted_state_unfits_a_fitted_calibrator(task, name):
    """The loaded state is the whole state: a fitted calibrator given an unfitted state (with other
    parameters) is unfitted, holds no fitted value, and takes the state's parameters."""
    logits, targets = _data(task)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # convergence and absent-class notes of the small data set
        cal = create(name, task=task, **FAST_KW.get((task, name), {})).fit(logits, targets)
    params = {**FAST_KW.get((task, name), {}), **OTHER_PARAMS.get((task, name), {})}
    state = create(name, task=task, **params).state_dict()
    assert state["fitted"] == {}
    cal.load_state_dict(state)
    assert not cal.is_fitted
    assert [a for a in vars(cal) if a.endswith("_")] == []
    with pytest.raises(NotFittedError):
        cal.transform(logits)
    expected = {k: (list(v) if isinstance(v, tuple) else v) for k, v in params.items()}
    got = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cal.get_params().items()}
    assert {k: got[k] for k in expected} == expected


def test_loading_a_state_drops_an_optional_record_it_lacks():
    """A grid-fitted temperature scaling (with ``search_``) given an NLL-fitted state has no ``search_``."""
    logits, targets = _data("multiclass")
    grid = TemperatureScaling(objective="ece").fit(logits, targets)
    assert hasattr(grid, "search_")
    nll = TemperatureScaling().fit(logits, targets)
    assert "search_" not in nll.state_dict()["fitted"]
    grid.load_state_dict(nll.state_dict())
    assert not hasattr(grid, "search_") and grid.temperature_ == nll.temperature_
    assert grid.objective == "nll"


def test_a_state_missing_fitted_values_is_refused_and_changes_nothing():
    logits, targets = _data("multiclass")
    cal = TemperatureScaling().fit(logits, targets)
    state = TemperatureScaling(objective="ece").fit(logits, targets).state_dict()
    del state["fitted"]["temperature_"]
    with pytest.raises(ValueError, match="lacks fitted values"):
        cal.load_state_dict(state)
    assert cal.objective == "nll" and cal.is_fitted and not hasattr(cal, "search_")


@pytest.mark.parametrize(
    "cls, logits, targets",
    [  # bins 1-14 of class 0 and bins 1-13 of class 1 hold no validation sample: NaN in frequencies_
        (HistogramBinning, [[3.0, 0.0], [2.5, 0.0], [0.0, 3.0]], [0, 0, 1]),
        (BinaryHistogramBinning, [[-3.0], [-2.0], [0.1], [3.0]], [[0], [1], [1], [1]]),
    ],
)
def test_to_json_is_strict_json_and_restores_nan(cls, logits, targets):
    cal = cls(n_bins=15).fit(torch.tensor(logits), torch.tensor(targets))
    assert torch.isnan(cal.frequencies_).any()
    text = cal.to_json()
    parsed = _strict_loads(text)  # no bare NaN token
    assert "NaN" in json.dumps(parsed["fitted"]["frequencies_"])  # written as the string "NaN"
    again = from_json(text)
    # NaN where it was, every other entry the same bits
    assert torch.equal(torch.isnan(again.frequencies_), torch.isnan(cal.frequencies_))
    assert torch.equal(again.frequencies_.nan_to_num(-1.0), cal.frequencies_.nan_to_num(-1.0))
    assert again.frequencies_.dtype == cal.frequencies_.dtype
    probe = torch.linspace(-4, 4, 9)[:, None].expand(9, cal.num_classes_).contiguous()
    torch.testing.assert_close(again.transform(probe), cal.transform(probe), rtol=0, atol=0)


def test_to_json_restores_infinite_floats_and_tensor_entries():
    """A Python float (BCTS's T = inf when the logits carry no information) and ±inf tensor entries."""
    g = torch.Generator().manual_seed(0)
    z, y = torch.randn(300, 3, generator=g, dtype=torch.float64), torch.randint(0, 3, (300,), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cal = BiasCorrectedTemperatureScaling().fit(-z - 2 * torch.nn.functional.one_hot(y, 3), y)
    assert cal.temperature_ == math.inf
    cal.bias_ = torch.tensor([-math.inf, 0.5, math.inf], dtype=torch.float64)  # tensor entries as well
    text = cal.to_json()
    parsed = _strict_loads(text)
    assert parsed["fitted"]["temperature_"] == {"__float__": "Infinity"}
    assert parsed["fitted"]["bias_"]["__tensor__"] == ["-Infinity", 0.5, "Infinity"]
    again = from_json(text)
    assert again.temperature_ == math.inf and torch.equal(again.bias_, cal.bias_)


@pytest.mark.parametrize(
    "make",
    [
        lambda: TemperatureScaling(objective="ece"),
        lambda: TemperatureScaling(objective="adaece", grid=(0.1, 0.2)),  # left its grid: a longer record
        lambda: FocalTemperatureScaling(temperatures=[0.5, 1.0, 2.0]),
    ],
)
def test_the_grid_record_survives_state_dict_and_json(make):
    logits, targets = _data("multiclass")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a grid left
        cal = make().fit(logits, targets)
    record = cal.search_
    assert record["T"]["chosen"] == cal.temperature_
    buffer = io.BytesIO()
    torch.save(cal.state_dict(), buffer)
    buffer.seek(0)
    restored = type(cal)().load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.search_ == record
    assert from_json(cal.to_json()).search_ == record


def test_a_focal_state_saved_without_its_grid_record_still_loads():
    logits, targets = _data("multiclass")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a grid left
        cal = FocalTemperatureScaling(temperatures=[0.5, 1.0, 2.0]).fit(logits, targets)
    state = cal.state_dict()
    del state["fitted"]["search_"]
    restored = FocalTemperatureScaling().load_state_dict(state)
    assert not hasattr(restored, "search_")
    torch.testing.assert_close(restored.transform(logits), cal.transform(logits), rtol=0, atol=0)
