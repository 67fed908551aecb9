"""Temperature scaling, focal temperature scaling and ensemble temperature scaling (SPEC §4)."""

from __future__ import annotations

import itertools
import math
import warnings

import torch

from .._validation import check_bool, check_choice, check_float, check_positive_int
from ..functional import calibration as C
from ..functional._binning import bin_sums, equal_mass_group_index, equal_width_index
from ..functional.focal_map import _focal_ratio
from .base import Calibrator

__all__ = [
    "TemperatureScaling",
    "FocalTemperatureScaling",
    "EnsembleTemperatureScaling",
    "fit_temperature_nll",
    "PAPER_TEMPERATURE_GRID",
    "FTS_GAMMA_GRID",
    "FTS_TEMPERATURE_GRID",
    "SEARCH_LIMITS",
    "GAMMA_LIMITS",
]

#: T = 0.1, 0.2, ..., 10.0: the grid of Mukhoti et al. / Ghosh et al. for ECE-tuned temperature scaling.
PAPER_TEMPERATURE_GRID = tuple(round(0.1 * i, 1) for i in range(1, 101))
#: Komisarenko & Kull 2024's γ grid for focal temperature scaling.
FTS_GAMMA_GRID = (-0.5, -0.25, 0.05, 0.25, 0.37, 0.5, 0.75, 1.0, 5.0)
#: T = 0.01, 0.02, ..., 5.00.
FTS_TEMPERATURE_GRID = tuple(round(0.01 * i, 2) for i in range(1, 501))
#: The widest temperatures a grid search goes to when its minimiser lies on an edge of its grid.
SEARCH_LIMITS = (1e-3, 1e3)
#: The widest γ focal temperature scaling goes to (the focal map needs γ > −1; (1 − q)^−γ stays finite in
#: float32 for q <= 1/2 up to γ = 127).
GAMMA_LIMITS = (-0.99, 50.0)
_PER_DECADE = 20  # log-spaced points per decade beyond a grid's edge (T × 1.122 apart)
_REFINE_POINTS = 40  # at most this many points of the grid's own step around a minimiser found beyond it


def _first_minimum(columns: list[torch.Tensor]) -> tuple[int, int]:
    """(row, column) of the first minimum of the (G, len(columns)) scores in (row, column) order."""
    flat = torch.stack(columns, 1).reshape(-1)
    best = int(torch.nonzero(flat == flat.min())[0])
    return best // len(columns), best % len(columns)


def _search_temperature(score_at, grid, extend: bool):
    """Grid search over T whose minimiser is never silently an edge of the grid (decision 81).

    ``score_at(t)`` gives the (G,) objective values at T = t (one per γ of focal temperature scaling, G = 1
    for temperature scaling); the first minimiser in (γ, T) order wins, so the grid's own points win ties.
    The grid is evaluated first. With ``extend``, while the minimiser is the grid's largest (smallest) T the
    search goes on beyond it on a log-spaced grid (20 points per decade) one decade at a time, up to
    :data:`SEARCH_LIMITS`; a minimiser found there is then refined with the grid's own step (at most 40
    points) between its log-spaced neighbours. Returns (γ index, T, value, the (G, T) scores, the T
    evaluated)."""
    temps = list(grid)
    columns = [score_at(t) for t in temps]
    lo, hi = min(temps), max(temps)
    ordered = sorted(set(temps))
    step = min((b - a for a, b in zip(ordered, ordered[1:], strict=False)), default=None)
    if extend:
        ratio = 10 ** (1 / _PER_DECADE)
        beyond = False
        for direction in (1, -1):
            edge = hi if direction == 1 else lo
            limit = SEARCH_LIMITS[1] if direction == 1 else SEARCH_LIMITS[0]
            while temps[_first_minimum(columns)[1]] == edge and (
                edge < limit if direction == 1 else edge > limit
            ):
                for i in range(1, _PER_DECADE + 1):
                    t = float(f"{edge * ratio ** (direction * i):.12g}")  # 100, not 99.99999999999984
                    if (t - limit) * direction > -1e-9 * limit:  # at or (to rounding) beyond the limit
                        t = limit
                    temps.append(t)
                    columns.append(score_at(t))
                    if t == limit:
                        break
                edge, beyond = temps[-1], True
        if beyond:
            best_t = temps[_first_minimum(columns)[1]]
            if best_t not in grid and best_t not in SEARCH_LIMITS:
                left = max(best_t / ratio, SEARCH_LIMITS[0])
                right = min(best_t * ratio, SEARCH_LIMITS[1])
                width = max(step or 0.0, (right - left) / _REFINE_POINTS)
                for i in range(math.floor(left / width) + 1, math.ceil(right / width)):
                    t = round(i * width, 12)  # multiples of the grid's step: 12.1, not 12.0999...
                    if all(abs(t - u) > 1e-12 * t for u in temps):
                        temps.append(t)
                        columns.append(score_at(t))
    row, col = _first_minimum(columns)
    return row, temps[col], float(columns[col][row]), columns, temps


def _search_notes(what, name, chosen, grid, searched, limits, extend) -> tuple[dict, list[str]]:
    """The record of a grid search of parameter ``name`` (the grid, the range searched, the value chosen)
    and its warnings: the grid was left, a limit was hit, or (``extend=False``) an edge was chosen."""
    lo, hi = min(grid), max(grid)
    record = {"grid": [lo, hi], "searched": [min(searched), max(searched)], "chosen": chosen}
    notes = []
    if chosen in limits:
        notes.append(f"{what} hit the bound {name} = {chosen:g} of its search ({name} in [{limits[0]:g}, "
                     f"{limits[1]:g}]): the optimum lies outside it")  # fmt: skip
    elif extend and not lo <= chosen <= hi:
        notes.append(f"{what} left its grid {name} in [{lo:g}, {hi:g}]: the minimiser lies beyond it, at "
                     f"{name} = {chosen:.4g} (searched {name} in [{min(searched):.4g}, {max(searched):.4g}])")  # fmt: skip
    elif not extend and chosen in (lo, hi) and lo != hi:
        notes.append(f"{what} chose {name} = {chosen:g}, an edge of its grid {name} in [{lo:g}, {hi:g}]: the "
                     "optimum may lie beyond it (extend=True searches further)")  # fmt: skip
    return record, notes


def _nll_slope(z, z_true, beta, scratch):
    """First and second derivative of mean NLL(softmax(β z)) with respect to β, for row-centred z (max 0).

    d/dβ = mean_i (E_p[z_i] − z_{i,y}) and d²/dβ² = mean_i Var_p[z_i]. Rows are processed in chunks through
    a small cache-resident scratch buffer; since β z <= 0, exp needs no shift, and arguments are clamped at
    log(tiny) so exp never produces (slow) subnormals (terms below 1e-38 change no sum).
    """
    n = z.shape[0]
    rows = scratch.shape[1]
    floor = math.log(torch.finfo(z.dtype).tiny)
    grad = torch.zeros((), dtype=torch.float64, device=z.device)
    curv = torch.zeros((), dtype=torch.float64, device=z.device)
    for s in range(0, n, rows):
        m = min(rows, n - s)
        zc = z[s : s + m]
        w, wz = scratch[0, :m], scratch[1, :m]
        torch.mul(zc, beta, out=w).clamp_(min=floor).exp_()
        s0 = w.sum(1)
        torch.mul(w, zc, out=wz)
        s1 = wz.sum(1)
        s2 = wz.mul_(zc).sum(1)
        ez = s1 / s0
        grad += (ez - z_true[s : s + m]).sum(dtype=torch.float64)
        curv += (s2 / s0 - ez * ez).sum(dtype=torch.float64)
    return float(grad) / n, float(curv) / n


def fit_temperature_nll(logits, targets, bounds=(0.01, 100.0), tol: float = 1e-10, max_iter: int = 200):
    """Temperature minimising validation NLL of softmax(z/T), bounded, deterministic.

    NLL is convex in β = 1/T, so its β-derivative is increasing; we find its root by Newton's method
    safeguarded by a bracket (a Newton step that leaves the bracket is replaced by a geometric bisection).
    Each step costs one pass of softmax over the logits. If the optimum lies outside ``bounds`` the nearest
    bound is returned with a warning (e.g. separable data, where NLL keeps falling as T → 0).

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(3000, 3, generator=g)
        >>> y = torch.multinomial(torch.softmax(2 * z, 1), 1, generator=g).squeeze(1)
        >>> round(fit_temperature_nll(4 * z, y), 2)  # 4z is twice as sharp as the model the labels came from
        1.97
    """
    t_lo, t_hi = bounds
    z = logits - logits.max(dim=1, keepdim=True).values
    z_true = z.gather(1, targets[:, None]).squeeze(1)
    lo, hi = 1.0 / t_hi, 1.0 / t_lo
    beta = min(max(1.0, lo), hi)
    rows = min(z.shape[0], max(1, (1 << 16) // z.shape[1]))
    scratch = torch.empty(2, rows, z.shape[1], dtype=z.dtype, device=z.device)
    # the slope is a mean of terms of size |z|, each rounded in z's dtype: below this it is noise, and
    # Newton steps would wander around the root (float32 at K = 1000: ±5e-7, a dozen wasted passes)
    noise = 16 * torch.finfo(z.dtype).eps * (float(z_true.abs().mean()) + 1.0)
    signs = set()
    for _ in range(max_iter):
        grad, curv = _nll_slope(z, z_true, beta, scratch)
        if abs(grad) <= noise and len(signs) == 2:  # only once a root is bracketed (not on a bound's way)
            break
        if grad > 0:
            hi = beta
            signs.add(1)
        elif grad < 0:
            lo = beta
            signs.add(-1)
        else:
            break
        step = beta - grad / curv if curv > 0 else math.nan
        new = step if lo < step < hi else math.sqrt(lo * hi)
        if abs(new - beta) <= tol * beta or hi / lo - 1 <= tol:
            beta = new
            break
        beta = new
    if beta >= (1 - 1e-6) / t_lo or beta <= (1 + 1e-6) / t_hi:
        warnings.warn(
            f"temperature scaling hit the bound T in {bounds}: the NLL optimum lies outside it", stacklevel=3
        )
    return 1.0 / beta


def _top_conf_at(z_centered, temperature):
    """Top-label confidence of softmax(z / T) for row-centred logits (max = 0): 1 / Σ exp(z/T)."""
    return torch.exp(-torch.logsumexp(z_centered / temperature, dim=1))


class TemperatureScaling(Calibrator):
    """Temperature scaling: ``softmax(z / T)`` with one learned ``temperature_`` (Guo et al. 2017).

    Args:
        objective: ``"nll"`` minimises validation NLL over T by a safeguarded Newton method on 1/T (see
            :func:`fit_temperature_nll`); ``"ece"`` / ``"adaece"`` follow the papers: evaluate T on ``grid``
            (default 0.1, 0.2, ..., 10.0) and keep the first minimiser of validation ECE / AdaECE.
        n_bins: bins of the ECE objectives.
        grid: temperatures tried by the ECE objectives.
        bounds: (T_min, T_max) for the NLL objective.
        extend: ECE objectives: when the minimiser is the grid's largest (smallest) T, search on beyond it,
            log-spaced, up to T = 1000 (down to 0.001), and refine what is found there with the grid's step
            (decision 81). Leaving the grid, or hitting a limit, gives a warning, and ``search_`` records the
            grid, the range searched and the T chosen. ``False``: the grid only (a minimiser on its edge
            gives a warning).

    Never changes the argmax (T > 0 rescales all logits of a row equally).

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> true_logits = 2 * torch.randn(4000, 5, generator=g)
        >>> targets = torch.multinomial(torch.softmax(true_logits, 1), 1, generator=g).squeeze(1)
        >>> ts = TemperatureScaling().fit(3.0 * true_logits, targets)   # over-confident by a factor 3
        >>> round(ts.temperature_, 1)
        3.0
        >>> ts.transform(3.0 * true_logits[:1]).sum().item()
        1.0
    """

    name = "temperature_scaling"
    fitted_attributes = ("temperature_",)
    optional_fitted_attributes = ("search_",)  # set by the grid objectives

    def __init__(
        self,
        objective: str = "nll",
        n_bins: int = 15,
        grid=PAPER_TEMPERATURE_GRID,
        bounds=(0.01, 100.0),
        extend: bool = True,
    ):
        self.objective = objective
        self.n_bins = n_bins
        self.grid = grid
        self.bounds = bounds
        self.extend = extend

    def check_params(self) -> TemperatureScaling:
        check_choice(self.objective, "objective", {"nll", "ece", "adaece"})
        if self.objective == "nll":
            lo = check_float(self.bounds[0], "bounds[0]", low=0, low_open=True)
            check_float(self.bounds[1], "bounds[1]", low=lo, low_open=True)
            return self
        check_positive_int(self.n_bins, "n_bins")
        if not [check_float(t, "grid", low=0, low_open=True) for t in self.grid]:
            raise ValueError("`grid` must hold at least one temperature")
        check_bool(self.extend, "extend")
        return self

    def _fit(self, logits, targets):
        check_choice(self.objective, "objective", {"nll", "ece", "adaece"})
        if self.objective == "nll":
            lo = check_float(self.bounds[0], "bounds[0]", low=0, low_open=True)
            hi = check_float(self.bounds[1], "bounds[1]", low=lo, low_open=True)
            self.temperature_ = fit_temperature_nll(logits, targets, (lo, hi))
            return
        n_bins = check_positive_int(self.n_bins, "n_bins")
        grid = [check_float(t, "grid", low=0, low_open=True) for t in self.grid]
        if not grid:
            raise ValueError("`grid` must hold at least one temperature")
        extend = check_bool(self.extend, "extend")
        z = logits - logits.max(dim=1, keepdim=True).values
        correct = z.argmax(1) == targets

        def score_at(t):
            conf = _top_conf_at(z, t)
            if self.objective == "ece":
                value = C.ece_from_sums(*bin_sums(equal_width_index(conf, n_bins), n_bins, conf, correct))
            else:
                value = C.adaece_from_sorted(*C.sorted_by_confidence(conf, correct), n_bins)
            return torch.tensor([float(value)], dtype=torch.float64)

        _, t, _, _, searched = _search_temperature(score_at, grid, extend)
        self.temperature_ = float(t)  # the first minimiser
        what = f"temperature scaling (objective={self.objective!r})"
        record, notes = _search_notes(what, "T", t, grid, searched, SEARCH_LIMITS, extend)
        self.search_ = {"T": record}
        for note in notes:
            warnings.warn(note, UserWarning, stacklevel=3)

    def transform_logits(self, logits) -> torch.Tensor:
        """Calibrated logits z / T."""
        self._check_fitted()
        return self._check_input(logits) / self.temperature_

    def _transform(self, logits):
        return torch.softmax(logits / self.temperature_, dim=1)


class _FocalObjective:
    """The validation objective of :class:`FocalTemperatureScaling` at one temperature for every γ of
    ``gammas`` (then of :meth:`use_gammas`): ``objective(t)`` is the (G,) float64 tensor of ``"adaece"``
    (equal-mass ECE, ``n_bins`` bins) or ``"nll"`` values of focal_map_γ(softmax(logits / t)), computed in
    the logits' dtype. For each T, the γ-independent parts of the map are computed once and all γ are mapped
    in one batched tensor operation; the work buffers are reused from one T to the next."""

    def __init__(self, logits: torch.Tensor, targets: torch.Tensor, gammas, objective: str, n_bins: int):
        n, k = logits.shape
        self.n, self.k, self.objective, self.n_bins = n, k, objective, n_bins
        self.dev, self.dtype = logits.device, logits.dtype
        self.group = equal_mass_group_index(n, n_bins, self.dev)
        self.targets = targets
        self.centred = logits - logits.max(dim=1, keepdim=True).values
        self.pred = self.centred.argmax(dim=1)  # the focal map preserves the argmax for gamma > -1
        self.correct_pred = (self.pred == targets).double()
        self.top_mask = torch.nn.functional.one_hot(self.pred, k).bool()
        # log-probabilities are clamped at floor (q >= ~3e-35 in float32): exp() takes a slow path (10-30x)
        # whenever its result would be subnormal, and no sum changes by a term that small.
        self.floor = math.log(torch.finfo(self.dtype).tiny) + 8
        # (N, K) work buffers as well: fresh multi-megabyte tensors cost page faults on every T.
        self.log_q, self.q, self.l1, self.a, self.tmp = (
            torch.empty(n, k, dtype=self.dtype, device=self.dev) for _ in range(5)
        )
        self.use_gammas(gammas)

    def use_gammas(self, values) -> None:
        """The γ values mapped at each T from now on."""
        self.n_g = len(values)
        self.g = torch.tensor(values, dtype=self.dtype, device=self.dev)
        self.g3 = self.g[:, None, None]
        self.flat_group = (
            torch.arange(self.n_g, device=self.dev)[:, None] * self.n_bins + self.group
        ).reshape(-1)
        # Two (G, N, K) work buffers reused for every T: allocation, not arithmetic, dominates otherwise.
        self.num = torch.empty(self.n_g, self.n, self.k, dtype=self.dtype, device=self.dev)
        self.den = torch.empty_like(self.num)

    def __call__(self, t) -> torch.Tensor:  # (G,) objective values at T = t
        n, n_g, g, g3, floor = self.n, self.n_g, self.g, self.g3, self.floor
        log_q, q, l1, a, tmp, num, den = self.log_q, self.q, self.l1, self.a, self.tmp, self.num, self.den
        targets, pred, dev = self.targets, self.pred, self.dev
        torch.div(self.centred, t, out=log_q)  # row max is 0, so log Σ exp needs no shift
        true_lq = log_q.gather(1, targets[:, None]).squeeze(1)
        # The NLL objective uses the exact true-class log-probability below, never a clamped one.
        log_q.clamp_(min=floor)
        lse = torch.exp(log_q, out=q).sum(1).log_()
        log_q.sub_(lse[:, None])
        true_lq = true_lq - lse
        top_lq = log_q.gather(1, pred[:, None]).squeeze(1)
        # Non-top entries (q <= 1/2) in linear space; the top entry is masked to q = tiny (adds ~0).
        log_q.masked_fill_(self.top_mask, floor).clamp_(min=floor)
        torch.exp(log_q, out=q)
        torch.neg(q, out=l1).log1p_()  # log(1 − q)
        torch.mul(q, log_q, out=a).div_(torch.sub(q, 1, out=tmp))  # a = q (−ln q)/(1 − q)
        torch.addcmul(log_q, g3, l1, value=-1, out=num).exp_()  # q (1 − q)^−γ
        torch.mul(g3, a, out=den).add_(1)  # 1 + γ a
        log_others = num.div_(den).sum(2).log_()
        # The top entry in log space, with log(1 − q_top) = log Σ of the other classes.
        l1_top = q.sum(1).log().clamp(min=floor)
        a_top = _focal_ratio(top_lq, l1_top)
        log_top = top_lq - g[:, None] * l1_top - torch.log1p(g[:, None] * a_top)  # (G, N)
        log_total = torch.logaddexp(log_top, log_others)
        if self.objective == "nll":
            q_true = true_lq.exp()
            l1_true = torch.log1p(-q_true.clamp(max=0.5))
            log_true = (
                true_lq - g[:, None] * l1_true - torch.log1p(g[:, None] * _focal_ratio(true_lq, l1_true))
            )
            log_true = torch.where((targets == pred)[None, :], log_top, log_true)
            return (log_total - log_true).double().mean(1).cpu()
        conf = torch.exp(log_top - log_total)
        conf_s, order = torch.sort(conf, dim=1, stable=True)
        corr_s = self.correct_pred.expand(n_g, n).gather(1, order)
        size = n_g * self.n_bins
        conf_sum = torch.zeros(size, dtype=torch.float64, device=dev)
        corr_sum = torch.zeros(size, dtype=torch.float64, device=dev)
        conf_sum.index_add_(0, self.flat_group, conf_s.reshape(-1).double())
        corr_sum.index_add_(0, self.flat_group, corr_s.reshape(-1))
        return ((corr_sum - conf_sum).abs().view(n_g, self.n_bins).sum(1) / n).cpu()


class FocalTemperatureScaling(Calibrator):
    """Focal temperature scaling: ``focal_map_γ(softmax(z / T))`` (Komisarenko & Kull 2024).

    The focal calibration map (:func:`torchcal.functional.focal_calibration_map`) composed with temperature
    scaling. Both parameters are chosen on the validation set by a full grid search: every γ in ``gammas``
    times every T in ``temperatures`` (defaults: the paper's 9 γ values and T = 0.01, ..., 5.00), minimising
    ``objective`` = ``"adaece"`` (equal-mass ECE, ``n_bins`` bins) or ``"nll"``. Ties go to the first pair in
    (γ, T) order. With ``extend`` (default), a minimiser on the largest (smallest) T of the grid is followed
    beyond it, log-spaced up to T = 1000 (down to 0.001), and refined with the grid's step around what is
    found there (decision 81; a 12× over-confident model needs T ≈ 12, beyond the paper's 5). A γ on an
    edge of ``gammas`` is followed the same way (up to 50, down towards −1; T is searched again for the new
    γ). Leaving a grid or hitting a limit (:data:`SEARCH_LIMITS`, :data:`GAMMA_LIMITS`) gives a warning;
    ``search_`` records the grids, the ranges searched and the values chosen. For each T, the γ-independent
    parts of the map are computed once and all γ are mapped in one batched tensor operation.

    The map preserves the argmax for every γ > −1 (h is increasing on [0, 1/2] and h(q) >= h(1 − q) for
    q >= 1/2; checked numerically on a fine grid and in the tests), so the fit needs only the mapped top-label
    confidence: non-top entries (q <= 1/2) are mapped in linear space, the top entry in log space.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> logits = 3 * torch.randn(2000, 4, generator=g)
        >>> targets = torch.multinomial(torch.softmax(logits / 3, 1), 1, generator=g).squeeze(1)
        >>> fts = FocalTemperatureScaling(temperatures=[1.0, 2.0, 3.0, 4.0, 5.0]).fit(logits, targets)
        >>> fts.gamma_, fts.temperature_
        (1.0, 4.0)
    """

    name = "focal_temperature_scaling"
    fitted_attributes = ("gamma_", "temperature_", "objective_value_")
    optional_fitted_attributes = ("search_",)  # a state saved without the grid record still loads

    def __init__(
        self,
        gammas=FTS_GAMMA_GRID,
        temperatures=FTS_TEMPERATURE_GRID,
        objective: str = "adaece",
        n_bins: int = 15,
        extend: bool = True,
    ):
        self.gammas = gammas
        self.temperatures = temperatures
        self.objective = objective
        self.n_bins = n_bins
        self.extend = extend

    def check_params(self) -> FocalTemperatureScaling:
        check_choice(self.objective, "objective", {"adaece", "nll"})
        check_positive_int(self.n_bins, "n_bins")
        gammas = [check_float(g, "gammas", low=-1, low_open=True) for g in self.gammas]
        temps = [check_float(t, "temperatures", low=0, low_open=True) for t in self.temperatures]
        if not gammas or not temps:
            raise ValueError("`gammas` and `temperatures` must each hold at least one value")
        check_bool(self.extend, "extend")
        return self

    def _fit(self, logits, targets):
        check_choice(self.objective, "objective", {"adaece", "nll"})
        n_bins = check_positive_int(self.n_bins, "n_bins")
        gammas = [check_float(g, "gammas", low=-1, low_open=True) for g in self.gammas]
        temps = [check_float(t, "temperatures", low=0, low_open=True) for t in self.temperatures]
        if not gammas or not temps:
            raise ValueError("`gammas` and `temperatures` must each hold at least one value")
        extend = check_bool(self.extend, "extend")
        searched_g = list(gammas)
        score_at = _FocalObjective(logits, targets, searched_g, self.objective, n_bins)
        row, t, value, _, searched_t = _search_temperature(score_at, temps, extend)
        while extend:  # γ on an edge of its grid: more γ beyond it, and T searched again for all of them
            best, more = searched_g[row], []
            if best == max(searched_g) and best < GAMMA_LIMITS[1]:  # 10 per decade (steps of 0.25 up to 1)
                more = [
                    min(max(best * 10 ** (i / 10), best + 0.25 * i), GAMMA_LIMITS[1]) for i in range(1, 11)
                ]
            elif best == min(searched_g) and best > GAMMA_LIMITS[0]:  # halving the distance to −1
                more = [max(-1 + (best + 1) / 2**i, GAMMA_LIMITS[0]) for i in range(1, 6)]
            more = list(dict.fromkeys(m for m in more if m not in searched_g))
            if not more:
                break
            searched_g += more
            score_at.use_gammas(searched_g)
            row, t, value, _, searched_t = _search_temperature(score_at, temps, extend)
        self.gamma_, self.temperature_, self.objective_value_ = float(searched_g[row]), float(t), value
        what = f"focal temperature scaling (objective={self.objective!r})"
        record_t, notes_t = _search_notes(what, "T", t, temps, searched_t, SEARCH_LIMITS, extend)
        record_g, notes_g = _search_notes(
            what, "γ", searched_g[row], gammas, searched_g, GAMMA_LIMITS, extend
        )
        self.search_ = {"T": record_t, "gamma": record_g}
        for note in notes_t + notes_g:
            warnings.warn(note, UserWarning, stacklevel=3)

    def _transform(self, logits):
        from ..functional.focal_map import focal_log_map

        return focal_log_map(torch.log_softmax(logits / self.temperature_, dim=1), self.gamma_).exp()


def _simplex_qp(gram, lin) -> torch.Tensor:
    """argmin_w wᵀ A w − 2 bᵀ w over the probability simplex, exactly, by checking every face (3 variables).

    Each face's KKT system is solved by LU (``solve_ex``), which gives the same bits on every call (MKL's
    ``lstsq`` does not). A face whose system is singular is skipped: the objective (A is a Gram matrix) is
    then constant or linear along a direction within the face, so a smaller face attains its minimum."""
    best_w, best_val = None, math.inf
    k = gram.shape[0]
    for size in range(1, k + 1):
        for face in itertools.combinations(range(k), size):
            idx = list(face)
            a = gram[idx][:, idx]
            kkt = torch.zeros(size + 1, size + 1, dtype=torch.float64)
            kkt[:size, :size] = 2 * a
            kkt[:size, size] = 1
            kkt[size, :size] = 1
            rhs = torch.cat([2 * lin[idx], torch.ones(1, dtype=torch.float64)])
            sol, info = torch.linalg.solve_ex(kkt, rhs)
            sol = sol[:size]
            if int(info) != 0 or not bool(torch.isfinite(sol).all()) or bool((sol < -1e-12).any()):
                continue
            w = torch.zeros(k, dtype=torch.float64)
            w[idx] = sol.clamp(min=0)
            w = w / w.sum()
            val = float(w @ gram @ w - 2 * lin @ w)
            if val < best_val - 1e-15:
                best_w, best_val = w, val
    assert best_w is not None, "no face of the simplex has a finite objective"
    return best_w


class EnsembleTemperatureScaling(Calibrator):
    """Ensemble temperature scaling (Zhang et al. 2020, Mix-n-Match):
    ``w₁·softmax(z/T) + w₂·softmax(z) + w₃/K``.

    T minimises validation NLL (as :class:`TemperatureScaling`); the weights minimise the squared error
    Σ_i ‖p̂_i − onehot(y_i)‖² over the simplex, solved exactly (a 3-variable quadratic program; the paper's
    code uses a generic constrained optimiser). Never changes the argmax.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> z = 2 * torch.randn(3000, 4, generator=g)
        >>> y = torch.multinomial(torch.softmax(z, 1), 1, generator=g).squeeze(1)
        >>> ets = EnsembleTemperatureScaling().fit(3 * z, y)
        >>> round(sum(ets.weights_.tolist()), 6), round(ets.temperature_, 1)
        (1.0, 3.0)
    """

    name = "ensemble_temperature_scaling"
    fitted_attributes = ("temperature_", "weights_")

    def __init__(self, bounds=(0.01, 100.0)):
        self.bounds = bounds

    def _fit(self, logits, targets):
        self.temperature_ = fit_temperature_nll(logits, targets, tuple(self.bounds))
        k = logits.shape[1]
        p1 = torch.softmax(logits / self.temperature_, dim=1)
        p0 = torch.softmax(logits, dim=1)
        n = logits.shape[0]
        dot = lambda a, b: (a * b).sum(dtype=torch.float64)  # noqa: E731
        gram = torch.tensor(
            [
                [dot(p1, p1), dot(p1, p0), n / k],
                [dot(p1, p0), dot(p0, p0), n / k],
                [n / k, n / k, n / k],
            ],
            dtype=torch.float64,
        )
        lin = torch.tensor(
            [
                float(p1.gather(1, targets[:, None]).sum(dtype=torch.float64)),
                float(p0.gather(1, targets[:, None]).sum(dtype=torch.float64)),
                n / k,
            ],
            dtype=torch.float64,
        )
        self.weights_ = _simplex_qp(gram / n, lin / n)

    def _transform(self, logits):
        w = self.weights_.to(logits.dtype).tolist()
        k = logits.shape[1]
        return (
            w[0] * torch.softmax(logits / self.temperature_, 1) + w[1] * torch.softmax(logits, 1) + w[2] / k
        )
