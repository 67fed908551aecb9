"""Writes tests/data/peer_selective.npz: torch-uncertainty's AURC, AUGRC, FPR95 and probmetrics' Kuiper and KS
on random data without ties, for tests/test_field_metrics.py.

Run in a separate environment with the peers installed (they are not torchcal dependencies):
    python -m venv /tmp/peers && /tmp/peers/bin/pip install torch==2.13.0 torchvision \
        torch-uncertainty probmetrics numba lightning rich
    /tmp/peers/bin/python tests/data/make_peer_selective.py

torch-uncertainty's package import needs torchvision and Lightning; the committed values were written with
torch-uncertainty 0.13.0 and probmetrics 1.3.0 (the torch that torchvision pulled in: 2.15).
"""

from __future__ import annotations

import os
import tempfile
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from probmetrics.metrics import KolmogorovSmirnovCalibrationMetric, KuiperCalibrationMetric
from torch_uncertainty.metrics import AUGRC, AURC, FPR95


def main() -> None:
    rng = np.random.default_rng(0)
    out = {}
    for i, (n, k) in enumerate([(2000, 10), (777, 3), (1500, 2)]):
        logits = 2.5 * rng.standard_normal((n, k))
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        targets = (
            (np.cumsum(probs / 1.3 + 0.3 / (1.3 * k), 1) < rng.random(n)[:, None]).sum(1).clip(max=k - 1)
        )
        p, y = torch.from_numpy(probs), torch.from_numpy(targets)
        out[f"probs_{i}"], out[f"targets_{i}"] = probs, targets
        for name, cls in (("aurc", AURC), ("augrc", AUGRC)):
            m = cls()
            m.update(p, y)
            out[f"tu_{name}_{i}"] = np.float64(m.compute())
        scores = rng.standard_normal(n) + 0.8 * (targets == 0)  # "OOD" = class 0 samples, shifted up
        m = FPR95(pos_label=1)
        m.update(torch.from_numpy(scores), torch.from_numpy((targets == 0).astype(np.int64)))
        out[f"ood_scores_{i}"] = scores
        out[f"tu_fpr95_{i}"] = np.float64(m.compute())
        if k == 2:
            out[f"pm_kuiper_{i}"] = np.float64(KuiperCalibrationMetric().compute_from_labels_probs(y, p))
            out[f"pm_ks_{i}"] = np.float64(
                KolmogorovSmirnovCalibrationMetric().compute_from_labels_probs(y, p)
            )
    out["versions"] = np.array(
        f"torch-uncertainty {version('torch-uncertainty')}, probmetrics {version('probmetrics')}"
    )
    target = Path(__file__).with_name("peer_selective.npz")
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".npz")
    os.close(fd)
    np.savez_compressed(tmp, **out)
    os.chmod(tmp, 0o644)
    os.replace(tmp, target)
    print({k: v for k, v in out.items() if k.startswith(("tu_", "pm_", "versions"))})


if __name__ == "__main__":
    main()
