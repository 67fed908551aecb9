"""Venn-Abers (IVAP) against venn-abers 1.5.4: golden values for tests/test_venn_abers.py.

Calls ``venn_abers.venn_abers.predict_proba_prefitted_va(va_tpe="one_vs_all")`` (the function behind
probmetrics' ``ivap``) on softmax probabilities of seeded synthetic logits
(tests/reference/calibration_data.py; first half calibration, second half test) and writes its merged
probabilities and (p0, p1) intervals into tests/data/venn_abers_goldens.json. The "ties" case rounds the
logits to integers so that many calibration and test scores are tied. The probabilities are computed here
in float64 exactly as torchcal computes them (softmax of the float64 logits), so the tests can ask for
agreement to rounding.

Peers (a separate environment, not torchcal dependencies):
    python3 -m venv /path/peers && /path/peers/bin/pip install torch==2.13.0 venn-abers==1.5.4
Run from the repository root:
    PYTHONPATH=src:. /path/peers/bin/python benchmarks/conformance_venn_abers.py
"""

from __future__ import annotations

import json
import os
import sys
from importlib import metadata

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.reference.calibration_data import split, synthetic_logits  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "venn_abers_goldens.json")
# name: (n, k, seed, round the logits to integers)
CASES = {
    "distinct_800_x_4": (800, 4, 3, False),
    "ties_800_x_3": (800, 3, 4, True),
    "binary_600": (600, 2, 5, True),
}


def main():
    from venn_abers.venn_abers import predict_proba_prefitted_va

    golden = {"versions": {p: metadata.version(p) for p in ("venn-abers", "numpy", "torch")}, "cases": {}}
    golden["generator"] = "tests/reference/calibration_data.py::synthetic_logits (float64), split in halves"
    for name, (n, k, seed, rounded) in CASES.items():
        z, y = synthetic_logits(n, k, seed, dtype=torch.float64)
        if rounded:
            z = torch.round(z)
        (zc, yc), (zt, _) = split(z, y)
        pc, pt = torch.softmax(zc, 1).numpy(), torch.softmax(zt, 1).numpy()
        probs, p0p1 = predict_proba_prefitted_va(pc, yc.numpy(), pt, va_tpe="one_vs_all")
        assert probs.shape[1] == k, "a class is absent from the calibration labels"
        golden["cases"][name] = {
            "n": n,
            "k": k,
            "seed": seed,
            "round_logits": rounded,
            "probs": np.asarray(probs).tolist(),
            "p0": np.stack([q[:, 0] for q in p0p1], 1).tolist(),
            "p1": np.stack([q[:, 1] for q in p0p1], 1).tolist(),
        }
        print(f"{name}: {len(zt)} test rows, {len(np.unique(pc))} distinct calibration scores", flush=True)
    tmp = OUT + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(golden, fh, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, OUT)


if __name__ == "__main__":
    main()
