"""torchcal: make a PyTorch classifier's confidence mean what it says.

``import torchcal`` gives ``torchcal.functional``, ``torchcal.losses``, ``torchcal.adafocal``,
``torchcal.metrics`` and ``torchcal.calibrators``; they need only torch and numpy (plotting imports matplotlib
inside its functions).
"""

from . import adafocal, calibrators, functional, losses, metrics
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
