"""CalibratedModel: a model and its calibrator as one nn.Module (state_dict, torch.save, torch.export)."""

import io

import pytest
import torch

from tests.reference.calibration_data import synthetic_logits
from torchcal.calibrators import CalibratedModel, NotFittedError, TemperatureScaling, create

EXPORTABLE = ["ts", "vector", "matrix", "svs", "sms", "bcts", "nbvs", "dirichlet", "dirichlet_diag", "beta"]


class Memorised(torch.nn.Module):
    """Returns stored logits for row indices (so the calibrator sees known logits), plus a parameter."""

    def __init__(self, logits):
        super().__init__()
        self.table = torch.nn.Parameter(logits.clone())

    def forward(self, idx):
        return self.table[idx]


@pytest.fixture(scope="module")
def data():
    return synthetic_logits(2000, 5, seed=20)


@pytest.mark.parametrize("name", EXPORTABLE)
def test_forward_equals_the_calibrator_and_survives_save_load_and_export(name, data):
    logits, targets = data
    idx = torch.arange(len(targets))
    cm = CalibratedModel(Memorised(logits), create(name)).fit(idx, targets, batch_size=512)
    expected = create(name).fit(logits, targets).transform(logits[:50])
    torch.testing.assert_close(cm(idx[:50]), expected)
    # calibrated logits give the calibrated probabilities back
    cm_logits = CalibratedModel(cm.model, cm.calibrator, output="logits")
    torch.testing.assert_close(torch.softmax(cm_logits(idx[:50]), 1), expected)

    buffer = io.BytesIO()
    torch.save(cm.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    fresh = CalibratedModel(Memorised(torch.zeros_like(logits)), create(name))
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh(idx[:50]), expected)

    exported = torch.export.export(cm, (idx[:8],), dynamic_shapes=(({0: torch.export.Dim("batch")},),))
    torch.testing.assert_close(exported.module()(idx[:50]), expected)


def test_unfitted_and_bad_arguments():
    cm = CalibratedModel(torch.nn.Linear(3, 2), TemperatureScaling())
    with pytest.raises(NotFittedError, match="not fitted yet"):
        cm(torch.randn(2, 3))
    with pytest.raises(TypeError, match="`model` must be a torch.nn.Module"):
        CalibratedModel(lambda x: x, TemperatureScaling())
    with pytest.raises(TypeError, match="`calibrator` must be a torchcal Calibrator"):
        CalibratedModel(torch.nn.Linear(3, 2), "ts")
    with pytest.raises(ValueError, match="`output` must be one of"):
        CalibratedModel(torch.nn.Linear(3, 2), TemperatureScaling(), output="log")
    for bad in (0, -5):  # -5 gave torch.cat's "expected a non-empty list", 0 the whole set at once
        with pytest.raises(ValueError, match="`batch_size` must be >= 1"):
            cm.fit(torch.randn(8, 3), torch.randint(0, 2, (8,)), batch_size=bad)


def test_fit_accepts_an_iterable_of_batches_and_leaves_eval_mode(data):
    logits, targets = data
    model = torch.nn.Sequential(torch.nn.Dropout(0.5), Memorised(logits))
    model[1].forward = lambda idx, table=model[1].table: table[idx]
    idx = torch.arange(len(targets))
    cm = CalibratedModel(model, TemperatureScaling()).fit([idx[:1000], idx[1000:]], targets)
    assert not model.training  # dropout off: the calibrator saw the deterministic logits
    assert cm.calibrator.temperature_ == pytest.approx(TemperatureScaling().fit(logits, targets).temperature_)


class Identity(torch.nn.Module):
    def forward(self, x):
        return x


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["dirichlet", "histogram", "matrix"])
def test_half_precision_logits_are_calibrated_in_float32(name, dtype, data):
    """A float16/bfloat16 model gives the calibrator's float32 map of its logits, as ``transform`` does (in
    the logits' dtype, float16 Dirichlet probabilities were off by up to 0.17 and bfloat16 histogram
    binning's by up to 0.25)."""
    logits, targets = data
    calibrator = create(name).fit(logits, targets)
    half = logits[:500].to(dtype)
    got = CalibratedModel(Identity(), calibrator)(half)
    assert got.dtype == torch.float32
    # reference: the same (rounded) logits in float64; float32 evaluation of the map costs a few ulps
    # (eps 1.2e-7) through its exp/log/matmul, so 1e-5 bounds it with margin
    torch.testing.assert_close(got.double(), calibrator.transform(half.double()), rtol=0, atol=1e-5)


def test_logits_of_another_shape_are_refused(data):
    logits, targets = data
    cm = CalibratedModel(Identity(), TemperatureScaling().fit(logits, targets))  # K = 5
    with pytest.raises(ValueError, match=r"`model` returned logits of shape \(4, 3\).*\(N, 5\)"):
        cm(torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"`model` returned logits of shape \(4, 5, 2\)"):
        cm(torch.randn(4, 5, 2))
    with pytest.raises(TypeError, match="`model` must return floating logits"):
        cm(torch.ones(4, 5, dtype=torch.long))
