"""Inductive Venn-Abers predictors (IVAP, Vovk, Petej, Fedorova 2015), one-vs-all for softmax outputs."""

from __future__ import annotations

import torch

from .._namespace import only_public as _only_public
from .base import Calibrator

__all__ = ["VennAbers", "venn_abers_tables"]

#: elements of one (K, rows, N + 1) block in the O(N²) table computation (float64: 32 MiB)
_BLOCK = 1 << 22


def venn_abers_tables(scores: torch.Tensor, labels: torch.Tensor):
    """The IVAP tables of B binary problems: p0 and p1 at every insertion position of a test score.

    For a test score inserted after the first i sorted calibration scores, p0[i] (p1[i]) is the isotonic
    regression fitted on the calibration pairs plus (s, 0) (plus (s, 1)) and evaluated at s. With the
    cumulative sum diagram S_j (labels of the j lowest scores) it is the min-max formula

        p0[i] = max_{a ≤ i} min_{b ≥ i} (S_b − S_a) / (b − a + 1),
        p1[i] = max_{a ≤ i} min_{b ≥ i} (S_b − S_a + 1) / (b − a + 1),

    where a and b run over the boundaries between distinct scores only (tied calibration scores form one
    block, as in the isotonic regression of tied inputs). A test score equal to calibration scores is looked
    up after them for p0 and before them for p1 (``searchsorted`` right and left), which gives the same
    values as pooling it with the tie. Exact (no iteration), O(B·N²) time in blocks of bounded memory.

    Args:
        scores: (B, N) calibration scores, sorted along dim 1.
        labels: (B, N) 0/1 labels in the same order.

    Returns:
        (p0, p1), each (B, N + 1), in the dtype of ``scores``.
    """
    bsz, n = scores.shape
    dtype, device = scores.dtype, scores.device
    s = torch.cat([torch.zeros(bsz, 1, dtype=dtype, device=device), labels.to(dtype).cumsum(1)], 1)
    valid = torch.ones(bsz, n + 1, dtype=torch.bool, device=device)
    valid[:, 1:-1] = scores[:, 1:] > scores[:, :-1]  # a boundary between two distinct scores
    pos = torch.arange(n + 1, device=device)
    p0 = torch.full((bsz, n + 1), -torch.inf, dtype=dtype, device=device)
    p1 = torch.full_like(p0, -torch.inf)
    rows = max(1, _BLOCK // max(1, bsz * (n + 1)))
    inf = torch.tensor(torch.inf, dtype=dtype, device=device)
    for start in range(0, n + 1, rows):
        a = pos[start : start + rows]  # (R,)
        b = pos[start:]  # only b ≥ a matters, and a ≥ start
        sa = s[:, a]  # (B, R)
        width = (b[None, :] - a[:, None] + 1).to(dtype)  # (R, N + 1 − start), b − a + 1
        after = (b[None, :] >= a[:, None])[None]
        later = after & valid[:, None, start:]  # admissible b for each a
        ends_ok = valid[:, a][:, :, None] & after  # admissible (a, i)
        diff = s[:, None, start:] - sa[:, :, None]  # (B, R, N + 1 − start), S_b − S_a
        for table, extra in ((p0, 0.0), (p1, 1.0)):
            slope = torch.where(later, (diff + extra) / width, inf)
            # min over b ≥ i: a suffix minimum along b
            inner = torch.flip(torch.cummin(torch.flip(slope, [2]), 2).values, [2])
            best = torch.where(ends_ok, inner, -inf).amax(1)
            torch.maximum(table[:, start:], best, out=table[:, start:])
    return p0, p1


class VennAbers(Calibrator):
    """Inductive Venn-Abers predictor (IVAP), one-vs-all for softmax outputs, as venn-abers 1.5.4 computes it
    (probmetrics' ``ivap``).

    Class k uses the binary score s = p_k = softmax(z)_k and the labels 1[y = k]. For a test score, p0 (p1)
    is the isotonic regression fitted on the calibration pairs plus (s, 0) (plus (s, 1)), evaluated at s:
    the interval [p0, p1] is the Venn-Abers multiprobability prediction, returned by
    :meth:`predict_interval`. The point prediction merges it as p'_k = p1 / (1 − p0 + p1), and the K merged
    values are divided by their row sum (so p'_k is not p1 / (1 − p0 + p1) itself for K > 2). Fitting
    precomputes p0 and p1 at every position between the sorted calibration scores
    (:func:`venn_abers_tables`, O(K·N²) time); a test score is looked up with ``searchsorted`` (right for
    p0, left for p1). No parameters are learned: the calibration scores are stored. The fit grows as K·N²:
    3.4 s for N = 5,000 and K = 10 on one CPU thread, so some 2 minutes (extrapolated) for N = 10,000
    and K = 100.

    A class absent from the calibration labels keeps its column (its p0 is 0 and p1 = 1 / (m + 1), m the
    number of calibration scores at or above s); venn-abers drops it instead (its classes come from
    ``np.unique(y_cal)``). Can change the argmax.

    References:
        V. Vovk, I. Petej, V. Fedorova, "Large-scale probabilistic predictors with and without guarantees of
        validity", NeurIPS 2015. V. Manokhin, "Multi-class probabilistic classification using inductive and
        cross Venn-Abers predictors", COPA 2017.

    Example:
        >>> import torch
        >>> from torchcal.calibrators import VennAbers
        >>> z = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 2.0]])
        >>> va = VennAbers().fit(z, torch.tensor([0, 1, 0, 1]))
        >>> p0, p1 = va.predict_interval(torch.tensor([[3.0, 0.0]]))
        >>> p0, p1  # class 0: with (s, 0) added, s pools with the label-1 score below it
        (tensor([[0.5000, 0.0000]]), tensor([[1.0000, 0.5000]]))
        >>> va.predict_proba(torch.tensor([[3.0, 0.0]]))  # merged 2/3 and 1/3, rows summing to one
        tensor([[0.6667, 0.3333]])
    """

    name = "venn_abers"
    fitted_attributes = ("scores_", "p0_", "p1_")

    def _fit(self, logits, targets):
        probs = torch.softmax(logits.detach().double(), 1).T  # (K, N)
        k = probs.shape[0]
        labels = targets[None, :] == torch.arange(k, device=probs.device)[:, None]
        scores, order = torch.sort(probs, dim=1, stable=True)
        p0, p1 = venn_abers_tables(scores, labels.gather(1, order))
        self.scores_, self.p0_, self.p1_ = scores.contiguous(), p0, p1

    def _interval(self, logits):
        s = torch.softmax(logits.double(), 1).T.contiguous()  # (K, n)
        scores = self.scores_.to(s.device)
        p0 = self.p0_.to(s.device).gather(1, torch.searchsorted(scores, s, right=True))
        p1 = self.p1_.to(s.device).gather(1, torch.searchsorted(scores, s, right=False))
        return p0.T, p1.T

    def _transform(self, logits):
        p0, p1 = self._interval(logits)
        merged = p1 / (1 - p0 + p1)
        return (merged / merged.sum(1, keepdim=True)).to(logits.dtype)

    def predict_interval(self, logits) -> tuple[torch.Tensor, torch.Tensor]:
        """The Venn-Abers interval per class: (p0, p1), each (N, K) with p0 ≤ p1, for ``logits`` (N, K);
        the probability of class k lies in [p0[:, k], p1[:, k]] under the Venn-Abers validity guarantee of
        its one-vs-all problem (not renormalised)."""
        self._check_fitted()
        with torch.no_grad():
            logits = self._check_input(logits)
            p0, p1 = self._interval(logits)
        return p0.to(logits.dtype), p1.to(logits.dtype)


_only_public(__name__)
