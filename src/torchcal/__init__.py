"""torchcal: make a PyTorch classifier's confidence mean what it says.

The core (``torchcal.functional``, ``torchcal.metrics``, ``torchcal.calibrators``) needs only torch and
numpy; plotting imports matplotlib inside its functions.
"""

from . import calibrators, functional, metrics
from .functional import *  # noqa: F403  (metrics are re-exported at the top level)
from .functional import __all__ as _functional_all
from .metrics import CalibrationMetrics

__version__ = "0.1.0"

__all__ = ["CalibrationMetrics", "calibrators", "functional", "metrics", "__version__", *_functional_all]
