"""The papers' analysis figures, drawn from what runs saved (``metrics.jsonl``, its ``train.dynamics``
entries, ``logits.pt``), never by training again: ``torchcal figures RUN_OR_SWEEP... --out DIR``.

Each figure is a PNG and an SVG whose name starts with the paper and its figure number (``focal-fig3``,
``dualfocal-fig4b``, ``adafocal-fig1``, ``fcl-table9``); ``figures.json`` lists them with their captions and
the runs drawn, and the HTML report of ``torchcal report RUNS --out DIR`` links them when they are in
``DIR/figures``. Runs whose configs differ only in the seed form one curve: its mean, with a band of ± one
standard deviation over the seeds (the standard error with ``--band sem``). A figure whose data no run
logged is skipped with the config key that logs it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...calibrators.temperature import FTS_GAMMA_GRID, FTS_TEMPERATURE_GRID
from ..config import flatten_config
from ..errors import RunError, UserError
from ..evaluation.evaluate import distinct_folders, group_key, label_groups, load_logits
from ..run_files import atomic_write_bytes, make_dir, read_metrics

__all__ = [
    "FIGURES",
    "Curves",
    "draw_figures",
    "fcl_h",
    "fcl_h_root",
    "find_runs",
    "g_focal",
    "loss_arguments",
    "optimal_temperatures",
    "run_groups",
    "sweep_lines",
]

# name -> (caption, the key whose data it needs, or None when it needs only what every run saves)
FIGURES = {
    "focal-fig1": ("Focal loss Fig. 1: test NLL, test error and training loss over epochs", None),
    "focal-fig2": (
        "Focal loss Fig. 2: training-set reliability and share of samples per bin at chosen epochs",
        "train.dynamics=[bins]",
    ),
    "focal-fig3": (
        "Focal loss Fig. 3: test NLL, NLL / entropy / p_y of correct and wrong samples, test ECE over epochs",
        "train.dynamics=[outputs]",
    ),
    "focal-fig4a": ("Focal loss Fig. 4a: g(p, γ) = (1 − p)^γ − γ p (1 − p)^(γ−1) log p against p", None),
    "focal-fig4b": (
        "Focal loss Fig. 4b-d: per-sample gradient norms of the last linear layer over the "
        "training set (equal-mass histograms) at chosen epochs",
        "train.dynamics=[gradients]",
    ),
    "focal-weights": (
        "Focal loss §3: the last linear layer's weight norm over epochs",
        "train.dynamics=[weights]",
    ),
    "dualfocal-fig4a": (
        "Dual focal Fig. 4a: test ECE over epochs, exponential moving average 0.5",
        "train.test_every=1",
    ),
    "dualfocal-fig4b": (
        "Dual focal Fig. 4b: histogram of the test set's maximum logits (last epoch; equal-mass bins)",
        "train.dynamics=[logits]",
    ),
    "dualfocal-fig4c": (
        "Dual focal Fig. 4c: box plot of q_j, the largest probability below the true class's "
        "(test set, last epoch, first seed; outliers not shown)",
        "train.dynamics=[logits]",
    ),
    "adafocal-fig1": (
        "AdaFocal Figs. 1, 7-14: validation calibration gap (confidence − accuracy) per bin over epochs",
        "train.dynamics=[bins]",
    ),
    "adafocal-fig2": (
        "AdaFocal Fig. 2: training against validation confidence and accuracy per bin (last epoch)",
        "train.dynamics=[bins]",
    ),
    "fcl-table9": (
        "FCL Table 9 / A.17: ROC curves per class (one-vs-rest; per label for multi-label runs) "
        "with per-class AUROC, ECE and MCE in fcl-table9.csv",
        None,
    ),
    "adafocal-fig6": (
        "AdaFocal Fig. 6: ROC curves of OOD detection by predictive entropy (OOD positive) against the "
        "in-distribution test set, before and after temperature scaling (T minimising validation ECE)",
        "data.ood.sets=[svhn,cifar10_c] (a run evaluated on OOD sets)",
    ),
    "fcl-fig5": (
        "FCL Fig. 5 / Lemma A.3: h(q) = (1 − q)^γ/q − γ (1 − q)^(γ−1) log q − 2λq on (0, 1), strictly "
        "decreasing with one root (marked), for the (γ, λ) of the FCL runs, else the paper's",
        None,
    ),
    "fcl-fig7": (
        "FCL Fig. 7 / A.11: decision boundaries on 2-D data: p(class 1) of the first seed's selected model "
        "over the plane, its 0.5 contour and the test points, one panel per loss (grids in fcl-fig7.json)",
        "a set of 2-D points, data.name=moons (e.g. configs/moons_mlp_fcl.yaml)",
    ),
    "fcl-fig6": (
        "FCL Fig. 6: test NLL, ECE, AdaECE and classwise ECE before and after temperature scaling, and test "
        "error, against the loss argument the runs vary (λ of FCL; a loss without it, e.g. FL, as a dashed "
        "reference), values of fcl-fig6.csv",
        "a sweep over one loss argument, e.g. torchcal sweep sweeps/fcl_fig6_lambda.yaml",
    ),
    "fts-fig8": (
        "Focal temperature scaling Fig. 8: the temperature T minimising validation ECE (equal mass, 15 bins) "
        "of focal temperature scaling at each fixed γ_ev, one line per training loss (γ_tr of focal loss), "
        "values of fts-fig8.csv",
        "multiclass runs (their validation logits)",
    ),
}


@dataclass
class RunSet:
    """Runs whose configs differ only in the seed: one curve."""

    label: str
    config: dict
    runs: list[Path] = field(default_factory=list)
    rows: list[list[dict]] = field(default_factory=list)  # each run's metrics.jsonl rows
    seeds: list = field(default_factory=list)  # each run's train.seed (None: a config without one)


def find_runs(paths) -> list[Path]:
    """Run folders among ``paths``: a folder with ``config.yaml`` is a run; any other folder (a sweep's
    ``out``) contributes its sub-folders that are runs."""
    runs: list[Path] = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise UserError(f"{path} is not a folder (a run folder or a sweep's output folder)")
        if (path / "config.yaml").exists():
            runs.append(path)
            continue
        found = sorted(p for p in path.iterdir() if (p / "config.yaml").exists())
        if not found:
            raise UserError(f"{path} holds no run (no config.yaml in it or in its sub-folders)")
        runs.extend(found)
    return runs


def run_groups(run_dirs, warn=None) -> list[RunSet]:
    """The runs grouped as the report's rows (same config but the seed), with their logged rows. A curve
    counts each run and each seed once, as a report row does (decision 82): a folder given twice (or through
    a link, or once alone and once in its sweep's folder) is read once, and a run whose seed its group
    already has (a copied folder) is left out; each with a warning (``warn``, default :func:`warnings.warn`)
    naming the folders."""
    import warnings

    import yaml

    warn = warn or (lambda message: warnings.warn(message, UserWarning, stacklevel=3))
    groups: dict[str, RunSet] = {}
    for run in distinct_folders(run_dirs, warn):
        try:
            raw = yaml.safe_load((run / "config.yaml").read_text())
            if not isinstance(raw, dict):
                raise ValueError("config.yaml is not a mapping")
            rows = read_metrics(run)
        except (OSError, ValueError, yaml.YAMLError, RunError) as err:
            raise UserError(f"{run}: cannot be read ({err})") from None
        raw.pop("meta", None)
        flat = flatten_config(raw)
        key, config, label = group_key(flat)
        group = groups.setdefault(key, RunSet(label, config))
        seed = flat.get("train.seed")
        if seed in group.seeds:
            twin = group.runs[group.seeds.index(seed)]
            warn(f"{run} repeats seed {seed} of {twin} with the same config (a copy, or the same training "
                 f"elsewhere): left out, a curve counts each seed once")  # fmt: skip
            continue
        group.runs.append(run)
        group.rows.append(rows)
        group.seeds.append(seed)
    out = list(groups.values())
    label_groups(out)
    return out


@dataclass
class Curves:
    """A quantity per epoch over a group's seeds: mean and band (± std or ± standard error)."""

    epochs: torch.Tensor
    mean: torch.Tensor
    band: torch.Tensor
    n: int


def curve(group: RunSet, value, band: str = "std") -> Curves | None:
    """``value(row)`` (a number or None) per epoch, over the epochs every seed logged; None when no seed
    logged it."""
    series = []
    for rows in group.rows:
        points = {r["epoch"]: value(r) for r in rows}
        series.append({e: v for e, v in points.items() if v is not None and math.isfinite(v)})
    common = sorted(set.intersection(*(set(s) for s in series))) if series else []
    if not common:
        return None
    data = torch.tensor([[s[e] for e in common] for s in series], dtype=torch.float64)
    n = data.shape[0]
    std = data.std(dim=0, unbiased=True) if n > 1 else torch.zeros(len(common), dtype=torch.float64)
    spread = std / math.sqrt(n) if band == "sem" else std
    return Curves(torch.tensor(common), data.mean(dim=0), spread, n)


def ema(values: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """Exponential moving average s_t = α x_t + (1 − α) s_{t−1}, s_0 = x_0 (dual focal Fig. 4a: α = 0.5)."""
    out = values.clone()
    for t in range(1, len(values)):
        out[t] = alpha * values[t] + (1 - alpha) * out[t - 1]
    return out


def g_focal(p: torch.Tensor, gamma: float) -> torch.Tensor:
    """Focal loss's gradient factor g(p, γ) = (1 − p)^γ − γ p (1 − p)^(γ−1) log p (Mukhoti et al. §4): the
    focal gradient of the last layer is g times the cross entropy's."""
    p = p.double()
    return (1 - p) ** gamma - gamma * p * (1 - p) ** (gamma - 1) * torch.log(p)


def _dyn(row: dict, *keys):
    value = row.get("dynamics")
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def _plot_curves(ax, groups, value, band, label_suffix="", **style):
    drawn = False
    for i, group in enumerate(groups):
        c = curve(group, value, band)
        if c is None:
            continue
        color = f"C{i % 10}"
        ax.plot(c.epochs.numpy(), c.mean.numpy(), color=color, label=f"{group.label}{label_suffix} (n={c.n})",
                **style)  # fmt: skip
        if c.n > 1:
            ax.fill_between(c.epochs.numpy(), (c.mean - c.band).numpy(), (c.mean + c.band).numpy(), color=color,
                            alpha=0.2, linewidth=0)  # fmt: skip
        drawn = True
    return drawn


def _chosen_epochs(groups, epochs, key) -> list[int]:
    logged = sorted({r["epoch"] for g in groups for rows in g.rows for r in rows if _dyn(r, key) is not None})
    if epochs:
        missing = [e for e in epochs if e not in logged]
        if missing:
            raise UserError(
                f"--epochs {missing}: not logged with train.dynamics=[{key}]; logged epochs: {logged}"
            )
        return list(epochs)
    if len(logged) <= 4:
        return logged
    return [logged[round(i * (len(logged) - 1) / 3)] for i in range(4)]


def _equal_mass_hist(ax, percentiles, **style):
    """The distribution of 101 percentiles as an equal-mass histogram of 20 bins (every fifth percentile: 5%
    of the samples in each bin)."""
    q = torch.tensor(percentiles, dtype=torch.float64)[::5]
    width = (q[1:] - q[:-1]).clamp(min=1e-12)
    density = 0.05 / width
    xs = torch.repeat_interleave(q, 2)[1:-1].numpy()
    ys = torch.repeat_interleave(density, 2).numpy()
    ax.plot(xs, ys, **style)


def _first_row(rows, key):
    """The last logged row of one run that holds ``dynamics[key]``, or None."""
    for r in reversed(rows):
        if _dyn(r, key) is not None:
            return r
    return None


def _group_row(group: RunSet, key) -> dict | None:
    """The last row holding ``dynamics[key]`` of the group's first run that logged it."""
    return next((row for rows in group.rows if (row := _first_row(rows, key)) is not None), None)


def draw_figures(
    groups: list[RunSet],
    names,
    out: Path,
    *,
    band: str = "std",
    epochs=(),
    gammas=(1, 2, 3, 5, 7),
    sweep_key: str | None = None,
    calibrator: str = "ts",
    gammas_ev=FTS_GAMMA_GRID,
    temperatures=FTS_TEMPERATURE_GRID,
):
    """Draws each figure of ``names`` that the groups' data allow into ``out``; returns (written, skipped):
    written maps a figure name to its data (what was plotted), skipped to the key that would log it.

    ``sweep_key``: the loss argument on fcl-fig6's x axis (found by itself when the runs vary only one);
    ``calibrator``: fcl-fig6's "post" calibrator; ``gammas_ev`` and ``temperatures``: fts-fig8's grids (the
    paper's by default)."""
    from ...plotting import _pyplot, save_figure

    plt = _pyplot(None)
    written: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    existed = out.exists()
    if "fcl-fig6" in names:
        sweep_lines(groups, sweep_key)  # an unknown or ambiguous x axis is refused before anything is written
    make_dir(out)

    def save(name, fig, data):
        fig.set_layout_engine("constrained")  # titles and labels of neighbouring panels do not overlap
        for suffix in (".png", ".svg"):
            save_figure(fig, out / f"{name}{suffix}", dpi=110, bbox_inches="tight")
        plt.close(fig)
        written[name] = data

    def finish(name, fig, data, drawn, needs):
        """Saves the figure when anything was drawn; otherwise records the key that would log its data."""
        if drawn:
            save(name, fig, data)
        else:
            plt.close(fig)
            skipped[name] = needs

    def legend(ax):  # below the axes: run-group labels are long
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)

    for name in names:
        caption, needs = FIGURES[name]
        if name == "focal-fig1":
            fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
            drawn = False
            for ax, key, title in zip(axes, ("test_nll", "test_error", "train_loss"),
                                      ("test NLL", "test error", "training loss"), strict=True):  # fmt: skip
                drawn |= _plot_curves(ax, groups, lambda r, k=key: r.get(k), band)
                ax.set(xlabel="epoch", title=title)
            legend(axes[0])
            finish(name, fig, {"groups": [g.label for g in groups]}, drawn, "train.test_every=1")
        elif name == "focal-fig3":
            panels = [("test NLL", ("outputs", "nll")), ("NLL, correct", ("outputs", "nll_correct")),
                      ("NLL, wrong", ("outputs", "nll_wrong")), ("entropy, wrong", ("outputs", "entropy_wrong")),
                      ("p_y, correct", ("outputs", "p_y_correct")), ("p_y, wrong", ("outputs", "p_y_wrong")),
                      ("test ECE", ("outputs", "ece"))]  # fmt: skip
            fig, axes = plt.subplots(2, 4, figsize=(15, 6.5))
            drawn = False
            data = {}
            for ax, (title, keys) in zip(axes.flat, panels, strict=False):
                drawn |= _plot_curves(ax, groups, lambda r, k=keys: _dyn(r, *k), band)
                ax.set(xlabel="epoch", title=title)
                data[title] = {
                    g.label: _as_list(curve(g, lambda r, k=keys: _dyn(r, *k), band)) for g in groups
                }
            axes.flat[-1].axis("off")
            legend(axes.flat[0])
            finish(name, fig, data, drawn, needs)
        elif name == "focal-fig4a":
            fig, ax = plt.subplots(figsize=(4.5, 3.4))
            p = torch.linspace(1e-3, 1 - 1e-3, 500, dtype=torch.float64)
            ax.plot(
                p.numpy(), torch.ones_like(p).numpy(), "k--", linewidth=0.8, label="cross entropy (g = 1)"
            )
            for gamma in gammas:
                ax.plot(p.numpy(), g_focal(p, gamma).numpy(), label=f"γ = {gamma:g}")
            ax.set(xlabel="p", ylabel="g(p, γ)", ylim=(-0.1, 3))
            legend(ax)
            save(name, fig, {"gammas": list(gammas)})
        elif name == "focal-fig4b":
            if not any(_first_row(rows, "gradients") for g in groups for rows in g.rows):
                skipped[name] = needs
                continue
            chosen = _chosen_epochs(groups, epochs, "gradients")
            fig, axes = plt.subplots(1, len(chosen), figsize=(4 * len(chosen), 3.2), squeeze=False)
            data = {}
            for ax, epoch in zip(axes[0], chosen, strict=True):
                for i, g in enumerate(groups):
                    row = next((r for r in g.rows[0] if r["epoch"] == epoch and _dyn(r, "gradients")), None)
                    if row is not None:
                        _equal_mass_hist(ax, row["dynamics"]["gradients"]["percentiles"], color=f"C{i % 10}",
                                         label=g.label)  # fmt: skip
                        data[f"{g.label} @ {epoch}"] = row["dynamics"]["gradients"]["percentiles"]
                ax.set(xlabel="‖∂L/∂W‖ per sample", ylabel="density", title=f"epoch {epoch}")
            legend(axes[0][0])
            save(name, fig, data)
        elif name == "focal-weights":
            fig, ax = plt.subplots(figsize=(4.5, 3.4))
            drawn = _plot_curves(ax, groups, lambda r: _dyn(r, "weights", "last_linear_norm"), band)
            ax.set(xlabel="epoch", ylabel="‖W‖ of the last linear layer")
            legend(ax)
            finish(name, fig, {}, drawn, needs)
        elif name == "dualfocal-fig4a":
            fig, ax = plt.subplots(figsize=(4.5, 3.4))
            data = {}
            for i, g in enumerate(groups):
                c = curve(g, lambda r: r.get("test_ece"), band)
                if c is None:
                    continue
                smooth = ema(c.mean, 0.5)
                ax.plot(
                    c.epochs.numpy(), 100 * smooth.numpy(), color=f"C{i % 10}", label=f"{g.label} (n={c.n})"
                )
                data[g.label] = smooth.tolist()
            ax.set(xlabel="epoch", ylabel="test ECE (%), EMA 0.5")
            legend(ax)
            finish(name, fig, data, bool(data), needs)
        elif name == "dualfocal-fig4b":
            fig, ax = plt.subplots(figsize=(4.5, 3.4))
            data = {}
            for i, g in enumerate(groups):
                row = _group_row(g, "logits")
                if row is not None:
                    q = row["dynamics"]["logits"]["max_logit_percentiles"]
                    _equal_mass_hist(ax, q, color=f"C{i % 10}", label=g.label)
                    data[g.label] = q
            ax.set(xlabel="maximum logit", ylabel="density")
            legend(ax)
            finish(name, fig, data, bool(data), needs)
        elif name == "dualfocal-fig4c":
            stats, labels = [], []
            for g in groups:
                row = _group_row(g, "logits")
                if row is not None:
                    stats.append(dict(row["dynamics"]["logits"]["q_j"], label=g.label))
                    labels.append(g.label)
            if stats:
                fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(stats), 3.6))
                ax.bxp(stats, showfliers=False)
                ax.set(ylabel="q_j")
                ax.tick_params(axis="x", labelrotation=20, labelsize=7)
                save(name, fig, {s["label"]: {k: v for k, v in s.items() if k != "label"} for s in stats})
            else:
                skipped[name] = needs
        elif name == "adafocal-fig1":
            shown = [(g, row) for g in groups if (row := _group_row(g, "bins")) is not None]
            if not shown:
                skipped[name] = needs
                continue
            fig, axes = plt.subplots(1, len(shown), figsize=(4.6 * len(shown), 3.4), squeeze=False)
            data = {}
            for ax, (g, row) in zip(axes[0], shown, strict=True):
                n_bins = len(row["dynamics"]["bins"]["val"]["count"])
                data[g.label] = {}
                for b in range(n_bins):

                    def gap(r, b=b):
                        v = _dyn(r, "bins", "val")
                        if v is None or v["count"][b] == 0:
                            return None
                        return 100 * (v["confidence"][b] - v["accuracy"][b])

                    c = curve(g, gap, band)
                    if c is not None:
                        ax.plot(c.epochs.numpy(), c.mean.numpy(), linewidth=1,
                                label=f"({b / n_bins:.2f}, {(b + 1) / n_bins:.2f}]")  # fmt: skip
                        data[g.label][b] = c.mean.tolist()
                ax.axhline(0, color="black", linestyle="--", linewidth=0.8)
                ax.set(xlabel="epoch", ylabel="val confidence − accuracy (%)", title=g.label)
                legend(ax)
            save(name, fig, data)
        elif name == "adafocal-fig2":
            shown = [(g, row) for g in groups if (row := _group_row(g, "bins")) is not None]
            if not shown:
                skipped[name] = needs
                continue
            fig, axes = plt.subplots(1, len(shown), figsize=(4.6 * len(shown), 3.4), squeeze=False)
            data = {}
            for ax, (g, row) in zip(axes[0], shown, strict=True):
                bins = row["dynamics"]["bins"]
                m = len(bins["val"]["count"])
                centres = [(b + 0.5) / m for b in range(m)]
                for split, marker in (("train", "o"), ("val", "s")):
                    conf, acc = bins[split]["confidence"], bins[split]["accuracy"]
                    xs = [x for x, c in zip(centres, conf, strict=True) if c is not None]
                    ax.plot(
                        xs, [c for c in conf if c is not None], marker=marker, label=f"{split} confidence"
                    )
                    ax.plot(xs, [a for a in acc if a is not None], marker=marker, linestyle=":",
                            label=f"{split} accuracy")  # fmt: skip
                ax.set(xlabel="confidence bin", ylabel="value", title=g.label)
                legend(ax)
                data[g.label] = bins
            save(name, fig, data)
        elif name == "focal-fig2":
            if not any(_first_row(rows, "bins") for g in groups for rows in g.rows):
                skipped[name] = needs
                continue
            chosen = _chosen_epochs(groups, epochs, "bins")
            # the first run that logged the bins (the figure shows one run, as the paper's)
            g, run, rows = next((g, r, rows) for g in groups for r, rows in zip(g.runs, g.rows, strict=True)
                                if _first_row(rows, "bins"))  # fmt: skip
            fig, axes = plt.subplots(2, len(chosen), figsize=(3.4 * len(chosen), 5.6), squeeze=False)
            data = {}
            for j, epoch in enumerate(chosen):
                row = next((r for r in rows if r["epoch"] == epoch and _dyn(r, "bins")), None)
                if row is None:
                    continue
                train_bins = row["dynamics"]["bins"]["train"]
                m = len(train_bins["count"])
                edges = [b / m for b in range(m)]
                acc = [a if a is not None else 0.0 for a in train_bins["accuracy"]]
                total = sum(train_bins["count"]) or 1
                share = [100 * c / total for c in train_bins["count"]]
                axes[0][j].bar(edges, acc, width=1 / m, align="edge", edgecolor="black", linewidth=0.4)
                axes[0][j].plot([0, 1], [0, 1], "k--", linewidth=0.8)
                axes[0][j].set(title=f"epoch {epoch}", xlabel="confidence", ylabel="accuracy", xlim=(0, 1),
                               ylim=(0, 1))  # fmt: skip
                axes[1][j].bar(edges, share, width=1 / m, align="edge", edgecolor="black", linewidth=0.4)
                axes[1][j].set(xlabel="confidence", ylabel="% of samples", xlim=(0, 1))
                data[epoch] = {"accuracy": train_bins["accuracy"], "share": share}
            fig.suptitle(f"{g.label}: {run.name}", fontsize=9)
            save(name, fig, data)
        elif name in ("fcl-fig6", "fts-fig8"):
            if name == "fcl-fig6":
                fig, data = _loss_argument_figure(plt, groups, out, band, sweep_key, calibrator)
            else:
                fig, data = _optimal_temperature_figure(plt, groups, out, band, gammas_ev, temperatures)
            if fig is None:
                skipped[name] = needs
            else:
                save(name, fig, data)
        elif name == "fcl-table9":
            fig, axes = plt.subplots(1, len(groups), figsize=(4.6 * len(groups), 4.2), squeeze=False)
            rows_csv = ["run,class,auroc,ece,mce"]
            data = {}
            for ax, g in zip(axes[0], groups, strict=True):
                run = g.runs[0]
                try:
                    test = load_logits(run)["test"]
                except RunError as err:
                    raise UserError(f"{run}: {err}") from None
                per_class = per_class_table(test["logits"], test["targets"])
                data[g.label] = [
                    {k: v for k, v in e.items() if k in ("auroc", "ece", "mce")} for e in per_class
                ]
                for k, entry in enumerate(per_class):
                    rows_csv.append(f"{run},{k},{entry['auroc']:.6f},{entry['ece']:.6f},{entry['mce']:.6f}")
                    ax.plot(
                        entry["fpr"],
                        entry["tpr"],
                        linewidth=1,
                        label=f"class {k}: AUROC {entry['auroc']:.3f}",
                    )
                ax.plot([0, 1], [0, 1], "k--", linewidth=0.8)
                ax.set(
                    xlabel="false positive rate", ylabel="true positive rate", title=f"{g.label} ({run.name})"
                )
                ax.legend(fontsize=6)
            table = ("\n".join(rows_csv) + "\n").encode()
            atomic_write_bytes(out / "fcl-table9.csv", lambda fh, text=table: fh.write(text))
            save(name, fig, data)
        elif name == "adafocal-fig6":
            finish(name, *_ood_roc_figure(plt, groups), needs)
        elif name == "fcl-fig5":
            fig, data = _fcl_fig5(plt, groups)
            save(name, fig, data)
        elif name == "fcl-fig7":
            drawn_fig7 = _fcl_fig7(plt, groups)
            if drawn_fig7 is None:
                skipped[name] = needs
                continue
            fig, data = drawn_fig7
            grids = json.dumps(data, indent=1).encode()
            atomic_write_bytes(out / "fcl-fig7.json", lambda fh, text=grids: fh.write(text))
            save(name, fig, data)
    if not written:  # nothing drawn: nothing written (a figure's files are written only with its picture)
        if not existed:
            out.rmdir()
        return written, skipped
    index = [{"name": n, "png": f"{n}.png", "svg": f"{n}.svg", "caption": FIGURES[n][0],
              "runs": [str(r) for g in groups for r in g.runs]} for n in written]  # fmt: skip
    text = json.dumps({"figures": index, "skipped": skipped}, indent=2)
    atomic_write_bytes(out / "figures.json", lambda fh: fh.write(text.encode()))
    return written, skipped


def _as_list(c: Curves | None):
    return (
        None if c is None else {"epochs": c.epochs.tolist(), "mean": c.mean.tolist(), "band": c.band.tolist()}
    )


def per_class_table(logits: torch.Tensor, targets: torch.Tensor, n_bins: int = 15) -> list[dict]:
    """Per class (one-vs-rest on the softmax; per label on the sigmoid of a multi-label run): AUROC, the
    binary ECE and MCE of that class's probability (equal-width bins) and the ROC curve's points."""
    from ...functional.binary import multilabel_auroc, multilabel_ece, multilabel_mce

    if targets.ndim == 2:  # multi-label
        probs, onehot = torch.sigmoid(logits.double()), targets.long()
    else:
        probs = torch.softmax(logits.double(), dim=1)
        onehot = torch.nn.functional.one_hot(targets.long(), logits.shape[1])
    auroc = multilabel_auroc(probs, onehot, average="none")
    ece = multilabel_ece(probs, onehot, n_bins=n_bins, average="none")
    mce = multilabel_mce(probs, onehot, n_bins=n_bins, average="none")
    out = []
    for k in range(probs.shape[1]):
        fpr, tpr = roc_curve(probs[:, k], onehot[:, k])
        out.append(
            {"auroc": float(auroc[k]), "ece": float(ece[k]), "mce": float(mce[k]), "fpr": fpr, "tpr": tpr}
        )
    return out


def roc_curve(scores: torch.Tensor, labels: torch.Tensor) -> tuple[list[float], list[float]]:
    """The ROC curve's corners: thresholds at each distinct score, from (0, 0) to (1, 1)."""
    order = torch.argsort(scores, descending=True, stable=True)
    s, y = scores[order], labels[order].double()
    distinct = torch.nonzero(s[1:] != s[:-1]).flatten()
    ends = torch.cat([distinct, torch.tensor([len(s) - 1])])
    tp = torch.cumsum(y, 0)[ends]
    fp = (ends + 1).double() - tp
    pos, neg = max(float(y.sum()), 1.0), max(float(len(y) - y.sum()), 1.0)
    return [0.0, *(fp / neg).tolist()], [0.0, *(tp / pos).tolist()]


def ood_roc(logits_in: torch.Tensor, logits_out: torch.Tensor, to_probs) -> dict:
    """OOD detection by predictive entropy (OOD = positive) of ``to_probs(logits)``: the ROC curve's points
    and its AUROC (:func:`torchcal.functional.ood_auroc`, the report's number)."""
    from ... import functional as F

    p_in, p_out = to_probs(logits_in).double(), to_probs(logits_out).double()

    def entropy(p):
        return -(p * torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))).sum(dim=1)

    scores = torch.cat([entropy(p_in), entropy(p_out)])
    labels = torch.cat([torch.zeros(len(p_in)), torch.ones(len(p_out))])
    fpr, tpr = roc_curve(scores, labels)
    return {"auroc": float(F.ood_auroc(p_in, p_out)), "fpr": fpr, "tpr": tpr}


def _ood_roc_figure(plt, groups):
    """AdaFocal Fig. 6: one panel per OOD set, per run group (its first seed) the ROC curve before (solid)
    and after (dashed) temperature scaling fitted on the validation logits by ECE (AdaFocal Table 8's
    criterion). Returns (figure, data, drawn)."""
    import warnings

    from ...calibrators import from_spec
    from ..evaluation.evaluate import run_task

    shown = []
    for g in groups:
        run = g.runs[0]
        try:
            logits = load_logits(run)
        except RunError as err:
            raise UserError(f"{run}: {err}") from None
        sets = sorted(k[4:] for k in logits if k.startswith("ood_"))
        if sets and run_task(logits) == "multiclass":
            with warnings.catch_warnings():  # a search past the grid's edge is the calibrator's to report
                warnings.simplefilter("ignore")
                cal = from_spec("ts:objective=ece").fit(logits["val"]["logits"], logits["val"]["targets"])
            shown.append((g, run, logits, sets, cal))
    names = sorted({name for *_, sets, _ in shown for name in sets})
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(4.8 * max(1, len(names)), 4.4), squeeze=False)
    data: dict = {}
    for ax, name in zip(axes[0], names, strict=False):
        data[name] = {}
        for i, (g, run, logits, sets, cal) in enumerate(shown):
            if name not in sets:
                continue
            stages = (
                ("pre T", lambda z: torch.softmax(z.double(), dim=1), "-"),
                ("post T", cal.transform, "--"),
            )
            for stage, to_probs, style in stages:
                roc = ood_roc(logits["test"]["logits"], logits[f"ood_{name}"]["logits"], to_probs)
                ax.plot(roc["fpr"], roc["tpr"], color=f"C{i % 10}", linestyle=style, linewidth=1,
                        label=f"{g.label} {stage}: AUROC {100 * roc['auroc']:.2f}")  # fmt: skip
                data[name][f"{g.label} {stage}"] = {
                    "run": str(run), "auroc": roc["auroc"], "temperature": float(cal.temperature_),
                }  # fmt: skip
        ax.plot([0, 1], [0, 1], "k:", linewidth=0.8)
        ax.set(xlabel="false positive rate", ylabel="true positive rate", title=f"in: test set, OOD: {name}")
        ax.legend(fontsize=6, loc="lower right")
    return fig, data, bool(shown)
# ----------------------------------------------------------------------------- FCL Figs. 5 and 7

# the FCL paper's settings drawn by fcl-fig5 when no FCL run is given: (γ, λ) of its App. A.10 table
# (CIFAR-10 ResNet-50 and WRN-26-10) and of the decision-boundary experiment (App. A.11)
FCL_PAPER_SETTINGS = ((4.0, 1.5), (2.0, 0.5), (10.0, 1.5))


def fcl_h(q, gamma: float, lambda_: float) -> torch.Tensor:
    """FCL's h(q) = (1 − q)^γ / q − γ (1 − q)^(γ−1) log q − 2λq = g(q, γ)/q − 2λq (Lemma A.3, Eq. 59 as
    decision 190 reads it) in float64 on q ∈ (0, 1): minus the derivative of the focal term −(1 − q)^γ log q
    plus λq², the q-dependent part of the stationarity condition of FCL's conditional risk. It falls strictly
    from +∞ (q → 0) to −2λ (q → 1; 1 − 2λ at γ = 0) for every γ ≥ 0, λ ≥ 0.

    Example:
        >>> float(fcl_h(0.5, 0.0, 0.0))  # γ = 0, λ = 0: the cross entropy's 1/q
        2.0
    """
    q = torch.as_tensor(q, dtype=torch.float64)
    one_minus = 1 - q
    return one_minus**gamma / q - gamma * one_minus ** (gamma - 1) * torch.log(q) - 2 * lambda_ * q


def fcl_h_root(gamma: float, lambda_: float) -> float | None:
    """The unique root q* ∈ (0, 1) of :func:`fcl_h`, by bisection in float64 down to adjacent floats (h is
    continuous and strictly decreasing); None when h stays positive (λ = 0, or γ = 0 with λ <= 1/2).

    Example:
        >>> q = fcl_h_root(4.0, 1.5)  # the FCL paper's CIFAR-10 ResNet-50 setting
        >>> round(q, 4), abs(float(fcl_h(q, 4.0, 1.5))) < 1e-12
        (0.3932, True)
        >>> fcl_h_root(0.0, 0.25) is None  # h(q) = 1/q − q/2 > 0 on (0, 1)
        True
    """
    limit_at_one = (1.0 if gamma == 0 else 0.0) - 2 * lambda_
    if limit_at_one >= 0:
        return None
    lo, hi = 1e-300, 1.0 - 2.0**-53  # h(lo) > 0: its first term is ~1e300; h(hi) < 0 (near its limit)
    while True:
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if float(fcl_h(mid, gamma, lambda_)) > 0:
            lo = mid
        else:
            hi = mid
    return lo if abs(float(fcl_h(lo, gamma, lambda_))) <= abs(float(fcl_h(hi, gamma, lambda_))) else hi


def _fcl_settings(groups) -> list[tuple[float, float, str]]:
    """(γ, λ, source) of the groups' FCL runs (their loss's values, defaults included), else the paper's."""
    from ...losses import FocalCalibrationLoss, create

    found: list[tuple[float, float, str]] = []
    for g in groups:
        if g.config.get("loss.name") != "fcl":
            continue
        loss = create("fcl", **dict(g.config.get("loss.kwargs") or {}))
        if not isinstance(loss, FocalCalibrationLoss) or loss.distance != "l2":
            continue  # the L1 ablation's term has another derivative (2λ(1 − q): constant in q)
        setting = (float(loss.gamma), float(loss.lambda_))
        if setting not in [(a, b) for a, b, _ in found]:
            found.append((*setting, g.label))
    return found or [(gam, lam, "paper") for gam, lam in FCL_PAPER_SETTINGS]


def _fcl_fig5(plt, groups):
    settings = _fcl_settings(groups)
    fig, ax = plt.subplots(figsize=(5.2, 3.8))
    near_zero = torch.logspace(-4, -1, 200, dtype=torch.float64)  # h's steep part, resolved on a log scale
    q = torch.cat([near_zero, torch.linspace(0.1, 1 - 1e-6, 600, dtype=torch.float64)[1:]])
    curves = []
    low = 0.0
    for i, (gamma, lam, source) in enumerate(settings):
        h = fcl_h(q, gamma, lam)
        root = fcl_h_root(gamma, lam)
        color = f"C{i % 10}"
        shown = "" if source == "paper" else f", {source}"
        ax.plot(q.numpy(), h.numpy(), color=color, label=f"γ = {gamma:g}, λ = {lam:g}{shown}")
        if root is not None:
            ax.plot([root], [0.0], "o", color=color, markersize=5)
            # labels stacked by curve, so that roots close together stay readable
            ax.annotate(f"q* = {root:.3f}", (root, 0.0), textcoords="offset points", xytext=(4, 6 + 11 * i),
                        fontsize=7, color=color)  # fmt: skip
        low = min(low, float(h[-1]))
        curves.append({"gamma": gamma, "lambda": lam, "source": source, "root": root,
                       "h_at_1": float(h[-1])})  # fmt: skip
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set(xlabel="q", ylabel="h(q)", xlim=(0, 1), ylim=(low - 0.5, 10),
           title="FCL: h(q) = (1−q)^γ/q − γ(1−q)^(γ−1) log q − 2λq")  # fmt: skip
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7)
    return fig, {"curves": curves}


def _loss_name(config: dict) -> str:
    """The loss as a title names it: its registry name and arguments (``fcl (gamma=10, lambda_=1.5)``)."""
    kwargs = config.get("loss.kwargs") or {}
    args = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in kwargs.items())
    return f"{config.get('loss.name')}" + (f" ({args})" if args else "")


def _first_seed(group: RunSet) -> Path:
    import yaml

    def seed(run):
        try:
            saved = yaml.safe_load((run / "config.yaml").read_text()) or {}
            return int((saved.get("train") or {}).get("seed", 0))
        except (OSError, yaml.YAMLError, TypeError, ValueError, AttributeError):
            return 0

    return min(group.runs, key=lambda run: (seed(run), str(run)))


def _boundary_grid(model, inputs: torch.Tensor, size: int = 150):
    """A size × size grid over the points' range (10 % margin each side) and p(class 1) of ``model`` on it:
    (xs, ys, probabilities of shape (size, size), row i at ys[i])."""
    lo, hi = inputs.double().amin(0), inputs.double().amax(0)
    pad = 0.1 * (hi - lo)
    xs = torch.linspace(float(lo[0] - pad[0]), float(hi[0] + pad[0]), size, dtype=torch.float64)
    ys = torch.linspace(float(lo[1] - pad[1]), float(hi[1] + pad[1]), size, dtype=torch.float64)
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    points = torch.stack([xx.flatten(), yy.flatten()], 1).to(inputs.dtype)
    with torch.no_grad():
        logits = model(points)
    probs = torch.softmax(logits.double(), 1)[:, 1].reshape(size, size)
    return xs, ys, probs


def _fcl_fig7(plt, groups):
    """The decision-boundary panels of the groups on 2-D points; None when no group has them. A group of
    other data is left out with its reason in the data's ``left_out``."""
    from ...functional import ece
    from ..data.catalog import POINT_DATASETS
    from .gradcam import load_run_model

    shown, left_out = [], {}
    for g in groups:
        data_name = g.config.get("data.name")
        if data_name not in POINT_DATASETS:
            left_out[g.label] = (f"data.name={data_name} is not a set of 2-D points: decision boundaries over the "
                                 f"plane need {', '.join(POINT_DATASETS)}")  # fmt: skip
            continue
        run = _first_seed(g)
        try:
            test = load_logits(run)["test"]
            model, splits = load_run_model(run)
        except (RunError, OSError) as err:
            raise UserError(f"{run}: {err}") from None
        inputs = splits["test"].inputs
        if not isinstance(inputs, torch.Tensor) or inputs.ndim != 2 or inputs.shape[1] != 2:
            left_out[g.label] = f"{run}: its test inputs have shape {tuple(inputs.shape)}, not (N, 2)"
            continue
        if test["logits"].shape[1] != 2:
            left_out[g.label] = f"{run}: {test['logits'].shape[1]} classes; the figure draws p(class 1) of two"
            continue
        with torch.no_grad():
            again = model(inputs)
        # the same float32 network on the same points: equal up to the rounding of a different batch split
        scale = 1e-4 * (1 + float(test["logits"].abs().max()))
        if again.shape != test["logits"].shape or not torch.allclose(again, test["logits"], rtol=0, atol=scale):
            raise UserError(
                f"{run}: the saved weights do not reproduce its logits.pt on the test points drawn again "
                f"(data.name={data_name}): the data generator changed since the run; train it again"
            )
        xs, ys, probs = _boundary_grid(model, inputs)
        test_ece = float(ece(test["logits"].double(), test["targets"], from_logits=True))
        shown.append((g, run, inputs, splits["test"].targets, xs, ys, probs, test_ece))
    if not shown:
        return None
    fig, axes = plt.subplots(1, len(shown), figsize=(4.4 * len(shown) + 0.8, 4.0), squeeze=False)
    data: dict = {"groups": {}, "left_out": left_out}
    contours = None
    for ax, (g, run, inputs, targets, xs, ys, probs, test_ece) in zip(axes[0], shown, strict=True):
        contours = ax.contourf(xs.numpy(), ys.numpy(), probs.numpy(), levels=[i / 10 for i in range(11)],
                               cmap="RdBu_r", vmin=0, vmax=1)  # fmt: skip
        ax.contour(xs.numpy(), ys.numpy(), probs.numpy(), levels=[0.5], colors="black", linewidths=1.2)
        for k, marker in ((0, "o"), (1, "s")):
            chosen = targets == k
            ax.scatter(inputs[chosen, 0].numpy(), inputs[chosen, 1].numpy(), s=6, marker=marker,
                       c=f"C{3 if k else 0}", edgecolors="white", linewidths=0.3, label=f"class {k}")  # fmt: skip
        ax.set(xlabel="x₁", ylabel="x₂", title=f"{_loss_name(g.config)}\ntest ECE {100 * test_ece:.2f} %")
        ax.title.set_fontsize(9)
        data["groups"][g.label] = {"run": str(run), "loss": _loss_name(g.config), "test_ece": test_ece,
                                   "xs": xs.tolist(), "ys": ys.tolist(), "p1": probs.tolist()}  # fmt: skip
    axes[0][0].legend(fontsize=7, loc="lower left")
    if contours is not None:
        fig.colorbar(contours, ax=list(axes[0]), label="p(class 1)", shrink=0.9)
    return fig, data


# -- fcl-fig6: test metrics against the loss argument a sweep varies; fts-fig8: the optimal T against γ_ev --

_SYMBOLS = {"gamma": "γ", "lambda_": "λ", "alpha": "α", "beta": "β"}
_SHORT_NAMES = {"FocalLoss": "FL", "FocalCalibrationLoss": "FCL", "CrossEntropyLoss": "CE", "DualFocalLoss": "DFL",
                "InverseFocalLoss": "IFL", "MMCELoss": "MMCE", "KDEXELoss": "KDE-XE"}  # fmt: skip
# fcl-fig6's panels: (results key, title, factor of the plotted value); each before and after the calibrator
FIG6_METRICS = (("nll", "NLL", 1.0), ("ece", "ECE (%)", 100.0), ("adaece", "AdaECE (%)", 100.0),
                ("classwise_ece", "classwise ECE (%)", 100.0))  # fmt: skip


def _built_loss(config: dict):
    """The loss module a run's (flattened) config builds; None when this library cannot build it."""
    from ...losses import create

    try:
        return create(str(config.get("loss.name")), **(config.get("loss.kwargs") or {}))
    except (ValueError, TypeError):
        return None


def loss_arguments(config: dict) -> tuple[str, dict[str, float]]:
    """(the loss's class name, its finite numeric arguments) as a run's flattened config builds the loss: the
    values its name fixes (γ of ``fl-3``) and its defaults included, e.g. ``("FocalCalibrationLoss",
    {"gamma": 4.0, "lambda_": 0.5})``. A loss this library cannot build gives its name and the numbers of
    its ``loss.kwargs``.

    Example:
        >>> loss_arguments({"loss.name": "fl-3", "loss.kwargs": {}})
        ('FocalLoss', {'gamma': 3.0})
        >>> loss_arguments({"loss.name": "fcl", "loss.kwargs": {"lambda_": 0.5}})
        ('FocalCalibrationLoss', {'gamma': 4.0, 'lambda_': 0.5})
    """
    loss = _built_loss(config)
    if loss is None:
        name, values = str(config.get("loss.name")), dict(config.get("loss.kwargs") or {})
    else:
        name, values = type(loss).__name__, {a: getattr(loss, a, None) for a in getattr(loss, "_args", ())}
    return name, {
        k: float(v)
        for k, v in values.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


def _style(i: int) -> dict:
    """Colour, line style and marker of line i: the ten default colours, then again with another style."""
    return {"color": f"C{i % 10}", "linestyle": ("-", "--", ":", "-.")[i // 10 % 4],
            "marker": ("o", "s", "^", "D")[i // 10 % 4]}  # fmt: skip


def _loss_label(config: dict, cls: str, args: dict, skip: str | None = None) -> str:
    """A loss with its numeric arguments but ``skip`` (and a zero label smoothing): "FCL (γ = 4, λ = 0.5)"."""
    shown = [f"{_SYMBOLS.get(a, a)} = {v:g}" for a, v in args.items()
             if a != skip and not (a == "label_smoothing" and v == 0)]  # fmt: skip
    short = _SHORT_NAMES.get(cls, str(config.get("loss.name")))
    return f"{short} ({', '.join(shown)})" if shown else short


@dataclass
class SweepLine:
    """A line of fcl-fig6 (run groups that differ only in the swept loss argument, its points) or of fts-fig8
    (one run group); a reference line's loss does not take the swept argument (its point is under None)."""

    label: str
    config: dict  # what its groups share but the loss (for the labels of lines that share a name)
    reference: bool = False
    points: dict[float | None, list[Path]] = field(default_factory=dict)


def sweep_lines(groups: list[RunSet], key: str | None = None) -> tuple[str, list[SweepLine]] | None:
    """fcl-fig6's x axis and lines: (the loss argument, the lines). ``key`` names the argument (``lambda_``
    or ``loss.kwargs.lambda_``); None finds the one numeric loss argument (:func:`loss_arguments`) that
    takes two or more values among run groups whose configs are otherwise equal, a :class:`UserError` when
    several do, None when none does. Groups whose loss does not take the argument (FL beside FCL's λ)
    become reference lines.

    Example:
        >>> fcl = [RunSet(f"fcl {v}", {"loss.name": "fcl", "loss.kwargs": {"lambda_": v}}) for v in (0.5, 1.0)]
        >>> fl = RunSet("fl", {"loss.name": "fl-3", "loss.kwargs": {}})
        >>> key, lines = sweep_lines([*fcl, fl])
        >>> key, [(line.label, line.reference, sorted(line.points, key=str)) for line in lines]
        ('lambda_', [('FCL (γ = 4)', False, [0.5, 1.0]), ('FL (γ = 3)', True, [None])])
    """
    built = [(g, *loss_arguments(g.config)) for g in groups]

    def rest(g):
        return {c: v for c, v in g.config.items() if c not in ("loss.name", "loss.kwargs")}

    def family(g, cls, args, k):  # the line of group g when argument k is on the x axis
        return json.dumps(
            [cls, rest(g), {a: v for a, v in args.items() if a != k}], sort_keys=True, default=str
        )

    def varies(k):
        values: dict[str, set] = {}
        for g, cls, args in built:
            if k in args:
                values.setdefault(family(g, cls, args, k), set()).add(args[k])
        return any(len(v) > 1 for v in values.values())

    names = sorted({a for _, _, args in built for a in args})
    if key is not None:
        key = key.removeprefix("loss.kwargs.")
        if key not in names:
            raise UserError(
                f"--sweep-key {key}: no run's loss takes it; the runs' numeric loss arguments: "
                f"{', '.join(names) or 'none'}"
            )
    else:
        varied = [k for k in names if varies(k)]
        if len(varied) > 1:
            raise UserError(
                f"fcl-fig6: the runs vary several loss arguments ({', '.join(varied)}); choose the x axis "
                f"with --sweep-key (e.g. --sweep-key {varied[0]})"
            )
        if not varied:
            return None
        key = varied[0]
    lines: dict[str, SweepLine] = {}
    for g, cls, args in built:
        reference = key not in args
        line_id = (
            json.dumps(g.config, sort_keys=True, default=str) if reference else family(g, cls, args, key)
        )
        if line_id not in lines:
            lines[line_id] = SweepLine(_loss_label(g.config, cls, args, key), rest(g), reference)
        lines[line_id].points.setdefault(args.get(key), []).extend(g.runs)
    out = list(lines.values())
    label_groups(out)
    return key, out


def _test_metrics(run: Path, calibrator: str) -> tuple[dict, dict]:
    """A run's test metrics uncalibrated and after ``calibrator``: those of its results.json (what
    ``torchcal evaluate`` saved and the report shows), else computed by the same functions, without writing
    to the run."""
    from ..evaluation.evaluate import _fit_and_score, _uncalibrated, read_results

    try:
        res = read_results(run)
        if "uncalibrated" in res and calibrator in res:
            return res["uncalibrated"]["test"], res[calibrator]["test"]
        logits = load_logits(run)
    except RunError as err:
        raise UserError(f"{run}: {err}") from None
    return _uncalibrated(run, logits)["uncalibrated"]["test"], _fit_and_score(logits, calibrator)[1]["test"]


def _mean_band(values, band: str) -> tuple[float, float]:
    """Mean and band (± std over the values, or ± its standard error with ``band="sem"``; 0 for one value)."""
    t = torch.tensor(values, dtype=torch.float64)
    std = float(t.std()) if len(values) > 1 else 0.0
    return float(t.mean()), std / math.sqrt(len(values)) if band == "sem" else std


def _write_csv(path: Path, rows) -> None:
    import csv
    import io

    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    text = buf.getvalue().encode()
    atomic_write_bytes(path, lambda fh: fh.write(text))


def _loss_argument_figure(plt, groups, out: Path, band: str, key: str | None, calibrator: str):
    """fcl-fig6: (figure, data), or (None, {}) when no loss argument varies. The data hold each line's points
    in the units of results.json (fractions, NLL in nats): ``lines[label]["metrics"]["ece post"]["mean"]``."""
    from ..evaluation.evaluate import check_calibrators

    found = sweep_lines(groups, key)
    if found is None:
        return None, {}
    key, lines = found
    check_calibrators([calibrator], None)
    pre, post = (
        ("pre T", "post T") if calibrator.split(":")[0] == "ts" else ("uncalibrated", f"after {calibrator}")
    )
    fig, axes = plt.subplots(2, 5, figsize=(17, 6.6))
    panels = [(axes[row][j], m, when, f"{title}, {words}", scale)
              for j, (m, title, scale) in enumerate(FIG6_METRICS)
              for row, (when, words) in enumerate((("pre", pre), ("post", post)))]  # fmt: skip
    panels.append((axes[0][4], "error", "pre", "test error (%)", 100.0))
    cache: dict[Path, tuple[dict, dict]] = {}

    def value(run, metric, when):
        if run not in cache:
            cache[run] = _test_metrics(run, calibrator)
        return cache[run][0 if when == "pre" else 1].get(metric)

    symbol = _SYMBOLS.get(key, key)
    xlabel = f"{symbol} ({key})" if symbol != key else key
    ticks = sorted({x for line in lines for x in line.points if x is not None})
    data: dict = {"key": key, "calibrator": calibrator, "band": band, "lines": {}}
    rows: list[list] = [["line", "reference", key, "metric", "mean", "band", "n", "runs"]]
    for i, line in enumerate(lines):
        style = _style(i)
        color = style["color"]
        xs = [None] if line.reference else sorted(x for x in line.points if x is not None)
        counts = [len(line.points[x]) for x in xs]
        n_text = f"n = {min(counts)}" + (f"-{max(counts)}" if max(counts) > min(counts) else "")
        entry = {"reference": line.reference, "x": xs, "n": counts, "metrics": {},
                 "runs": [[str(r) for r in line.points[x]] for x in xs]}  # fmt: skip
        for ax, metric, when, _, scale in panels:
            means, bands = [], []
            for x in xs:
                values = [value(run, metric, when) for run in line.points[x]]
                mean, spread = (
                    _mean_band(values, band) if all(v is not None for v in values) else (math.nan, math.nan)
                )
                means.append(mean)
                bands.append(spread)
                rows.append([line.label, line.reference, "" if x is None else x, f"{metric} {when}", mean, spread,
                             len(values), ";".join(map(str, line.points[x]))])  # fmt: skip
            entry["metrics"][f"{metric} {when}"] = {"mean": means, "band": bands}
            m, b = (
                scale * torch.tensor(means, dtype=torch.float64),
                scale * torch.tensor(bands, dtype=torch.float64),
            )
            label = f"{line.label}, {n_text}" + (" (no " + symbol + ": reference)" if line.reference else "")
            if line.reference:
                ax.axhline(float(m[0]), color=color, linestyle="--", linewidth=1.2, label=label)
                if max(counts) > 1:
                    ax.axhspan(float(m[0] - b[0]), float(m[0] + b[0]), color=color, alpha=0.12, linewidth=0)
            else:
                ax.plot(xs, m.numpy(), markersize=4, label=label, **style)
                if max(counts) > 1:
                    ax.fill_between(xs, (m - b).numpy(), (m + b).numpy(), color=color, alpha=0.2, linewidth=0)
        data["lines"][line.label] = entry
    for ax, _, _, title, _ in panels:
        ax.set(xlabel=xlabel, title=title)
        if 1 < len(ticks) <= 12:
            ax.set_xticks(ticks)
            ax.tick_params(axis="x", labelsize=7)
    legend_ax = axes[1][4]
    legend_ax.axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    band_text = "± std" if band == "std" else "± standard error"
    legend_ax.legend(handles, labels, loc="center", fontsize=8, frameon=False,
                     title=f"mean {band_text} over seeds", title_fontsize=7)  # fmt: skip
    _write_csv(out / "fcl-fig6.csv", rows)
    return fig, data


def optimal_temperatures(
    logits: torch.Tensor,
    targets: torch.Tensor,
    gammas_ev=FTS_GAMMA_GRID,
    temperatures=FTS_TEMPERATURE_GRID,
    n_bins: int = 15,
) -> list[dict]:
    """For each γ_ev of ``gammas_ev``: the temperature of ``temperatures`` minimising the equal-mass ECE
    (``n_bins`` bins) of focal temperature scaling with γ fixed at γ_ev, ``focal_map_γ(softmax(z / T))``, on
    (``logits``, ``targets``): the objective :class:`~torchcal.calibrators.FocalTemperatureScaling`
    minimises (``objective="adaece"``, the same code, in the logits' dtype), every γ_ev at once for each T,
    the first minimiser in the grid's order. Each entry: ``gamma_ev``, ``T``, ``ece`` (the minimum) and
    ``edge`` (T is an end of the grid: the minimum may lie beyond it).

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(400, 3, generator=g, dtype=torch.float64)
        >>> y = torch.multinomial(torch.softmax(z, 1), 1, generator=g).squeeze(1)
        >>> [row["T"] for row in optimal_temperatures(4 * z, y, [0.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])]
        [4.0]
    """
    from ..._validation import check_float
    from ...calibrators.temperature import _FocalObjective

    gammas = [check_float(x, "gammas_ev", low=-1, low_open=True) for x in gammas_ev]
    temps = [check_float(t, "temperatures", low=0, low_open=True) for t in temperatures]
    if not gammas or not temps:
        raise ValueError("`gammas_ev` and `temperatures` must each hold at least one value")
    objective = _FocalObjective(logits, targets, gammas, "adaece", n_bins)
    table = torch.stack([objective(t) for t in temps])  # (T, G)
    best = torch.argmin(table, dim=0)  # the first minimiser of each column
    ends = (min(temps), max(temps))
    return [{"gamma_ev": gammas[j], "T": temps[int(best[j])], "ece": float(table[best[j], j]),
             "edge": temps[int(best[j])] in ends and ends[0] != ends[1]} for j in range(len(gammas))]  # fmt: skip


def _gamma_tr(config: dict) -> tuple[tuple, str, float | None]:
    """fts-fig8's sort key, label and γ_tr of a run group: focal loss's γ, 0 for cross entropy, else the
    loss with its arguments (no γ_tr)."""
    from ...losses import CrossEntropyLoss, FocalLoss

    loss = _built_loss(config)
    name = str(config.get("loss.name"))
    if type(loss) is FocalLoss:
        return (1, loss.gamma, name, []), f"FL, γ_tr = {loss.gamma:g}", loss.gamma
    if type(loss) is CrossEntropyLoss and not loss.label_smoothing:
        return (0, 0.0, name, []), "CE, γ_tr = 0", 0.0
    cls, args = loss_arguments(config)
    return (2, 0.0, name, sorted(args.items())), _loss_label(config, cls, args), None


def _optimal_temperature_figure(plt, groups, out: Path, band: str, gammas_ev, temperatures):
    """fts-fig8: (figure, data), or (None, {}) without multiclass runs. The data: per line, γ_tr, the mean
    and band of T at each γ_ev, and each run's (γ_ev, T, validation ECE, edge) table."""
    shown = []
    for g in groups:
        val = []
        for run in g.runs:
            try:
                val.append(load_logits(run)["val"])
            except RunError as err:
                raise UserError(f"{run}: {err}") from None
        if all(v["targets"].ndim == 1 for v in val):  # multi-label runs have no focal temperature scaling
            order, label, gamma = _gamma_tr(g.config)
            shown.append((order, SweepLine(label, g.config), gamma, g, val))
    if not shown:
        return None, {}
    shown.sort(key=lambda s: s[0])
    label_groups([s[1] for s in shown])
    gammas_ev = [float(x) for x in gammas_ev]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    data: dict = {"gammas_ev": gammas_ev, "temperatures": [min(temperatures), max(temperatures), len(temperatures)],
                  "band": band, "lines": {}}  # fmt: skip
    rows: list[list] = [["line", "gamma_tr", "run", "gamma_ev", "T", "val_ece", "edge"]]
    edge_label = "T at an end of its grid (in a seed)"
    for i, (_, line, gamma, g, val) in enumerate(shown):
        per_run = {}
        for run, split in zip(g.runs, val, strict=True):
            table = optimal_temperatures(split["logits"], split["targets"], gammas_ev, temperatures)
            per_run[str(run)] = table
            rows += [[line.label, "" if gamma is None else gamma, run, r["gamma_ev"], r["T"], r["ece"], r["edge"]]
                     for r in table]  # fmt: skip
        stats = [_mean_band([t[j]["T"] for t in per_run.values()], band) for j in range(len(gammas_ev))]
        mean = [s[0] for s in stats]
        spread = [s[1] for s in stats]
        style = _style(i)
        color = style["color"]
        ax.plot(gammas_ev, mean, markersize=4, label=f"{line.label} (n={len(g.runs)})", **style)
        if len(g.runs) > 1:
            ax.fill_between(gammas_ev, [m - s for m, s in zip(mean, spread, strict=True)],
                            [m + s for m, s in zip(mean, spread, strict=True)], color=color, alpha=0.2,
                            linewidth=0)  # fmt: skip
        edges = [j for j in range(len(gammas_ev)) if any(t[j]["edge"] for t in per_run.values())]
        if edges:
            ax.plot([gammas_ev[j] for j in edges], [mean[j] for j in edges], linestyle="none", marker="x",
                    color="black", markersize=7, label=edge_label)  # fmt: skip
            edge_label = "_nolegend_"
        data["lines"][line.label] = {"gamma_tr": gamma, "loss": g.config.get("loss.name"),
                                     "T": {"mean": mean, "band": spread}, "n": len(g.runs), "runs": per_run}  # fmt: skip
    band_text = "± std" if band == "std" else "± standard error"
    ax.set(xlabel="γ_ev (focal calibration parameter)",
           ylabel="optimal T (min. validation ECE, equal mass)", title=f"optimal T against γ_ev (mean {band_text})")  # fmt: skip
    ax.title.set_fontsize(9)
    legend_ax = ax
    if legend_ax.get_legend_handles_labels()[0]:
        legend_ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    _write_csv(out / "fts-fig8.csv", rows)
    return fig, data
