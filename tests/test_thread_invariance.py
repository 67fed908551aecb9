"""Loss values and gradients that do not depend on torch's thread count.

torch's CPU sum of a long tensor splits the reduction between its threads, so its last bits change with the
thread count (``F.cross_entropy``'s own mean does not). Every reduction of a per-row loss adds through
``ordered_sum``, whose order is fixed by the size alone: the same bits on 1, 2 and 3 threads, on the C++ path
and the torch path. The sizes cross torch's one-thread limit of 32,768 entries and the 4096-entry blocks.
"""

from __future__ import annotations

import pytest
import torch

import torchcal.functional as F
from tests.conftest import for_thread_counts
from torchcal.functional import use_cpu_extension
from torchcal.functional._spec import ordered_softmax, ordered_sum

SIZES = (32_768, 40_961, 150_037)


@pytest.mark.parametrize("n", SIZES + (0, 1, 4096, 4097))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_ordered_sum_is_the_sum_to_its_rounding(n, dtype):
    """Against an exact float64 sum of the same numbers: within n·u of Σ|x| (any order of a float sum is),
    with u of float32 for the half dtypes, which add in float32 (as torch's sum), rounded once to the dtype."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype)
    exact = x.double().sum().item()
    got = ordered_sum(x)
    assert got.dtype == dtype and got.shape == ()
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    bound = n * torch.finfo(acc).eps * x.double().abs().sum().item() + abs(exact) * torch.finfo(dtype).eps
    assert abs(got.double().item() - exact) <= bound


def test_ordered_sum_keeps_the_gradient_and_other_shapes():
    x = torch.randn(300, 200, dtype=torch.float64, requires_grad=True)
    s = ordered_sum(x)
    s.backward()
    torch.testing.assert_close(s, x.detach().sum(), rtol=1e-13, atol=0)
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_ordered_sum_does_not_depend_on_the_thread_count(n, dtype):
    x = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    a, b, c = for_thread_counts(ordered_sum, x, counts=(1, 2, 3))
    assert torch.equal(a, b) and torch.equal(a, c)


N_ROWS, K = 40_961, 10


def _extra(name, g, n=N_ROWS):
    """The arguments a loss needs beyond logits and targets."""
    if name == "soft_avuc_loss":
        return {"temperature": 0.1, "kappa": 0.5}
    if name == "calfocal_loss":
        return {"bin_edges": torch.linspace(0, 1, 6), "bin_accuracy": torch.rand(5, generator=g)}
    if name == "varying_focal_loss":
        return {"gamma": torch.rand(n, generator=g) * 4 - 1}
    if name == "cals_loss":
        return {"lambdas": torch.rand(K, generator=g), "rhos": torch.rand(K, generator=g) + 0.5}
    return {}


def _takes_weight(name):
    """Whether the loss defines class weights (the batch-term losses refuse them: their penalty is a statistic
    of the whole batch)."""
    g = torch.Generator().manual_seed(0)
    try:
        getattr(F, name)(torch.randn(4, K), torch.arange(4), weight=torch.ones(K), **_extra(name, g, 4))
    except ValueError as err:
        assert "weight" in str(err)
        return False
    return True


def _cases():
    # the binary losses are left to the reduction's own test above: torch's sigmoid kernel itself can differ
    # in the last bit with the thread count (its vector tail falls at the threads' chunk edges)
    skip = ("focal_gamma_star", "mmce_penalty", "kde_xe_loss", "mmce_loss")  # (the last two are O(N²))
    cases = []
    for name in F.LOSS_FUNCTIONS:
        if name in skip or name.startswith("binary"):
            continue
        cases += [(name, "plain"), (name, "ignore")] + ([(name, "weight")] if _takes_weight(name) else [])
    return cases


@pytest.mark.parametrize("extension", [True, False])
@pytest.mark.parametrize(("name", "variant"), _cases())
def test_losses_do_not_depend_on_the_thread_count(name, variant, extension):
    """Value and gradient, bitwise, at 40,961 rows (above torch's one-thread limit), "mean" reduction: every
    loss plain, with ignored labels and, where it defines them, with class weights."""
    fn = getattr(F, name)
    g = torch.Generator().manual_seed(7)
    z = 3 * torch.randn(N_ROWS, K, generator=g)
    y = torch.randint(0, K, (N_ROWS,), generator=g)
    kwargs = _extra(name, g)
    if variant == "ignore":
        y[::5] = -100
        kwargs["ignore_index"] = -100
    if variant == "weight":
        kwargs["weight"] = torch.rand(K, generator=g) + 0.5

    def step():
        x = z.clone().requires_grad_(True)
        loss = fn(x, y, **kwargs)
        loss.backward()
        return loss.detach(), x.grad

    with use_cpu_extension(extension):
        results = for_thread_counts(step, counts=(1, 2, 3))
    for loss, grad in results[1:]:
        assert torch.equal(loss, results[0][0]), (loss.item(), results[0][0].item())
        assert torch.equal(grad, results[0][1])


@pytest.mark.parametrize("shape", [(150_037, 3), (40_961, 19), (9000, 5)])
def test_ordered_column_sums(shape):
    """Over the first dimension: the float64 column sums to float32's rounding (n·u of Σ|x|), and the same
    bits on 1, 2 and 3 threads."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    got = ordered_sum(x, 0)
    exact = x.double().sum(0)
    bound = shape[0] * torch.finfo(torch.float32).eps * x.double().abs().sum(0)
    assert got.shape == (shape[1],) and bool(((got.double() - exact).abs() <= bound).all())
    a, b, c = for_thread_counts(ordered_sum, x, 0, counts=(1, 2, 3))
    assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(ValueError, match="`dim` must be None or 0"):
        ordered_sum(x, 1)


@pytest.mark.parametrize("k", [3, 10, 15, 100])
def test_ordered_softmax(k):
    """torch.softmax's values bit for bit; a gradient within float32 rounding of torch's (the same formula
    p(g − Σ g p), its row sum in another order: |Σ g p| + |g| times a few ulps, bounded here by 1e-6 of the
    entries' scale), the same bits on 1, 2 and 3 threads (torch's own CPU softmax backward differs in the
    last bit on AVX2 CPUs at these row widths), and second derivatives in float64."""
    g = torch.Generator().manual_seed(k)
    z = 3 * torch.randn(40_961, k, generator=g)
    go = torch.randn(40_961, k, generator=g)

    def grad_of(fn):
        x = z.clone().requires_grad_(True)
        out = fn(x)
        out.backward(go)
        return out.detach(), x.grad

    mine, theirs = grad_of(ordered_softmax), grad_of(lambda x: torch.softmax(x, 1))
    assert torch.equal(mine[0], theirs[0])
    torch.testing.assert_close(mine[1], theirs[1], rtol=0, atol=1e-6 * go.abs().max().item())
    a, b, c = for_thread_counts(lambda: grad_of(ordered_softmax)[1], counts=(1, 2, 3))
    assert torch.equal(a, b) and torch.equal(a, c)
    x = torch.randn(5, min(k, 6), dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradgradcheck(ordered_softmax, (x,))
    assert torch.autograd.gradcheck(ordered_softmax, (x,), check_forward_ad=True, check_batched_grad=True)
    v = torch.randn_like(x)
    _, tangent = torch.func.jvp(ordered_softmax, (x,), (v,))
    torch.testing.assert_close(tangent, torch.func.jvp(lambda u: torch.softmax(u, 1), (x,), (v,))[1])


BATCH_TERMS = ["mdca_loss", "dca_loss", "sbece_loss", "avuc_loss", "soft_avuc_loss", "esd_loss", "cals_loss"]


@pytest.mark.parametrize("name", BATCH_TERMS)
def test_batch_statistics_do_not_depend_on_the_thread_count(name):
    """The torch path's column sums and batch statistics at 150,037 rows × 19 classes (every block size and
    torch's parallel matrix products in play), with ignored labels; and CALS's update statistics."""
    g = torch.Generator().manual_seed(3)
    n, k = 150_037, 19
    z = 3 * torch.randn(n, k, generator=g)
    y = torch.randint(0, k, (n,), generator=g)
    y[::7] = -100
    kwargs = {"temperature": 0.1, "kappa": 0.5} if name == "soft_avuc_loss" else {}
    if name == "cals_loss":
        kwargs = {"lambdas": torch.rand(k, generator=g), "rhos": torch.rand(k, generator=g) + 0.5}

    def step():
        x = z.clone().requires_grad_(True)
        loss = getattr(F, name)(x, y, ignore_index=-100, **kwargs)
        loss.backward()
        extra = F.cals_statistics(z, y, kwargs["lambdas"], kwargs["rhos"]) if name == "cals_loss" else None
        return loss.detach(), x.grad, extra

    with use_cpu_extension(False):
        results = for_thread_counts(step, counts=(1, 2, 3))
    for loss, grad, extra in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1])
        assert extra is None or torch.equal(extra, results[0][2])


METRICS = ["ece", "adaece", "classwise_ece", "debiased_ece", "mce", "brier_score", "root_brier_score", "nll",
           "error_rate", "signed_calibration_error", "ks_calibration_error", "kuiper_calibration_error", "aurc",
           "augrc", "brier_decomposition", "log_score_decomposition", "calibration_error_direction"]  # fmt: skip


@pytest.mark.parametrize("extension", [True, False])
@pytest.mark.parametrize("name", METRICS)
def test_metrics_do_not_depend_on_the_thread_count(name, extension):
    """Every float of the result, bitwise, on 1, 2 and 3 threads, at 150,037 rows (ties included: 3-decimal
    confidences) from probabilities and, where the metric takes them, logits."""
    g = torch.Generator().manual_seed(5)
    n, k = 150_037, 10
    z = 3 * torch.randn(n, k, generator=g)
    probs = z.softmax(1).double()
    probs = probs.round(decimals=3)
    probs = probs / probs.sum(1, keepdim=True)
    y = torch.randint(0, k, (n,), generator=g)
    fn = getattr(F, name)

    def floats(result):
        if isinstance(result, torch.Tensor):
            return [result]
        return [v for v in (result._asdict().values() if hasattr(result, "_asdict") else result)
                if isinstance(v, torch.Tensor)]  # fmt: skip

    def step():
        out = floats(fn(probs, y))
        if name in ("ece", "nll", "brier_score", "aurc"):
            out += floats(fn(z, y, from_logits=True))
        return out

    with use_cpu_extension(extension):
        results = for_thread_counts(step, counts=(1, 2, 3))
    for other in results[1:]:
        assert len(other) == len(results[0])
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b), (a, b)
