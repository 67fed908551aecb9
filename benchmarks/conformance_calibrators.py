"""Calibrators against their reference implementations: golden values for tests/test_calibrator_conformance.py.

Fits torchcal's calibrator and the peer's implementation on the same seeded synthetic logits
(tests/reference/calibration_data.py: 10k x 10 and 25k x 100, and 6k x 2 for TS, SVS and SMS; first half
calibration, second half test) and
writes the peer's test NLL, Brier score, ECE (15 equal-width bins, top label), accuracy and the fitted
parameters that both define the same way into tests/data/calibrator_goldens.json. The tests then check
torchcal against these numbers without the peers installed.

Peers (a separate environment; they are not torchcal dependencies):
    python3 -m venv /path/peers && /path/peers/bin/pip install torch==2.13.0 probmetrics==1.3.0 numba \\
        betacal==1.1.0 venn-abers==1.5.4 netcal==1.4.0 && /path/peers/bin/pip install --no-deps abstention
dirichletcal's releases do not install with current build tools: put its source (github
dirichletcal/dirichlet_python @b03f65f, the `dirichletcal/` folder) on PYTHONPATH and install jax.
Run from the repository root:
    PYTHONPATH=src:.:/path/dirichletcal-src /path/peers/bin/python benchmarks/conformance_calibrators.py [--only svs,bcts]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from importlib import metadata

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.reference.calibration_data import split, synthetic_logits  # noqa: E402

from torchcal.calibrators import create  # noqa: E402

DATASETS = {"10k_x_10": (10_000, 10, 0), "25k_x_100": (25_000, 100, 1)}
# two classes, where the matrix families meet binary calibration (SMS is then 6 parameters on 2 logits)
TWO_CLASSES = {"6k_x_2": (6_000, 2, 2)}
WITH_TWO_CLASSES = {**DATASETS, **TWO_CLASSES}
OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "calibrator_goldens.json")


def scores(probs: np.ndarray, y: np.ndarray) -> dict:
    """NLL (mean), Brier (sum over classes, mean over rows), top-label ECE with 15 bins (lo, hi], accuracy."""
    probs = np.asarray(probs, dtype=np.float64)
    n = len(y)
    p_true = probs[np.arange(n), y]
    nll = float(-np.mean(np.log(np.clip(p_true, 1e-300, None))))
    onehot = np.eye(probs.shape[1])[y]
    brier = float(np.mean(((probs - onehot) ** 2).sum(1)))
    conf, pred = probs.max(1), probs.argmax(1)
    correct = (pred == y).astype(np.float64)
    bins = np.clip(np.ceil(conf * 15).astype(int) - 1, 0, 14)
    ece = 0.0
    for b in range(15):
        m = bins == b
        if m.any():
            ece += m.sum() / n * abs(correct[m].mean() - conf[m].mean())
    return {"nll": nll, "brier": brier, "ece": float(ece), "accuracy": float(correct.mean())}


def _probs(z):
    return torch.softmax(z.double(), 1).numpy()


# -- peers: each returns (test probabilities, fitted parameters worth comparing) -------------------------


def probmetrics_method(method):
    def run(zc, yc, zt):
        from probmetrics.calibrators import get_calibrator

        cal = get_calibrator(method)
        cal.fit(_probs(zc).astype(np.float32), yc.numpy())
        out = cal.predict_proba(_probs(zt).astype(np.float32))
        params = {}
        if method in ("svs", "sms"):
            ts = cal.ts_
            ts = getattr(ts, "cal_", ts)
            params["beta"] = float(ts.invtemp_)
            if method == "svs":
                params["weight"] = np.asarray(cal.v_, dtype=float).tolist()
                params["bias"] = np.asarray(cal.b_, dtype=float).tolist()
            elif zc.shape[1] <= 10:  # [I + Δ | b], (K, K + 1)
                params["weight_and_bias"] = np.asarray(cal.W_, dtype=float).tolist()
        if method == "temp-scaling":
            params["temperature"] = 1.0 / float(cal.invtemp_)
        return out, params

    return run


def dirichletcal_diag(zc, yc, zt):
    from dirichletcal.calib.diagdirichlet import DiagonalDirichletCalibrator

    cal = DiagonalDirichletCalibrator(reg_lambda=1e-3, reg_mu=1e-3)
    cal.fit(_probs(zc), yc.numpy())
    return cal.predict_proba(_probs(zt)), {}


def betacal_binary(zc, yc, zt):
    """betacal on s = p_0 with labels 1[y = 0] (zc, zt here are the binary logits logit(p_0))."""
    from betacal import BetaCalibration

    cal = BetaCalibration(parameters="abm")
    cal.fit(torch.sigmoid(zc.double()).numpy().astype(np.float32), yc.numpy())
    p = cal.predict(torch.sigmoid(zt.double()).numpy().astype(np.float32))
    a, b, m = (float(v) for v in cal.calibrator_.map_)
    return np.stack([1 - p, p], 1), {"a": a, "b": b, "m": m}


def probmetrics_ovr_beta(zc, yc, zt):
    from probmetrics.calibrators import BetacalCalibrator, MulticlassOneVsRestCalibrator

    cal = MulticlassOneVsRestCalibrator(BetacalCalibrator())
    cal.fit(_probs(zc).astype(np.float32), yc.numpy())
    return cal.predict_proba(_probs(zt).astype(np.float32)), {}


def netcal_bbq(zc, yc, zt):
    """netcal's BBQ (probmetrics' ``NetcalBBQCalibrator``): equal-width bins, BIC scores, elbow pruning, one
    model per class (one-vs-all), the outputs divided by the row sum as netcal returns them."""
    from netcal.binning import BBQ

    cal = BBQ()
    cal.fit(_probs(zc), yc.numpy())
    out = np.clip(np.asarray(cal.transform(_probs(zt)), dtype=np.float64), 1e-30, None)
    return out / out.sum(1, keepdims=True), {}


def probmetrics_iop(zc, yc, zt):
    """probmetrics' port of the IOP reference code (not in its factory; its defaults: hidden (150, 150),
    Adam lr 5e-3, weight decay 5e-4, batch 256, 40 epochs), seeded with torch.manual_seed(0); it trains on
    float32 ln clip(p, 1e-15, 1)."""
    from probmetrics.calibrators.orderpreserving import IntraOrderPreservingCalibrator

    torch.manual_seed(0)
    cal = IntraOrderPreservingCalibrator()
    cal.fit(_probs(zc).astype(np.float32), yc.numpy())
    return cal.predict_proba(_probs(zt).astype(np.float32)), {}


def abstention_method(kind):
    def run(zc, yc, zt):
        from abstention import calibration as A

        factory = {
            "bcts": lambda: A.TempScaling(bias_positions="all"),
            "nbvs": A.NoBiasVectorScaling,
            "vector": A.VectorScaling,
        }[kind]()
        onehot = np.eye(zc.shape[1])[yc.numpy()]
        fn = factory(valid_preacts=zc.double().numpy(), valid_labels=onehot)
        return np.asarray(fn(zt.double().numpy())), {}

    return run


# name: (torchcal spec, peer label, peer function, datasets)
METHODS = {
    "ts": ("ts", "probmetrics temp-scaling", probmetrics_method("temp-scaling"), WITH_TWO_CLASSES),
    "svs": ("svs", "probmetrics svs", probmetrics_method("svs"), WITH_TWO_CLASSES),
    "sms": ("sms", "probmetrics sms", probmetrics_method("sms"), WITH_TWO_CLASSES),
    "bcts": ("bcts", "abstention TempScaling(bias_positions='all')", abstention_method("bcts"), DATASETS),
    "nbvs": ("nbvs", "abstention NoBiasVectorScaling", abstention_method("nbvs"), DATASETS),
    "vector": ("vector", "abstention VectorScaling", abstention_method("vector"), DATASETS),
    "dirichlet": (
        "dirichlet",
        "probmetrics dircal (dirichletcal b03f65f, jax)",
        probmetrics_method("dircal"),
        DATASETS,
    ),
    "beta": (
        "beta",
        "probmetrics MulticlassOneVsRestCalibrator(BetacalCalibrator())",
        probmetrics_ovr_beta,
        DATASETS,
    ),
    "beta_binary": (
        "binary:beta",
        "betacal 1.1.0 BetaCalibration('abm'), class 0 against the rest",
        betacal_binary,
        DATASETS,
    ),
    # venn-abers' table computation is O(N²) Python per class: 10k x 10 only
    "venn_abers": (
        "venn_abers",
        "probmetrics ivap (venn-abers 1.5.4, one_vs_all)",
        probmetrics_method("ivap"),
        {"10k_x_10": DATASETS["10k_x_10"]},
    ),
    "bbq": ("bbq", "netcal 1.4.0 BBQ() (equal-width bins, BIC, elbow)", netcal_bbq, DATASETS),
    "iop": (
        "iop",
        "probmetrics IntraOrderPreservingCalibrator, torch.manual_seed(0)",
        probmetrics_iop,
        DATASETS,
    ),
    "dirichlet_diag": (
        "dirichlet_diag",
        "dirichletcal b03f65f DiagonalDirichletCalibrator(reg_lambda=1e-3, reg_mu=1e-3)",
        dirichletcal_diag,
        DATASETS,
    ),
}


def binary_view(spec, data):
    """For binary methods: the logit of p_0 and the labels 1[y = 0] (class 0 against the rest)."""
    if not spec.startswith("binary:"):
        return data
    z, y = data
    ell = torch.log_softmax(z, 1)[:, 0]
    return ell - torch.log(-torch.expm1(ell)), (y == 0).long()


def versions():
    out = {"torch": torch.__version__}
    for pkg in (
        "probmetrics",
        "abstention",
        "betacal",
        "venn-abers",
        "netcal",
        "jax",
        "scikit-learn",
        "numpy",
    ):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated method names (default: all)")
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    only = [m for m in args.only.split(",") if m] or list(METHODS)
    golden = json.load(open(args.out)) if os.path.exists(args.out) else {"methods": {}}
    golden["datasets"] = {k: {"n": n, "k": c, "seed": s} for k, (n, c, s) in WITH_TWO_CLASSES.items()}
    golden["generator"] = "tests/reference/calibration_data.py::synthetic_logits (float64), split in halves"
    golden["versions"] = versions()
    torch.set_num_threads(int(os.environ.get("TORCHCAL_THREADS", "1")))
    for name in only:
        spec, label, peer, datasets = METHODS[name]
        entry = golden["methods"].setdefault(name, {"peer": label, "torchcal": spec, "results": {}})
        entry["peer"], entry["torchcal"] = label, spec
        for ds, (n, k, seed) in datasets.items():
            (zc, yc), (zt, yt) = split(*binary_view(spec, synthetic_logits(n, k, seed, dtype=torch.float64)))
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out, params = peer(zc, yc, torch.cat([zc, zt]))
            t_peer = time.perf_counter() - t0
            t0 = time.perf_counter()
            if spec.startswith("binary:"):
                p = create(spec.split(":")[1], task="multilabel").fit(zc, yc).transform(torch.cat([zc, zt]))
                ours = torch.stack([1 - p, p], 1).numpy()
            else:
                ours = create(spec).fit(zc, yc).transform(torch.cat([zc, zt])).numpy()
            t_ours = time.perf_counter() - t0
            h = len(yc)
            train_peer, train_ours = scores(out[:h], yc.numpy())["nll"], scores(ours[:h], yc.numpy())["nll"]
            out, ours = out[h:], ours[h:]
            peer_scores, our_scores = scores(out, yt.numpy()), scores(ours, yt.numpy())
            entry["results"][ds] = {
                "peer": peer_scores,
                "calibration_nll": {"peer": train_peer, "torchcal_at_generation": train_ours},
                "peer_params": params,
                "peer_max_abs_dp_vs_torchcal": float(np.abs(np.asarray(out, dtype=float) - ours).max()),
                "torchcal_at_generation": our_scores,
                "fit_predict_seconds": {"peer": round(t_peer, 3), "torchcal": round(t_ours, 3)},
            }
            print(
                f"{name:8s} {ds:10s} peer NLL {peer_scores['nll']:.6f} torchcal {our_scores['nll']:.6f} "
                f"(Δ {our_scores['nll'] - peer_scores['nll']:+.2e}) max|Δp| "
                f"{entry['results'][ds]['peer_max_abs_dp_vs_torchcal']:.2e}  t {t_peer:.2f}s / {t_ours:.2f}s",
                flush=True,
            )
            if not math.isfinite(peer_scores["nll"]):
                print(f"  warning: the peer's NLL is not finite for {name} on {ds}", flush=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(golden, fh, indent=1, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
