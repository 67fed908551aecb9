"""Streaming calibration metrics: constant-size bin sums, plus every sample's row for the metrics that need
them all (equal-mass, cumulative and selective-prediction metrics)."""

from __future__ import annotations

import torch

from ._validation import check_bool, check_choice, check_float, check_positive_int
from .functional import calibration as C
from .functional import cumulative as CU
from .functional import decomposition as D
from .functional import selective as S
from .functional._binning import classwise_sums, equal_mass_sums, equal_width_index, prefix_sums
from .functional._inputs import metric_rows, scan_inputs
from .functional._loss_inputs import check_ignore_index

__all__ = [
    "CalibrationMetrics",
    "MultilabelCalibrationMetrics",
    "METRICS",
    "BINNED_METRICS",
    "DECOMPOSITION_METRICS",
    "ROW_METRICS",
    "all_gather_rows",
    "metric_rows",
]


class CalibrationMetrics:
    """Accumulates every calibration metric over batches, mergeable and all-reducible.

    State, all float64 unless stated:

    * top-label equal-width bin sums (count, confidence sum, correct sum), 3·M numbers: ECE, MCE and the
      direction (signed ECE, its over- and under-confident parts);
    * classwise bin sums (p_k sum and [y = k] sum per class and bin), 2·K·M numbers;
    * sums of NLL, Brier (also giving the root Brier score), p_y, correct, the S99 count and hits, and N;
    * with ``decompositions`` (default), per top-label bin the K-vectors Σ P_i and Σ onehot(y_i), 2·M·K
      numbers: the Brier and log-score decompositions grouped by those bins (``groups="width"`` of
      :func:`torchcal.functional.brier_decomposition`);
    * with ``equal_mass`` (default), the rows of the metrics that need every sample (AdaECE, debiased ECE,
      ECE sweep, smECE, the equal-mass over/under split, KS, Kuiper, AURC, AUGRC): the top-label confidence
      (in the input's dtype, float32 for half inputs) and correctness (bool) of every sample, **5 bytes per
      sample** for float32 inputs (5 MB per million; 9 for float64), plus a float64 ranking score when
      ``score`` is not ``"max_prob"``: the only state that grows with N.

    ``compute()`` calls the same functions as the one-shot API, so k updates give the one-shot values up to
    float64 summation order. ``sync()`` all-reduces the constant-size sums in one call and all-gathers the
    per-sample rows (the only variable-size traffic; they come back in rank order). KDE ECE (O(N²)),
    classwise KS (O(N·K) rows) and OOD metrics (two data sets) are not streamed: use their functions.

    Args:
        num_classes: K.
        n_bins: bins M of the binned metrics (ECE, MCE, classwise ECE, the direction, the decompositions'
            groups, AdaECE and debiased ECE).
        from_logits: ``update`` receives logits and applies softmax.
        equal_mass: keep the per-sample rows (else the row metrics are not available).
        decompositions: keep the per-bin K-vector sums of the decompositions (else they are not available
            and ``update`` skips their one extra pass over the (B, K) batch).
        score: the ranking score of AURC and AUGRC, a :func:`torchcal.functional.confidence_score` name
            (``"max_logit"`` and ``"energy"`` need ``from_logits``).
        s99_threshold: confidence threshold of the S99 share.
        ignore_index: a label whose positions ``update`` leaves out (None: every label counts), as the
            losses' ``ignore_index``; ``update`` also takes (B, K, d1, ...) scores with (B, d1, ...)
            targets, each position a sample (decision 97).

    Example:
        >>> import torch
        >>> from torchcal.metrics import CalibrationMetrics
        >>> from torchcal.functional import brier_decomposition, expected_calibration_error
        >>> g = torch.Generator().manual_seed(0)
        >>> logits, targets = torch.randn(300, 5, generator=g), torch.randint(0, 5, (300,), generator=g)
        >>> m = CalibrationMetrics(num_classes=5, from_logits=True)
        >>> for i in range(0, 300, 64):
        ...     m.update(logits[i:i + 64], targets[i:i + 64])
        >>> out = m.compute()
        >>> sorted(out)[:4]
        ['adaece', 'adaece_over', 'adaece_under', 'augrc']
        >>> torch.allclose(out["ece"], expected_calibration_error(logits, targets, from_logits=True))
        True
        >>> d = brier_decomposition(logits, targets, groups="width", from_logits=True)
        >>> bool(torch.allclose(out["brier_reliability"], d.reliability))
        True
    """

    def __init__(
        self,
        num_classes: int,
        n_bins: int = 15,
        *,
        from_logits: bool = False,
        equal_mass: bool = True,
        decompositions: bool = True,
        score: str = "max_prob",
        s99_threshold: float = 0.99,
        ignore_index=None,
    ):
        self.ignore_index = check_ignore_index(ignore_index)
        self.num_classes = check_positive_int(num_classes, "num_classes", minimum=2)
        self.n_bins = check_positive_int(n_bins, "n_bins")
        self.from_logits = check_bool(from_logits, "from_logits")
        self.equal_mass = check_bool(equal_mass, "equal_mass")
        self.decompositions = check_bool(decompositions, "decompositions")
        self.score = check_score(score, self.from_logits, "CalibrationMetrics")
        # the same check as confidence_at_least's `threshold`
        self.s99_threshold = check_float(s99_threshold, "s99_threshold", low=0, high=1)
        self._device = None
        self.reset()

    # -- state -------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget everything seen so far."""
        # One flat float64 buffer for every constant-size sum, so sync() is a single all-reduce.
        self._sums = torch.zeros(
            state_size(self.num_classes, self.n_bins, self.decompositions),
            dtype=torch.float64,
            device=self._device,
        )
        self._conf: list[torch.Tensor] = []
        self._correct: list[torch.Tensor] = []
        self._rank: list[torch.Tensor] = []  # float64 ranking scores, only when score != "max_prob"

    def _settings(self):
        return (self.num_classes, self.n_bins, self.equal_mass, self.decompositions, self.score,
                self.s99_threshold, self.ignore_index)  # fmt: skip

    def update(self, probs_or_logits, targets) -> None:
        """Adds a batch: probabilities (or logits if ``from_logits``) of shape (B, K) and targets (B,), or
        (B, K, d1, ...) and (B, d1, ...); positions labelled ``ignore_index`` are left out."""
        probs_or_logits, targets = metric_rows(
            probs_or_logits, targets, self.ignore_index, names=("probs_or_logits", "targets")
        )
        if self.ignore_index is not None and targets.shape[0] == 0:
            return  # every position of the batch is ignored
        sums, conf, correct, rank = batch_state(
            probs_or_logits,
            targets,
            self.num_classes,
            self.n_bins,
            self.from_logits,
            self.s99_threshold,
            decompositions=self.decompositions,
            score=self.score if self.equal_mass else "max_prob",
        )
        if self._device is None:
            self._device = sums.device
            self._sums = self._sums.to(sums.device)
        elif sums.device != self._device:
            raise ValueError(f"`probs_or_logits` is on {sums.device}, earlier batches were on {self._device}")
        self._sums += sums
        if self.equal_mass:
            self._conf.append(conf)
            self._correct.append(correct)
            if rank is not None:
                self._rank.append(rank)

    def merge(self, other: CalibrationMetrics) -> CalibrationMetrics:
        """Adds the state of ``other`` (same num_classes, n_bins, options) into this one; returns self."""
        if not isinstance(other, CalibrationMetrics):
            raise TypeError(f"`other` must be a CalibrationMetrics, got {type(other).__name__}")
        if self._settings() != other._settings():
            raise ValueError(
                f"cannot merge metrics with settings {other._settings()} into {self._settings()}"
            )
        if self._device is None:
            self._device = other._device
            self._sums = self._sums.to(other._sums.device)
        self._sums += other._sums.to(self._sums.device)
        self._conf += [c.to(self._sums.device) for c in other._conf]
        self._correct += [c.to(self._sums.device) for c in other._correct]
        self._rank += [r.to(self._sums.device) for r in other._rank]
        return self

    def sync(self, group=None) -> CalibrationMetrics:
        """Makes every rank hold the global state (torch.distributed): all-reduce of the constant-size sums,
        all-gather of the per-sample rows (in rank order). Call it once before ``compute()``; returns self."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self
        dist.all_reduce(self._sums, op=dist.ReduceOp.SUM, group=group)
        if self.equal_mass:
            device = self._sums.device
            conf = torch.cat(self._conf) if self._conf else torch.zeros(0, device=device)
            correct = torch.cat(self._correct) if self._correct else torch.zeros(0, dtype=torch.bool)
            columns = [conf.double(), correct.to(conf.device).double()]
            if self.score != "max_prob":
                columns.append(
                    torch.cat(self._rank) if self._rank else conf.new_zeros(0, dtype=torch.float64)
                )
            gathered = all_gather_rows(torch.stack(columns, dim=1), group)
            dtype = conf.dtype if conf.numel() else torch.float32
            self._conf = [g[:, 0].to(dtype) for g in gathered]
            self._correct = [g[:, 1].bool() for g in gathered]
            self._rank = [g[:, 2].clone() for g in gathered] if self.score != "max_prob" else []
        return self

    # -- results -----------------------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        return int(self._views()[2][0])

    def _views(self):
        return state_views(self._sums, self.num_classes, self.n_bins, self.decompositions)

    def bin_sums(self):
        """Top-label equal-width (count, confidence sum, correct sum), each (n_bins,) float64."""
        top = self._views()[0]
        return top[0].clone(), top[1].clone(), top[2].clone()

    def sorted_confidences(self):
        """All stored top-label confidences sorted (stable) with their correctness, for equal-mass bins."""
        if not self.equal_mass:
            raise RuntimeError("this CalibrationMetrics was built with equal_mass=False")
        return C.sorted_by_confidence(torch.cat(self._conf), torch.cat(self._correct))

    def compute(self, names=None) -> dict[str, torch.Tensor]:
        """Every metric the state supports as 0-d float64 tensors (:data:`METRICS`): the binned ones
        (:data:`BINNED_METRICS`), with ``decompositions`` the Brier and log-score terms
        (:data:`DECOMPOSITION_METRICS`) and with ``equal_mass`` the row metrics (:data:`ROW_METRICS`).
        ``names`` (one name or an iterable of names) restricts the result to those metrics (and skips the
        work of the others)."""
        names = check_names(names)
        rows = None
        if self.equal_mass:
            rows = (self._conf, self._correct, self._rank if self.score != "max_prob" else None)
        return results(self._sums, rows, self.num_classes, self.n_bins, names, self.decompositions)


def check_score(score, from_logits: bool, owner: str) -> str:
    """A :func:`torchcal.functional.confidence_score` name; the logit scores need ``from_logits``."""
    score = check_choice(score, "score", set(S.CONFIDENCE_SCORES))
    if score in ("max_logit", "energy") and not from_logits:
        raise ValueError(f"score={score!r} needs logits: build the {owner} with from_logits=True")
    return score


def check_names(names):
    """None, or a tuple of metric names from one name or an iterable of names."""
    if names is None:
        return None
    if isinstance(names, str):
        return (names,)
    try:
        names = tuple(names)
    except TypeError:
        raise TypeError(
            f"`names` must be a metric name or an iterable of names, got {type(names).__name__}"
        ) from None
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"`names` must hold metric names (strings), got {names!r}")
    return names


def all_gather_rows(rows: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``rows`` (n_rank, ...) — shards of any length, on the device the process group uses —
    on every rank, as a list in rank order (torch.distributed: the lengths first, then the rows padded to the
    longest)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.long, device=rows.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([rows.shape[0]], device=rows.device), group=group)
    sizes = [int(n) for n in sizes]
    packed = torch.zeros(max(sizes), *rows.shape[1:], dtype=rows.dtype, device=rows.device)
    packed[: rows.shape[0]] = rows
    gathered = [torch.empty_like(packed) for _ in range(world)]
    dist.all_gather(gathered, packed, group=group)
    return [g[:n] for g, n in zip(gathered, sizes, strict=True)]


# -- the state and its results, shared with torchcal.integrations.torchmetrics ------------------------------

_SCALARS = 7  # n, nll, brier, correct, s99 count, s99 hits, p_y
# Entries of one float64 chunk of the per-bin vector sums: bounds the float64 copy of a float32 batch (8 MiB)
# while keeping the number of upcasts and index_add calls (each a parallel region) small: with 2^16 entries
# the 765 chunks of a 50k x 1000 batch took 40x longer on 2 threads of a loaded 2-core machine than on one.
_VECTOR_CHUNK = 1 << 20


def state_size(num_classes: int, n_bins: int, decompositions: bool = False) -> int:
    """Length of the flat float64 state: top-label bins (3·M), classwise bins (2·K·M), 7 scalars and, with
    ``decompositions``, the per-bin vector sums (2·M·K)."""
    return (
        3 * n_bins + 2 * num_classes * n_bins + _SCALARS + (2 * n_bins * num_classes if decompositions else 0)
    )


def state_views(sums: torch.Tensor, num_classes: int, n_bins: int, decompositions: bool = False):
    """(top (3, M), classwise (2, K, M), scalars (7,): n, nll, brier, correct, s99 count, s99 hits, Σ p_y,
    per-bin vector sums (2, M, K): Σ P and Σ onehot(y), or None) views."""
    m, km = n_bins, num_classes * n_bins
    top = sums[: 3 * m].view(3, m)
    cw = sums[3 * m : 3 * m + 2 * km].view(2, num_classes, m)
    end = 3 * m + 2 * km + _SCALARS
    vec = sums[end : end + 2 * km].view(2, m, num_classes) if decompositions else None
    return top, cw, sums[3 * m + 2 * km : end], vec


def top_bin_vector_sums(
    probs: torch.Tensor,
    targets: torch.Tensor,
    conf: torch.Tensor,
    n_bins: int,
    bins: torch.Tensor | None = None,
):
    """Per equal-width top-label bin (SPEC §3) the float64 K-vectors Σ P_i and Σ onehot(y_i), (2, M, K).
    ``bins``: each row's bin when the caller has it (the scan's), else from ``conf``. A float32 batch is
    added in chunks of ``_VECTOR_CHUNK`` entries, each upcast once (no (B, K) float64 copy)."""
    n, k = probs.shape
    if bins is None:
        bins = equal_width_index(conf, n_bins)
    out = torch.zeros(2, n_bins, k, dtype=torch.float64, device=probs.device)
    if probs.dtype == torch.float64:
        out[0].index_add_(0, bins, probs)
    else:
        rows = max(1, _VECTOR_CHUNK // k)
        for start in range(0, n, rows):
            out[0].index_add_(0, bins[start : start + rows], probs[start : start + rows].double())
    out[1] = torch.bincount(torch.add(targets, bins, alpha=k), minlength=n_bins * k).view(n_bins, k)
    return out


def batch_state(
    probs_or_logits,
    targets,
    num_classes,
    n_bins,
    from_logits,
    s99_threshold,
    decompositions=False,
    score="max_prob",
):
    """A batch's contribution: (flat float64 sums of :func:`state_size`, top-label confidences, correctness,
    float64 ranking scores or None for ``score="max_prob"``, whose ranking score is the confidence)."""
    probs, targets, scan = scan_inputs(
        probs_or_logits,
        targets,
        from_logits,
        "probs_or_logits",
        num_classes,
        classwise_bins=n_bins,
        n_bins=n_bins,
        threshold=s99_threshold,
        bin_vectors=decompositions,
    )
    conf, correct = scan.conf, scan.correct
    sums = torch.zeros(
        state_size(num_classes, n_bins, decompositions), dtype=torch.float64, device=probs.device
    )
    top, cw, scalars, vec = state_views(sums, num_classes, n_bins, decompositions)
    assert scan.top is not None and scan.sums is not None  # asked for: n_bins, threshold
    top += torch.stack(list(scan.top))
    _, cw_conf, cw_correct = classwise_sums(probs, targets, n_bins, scan.classwise)
    cw += torch.stack([cw_conf, cw_correct])
    n, batch_sums = conf.shape[0], scan.sums
    if scan.sum_sq is None:
        brier = C.brier_per_sample(probs, targets).sum()
    else:  # Σ_i (Σ_k p_ik² − 2 p_t + 1) from the fused scan's Σ p²
        brier = scan.sum_sq - 2 * batch_sums.p_true + n
    batch = [n, batch_sums.nll, brier, batch_sums.correct, batch_sums.confident, batch_sums.confident_correct,
             batch_sums.p_true]  # fmt: skip
    if all(isinstance(v, float | int) for v in batch):  # the C++ scan's sums: one small tensor
        scalars += torch.tensor(batch, dtype=torch.float64, device=conf.device)
    else:  # 0-d device tensors (no host sync)
        scalars += torch.stack([torch.as_tensor(v, dtype=torch.float64, device=conf.device) for v in batch])
    if vec is not None:  # decompositions: from the C++ scan's pass, else by torch ops on the scan's bins
        vec += (
            scan.vectors
            if scan.vectors is not None
            else top_bin_vector_sums(probs, targets, conf, n_bins, scan.bins)
        )
    rank = None
    if score in ("max_logit", "energy"):
        rank = S.confidence_score(probs_or_logits, score=score, from_logits=True).to(probs.device)
    elif score != "max_prob":  # ``probs`` were validated in their own dtype (a float16 batch is upcast)
        rank = S.confidence_from_probs(probs, score)
    return sums, conf, correct, rank


# Metrics from the constant-size sums: equal-width top-label and classwise bins, per-sample sums
BINNED_METRICS = (
    "ece", "mce", "classwise_ece", "nll", "brier", "rbs", "error", "s99_fraction", "s99_accuracy",
    "signed_ece", "ece_over", "ece_under",
)  # fmt: skip
# From the per-bin vector sums (``decompositions``), grouped by the equal-width top-label bins
DECOMPOSITION_METRICS = (
    "brier_reliability", "brier_resolution", "brier_uncertainty", "brier_within_variance",
    "brier_within_covariance", "log_reliability", "log_resolution", "log_uncertainty", "log_within",
)  # fmt: skip
# From every sample's (confidence, correctness[, ranking score]) (``equal_mass``)
ROW_METRICS = (
    "adaece", "debiased_ece", "ece_sweep", "smece", "adaece_over", "adaece_under", "ks", "kuiper", "aurc",
    "augrc",
)  # fmt: skip
METRICS = BINNED_METRICS + DECOMPOSITION_METRICS + ROW_METRICS


def results(sums, rows, num_classes, n_bins, names=None, decompositions=False) -> dict[str, torch.Tensor]:
    """The metrics of a state: flat ``sums`` and, for the row metrics, ``rows`` = (confidences, correctness,
    ranking scores or None for the confidence) as tensors or lists of batch tensors (None: not kept)."""
    top, cw, scalars, vec = state_views(sums, num_classes, n_bins, decompositions)
    n = scalars[0]
    if names is not None:
        unknown = set(names) - set(METRICS)
        if unknown:
            raise ValueError(f"`names` has unknown metrics {sorted(unknown)}; choose from {list(METRICS)}")
        if vec is None and set(names) & set(DECOMPOSITION_METRICS):
            raise ValueError(
                f"{sorted(set(names) & set(DECOMPOSITION_METRICS))} need the per-bin vector sums: build the "
                "accumulator with decompositions=True"
            )
        if rows is None and set(names) & set(ROW_METRICS):
            raise ValueError(
                f"{sorted(set(names) & set(ROW_METRICS))} need every sample's row: build the accumulator with "
                "equal_mass=True"
            )
    if float(n) == 0:
        raise RuntimeError("CalibrationMetrics.compute() called before any update()")
    wanted = set(METRICS if names is None else names)
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=n.device)
    direction = D.direction_from_sums(top[0], top[1], top[2])
    out = {
        "ece": C.ece_from_sums(top[0], top[1], top[2]),
        "mce": C.mce_from_sums(top[0], top[1], top[2]),
        "classwise_ece": C.classwise_from_sums(cw[0], cw[1], n),
        "nll": scalars[1] / n,
        "brier": scalars[2] / n,
        "rbs": (scalars[2] / n).clamp(min=0).sqrt(),  # root Brier score, from the same sums
        "error": 1 - scalars[3] / n,
        "s99_fraction": scalars[4] / n,
        "s99_accuracy": scalars[5] / scalars[4] if float(scalars[4]) > 0 else nan,
        "signed_ece": direction.signed,
        "ece_over": direction.over,
        "ece_under": direction.under,
    }
    if vec is not None and wanted & set(DECOMPOSITION_METRICS):
        out.update(_decomposition_terms(top[0], vec, scalars, n))
    if rows is not None and wanted & set(ROW_METRICS):
        out.update(_row_metrics(rows, n_bins, wanted))
    return {k: v for k, v in out.items() if k in wanted}


def _decomposition_terms(count, vec, scalars, n) -> dict[str, torch.Tensor]:
    """The Brier and log-score terms of SPEC §9.3 grouped by the top-label bins, from per-bin counts and
    vector sums and the totals Σ‖P‖² (from the Brier sum), Σ p_y and Σ −log p_y."""
    p_sum, y_sum = vec[0], vec[1]
    safe = count.clamp(min=1)[:, None]
    f_bar, y_bar_g, w = p_sum / safe, y_sum / safe, count / n
    y_bar = y_sum.sum(0) / n
    p_true = scalars[6]
    sum_sq = scalars[2] + 2 * p_true - n  # Σ_i ‖P_i‖² = Σ_i (‖P_i − Y_i‖² + 2 p_y − 1)
    neg_ent_g = torch.special.xlogy(y_bar_g, y_bar_g).sum(1)
    cross_g = torch.special.xlogy(y_bar_g, f_bar).sum(1)  # Σ_k ȳ_gk log f̄_gk
    return {
        "brier_reliability": (w * ((f_bar - y_bar_g) ** 2).sum(1)).sum(),
        "brier_resolution": (w * ((y_bar_g - y_bar) ** 2).sum(1)).sum(),
        "brier_uncertainty": 1 - (y_bar**2).sum(),
        "brier_within_variance": (sum_sq - (count[:, None] * f_bar * f_bar).sum()) / n,
        "brier_within_covariance": (p_true - (count[:, None] * f_bar * y_bar_g).sum()) / n,
        "log_reliability": (w * (neg_ent_g - cross_g)).sum(),
        "log_resolution": (w * (neg_ent_g - torch.special.xlogy(y_bar_g, y_bar).sum(1))).sum(),
        "log_uncertainty": -torch.special.xlogy(y_bar, y_bar).sum(),
        "log_within": scalars[1] / n + (w * cross_g).sum(),
    }


def _row_metrics(rows, n_bins, wanted) -> dict[str, torch.Tensor]:
    """The row metrics in ``wanted`` from (confidences, correctness, ranking scores or None)."""
    conf, correct, rank = (
        r if r is None or isinstance(r, torch.Tensor) else torch.cat(list(r)) for r in rows
    )
    if conf is None or correct is None:
        raise RuntimeError("the row metrics need the confidences and the correctness of every sample")
    correct = correct.bool()
    conf_s, corr_s = C.sorted_by_confidence(conf, correct)
    out = {}
    sorted_metrics = {"adaece", "debiased_ece", "ece_sweep", "adaece_over", "adaece_under"}
    prefix = prefix_sums(conf_s, corr_s) if wanted & sorted_metrics else None
    if "adaece" in wanted:
        out["adaece"] = C.adaece_from_sorted(conf_s, corr_s, n_bins, prefix)
    if "debiased_ece" in wanted:
        out["debiased_ece"] = C.debiased_from_sorted(conf_s, corr_s, n_bins, prefix)
    if "ece_sweep" in wanted:
        out["ece_sweep"] = C.sweep_from_sorted(conf_s, corr_s, prefix=prefix)[0]
    if "smece" in wanted:
        out["smece"] = C.smooth_ece_from_conf(conf_s, corr_s)[0]
    if wanted & {"adaece_over", "adaece_under"}:
        split = D.direction_from_sums(*equal_mass_sums(conf_s, corr_s, n_bins, prefix))
        out["adaece_over"], out["adaece_under"] = split.over, split.under
    if wanted & {"ks", "kuiper"}:
        hi, lo = CU.extremes_of_sorted(conf_s, corr_s)
        out["ks"], out["kuiper"] = torch.maximum(hi, -lo), hi - lo
    if wanted & {"aurc", "augrc"}:
        curve = S._curve(conf if rank is None else rank, ~correct)
        out["aurc"], out["augrc"] = S.sample_area(curve.risk), S.sample_area(curve.generalized_risk)
    return out


# -- sigmoid outputs (binary / multi-label; SPEC §6) ---------------------------------------------------------


class MultilabelCalibrationMetrics:
    """Accumulates the multi-label (sigmoid) metrics of :mod:`torchcal.functional.binary` over batches,
    mergeable and all-reducible.

    State: per-label equal-width bin sums of p (count, p sum, positives, p², p·y), 5·L·M float64 numbers, and
    per-label sums of Brier, NLL and wrong decisions; with ``equal_mass`` (default) also every sample's
    (p, y), 16·L bytes per sample, for the equal-mass ECE, KS, Kuiper and the AUROC. ``compute()`` calls the
    one-shot functions' arithmetic, so k updates give the one-shot values up to float64 summation order.

    Example:
        >>> import torch
        >>> from torchcal.functional import multilabel_ece
        >>> g = torch.Generator().manual_seed(0)
        >>> logits, targets = torch.randn(200, 3, generator=g), torch.randint(0, 2, (200, 3), generator=g)
        >>> m = MultilabelCalibrationMetrics(num_labels=3, from_logits=True)
        >>> for i in range(0, 200, 64):
        ...     m.update(logits[i:i + 64], targets[i:i + 64])
        >>> out = m.compute()
        >>> torch.allclose(out["ece"], multilabel_ece(logits, targets, from_logits=True))
        True
    """

    def __init__(
        self, num_labels: int, n_bins: int = 15, *, from_logits: bool = False, equal_mass: bool = True
    ):
        self.num_labels = check_positive_int(num_labels, "num_labels")
        self.n_bins = check_positive_int(n_bins, "n_bins")
        self.from_logits = check_bool(from_logits, "from_logits")
        self.equal_mass = check_bool(equal_mass, "equal_mass")
        self._device = None
        self.reset()

    def reset(self) -> None:
        """Forget everything seen so far."""
        size = 5 * self.num_labels * self.n_bins + 3 * self.num_labels + 1
        self._sums = torch.zeros(size, dtype=torch.float64, device=self._device)
        self._samples: list[torch.Tensor] = []  # (B, 2, L) float64: p and y

    def _views(self):
        lm = self.num_labels * self.n_bins
        s = self._sums
        bins = s[: 5 * lm].view(5, self.num_labels, self.n_bins)  # count, Σ p, Σ y, Σ p², Σ p·y
        per_label = s[5 * lm : 5 * lm + 3 * self.num_labels].view(3, self.num_labels)  # brier, nll, wrong
        return bins, per_label[0], per_label[1], per_label[2], s[-1:]

    def update(self, probs_or_logits, targets) -> None:
        """Adds a batch: probabilities (or logits if ``from_logits``) (B, L) or (B,), targets of that shape."""
        from .functional import binary as B
        from .functional._binning import equal_width_index

        p, y = B._metric_inputs(probs_or_logits, targets, self.from_logits)
        if p.shape[1] != self.num_labels:
            raise ValueError(
                f"`probs_or_logits` has {p.shape[1]} labels, expected num_labels={self.num_labels}"
            )
        if self._device is None:
            self._device = p.device
            self._sums = self._sums.to(p.device)
        elif p.device != self._device:
            raise ValueError(f"`probs_or_logits` is on {p.device}, earlier batches were on {self._device}")
        m, labels = self.n_bins, self.num_labels
        index = (equal_width_index(p, m) + torch.arange(labels, device=p.device) * m).reshape(-1)
        bins, brier, nll, wrong, n = self._views()
        flat = (torch.bincount(index, minlength=labels * m).double(),
                torch.bincount(index, weights=p.reshape(-1), minlength=labels * m),
                torch.bincount(index, weights=y.reshape(-1), minlength=labels * m),
                torch.bincount(index, weights=(p * p).reshape(-1), minlength=labels * m),
                torch.bincount(index, weights=(p * y).reshape(-1), minlength=labels * m))  # fmt: skip
        bins += torch.stack(flat).view(5, labels, m)
        brier += ((p - y) ** 2).sum(0)
        wrong += ((p >= 0.5).double() != y).double().sum(0)
        if self.from_logits:
            z = torch.as_tensor(probs_or_logits).detach().double().reshape(p.shape)
            nll += torch.nn.functional.binary_cross_entropy_with_logits(z, y, reduction="none").sum(0)
        else:
            q = p.clamp(1e-12, 1 - 1e-12)
            nll += (-(y * q.log() + (1 - y) * (1 - q).log())).sum(0)
        n += p.shape[0]
        if self.equal_mass:
            self._samples.append(torch.stack([p, y], dim=1))

    def merge(self, other: MultilabelCalibrationMetrics) -> MultilabelCalibrationMetrics:
        """Adds the state of ``other`` (same settings) into this one; returns self."""
        if not isinstance(other, MultilabelCalibrationMetrics):
            raise TypeError(f"`other` must be a MultilabelCalibrationMetrics, got {type(other).__name__}")
        mine = (self.num_labels, self.n_bins, self.equal_mass)
        theirs = (other.num_labels, other.n_bins, other.equal_mass)
        if mine != theirs:
            raise ValueError(f"cannot merge metrics with settings {theirs} into {mine}")
        if self._device is None:
            self._device = other._device
            self._sums = self._sums.to(other._sums.device)
        self._sums += other._sums.to(self._sums.device)
        self._samples += [s.to(self._sums.device) for s in other._samples]
        return self

    def sync(self, group=None) -> MultilabelCalibrationMetrics:
        """Makes every rank hold the global state (all-reduce of the sums, all-gather of the samples)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self
        dist.all_reduce(self._sums, op=dist.ReduceOp.SUM, group=group)
        if self.equal_mass:
            empty = torch.zeros(0, 2, self.num_labels, dtype=torch.float64)
            mine = torch.cat(self._samples) if self._samples else empty
            self._samples = all_gather_rows(mine.to(self._sums.device), group)
        return self

    @property
    def num_samples(self) -> int:
        return int(self._views()[4][0])

    def compute(self) -> dict[str, torch.Tensor]:
        """ece, ece_micro, mce (macro over labels, equal-width), signed_ece, ece_over, ece_under (the direction
        of each label's ECE, and their ``_micro`` values), brier, nll, error (the share of wrong 0/1 decisions
        at p >= 0.5), the Brier decomposition of each label (:func:`label_brier_terms`: brier_reliability,
        brier_resolution, brier_uncertainty, brier_within_variance, brier_within_covariance) and, with
        ``equal_mass``, adaece, adaece_micro, ks, kuiper (``kind="binary"`` per label) and auroc (mean over
        the labels that have both classes); ``<name>_per_label`` (L,) tensors beside each macro value."""
        from .functional import binary as B
        from .functional.calibration import ece_from_sums, mce_from_sums

        bins, brier, nll, wrong, n = self._views()
        if float(n[0]) == 0:
            raise RuntimeError("MultilabelCalibrationMetrics.compute() called before any update()")
        ece = torch.stack([ece_from_sums(*bins[:3, j]) for j in range(self.num_labels)])
        mce = torch.stack([mce_from_sums(*bins[:3, j]) for j in range(self.num_labels)])
        out = {
            "ece": ece.mean(), "ece_per_label": ece, "ece_micro": ece_from_sums(*bins[:3].sum(1)),
            "mce": mce.mean(), "mce_per_label": mce,
            "brier": (brier / n).mean(), "brier_per_label": brier / n,
            "nll": (nll / n).mean(), "nll_per_label": nll / n,
            "error": (wrong / n).mean(), "error_per_label": wrong / n,
        }  # fmt: skip
        out.update(label_direction(bins[:3]))
        for name, values in label_brier_terms(bins).items():
            out[name], out[f"{name}_per_label"] = values.mean(), values
        if self.equal_mass:
            samples = torch.cat(self._samples)
            p, y = samples[:, 0], samples[:, 1]
            ada = B.multilabel_adaece(p, y, n_bins=self.n_bins, average="none")
            auroc = B.multilabel_auroc(p, y, average="none")
            hi, lo = CU.cumulative_extremes(p, y)  # per label along dim 0
            ks, kuiper = torch.maximum(hi, -lo), hi - lo
            out.update(
                {"ks": ks.mean(), "ks_per_label": ks, "kuiper": kuiper.mean(), "kuiper_per_label": kuiper}
            )
            kept = auroc[~torch.isnan(auroc)]
            out.update({
                "adaece": ada.mean(), "adaece_per_label": ada,
                "adaece_micro": B.multilabel_adaece(p, y, n_bins=self.n_bins, average="micro"),
                "auroc": kept.mean() if kept.numel() else auroc.new_tensor(float("nan")),
                "auroc_per_label": auroc,
            })  # fmt: skip
        return out


def label_direction(bins: torch.Tensor) -> dict[str, torch.Tensor]:
    """The direction of each label's equal-width ECE from its (count, p sum, positives) bin sums (3, L, M):
    ``signed_ece``, ``ece_over``, ``ece_under`` (macro means over the labels with a sample), their
    ``_per_label`` (L,) values (NaN for a label without samples) and ``_micro`` values (every (sample, label)
    pair pooled). Positive signed ECE: p above the observed frequency (over-confident in the positive
    class)."""
    per_label = D.direction_from_sums(bins[0], bins[1], bins[2])
    micro = D.direction_from_sums(*bins.sum(1))
    seen = bins[0].sum(-1) > 0
    out = {}
    for name, i in (("signed_ece", 1), ("ece_over", 2), ("ece_under", 3)):
        values = torch.where(seen, per_label[i], torch.full_like(per_label[i], float("nan")))
        out[name], out[f"{name}_per_label"], out[f"{name}_micro"] = values[seen].mean(), values, micro[i]
    return out


def label_brier_terms(bins: torch.Tensor) -> dict[str, torch.Tensor]:
    """Murphy's decomposition of each label's Brier score ``(1/N) Σ_i (p_i − y_i)²``, grouped by the label's
    equal-width bins of p, from the bin sums (count, Σ p, Σ y, Σ p², Σ p·y) (5, L, M): ``REL = Σ_b n_b
    (p̄_b − ȳ_b)²/N``, ``RES = Σ_b n_b (ȳ_b − ȳ)²/N``, ``UNC = ȳ(1 − ȳ)``, ``WBV = (Σ p² − Σ_b n_b p̄_b²)/N``,
    ``WBC = (Σ p·y − Σ_b n_b p̄_b ȳ_b)/N``, and ``BS = REL − RES + UNC + WBV − 2·WBC`` exactly. (L,) float64
    each; NaN for a label without samples."""
    count, p_sum, y_sum, sq_sum, py_sum = bins
    n = count.sum(-1)
    safe_n = n.clamp(min=1)
    safe = count.clamp(min=1)
    p_bar, y_bar_b = p_sum / safe, y_sum / safe
    y_bar = (y_sum.sum(-1) / safe_n)[:, None]
    terms = {
        "brier_reliability": (count * (p_bar - y_bar_b) ** 2).sum(-1) / safe_n,
        "brier_resolution": (count * (y_bar_b - y_bar) ** 2).sum(-1) / safe_n,
        "brier_uncertainty": (y_bar * (1 - y_bar)).squeeze(-1),
        "brier_within_variance": (sq_sum.sum(-1) - (count * p_bar * p_bar).sum(-1)) / safe_n,
        "brier_within_covariance": (py_sum.sum(-1) - (count * p_bar * y_bar_b).sum(-1)) / safe_n,
    }
    nan = torch.full_like(n, float("nan"))
    return {k: torch.where(n > 0, v, nan) for k, v in terms.items()}
