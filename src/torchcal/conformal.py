"""Split-conformal prediction sets on (calibrated) logits: THR/LAC, APS and RAPS, marginal or class-
conditional (Mondrian). The scores, the quantile and the set metrics are in
:mod:`torchcal.functional.conformal`; SPEC §9.7 states every convention."""

from __future__ import annotations

import torch

from ._namespace import only_public as _only_public
from ._validation import as_data, check_bool, check_choice, check_float, check_positive_int
from .functional._field_inputs import field_inputs
from .functional._inputs import in_input_dtype
from .functional.conformal import CONFORMAL_SCORES, conformal_quantile, conformal_scores

__all__ = ["SplitConformalClassifier", "tune_raps"]


class SplitConformalClassifier:
    """Split-conformal classifier: ``fit(cal_logits, targets, alpha)`` finds the threshold q̂ on a
    calibration set, ``predict_sets(logits)`` returns the boolean (N, K) mask of the sets
    ``{y : s(x, y) ≤ q̂}`` (``q̂_y`` with ``mondrian=True``).

    Marginal guarantee: on exchangeable calibration and test data, ``P(y ∈ C(x)) ≥ 1 − α`` (and
    ``≤ 1 − α + 1/(n+1)`` for continuous scores, randomized APS/RAPS); with ``mondrian`` it holds within
    each class. The quantile keeps every calibration score (a stream of calibration batches is concatenated
    before ``fit``).

    Args:
        score: ``"lac"`` (THR, 1 − π_y), ``"aps"`` or ``"raps"``.
        randomized: APS/RAPS with the randomized score ``C(x, y) − U·π_y``, one ``U ~ U(0, 1)`` per sample,
            at calibration and at prediction (``False``: ``C(x, y)``). Both can give empty sets: a sample
            whose top probability exceeds q̂ (non-randomized), or whose draw removes the top label.
        mondrian: one threshold per class (class-conditional coverage).
        lambda_: RAPS penalty λ (default 0.1). k_reg: RAPS rank from which the penalty applies (default 1).
        from_logits: inputs are logits (softmax applied); ``False`` for probabilities.
        seed: seed of the ``torch.Generator`` that draws the uniforms (``fit`` restarts it).

    Attributes (after ``fit``): ``qhat_`` (0-d, or (K,) with ``mondrian``), ``alpha_``, ``n_``,
    ``num_classes_``.

    References:
        Sadinle, Lei & Wasserman 2019 (LAC); Romano, Sesia & Candès 2020 (APS); Angelopoulos, Bates, Malik &
        Jordan 2021 (RAPS); Vovk 2012 (Mondrian).

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> logits = 2 * torch.randn(2000, 5, generator=g)
        >>> targets = torch.multinomial(torch.softmax(logits, 1), 1, generator=g).squeeze(1)
        >>> cp = SplitConformalClassifier("aps").fit(logits[:1000], targets[:1000], alpha=0.1)
        >>> sets = cp.predict_sets(logits[1000:])
        >>> sets.dtype, sets.shape
        (torch.bool, torch.Size([1000, 5]))
        >>> from torchcal.functional.conformal import set_coverage
        >>> 0.87 < float(set_coverage(sets, targets[1000:])) < 0.93
        True
    """

    def __init__(
        self,
        score: str = "aps",
        *,
        randomized: bool = True,
        mondrian: bool = False,
        lambda_: float = 0.1,
        k_reg: int = 1,
        from_logits: bool = True,
        seed: int = 0,
    ):
        self.score = score
        self.randomized = randomized
        self.mondrian = mondrian
        self.lambda_ = lambda_
        self.k_reg = k_reg
        self.from_logits = from_logits
        self.seed = seed

    def _check_params(self):
        check_choice(self.score, "score", set(CONFORMAL_SCORES))
        check_bool(self.randomized, "randomized")
        check_bool(self.mondrian, "mondrian")
        check_float(self.lambda_, "lambda_", low=0)
        check_positive_int(self.k_reg, "k_reg", minimum=0)
        check_bool(self.from_logits, "from_logits")
        check_positive_int(self.seed, "seed", minimum=0)

    def _uniforms(self, n, device, u, randomized):
        if self.score == "lac" or not randomized:
            return None
        if u is None:
            return torch.rand(n, generator=self._generator, dtype=torch.float64).to(device)
        u = as_data(u, "u").double().to(device)
        if u.shape != (n,):
            raise ValueError(f"`u` must have shape ({n},), got {tuple(u.shape)}")
        inside = (u >= 0) & (u <= 1)  # NaN fails both comparisons
        if not bool(inside.all()):
            raise ValueError(f"`u` must hold uniforms in [0, 1], found {float(u[~inside][0])}")
        return u

    def _scores(self, probs, u):
        return conformal_scores(probs, self.score, u=u, lambda_=self.lambda_, k_reg=self.k_reg)

    def fit(self, cal_logits, targets, alpha: float = 0.1, *, u=None) -> SplitConformalClassifier:
        """Calibrates the threshold on ``cal_logits`` (N, K) and ``targets`` (N,) for miscoverage ``alpha``
        in (0, 1). ``u``: the (N,) calibration uniforms of the randomized scores (default: drawn from
        ``seed``). Too few samples for ``alpha`` give q̂ = +inf with a warning. Returns self."""
        self._check_params()
        self.alpha_ = check_float(alpha, "alpha", low=0, high=1, low_open=True, high_open=True)
        probs, targets = field_inputs(cal_logits, targets, self.from_logits, "cal_logits")
        self._generator = torch.Generator().manual_seed(self.seed)
        n, k = probs.shape
        u = self._uniforms(n, probs.device, u, self.randomized)
        true_scores = self._scores(probs, u).gather(1, targets[:, None]).squeeze(1)
        if self.mondrian:
            self.qhat_ = torch.stack(
                [conformal_quantile(true_scores[targets == c], self.alpha_) for c in range(k)]
            )
        else:
            self.qhat_ = conformal_quantile(true_scores, self.alpha_)
        self.n_, self.num_classes_ = n, k
        return self

    def predict_sets(self, logits, *, u=None, randomized: bool | None = None) -> torch.Tensor:
        """Boolean (N, K) prediction sets for ``logits`` (probabilities with ``from_logits=False``).
        ``u``: the (N,) uniforms (default: the next draws of the fitted generator); ``randomized``
        overrides the setting for this call (e.g. a non-randomized set with a threshold calibrated on the
        randomized score, as MAPIE's ``include_last_label=False``)."""
        if not hasattr(self, "qhat_"):
            raise RuntimeError("SplitConformalClassifier.predict_sets() called before fit()")
        randomized = self.randomized if randomized is None else check_bool(randomized, "randomized")
        probs, _ = field_inputs(
            logits, torch.zeros(_rows(logits), dtype=torch.long), self.from_logits, "logits", allow_empty=True
        )
        if probs.shape[1] != self.num_classes_:
            raise ValueError(f"`logits` has {probs.shape[1]} classes, the fit had {self.num_classes_}")
        scores = self._scores(probs, self._uniforms(probs.shape[0], probs.device, u, randomized))
        qhat = self.qhat_.to(scores.device, torch.float64)
        return scores <= (qhat if qhat.ndim == 0 else qhat[None, :])


def _rows(x) -> int:
    return int(as_data(x, "logits").shape[0])


def tune_raps(
    logits,
    targets,
    alpha: float = 0.1,
    *,
    lambdas=(0.001, 0.01, 0.1, 0.2, 0.5),
    randomized: bool = True,
    from_logits: bool = True,
    seed: int = 0,
) -> tuple[float, int]:
    """RAPS's ``(lambda_, k_reg)`` tuned on a held-out tuning split (Angelopoulos et al. 2021, their
    ``pick_kreg`` and ``pick_lamda_size``): ``k_reg`` = the ⌈(1−α)⌉ "higher" quantile of the 0-based rank of
    the true label, plus 1; ``lambda_`` the value of ``lambdas`` whose sets, calibrated and measured on the
    same tuning data, are smallest on average (ties: the first). Use data apart from the calibration set.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> logits = 2 * torch.randn(500, 10, generator=g)
        >>> targets = torch.multinomial(torch.softmax(logits, 1), 1, generator=g).squeeze(1)
        >>> lam, k = tune_raps(logits, targets, 0.1)
        >>> lam in (0.001, 0.01, 0.1, 0.2, 0.5), 1 <= k <= 10
        (True, True)
    """
    alpha = check_float(alpha, "alpha", low=0, high=1, low_open=True, high_open=True)
    lambdas = tuple(lambdas)
    if not lambdas:
        raise ValueError("`lambdas` must hold at least one value to choose from, got none")
    logits = as_data(logits, "logits")
    probs, targets = field_inputs(logits, targets, from_logits, "logits", allow_empty=False)
    order = torch.sort(probs, dim=1, descending=True, stable=True).indices
    rank0 = (order == targets[:, None]).double().argmax(1).double()  # 0-based rank of the true label
    k_reg = int(torch.quantile(rank0, 1 - alpha, interpolation="higher")) + 1
    probs = in_input_dtype(probs, logits.dtype, from_logits)  # ``fit`` validates it again
    best, best_size = None, None
    for lam in lambdas:
        cp = SplitConformalClassifier(
            "raps", randomized=randomized, lambda_=float(lam), k_reg=k_reg, from_logits=False, seed=seed
        )
        size = float(cp.fit(probs, targets, alpha).predict_sets(probs).sum(1).double().mean())
        if best_size is None or size < best_size:
            best, best_size = float(lam), size
    assert best is not None  # lambdas is not empty
    return best, k_reg


_only_public(__name__)
