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
from .bootstrap import BootstrapResult, bootstrap_ci, bootstrap_replicates, resample_counts
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
    root_brier_score,
    smooth_calibration_error,
)
from .conformal import (
    average_set_size,
    class_coverage_gap,
    conformal_set_metrics,
    set_coverage,
    set_size_distribution,
    size_stratified_coverage,
)
from .cumulative import ks_calibration_error, kuiper_calibration_error
from .decomposition import (
    brier_decomposition,
    calibration_error_direction,
    log_score_decomposition,
    signed_calibration_error,
)
from .focal_map import focal_calibration_map
from .fused_head import FUSED_LOSSES, fused_linear_loss
from .losses import *  # noqa: F403  (the functional losses: functional.losses.__all__)
from .losses import __all__ as _MULTICLASS_LOSSES
from .margin import (  # noqa: F401  (the losses are listed in LOSS_FUNCTIONS below)
    acls_loss,
    avuc_loss,
    avuc_penalty,
    cals_loss,
    cals_statistics,
    confidence_penalty_loss,
    dca_loss,
    esd_loss,
    esd_penalty,
    logit_margin_l1_loss,
    maxsup_loss,
    mbls_alpha,
    mdca_loss,
    mdca_penalty,
    ml1ace_loss,
    ml1ace_penalty,
    phr_penalty,
    poly1_cross_entropy,
    sbece_loss,
    sbece_penalty,
    soft_avuc_loss,
    soft_avuc_penalty,
)
from .selective import (
    augrc,
    aurc,
    average_precision,
    confidence_score,
    coverage_at_risk,
    fpr_at_tpr,
    ood_detection_metrics,
    risk_at_coverage,
    risk_coverage_curve,
)
from .significance import calibration_test, paired_bootstrap

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
    "avuc_loss",
    "soft_avuc_loss",
    "esd_loss",
    "ml1ace_loss",
    "cals_loss",
]

# Short aliases.
ece = expected_calibration_error
adaece = adaptive_calibration_error
classwise_ece = classwise_calibration_error
mce = maximum_calibration_error
nll = negative_log_likelihood
brier = brier_score
rbs = root_brier_score
smece = smooth_calibration_error
debiased_ece = debiased_calibration_error
kde_ece = kde_calibration_error

__all__ = [
    "BootstrapResult",
    "ConfidenceShare",
    "adaece",
    "adaptive_calibration_error",
    "bootstrap_ci",
    "bootstrap_replicates",
    "resample_counts",
    "brier",
    "brier_score",
    "rbs",
    "root_brier_score",
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
# the metrics of SPEC §9: direction, decompositions, KS/Kuiper, significance, selective prediction, OOD,
# conformal set metrics (the scores and the set predictor: functional.conformal, torchcal.conformal)
_N_CORE = len(__all__)
__all__ += [
    "augrc",
    "aurc",
    "average_precision",
    "average_set_size",
    "brier_decomposition",
    "calibration_error_direction",
    "calibration_test",
    "class_coverage_gap",
    "confidence_score",
    "conformal_set_metrics",
    "coverage_at_risk",
    "fpr_at_tpr",
    "ks_calibration_error",
    "kuiper_calibration_error",
    "log_score_decomposition",
    "ood_detection_metrics",
    "paired_bootstrap",
    "risk_at_coverage",
    "risk_coverage_curve",
    "set_coverage",
    "set_size_distribution",
    "signed_calibration_error",
    "size_stratified_coverage",
]
FIELD_METRIC_FUNCTIONS = __all__[_N_CORE:]
METRIC_FUNCTIONS = list(__all__)  # (with the kernel switches) re-exported at torchcal's top level
__all__ += ["LOSS_FUNCTIONS", "METRIC_FUNCTIONS"]

# the functional losses (their nn.Module twins are in torchcal.losses)
__all__ += LOSS_FUNCTIONS  # pyright: ignore[reportUnsupportedDunderAll]  (each is bound by an import above)
__all__ += ["FUSED_LOSSES", "fused_linear_loss"]  # the fused linear head + loss (language-model vocabularies)
__all__ += ["mbls_alpha", "mdca_penalty", "sbece_penalty"]  # MbLS's α schedule; batch terms alone
# the other penalty terms alone; CALS's PHR penalty and the statistics of its multiplier update
__all__ += ["avuc_penalty", "soft_avuc_penalty", "esd_penalty", "ml1ace_penalty", "phr_penalty", "cals_statistics"]
