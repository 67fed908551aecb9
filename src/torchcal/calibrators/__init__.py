"""Post-hoc calibrators: fit on validation logits, transform test logits into calibrated probabilities.

Use a class directly or the registry::

    >>> from torchcal.calibrators import create, list_calibrators
    >>> list_calibrators()
    ['ets', 'fts', 'histogram', 'isotonic', 'matrix', 'spline', 'ts', 'vector']
    >>> create("ts", objective="ece")
    TemperatureScaling(objective='ece', n_bins=15, grid=..., bounds=(0.01, 100.0))
"""

from __future__ import annotations

import json

from .base import Calibrator, NotFittedError
from .nonparametric import HistogramBinning, IsotonicCalibration, SplineCalibration
from .scaling import MatrixScaling, VectorScaling
from .temperature import (
    FTS_GAMMA_GRID,
    FTS_TEMPERATURE_GRID,
    PAPER_TEMPERATURE_GRID,
    EnsembleTemperatureScaling,
    FocalTemperatureScaling,
    TemperatureScaling,
    fit_temperature_nll,
)

_REGISTRY: dict[str, type[Calibrator]] = {
    "ts": TemperatureScaling,
    "fts": FocalTemperatureScaling,
    "ets": EnsembleTemperatureScaling,
    "spline": SplineCalibration,
    "histogram": HistogramBinning,
    "isotonic": IsotonicCalibration,
    "vector": VectorScaling,
    "matrix": MatrixScaling,
}
_ALIASES = {cls.name: key for key, cls in _REGISTRY.items()}
_ALIASES.update({"temperature": "ts", "histogram_binning": "histogram"})


def list_calibrators() -> list[str]:
    """Registered short names, sorted."""
    return sorted(_REGISTRY)


def get_calibrator_class(name: str) -> type[Calibrator]:
    key = _ALIASES.get(name, name)
    if key not in _REGISTRY:
        raise ValueError(f"unknown calibrator {name!r}; choose one of {list_calibrators()}")
    return _REGISTRY[key]


def create(name: str, **kwargs) -> Calibrator:
    """A new, unfitted calibrator by short name (``"ts"``, ``"fts"``, ...) or full name."""
    return get_calibrator_class(name)(**kwargs)


def from_json(text: str) -> Calibrator:
    """Rebuilds any calibrator from its ``to_json()`` text."""
    name = json.loads(text).get("name")
    return get_calibrator_class(name).from_json(text)


__all__ = [
    "Calibrator",
    "EnsembleTemperatureScaling",
    "FTS_GAMMA_GRID",
    "FTS_TEMPERATURE_GRID",
    "FocalTemperatureScaling",
    "HistogramBinning",
    "IsotonicCalibration",
    "MatrixScaling",
    "NotFittedError",
    "PAPER_TEMPERATURE_GRID",
    "SplineCalibration",
    "TemperatureScaling",
    "VectorScaling",
    "create",
    "fit_temperature_nll",
    "from_json",
    "get_calibrator_class",
    "list_calibrators",
]
