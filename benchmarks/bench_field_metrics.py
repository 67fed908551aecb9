"""Speed of the metrics beyond ECE (SPEC §9) against the peers' implementations, paired in one run.

On the same inputs at (50k, 1000) and (1M, 10) (``--quick``: (10k, 100) and (100k, 10)), in rounds that
alternate torchcal and the peer:

* AURC and FPR@95TPR against torch-uncertainty (``torch_uncertainty.metrics``: ``AURC``, ``FPR95``);
* Kuiper and KS against probmetrics, whose ``KuiperCalibrationMetric`` and ``KolmogorovSmirnovCalibrationMetric``
  are binary: they sort column 1 of the probabilities and take cumulative sums of it and of the labels *as
  numbers* (0..K-1), so for K > 2 they compute another quantity than torchcal's top-label KS (a read of one
  column of (N, K), no input checks). Three rows each: ``ks`` / ``kuiper``, probmetrics called as it is on
  (probs, targets) (a different quantity for K > 2, kept for the record); ``ks_top_label`` /
  ``kuiper_top_label``, probmetrics given the top-label reduction ([1 - conf, conf], 1[argmax = y]) by
  ``probs.max(1)`` inside its timing: the same quantity (the CSV's ``abs_diff`` is |ours - peer|, float32
  cumulative sums on their side); ``ks_floor``, torchcal's KS against one ``amax`` over the rows, the least
  any top-label KS can cost (one read of the matrix);
* split-conformal APS, fit on the first half and sets for the second half, against MAPIE 1.6's
  ``SplitConformalClassifier`` (``conformalize`` + ``predict_set``);
* the streaming update of ``CalibrationMetrics`` with every metric on (the default) against its update
  without the per-bin vector sums of the decompositions (``decompositions=False``: the state and the work of
  the accumulator before the metrics beyond ECE joined it).

A peer that is not installed is skipped (its column left empty). Run it where the peers are installed, with
torchcal on the path, under the benchmark lock:

    flock /tmp/torchcal-bench.lock env PYTHONPATH=src <venv>/bin/python benchmarks/bench_field_metrics.py

Writes a CSV named by hardware and torch version to benchmarks/results/ and prints the ratios (ours / peer:
below 1 is faster).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_metrics import hardware, paired, write_results  # noqa: E402

import torchcal.functional as F  # noqa: E402
from torchcal.conformal import SplitConformalClassifier  # noqa: E402
from torchcal.metrics import CalibrationMetrics  # noqa: E402

SIZES = [(50_000, 1000), (1_000_000, 10)]
QUICK = [(10_000, 100), (100_000, 10)]


def data(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(n, k, generator=g)
    probs = torch.softmax(logits, 1)
    targets = torch.multinomial(torch.softmax(logits / 2, 1), 1, generator=g).squeeze(1)
    return logits, probs, targets


def _tu():
    """torch-uncertainty's AURC and FPR95. Its package __init__ imports torchvision (and Lightning); where
    that import fails, the two self-contained metric modules are loaded from the installed files."""
    try:
        from torch_uncertainty.metrics import AURC, FPR95

        return AURC, FPR95
    except ImportError:
        pass
    except RuntimeError:  # a torchvision built for another torch
        pass
    import importlib.util

    spec = importlib.util.find_spec("torch_uncertainty")
    if spec is None:
        return None
    folder = os.path.join(spec.submodule_search_locations[0], "metrics", "classification")
    mods = []
    for name in ("risk_coverage", "fpr"):
        s = importlib.util.spec_from_file_location(f"_tu_{name}", os.path.join(folder, f"{name}.py"))
        mod = importlib.util.module_from_spec(s)
        s.loader.exec_module(mod)
        mods.append(mod)
    return mods[0].AURC, mods[1].FPR95


def _probmetrics():
    try:
        from probmetrics.metrics import KolmogorovSmirnovCalibrationMetric, KuiperCalibrationMetric
    except ImportError:
        return None
    return None, KuiperCalibrationMetric, KolmogorovSmirnovCalibrationMetric


def _mapie():
    try:
        from mapie.classification import SplitConformalClassifier as MapieSCC
        from sklearn.base import BaseEstimator, ClassifierMixin
    except ImportError:
        return None

    class PassThrough(ClassifierMixin, BaseEstimator):
        def fit(self, X, y):
            self.classes_ = np.arange(X.shape[1])
            return self

        def predict_proba(self, X):
            return np.asarray(X)

        def predict(self, X):
            return np.asarray(X).argmax(1)

    return MapieSCC, PassThrough


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's); names the CSV '-<n>t'"
    )
    parser.add_argument(
        "--cases",
        default=None,
        help="comma-separated cases to run (e.g. ks,update_all_metrics; default: all)",
    )
    parser.add_argument("--tag", default="", help="a word in the CSV's name (keeps scratch runs apart)")
    args = parser.parse_args()
    cases = None if args.cases is None else set(args.cases.split(","))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = []

    def record(case, n, k, ours_fn, peer_fn, peer, same_value=False):
        if cases is not None and case not in cases:
            return
        if peer_fn is None:
            rows.append({"case": case, "n": n, "k": k, "peer": peer, "ours_s": float("nan")})
            print(f"{case} {n}x{k}: {peer} not installed, skipped", flush=True)
            return
        ours, base, ratios = paired(ours_fn, peer_fn, args.rounds, steps=1)
        ratio = float(np.median(ratios))
        rows.append({"case": case, "n": n, "k": k, "peer": peer, "ours_s": ours, "peer_s": base,
                     "ratio_median": ratio, "ratio_min": min(ratios), "ratio_max": max(ratios)})  # fmt: skip
        if same_value:  # both compute the same number: how far apart they are
            rows[-1]["abs_diff"] = abs(float(ours_fn()) - float(peer_fn()))
        print(f"{case} {n}x{k}: ours {ours * 1e3:.1f} ms, {peer} {base * 1e3:.1f} ms, ratio {ratio:.2f} "
              f"[{min(ratios):.2f}, {max(ratios):.2f}]", flush=True)  # fmt: skip

    tu, pm, mp = _tu(), _probmetrics(), _mapie()
    for n, k in QUICK if args.quick else SIZES:
        logits, probs, targets = data(n, k)
        conf = probs.amax(1)

        # AURC (torch-uncertainty: update with probabilities and targets, then compute)
        def tu_aurc():
            m = tu[0]()
            m.update(probs, targets)
            return m.compute()

        record("aurc", n, k, lambda: F.aurc(probs, targets), tu_aurc if tu else None, "torch-uncertainty")

        # FPR@95TPR: the first half in-distribution, the second "OOD", scored by the maximum probability
        half = n // 2
        is_ood = torch.cat([torch.zeros(half, dtype=torch.long), torch.ones(n - half, dtype=torch.long)])
        ood_score = -conf

        def tu_fpr():
            m = tu[1](pos_label=1)
            m.update(ood_score, is_ood)
            return m.compute()

        record(
            "fpr95",
            n,
            k,
            lambda: F.fpr_at_tpr(ood_score, is_ood),
            tu_fpr if tu else None,
            "torch-uncertainty",
        )

        # Kuiper / KS: probmetrics as it is (column 1, another quantity for K > 2), then given the top-label
        # reduction (the same quantity), then torchcal's KS against one read of the matrix
        def pm_metric(cls):
            return lambda: cls().compute_from_labels_probs(targets, probs)

        def pm_top_label(cls):
            def run():
                top, pred = probs.max(1)
                return cls().compute_from_labels_probs(
                    (pred == targets).long(), torch.stack([1 - top, top], 1)
                )

            return run

        for name, ours_fn, idx in (
            ("kuiper", F.kuiper_calibration_error, 1),
            ("ks", F.ks_calibration_error, 2),
        ):
            record(
                name,
                n,
                k,
                lambda f=ours_fn: f(probs, targets),
                pm_metric(pm[idx]) if pm else None,
                "probmetrics (column 1)",
            )
            record(
                f"{name}_top_label",
                n,
                k,
                lambda f=ours_fn: f(probs, targets),
                pm_top_label(pm[idx]) if pm else None,
                "probmetrics (top-label reduction)",
                same_value=True,
            )
        record(
            "ks_floor", n, k, lambda: F.ks_calibration_error(probs, targets), lambda: probs.amax(1), "amax(1)"
        )

        # split-conformal APS: fit on the first half, sets for the second
        cal, test = slice(0, half), slice(half, n)
        p_np, y_np = probs.double().numpy(), targets.numpy()

        def ours_aps():
            cp = SplitConformalClassifier("aps", from_logits=False).fit(probs[cal], targets[cal], 0.1)
            return cp.predict_sets(probs[test])

        def mapie_aps():
            est = mp[1]().fit(p_np[cal], y_np[cal])
            scc = mp[0](
                estimator=est, confidence_level=0.9, conformity_score="aps", prefit=True, random_state=0
            )
            scc.conformalize(p_np[cal], y_np[cal])
            return scc.predict_set(p_np[test])

        record("aps", n, k, ours_aps, mapie_aps if mp else None, "mapie")

        # the streaming update with every metric on, against the accumulator without the decompositions
        record(
            "update_all_metrics",
            n,
            k,
            lambda: CalibrationMetrics(k).update(probs, targets),
            lambda: CalibrationMetrics(k, decompositions=False).update(probs, targets),
            "CalibrationMetrics(decompositions=False)",
        )

    tag = ("quick-" if args.quick else "") + (f"{args.tag}-" if args.tag else "")
    threads = "" if args.threads is None else f"-{args.threads}t"
    write_results(rows, f"bench_field_metrics-{tag}{hardware()}{threads}", first=("case", "n", "k", "peer"))


if __name__ == "__main__":
    main()
