"""Grid-search calibrators never stop silently at their grid's edge (issue 24, decision 81): ECE-tuned
temperature scaling and focal temperature scaling follow a minimiser on an edge beyond the grid, and warn
when a search limit is still hit."""

import math

import pytest
import torch

import torchcal.functional as F
from tests.reference import metrics as R
from torchcal.calibrators import SEARCH_LIMITS, FocalTemperatureScaling, TemperatureScaling


def over_confident(n, factor, k=8, seed=0):
    """Labels drawn from softmax(z); the model's logits are ``factor`` z (``factor`` times too sharp)."""
    g = torch.Generator().manual_seed(seed)
    true = 1.5 * torch.randn(n, k, generator=g, dtype=torch.float64)
    y = torch.multinomial(torch.softmax(true, 1), 1, generator=g).squeeze(1)
    return factor * true, y


@pytest.fixture(scope="module")
def twelve_times():
    """A model 12× over-confident: validation and test sets (the issue's case, smaller)."""
    return over_confident(3000, 12.0, seed=1), over_confident(6000, 12.0, seed=2)


def test_ece_ts_follows_the_optimum_beyond_the_papers_grid(twelve_times):
    (zv, yv), (zt, yt) = twelve_times
    nll = TemperatureScaling().fit(zv, yv)
    with pytest.warns(
        UserWarning, match=r"left its grid T in \[0.1, 10\]: the minimiser lies beyond it"
    ) as caught:
        ece = TemperatureScaling(objective="ece").fit(zv, yv)
    assert len(caught) == 1  # left the grid; no limit hit
    assert 10.5 < ece.temperature_ < 14  # beyond the grid's 10, near the true 12
    assert ece.search_ == {
        "T": {"grid": [0.1, 10.0], "searched": [0.1, pytest.approx(100.0)], "chosen": ece.temperature_}
    }
    assert ece.temperature_ == round(ece.temperature_, 1)  # refined on the papers' 0.1 steps
    # the chosen T is the first minimiser of the float64 reference ECE over the 0.1 steps around it
    around = [round(ece.temperature_ + 0.1 * i, 1) for i in range(-5, 6)]
    values = [R.ece(torch.softmax(zv / t, 1), yv, 15) for t in around]
    assert around[values.index(min(values))] == ece.temperature_
    test_ece = F.ece(ece.transform(zt), yt).item()
    # as good on test as NLL-TS up to the two objectives' sampling noise (ECE of 6,000 samples, 15 bins:
    # its standard error is ~0.005); the grid's edge T = 10 is far worse
    assert test_ece < F.ece(nll.transform(zt), yt).item() + 0.01
    with pytest.warns(UserWarning, match=r"chose T = 10, an edge of its grid T in \[0.1, 10\]"):
        edge = TemperatureScaling(objective="ece", extend=False).fit(zv, yv)
    assert edge.temperature_ == 10.0 and F.ece(edge.transform(zt), yt).item() > test_ece + 0.02


# the default grid's range (0.05 to 5) at a fifth of its points, for time: the search is the same
COARSE = tuple(round(0.05 * i, 2) for i in range(1, 101))


def test_fts_follows_the_optimum_beyond_its_grid(twelve_times):
    (zv, yv), (zt, yt) = twelve_times
    nll = TemperatureScaling().fit(zv, yv)
    with pytest.warns(UserWarning, match=r"left its grid T in \[0.05, 5\]"):
        fts = FocalTemperatureScaling(temperatures=COARSE).fit(zv, yv)
    assert fts.search_["T"]["chosen"] == fts.temperature_ and fts.search_["gamma"]["grid"] == [-0.5, 5.0]
    assert fts.temperature_ > 5.0  # beyond the paper's grid (T and γ trade off: T ≈ 13 with γ = 1 here)
    # as good on test as NLL-TS up to sampling noise: ECE of 6,000 samples in 15 bins has a standard error
    # of ~0.005, and the two fits differ in objective (AdaECE against NLL): 3 standard errors
    assert F.ece(fts.transform(zt), yt).item() < F.ece(nll.transform(zt), yt).item() + 0.015
    with pytest.warns(UserWarning, match=r"chose T = 5, an edge of its grid"):
        edge = FocalTemperatureScaling(temperatures=COARSE, extend=False).fit(zv, yv)
    assert (edge.temperature_, edge.gamma_) == (5.0, -0.5)  # the edge the issue reports
    assert F.ece(edge.transform(zt), yt).item() > 0.1


def test_under_confident_models_are_followed_below_the_grid():
    zv, yv = over_confident(3000, 1 / 20, seed=3)  # 20× under-confident: T ≈ 0.05 < 0.1
    with pytest.warns(UserWarning, match="left its grid"):
        ts = TemperatureScaling(objective="adaece").fit(zv, yv)
    assert 0.03 < ts.temperature_ < 0.08


def test_a_gamma_on_the_edge_of_its_grid_is_followed_beyond_it():
    """Labels drawn from focal_map_2(softmax(z)): the model needs γ = 2 at T = 1. With γ in {0, 0.5}
    (validation NLL, a smooth objective) the search adds γ above 0.5 and finds γ near 2."""
    from torchcal.functional import focal_calibration_map

    g = torch.Generator().manual_seed(6)
    z = 2.0 * torch.randn(4000, 5, generator=g, dtype=torch.float64)
    y = torch.multinomial(focal_calibration_map(torch.softmax(z, 1), 2.0), 1, generator=g).squeeze(1)
    temps = [round(0.25 * i, 2) for i in range(2, 9)]  # 0.5 ... 2
    grid = (0.0, 0.5)
    with pytest.warns(UserWarning, match=r"left its grid γ in \[0, 0.5\]"):
        fts = FocalTemperatureScaling(gammas=grid, temperatures=temps, objective="nll").fit(z, y)
    assert 1.3 < fts.gamma_ < 3 and 0.75 <= fts.temperature_ <= 1.25
    with pytest.warns(UserWarning, match=r"chose γ = 0.5, an edge of its grid"):
        edge = FocalTemperatureScaling(gammas=grid, temperatures=temps, objective="nll", extend=False).fit(
            z, y
        )
    assert fts.objective_value_ < edge.objective_value_


def test_a_search_that_ends_on_its_limit_warns_as_nll_ts_does():
    logits = torch.tensor([[3.0, 0.0], [0.0, 3.0], [2.0, 0.0]], dtype=torch.float64)  # separable
    targets = torch.tensor([0, 1, 0])
    with pytest.warns(UserWarning, match="hit the bound"):
        TemperatureScaling(bounds=(0.05, 20.0)).fit(logits, targets)  # NLL-TS
    # all right with margins of 0.001: ECE = 1 - confidence falls as T falls, still at T = 0.001
    logits = logits * 1e-3
    with pytest.warns(UserWarning, match=rf"hit the bound T = {SEARCH_LIMITS[0]:g} of its search"):
        ts = TemperatureScaling(objective="ece").fit(logits, targets)
    assert ts.temperature_ == SEARCH_LIMITS[0]
    # all wrong: the smallest ECE is at the flattest softmax, the upper limit
    with pytest.warns(UserWarning, match=rf"hit the bound T = {SEARCH_LIMITS[1]:g} of its search"):
        fts = FocalTemperatureScaling(gammas=(0.05,)).fit(logits, torch.tensor([1, 0, 1]))
    assert fts.temperature_ == SEARCH_LIMITS[1] and math.isfinite(fts.objective_value_)


def test_a_minimiser_inside_the_grid_is_the_grids_own():
    """Inside the grid nothing changes: the first minimiser of the papers' grid (float64 reference ECE)."""
    zv, yv = over_confident(2000, 2.0, seed=4)
    grid = [round(0.1 * i, 1) for i in range(1, 101)]
    ts = TemperatureScaling(objective="ece").fit(zv, yv)
    values = [R.ece(torch.softmax(zv / t, 1), yv, 15) for t in grid]
    assert ts.temperature_ == grid[values.index(min(values))]
