"""The fused linear head + loss (torchcal.functional.fused_linear_loss) against the unfused
loss(hidden @ weight.T + bias, targets), the per-sample float64 reference, and numerical gradients."""

from __future__ import annotations

import math

import pytest
import torch

from torchcal import adafocal, losses
from torchcal.functional import fused_linear_loss
from torchcal.functional import losses as L

from .reference import losses as R

IGNORE = -100

# name -> (unfused functional loss, its keyword arguments, per-sample reference or None)
CASES = {
    "cross_entropy": (L.cross_entropy, {}, lambda z, t: R.ce(z, t)),
    "label_smoothing": (
        lambda z, t, **kw: L.label_smoothing_loss(
            z, t, kw["epsilon"], reduction=kw["reduction"], weight=kw.get("weight")
        ),
        {"epsilon": 0.1},
        lambda z, t: R.ce(z, t, 0.1),
    ),
    "brier": (L.brier_loss, {}, R.brier),
    "focal": (L.focal_loss, {"gamma": 3.0}, lambda z, t: R.focal(z, t, 3.0)),
    "inverse_focal": (L.inverse_focal_loss, {"gamma": 1.5}, lambda z, t: R.inverse_focal(z, t, 1.5)),
    "sample_dependent_focal": (L.sample_dependent_focal_loss, {}, lambda z, t: R.flsd(z, t, (5, 3), (0.2,))),
    "dual_focal": (L.dual_focal_loss, {"gamma": 5.0}, lambda z, t: R.dfl(z, t, 5.0)),
    "dual_sample_dependent_focal": (
        L.dual_sample_dependent_focal_loss,
        {},
        lambda z, t: R.dual_flsd(z, t, (5, 3), (0.2,)),
    ),
    "focal_calibration": (
        L.focal_calibration_loss,
        {"gamma": 4.0, "lambda_": 1.5},
        lambda z, t: R.fcl(z, t, 4.0, 1.5),
    ),
}


def _unfused(name, logits, targets, reduction, class_weight=None):
    fn, kwargs, _ = CASES[name]
    if class_weight is not None:
        kwargs = {**kwargs, "weight": class_weight}
    return fn(logits, targets, **kwargs, reduction=reduction)


def _class_weight(v, seed=5):
    """Class weights in [0.2, 2.2): far enough from 1 that a dropped or misapplied weight shows."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(v, generator=g, dtype=torch.float64) * 2 + 0.2


def _inputs(dtype, n=(3, 7), h=6, v=11, bias=True, seed=0, scale=1.5):
    """(B, T, H) hidden states, a (V, H) head and (B, T) labels with about a quarter ignored."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(*n, h, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    b = torch.randn(v, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, v, n, generator=g)
    targets[torch.rand(n, generator=g) < 0.25] = IGNORE
    targets.view(-1)[0] = IGNORE  # at least one ignored token
    return hidden, weight, b, targets


def _logits(hidden, weight, bias):
    """The unfused head with the classes at dimension 1, as the losses take (N, K, d1, ...) inputs."""
    z = hidden @ weight.T
    if bias is not None:
        z = z + bias
    return z.movedim(-1, 1)


def _params(hidden, weight, bias):
    return tuple(x for x in (hidden, weight, bias) if x is not None)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("vocab_chunk_size", [None, 4])
def test_float64_value_and_gradients_equal_the_unfused_loss(name, reduction, vocab_chunk_size):
    # float64: the fused and unfused computations differ only in summation order and in exp(z − m)/s
    # against exp(z − m − log s), each a few ulps (2.2e-16) of values of order 10, so 1e-10 holds with margin
    hidden, weight, bias, targets = _inputs(torch.float64, bias=name != "focal")
    _, kwargs, _ = CASES[name]
    fused = fused_linear_loss(
        hidden,
        weight,
        targets,
        name,
        bias=bias,
        chunk_size=5,
        vocab_chunk_size=vocab_chunk_size,
        reduction=reduction,
        **kwargs,
    )
    unfused = _unfused(name, _logits(hidden, weight, bias), targets, reduction)
    torch.testing.assert_close(fused, unfused, rtol=1e-10, atol=1e-10)
    out = torch.randn_like(unfused)
    params = _params(hidden, weight, bias)
    for a, b in zip(torch.autograd.grad(fused, params, out), torch.autograd.grad(unfused, params, out)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_value_equals_the_per_sample_reference(name):
    hidden, weight, bias, targets = _inputs(torch.float64, n=(13,), v=9)
    _, kwargs, reference = CASES[name]
    fused = fused_linear_loss(
        hidden, weight, targets, name, bias=bias, chunk_size=4, reduction="none", **kwargs
    )
    keep = targets != IGNORE
    z = (hidden @ weight.T + bias).detach()
    expected = torch.zeros(13, dtype=torch.float64)
    expected[keep] = torch.tensor(reference(z[keep], targets[keep]), dtype=torch.float64)
    torch.testing.assert_close(fused.detach(), expected, rtol=1e-12, atol=1e-12)


def _float32_error_budget(name, reduction):
    """Errors of fused and unfused float32 against the float64 truth for one loss."""
    h64, w64, b64, targets = _inputs(torch.float64, n=(4, 33), h=32, v=300, seed=1)
    truth = _unfused(name, _logits(h64, w64, b64), targets, reduction)
    out = torch.randn(truth.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    true_grads = torch.autograd.grad(truth, (h64, w64, b64), out)
    h, w, b = (x.detach().float().requires_grad_() for x in (h64, w64, b64))
    _, kwargs, _ = CASES[name]
    results = {}
    for path in ("fused", "unfused"):
        if path == "fused":
            value = fused_linear_loss(
                h, w, targets, name, bias=b, chunk_size=37, reduction=reduction, **kwargs
            )
        else:
            value = _unfused(name, _logits(h, w, b), targets, reduction)
        grads = torch.autograd.grad(value, (h, w, b), out.float())
        results[path] = [
            (a.double() - t).abs().max().item() for a, t in zip((value, *grads), (truth, *true_grads))
        ]
    scales = [x.abs().max().item() for x in (truth, *true_grads)]
    return results, scales


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_float32_is_as_accurate_as_the_unfused_float32_loss(name, reduction):
    # The fused path performs the unfused float32 computation's operations in another order (chunked
    # matmuls, the softmax as exp(z − m)/s): its rounding error is of the same size. Both are measured
    # against the float64 truth; the fused error may be up to 4x the unfused one (different summation
    # orders of 32 + 300 terms), plus 8 float32 ulps (2^-23) of the largest value for the final roundings.
    results, scales = _float32_error_budget(name, reduction)
    for fused, unfused, scale in zip(results["fused"], results["unfused"], scales):
        assert fused <= 4 * unfused + 8 * 2**-23 * scale, (results, scales)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("vocab_chunk_size", [None, 4])
def test_class_weights_equal_the_weighted_unfused_loss(name, reduction, vocab_chunk_size):
    # float64, the same operations as the unweighted test above (the weights add one product per row or
    # class): 1e-10 holds with margin
    hidden, weight, bias, targets = _inputs(torch.float64)
    cw = _class_weight(11)
    _, kwargs, _ = CASES[name]
    fused = fused_linear_loss(
        hidden,
        weight,
        targets,
        name,
        bias=bias,
        chunk_size=5,
        vocab_chunk_size=vocab_chunk_size,
        reduction=reduction,
        class_weight=cw,
        **kwargs,
    )
    unfused = _unfused(name, _logits(hidden, weight, bias), targets, reduction, cw)
    torch.testing.assert_close(fused, unfused, rtol=1e-10, atol=1e-10)
    out = torch.randn_like(unfused)
    params = _params(hidden, weight, bias)
    for a, b in zip(torch.autograd.grad(fused, params, out), torch.autograd.grad(unfused, params, out)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_class_weights_equal_the_per_sample_reference(reduction):
    # float64 against plain-Python float64 sums over 9 classes: a few ulps of values of order 10, so 1e-12
    hidden, weight, bias, targets = _inputs(torch.float64, n=(13,), v=9)
    cw = _class_weight(9)
    keep = targets != IGNORE
    z = (hidden @ weight.T + bias).detach()
    safe = torch.where(keep, targets, 0)  # the reference reads a label on every row; ignored rows add 0
    for name, kwargs, per_row, scale in (
        # F.cross_entropy's smoothed weighting: Σ_k w_k q'_k (−log p_k) per row, "mean" over Σ w_y
        (
            "label_smoothing",
            {"epsilon": 0.1},
            R.soft_general(z, R.smoothed(safe, 9, 0.1), lambda pj, j: -math.log(pj), cw),
            False,
        ),
        ("focal", {"gamma": 2.0}, R.focal(z, safe, 2.0), True),  # w_y · focal, "mean" over Σ w_y
        ("dual_focal", {"gamma": 2.0}, R.dfl(z, safe, 2.0), True),
    ):
        fused = fused_linear_loss(
            hidden, weight, targets, name, bias=bias, chunk_size=4, reduction=reduction, class_weight=cw,
            **kwargs,
        )  # fmt: skip
        expected = torch.tensor(
            R.reduce_weighted(per_row, targets, cw, reduction, scale=scale), dtype=torch.float64
        )
        torch.testing.assert_close(fused.detach(), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "name",
    ["cross_entropy", "label_smoothing", "brier", "focal", "sample_dependent_focal", "focal_calibration"],
)
def test_soft_targets_with_class_weights_equal_the_unfused_loss(name):
    # float64, as test_soft_targets_equal_the_unfused_loss
    hidden, weight, bias, _ = _inputs(torch.float64, n=(2, 5), v=8)
    g = torch.Generator().manual_seed(3)
    q = torch.softmax(torch.randn(2, 5, 8, generator=g, dtype=torch.float64) * 2, dim=-1)
    cw = _class_weight(8)
    _, kwargs, _ = CASES[name]
    for reduction in ("mean", "sum"):
        fused = fused_linear_loss(
            hidden, weight, q, name, bias=bias, chunk_size=3, reduction=reduction, class_weight=cw, **kwargs
        )
        unfused = _unfused(name, _logits(hidden, weight, bias), q.movedim(-1, 1), reduction, cw)
        torch.testing.assert_close(fused, unfused, rtol=1e-10, atol=1e-12)
        params = (hidden, weight, bias)
        for a, b in zip(torch.autograd.grad(fused, params), torch.autograd.grad(unfused, params)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # Σ_k w_k q_k f(p_k) + λ·(Σ_k w_k q_k)·Σ_k (p_k − q_k)² per row, "mean" over the rows (plain Python)
    z = (hidden @ weight.T + bias).detach().reshape(10, 8)
    rows = R.soft_general(z, q.reshape(10, 8).tolist(), R.focal_term(4.0), cw, lam=1.5)
    fused = fused_linear_loss(hidden, weight, q, "focal_calibration", bias=bias, class_weight=cw)
    torch.testing.assert_close(fused.detach(), torch.tensor(math.fsum(rows) / 10, dtype=torch.float64))


def test_backward_with_create_graph_raises():
    # the gradients are made in the forward pass: a graph of them would miss the second derivative
    hidden, weight, bias, targets = _inputs(torch.float64, n=(6,), v=5)
    for reduction in ("mean", "none"):
        value = fused_linear_loss(hidden, weight, targets, "focal", bias=bias, reduction=reduction)
        with pytest.raises(RuntimeError, match="differentiable once only"):
            torch.autograd.grad(value.sum(), hidden, create_graph=True)
    value = fused_linear_loss(hidden, weight, targets, "focal", bias=bias)
    (grad,) = torch.autograd.grad(value, hidden)  # a first-order gradient is unaffected
    (expected,) = torch.autograd.grad(L.focal_loss(hidden @ weight.T + bias, targets, 3.0), hidden)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)


def test_targets_and_class_weights_requiring_grad_are_refused():
    hidden, weight, _, _ = _inputs(torch.float64, n=(4,), v=5)
    q = torch.full((4, 5), 0.2, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="`targets` requires grad.*detach"):
        fused_linear_loss(hidden, weight, q, "cross_entropy")
    cw = torch.ones(5, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="`class_weight` requires grad.*detach"):
        fused_linear_loss(hidden, weight, torch.tensor([0, 1, 2, 3]), class_weight=cw)
    value = fused_linear_loss(hidden, weight, q.detach(), "cross_entropy")  # detached: accepted
    assert value.requires_grad


def test_chunk_sizes_do_not_change_the_result():
    hidden, weight, bias, targets = _inputs(torch.float64, n=(2, 9), v=13)
    values = [
        fused_linear_loss(
            hidden, weight, targets, "dual_focal", bias=bias, chunk_size=c, vocab_chunk_size=vc, gamma=2.0
        )
        for c, vc in ((1, None), (4, 5), (18, 13), (100, 1))
    ]
    for value in values[1:]:
        torch.testing.assert_close(value, values[0], rtol=1e-13, atol=0)


def test_gradcheck_small_cases():
    for name, kwargs, vchunk in (
        ("focal_calibration", {"gamma": 2.0, "lambda_": 0.5}, 3),
        ("dual_focal", {"gamma": 2.0}, None),
        ("label_smoothing", {"epsilon": 0.2}, 2),
        ("sample_dependent_focal", {}, 4),
    ):
        hidden, weight, bias, targets = _inputs(torch.float64, n=(5,), h=3, v=7, scale=0.7)

        def fn(h, w, b, name=name, kwargs=kwargs, vchunk=vchunk, targets=targets):
            return fused_linear_loss(
                h, w, targets, name, bias=b, chunk_size=2, vocab_chunk_size=vchunk, **kwargs
            )

        assert torch.autograd.gradcheck(fn, (hidden, weight, bias))

        def per_token(h, w, b, name=name, kwargs=kwargs, targets=targets):
            return fused_linear_loss(h, w, targets, name, bias=b, chunk_size=3, reduction="none", **kwargs)

        assert torch.autograd.gradcheck(per_token, (hidden, weight, bias))


def test_adafocal_and_per_token_gamma_equal_the_stateful_losses():
    hidden, weight, bias, targets = _inputs(torch.float64, n=(4, 8), v=10)
    for dual in (False, True):
        z = _logits(hidden, weight, bias)
        module = adafocal.AdaFocalLoss(n_bins=4, dual=dual)
        module.gamma_per_bin.copy_(torch.tensor([-1.5, 0.5, 3.0, 1.0], dtype=torch.float64))
        module.bin_edges.copy_(torch.tensor([0.0, 0.05, 0.2, 0.6, 1.0], dtype=torch.float64))
        fused = fused_linear_loss(
            hidden,
            weight,
            targets,
            "adafocal",
            bias=bias,
            chunk_size=7,
            vocab_chunk_size=3,
            bin_edges=module.bin_edges,
            bin_gammas=module.gamma_per_bin,
            dual=dual,
        )
        unfused = module(z, targets)
        torch.testing.assert_close(fused, unfused, rtol=1e-10, atol=1e-12)
        params = (hidden, weight, bias)
        for a, b in zip(torch.autograd.grad(fused, params), torch.autograd.grad(unfused, params)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    gamma = torch.linspace(-2, 4, 32, dtype=torch.float64).reshape(4, 8)
    z = _logits(hidden, weight, bias)
    fused = fused_linear_loss(
        hidden, weight, targets, "varying_focal", bias=bias, gamma=gamma, reduction="sum"
    )
    unfused = L.varying_focal_loss(z, targets, gamma, reduction="sum")
    torch.testing.assert_close(fused, unfused, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "name",
    ["cross_entropy", "label_smoothing", "brier", "focal", "sample_dependent_focal", "focal_calibration"],
)
def test_soft_targets_equal_the_unfused_loss(name):
    hidden, weight, bias, _ = _inputs(torch.float64, n=(2, 5), v=8)
    g = torch.Generator().manual_seed(3)
    q = torch.softmax(torch.randn(2, 5, 8, generator=g, dtype=torch.float64) * 2, dim=-1)
    _, kwargs, _ = CASES[name]
    fused = fused_linear_loss(hidden, weight, q, name, bias=bias, chunk_size=3, **kwargs)
    unfused = _unfused(name, _logits(hidden, weight, bias), q.movedim(-1, 1), "mean")
    torch.testing.assert_close(fused, unfused, rtol=1e-10, atol=1e-12)
    params = (hidden, weight, bias)
    for a, b in zip(torch.autograd.grad(fused, params), torch.autograd.grad(unfused, params)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_soft_targets_are_refused_where_the_loss_needs_a_true_class():
    hidden, weight, _, _ = _inputs(torch.float64, n=(4,), v=5)
    q = torch.full((4, 5), 0.2, dtype=torch.float64)
    for name, kwargs in (
        ("dual_focal", {}),
        ("dual_sample_dependent_focal", {}),
        ("varying_focal", {"gamma": torch.ones(4)}),
        ("adafocal", {"bin_edges": [0.0, 0.5, 1.0], "bin_gammas": [1.0, 2.0]}),
    ):
        with pytest.raises(TypeError, match="soft .* not accepted"):
            fused_linear_loss(hidden, weight, q, name, **kwargs)
    with pytest.raises(ValueError, match="vocab_chunk_size.*integer labels"):
        fused_linear_loss(hidden, weight, q, "focal", vocab_chunk_size=2)


def test_ignored_tokens_are_dropped_before_the_matmul():
    # their hidden states never enter the computation: NaN there changes nothing, and their gradient is 0
    hidden, weight, bias, targets = _inputs(torch.float64, n=(3, 6), v=9)
    ignored = targets == IGNORE
    poisoned = hidden.detach().clone()
    poisoned[ignored] = math.nan
    poisoned.requires_grad_()
    for reduction in ("mean", "none"):
        clean = fused_linear_loss(hidden, weight, targets, "focal", bias=bias, reduction=reduction)
        dirty = fused_linear_loss(poisoned, weight, targets, "focal", bias=bias, reduction=reduction)
        torch.testing.assert_close(dirty, clean, rtol=0, atol=0)
        (grad,) = torch.autograd.grad(dirty.sum(), poisoned)
        assert torch.equal(grad[ignored], torch.zeros_like(grad[ignored]))
        assert torch.isfinite(grad).all()
        if reduction == "none":
            assert torch.equal(dirty[ignored], torch.zeros_like(dirty[ignored]))


def test_every_token_ignored():
    hidden, weight, bias, targets = _inputs(torch.float64, n=(2, 3), v=5)
    targets = torch.full_like(targets, IGNORE)
    mean = fused_linear_loss(hidden, weight, targets, "focal", bias=bias)
    assert math.isnan(mean.item())  # as F.cross_entropy: 0 / 0
    total = fused_linear_loss(hidden, weight, targets, "focal", bias=bias, reduction="sum")
    assert total.item() == 0
    none = fused_linear_loss(hidden, weight, targets, "focal", bias=bias, reduction="none")
    assert torch.equal(none, torch.zeros(2, 3, dtype=torch.float64))
    for value in (mean, total, none.sum()):
        for grad in torch.autograd.grad(value, (hidden, weight, bias)):
            assert torch.equal(grad, torch.zeros_like(grad))


def test_bfloat16_inputs_accumulate_in_float32():
    # The reference is the float32 computation on the bfloat16 values: fused bfloat16 must match it to
    # float32 rounding (the loss is returned in float32), and its gradients, returned in bfloat16, to one
    # bfloat16 rounding (relative 2^-8) of the float32 gradients.
    h64, w64, b64, targets = _inputs(torch.float64, n=(4, 16), h=16, v=50)
    h, w, b = (x.detach().bfloat16().requires_grad_() for x in (h64, w64, b64))
    h32, w32, b32 = (x.detach().float().requires_grad_() for x in (h, w, b))
    fused = fused_linear_loss(h, w, targets, "sample_dependent_focal", bias=b, chunk_size=16)
    assert fused.dtype == torch.float32
    reference = L.sample_dependent_focal_loss(_logits(h32, w32, b32), targets)
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(fused, (h, w, b))
    for grad, x, expected in zip(grads, (h, w, b), torch.autograd.grad(reference, (h32, w32, b32))):
        assert grad.dtype == x.dtype == torch.bfloat16
        torch.testing.assert_close(
            grad.float(), expected, rtol=2**-8, atol=2**-8 * expected.abs().max().item()
        )


def test_autocast_regions_and_mixed_precision():
    # autocast does not lower the fused computation: float32 inputs give the float32 result bit for bit, and
    # bfloat16 hidden states (what an autocast region hands to the head) with a float32 head are computed in
    # float32 from their values, gradients returned in each input's dtype
    hidden, weight, bias, targets = _inputs(torch.float32, n=(4, 8), h=8, v=20)
    plain = fused_linear_loss(hidden, weight, targets, "focal", bias=bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = fused_linear_loss(hidden, weight, targets, "focal", bias=bias)
        grads = torch.autograd.grad(inside, (hidden, weight, bias))
    assert torch.equal(inside, plain)
    for a, b in zip(grads, torch.autograd.grad(plain, (hidden, weight, bias))):
        assert torch.equal(a, b)
    low = hidden.detach().bfloat16().requires_grad_()
    mixed = fused_linear_loss(low, weight, targets, "focal", bias=bias)
    reference = fused_linear_loss(low.detach().float(), weight, targets, "focal", bias=bias)
    torch.testing.assert_close(mixed, reference, rtol=0, atol=0)
    grad_low, grad_weight = torch.autograd.grad(mixed, (low, weight))
    assert grad_low.dtype == torch.bfloat16 and grad_weight.dtype == torch.float32


def test_no_grad_and_partial_requires_grad():
    hidden, weight, bias, targets = _inputs(torch.float64, n=(10,), v=6)
    with torch.no_grad():
        value = fused_linear_loss(hidden, weight, targets, "focal", bias=bias)
    assert value.grad_fn is None
    frozen = weight.detach()
    value = fused_linear_loss(hidden, frozen, targets, "focal")
    (grad,) = torch.autograd.grad(value, hidden)
    (expected,) = torch.autograd.grad(L.focal_loss(hidden @ frozen.T, targets), hidden)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)


def test_bad_arguments_raise_named_errors():
    hidden, weight, bias, targets = _inputs(torch.float64, n=(4,), v=5)
    with pytest.raises(ValueError, match="`loss` must be one of"):
        fused_linear_loss(hidden, weight, targets, "mmce")
    with pytest.raises(TypeError, match="takes the keyword arguments"):
        fused_linear_loss(hidden, weight, targets, "focal", gama=2.0)
    with pytest.raises(TypeError, match="needs the keyword arguments"):
        fused_linear_loss(hidden, weight, targets, "varying_focal")
    with pytest.raises(ValueError, match="`gamma` must be >= 0"):
        fused_linear_loss(hidden, weight, targets, "focal", gamma=-1.0)
    with pytest.raises(ValueError, match="`weight` must have shape"):
        fused_linear_loss(hidden, weight[:, :3], targets)
    with pytest.raises(TypeError, match="`weight` must have hidden's dtype"):
        fused_linear_loss(hidden, weight.float(), targets)
    with pytest.raises(TypeError, match="`bias` must have hidden's dtype"):
        fused_linear_loss(hidden.float(), weight.float(), targets, bias=bias)
    with pytest.raises(ValueError, match="`bias` must have shape"):
        fused_linear_loss(hidden, weight, targets, bias=bias[:3])
    with pytest.raises(ValueError, match="`targets` must have shape"):
        fused_linear_loss(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="label"):
        fused_linear_loss(hidden, weight, torch.tensor([0, 1, 5, 2]))
    with pytest.raises(ValueError, match="`chunk_size` must be >= 1"):
        fused_linear_loss(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="`reduction` must be one of"):
        fused_linear_loss(hidden, weight, targets, reduction="avg")
    with pytest.raises(ValueError, match="`gamma` must have shape"):
        fused_linear_loss(hidden, weight, targets, "varying_focal", gamma=torch.ones(3))


def test_fused_linear_loss_module_follows_the_wrapped_loss():
    hidden, weight, bias, targets = _inputs(torch.float64, n=(3, 5), v=7)
    z = _logits(hidden, weight, bias)
    for name in (
        "ce",
        "ls-0.05",
        "brier",
        "fl-3",
        "ifl-1",
        "flsd-53",
        "flsd-532",
        "dfl",
        "dualflsd-53",
        "fcl",
    ):
        inner = losses.create(name, reduction="sum")
        fused = losses.FusedLinearLoss(inner, chunk_size=4)(hidden, weight, targets, bias)
        torch.testing.assert_close(fused, inner(z, targets), rtol=1e-10, atol=1e-12)
    scheduled = losses.create("fls-531")
    scheduled.set_epoch(120)  # γ = 3 from epoch 100
    fused = losses.FusedLinearLoss(scheduled)(hidden, weight, targets, bias)
    torch.testing.assert_close(fused, L.focal_loss(z, targets, 3.0), rtol=1e-10, atol=1e-12)
    ada = losses.FusedLinearLoss("adafocal", n_bins=3)
    before = ada(hidden, weight, targets, bias)
    torch.testing.assert_close(before, ada.loss(z, targets), rtol=1e-10, atol=1e-12)
    ada.loss.update(
        torch.softmax(z.detach().movedim(1, -1).reshape(-1, 7), 1), targets.reshape(-1).clamp(min=0)
    )
    after = ada(hidden, weight, targets, bias)  # the updated γ per bin is used
    torch.testing.assert_close(after, ada.loss(z, targets), rtol=1e-10, atol=1e-12)
    assert not torch.equal(before, after)
    assert "loss.gamma_per_bin" in ada.state_dict()
    with pytest.raises(TypeError, match="MMCE"):
        losses.FusedLinearLoss("mmce")


def test_fused_linear_loss_module_takes_class_weights_and_refuses_other_smoothing():
    # float64, the same computation as test_class_weights_equal_the_weighted_unfused_loss: 1e-10
    hidden, weight, bias, targets = _inputs(torch.float64, n=(3, 5), v=7)
    cw = _class_weight(7)
    for inner in (
        losses.CrossEntropyLoss(weight=cw),
        losses.CrossEntropyLoss(weight=cw, label_smoothing=0.1),
        losses.FocalLoss(2.0, weight=cw),
        losses.DualFocalLoss(weight=cw),
        losses.FocalCalibrationLoss(weight=cw),
        adafocal.AdaFocalLoss(n_bins=3, weight=cw),
    ):
        fused = losses.FusedLinearLoss(inner, chunk_size=4)(hidden, weight, targets, bias)
        unfused = inner(_logits(hidden, weight, bias), targets)
        torch.testing.assert_close(fused, unfused, rtol=1e-10, atol=1e-12)
        params = (hidden, weight, bias)
        for a, b in zip(torch.autograd.grad(fused, params), torch.autograd.grad(unfused, params)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for inner in (
        losses.FocalLoss(2.0, label_smoothing=0.1),
        losses.BrierLoss(label_smoothing=0.1),
        losses.SampleDependentFocalLoss(label_smoothing=0.1),
    ):
        with pytest.raises(ValueError, match=f"{type(inner).__name__} with label_smoothing=0.1"):
            losses.FusedLinearLoss(inner)
    changed = losses.FusedLinearLoss(losses.FocalLoss(2.0))
    changed.loss.label_smoothing = 0.1  # read at every call, as the other hyper-parameters
    with pytest.raises(ValueError, match="label_smoothing"):
        changed(hidden, weight, targets, bias)


class _LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest number of elements of any tensor an operator produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, tuple | list) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


@pytest.mark.parametrize("vocab_chunk_size", [None, 500])
def test_no_tensor_of_all_the_logits_is_ever_made(vocab_chunk_size):
    # 256 tokens, V = 3,000, H = 16, chunks of 32 tokens: no operator output of forward + backward may
    # exceed the larger of the weight gradient (V × H) and one chunk's logits (32 × V, or 32 × 500 with
    # vocabulary blocks) — far below the N × V logits, which the unfused path does make
    hidden, weight, bias, targets = _inputs(torch.float32, n=(256,), h=16, v=3000)
    bound = max(3000 * 16, 32 * (vocab_chunk_size or 3000))
    for name in ("cross_entropy", "dual_focal", "focal_calibration"):
        with _LargestTensor() as mode:
            fused_linear_loss(
                hidden, weight, targets, name, bias=bias, chunk_size=32, vocab_chunk_size=vocab_chunk_size
            ).backward()
        assert mode.largest <= bound < 256 * 3000, (name, mode.largest)
    with _LargestTensor() as mode:
        _unfused("dual_focal", _logits(hidden, weight, bias), targets, "mean").backward()
    assert mode.largest >= 256 * 3000  # the check sees the logits when they are made
