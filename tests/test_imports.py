"""The core imports only torch and numpy."""

import subprocess
import sys


def test_import_torchcal_stays_light():
    code = (
        "import sys, torchcal, torchcal.calibrators, torchcal.metrics, torchcal.plotting\n"
        "heavy = [m for m in ('matplotlib', 'scipy', 'sklearn', 'pandas', 'torchcal.experiments') if m in sys.modules]\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_api_is_reexported():
    import torchcal

    for name in (
        "expected_calibration_error",
        "ece",
        "smooth_calibration_error",
        "CalibrationMetrics",
        "focal_calibration_map",
        "bootstrap_ci",
        "ood_auroc",
        "confidence_at_least",
    ):
        assert hasattr(torchcal, name), name
