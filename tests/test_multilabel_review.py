"""The one-shot multi-label metrics (SPEC §6) on edge cases, against float64 loops written here and
scikit-learn: probabilities exactly on bin edges, ties, a label with one class, float16/bfloat16 inputs,
and the inputs they refuse (non-finite AUROC scores, ``label_names`` of the wrong length, no labels)."""

from __future__ import annotations

import math

import pytest
import torch

from torchcal.functional import binary as B
from torchcal.metrics import MultilabelCalibrationMetrics


def _bin(p: float, m: int) -> int:
    """Bin (k/M, (k+1)/M] of p, 0 in bin 0, the edges compared as float64 numbers k/M."""
    return next(k for k in range(m) if p <= (k + 1) / m or k == m - 1)


def _binned(p, y, m, norm="l1"):
    bins = [[] for _ in range(m)]
    for a, b in zip(p, y, strict=True):
        bins[_bin(a, m)].append((a, b))
    gaps = [(len(b), abs(sum(a for a, _ in b) - sum(t for _, t in b)) / len(b)) for b in bins if b]
    return max(g for _, g in gaps) if norm == "max" else sum(c * g for c, g in gaps) / len(p)


def _equal_mass(p, y, m):
    """numpy.array_split of the stable ascending order into m groups, Σ_b |Σ p − Σ y| / N."""
    order = sorted(range(len(p)), key=lambda i: (p[i], i))
    q, r = divmod(len(p), m)
    total, start = 0.0, 0
    for b in range(m):
        group = order[start : start + q + (b < r)]
        start += len(group)
        total += abs(sum(p[i] for i in group) - sum(y[i] for i in group))
    return total / len(p)


def _edge_data():
    g = torch.Generator().manual_seed(0)
    p = torch.rand(97, 4, generator=g, dtype=torch.float64)
    p[::7] = torch.tensor([0.2, 0.4, 0.6, 0.8], dtype=torch.float64)  # on the edges of 5 bins
    p[3::11, 1], p[5::13, 2] = 0.0, 1.0
    p[:, 3] = torch.round(p[:, 3] * 4) / 4  # five values: long ties
    y = (torch.rand(97, 4, generator=g, dtype=torch.float64) < p).long()
    y[:, 0] = 1  # one class only
    return p, y


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_binned_metrics_and_auroc_equal_loops_and_sklearn_on_edges_and_ties(dtype):
    from sklearn.metrics import roc_auc_score

    p, y = _edge_data()
    low = p.to(dtype)
    exact = low.double()  # the values the metric sees: the low-precision numbers, binned as float64 numbers
    ece = B.multilabel_ece(low, y, n_bins=5, average="none")
    mce = B.multilabel_mce(low, y, n_bins=5, average="none")
    ada = B.multilabel_adaece(low, y, n_bins=5, average="none")
    with pytest.warns(UserWarning, match=r"label\(s\) \[0\]"):
        auroc = B.multilabel_auroc(low, y, average="none")
    for j in range(4):
        col, t = exact[:, j].tolist(), y[:, j].tolist()
        # sums of 97 float64 terms of size <= 1 in another order than the loop's: a few ulps
        assert float(ece[j]) == pytest.approx(_binned(col, t, 5), abs=1e-12)
        assert float(mce[j]) == pytest.approx(_binned(col, t, 5, "max"), abs=1e-12)
        assert float(ada[j]) == pytest.approx(_equal_mass(col, t, 5), abs=1e-12)
        if j:  # mid-ranks: exact half-integer arithmetic, as scikit-learn's trapezoids
            assert float(auroc[j]) == pytest.approx(roc_auc_score(t, col), abs=1e-12)
    assert math.isnan(float(auroc[0]))
    pooled_p, pooled_y = exact.reshape(-1).tolist(), y.reshape(-1).tolist()
    assert float(B.multilabel_ece(low, y, n_bins=5, average="micro")) == pytest.approx(
        _binned(pooled_p, pooled_y, 5), abs=1e-12
    )
    assert float(B.multilabel_adaece(low, y, n_bins=5, average="micro")) == pytest.approx(
        _equal_mass(pooled_p, pooled_y, 5), abs=1e-12
    )


def test_auroc_refuses_scores_without_a_rank():
    # a NaN score has no place in the ranking: the previous code sorted it last and returned 0.8225 for the
    # label (scikit-learn's roc_auc_score refuses such input)
    p, y = _edge_data()
    for bad in (math.nan, math.inf):
        scores = p.clone()
        scores[0, 1] = bad
        with pytest.raises(ValueError, match="`scores` contains NaN or infinite values"):
            B.multilabel_auroc(scores, y)


def test_auroc_label_names_need_one_name_per_label():
    p, y = _edge_data()
    # too few names raised IndexError once a label was missing; too many were taken silently
    for names in (["a"], ["a", "b", "c", "d", "e"]):
        with pytest.raises(ValueError, match=r"`label_names` must have one name per label \(4\), got"):
            B.multilabel_auroc(p, y, label_names=names)
    with pytest.warns(UserWarning, match=r"\['a'\]"):
        B.multilabel_auroc(p, y, label_names=("a", "b", "c", "d"))


def test_inputs_without_labels_are_refused_by_name():
    # (N, 0) inputs ended in torch errors ("min(): Expected reduction dim", "stack expects a non-empty
    # TensorList") or, for the AUROC, a stack error
    p, y = torch.zeros(3, 0), torch.zeros(3, 0)
    metrics = (B.multilabel_ece, B.multilabel_mce, B.multilabel_adaece, B.multilabel_brier_score)
    for fn in (*metrics, B.multilabel_nll):
        with pytest.raises(ValueError, match=r"`probs` must have shape \(N,\) or \(N, L\) with L >= 1"):
            fn(p, y)
    with pytest.raises(ValueError, match=r"`logits` must have shape \(N,\) or \(N, L\) with L >= 1"):
        B.multilabel_nll(p, y, from_logits=True)
    with pytest.raises(ValueError, match=r"`scores` must have shape \(N,\) or \(N, L\) with L >= 1"):
        B.multilabel_auroc(p, y)


def test_one_sample_and_one_label():
    # N = 1, L = 1: p = 0.3 with a positive is one bin with gap |1 − 0.3| = 0.7 for every binned estimator
    p, y = torch.tensor([[0.3]], dtype=torch.float64), torch.tensor([[1]])
    for fn in (B.multilabel_ece, B.multilabel_mce, B.multilabel_adaece):
        assert float(fn(p, y)) == pytest.approx(0.7, abs=1e-15)
    m = MultilabelCalibrationMetrics(1)
    m.update(p[:, 0], y[:, 0])
    with pytest.warns(UserWarning, match="AUROC is undefined"):
        out = m.compute()
    assert float(out["ece"]) == pytest.approx(0.7, abs=1e-15) and math.isnan(float(out["auroc"]))
