"""The runner's side of SPEC §9: the metrics beyond ECE stored with every evaluation, conformal sets after
each calibrator (``torchcal evaluate --conformal aps:alpha=0.1``), and the report's ``--metrics`` columns."""

from __future__ import annotations

import torch

from ... import functional as F
from ...conformal import SplitConformalClassifier
from ...functional.conformal import CONFORMAL_SCORES, conformal_set_metrics
from ..errors import UserError

__all__ = [
    "FIELD_COLUMNS",
    "CONFORMAL_COLUMNS",
    "REPORT_METRICS",
    "field_metrics",
    "parse_conformal",
    "conformal_metrics",
    "check_report_metrics",
    "field_stats",
    "direction_word",
    "field_figures",
]

# Metrics of SPEC §9 stored with every multiclass evaluation (top-label, 15 equal-width bins of SPEC §3;
# decompositions grouped by those bins; AURC/AUGRC ranked by the maximum probability).
FIELD_COLUMNS = (
    "signed_ece",
    "ece_over",
    "ece_under",
    "ks",
    "kuiper",
    "classwise_ks",
    "aurc",
    "augrc",
    "brier_reliability",
    "brier_resolution",
    "brier_uncertainty",
    "log_reliability",
    "log_resolution",
)
# From the first conformal spec of the evaluation: empirical coverage and mean set size on the held-out half.
CONFORMAL_COLUMNS = ("coverage", "set_size")
REPORT_METRICS = FIELD_COLUMNS + CONFORMAL_COLUMNS


def field_metrics(probs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """The §9 metrics of one split (Python floats)."""
    d = F.calibration_error_direction(probs, targets)
    b = F.brier_decomposition(probs, targets, groups="width")
    ls = F.log_score_decomposition(probs, targets, groups="width")
    values = {
        "signed_ece": d.signed,
        "ece_over": d.over,
        "ece_under": d.under,
        "ks": F.ks_calibration_error(probs, targets),
        "kuiper": F.kuiper_calibration_error(probs, targets),
        "classwise_ks": F.ks_calibration_error(probs, targets, kind="classwise"),
        "aurc": F.aurc(probs, targets),
        "augrc": F.augrc(probs, targets),
        "brier_reliability": b.reliability,
        "brier_resolution": b.resolution,
        "brier_uncertainty": b.uncertainty,
        "log_reliability": ls.reliability,
        "log_resolution": ls.resolution,
    }
    return {k: float(v) for k, v in values.items()}


_BOOL = {"true": True, "false": False, "1": True, "0": False}


def parse_conformal(spec: str) -> tuple[str, dict]:
    """``score[:key=value,...]`` → (spec as given, options): score in lac|aps|raps; keys ``alpha`` (required
    range (0, 1), default 0.1), ``randomized``, ``mondrian`` (true/false), ``lambda``, ``k_reg`` (RAPS)."""
    score, _, rest = spec.strip().partition(":")
    if score not in CONFORMAL_SCORES:
        raise UserError(
            f"--conformal {spec!r}: the score must be one of {list(CONFORMAL_SCORES)}, got {score!r}"
        )
    opts: dict = {"alpha": 0.1}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        try:
            if not eq:
                raise ValueError("expected key=value")
            if key == "alpha":
                opts["alpha"] = float(value)
                if not 0 < opts["alpha"] < 1:
                    raise ValueError("alpha must lie in (0, 1)")
            elif key in ("randomized", "mondrian"):
                opts[key] = _BOOL[value.lower()]
            elif key == "lambda":
                opts["lambda_"] = float(value)
                if opts["lambda_"] < 0:
                    raise ValueError("lambda must be >= 0")
            elif key == "k_reg":
                opts["k_reg"] = int(value)
                if opts["k_reg"] < 0:
                    raise ValueError("k_reg must be >= 0")
            else:
                raise ValueError("keys are alpha, randomized, mondrian, lambda, k_reg")
        except (ValueError, KeyError) as err:
            reason = "randomized/mondrian take true or false" if isinstance(err, KeyError) else str(err)
            raise UserError(f"--conformal {spec!r}: {item!r}: {reason}") from None
    return spec.strip(), {"score": score, **opts}


def conformal_sets(probs: torch.Tensor, targets: torch.Tensor, opts: dict, seed: int = 0):
    """(sets of the held-out half, its targets, alpha): a seeded random half of the test split calibrates the
    threshold of the spec's options (:func:`parse_conformal`), the other half gets sets (the post-hoc
    calibrator never saw either, so the halves are exchangeable)."""
    n = probs.shape[0]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(probs.device)
    cal, held = order[: n // 2], order[n // 2 :]
    opts = dict(opts)
    alpha = opts.pop("alpha")
    cp = SplitConformalClassifier(opts.pop("score"), from_logits=False, seed=seed, **opts)
    return cp.fit(probs[cal], targets[cal], alpha).predict_sets(probs[held]), targets[held], alpha


def conformal_metrics(probs: torch.Tensor, targets: torch.Tensor, specs, seed: int = 0) -> dict:
    """Set metrics of each conformal spec on the test split (:func:`conformal_sets`): ``{spec: {coverage,
    macro_coverage, set_size, empty, sscv, coverage_gap, violated_classes, size_distribution}}`` with Python
    values."""
    out = {}
    for spec, opts in specs:
        sets, held, alpha = conformal_sets(probs, targets, opts, seed)
        m = conformal_set_metrics(sets, held, alpha)
        m.pop("stratified_coverage")
        out[spec] = {
            k: (
                v.tolist()
                if isinstance(v, torch.Tensor) and v.ndim
                else float(v)
                if k != "violated_classes"
                else v
            )
            for k, v in m.items()
        }
    return out


def check_report_metrics(names) -> tuple[str, ...]:
    names = tuple(n.strip() for n in names if n.strip())
    unknown = [n for n in names if n not in REPORT_METRICS]
    if unknown:
        raise UserError(f"--metrics: unknown {unknown}; choose from {list(REPORT_METRICS)}")
    return names


COLUMN_HEADERS = {
    "signed_ece": "signed ECE",
    "ece_over": "ECE over",
    "ece_under": "ECE under",
    "classwise_ks": "classwise KS",
    "coverage": "conformal coverage",
    "set_size": "mean set size (not ×100)",
}


def field_stats(res: dict, calibrator: str) -> dict[str, tuple[float, float]]:
    """(pre, post) of each report metric present in one run's results (×100, but the set size)."""
    out = {}
    pre, post = res["uncalibrated"], res[calibrator]
    for m in FIELD_COLUMNS:
        if m in pre.get("test", {}) and m in post.get("test", {}):
            out[m] = (100 * pre["test"][m], 100 * post["test"][m])
    if pre.get("conformal") and post.get("conformal"):
        spec = next(iter(pre["conformal"]))
        if spec in post["conformal"]:
            out["coverage"] = (
                100 * pre["conformal"][spec]["coverage"],
                100 * post["conformal"][spec]["coverage"],
            )
            out["set_size"] = (pre["conformal"][spec]["set_size"], post["conformal"][spec]["set_size"])
    return out


def direction_word(signed: float) -> str:
    """What the sign of the signed ECE says: over-confident (> 0), under-confident (< 0)."""
    return "over-confident" if signed > 0 else "under-confident" if signed < 0 else "neither"


def field_figures(run_dir, test: dict, pre: torch.Tensor, post: torch.Tensor, calibrator: str) -> list:
    """(title, matplotlib Figure) pairs for one run: the risk-coverage curves before and after the
    calibrator and, when ``evaluate --conformal`` was run, the set sizes of its first spec on the held-out
    half of the test split (the sets the report's columns measure)."""
    import json

    from ...plotting import plot_risk_coverage, plot_set_sizes
    from ..run_files import RESULTS

    targets = test["targets"]
    curves = {
        "uncalibrated": F.risk_coverage_curve(pre, targets),
        calibrator: F.risk_coverage_curve(post, targets),
    }
    figs = [("risk-coverage (max probability)", plot_risk_coverage(curves))]
    try:
        results = json.loads((run_dir / RESULTS).read_text())
        specs = results["uncalibrated"].get("conformal") or {}
    except (OSError, ValueError, KeyError):
        specs = {}
    if specs:
        spec = next(iter(specs))
        opts = parse_conformal(spec)[1]
        sets = {
            name: conformal_sets(p, targets, opts)[0]
            for name, p in (("uncalibrated", pre), (calibrator, post))
        }
        figs.append((f"conformal set sizes ({spec})", plot_set_sizes(sets)))
    return figs


def paired_ranking(groups, calibrator: str, probs_of, n_resamples: int = 1000, seed: int = 0) -> str:
    """Markdown lines ranking the rows by ECE after ``calibrator`` with its uncertainty: each row's first run
    against the best row's first run on the same test samples, ``paired_bootstrap`` of the ECE difference
    (×100, 95 % interval, two-sided p). ``probs_of(run_dir)`` gives a run's (test probabilities after the
    calibrator, test targets). Empty when fewer than two rows share one test set."""
    scored = []
    for g in groups:
        probs, targets = probs_of(g.runs[0])
        scored.append((g.label, probs, targets))
    if len(scored) < 2:
        return ""
    ref_targets = scored[0][2]
    same = [s for s in scored if s[2].shape == ref_targets.shape and torch.equal(s[2], ref_targets)]
    if len(same) < 2:
        return ""
    eces = [float(F.ece(p, t)) for _, p, t in same]
    best = min(range(len(same)), key=eces.__getitem__)
    label_b, probs_b, targets = same[best]
    lines = [f"Rows ranked by ECE after {calibrator} against the best row ({label_b}), on the first run of each "
             f"row: paired bootstrap of ECE(row) − ECE(best) ×100 over the same test samples ({n_resamples} "
             f"resamples, seed {seed}), 95 % interval, two-sided p.", ""]  # fmt: skip
    for i in sorted(range(len(same)), key=eces.__getitem__):
        label, probs, _ = same[i]
        if i == best:
            lines.append(f"- {label}: ECE {100 * eces[i]:.2f} (best)")
            continue
        res = F.paired_bootstrap(F.ece, probs_b, probs, targets, n_resamples=n_resamples, seed=seed)
        lines.append(f"- {label}: ECE {100 * eces[i]:.2f}, +{100 * float(res.difference):.2f} "
                     f"[{100 * float(res.low):.2f}, {100 * float(res.high):.2f}], p = {float(res.pvalue):.3f}")  # fmt: skip
    return "\n".join(lines) + "\n"
