"""Reliability diagrams, risk-coverage curves and conformal set sizes: the data (pure torch) and the drawing
(matplotlib, imported inside the function)."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

import torch

from ._namespace import only_public as _only_public
from ._validation import check_choice, check_positive_int
from .functional import calibration as C
from .functional._binning import equal_mass_sums, equal_width_edges
from .functional._inputs import scan_inputs

__all__ = [
    "ReliabilityDiagram",
    "reliability_diagram_data",
    "plot_reliability_diagram",
    "multilabel_reliability_data",
    "plot_multilabel_reliability",
    "save_figure",
    "plot_risk_coverage",
    "plot_set_sizes",
]


@dataclass(frozen=True)
class ReliabilityDiagram:
    """Per-bin statistics of a top-label reliability diagram (all float64, shape (n_bins,)).

    ``confidence`` and ``accuracy`` are NaN for empty bins. For equal-width bins ``lower``/``upper`` are the
    bin edges m/M and (m+1)/M; for equal-mass bins they are the smallest and largest confidence in the bin
    (NaN when empty). ``value`` is the calibration error the diagram shows (ECE or AdaECE).
    """

    binning: str
    count: torch.Tensor
    confidence: torch.Tensor
    accuracy: torch.Tensor
    lower: torch.Tensor
    upper: torch.Tensor
    value: torch.Tensor

    @property
    def metric_name(self) -> str:
        return "ECE" if self.binning == "equal_width" else "AdaECE"


def reliability_diagram_data(
    probs, targets, *, n_bins: int = 15, binning: str = "equal_width", from_logits: bool = False
) -> ReliabilityDiagram:
    """Bin statistics for a reliability diagram, with the conventions of the matching metric.

    ``binning="equal_width"`` uses the bins of :func:`~torchcal.functional.expected_calibration_error`,
    ``"equal_mass"`` those of :func:`~torchcal.functional.adaptive_calibration_error`.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7]])
        >>> d = reliability_diagram_data(probs, torch.tensor([0, 1, 1]), n_bins=2)
        >>> d.count, d.accuracy, d.value
        (tensor([0., 3.], dtype=torch.float64), tensor([   nan, 0.6667], dtype=torch.float64), tensor(0.0667, dtype=torch.float64))
    """
    n_bins = check_positive_int(n_bins, "n_bins")
    check_choice(binning, "binning", {"equal_width", "equal_mass"})
    _, _, scan = scan_inputs(probs, targets, from_logits, n_bins=n_bins if binning == "equal_width" else None)
    conf, correct = scan.conf, scan.correct
    if binning == "equal_width":
        assert scan.top is not None  # the scan bins with n_bins
        count, conf_sum, correct_sum = scan.top
        edges = equal_width_edges(n_bins, torch.float64, conf.device)
        lower, upper = edges[:-1], edges[1:]
    else:
        conf_s, corr_s = C.sorted_by_confidence(conf, correct)
        count, conf_sum, correct_sum = equal_mass_sums(conf_s, corr_s, n_bins)
        ends = count.long().cumsum(0)
        starts = ends - count.long()
        filled = count > 0
        c64 = conf_s.double()
        nan = torch.full_like(count, float("nan"))
        lower = torch.where(filled, c64[starts.clamp(max=len(c64) - 1)], nan)
        upper = torch.where(filled, c64[(ends - 1).clamp(min=0)], nan)
    safe = count.clamp(min=1)
    nan = torch.full_like(count, float("nan"))
    return ReliabilityDiagram(
        binning=binning,
        count=count,
        confidence=torch.where(count > 0, conf_sum / safe, nan),
        accuracy=torch.where(count > 0, correct_sum / safe, nan),
        lower=lower,
        upper=upper,
        value=C.ece_from_sums(count, conf_sum, correct_sum),
    )


def plot_reliability_diagram(
    data: ReliabilityDiagram | None = None,
    probs=None,
    targets=None,
    *,
    n_bins: int = 15,
    binning: str = "equal_width",
    from_logits: bool = False,
    title: str | None = None,
    axes=None,
):
    """Draws a reliability diagram: accuracy bars (always up to the bin's accuracy), hatched gap bars between
    the accuracy and the mean confidence (above the bar when over-confident, across its top when
    under-confident), the diagonal, and a histogram of bin counts underneath, on the same confidence axis
    [0, 1] as the diagram; the title carries the calibration error (×100, like the papers).

    Pass either ``data`` (from :func:`reliability_diagram_data`) or ``probs`` and ``targets``. ``axes`` may be
    a pair (diagram, histogram) of matplotlib axes to draw into. Requires matplotlib (``pip install
    torchcal[plot]``). Returns the matplotlib Figure.
    """
    try:
        import matplotlib

        if axes is None and not os.environ.get("DISPLAY"):
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - exercised only without matplotlib
        raise ImportError("plotting needs matplotlib: pip install 'torchcal[plot]'") from err
    if data is None:
        if probs is None or targets is None:
            raise ValueError("pass either `data` or both `probs` and `targets`")
        data = reliability_diagram_data(
            probs, targets, n_bins=n_bins, binning=binning, from_logits=from_logits
        )
    elif not isinstance(data, ReliabilityDiagram):
        raise TypeError(f"`data` must be a ReliabilityDiagram, got {type(data).__name__}")
    if axes is None:
        fig, (ax, hist) = plt.subplots(
            2,
            1,
            figsize=(4.2, 5.2),
            sharex=True,
            gridspec_kw={"height_ratios": [3, 1]},
            constrained_layout=True,
        )
    else:
        ax, hist = axes
        fig = ax.figure
    filled = data.count > 0
    lo = data.lower[filled].numpy()
    width = (data.upper[filled] - data.lower[filled]).clamp(min=2e-3).numpy()
    acc = data.accuracy[filled].numpy()
    conf = data.confidence[filled].numpy()
    ax.bar(
        lo,
        acc,
        width=width,
        align="edge",
        color="#4C72B0",
        edgecolor="black",
        linewidth=0.6,
        label="accuracy",
    )
    # the gap between accuracy and mean confidence, hatched over a transparent face: above an accuracy bar
    # in over-confident bins, across its top part in under-confident ones, where the bar stays visible
    ax.bar(
        lo,
        conf - acc,
        bottom=acc,
        width=width,
        align="edge",
        facecolor=(0, 0, 0, 0),
        edgecolor="#C44E52",
        hatch="///",
        linewidth=0.8,
        label="gap to mean confidence",
    )
    ax.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy")
    ax.legend(loc="upper left", fontsize=8)
    heading = f"{data.metric_name} = {100 * float(data.value):.2f}%"
    ax.set_title(f"{title}\n{heading}" if title else heading)
    hist.bar(
        lo,
        data.count[filled].numpy(),
        width=width,
        align="edge",
        color="#8C8C8C",
        edgecolor="black",
        linewidth=0.6,
    )
    # both panels span the confidence range [0, 1]: axes passed in share no x axis, and the histogram's own
    # limits (the data's range) would stretch its bars against the diagram's bins above
    hist.set_xlim(0, 1)
    hist.set_xlabel("confidence")
    hist.set_ylabel("count")
    return fig


def _diagram_from_pairs(conf, correct, n_bins, binning) -> ReliabilityDiagram:
    """The diagram of 1-D (confidence, outcome) pairs: equal-width or equal-mass bins."""
    from .functional._binning import bin_sums, equal_width_index

    if binning == "equal_width":
        count, conf_sum, correct_sum = bin_sums(equal_width_index(conf, n_bins), n_bins, conf, correct)
        edges = equal_width_edges(n_bins, torch.float64, conf.device)
        lower, upper = edges[:-1], edges[1:]
    else:
        conf_s, corr_s = C.sorted_by_confidence(conf, correct.bool())
        count, conf_sum, correct_sum = equal_mass_sums(conf_s, corr_s, n_bins)
        ends = count.long().cumsum(0)
        starts = ends - count.long()
        nan = torch.full_like(count, float("nan"))
        c64 = conf_s.double()
        lower = torch.where(count > 0, c64[starts.clamp(max=len(c64) - 1)], nan)
        upper = torch.where(count > 0, c64[(ends - 1).clamp(min=0)], nan)
    safe = count.clamp(min=1)
    nan = torch.full_like(count, float("nan"))
    return ReliabilityDiagram(binning=binning, count=count,
                              confidence=torch.where(count > 0, conf_sum / safe, nan),
                              accuracy=torch.where(count > 0, correct_sum / safe, nan), lower=lower, upper=upper,
                              value=C.ece_from_sums(count, conf_sum, correct_sum))  # fmt: skip


def multilabel_reliability_data(
    probs, targets, *, n_bins: int = 15, binning: str = "equal_width", from_logits: bool = False
) -> tuple[list[ReliabilityDiagram], ReliabilityDiagram]:
    """Reliability of each label's p (bin "accuracy" = fraction of positives, "confidence" = mean p) and of
    all labels pooled, with the conventions of :func:`~torchcal.functional.multilabel_calibration_error`
    (its per-label and micro values are the diagrams' ``value``; for equal-mass bins the diagrams show the
    bins that estimator uses).

    Example:
        >>> import torch
        >>> p = torch.tensor([[0.9, 0.2], [0.8, 0.1], [0.3, 0.7], [0.6, 0.4]])
        >>> per_label, pooled = multilabel_reliability_data(p, torch.tensor([[1, 0], [1, 0], [0, 1], [0, 1]]), n_bins=5)
        >>> [round(float(d.value), 2) for d in per_label], round(float(pooled.value), 2)
        ([0.3, 0.3], 0.3)
    """
    from .functional import binary as B

    n_bins = check_positive_int(n_bins, "n_bins")
    check_choice(binning, "binning", {"equal_width", "equal_mass"})
    p, y = B._metric_inputs(probs, targets, from_logits)
    per_label = [
        _diagram_from_pairs(p[:, j].contiguous(), y[:, j].contiguous(), n_bins, binning)
        for j in range(p.shape[1])
    ]
    return per_label, _diagram_from_pairs(p.reshape(-1), y.reshape(-1), n_bins, binning)


def plot_multilabel_reliability(
    probs,
    targets,
    *,
    label_names=None,
    n_bins: int = 15,
    binning: str = "equal_width",
    from_logits: bool = False,
    ncols: int = 4,
    title: str | None = None,
):
    """Small multiples: one reliability diagram (with its histogram) per label and one for all labels
    pooled, the multi-label calibration picture of :func:`multilabel_reliability_data`. Returns the Figure."""
    try:
        import matplotlib

        if not os.environ.get("DISPLAY"):
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - exercised only without matplotlib
        raise ImportError("plotting needs matplotlib: pip install 'torchcal[plot]'") from err
    per_label, pooled = multilabel_reliability_data(
        probs, targets, n_bins=n_bins, binning=binning, from_logits=from_logits
    )
    names = list(label_names) if label_names is not None else [f"label {j}" for j in range(len(per_label))]
    if len(names) != len(per_label):
        raise ValueError(f"`label_names` has {len(names)} names for {len(per_label)} labels")
    panels = [*zip(names, per_label), ("all labels pooled", pooled)]
    ncols = min(check_positive_int(ncols, "ncols"), len(panels))
    nrows = -(-len(panels) // ncols)
    fig = plt.figure(figsize=(3.2 * ncols, 4.0 * nrows), constrained_layout=True)
    grid = fig.add_gridspec(2 * nrows, ncols, height_ratios=[3, 1] * nrows)
    for i, (name, data) in enumerate(panels):
        r, c = divmod(i, ncols)
        ax = fig.add_subplot(grid[2 * r, c])
        hist = fig.add_subplot(grid[2 * r + 1, c], sharex=ax)
        plot_reliability_diagram(data, title=name, axes=(ax, hist))
        ax.set_ylabel("fraction positive")
        hist.set_xlabel("predicted probability p")
        legend = ax.get_legend()
        if i and legend is not None:
            legend.remove()
    if title:
        fig.suptitle(title)
    return fig


def save_figure(fig, path, **savefig_kwargs) -> None:
    """Saves a matplotlib figure atomically (temporary file in the same folder, then ``os.replace``), with the
    permissions of any new file (0666 minus the umask)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    suffix = os.path.splitext(path)[1] or ".png"
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp{suffix}")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # created with the umask applied
    try:
        fig.savefig(tmp, **savefig_kwargs)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _pyplot(axes):
    try:
        import matplotlib

        if axes is None and not os.environ.get("DISPLAY"):
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - exercised only without matplotlib
        raise ImportError("plotting needs matplotlib: pip install 'torchcal[plot]'") from err
    return plt


def plot_risk_coverage(curves, *, generalized: bool = False, title: str | None = None, axes=None):
    """Draws risk-coverage curves: ``curves`` maps a label to a
    :class:`torchcal.functional.selective.RiskCoverageCurve` (from
    :func:`torchcal.functional.risk_coverage_curve`), or is one curve. The selective risk (or, with
    ``generalized``, the generalized risk) against coverage; the legend carries AURC (AUGRC) ×100 by the
    per-sample rule of :func:`torchcal.functional.aurc`. Requires matplotlib. Returns the Figure.

    Example:
        >>> import torch
        >>> from torchcal.functional import risk_coverage_curve
        >>> curve = risk_coverage_curve(torch.tensor([.1, .2, .3, .4, .2]), torch.tensor([0, 0, 1, 1, 0]))
        >>> fig = plot_risk_coverage({"model": curve})
        >>> fig.axes[0].get_xlabel()
        'coverage'
    """
    from .functional.selective import RiskCoverageCurve

    plt = _pyplot(axes)
    if isinstance(curves, RiskCoverageCurve):
        curves = {"": curves}
    if not isinstance(curves, dict) or not all(isinstance(c, RiskCoverageCurve) for c in curves.values()):
        raise TypeError("`curves` must be a RiskCoverageCurve or a dict of label -> RiskCoverageCurve")
    fig, ax = (
        plt.subplots(figsize=(4.6, 3.6), constrained_layout=True) if axes is None else (axes.figure, axes)
    )
    for label, c in curves.items():
        y = (c.generalized_risk if generalized else c.risk).cpu()
        n = y.shape[0]
        area = float((y[1:] + y[:-1]).sum() / (2 * (n - 1))) if n >= 2 else float("nan")
        name = "AUGRC" if generalized else "AURC"
        ax.plot(c.coverage.cpu(), y, label=f"{label} ({name} {100 * area:.2f})".strip())
    ax.set_xlabel("coverage")
    ax.set_ylabel("generalized risk" if generalized else "selective risk")
    ax.set_xlim(0, 1)
    ax.legend(fontsize="small")
    if title:
        ax.set_title(title)
    return fig


def plot_set_sizes(sets_by_label, *, title: str | None = None, axes=None):
    """Draws the distribution of prediction-set sizes: ``sets_by_label`` maps a label to a boolean (N, K)
    mask of conformal sets (e.g. from :meth:`torchcal.conformal.SplitConformalClassifier.predict_sets`).
    Bars show the share of sets of each size; the legend carries the mean size. Requires matplotlib.
    Returns the Figure.

    Example:
        >>> import torch
        >>> fig = plot_set_sizes({"aps": torch.tensor([[True, False], [True, True]])})
        >>> fig.axes[0].get_xlabel()
        'set size'
    """
    from .functional.conformal import set_size_distribution

    plt = _pyplot(axes)
    if not isinstance(sets_by_label, dict) or not sets_by_label:
        raise TypeError("`sets_by_label` must be a non-empty dict of label -> boolean (N, K) sets")
    fig, ax = (
        plt.subplots(figsize=(4.6, 3.4), constrained_layout=True) if axes is None else (axes.figure, axes)
    )
    width = 0.8 / len(sets_by_label)
    for i, (label, sets) in enumerate(sets_by_label.items()):
        dist = set_size_distribution(sets).cpu()
        mean = float((dist * torch.arange(dist.shape[0], dtype=torch.float64)).sum())
        x = torch.arange(dist.shape[0], dtype=torch.float64) + (i - (len(sets_by_label) - 1) / 2) * width
        ax.bar(x, dist, width=width, label=f"{label} (mean {mean:.2f})")
    ax.set_xlabel("set size")
    ax.set_ylabel("share of samples")
    ax.legend(fontsize="small")
    if title:
        ax.set_title(title)
    return fig


_only_public(__name__)
