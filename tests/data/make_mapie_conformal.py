"""Writes tests/data/mapie_conformal.npz: MAPIE 1.6.0's split-conformal sets (LAC; APS with
include_last_label False and True) on SPEC §9.7.4's synthetic data, for tests/test_conformal.py.

Run in a separate environment with the peer installed (it is not a torchcal dependency):
    python -m venv /tmp/peers && /tmp/peers/bin/pip install mapie==1.6.0
    /tmp/peers/bin/python tests/data/make_mapie_conformal.py
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
from mapie.classification import SplitConformalClassifier
from sklearn.base import BaseEstimator, ClassifierMixin

K, N_CAL, N_TEST, ALPHA = 10, 1000, 3000, 0.1


class ProbaPassThrough(ClassifierMixin, BaseEstimator):
    """X is the probability matrix."""

    def fit(self, X, y):
        self.classes_ = np.arange(K)
        return self

    def predict_proba(self, X):
        return np.asarray(X)

    def predict(self, X):
        return np.asarray(X).argmax(1)


def main() -> None:
    import mapie

    rng = np.random.default_rng(0)
    logits = 2.0 * rng.standard_normal((N_CAL + N_TEST, K))
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    u = rng.random(N_CAL + N_TEST)
    y = (np.cumsum(probs, 1) < u[:, None]).sum(1).clip(max=K - 1)
    p_cal, y_cal, p_test = probs[:N_CAL], y[:N_CAL], probs[N_CAL:]
    est = ProbaPassThrough().fit(p_cal, y_cal)
    out = {"logits": logits, "targets": y, "n_cal": np.int64(N_CAL), "alpha": np.float64(ALPHA)}
    # MAPIE draws the APS calibration uniforms from RandomState(random_state).uniform(size=n_cal)
    out["aps_calibration_u"] = np.random.RandomState(0).uniform(size=N_CAL)
    for score, include in [("lac", True), ("aps", False), ("aps", True)]:
        scc = SplitConformalClassifier(
            estimator=est, confidence_level=1 - ALPHA, conformity_score=score, prefit=True, random_state=0
        )
        scc.conformalize(p_cal, y_cal)
        params = {} if score == "lac" else {"conformity_score_params": {"include_last_label": include}}
        _, sets = scc.predict_set(p_test, **params)
        key = score if score == "lac" else f"aps_last_{str(include).lower()}"
        out[f"{key}_sets"] = sets[:, :, 0].astype(np.uint8)
        out[f"{key}_qhat"] = np.float64(
            np.ravel(scc._mapie_classifier.conformity_score_function_.quantiles_)[0]
        )
    out["mapie_version"] = np.array(mapie.__version__)
    target = Path(__file__).with_name("mapie_conformal.npz")
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".npz")
    os.close(fd)
    np.savez_compressed(tmp, **out)
    os.chmod(tmp, 0o644)
    os.replace(tmp, target)
    for key in ("lac", "aps_last_false", "aps_last_true"):
        s = out[f"{key}_sets"].astype(bool)
        print(key, out[f"{key}_qhat"], s[np.arange(N_TEST), y[N_CAL:]].mean(), s.sum(1).mean())


if __name__ == "__main__":
    main()
