"""Calibrators for sigmoid outputs (binary and multi-label; SPEC §6): each label calibrated on its own.

They take logits (N,) or (N, L) and targets of the same shape in {0, 1}; ``transform`` returns the calibrated
probabilities of the positive class, same shape. The API is the multiclass one (``fit`` / ``transform`` /
``state_dict`` / JSON / scikit-learn's parameters); ``num_classes_`` holds the number of labels L.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .._validation import as_data, check_bool, check_float, check_positive_int
from ..functional._binning import equal_width_index
from ..functional.binary import _check_binary_targets, _finite_logits, _label_scores
from .base import Calibrator
from .nonparametric import _interp_rows, _pav
from .temperature import FocalTemperatureScaling, fit_temperature_nll

__all__ = [
    "BinaryCalibrator",
    "BinaryTemperatureScaling",
    "PlattScaling",
    "BinaryHistogramBinning",
    "BinaryIsotonicCalibration",
    "BinaryFocalTemperatureScaling",
]


_SIGMOID_LOGITS_ADVICE = "sigmoid calibrators take logits (for probabilities pass torch.logit(probs))"


class BinaryCalibrator(Calibrator):
    """Base of the sigmoid calibrators: inputs (N,) or (N, L); subclasses see (N, L) float64 logits and
    float64 0/1 targets in ``_fit`` and (N, L) float64 logits in ``_transform``."""

    @property
    def num_labels_(self) -> int:
        self._check_fitted()
        return self.num_classes_

    def _as_2d(self, logits, warn_if_probs: bool = False):
        z = _label_scores(as_data(logits, "logits"), "logits")
        _finite_logits(z, "logits", _SIGMOID_LOGITS_ADVICE if warn_if_probs else None)
        return z, (z[:, None] if z.ndim == 1 else z)

    def fit(self, logits, targets) -> BinaryCalibrator:
        """Learns one calibration map per label from validation logits (N,) or (N, L) and 0/1 targets."""
        z, z2 = self._as_2d(logits, warn_if_probs=True)
        y, _ = _check_binary_targets(as_data(targets, "targets"), z.shape, z.device, soft=False)
        y2 = (y[:, None] if y.ndim == 1 else y).double()
        self._clear_fitted()
        with torch.inference_mode(False):
            z2, y2 = z2.double().clone(), y2.clone()
            self._fit(z2, y2)
        self.num_classes_ = int(z2.shape[1])
        return self

    def transform(self, logits) -> torch.Tensor:
        """Calibrated probabilities of the positive class, of the shape of ``logits``."""
        self._check_fitted()
        z, z2 = self._as_2d(logits)
        if z2.shape[1] != self.num_classes_:
            raise ValueError(
                f"`logits` has {z2.shape[1]} labels but this {type(self).__name__} was fitted on {self.num_classes_}"
            )
        with torch.no_grad():
            out = self._transform(z2.double()).to(
                z.dtype if z.dtype in (torch.float32, torch.float64) else torch.float32
            )
        return out.reshape(z.shape)


class BinaryTemperatureScaling(BinaryCalibrator):
    """σ(z / T): one temperature per label (``per_label=True``) or one shared by all labels, minimising the
    validation binary NLL (the multiclass NLL fit on the two-class logits [0, z], which is the same loss).

    Args:
        per_label: one temperature per label, or one shared by all labels (fitted on them pooled).
        bounds: (T_min, T_max), 0 < T_min < T_max, finite; an optimum outside them gives the nearest bound,
            with a warning.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(20000, 2, generator=g)
        >>> y = (torch.rand(20000, 2, generator=g) < torch.sigmoid(z)).float()
        >>> ts = BinaryTemperatureScaling().fit(3 * z, y)  # three times too sharp
        >>> [round(t) for t in ts.temperature_.tolist()]
        [3, 3]
    """

    name = "binary_temperature_scaling"
    fitted_attributes = ("temperature_",)

    def __init__(self, per_label: bool = True, bounds=(0.01, 100.0)):
        self.per_label = per_label
        self.bounds = bounds

    def check_params(self) -> BinaryTemperatureScaling:
        check_bool(self.per_label, "per_label")
        self._bounds()
        return self

    def _bounds(self) -> tuple[float, float]:
        try:
            pair = () if isinstance(self.bounds, str) else tuple(self.bounds)
        except TypeError:
            pair = ()
        if len(pair) != 2:
            raise ValueError(f"`bounds` must be a pair (T_min, T_max), got {self.bounds!r}")
        lo = check_float(pair[0], "bounds[0]", low=0, low_open=True)
        return lo, check_float(pair[1], "bounds[1]", low=lo, low_open=True)

    def _fit(self, logits, targets):
        check_bool(self.per_label, "per_label")
        bounds = self._bounds()
        columns = range(logits.shape[1]) if self.per_label else [None]
        temps = []
        for j in columns:
            z = logits.reshape(-1) if j is None else logits[:, j]
            y = targets.reshape(-1) if j is None else targets[:, j]
            rows = torch.stack([torch.zeros_like(z), z], dim=1)
            temps.append(fit_temperature_nll(rows, y.long(), bounds=bounds))
        t = torch.tensor(temps, dtype=torch.float64)
        self.temperature_ = t if self.per_label else t.expand(logits.shape[1]).clone()

    def _transform(self, logits):
        return torch.sigmoid(logits / self.temperature_.to(logits.device))


class PlattScaling(BinaryCalibrator):
    """σ(a·z + b) per label (Platt 1999), fitted by Newton's method on the binary NLL with Platt's target
    smoothing (positives (N₊ + 1)/(N₊ + 2), negatives 1/(N₋ + 2)), which keeps a and b finite on separable
    data.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(20000, generator=g)
        >>> y = (torch.rand(20000, generator=g) < torch.sigmoid(2 * z - 1)).float()
        >>> platt = PlattScaling().fit(z, y)
        >>> [round(v, 1) for v in (platt.slope_.item(), platt.intercept_.item())]
        [2.0, -1.0]
    """

    name = "platt"
    fitted_attributes = ("slope_", "intercept_")

    def __init__(self, max_iter: int = 100):
        self.max_iter = max_iter

    def check_params(self) -> PlattScaling:
        check_positive_int(self.max_iter, "max_iter")
        return self

    def _fit(self, logits, targets):
        max_iter = check_positive_int(self.max_iter, "max_iter")
        slopes, intercepts = [], []
        for j in range(logits.shape[1]):
            a, b = _platt(logits[:, j], targets[:, j], max_iter)
            slopes.append(a)
            intercepts.append(b)
        self.slope_ = torch.tensor(slopes, dtype=torch.float64)
        self.intercept_ = torch.tensor(intercepts, dtype=torch.float64)

    def _transform(self, logits):
        return torch.sigmoid(logits * self.slope_.to(logits.device) + self.intercept_.to(logits.device))


def _platt(z: torch.Tensor, y: torch.Tensor, max_iter: int) -> tuple[float, float]:
    """Newton's method with backtracking on Σ −t log σ(az + b) − (1 − t) log(1 − σ(az + b)) (Lin et al.
    2007's safeguarded form of Platt's algorithm), float64."""
    n_pos = float(y.sum())
    n_neg = y.shape[0] - n_pos
    t = torch.where(y > 0.5, (n_pos + 1) / (n_pos + 2), 1 / (n_neg + 2))
    x = torch.stack([z, torch.ones_like(z)], dim=1)
    w = torch.tensor([0.0, math.log((n_pos + 1) / (n_neg + 1))], dtype=torch.float64, device=z.device)

    def loss(v):
        s = x @ v
        return float((torch.nn.functional.softplus(s) - t * s).sum())

    current = loss(w)
    for _ in range(max_iter):
        p = torch.sigmoid(x @ w)
        grad = x.T @ (p - t)
        hess = (x.T * (p * (1 - p))) @ x + 1e-12 * torch.eye(2, dtype=torch.float64, device=z.device)
        step = torch.linalg.solve(hess, grad)
        if float(grad.abs().max()) < 1e-10:
            break
        scale = 1.0
        while scale > 1e-10:
            candidate = w - scale * step
            value = loss(candidate)
            if value < current + 1e-4 * scale * float(grad @ -step):
                break
            scale /= 2
        else:
            break
        w, current = candidate, value
    return float(w[0]), float(w[1])


class BinaryHistogramBinning(BinaryCalibrator):
    """Histogram binning per label (Zadrozny & Elkan 2001): p = σ(z) on ``n_bins`` equal-width bins
    (``(m/M, (m+1)/M]``, 0 in bin 0) is replaced by the validation frequency of positives in its bin; a bin
    without validation samples leaves p unchanged.

    Example:
        >>> import torch
        >>> hb = BinaryHistogramBinning(n_bins=2).fit(torch.tensor([2.0, 1.5, -2.0, -1.0]), torch.tensor([1, 0, 1, 0]))
        >>> hb.frequencies_
        tensor([[0.5000, 0.5000]], dtype=torch.float64)
    """

    name = "binary_histogram_binning"
    fitted_attributes = ("frequencies_",)

    def __init__(self, n_bins: int = 15):
        self.n_bins = n_bins

    def check_params(self) -> BinaryHistogramBinning:
        check_positive_int(self.n_bins, "n_bins")
        return self

    def _fit(self, logits, targets):
        n_bins = check_positive_int(self.n_bins, "n_bins")
        p = torch.sigmoid(logits)
        rows = []
        for j in range(p.shape[1]):
            idx = equal_width_index(p[:, j].contiguous(), n_bins)
            count = torch.bincount(idx, minlength=n_bins).double()
            positives = torch.bincount(idx, weights=targets[:, j], minlength=n_bins)
            rows.append(torch.where(count > 0, positives / count.clamp(min=1), torch.nan))
        self.frequencies_ = torch.stack(rows).cpu()

    def _transform(self, logits):
        p = torch.sigmoid(logits)
        table = self.frequencies_.to(p.device)
        idx = equal_width_index(p, table.shape[1])
        mapped = table.gather(1, idx.T).T
        return torch.where(torch.isnan(mapped), p, mapped)


class BinaryIsotonicCalibration(BinaryCalibrator):
    """Isotonic regression per label (Zadrozny & Elkan 2002): a non-decreasing map of p = σ(z) to the
    frequency of positives by weighted pool-adjacent-violators, applied by linear interpolation between the
    fitted points and clipped at the ends (scikit-learn's ``IsotonicRegression(out_of_bounds="clip")``).

    Example:
        >>> import torch
        >>> iso = BinaryIsotonicCalibration().fit(torch.tensor([-2.0, -1.0, 1.0, 2.0]), torch.tensor([0, 1, 0, 1]))
        >>> iso.transform(torch.tensor([-2.0, 0.0, 2.0]))
        tensor([0.0000, 0.5000, 1.0000])
    """

    name = "binary_isotonic"
    fitted_attributes = ("thresholds_", "values_")

    def _fit(self, logits, targets):
        p = torch.sigmoid(logits).cpu().numpy()
        y = targets.cpu().numpy().astype(np.float64)
        thresholds, values = [], []
        for j in range(p.shape[1]):
            xu, fit = _pav(p[:, j], y[:, j])
            thresholds.append(torch.from_numpy(xu))
            values.append(torch.from_numpy(fit))
        self.thresholds_, self.values_ = thresholds, values

    def _transform(self, logits):
        p = torch.sigmoid(logits)
        cols = [
            _interp_rows(p[:, j].contiguous(), self.thresholds_[j].to(p.device), self.values_[j].to(p.device))
            for j in range(p.shape[1])
        ]
        return torch.stack(cols, 1)


def _rows(z: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.zeros_like(z), z], dim=1)


class BinaryFocalTemperatureScaling(BinaryCalibrator):
    """Focal temperature scaling (Komisarenko & Kull 2024) per label: the multiclass FTS of the two-class
    logits [0, z] (its focal calibration map after temperature, (γ, T) by its grid on the objective), the
    positive class's probability returned.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> z = torch.randn(3000, generator=g)
        >>> y = (torch.rand(3000, generator=g) < torch.sigmoid(z)).float()
        >>> fts = BinaryFocalTemperatureScaling().fit(3 * z, y)
        >>> fts.transform(3 * z).shape, len(fts.gamma_), len(fts.temperature_)
        (torch.Size([3000]), 1, 1)
    """

    name = "binary_focal_temperature_scaling"
    fitted_attributes = ("gamma_", "temperature_")

    def __init__(self, objective: str = "adaece", n_bins: int = 15):
        self.objective = objective
        self.n_bins = n_bins

    def check_params(self) -> BinaryFocalTemperatureScaling:
        FocalTemperatureScaling(objective=self.objective, n_bins=self.n_bins).check_params()
        return self

    def _fit(self, logits, targets):
        gammas, temps = [], []
        for j in range(logits.shape[1]):
            fts = FocalTemperatureScaling(objective=self.objective, n_bins=self.n_bins)
            fts.fit(_rows(logits[:, j]), targets[:, j].long())
            gammas.append(float(fts.gamma_))
            temps.append(float(fts.temperature_))
        self.gamma_ = torch.tensor(gammas, dtype=torch.float64)
        self.temperature_ = torch.tensor(temps, dtype=torch.float64)

    def _transform(self, logits):
        cols = []
        for j in range(logits.shape[1]):
            fts = FocalTemperatureScaling(objective=self.objective, n_bins=self.n_bins)
            fts.gamma_, fts.temperature_, fts.num_classes_ = (
                float(self.gamma_[j]),
                float(self.temperature_[j]),
                2,
            )
            cols.append(fts.transform(_rows(logits[:, j]))[:, 1])
        return torch.stack(cols, 1)
