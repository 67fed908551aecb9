"""The C++ operators on non-finite and extreme inputs: a row holding a NaN or +inf logit has a NaN loss on every
path (never a finite number), rows of huge but finite logits keep their exact cross entropy, and an operator
called on rows of no entries raises instead of reading past them. Each case against an independent value (the
NaN of a log-sum-exp that meets a NaN, float64 references with the row's maximum subtracted first) or the plain
torch path."""

import subprocess
import sys

import pytest
import torch

import torchcal.functional as F
from torchcal.functional import _extension

pytestmark = pytest.mark.usefixtures("cpp_extension")

NAN, INF = float("nan"), float("inf")


def _nll_reference(z, y):
    """Per-row cross entropy of float32 logits in float64: log Σ exp(x − max) − (x_y − max)."""
    x = z.double()
    shifted = x - x.max(1, keepdim=True).values
    return shifted.logsumexp(1) - shifted.gather(1, y[:, None])[:, 0]


@pytest.mark.parametrize("value", [NAN, INF])
@pytest.mark.parametrize("base", [0, 1], ids=["nll", "focal"])
@pytest.mark.parametrize("shape", [(6, 10), (2, 10, 4, 4)], ids=["rows-as-lanes", "positions-as-lanes"])
def test_lane_rows_with_a_nan_or_inf_logit_have_a_nan_base_loss(shape, base, value):
    """float32 rows of at most 32 classes and (N, K, H, W) positions take the batch-term operator's lane
    kernels. A lane whose row holds a NaN (not its first entry: the row's maximum stays finite) or a +inf
    logit has a NaN exp sum; its log must stay NaN, and so its base loss (the row path's and torch's answer).
    log_positive read the NaN's bits as a number (~89.1): NLL 91.1 and a focal base of 0 for a NaN row, NLL
    +inf for a +inf row. The other rows keep their float64 reference."""
    g = torch.Generator().manual_seed(11)
    z = torch.randn(*shape, generator=g)
    y = torch.randint(0, shape[1], (shape[0], *shape[2:]), generator=g)
    y.view(-1)[0] = 2
    z[(0, 7) + (0,) * (len(shape) - 2)] = value  # row (position) 0, not its label, not its first entry
    out = torch.ops.torchcal.batch_terms_fwd.default(z, y, None, base, 2.0, 0.0, 0, False)
    got = out[0].reshape(-1)
    assert torch.isnan(got[0]), got[0].item()
    rows = z.movedim(1, -1).reshape(-1, shape[1])[1:]
    labels = y.reshape(-1)[1:]
    ce = _nll_reference(rows, labels)
    ref = ce if base == 0 else -((-torch.expm1(-ce)) ** 2) * -ce  # focal: −(1 − p_y)^γ log p_y, γ = 2
    # (the lanes' Σ exp is a float32 sum of K = 10 terms: within K·eps32 relative, so ~1e-6 in log Σ)
    torch.testing.assert_close(got[1:].double(), ref, rtol=1e-5, atol=1e-5)


def test_esd_with_a_held_out_part_and_a_nan_training_row_is_nan():
    """ESD's held-out part takes the rows after the split into the term only: a NaN logit in a training row
    reaches the loss through that row's cross entropy alone, which must be NaN ("mean" too), as on the torch
    path. The lane kernels gave it ~90 and a finite mean."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(8, 10, generator=g)
    y = torch.randint(0, 10, (8,), generator=g)
    y[0] = 1
    z[0, 9] = NAN
    values = {}
    for cpp in (True, False):
        with F.use_cpu_extension(cpp):
            values[cpp] = (F.esd_loss(z, y, holdout=0.5, reduction="none"), F.esd_loss(z, y, holdout=0.5))
    for cpp in (True, False):
        none, mean = values[cpp]
        assert torch.isnan(none[0]) and torch.isnan(mean), (cpp, none[0].item(), mean.item())
    # the other training rows: cross entropy + λ·sqrt(ESD⁺) of the held-out rows, the same on both paths
    # (float32 terms: a few ulp)
    torch.testing.assert_close(values[True][0][1:], values[False][0][1:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "dtype,offset",
    [(torch.float64, 1e15), (torch.float32, 1e30)],
    ids=["float64", "float32"],
)
@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 2, 2)], ids=["rows", "positions"])
def test_ace_cross_entropy_of_large_logits_is_exact(dtype, offset, shape):
    """mL1-ACE's operator takes the cross entropy as (max − x_y) + log Σ exp(x − max), the difference first:
    logits sharing a large offset (1e15 in float64, 1e30 in float32; rows of equal logits have CE = log K)
    keep their cross entropy. (log Σ + max) − x_y absorbed log Σ into the offset: CE 0 for a row of equal
    logits, off by up to half an ulp of the offset (0.0625 at 1e15) otherwise."""
    g = torch.Generator().manual_seed(2)
    small = torch.randint(0, 3, shape, generator=g).to(torch.float64)
    if dtype == torch.float32:
        small.zero_()  # (1e30 + 1 is 1e30 in float32: rows of equal logits)
    z = (small + offset).to(dtype)
    y = torch.randint(0, shape[1], (shape[0], *shape[2:]), generator=g)
    got = F.ml1ace_loss(z, y, 0.0, reduction="none")
    rows = z.double().movedim(1, -1).reshape(-1, shape[1])
    shifted = rows - rows.max(1, keepdim=True).values  # (exact: the entries are offset + 0, 1 or 2)
    ref = shifted.logsumexp(1) - shifted.gather(1, y.reshape(-1, 1))[:, 0]
    # float64: the reference's few roundings of log Σ; float32: the result's own rounding
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-7, "atol": 0.0}
    torch.testing.assert_close(got.reshape(-1).double(), ref, **tol)


@pytest.mark.parametrize("value", [NAN, INF])
def test_soft_ace_with_a_nan_probability_is_nan_on_both_paths(value):
    """A row with a NaN or +inf logit has NaN probabilities, whose image's mL1-ACE is NaN: every row's loss
    ("none") and the penalty are NaN with soft bins as with hard bins, on the torch path as on the C++
    operator. The torch path's soft bins turned floor(NaN) into an integer index (IndexError), and a bin whose
    count was NaN was taken for an empty one (a finite ACE without the NaN row)."""
    g = torch.Generator().manual_seed(4)
    z = torch.randn(5, 4, generator=g)
    y = torch.tensor([0, 1, 2, 3, 0])
    z[4, 1] = value
    for cpp in (True, False):
        with F.use_cpu_extension(cpp):
            for binning in ("soft", "hard"):
                loss = F.ml1ace_loss(z, y, binning=binning, reduction="none")
                assert torch.isnan(loss).all(), (cpp, binning, loss)
                assert torch.isnan(F.ml1ace_penalty(z, y, binning=binning)), (cpp, binning)


_EMPTY_ROWS = """
import sys, torch
torch.ops.load_library(sys.argv[1])
z, y = torch.zeros(3, 0, dtype=getattr(torch, sys.argv[3])), torch.zeros(3, dtype=torch.long)
params = torch.tensor([0, 0, 0, 1, 0, 0, 0, 0, 2.0], dtype=torch.float64)
calls = {
    "fused_true_class": lambda: torch.ops.torchcal.fused_true_class(z, y, params, None, 1),
    "top_label_scan": lambda: torch.ops.torchcal.top_label_scan(z, y, 10, 5),
    "logits_top_label": lambda: torch.ops.torchcal.logits_top_label(z, y, 10),
}
try:
    calls[sys.argv[2]]()
except ValueError as exc:
    print("ValueError:", exc)
    sys.exit(0)
print("no error")
sys.exit(1)
"""


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", ["fused_true_class", "top_label_scan", "logits_top_label"])
def test_row_operators_refuse_rows_of_no_classes(op, dtype):
    """The (N, K) operators read each row from its first entry: (N, 0) rows must raise a ValueError naming the
    argument, not read row[0] of an empty tensor (a segmentation fault: run in a child process). The public
    losses and metrics refuse K < 2 before the operators."""
    library = str(_extension._state["loaded"])
    proc = subprocess.run(
        [sys.executable, "-c", _EMPTY_ROWS, library, op, dtype], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-500:], proc.stderr[-500:])
    assert "at least one class" in proc.stdout
