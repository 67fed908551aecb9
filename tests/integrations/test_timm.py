"""timm's mixup / cutmix soft targets and its soft-target and label-smoothing cross entropies against
torchcal's losses. timm itself does not import beside the CPU torch (its torchvision pins another torch), so
`make setup` installs timm without dependencies and these tests load the two self-contained files they need
(`timm/data/mixup.py`, `timm/loss/cross_entropy.py`: numpy and torch only) straight from the package."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

import torchcal.functional as F
from tests.reference import losses as R
from torchcal.losses import create


def _timm_file(relative: str):
    spec = importlib.util.find_spec("timm")  # locates the package without importing it
    if spec is None or spec.origin is None:
        pytest.fail("timm is not installed: `make setup` installs it (pip install --no-deps timm)")
    path = Path(spec.origin).parent / relative
    module_spec = importlib.util.spec_from_file_location(f"_timm_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mixed():
    """A batch through timm's Mixup (mixup or cutmix per batch, label smoothing 0.1): its soft targets."""
    mixup = _timm_file("data/mixup.py").Mixup(
        mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=10, mode="elem"
    )
    np.random.seed(0)  # noqa: NPY002 (timm draws from NumPy's global generator)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, 8, 8, generator=g)
    y = torch.randint(0, 10, (8,), generator=g)
    _, targets = mixup(x, y)
    logits = 3 * torch.randn(8, 10, generator=g)
    return logits, targets, y


def test_mixup_targets_are_soft_class_probabilities(mixed):
    _, targets, _ = mixed
    assert targets.shape == (8, 10) and targets.dtype == torch.float32
    torch.testing.assert_close(targets.sum(1), torch.ones(8))
    assert (targets > 0).all()  # smoothing puts mass everywhere


def test_cross_entropy_equals_timm_soft_target_and_smoothing_losses(mixed):
    logits, targets, y = mixed
    timm_ce = _timm_file("loss/cross_entropy.py")
    a, b = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    ours = F.cross_entropy(a, targets)
    theirs = timm_ce.SoftTargetCrossEntropy()(b, targets)
    torch.testing.assert_close(ours, theirs)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(a.grad, b.grad)
    torch.testing.assert_close(
        F.cross_entropy(logits, y, label_smoothing=0.1), timm_ce.LabelSmoothingCrossEntropy(0.1)(logits, y)
    )


def test_calibration_losses_take_timm_targets(mixed):
    logits, targets, _ = mixed
    z, q = logits.double(), targets.double()
    torch.testing.assert_close(
        create("fl-3", reduction="none")(z, q), torch.tensor(R.soft_focal(z, q, 3.0), dtype=torch.float64)
    )
    torch.testing.assert_close(
        create("fcl", reduction="none")(z, q), torch.tensor(R.soft_fcl(z, q, 4.0, 1.5), dtype=torch.float64)
    )
    for name in ("flsd-53", "brier", "ls-0.05"):
        loss = create(name)(logits.requires_grad_(True), targets)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()
    with pytest.raises(TypeError, match="dual focal loss is defined by the true class"):
        create("dfl")(logits, targets)
