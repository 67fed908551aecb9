"""The arena's reports: the leaderboard as Markdown, CSV, an HTML page (Jinja2 templates) and JSON; the
rank and reliability figures; the one-sentence recommendation."""

from __future__ import annotations

import csv
import io
import json
import warnings
from pathlib import Path

import torch

from ..evaluation.arena import (
    LOWER_IS_BETTER,
    PERCENT,
    SCORE_TITLES,
    SCORES,
    UNCALIBRATED,
    ArenaTask,
    _task_values,
    rank_scores,
)
from .templates import render

__all__ = ["recommendation", "arena_markdown", "arena_csv", "arena_html_section", "write_arena"]


def _fmt(score: str, value) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.2f}" if score in PERCENT else f"{value:.4f}"


def _fmt_improvement(score: str, triple) -> str:
    value, low, high = triple
    scale, digits = (100, 2) if score in PERCENT else (1, 4)
    return f"{scale * value:+.{digits}f} [{scale * low:+.{digits}f}, {scale * high:+.{digits}f}]"


def _seconds(value) -> str:
    return "-" if value is None else (f"{value:.3f}" if value < 10 else f"{value:.1f}")


def _level(result: dict) -> str:
    """The interval's confidence level as a percentage ("95%", "97.5%")."""
    return f"{100 * result['confidence_level']:.10g}%"


def _describe(result: dict) -> str:
    level = _level(result)
    return (f"Each calibrator is fitted on the validation split and scored on the test split. Mean rank: 1 = best "
            f"among the {len(result['calibrators']) + 1} entries (uncalibrated included) on each task; equal "
            f"values share their mean rank and a failed calibrator ranks last. Win rate: the share of (task, "
            f"opponent) pairs won, ties counting ½ (CalArena's presentation). Improvement over uncalibrated: "
            f"positive is better (a lower NLL, Brier, ECE, classwise ECE; a higher accuracy); ECE, classwise ECE "
            f"and accuracy ×100, 15 equal-width bins; [{level} paired bootstrap interval, "
            f"{result['n_resamples']} resamples of the test set, seed {result['seed']}].")  # fmt: skip


def recommendation(result: dict) -> str:
    """One sentence: the calibrator with the best mean NLL rank and how it did against the others."""
    s = result["summary"]
    best = s["order"][0]
    if s["failures"][best] == s["n_tasks"]:  # failures rank last: the best failed only if every one did
        return ("Every calibrator failed on every task (see the rows' messages): no calibrator to recommend; "
                "the uncalibrated model is the only result.")  # fmt: skip
    nll = s["improvement"][best]["nll"]
    rank, base = s["mean_rank"]["nll"][best], s["mean_rank"]["nll"][UNCALIBRATED]
    lead = f"Start with **{best}**" if rank < base else (
        f"No calibrator ranks ahead of the uncalibrated model on NLL (mean rank {base:.2f}); the closest is "
        f"**{best}**")  # fmt: skip
    parts = [f"mean NLL rank {rank:.2f} of {len(result['calibrators']) + 1}",
             f"NLL win rate {100 * s['win_rate']['nll'][best]:.0f}%"]  # fmt: skip
    failed, n = s["failures"][best], s["n_tasks"]
    if failed:
        parts.append(f"failed on {failed} of {n} tasks")
    if nll["mean"] is not None:
        over = f" of the {n - failed} task{'s' if n - failed != 1 else ''} it fitted" if failed else ""
        parts.append(f"NLL {nll['mean']:+.4f} on average over uncalibrated{over} (better in "
                     f"{nll['better']} of {n} tasks by its {_level(result)} interval, worse in {nll['worse']})")  # fmt: skip
    text = f"{lead}: " + ", ".join(parts)
    after = [c for c in s["order"][1:] if s["failures"][c] < n][:2]
    if after:
        text += "; then " + " and ".join(after)
    return text + "."


def arena_markdown(result: dict) -> str:
    """The arena as Markdown: the leaderboard (mean ranks, win rates, improvement, failures, times), the
    pairwise NLL win rates, then a table per task."""
    s = result["summary"]
    entries = [*s["order"], UNCALIBRATED]
    lines = [f"# Calibrator arena: {s['n_tasks']} task{'s' if s['n_tasks'] != 1 else ''}", "", _describe(result), "",
             recommendation(result), "", "## Leaderboard (sorted by mean NLL rank)", ""]  # fmt: skip
    head = (["calibrator"] + [f"rank {SCORE_TITLES[x]}" for x in SCORES] + ["win rate NLL", "Δ NLL (mean)",
            "tasks better / worse (NLL)", "Δ ECE ×100 (mean)", "fit s", "predict s", "failed", "warned"])  # fmt: skip
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in entries:
        cells = [name] + [f"{s['mean_rank'][x][name]:.2f}" for x in SCORES]
        cells.append(f"{100 * s['win_rate']['nll'][name]:.0f}%")
        if name == UNCALIBRATED:
            cells += ["0", "-", "0", "-", "-", "-", "-"]
        else:
            imp = s["improvement"][name]
            cells.append("-" if imp["nll"]["mean"] is None else f"{imp['nll']['mean']:+.4f}")
            cells.append(f"{imp['nll']['better']} / {imp['nll']['worse']}")
            cells.append("-" if imp["ece"]["mean"] is None else f"{100 * imp['ece']['mean']:+.2f}")
            cells += [_seconds(s["fit_seconds"][name]), _seconds(s["predict_seconds"][name]),
                      str(s["failures"][name]), str(s["warnings"][name])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Pairwise win rate (NLL): the row's share of tasks won against the column", ""]
    lines += ["| | " + " | ".join(entries) + " |", "|" + "---|" * (len(entries) + 1)]
    for a in entries:
        cells = ["-" if a == b else f"{100 * s['pairwise']['nll'][a][b]:.0f}%" for b in entries]
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    lines += ["", "## Per task", ""]
    for task in result["tasks"]:
        lines += [f"### {task['name']}", "",
                  (f"{task['source']}: " if task["source"] else "") + f"{task['n_val']} validation, "
                  f"{task['n_test']} test samples, "
                  f"K = {task['num_classes']}.", ""]  # fmt: skip
        head = (["calibrator", "status"] + [f"{SCORE_TITLES[x]}" for x in SCORES]
                + [f"Δ {SCORE_TITLES[x]} [{_level(result)} CI]" for x in ("nll", "ece")]
                + ["fit s", "predict s"])  # fmt: skip
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        base = task["uncalibrated"]["test"]
        lines.append("| uncalibrated | - | " + " | ".join(_fmt(x, base[x]) for x in SCORES) + " | | | | |")
        for name in s["order"]:
            row = task["rows"][name]
            status = row["status"] if not row["message"] else f"{row['status']}: {row['message']}"
            status = status.replace("|", "/")
            scores = [_fmt(x, row.get("test", {}).get(x)) for x in SCORES]
            imps = [
                _fmt_improvement(x, row["improvement"][x]) if "improvement" in row else "-"
                for x in ("nll", "ece")
            ]
            lines.append("| " + " | ".join([name, status, *scores, *imps, _seconds(row["fit_seconds"]),
                                            _seconds(row["predict_seconds"])]) + " |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def arena_csv(result: dict) -> str:
    """One row per (task, entrant): status, message, every score, every improvement with its interval, times."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    header = ["task", "source", "calibrator", "status", "message", *SCORES]
    header += [f"improvement_{x}{suffix}" for x in SCORES for suffix in ("", "_low", "_high")]
    header += ["fit_seconds", "predict_seconds"] + [f"rank_{x}" for x in SCORES]
    writer.writerow(header)
    names = [UNCALIBRATED, *result["calibrators"]]
    for task in result["tasks"]:
        ranks = {x: rank_scores(_task_values(task, names, x), LOWER_IS_BETTER[x]) for x in SCORES}
        for i, name in enumerate(names):
            if name == UNCALIBRATED:
                row = {"status": "ok", "message": "", "test": task["uncalibrated"]["test"],
                       "improvement": {x: [0.0, 0.0, 0.0] for x in SCORES}, "fit_seconds": None,
                       "predict_seconds": None}  # fmt: skip
            else:
                row = task["rows"][name]
            cells = [task["name"], task["source"], name, row["status"], row["message"]]
            cells += [row.get("test", {}).get(x, "") for x in SCORES]
            for x in SCORES:
                cells += row["improvement"][x] if "improvement" in row else ["", "", ""]
            cells += ["" if row["fit_seconds"] is None else row["fit_seconds"],
                      "" if row["predict_seconds"] is None else row["predict_seconds"]]  # fmt: skip
            cells += [ranks[x][i] for x in SCORES]
            writer.writerow(cells)
    return buf.getvalue()


def _png(fig) -> str:
    import base64

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _rank_figure(result: dict):
    """Mean rank per score (rows: entrants, best NLL rank on top; columns: scores), and the pairwise NLL win
    rates as a heat map."""
    import matplotlib.pyplot as plt
    import numpy as np

    s = result["summary"]
    entries = [*s["order"], UNCALIBRATED]
    n = len(entries) + 1
    fig, (ax, hm) = plt.subplots(1, 2, figsize=(11, 0.42 * n + 1.6), constrained_layout=True,
                                 gridspec_kw={"width_ratios": [1.1, 1]})  # fmt: skip
    y = np.arange(len(entries))[::-1]
    markers = ["o", "s", "D", "^", "v"]
    for j, score in enumerate(SCORES):
        ranks = [s["mean_rank"][score][e] for e in entries]
        ax.scatter(ranks, y + (j - 2) * 0.11, marker=markers[j], s=28, label=SCORE_TITLES[score], zorder=3)
    ax.set_yticks(y, entries)
    ax.set_xlabel(f"mean rank over {s['n_tasks']} task(s) (1 = best of {len(entries)})")
    ax.set_xlim(0.5, len(entries) + 0.5)
    ax.grid(axis="x", linestyle=":", alpha=0.6)
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=5, frameon=False,
              title="mean rank per score", title_fontsize=10)  # fmt: skip
    mat = np.array(
        [[np.nan if a == b else 100 * s["pairwise"]["nll"][a][b] for b in entries] for a in entries]
    )
    im = hm.imshow(mat, vmin=0, vmax=100, cmap="RdBu")
    hm.set_xticks(range(len(entries)), entries, rotation=45, ha="right")
    hm.set_yticks(range(len(entries)), entries)
    for i in range(len(entries)):
        for j in range(len(entries)):
            if i != j:
                colour = "white" if abs(mat[i, j] - 50) > 30 else "black"
                hm.text(j, i, f"{mat[i, j]:.0f}", ha="center", va="center", fontsize=8, color=colour)
    fig.colorbar(im, ax=hm, shrink=0.8, label="% of tasks the row beats the column (NLL)")
    hm.set_title("pairwise win rate (NLL)")
    return fig


def _reliability_figure(task: ArenaTask, specs: list[str], device):
    """Reliability diagrams on the task's test split: uncalibrated, then each calibrator refitted on its
    validation split."""
    import matplotlib.pyplot as plt

    from ...calibrators import from_spec
    from ...plotting import plot_reliability_diagram

    panels = [(UNCALIBRATED, torch.softmax(task.test_logits, 1))]
    for spec in specs:
        cal = from_spec(spec)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # reported in the arena's rows already
            cal.fit(task.val_logits.to(device), task.val_targets.to(device))
        panels.append((spec, cal.transform(task.test_logits.to(device)).cpu()))
    fig, axes = plt.subplots(2, len(panels), figsize=(3.3 * len(panels), 4.2), constrained_layout=True,
                             gridspec_kw={"height_ratios": [3, 1]}, squeeze=False)  # fmt: skip
    for j, (name, probs) in enumerate(panels):
        plot_reliability_diagram(probs=probs, targets=task.test_targets, axes=(axes[0, j], axes[1, j]))
        axes[0, j].set_title(f"{name}\n" + axes[0, j].get_title(), fontsize=9)
    return fig


def arena_html_section(result: dict, tasks: list[ArenaTask] | None = None, device="cpu") -> str:
    """An HTML fragment: the leaderboard, the rank figure (mean ranks per score and pairwise NLL win rates) and,
    given the tasks, the reliability diagrams of the three best calibrators on the first task's test split.
    Without matplotlib the tables are kept and the page says how to get the figures."""
    s = result["summary"]
    entries = [*s["order"], UNCALIBRATED]
    head = ["calibrator", *(f"rank {SCORE_TITLES[x]}" for x in SCORES), "win rate NLL", "Δ NLL (mean)",
            "tasks better / worse", "fit s", "predict s", "failed", "warned"]  # fmt: skip
    rows = []
    for name in entries:
        cells = [name] + [f"{s['mean_rank'][x][name]:.2f}" for x in SCORES]
        cells.append(f"{100 * s['win_rate']['nll'][name]:.0f}%")
        if name == UNCALIBRATED:
            cells += ["0", "-", "-", "-", "-", "-"]
        else:
            imp = s["improvement"][name]["nll"]
            cells += ["-" if imp["mean"] is None else f"{imp['mean']:+.4f}", f"{imp['better']} / {imp['worse']}",
                      _seconds(s["fit_seconds"][name]), _seconds(s["predict_seconds"][name]),
                      str(s["failures"][name]), str(s["warnings"][name])]  # fmt: skip
        rows.append(cells)
    problems = [(t["name"], c, t["rows"][c]["status"], t["rows"][c]["message"]) for t in result["tasks"]
                for c in result["calibrators"] if t["rows"][c]["status"] != "ok"]  # fmt: skip
    figures = []
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
    except ImportError:
        available = False
    else:
        available = True
        figures.append((_png(_rank_figure(result)), f"Mean rank per score over {s['n_tasks']} task(s), and the "
                        "pairwise NLL win rate."))  # fmt: skip
        if tasks:
            best = [c for c in s["order"] if s["failures"][c] < s["n_tasks"]][:3]
            usable = [t for t, entry in zip(tasks, result["tasks"], strict=True)
                      if all(entry["rows"][c]["status"] != "failed" for c in best)]  # fmt: skip
            task = usable[0] if usable else None
            if task is not None and best:
                figures.append((_png(_reliability_figure(task, best, device)),
                                "Reliability diagrams of the three best calibrators by mean NLL rank on the test "
                                f"split of {task.name} (15 equal-width bins), next to the uncalibrated model."))  # fmt: skip
    return render("arena_section.html.j2", description=_describe(result),
                  recommendation=recommendation(result).replace("**", ""), head=head, rows=rows,
                  problems=problems, figures=figures, figures_available=available)  # fmt: skip


def write_arena(result: dict, out_dir, tasks: list[ArenaTask] | None = None, device="cpu") -> dict[str, Path]:
    """Writes ``arena.md``, ``arena.csv``, ``arena.html`` (the section of :func:`arena_html_section` in one
    self-contained page) and ``arena.json`` (the results) to ``out_dir``, each atomically; returns the paths.
    Everything is rendered before the folder is created, so a failure writes nothing."""
    from markupsafe import Markup

    from ..run_files import atomic_write_bytes, make_dir

    texts = {
        "arena.md": arena_markdown(result),
        "arena.csv": arena_csv(result),
        "arena.html": render("arena.html.j2", section=Markup(arena_html_section(result, tasks, device))),
        "arena.json": json.dumps(result, indent=2, sort_keys=True),
    }
    out_dir = Path(out_dir)
    make_dir(out_dir)
    paths = {}
    for name, text in texts.items():
        paths[name] = out_dir / name
        atomic_write_bytes(paths[name], lambda fh, text=text: fh.write(text.encode()))
    return paths
