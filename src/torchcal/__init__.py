"""torchcal: make a PyTorch classifier's confidence mean what it says.

``import torchcal`` gives ``torchcal.functional``, ``torchcal.losses``, ``torchcal.adafocal``,
``torchcal.metrics`` and ``torchcal.calibrators``; they need only torch and numpy (plotting imports matplotlib
inside its functions).
"""

from typing import TYPE_CHECKING

from . import adafocal, calibrators, functional, losses, metrics
from ._namespace import only_public as _only_public
from .functional import METRIC_FUNCTIONS as _metric_functions
from .metrics import CalibrationMetrics

# the metric functions are re-exported at the top level (torchcal.ece, ...); losses stay in their modules
globals().update({_name: getattr(functional, _name) for _name in _metric_functions})

if TYPE_CHECKING:  # the same names bound for type checkers, which do not run the line above
    # (tests/test_imports.py checks that this list is functional.METRIC_FUNCTIONS)
    from .functional import BootstrapResult as BootstrapResult
    from .functional import ConfidenceShare as ConfidenceShare
    from .functional import adaece as adaece
    from .functional import adaptive_calibration_error as adaptive_calibration_error
    from .functional import augrc as augrc
    from .functional import aurc as aurc
    from .functional import average_precision as average_precision
    from .functional import average_set_size as average_set_size
    from .functional import bootstrap_ci as bootstrap_ci
    from .functional import bootstrap_replicates as bootstrap_replicates
    from .functional import brier as brier
    from .functional import brier_decomposition as brier_decomposition
    from .functional import brier_score as brier_score
    from .functional import build_cpu_extension as build_cpu_extension
    from .functional import calibration_error_direction as calibration_error_direction
    from .functional import calibration_test as calibration_test
    from .functional import class_coverage_gap as class_coverage_gap
    from .functional import classwise_calibration_error as classwise_calibration_error
    from .functional import classwise_ece as classwise_ece
    from .functional import confidence_at_least as confidence_at_least
    from .functional import confidence_score as confidence_score
    from .functional import conformal_set_metrics as conformal_set_metrics
    from .functional import coverage_at_risk as coverage_at_risk
    from .functional import cpu_extension_available as cpu_extension_available
    from .functional import cpu_kernels_available as cpu_kernels_available
    from .functional import debiased_calibration_error as debiased_calibration_error
    from .functional import debiased_ece as debiased_ece
    from .functional import ece as ece
    from .functional import ece_sweep as ece_sweep
    from .functional import error_rate as error_rate
    from .functional import expected_calibration_error as expected_calibration_error
    from .functional import focal_calibration_map as focal_calibration_map
    from .functional import fpr_at_tpr as fpr_at_tpr
    from .functional import kde_calibration_error as kde_calibration_error
    from .functional import kde_ece as kde_ece
    from .functional import ks_calibration_error as ks_calibration_error
    from .functional import kuiper_calibration_error as kuiper_calibration_error
    from .functional import log_score_decomposition as log_score_decomposition
    from .functional import maximum_calibration_error as maximum_calibration_error
    from .functional import mce as mce
    from .functional import multilabel_adaece as multilabel_adaece
    from .functional import multilabel_auroc as multilabel_auroc
    from .functional import multilabel_brier_score as multilabel_brier_score
    from .functional import multilabel_calibration_error as multilabel_calibration_error
    from .functional import multilabel_ece as multilabel_ece
    from .functional import multilabel_mce as multilabel_mce
    from .functional import multilabel_nll as multilabel_nll
    from .functional import negative_log_likelihood as negative_log_likelihood
    from .functional import nll as nll
    from .functional import ood_auroc as ood_auroc
    from .functional import ood_detection_metrics as ood_detection_metrics
    from .functional import paired_bootstrap as paired_bootstrap
    from .functional import rbs as rbs
    from .functional import resample_counts as resample_counts
    from .functional import risk_at_coverage as risk_at_coverage
    from .functional import risk_coverage_curve as risk_coverage_curve
    from .functional import root_brier_score as root_brier_score
    from .functional import set_coverage as set_coverage
    from .functional import set_size_distribution as set_size_distribution
    from .functional import signed_calibration_error as signed_calibration_error
    from .functional import size_stratified_coverage as size_stratified_coverage
    from .functional import smece as smece
    from .functional import smooth_calibration_error as smooth_calibration_error
    from .functional import use_cpu_extension as use_cpu_extension
    from .functional import use_cpu_kernels as use_cpu_kernels

__version__ = "0.1.0"

__all__ = [
    "CalibrationMetrics",
    "adafocal",
    "calibrators",
    "functional",
    "losses",
    "metrics",
    "__version__",
    *_metric_functions,  # pyright: ignore[reportUnsupportedDunderAll]  (bound under TYPE_CHECKING above)
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
