"""Writes tests/data/iop_goldens.json: the intra order-preserving map of probmetrics' port of the IOP
reference code (``probmetrics.calibrators.orderpreserving._OrderPreservingModel`` around its ``_FCModel``)
with seeded random weights, on float32 log-probabilities, for tests/test_neural_calibrators.py. The weights,
the inputs and the peer's calibrated logits are stored, so the test needs no peer.

Run from the repository root in a separate environment with the peer installed (not a torchcal dependency):
    python3 -m venv /path/peers && /path/peers/bin/pip install torch==2.13.0 probmetrics==1.3.0
    PYTHONPATH=src:. /path/peers/bin/python tests/data/make_iop_goldens.py
"""

from __future__ import annotations

import json
import os
import sys
from importlib import metadata

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.reference.calibration_data import synthetic_logits  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "iop_goldens.json")
# name: (n, k, seed, hidden sizes, invariant)
CASES = {"invariant_300_x_5": (300, 5, 21, [7, 6], True), "not_invariant_200_x_4": (200, 4, 22, [5], False)}


def main():
    from probmetrics.calibrators.orderpreserving import _FCModel, _OrderPreservingModel

    golden = {"versions": {p: metadata.version(p) for p in ("probmetrics", "torch", "numpy")}, "cases": {}}
    for name, (n, k, seed, hidden, invariant) in CASES.items():
        torch.manual_seed(seed)
        base = _FCModel(in_features=k, hidden_sizes=hidden, out_features=k)
        for p in base.parameters():  # larger weights than the default init, so that m varies visibly
            p.data.mul_(3.0)
        model = _OrderPreservingModel(base_model=base, invariant=invariant, num_classes=k)
        z, _ = synthetic_logits(n, k, seed, dtype=torch.float64)
        # the peer's input: ln clip(p, 1e-15, 1) of float64 probabilities, cast to float32
        x = torch.tensor(np.log(np.clip(torch.softmax(z, 1).numpy(), 1e-15, 1.0)), dtype=torch.float32)
        with torch.no_grad():
            out = model(x)
        linears = [m for m in base.model if isinstance(m, torch.nn.Linear)]
        golden["cases"][name] = {
            "invariant": invariant,
            "weights": [m.weight.tolist() for m in linears],
            "biases": [m.bias.tolist() for m in linears],
            "inputs": x.tolist(),
            "logits": out.tolist(),
        }
        print(name, tuple(out.shape), flush=True)
    tmp = OUT + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(golden, fh, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, OUT)


if __name__ == "__main__":
    main()
