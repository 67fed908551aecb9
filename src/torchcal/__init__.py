"""torchcal: make a PyTorch classifier's confidence mean what it says.

``import torchcal`` gives ``torchcal.functional``, ``torchcal.losses``, ``torchcal.adafocal``,
``torchcal.metrics`` and ``torchcal.calibrators``; they need only torch and numpy (plotting imports matplotlib
inside its functions).
"""

from . import adafocal, calibrators, functional, losses, metrics
from ._namespace import only_public as _only_public
from .functional import METRIC_FUNCTIONS as _metric_functions
from .metrics import CalibrationMetrics

# the metric functions are re-exported at the top level (torchcal.ece, ...); losses stay in their modules
globals().update({_name: getattr(functional, _name) for _name in _metric_functions})

__version__ = "0.1.0"

__all__ = [
    "CalibrationMetrics",
    "adafocal",
    "calibrators",
    "functional",
    "losses",
    "metrics",
    "__version__",
    *_metric_functions,
]

# dir() of every public namespace lists its public names only (the modules import torch, json, ... for
# their own use); torchcal.plotting does the same for itself
for _module in (
    __name__,
    "torchcal.adafocal",
    "torchcal.calibrators",
    "torchcal.calibrators.base",
    "torchcal.calibrators.binary",
    "torchcal.calibrators.nonparametric",
    "torchcal.calibrators.scaling",
    "torchcal.calibrators.temperature",
    "torchcal.functional",
    "torchcal.functional.binary",
    "torchcal.functional.bootstrap",
    "torchcal.functional.calibration",
    "torchcal.functional.focal_map",
    "torchcal.functional.losses",
    "torchcal.functional.margin",
    "torchcal.losses",
    "torchcal.metrics",
):
    _only_public(_module)
