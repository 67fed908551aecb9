"""Post-hoc calibrators: fit on validation logits, transform test logits into calibrated probabilities.

Use a class directly or the registry::

    >>> from torchcal.calibrators import create, list_calibrators
    >>> names = list_calibrators()
    >>> names[:9]
    ['bbq', 'bcts', 'beta', 'dirichlet', 'dirichlet_diag', 'ets', 'fts', 'histogram', 'iop']
    >>> names[9:]
    ['isotonic', 'matrix', 'nbvs', 'pts', 'sms', 'spline', 'svs', 'ts', 'vector', 'venn_abers']
    >>> create("ts", objective="ece")
    TemperatureScaling(objective='ece', n_bins=15, grid=..., bounds=(0.01, 100.0), extend=True)
"""

from .base import Calibrator, NotFittedError
from .bbq import BBQ, BinaryBBQ
from .beta import BetaCalibration, BinaryBetaCalibration
from .binary import (
    BinaryCalibrator,
    BinaryFocalTemperatureScaling,
    BinaryHistogramBinning,
    BinaryIsotonicCalibration,
    BinaryTemperatureScaling,
    PlattScaling,
)
from .dirichlet import DiagonalDirichletCalibration, DirichletCalibration
from .model import CalibratedModel
from .neural import IntraOrderPreserving, ParameterizedTemperatureScaling
from .nonparametric import HistogramBinning, IsotonicCalibration, SplineCalibration
from .scaling import BiasCorrectedTemperatureScaling, MatrixScaling, NoBiasVectorScaling, VectorScaling
from .structured import StructuredMatrixScaling, StructuredVectorScaling
from .temperature import (
    FTS_GAMMA_GRID,
    FTS_TEMPERATURE_GRID,
    GAMMA_LIMITS,
    PAPER_TEMPERATURE_GRID,
    SEARCH_LIMITS,
    EnsembleTemperatureScaling,
    FocalTemperatureScaling,
    TemperatureScaling,
    fit_temperature_nll,
)
from .venn_abers import VennAbers

_REGISTRY: dict[str, type[Calibrator]] = {
    "ts": TemperatureScaling,
    "fts": FocalTemperatureScaling,
    "ets": EnsembleTemperatureScaling,
    "spline": SplineCalibration,
    "histogram": HistogramBinning,
    "isotonic": IsotonicCalibration,
    "vector": VectorScaling,
    "matrix": MatrixScaling,
    "svs": StructuredVectorScaling,
    "sms": StructuredMatrixScaling,
    "bcts": BiasCorrectedTemperatureScaling,
    "nbvs": NoBiasVectorScaling,
    "dirichlet": DirichletCalibration,
    "beta": BetaCalibration,
    "dirichlet_diag": DiagonalDirichletCalibration,
    "venn_abers": VennAbers,
    "bbq": BBQ,
    "pts": ParameterizedTemperatureScaling,
    "iop": IntraOrderPreserving,
}
_ALIASES = {cls.name: key for key, cls in _REGISTRY.items()}
_ALIASES.update({"temperature": "ts", "histogram_binning": "histogram", "ivap": "venn_abers"})
# sigmoid outputs (binary / multi-label): the same short names, one map per label
_BINARY_REGISTRY: dict[str, type[Calibrator]] = {
    "ts": BinaryTemperatureScaling,
    "fts": BinaryFocalTemperatureScaling,
    "platt": PlattScaling,
    "beta": BinaryBetaCalibration,
    "histogram": BinaryHistogramBinning,
    "isotonic": BinaryIsotonicCalibration,
    "bbq": BinaryBBQ,
}
_BINARY_ALIASES = {cls.name: key for key, cls in _BINARY_REGISTRY.items()}
_TASKS = ("multiclass", "multilabel")


def list_calibrators(task: str = "multiclass") -> list[str]:
    """Registered short names, sorted: for softmax outputs, or with ``task="multilabel"`` for sigmoid ones."""
    if task not in _TASKS:
        raise ValueError(f"`task` must be one of {list(_TASKS)}, got {task!r}")
    return sorted(_REGISTRY if task == "multiclass" else _BINARY_REGISTRY)


def get_calibrator_class(name: str, task: str = "multiclass") -> type[Calibrator]:
    """The class registered as ``name`` (short or full name, any case: "TS", "ts", "Temperature_Scaling")."""
    if task not in _TASKS:
        raise ValueError(f"`task` must be one of {list(_TASKS)}, got {task!r}")
    if not isinstance(name, str):
        raise TypeError(f"a calibrator name must be a string, got {type(name).__name__}")
    registry, aliases = (_REGISTRY, _ALIASES) if task == "multiclass" else (_BINARY_REGISTRY, _BINARY_ALIASES)
    lowered = name.strip().lower()
    names = {**{k.lower(): k for k in registry}, **{a.lower(): k for a, k in aliases.items()}}
    key = names.get(lowered)
    if key is None:
        raise ValueError(f"unknown calibrator {name!r}; choose one of {list_calibrators(task)}")
    return registry[key]


def create(name: str, task: str = "multiclass", **kwargs) -> Calibrator:
    """A new, unfitted calibrator by short name (``"ts"``, ``"fts"``, ...) or full name; ``task="multilabel"``
    for sigmoid outputs (``"ts"``, ``"platt"``, ``"histogram"``, ``"isotonic"``)."""
    return get_calibrator_class(name, task)(**kwargs)


def _spec_value(text: str):
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_spec(spec: str) -> tuple[str, dict]:
    """A calibrator spec ``name[:key=value[:key=value...]]`` as (name, keyword arguments); values are read
    as bool, int, float or else string.

    Example:
        >>> from torchcal.calibrators import parse_spec
        >>> parse_spec("ts:objective=ece:n_bins=10")
        ('ts', {'objective': 'ece', 'n_bins': 10})
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            f"a calibrator spec must be a non-empty string like 'ts' or 'ts:objective=ece', got {spec!r}"
        )
    name, *args = [part.strip() for part in spec.split(":")]
    kwargs = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"calibrator spec {spec!r}: {arg!r} must look like key=value (e.g. ts:objective=ece)"
            )
        kwargs[key.strip()] = _spec_value(value)
    return name, kwargs


def from_spec(spec: str, task: str = "multiclass") -> Calibrator:
    """A new, unfitted calibrator from a spec such as ``"ts"`` or ``"ts:objective=ece"`` (:func:`parse_spec`);
    an unknown name, an unknown argument or a value ``fit`` would refuse (:meth:`Calibrator.check_params`)
    is a ``ValueError`` naming the spec and the argument.

    Example:
        >>> from torchcal.calibrators import from_spec
        >>> from_spec("ts:objective=adaece").objective
        'adaece'
    """
    name, kwargs = parse_spec(spec)
    cls = get_calibrator_class(name, task)
    try:
        return cls(**kwargs).check_params()  # the arguments checked as fit checks them
    except (TypeError, ValueError) as err:
        raise ValueError(f"calibrator spec {spec!r}: {err}") from None


def from_json(text: str) -> Calibrator:
    """Rebuilds any calibrator from its ``to_json()`` text."""
    import json

    name = json.loads(text).get("name")
    task = "multilabel" if name in _BINARY_ALIASES else "multiclass"
    return get_calibrator_class(name, task).from_json(text)


__all__ = [
    "BBQ",
    "BinaryBBQ",
    "BiasCorrectedTemperatureScaling",
    "BetaCalibration",
    "BinaryBetaCalibration",
    "BinaryCalibrator",
    "CalibratedModel",
    "BinaryFocalTemperatureScaling",
    "BinaryHistogramBinning",
    "BinaryIsotonicCalibration",
    "BinaryTemperatureScaling",
    "Calibrator",
    "DiagonalDirichletCalibration",
    "DirichletCalibration",
    "EnsembleTemperatureScaling",
    "FTS_GAMMA_GRID",
    "FTS_TEMPERATURE_GRID",
    "GAMMA_LIMITS",
    "SEARCH_LIMITS",
    "FocalTemperatureScaling",
    "HistogramBinning",
    "IntraOrderPreserving",
    "IsotonicCalibration",
    "MatrixScaling",
    "NoBiasVectorScaling",
    "NotFittedError",
    "PAPER_TEMPERATURE_GRID",
    "ParameterizedTemperatureScaling",
    "PlattScaling",
    "SplineCalibration",
    "StructuredMatrixScaling",
    "StructuredVectorScaling",
    "TemperatureScaling",
    "VectorScaling",
    "VennAbers",
    "create",
    "fit_temperature_nll",
    "from_json",
    "from_spec",
    "get_calibrator_class",
    "list_calibrators",
    "parse_spec",
]
