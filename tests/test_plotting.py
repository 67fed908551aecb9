"""Reliability-diagram data agrees with the metrics; the drawing carries the metric; saving is atomic."""

import os

import pytest
import torch

import torchcal.functional as F
from tests.conftest import make_probs
from torchcal.plotting import plot_reliability_diagram, reliability_diagram_data, save_figure


@pytest.mark.parametrize("binning,metric", [("equal_width", F.ece), ("equal_mass", F.adaece)])
def test_data_agrees_with_metric(binning, metric):
    probs, targets = make_probs(500, 6, seed=1)
    d = reliability_diagram_data(probs, targets, n_bins=12, binning=binning)
    assert d.count.sum().item() == 500
    torch.testing.assert_close(d.value, metric(probs, targets, n_bins=12))
    filled = d.count > 0
    # the weighted sum of per-bin gaps is the metric
    gaps = (d.count[filled] / 500 * (d.accuracy[filled] - d.confidence[filled]).abs()).sum()
    torch.testing.assert_close(gaps, d.value)
    assert (d.lower[filled] <= d.confidence[filled] + 1e-12).all()
    assert (d.confidence[filled] <= d.upper[filled] + 1e-12).all()


def test_equal_mass_edges_are_min_and_max_of_each_group():
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.7, 0.3], [0.8, 0.2]], dtype=torch.float64)
    d = reliability_diagram_data(probs, torch.tensor([0, 0, 1, 0]), n_bins=2, binning="equal_mass")
    assert d.lower.tolist() == [0.6, 0.8] and d.upper.tolist() == [0.7, 0.9]
    assert d.accuracy.tolist() == [0.5, 1.0]


def test_plot_and_atomic_save(tmp_path):
    pytest.importorskip("matplotlib")
    probs, targets = make_probs(300, 4, seed=2)
    fig = plot_reliability_diagram(probs=probs, targets=targets, title="demo")
    title = fig.axes[0].get_title()
    assert "demo" in title and f"ECE = {100 * F.ece(probs, targets).item():.2f}%" in title
    out = tmp_path / "sub" / "diagram.png"
    save_figure(fig, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(out.parent) == ["diagram.png"]  # no temporary file left behind
    fig_em = plot_reliability_diagram(reliability_diagram_data(probs, targets, binning="equal_mass"))
    assert "AdaECE" in fig_em.axes[0].get_title()


def test_plot_argument_errors():
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="pass either `data`"):
        plot_reliability_diagram()
    with pytest.raises(TypeError, match="`data` must be a ReliabilityDiagram"):
        plot_reliability_diagram({"count": 1})
    with pytest.raises(ValueError, match="`binning` must be one of"):
        reliability_diagram_data(torch.tensor([[0.5, 0.5]]), torch.tensor([0]), binning="quantile")


def test_accuracy_bars_stay_visible_in_under_confident_bins():
    """Each accuracy bar reaches its bin's accuracy and no gap bar hides it: gap bars are hatched outlines
    with a transparent face, from the accuracy to the mean confidence, in both directions."""
    pytest.importorskip("matplotlib")
    from torchcal.plotting import plot_reliability_diagram, reliability_diagram_data

    # two bins: confidence 0.55 with accuracy 1 (under-confident), confidence 0.95 with accuracy 0.5
    probs = torch.tensor([[0.55, 0.45]] * 4 + [[0.95, 0.05]] * 4, dtype=torch.float64)
    targets = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1])
    data = reliability_diagram_data(probs, targets, n_bins=10)
    fig = plot_reliability_diagram(data)
    accuracy_bars, gap_bars = fig.axes[0].containers[:2]
    assert [round(b.get_height(), 6) for b in accuracy_bars] == [1.0, 0.5]
    assert [round(b.get_y(), 6) for b in gap_bars] == [1.0, 0.5]
    assert [round(b.get_y() + b.get_height(), 6) for b in gap_bars] == [0.55, 0.95]
    assert all(b.get_facecolor()[3] == 0 for b in gap_bars)  # transparent: the accuracy bar shows through


def test_histogram_shares_the_diagram_confidence_axis_when_axes_are_given():
    """Axes passed in (the arena's panels) share no x axis: the count histogram must still span [0, 1] like the
    diagram, or its bars stretch over the page while the diagram's bins above stay narrow. With confidences
    in [0.3, 0.45] the histogram's own limits were about (0.29, 0.48)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    probs = torch.tensor([[0.3, 0.25, 0.25, 0.2], [0.45, 0.2, 0.2, 0.15], [0.38, 0.32, 0.2, 0.1]] * 5)
    targets = torch.tensor([0, 1, 2] * 5)
    fig, (ax, hist) = plt.subplots(2, 1)  # not shared, as in the arena's grid of panels
    plot_reliability_diagram(probs=probs, targets=targets, axes=(ax, hist))
    assert ax.get_xlim() == (0.0, 1.0) and hist.get_xlim() == (0.0, 1.0)  # limits set exactly, no tolerance
    # the bars stand on the equal-width bins of the ECE: (4/15, 5/15], (6/15, 7/15], 15 bins
    lefts = sorted(round(b.get_x(), 12) for b in hist.containers[0])
    assert lefts == [round(4 / 15, 12), round(5 / 15, 12), round(6 / 15, 12)]
    plt.close(fig)


def test_saved_figures_follow_the_umask(tmp_path):
    pytest.importorskip("matplotlib")
    import stat

    probs, targets = make_probs(100, 3)
    old = os.umask(0o022)
    try:
        save_figure(plot_reliability_diagram(probs=probs, targets=targets), tmp_path / "fig.png")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "fig.png").stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["fig.png"]  # no temporary file left


def test_multilabel_small_multiples(tmp_path):
    from torchcal.functional import multilabel_adaece, multilabel_ece
    from torchcal.plotting import multilabel_reliability_data, plot_multilabel_reliability, save_figure

    g = torch.Generator().manual_seed(0)
    z = 2 * torch.randn(500, 3, generator=g)
    y = (torch.rand(500, 3, generator=g) < torch.sigmoid(z / 2)).float()
    for binning, metric in (("equal_width", multilabel_ece), ("equal_mass", multilabel_adaece)):
        per_label, pooled = multilabel_reliability_data(z, y, from_logits=True, binning=binning)
        expected = metric(z, y, from_logits=True, average="none")
        assert [float(d.value) for d in per_label] == pytest.approx(expected.tolist(), abs=1e-12)
        assert float(pooled.value) == pytest.approx(
            float(metric(z, y, from_logits=True, average="micro")), abs=1e-12
        )
        assert all(float(d.count.sum()) == 500 for d in per_label) and float(pooled.count.sum()) == 1500
    fig = plot_multilabel_reliability(z, y, from_logits=True, label_names=["a", "b", "c"], ncols=2)
    assert len(fig.axes) == 2 * 4  # three labels and the pooled panel, each a diagram and a histogram
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles[0].startswith("a\nECE = ") and titles[-1].startswith("all labels pooled")
    save_figure(fig, tmp_path / "ml.png")
    assert (tmp_path / "ml.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="`label_names` has 2 names for 3 labels"):
        plot_multilabel_reliability(z, y, from_logits=True, label_names=["a", "b"])


def test_risk_coverage_and_set_size_figures(tmp_path):
    pytest.importorskip("matplotlib")
    from torchcal.conformal import SplitConformalClassifier
    from torchcal.functional import risk_coverage_curve
    from torchcal.plotting import plot_risk_coverage, plot_set_sizes, save_figure

    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(400, 6, generator=g)
    targets = torch.multinomial(torch.softmax(logits, 1), 1, generator=g).squeeze(1)
    curves = {
        s: risk_coverage_curve(logits, targets, score=s, from_logits=True) for s in ("max_prob", "energy")
    }
    fig = plot_risk_coverage(curves, generalized=True, title="rc")
    assert len(fig.axes[0].lines) == 2 and "AUGRC" in fig.axes[0].get_legend().get_texts()[0].get_text()
    save_figure(fig, tmp_path / "rc.png")
    sets = {
        s: SplitConformalClassifier(s).fit(logits[:200], targets[:200], 0.1).predict_sets(logits[200:])
        for s in ("lac", "aps")
    }
    fig = plot_set_sizes(sets)
    assert len(fig.axes[0].patches) == 2 * 7  # sizes 0..6 for each method
    save_figure(fig, tmp_path / "sizes.png")
    assert (tmp_path / "rc.png").stat().st_size > 0 and (tmp_path / "sizes.png").stat().st_size > 0
    with pytest.raises(TypeError, match="curves"):
        plot_risk_coverage([1, 2])
    with pytest.raises(TypeError, match="sets_by_label"):
        plot_set_sizes({})
