"""Calibrator fit + transform time and test NLL, torchcal against the peers, paired in one run.

Synthetic over-confident, class-biased float32 logits (tests/reference/calibration_data.py): fit on N rows,
score on 10,000 further rows. Every method runs in this process on the same tensors, one after another,
with the same thread count (OMP/MKL threads too), so the ratios compare like with like. Each row is the
best of ``--repeat`` runs.

Peers are optional (a separate environment, see conformance_calibrators.py); run from the repository root:
    PYTHONPATH=src:. /path/peers/bin/python benchmarks/bench_calibrators.py [--sizes 25000x1000,50000x10]
Writes benchmarks/results/bench_calibrators-<cpu>-<threads>t-torch<version>.csv and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import re
import sys
import time
import warnings

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, os.environ.get("BENCH_THREADS", "1"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.reference.calibration_data import synthetic_logits  # noqa: E402

from torchcal.calibrators import create  # noqa: E402

N_TEST = 10_000


def _nll(probs, y):
    probs = torch.as_tensor(np.asarray(probs), dtype=torch.float64)
    return float(-torch.log(probs.gather(1, y[:, None]).clamp_min(1e-300)).mean())


def _probs32(z):
    return torch.softmax(z.double(), 1).float().numpy()


def probmetrics(method):
    def run(zc, yc, zt):
        from probmetrics.calibrators import get_calibrator

        cal = get_calibrator(method)
        cal.fit(_probs32(zc), yc.numpy())
        return cal.predict_proba(_probs32(zt))

    return run


def abstention(kind):
    def run(zc, yc, zt):
        from abstention import calibration as A

        factory = {"bcts": lambda: A.TempScaling(bias_positions="all"), "nbvs": A.NoBiasVectorScaling,
                   "vector": A.VectorScaling}[kind]()  # fmt: skip
        onehot = np.eye(zc.shape[1], dtype=np.float32)[yc.numpy()]
        fn = factory(valid_preacts=zc.numpy(), valid_labels=onehot)
        return fn(zt.numpy())

    return run


def probmetrics_ovr_beta(zc, yc, zt):
    from probmetrics.calibrators import BetacalCalibrator, MulticlassOneVsRestCalibrator

    cal = MulticlassOneVsRestCalibrator(BetacalCalibrator())
    cal.fit(_probs32(zc), yc.numpy())
    return cal.predict_proba(_probs32(zt))


def netcal_bbq(zc, yc, zt):
    """netcal's BBQ on the probabilities, one model per class (one-vs-all), rows divided by their sum."""
    from netcal.binning import BBQ

    cal = BBQ()
    cal.fit(_probs32(zc).astype(np.float64), yc.numpy())
    out = np.clip(np.asarray(cal.transform(_probs32(zt).astype(np.float64)), dtype=np.float64), 1e-30, None)
    return out / out.sum(1, keepdims=True)


def probmetrics_iop(zc, yc, zt):
    """probmetrics' port of the IOP reference code (its defaults: hidden (150, 150), Adam lr 5e-3, weight
    decay 5e-4, batch 256, 40 epochs), seeded with torch.manual_seed(0)."""
    from probmetrics.calibrators.orderpreserving import IntraOrderPreservingCalibrator

    torch.manual_seed(0)
    cal = IntraOrderPreservingCalibrator()
    cal.fit(_probs32(zc), yc.numpy())
    return cal.predict_proba(_probs32(zt))


def dirichletcal_diag(zc, yc, zt):
    from dirichletcal.calib.diagdirichlet import (  # pyright: ignore[reportMissingImports]  (from source)
        DiagonalDirichletCalibrator,
    )

    cal = DiagonalDirichletCalibrator(reg_lambda=1e-3, reg_mu=1e-3)
    cal.fit(_probs32(zc).astype(np.float64), yc.numpy())
    return cal.predict_proba(_probs32(zt).astype(np.float64))


def torchcal(spec):
    def run(zc, yc, zt):
        return create(spec).fit(zc, yc).transform(zt)

    return run


# method: ([(implementation label, callable[, classes up to which this one runs])], torchcal first; classes up
# to which the method runs)
METHODS = {
    "ts": (
        [("torchcal ts", torchcal("ts")), ("probmetrics temp-scaling", probmetrics("temp-scaling"))],
        10**9,
    ),
    "svs": ([("torchcal svs", torchcal("svs")), ("probmetrics svs", probmetrics("svs"))], 10**9),
    "bcts": ([("torchcal bcts", torchcal("bcts")), ("abstention bcts", abstention("bcts"))], 10**9),
    "nbvs": ([("torchcal nbvs", torchcal("nbvs")), ("abstention nbvs", abstention("nbvs"))], 10**9),
    "vector": ([("torchcal vector", torchcal("vector")), ("abstention vector", abstention("vector"))], 10**9),
    "sms": ([("torchcal sms", torchcal("sms")), ("probmetrics sms", probmetrics("sms"))], 100),
    "matrix": ([("torchcal matrix", torchcal("matrix"))], 100),
    "dirichlet": (
        [("torchcal dirichlet", torchcal("dirichlet")), ("probmetrics dircal", probmetrics("dircal"))],
        10,
    ),
    "dirichlet_diag": (
        [("torchcal dirichlet_diag", torchcal("dirichlet_diag")), ("dirichletcal diag", dirichletcal_diag)],
        10,
    ),
    "beta": ([("torchcal beta", torchcal("beta")), ("probmetrics beta-ovr", probmetrics_ovr_beta)], 100),
    # netcal's one-vs-all BBQ fits K scored binning ensembles in Python: 100 s of CPU at 5k x 1000 already,
    # growing with N, so it runs up to K = 100 (a third entry: the classes up to which that one runs)
    "bbq": ([("torchcal bbq", torchcal("bbq")), ("netcal bbq", netcal_bbq, 100)], 10**9),
    "iop": ([("torchcal iop", torchcal("iop")), ("probmetrics iop", probmetrics_iop)], 10**9),
    # no installable peer implements PTS (netcal, probmetrics and torch-uncertainty do not); its 100,000 Adam
    # steps take minutes at K = 10 and far longer at K = 1000
    "pts": ([("torchcal pts", torchcal("pts"))], 10),
    "venn_abers": (
        [("torchcal venn_abers", torchcal("venn_abers")), ("probmetrics ivap", probmetrics("ivap"))],
        100,
    ),
}


# fitted for a fixed number of steps whatever N (PTS: 100,000 Adam steps): a warm-up would cost as much as
# the run, and the first-call costs it would absorb are negligible against it
NO_WARMUP = {"pts"}


def available(label):
    peer = label.split()[0]
    if peer == "torchcal":
        return True
    if label in ("probmetrics dircal", "dirichletcal diag"):
        peer = "dirichletcal"
    try:
        __import__(peer)
        return True
    except ImportError:
        return False


def cpu_name():
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main(argv=None):
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--sizes", default="25000x1000,50000x10", help="NxK of the calibration set, comma-separated"
    )
    # dirichlet is opt-in: dirichletcal's un-jitted jax Newton takes minutes at 50k x 10
    parser.add_argument("--methods", default=",".join(m for m in METHODS if m != "dirichlet"))
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "1")))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    out = args.out or os.path.join(
        os.path.dirname(__file__),
        "results",
        f"bench_calibrators-{cpu_name()}-{os.cpu_count()}cpu-{args.threads}t-torch{torch.__version__.split('+')[0]}.csv",
    )

    def write():  # after every method, atomically: an interrupted run keeps what it measured
        tmp = out + ".tmp"
        with open(tmp, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, out)

    for size in args.sizes.split(","):
        n, k = (int(v) for v in size.lower().split("x"))
        z, y = synthetic_logits(n + N_TEST, k, seed=7, dtype=torch.float32)
        zc, yc, zt, yt = z[:n], y[:n], z[n:], y[n:]
        uncal = _nll(torch.softmax(zt.double(), 1), yt)
        print(f"\n{n} x {k} (float32), uncalibrated test NLL {uncal:.4f}", flush=True)
        for method in args.methods.split(","):
            impls, k_max = METHODS[method]
            if k > k_max:
                continue
            results = []
            for label, fn, *limit in impls:
                if not available(label) or k > (limit[0] if limit else k_max):
                    continue
                best, nll = float("inf"), float("nan")
                try:  # warm-up on a slice: imports, JIT compilation (numba) and first-call costs
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        if method not in NO_WARMUP:
                            fn(zc[:2000], yc[:2000], zt[:100])
                except Exception:
                    pass
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    try:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            probs = fn(zc, yc, zt)
                    except Exception as err:  # a peer that fails is reported, the run continues
                        print(f"  {label}: failed: {type(err).__name__}: {err}", flush=True)
                        break
                    best = min(best, time.perf_counter() - t0)
                    nll = _nll(probs, yt)
                results.append((label, best, nll))
                print(f"  {label:28s} {best:9.3f} s   test NLL {nll:.5f}", flush=True)
            peers = [r for r in results[1:] if np.isfinite(r[1])]
            fastest = min(peers, key=lambda r: r[1]) if peers else None
            for label, secs, nll in results:
                rows.append({
                    "n": n, "k": k, "method": method, "implementation": label, "fit_transform_s": round(secs, 4),
                    "test_nll": round(nll, 6), "uncalibrated_nll": round(uncal, 6),
                    "speedup_vs_fastest_peer": (round(fastest[1] / secs, 2)
                                                if fastest and label.startswith("torchcal") else ""),
                    "nll_minus_fastest_peer": (round(nll - fastest[2], 6)
                                               if fastest and label.startswith("torchcal") else ""),
                    "threads": args.threads,
                })  # fmt: skip
            if rows:
                write()
    print(f"\nwrote {out}\n")
    print("| N × K | method | implementation | fit + transform (s) | test NLL | speed-up vs fastest peer |")
    print("|---|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['n']} × {r['k']} | {r['method']} | {r['implementation']} | {r['fit_transform_s']:.3f} | "
              f"{r['test_nll']:.4f} | {r['speedup_vs_fastest_peer']} |")  # fmt: skip


if __name__ == "__main__":
    main()
