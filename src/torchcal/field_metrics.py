"""Streaming the metrics of SPEC §9: the direction of the ECE and the Brier/log-score decompositions from
fixed-size bin sums (O(M·K) state, all-reduced), and KS/Kuiper, the equal-mass split, AURC and AUGRC from
kept rows (merged by gathering)."""

from __future__ import annotations

import torch

from ._namespace import only_public as _only_public
from ._validation import as_data, check_bool, check_choice, check_positive_int
from .functional import cumulative as CU
from .functional import decomposition as D
from .functional import selective as S
from .functional._binning import equal_width_index
from .functional._field_inputs import field_inputs, top_label
from .functional._inputs import scan_inputs
from .metrics import all_gather_rows

__all__ = ["FieldMetrics", "field_batch_state", "field_results", "BINNED_FIELD_METRICS", "ROW_FIELD_METRICS"]


# Up to this many entries a batch's per-bin vector sums use one float64 index_add (fewest ops); above it, one
# float32 gather in bin order and a float64-accumulating sum per bin (no (N, K) float64 copy).
_SMALL_BATCH = 1 << 16


def _state_size(k: int, m: int) -> int:
    # top-label bins (count, conf sum, correct sum): 3M; per-bin Σ P and Σ Y: 2·M·K; per-bin Σ ‖P‖² and Σ p_y:
    # 2M; Σ −log p_y and N: 2
    return 3 * m + 2 * m * k + 2 * m + 2


class FieldMetrics:
    """Accumulates the metrics of SPEC §9 over batches; mergeable and all-reducible like
    :class:`torchcal.metrics.CalibrationMetrics`.

    Constant-size float64 state (one flat buffer, one all-reduce): per equal-width top-label confidence bin
    (SPEC §3 bins) the count, confidence sum, correct sum, the K-vectors Σ P and Σ onehot(y), Σ ‖P‖² and
    Σ p_y; and Σ −log p_y and N. From it: ``ece``, ``signed_ece``, ``ece_over``, ``ece_under``, ``brier``
    and its terms (``brier_reliability``, ``brier_resolution``, ``brier_uncertainty``,
    ``brier_within_variance``, ``brier_within_covariance``), ``nll`` and its terms (``log_reliability``,
    ``log_resolution``, ``log_uncertainty``, ``log_within``), grouped by those bins
    (``groups="width"`` of :func:`torchcal.functional.brier_decomposition`).

    With ``keep_rows`` (default) every sample's top-label confidence, correctness and ranking score are kept
    (three float64 numbers, 24 bytes per sample; ``sync`` gathers them): ``adaece_over``, ``adaece_under`` (equal mass), ``ks``,
    ``kuiper`` (top-label), ``aurc`` and ``augrc`` (ranked by ``score``).

    Args:
        num_classes: K.
        n_bins: bins M.
        score: the selective-prediction ranking score, a :func:`torchcal.functional.confidence_score` name
            (``"max_logit"``/``"energy"`` need ``from_logits``).
        from_logits: ``update`` receives logits.
        keep_rows: keep the per-sample rows.

    Example:
        >>> import torch
        >>> from torchcal.functional import brier_decomposition
        >>> g = torch.Generator().manual_seed(0)
        >>> logits, targets = torch.randn(300, 4, generator=g), torch.randint(0, 4, (300,), generator=g)
        >>> m = FieldMetrics(4, from_logits=True)
        >>> for i in range(0, 300, 70):
        ...     m.update(logits[i:i + 70], targets[i:i + 70])
        >>> out = m.compute()
        >>> d = brier_decomposition(logits, targets, groups="width", from_logits=True)
        >>> bool(torch.allclose(out["brier_reliability"], d.reliability))
        True
    """

    def __init__(
        self,
        num_classes: int,
        n_bins: int = 15,
        *,
        score: str = "max_prob",
        from_logits: bool = False,
        keep_rows: bool = True,
    ):
        self.num_classes = check_positive_int(num_classes, "num_classes", minimum=2)
        self.n_bins = check_positive_int(n_bins, "n_bins")
        self.score = check_choice(score, "score", set(S.CONFIDENCE_SCORES))
        self.from_logits = check_bool(from_logits, "from_logits")
        if score in ("max_logit", "energy") and not from_logits:
            raise ValueError(f"score={score!r} needs logits: build FieldMetrics with from_logits=True")
        self.keep_rows = check_bool(keep_rows, "keep_rows")
        self._device = None
        self.reset()

    def reset(self) -> None:
        """Forget everything seen so far."""
        self._sums = torch.zeros(
            _state_size(self.num_classes, self.n_bins), dtype=torch.float64, device=self._device
        )
        self._rows: list[torch.Tensor] = []  # (B, 3) float64: confidence, correct, ranking score

    def _views(self):
        return field_state_views(self._sums, self.num_classes, self.n_bins)

    def update(self, probs_or_logits, targets) -> None:
        """Adds a batch: (B, K) probabilities (logits with ``from_logits``) and (B,) integer targets."""
        sums, rows = field_batch_state(
            probs_or_logits,
            targets,
            self.num_classes,
            self.n_bins,
            self.score,
            self.from_logits,
            self.keep_rows,
        )
        if self._device is None:
            self._device = sums.device
            self._sums = self._sums.to(sums.device)
        elif sums.device != self._device:
            raise ValueError(f"`probs_or_logits` is on {sums.device}, earlier batches were on {self._device}")
        self._sums += sums
        if rows is not None:
            self._rows.append(rows)

    def merge(self, other: FieldMetrics) -> FieldMetrics:
        """Adds the state of ``other`` (same settings) into this one; returns self."""
        if not isinstance(other, FieldMetrics):
            raise TypeError(f"`other` must be a FieldMetrics, got {type(other).__name__}")
        mine = (self.num_classes, self.n_bins, self.score, self.keep_rows)
        theirs = (other.num_classes, other.n_bins, other.score, other.keep_rows)
        if mine != theirs:
            raise ValueError(f"cannot merge metrics with settings {theirs} into {mine}")
        if self._device is None:
            self._device = other._device
            self._sums = self._sums.to(other._sums.device)
        self._sums += other._sums.to(self._sums.device)
        self._rows += [r.to(self._sums.device) for r in other._rows]
        return self

    def sync(self, group=None) -> FieldMetrics:
        """Makes every rank hold the global state: one all-reduce of the sums, one all-gather of the rows
        (in rank order). Call it once before ``compute()``; returns self."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self
        dist.all_reduce(self._sums, op=dist.ReduceOp.SUM, group=group)
        if self.keep_rows:
            mine = torch.cat(self._rows) if self._rows else torch.zeros(0, 3, dtype=torch.float64)
            self._rows = all_gather_rows(mine.to(self._sums.device), group)
        return self

    @property
    def num_samples(self) -> int:
        return int(self._views()[3][1])

    def compute(self) -> dict[str, torch.Tensor]:
        """Every metric of the state as 0-d float64 tensors (see the class)."""
        rows = (
            (torch.cat(self._rows) if self._rows else torch.zeros(0, 3, dtype=torch.float64))
            if self.keep_rows
            else None
        )
        return field_results(self._sums, rows, self.num_classes, self.n_bins)


# -- the state and its results, shared with torchcal.integrations.torchmetrics_field -------------------------

BINNED_FIELD_METRICS = (
    "ece", "signed_ece", "ece_over", "ece_under", "brier", "brier_reliability", "brier_resolution",
    "brier_uncertainty", "brier_within_variance", "brier_within_covariance", "nll", "log_reliability",
    "log_resolution", "log_uncertainty", "log_within",
)  # fmt: skip
ROW_FIELD_METRICS = ("adaece_over", "adaece_under", "ks", "kuiper", "aurc", "augrc")


def field_state_views(sums: torch.Tensor, k: int, m: int):
    """(top (3, M), per-bin vectors (2, M, K), per-bin Σ‖P‖² and Σ p_y (2, M), (Σ −log p_y, N)) views."""
    top = sums[: 3 * m].view(3, m)
    vec = sums[3 * m : 3 * m + 2 * m * k].view(2, m, k)
    sq = sums[3 * m + 2 * m * k : 5 * m + 2 * m * k].view(2, m)
    return top, vec, sq, sums[-2:]


def field_batch_state(probs_or_logits, targets, k, m, score="max_prob", from_logits=False, keep_rows=True):
    """A batch's contribution: (flat float64 sums of length 3M + 2MK + 2M + 2, rows (B, 3) float64 of
    confidence, correctness and ranking score, or None without ``keep_rows``)."""
    raw = as_data(probs_or_logits, "probs_or_logits")
    if raw.ndim == 2 and raw.shape[0] > 0:  # one fused pass: validation, confidence, correctness
        probs, targets, scan = scan_inputs(raw, targets, from_logits, "probs_or_logits")
        conf, correct = scan.conf, scan.correct.double()
    else:
        probs, targets = field_inputs(raw, targets, from_logits, "probs_or_logits")
        conf, correct, _ = top_label(probs, targets)
    if probs.shape[1] != k:
        raise ValueError(f"`probs_or_logits` has {probs.shape[1]} classes, expected {k}")
    bins = equal_width_index(conf, m)
    p_true = probs.gather(1, targets[:, None]).squeeze(1).double()
    sums = torch.zeros(_state_size(k, m), dtype=torch.float64, device=probs.device)
    top, vec, sq, scalars = field_state_views(sums, k, m)
    counts = torch.bincount(bins, minlength=m)
    top[0] += counts.double()
    top[1] += torch.bincount(bins, weights=conf.double(), minlength=m)
    top[2] += torch.bincount(bins, weights=correct, minlength=m)
    if probs.numel() <= _SMALL_BATCH:
        vec[0].index_add_(0, bins, probs.double())
    else:  # per bin, the rows' float64 column sums without an (N, K) float64 copy
        order = torch.sort(bins, stable=True).indices
        rows = probs[order]
        start = 0
        for b, c in enumerate(counts.tolist()):
            if c:
                vec[0][b] += rows[start : start + c].sum(0, dtype=torch.float64)
                start += c
    vec[1].index_put_((bins, targets), torch.ones_like(p_true), accumulate=True)
    sq_norm = torch.linalg.vector_norm(probs, dim=1, dtype=torch.float64) ** 2
    sq[0] += torch.bincount(bins, weights=sq_norm, minlength=m)
    sq[1] += torch.bincount(bins, weights=p_true, minlength=m)
    scalars[0] += -torch.log(p_true).sum()
    scalars[1] += probs.shape[0]
    if not keep_rows:
        return sums, None
    if score == "max_prob":
        rank = conf.double()
    elif score in ("max_logit", "energy"):
        rank = S.confidence_score(probs_or_logits, score=score, from_logits=True).to(probs.device)
    else:
        rank = S.confidence_score(probs, score=score)
    return sums, torch.stack([conf.double(), correct, rank], dim=1)


def field_results(sums: torch.Tensor, rows, k: int, m: int) -> dict[str, torch.Tensor]:
    """The metrics of a state: flat ``sums`` and the concatenated (N, 3) ``rows`` (None: not kept)."""
    top, vec, sq, scalars = field_state_views(sums, k, m)
    n = scalars[1]
    if float(n) == 0:
        raise RuntimeError("FieldMetrics.compute() called before any update()")
    out: dict[str, torch.Tensor] = dict(
        zip(("ece", "signed_ece", "ece_over", "ece_under"), D.direction_from_sums(*top), strict=True)
    )
    count, p_sum, y_sum = top[0], vec[0], vec[1]
    safe = count.clamp(min=1)[:, None]
    f_bar, y_bar_g, w = p_sum / safe, y_sum / safe, count / n
    y_bar = y_sum.sum(0) / n
    brier = (sq[0].sum() - 2 * sq[1].sum() + n) / n
    wbv = (sq[0].sum() - (count[:, None] * f_bar * f_bar).sum()) / n
    wbc = (sq[1].sum() - (count[:, None] * f_bar * y_bar_g).sum()) / n
    out.update({
        "brier": brier,
        "brier_reliability": (w * ((f_bar - y_bar_g) ** 2).sum(1)).sum(),
        "brier_resolution": (w * ((y_bar_g - y_bar) ** 2).sum(1)).sum(),
        "brier_uncertainty": 1 - (y_bar**2).sum(),
        "brier_within_variance": wbv,
        "brier_within_covariance": wbc,
    })  # fmt: skip
    neg_ent_g = torch.special.xlogy(y_bar_g, y_bar_g).sum(1)
    cross_g = torch.special.xlogy(y_bar_g, f_bar).sum(1)  # Σ_k ȳ_gk log f̄_gk
    nll = scalars[0] / n
    out.update({
        "nll": nll,
        "log_reliability": (w * (neg_ent_g - cross_g)).sum(),
        "log_resolution": (w * (neg_ent_g - torch.special.xlogy(y_bar_g, y_bar).sum(1))).sum(),
        "log_uncertainty": -torch.special.xlogy(y_bar, y_bar).sum(),
        "log_within": nll + (w * cross_g).sum(),
    })  # fmt: skip
    if rows is not None:
        conf, correct, rank = rows[:, 0], rows[:, 1], rows[:, 2]
        split = D.direction_from_sums(*D._equal_mass_sums(conf, correct, m))
        hi, lo = CU.cumulative_extremes(conf, correct)
        curve = S._curve(rank, 1 - correct)
        nn = rows.shape[0]
        nan = n.new_tensor(float("nan"))

        def area(y):
            return (y[1:] + y[:-1]).sum() / (2 * (nn - 1)) if nn >= 2 else nan

        out.update({
            "adaece_over": split.over, "adaece_under": split.under,
            "ks": torch.maximum(hi, -lo), "kuiper": hi - lo,
            "aurc": area(curve.risk), "augrc": area(curve.generalized_risk),
        })  # fmt: skip
    return out


_only_public(__name__)
