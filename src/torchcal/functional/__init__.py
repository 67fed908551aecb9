"""Pure tensor functions, like ``torch.nn.functional``: calibration metrics, the training losses (their
``nn.Module`` twins are in :mod:`torchcal.losses`), for softmax and for sigmoid (binary / multi-label,
:mod:`torchcal.functional.binary`) outputs, the focal calibration map, bootstrap intervals."""

from ._backend import cpu_kernels_available, use_cpu_kernels
from ._extension import build_cpu_extension, cpu_extension_available, use_cpu_extension
from .binary import (  # noqa: F401  (the sigmoid losses are listed in LOSS_FUNCTIONS below)
    binary_brier_loss,
    binary_cross_entropy,
    binary_dual_focal_loss,
    binary_focal_calibration_loss,
    binary_focal_loss,
    multilabel_adaece,
    multilabel_auroc,
    multilabel_brier_score,
    multilabel_calibration_error,
    multilabel_ece,
    multilabel_mce,
    multilabel_nll,
)
from .bootstrap import BootstrapResult, bootstrap_ci
from .calibration import (
    ConfidenceShare,
    adaptive_calibration_error,
    brier_score,
    classwise_calibration_error,
    confidence_at_least,
    debiased_calibration_error,
    ece_sweep,
    error_rate,
    expected_calibration_error,
    kde_calibration_error,
    maximum_calibration_error,
    negative_log_likelihood,
    ood_auroc,
    smooth_calibration_error,
)
from .focal_map import focal_calibration_map
from .losses import *  # noqa: F403  (the functional losses: functional.losses.__all__)
from .losses import __all__ as _MULTICLASS_LOSSES
from .margin import (  # noqa: F401  (the losses are listed in LOSS_FUNCTIONS below)
    acls_loss,
    confidence_penalty_loss,
    dca_loss,
    logit_margin_l1_loss,
    maxsup_loss,
    mbls_alpha,
    mdca_loss,
    mdca_penalty,
    poly1_cross_entropy,
    sbece_loss,
    sbece_penalty,
)

# the functional losses: softmax (functional.losses) and sigmoid (functional.binary)
LOSS_FUNCTIONS = [
    *_MULTICLASS_LOSSES,
    "binary_brier_loss",
    "binary_cross_entropy",
    "binary_dual_focal_loss",
    "binary_focal_calibration_loss",
    "binary_focal_loss",
    "acls_loss",
    "confidence_penalty_loss",
    "dca_loss",
    "logit_margin_l1_loss",
    "maxsup_loss",
    "mdca_loss",
    "poly1_cross_entropy",
    "sbece_loss",
]

# Short aliases.
ece = expected_calibration_error
adaece = adaptive_calibration_error
classwise_ece = classwise_calibration_error
mce = maximum_calibration_error
nll = negative_log_likelihood
brier = brier_score
smece = smooth_calibration_error
debiased_ece = debiased_calibration_error
kde_ece = kde_calibration_error

__all__ = [
    "BootstrapResult",
    "ConfidenceShare",
    "adaece",
    "adaptive_calibration_error",
    "bootstrap_ci",
    "brier",
    "brier_score",
    "build_cpu_extension",
    "classwise_calibration_error",
    "classwise_ece",
    "confidence_at_least",
    "cpu_extension_available",
    "cpu_kernels_available",
    "debiased_calibration_error",
    "debiased_ece",
    "ece",
    "ece_sweep",
    "error_rate",
    "expected_calibration_error",
    "focal_calibration_map",
    "kde_calibration_error",
    "kde_ece",
    "maximum_calibration_error",
    "mce",
    "multilabel_adaece",
    "multilabel_auroc",
    "multilabel_brier_score",
    "multilabel_calibration_error",
    "multilabel_ece",
    "multilabel_mce",
    "multilabel_nll",
    "negative_log_likelihood",
    "nll",
    "ood_auroc",
    "smece",
    "smooth_calibration_error",
    "use_cpu_extension",
    "use_cpu_kernels",
]
METRIC_FUNCTIONS = list(__all__)  # (with the kernel switches) re-exported at torchcal's top level
__all__ += ["LOSS_FUNCTIONS", "METRIC_FUNCTIONS"]

# the functional losses (their nn.Module twins are in torchcal.losses)
__all__ += LOSS_FUNCTIONS
__all__ += ["mbls_alpha", "mdca_penalty", "sbece_penalty"]  # MbLS's α schedule; batch terms alone
