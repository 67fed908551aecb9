"""Inductive Venn-Abers predictors (IVAP, Vovk, Petej, Fedorova 2015), one-vs-all for softmax outputs."""

from __future__ import annotations

import torch

from .._namespace import only_public as _only_public
from .base import Calibrator

__all__ = ["VennAbers", "venn_abers_tables"]


def _lower_hull_next(w, s):
    """For each boundary b, the index of the vertex after (w_b, s_b) on the lower convex hull of the points
    (w_j, s_j), j ≥ b, or −1 for the last one: the hull of every suffix at once, as a tree of pointers (a
    right-to-left monotone chain; collinear points are not vertices). Exact integer arithmetic."""
    nxt = [-1] * len(w)
    hull = []
    for b in range(len(w) - 1, -1, -1):
        while len(hull) >= 2:
            o, a = hull[-2], hull[-1]
            # pop a when it lies on or above the segment from b to o (a clockwise or straight turn o, a, b)
            if (w[a] - w[o]) * (s[b] - s[o]) - (s[a] - s[o]) * (w[b] - w[o]) >= 0:
                hull.pop()
            else:
                break
        nxt[b] = hull[-1] if hull else -1
        hull.append(b)
    return nxt


def _ivap_scan(w, s, extra, nxt):
    """The isotonic value at an inserted test point of label ``extra`` (0 or 1), at every boundary u:
    max_{a ≤ u} min_{b ≥ u} (s_b − s_a + extra) / (w_b − w_a + 1), as exact (numerator, denominator) pairs.

    That value is the slope of the bridge (common lower tangent) between the lower hull of the left points
    L_a = (w_a − 1, s_a − extra), a ≤ u, and the lower hull of the right points R_b = (w_b, s_b), b ≥ u: the
    left points lie strictly left of the right ones, and the line through a bridge has every point on or
    above it, which makes its slope both the max-min and the min-max. Scanning u upward, the left hull is a
    stack and the right hull is the pointer chain from u (``nxt``, :func:`_lower_hull_next`; a vertex of the
    hull of the right points stays one when R_{u−1} leaves). Both bridge ends only move right: the left end
    jumps to u when L_u pops it (L_u lies on or below the previous bridge), else walks up the stack one
    vertex at a time with a new tangent from each, and the right end walks along the chain (from u when the
    previous end left the set), so the scan takes O(m) steps in all (decision 175). Vovk, Petej and Fedorova
    (2015) compute the same values with another stack algorithm."""
    m = len(w)
    lx = [v - 1 for v in w]  # the left points L_a
    ly = [v - extra for v in s]
    num, den = [0] * m, [0] * m
    stack = []  # the left hull's boundary indices
    pa = b = 0  # the bridge: left end stack[pa], right end b
    for u in range(m):
        xu, yu = lx[u], ly[u]
        while len(stack) >= 2:
            o, a = stack[-2], stack[-1]
            if (lx[a] - lx[o]) * (yu - ly[o]) - (ly[a] - ly[o]) * (xu - lx[o]) <= 0:
                stack.pop()
            else:
                break
        if pa >= len(stack):  # the left end was popped: L_u is on or below the old bridge
            pa = len(stack)
        stack.append(u)
        if b < u:
            b = u
        top = len(stack) - 1
        while True:
            a = stack[pa]
            xa, ya = lx[a], ly[a]
            # the right end: the tangent from L_a, walking the chain while the slope falls (it is unimodal
            # along a convex chain)
            c = nxt[b]
            while c >= 0 and (s[c] - ya) * (w[b] - xa) < (s[b] - ya) * (w[c] - xa):
                b = c
                c = nxt[b]
            # the left end: one step up the stack if the next vertex lies below the tangent line, then a new
            # tangent (every vertex below L_a stays above the steeper line through the lower point)
            if pa == top:
                break
            q = stack[pa + 1]
            if (s[b] - ly[q]) * (w[b] - xa) > (s[b] - ya) * (w[b] - lx[q]):
                pa += 1
            else:
                break
        a = stack[pa]
        num[u], den[u] = s[b] - s[a] + extra, w[b] - w[a] + 1
    return num, den


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
    values as pooling it with the tie; a position inside a run of tied scores is never looked up and repeats
    the value of the run's start.

    Each value is the slope of a bridge between two convex hulls of the diagram, found by one sequential
    scan per problem and table (:func:`_ivap_scan`): O(B·N) after the sort, exact (integer counts, one
    division per value). The scan is sequential, so it runs in Python on the host: the label counts go to
    the host once and the tables come back on the device of ``scores`` (decision 175).

    Args:
        scores: (B, N) calibration scores, sorted along dim 1.
        labels: (B, N) 0/1 labels in the same order.

    Returns:
        (p0, p1), each (B, N + 1), in the dtype of ``scores``.
    """
    bsz, n = scores.shape
    device = scores.device
    valid = torch.ones(bsz, n + 1, dtype=torch.bool, device=device)
    valid[:, 1:-1] = scores[:, 1:] > scores[:, :-1]  # a boundary between two distinct scores
    zero = torch.zeros(bsz, 1, dtype=torch.long, device=device)
    counts = torch.cat([zero, labels.long().cumsum(1)], 1)  # S_j at every position
    fill = valid.long().cumsum(1) - 1  # each position takes the value of the last boundary at or before it
    out = [torch.empty(bsz, n + 1, dtype=scores.dtype, device=device) for _ in range(2)]
    for row in range(bsz):  # one problem at a time on the host: O(N) Python integers in memory
        where = valid[row].nonzero()[:, 0]
        w, cum = where.tolist(), counts[row, where].tolist()
        nxt = _lower_hull_next(w, cum)
        for table, extra in zip(out, (0, 1)):
            num, den = _ivap_scan(w, cum, extra, nxt)
            values = torch.tensor(num, dtype=scores.dtype) / torch.tensor(den, dtype=scores.dtype)
            table[row] = values.to(device)[fill[row]]
    return out[0], out[1]


class VennAbers(Calibrator):
    """Inductive Venn-Abers predictor (IVAP), one-vs-all for softmax outputs, as venn-abers 1.5.4 computes it
    (probmetrics' ``ivap``).

    Class k uses the binary score s = p_k = softmax(z)_k and the labels 1[y = k]. For a test score, p0 (p1)
    is the isotonic regression fitted on the calibration pairs plus (s, 0) (plus (s, 1)), evaluated at s:
    the interval [p0, p1] is the Venn-Abers multiprobability prediction, returned by
    :meth:`predict_interval`. The point prediction merges it as p'_k = p1 / (1 − p0 + p1), and the K merged
    values are divided by their row sum (so p'_k is not p1 / (1 − p0 + p1) itself for K > 2). Fitting
    precomputes p0 and p1 at every position between the sorted calibration scores
    (:func:`venn_abers_tables`: a sort and one O(N) scan per class and table, exact; the scan runs on the
    host, the tables live on the input's device); a test score is looked up with ``searchsorted`` (right
    for p0, left for p1), O(log N) per score. No parameters are learned: the calibration scores are
    stored. On one CPU thread the fit takes about 0.9 s for N = 25,000 and K = 10 and 8 s for K = 100.

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
