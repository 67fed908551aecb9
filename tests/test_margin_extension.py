"""The C++ operator of the row-wise margin losses (MbLS, MaxSup, ACLS, the confidence penalty, CALS and
Poly-1; torch.ops.torchcal.fused_margin and fused_margin_class) against the plain torch path and the float64
loop references: values and gradients at (N, K) and (N, K, d1, ...), ignored labels, the three reductions,
ties in the maximum, CALS's training statistics and multiplier update, Poly-1's class weights, the label
errors, threads, the torch.compile operators and the cases it leaves to the torch path."""

import pytest
import torch

import torchcal.functional as F
from tests.conftest import for_thread_counts
from tests.test_margin_losses import CASES, batch
from torchcal.losses import CALSLoss

pytestmark = pytest.mark.usefixtures("cpp_extension")

FUSED = ("mbls", "acls", "cp", "maxsup", "cals", "poly1")
FUSED_CASES = [c for c in CASES if c[0].startswith(FUSED)]
EPS32 = torch.finfo(torch.float32).eps


def _cals_params(k, seed=5):
    """λ (K,) in [0, 2) with one flat class (1e-6) and ρ (K,) in [1, 4): float64, as CALSLoss holds them."""
    g = torch.Generator().manual_seed(seed)
    lam = 2 * torch.rand(k, generator=g, dtype=torch.float64)
    lam[0] = 1e-6
    return lam, 1 + 3 * torch.rand(k, generator=g, dtype=torch.float64)


def _cals(z, y, margin=3.0, **kw):
    lam, rho = _cals_params(z.shape[1])
    return F.cals_loss(z, y, lam, rho, margin, **kw)


def _class_weight(z):
    return torch.linspace(0.25, 2.0, z.shape[1], dtype=z.dtype)

# the fused losses with float32-friendly options (margin 3, so that hinges are active at unit-scale logits)
LOSSES = {
    "mbls": lambda z, y, **kw: F.logit_margin_l1_loss(z, y, 3.0, 0.5, **kw),
    "mbls-drop": lambda z, y, **kw: F.logit_margin_l1_loss(z, y, 3.0, 0.5, ignored_rows="drop", **kw),
    "maxsup": lambda z, y, **kw: F.maxsup_loss(z, y, 0.2, **kw),
    "acls": lambda z, y, **kw: F.acls_loss(z, y, 0.5, 3.0, lambda_neg=0.3, **kw),
    "acls-drop": lambda z, y, **kw: F.acls_loss(z, y, 0.5, 3.0, ignored_rows="drop", **kw),
    "cp": lambda z, y, **kw: F.confidence_penalty_loss(z, y, 0.7, **kw),
    "cp-exact": lambda z, y, **kw: F.confidence_penalty_loss(z, y, 0.3, eps=0.0, **kw),
    "cp-mbls": lambda z, y, **kw: F.confidence_penalty_loss(z, y, 0.1, form="mbls", **kw),
    "cals": _cals,
    "cals-drop-raw": lambda z, y, **kw: _cals(z, y, 2.0, normalize=False, ignored_rows="drop", **kw),
    "poly1": lambda z, y, **kw: F.poly1_cross_entropy(z, y, 2.0, **kw),
    "poly1-neg": lambda z, y, **kw: F.poly1_cross_entropy(z, y, -0.5, **kw),
    "poly1-weight": lambda z, y, **kw: F.poly1_cross_entropy(z, y, 1.0, weight=_class_weight(z), **kw),
}


def _both_paths(fn, z, y, upstream=None):
    """fn(z, y) and its gradient (of Σ upstream·loss) on the C++ operator and on the plain torch path."""
    results = []
    for cpp in (True, False):
        x = z.detach().clone().requires_grad_(True)
        with F.use_cpu_extension(cpp):
            value = fn(x, y)
            assert ("FusedMargin" in value.grad_fn.name()) == cpp
            weights = torch.ones_like(value) if upstream is None else upstream(value)
            (grad,) = torch.autograd.grad((value * weights).sum(), x)
        results.append((value.detach(), grad))
    return results


@pytest.mark.parametrize("name,fast,ref,options", FUSED_CASES, ids=[c[0] for c in FUSED_CASES])
@pytest.mark.parametrize("shape", [(9,), (2, 3, 2)], ids=["NK", "NKHW"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_operator_matches_the_float64_loop_reference(name, fast, ref, options, shape, reduction):
    """float64 through the operator (asserted by its autograd node) against the loop references."""
    ignore = options.get("ignore_index", -100)
    z, y = batch(shape, ignore=ignore)
    za, zb = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    got = fast(za, y, reduction=reduction, **options)
    assert "FusedMargin" in got.grad_fn.name()
    want = ref(zb, y, reduction=reduction, **options)
    # float64 on both sides; the loops sum in another order, a few ulps per term
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    upstream = torch.linspace(0.5, 1.5, got.numel(), dtype=torch.float64).reshape(got.shape)
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    torch.testing.assert_close(za.grad, zb.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name,fast,ref,options", FUSED_CASES, ids=[c[0] for c in FUSED_CASES])
@pytest.mark.parametrize("shape", [(5,), (2, 2, 2)], ids=["NK", "NKHW"])
def test_gradcheck_float64(name, fast, ref, options, shape):
    if name.startswith("acls") and not name.startswith("acls-positive"):
        # ACLS detaches the max in its negative term (released code): its gradient is not the derivative
        # of its value, so finite differences check only the positive term
        fast = lambda z, y, **kw: F.acls_loss(z, y, 1.0, 3.0, lambda_neg=0.0, **kw)  # noqa: E731
    # scale 4: no logit distance within gradcheck's step of the margin, where the hinge has a kink
    z, y = batch(shape, seed=3, scale=4.0, ignore=options.get("ignore_index", -100))
    for reduction in ("mean", "none"):
        x = z.clone().requires_grad_(True)
        assert "FusedMargin" in fast(x, y, reduction=reduction, **options).grad_fn.name()
        assert torch.autograd.gradcheck(lambda a, r=reduction: fast(a, y, reduction=r, **options), (x,))


def _float32_batch(shape, k, seed, scale=3.0, ignore=-100):
    g = torch.Generator().manual_seed(seed)
    z = scale * torch.randn(shape[0], k, *shape[1:], generator=g)
    y = torch.randint(0, k, (shape[0], *shape[1:]), generator=g)
    flat = y.view(-1)
    flat[:: max(2, flat.numel() // 5)] = ignore  # a few ignored positions
    return z, y


# K: short rows on 16-byte vectors, wide spans with 16-byte and scalar tails, 256-entry blocks; the spatial
# shapes cover tiles of 64, 54 and 8 positions with partial last tiles
@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize(
    "shape,k",
    [((300,), 3), ((300,), 10), ((64,), 37), ((64,), 100), ((16,), 1027), ((2, 5, 31), 19), ((2, 70), 300),
     ((1, 3, 3), 2100)],
)  # fmt: skip
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_float32_operator_equals_the_torch_path(name, shape, k, reduction):
    """float32 values and gradients of the operator against the torch path. The two sum in different orders
    and precisions (the operator's per-row sums are float64, torch's float32 over K entries, and the
    reductions over up to 1000 rows float32 against float64), a few float32 ulps per sum: rtol 1e-5. In the
    gradient the label entry p − 1 cancels in float32 on the torch path (the operator recomputes it in
    float64): atol 8 float32 ulps of the largest entry."""
    z, y = _float32_batch(shape, k, seed=k)
    upstream = lambda v: torch.linspace(0.5, 1.5, v.numel()).reshape(v.shape)  # noqa: E731
    (v1, g1), (v2, g2) = _both_paths(lambda a, b: LOSSES[name](a, b, reduction=reduction), z, y, upstream)
    torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-6)
    atol = 8 * torch.finfo(torch.float32).eps * g2.abs().max().item()
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("name", list(LOSSES))
def test_float32_operator_is_as_close_to_float64_as_the_torch_path(name):
    """Against the same loss of the float32 inputs in float64, the operator's float32 error is at most the
    torch path's (plus one float32 ulp of the result): its sums are float64."""
    z, y = _float32_batch((2000,), 200, seed=7, scale=5.0)
    with F.use_cpu_extension(False):
        exact = LOSSES[name](z.double(), y)
        plain = LOSSES[name](z, y)
    fused = LOSSES[name](z, y)
    ulp = torch.finfo(torch.float32).eps * abs(exact.item())
    assert abs(fused.double() - exact) <= abs(plain.double() - exact) + ulp


@pytest.mark.parametrize("shape", [(4, 19, 16, 16), (512, 10)], ids=["NKHW", "NK-lanes"])
def test_poly1_lanes_near_certain_positions_are_near_float64(shape):
    """Poly-1 on the lanes (positions, or rows of <= 32 classes) takes 1 − p_y = (Σ − e_y)/Σ and p_y = e_y/Σ
    from the pass's own exps, in float64 from the float32 Σ. At near-certain positions (a margin of 12-24
    over the other classes: 1 − p_y from ~1e-5 down to ~1e-10, below float32's resolution of Σ ≈ 1) each
    position's cross entropy and 1 − p_y carry the rounding of that float32 sum of K terms, at most K·u
    (u = 2⁻²⁴) absolute, so the mean of CE + ε(1 − p_y) is within (1 + ε)·K·u of the float64 loss of the same
    float32 logits. The gradient's largest error is at most the float32 torch path's (plus one float32 ulp of
    its largest entry): at these positions p of the other classes are tiny and both paths lose relative
    precision there (~2e-4 and ~1e-3 of the largest entry at K = 10)."""
    g = torch.Generator().manual_seed(21)
    k = shape[1]
    z = torch.randn(shape, generator=g)
    positions = z.movedim(1, -1).reshape(-1, k)
    top = torch.randint(0, k, (positions.shape[0],), generator=g)
    margin = 12.0 + 12.0 * torch.rand(positions.shape[0], generator=g)
    positions[torch.arange(positions.shape[0]), top] += margin
    z = positions.reshape(shape[0], *shape[2:], k).movedim(-1, 1).contiguous()
    y = top.reshape(shape[0], *shape[2:])
    eps_poly = 2.0
    fn = LOSSES["poly1"]  # (ε = 2)
    (fused, g_fused), (_, g_plain) = _both_paths(fn, z, y)
    x = z.double().requires_grad_(True)
    with F.use_cpu_extension(False):
        exact = fn(x, y)
    (g_exact,) = torch.autograd.grad(exact, x)
    assert abs(fused.double() - exact) <= (1 + eps_poly) * k * 2.0**-24
    scale = g_exact.abs().max().item()
    err_fused, err_plain = ((g.double() - g_exact).abs().max().item() for g in (g_fused, g_plain))
    assert err_fused <= err_plain + 2.0**-23 * scale


# (N, K, d1, ...) logits with at least one vector's width of positions per image (16 float32 lanes with
# AVX-512, fewer elsewhere) take the lane path (one position per vector lane; every fused kind); these
# shapes cover images of a whole number of blocks (16 x 16), partial last blocks (7 x 5 = 35, 37 positions)
# and d1 only (N, K, L)
SPATIAL = [(4, 19, 7, 5), (3, 19, 37), (2, 10, 16, 16), (2, 300, 3, 6)]


def _row_path(fn, z, y, reduction, upstream):
    """fn on the positions as rows: (N·S, K) logits, the (N, K, S) layout's value and gradient back."""
    k = z.shape[1]
    rows = z.movedim(1, -1).reshape(-1, k).contiguous().requires_grad_(True)
    value = fn(rows, y.reshape(-1), reduction=reduction)
    weights = upstream(value.reshape(y.shape)).reshape(value.shape) if reduction == "none" else upstream(value)
    (grad,) = torch.autograd.grad((value * weights).sum(), rows)
    shape = (z.shape[0], *z.shape[2:], k)
    return value.detach().reshape(y.shape if reduction == "none" else ()), grad.reshape(shape).movedim(-1, 1)


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("shape", SPATIAL, ids=["x".join(map(str, s)) for s in SPATIAL])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_spatial_lanes_equal_the_torch_path_and_the_row_path(name, shape, dtype, reduction):
    """The lane path against the torch path and against the operator's row path on the same positions as
    (N·S, K) rows, in value and gradient, with ignored positions (the -drop losses leave their penalty out).
    The lane path does the row path's arithmetic; what differs is float32 summation order (per-class sums in
    input-dtype lanes: a sum of n <= K terms is within (n − 1)·u·Σ|terms| on either path, u = 2⁻²⁴) and the
    row path's scalar exp on the last K mod 4 entries of a row against the vectorised one (1 ulp each): the
    statistics agree to about 2(K + 4)·u relative, carried into the values and p = exp(x − max)/Σ. float64:
    the same bound with u = 2⁻⁵³. Against the torch path the float32 bounds of
    test_float32_operator_equals_the_torch_path (torch's float32 sums and its float32 p − 1 at the label)."""
    z, y = _float32_batch((shape[0], *shape[2:]), shape[1], seed=shape[1])
    z = z.to(dtype)
    fn = LOSSES[name]
    upstream = lambda v: torch.linspace(0.5, 1.5, v.numel(), dtype=dtype).reshape(v.shape)  # noqa: E731
    (v1, g1), (v2, g2) = _both_paths(lambda a, b: fn(a, b, reduction=reduction), z, y, upstream)
    v3, g3 = _row_path(fn, z, y, reduction, upstream)
    eps = torch.finfo(dtype).eps
    if dtype == torch.float32:
        torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g1, g2, rtol=1e-5, atol=8 * eps * g2.abs().max().item())
    else:
        torch.testing.assert_close(v1, v2, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-14)
    rtol = (shape[1] + 4) * eps  # 2(K + 4)·u, eps = 2u
    # entries that cancel (a·p − c, p − 1 recomputed in float64 on both paths) keep an absolute error of
    # that relative size of the gradient's largest entry
    torch.testing.assert_close(v1, v3, rtol=rtol, atol=rtol * v3.abs().max().item())
    torch.testing.assert_close(g1, g3, rtol=rtol, atol=rtol * g3.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SPATIAL, ids=["x".join(map(str, s)) for s in SPATIAL])
def test_spatial_cals_with_and_without_statistics_agree(dtype, shape):
    """CALS's forward with the training statistics runs the lane kernel of the forward without (the sums
    added beside it): the same loss and gradient, bit for bit. (The statistics themselves are checked
    against the torch path and across thread counts below.)"""
    z, y = _float32_batch((shape[0], *shape[2:]), shape[1], seed=shape[1])
    z = z.to(dtype)
    results = []
    for statistics in (None, (1e-3, 1.5)):
        x = z.clone().requires_grad_(True)
        out = _cals(x, y, statistics=statistics)
        loss = out if statistics is None else out[0]
        assert "FusedMargin" in loss.grad_fn.name()
        (grad,) = torch.autograd.grad(loss, x)
        results.append((loss.detach(), grad))
    (v1, g1), (v2, g2) = results
    assert torch.equal(v1, v2) and torch.equal(g1, g2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_spatial_lanes_ties_non_contiguous_inputs_and_label_errors(dtype):
    """Small integer logits (ties at the max in most positions: the max's gradient goes to the first, as
    torch's max(dim)), a transposed view and channels-last images on the lane path, against the torch path;
    a bad label at any position raises the torch path's error."""
    g = torch.Generator().manual_seed(5)
    ties = torch.randint(-2, 3, (2, 5, 6, 7), generator=g).to(dtype)
    labels = torch.randint(0, 5, (2, 6, 7), generator=g)
    labels[0, 1, 2] = -100
    transposed = (3 * torch.randn(2, 5, 7, 6, generator=g, dtype=dtype)).transpose(2, 3)
    channels_last = (3 * torch.randn(2, 5, 6, 7, generator=g, dtype=dtype)).to(memory_format=torch.channels_last)
    # float32: a gradient entry is a few rounded terms (p times the row's factor, the hinge's share, the
    # max's share) on either path: a few ulps of the largest entry. float64: a few ulps.
    eps = torch.finfo(dtype).eps
    for logits in (ties, transposed, channels_last):
        for name in LOSSES:
            for reduction in ("none", "mean"):
                fn = lambda a, b, n=name, r=reduction: LOSSES[n](a, b, reduction=r)  # noqa: E731
                (v1, g1), (v2, g2) = _both_paths(fn, logits, labels)
                torch.testing.assert_close(v1, v2, rtol=8 * eps, atol=8 * eps * v2.abs().max().item())
                torch.testing.assert_close(g1, g2, rtol=8 * eps, atol=8 * eps * g2.abs().max().item())
    bad = labels.clone()
    bad[1, 5, 6] = 5
    for name in LOSSES:
        messages = []
        for cpp in (True, False):
            with F.use_cpu_extension(cpp), pytest.raises(ValueError) as info:
                LOSSES[name](ties, bad)
            messages.append(str(info.value))
        assert messages[0] == messages[1]


@pytest.mark.parametrize("name", ["mbls", "maxsup", "acls", "cals", "poly1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ties_in_the_maximum_send_the_max_gradient_to_the_first(name, dtype):
    """Tied maxima: the max's gradient goes to the first of them, as torch's max(dim) on CPU (ACLS counts
    every tied maximum in its positive term)."""
    z = torch.tensor(
        [[5.0, 1.0, 5.0, -2.0], [0.0, 0.0, 0.0, 0.0], [-3.0, 4.0, 4.0, 4.0], [2.0, -9.0, 1.0, 2.0]], dtype=dtype
    )
    y = torch.tensor([1, 2, 0, 3])
    (v1, g1), (v2, g2) = _both_paths(lambda a, b: LOSSES[name](a, b, reduction="none"), z, y)
    tol = {"rtol": 1e-6, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-14}
    torch.testing.assert_close(v1, v2, **tol)
    torch.testing.assert_close(g1, g2, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [16, 64, 100])
def test_a_row_without_its_maximum_keeps_the_arg_max_inside_the_row(dtype, k):
    """A row led by NaN has a NaN maximum that no entry equals: the saved arg-max (the entry the backward
    writes the max's gradient to) stays inside the row (the last entry on the row path, the first on the
    small-K lanes path), never K (a write past the row, and past the gradient's end on the last row; the
    rows' search ended at K where the row was whole vectors). The other rows keep the torch path's values
    and gradients."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(4, k, generator=g, dtype=dtype)
    z[1, 0] = z[3, 0] = float("nan")
    y = torch.tensor([1, 2, 3, 4])
    stats = torch.ops.torchcal.fused_margin_fwd.default(z, y, 0, [0.1, 3.0], None, True, 0)[1]
    saved = torch.ops.torchcal.batch_terms_fwd.default(z, y, None, 0, 1.0, 0.0, 2, False)[5]
    for arg in (stats[:, 4], saved[:, 2]):  # (the arg-max columns: S_ARG, BS_ARG)
        assert 0 <= arg[1].item() < k and 0 <= arg[3].item() < k
        assert arg[0].item() == z[0].argmax().item() and arg[2].item() == z[2].argmax().item()
    (v1, g1), (v2, g2) = _both_paths(lambda a, b: LOSSES["mbls"](a, b, reduction="none"), z, y)
    tol = {"rtol": 1e-6, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-14}
    torch.testing.assert_close(v1[[0, 2]], v2[[0, 2]], **tol)
    torch.testing.assert_close(g1[[0, 2]], g2[[0, 2]], **tol)
    assert torch.isnan(v1[[1, 3]]).all() and torch.isnan(v2[[1, 3]]).all()


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("ignore_index", [None, 0, 255])
def test_ignore_index_forms(name, ignore_index):
    """ignore_index None (every label counts), a class index (its labels leave the loss) and 255."""
    z, y = _float32_batch((3, 4, 5), 6, seed=1, ignore=255 if ignore_index == 255 else 0)
    for reduction in ("mean", "none"):
        fn = lambda a, b, r=reduction: LOSSES[name](a, b, ignore_index=ignore_index, reduction=r)  # noqa: E731
        (v1, g1), (v2, g2) = _both_paths(fn, z, y)
        torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-7)


def test_every_label_ignored_gives_nan_mean_and_zero_gradient_like_the_torch_path():
    z, y = torch.randn(4, 3), torch.full((4,), -100)
    for name in ("mbls-drop", "maxsup", "cp"):
        (v1, g1), (v2, g2) = _both_paths(LOSSES[name], z, y)
        assert torch.isnan(v1) and torch.isnan(v2)
        torch.testing.assert_close(g1, g2, equal_nan=True)


@pytest.mark.parametrize("name", list(LOSSES))
def test_label_errors_are_the_torch_paths(name):
    """A label outside [0, K) that is not ignore_index: the operator refuses it and the torch path raises
    its named error."""
    z = torch.randn(3, 4)
    for bad in (torch.tensor([0, 4, 1]), torch.tensor([0, -1, 1])):
        messages = []
        for cpp in (True, False):
            with F.use_cpu_extension(cpp), pytest.raises(ValueError) as info:
                LOSSES[name](z, bad)
            messages.append(str(info.value))
        assert messages[0] == messages[1]
    with pytest.raises(ValueError, match=r"`targets` must lie in \[0, 4\), found label 4"):
        torch.ops.torchcal.fused_margin(z, torch.tensor([0, 4, 1]), 0, [0.1, 10.0], None, False, 1)


def test_results_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(2)
    cases = [(3 * torch.randn(5000, 64, generator=g), torch.randint(0, 64, (5000,), generator=g)),
             (3 * torch.randn(2, 19, 40, 50, generator=g), torch.randint(0, 19, (2, 40, 50), generator=g))]  # fmt: skip

    def step(z, y, name):
        x = z.clone().requires_grad_(True)
        loss = LOSSES[name](x, y)
        loss.backward()
        return loss.detach(), x.grad

    for z, y in cases:
        for name in ("mbls", "acls", "cp", "cals", "poly1-weight"):
            results = for_thread_counts(step, z, y, name)
            assert torch.equal(results[0][0], results[1][0])  # the reduction is summed in row order
            assert torch.equal(results[0][1], results[1][1])


def test_layouts_and_label_dtypes_match_the_torch_path():
    """Non-contiguous logits (a transposed view, channels-last images) and int32 / uint8 labels."""
    g = torch.Generator().manual_seed(1)
    z = (3 * torch.randn(7, 40, generator=g)).t()[:, :7]
    y = torch.randint(0, 7, (40,), generator=g, dtype=torch.int32)
    images = (3 * torch.randn(2, 5, 6, 7, generator=g)).to(memory_format=torch.channels_last)
    labels = torch.randint(0, 5, (2, 6, 7), generator=g, dtype=torch.uint8)
    for logits, targets in ((z, y), (images, labels)):
        assert not logits.is_contiguous()
        for name in ("mbls", "acls", "maxsup", "cp"):
            (v1, g1), (v2, g2) = _both_paths(lambda a, b, n=name: LOSSES[n](a, b, reduction="none"), logits, targets)
            torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-7)


def test_what_the_operator_leaves_to_the_torch_path():
    """Soft targets, half-precision logits (upcast by the torch path) and a disabled extension take the torch
    path; float32 logits inside an autocast region take the operator unchanged."""
    z, y = torch.randn(6, 4, requires_grad=True), torch.randint(0, 4, (6,))
    q = torch.softmax(torch.randn(6, 4), 1)
    assert "FusedMargin" not in F.logit_margin_l1_loss(z, q).grad_fn.name()
    assert "FusedMargin" not in F.maxsup_loss(z.detach().bfloat16().requires_grad_(True), y).grad_fn.name()
    with F.use_cpu_extension(False):
        assert "FusedMargin" not in F.acls_loss(z, y).grad_fn.name()
        expected = F.acls_loss(z, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.acls_loss(z, y)
    assert "FusedMargin" in loss.grad_fn.name() and loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)


def test_no_graph_without_gradients_and_extreme_logits():
    z = torch.tensor([[1e4, -1e4, 0.0], [-1e4, 1e4, 1e4], [0.0, 0.0, 0.0]])
    y = torch.tensor([1, 2, 0])
    with torch.no_grad():
        value = F.logit_margin_l1_loss(z, y)
    assert not value.requires_grad
    for name in LOSSES:
        (v1, g1), (v2, g2) = _both_paths(LOSSES[name], z, y)
        assert torch.isfinite(v1) and torch.isfinite(g1).all()
        torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-7)


def test_second_order_gradients_are_refused():
    z, y = torch.randn(5, 4, dtype=torch.float64, requires_grad=True), torch.tensor([0, 1, 2, 3, 0])
    for name in ("maxsup", "cp", "cals", "poly1"):
        with pytest.raises(RuntimeError, match="differentiable once only"):
            torch.autograd.grad(LOSSES[name](z, y), z, create_graph=True)


ARGS = {  # (kind, params, ignore_index, penalty_all_rows) of each operator kind
    "mbls": (0, [0.1, 3.0], -100, True),
    "maxsup": (1, [0.2], -100, False),
    "acls": (2, [0.1, 3.0, 1.0, 0.1], 255, True),
    "cp": (3, [1.0, 1e-6, 0.0], None, False),
}


@pytest.mark.parametrize("kind", list(ARGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_the_compile_operators_pass_opcheck(kind, dtype, reduction):
    """The forward/backward pair that torch.compile traces: schema, fake implementation (shapes, dtypes,
    strides) and autograd registration checked by torch.library.opcheck, at (N, K) and (N, K, H, W)."""
    code, params, ignore, every_row = ARGS[kind]
    for z, y in ((torch.randn(6, 4, dtype=dtype), torch.tensor([0, 1, 2, 3, 0, 1])),
                 (torch.randn(2, 3, 2, 2, dtype=dtype), torch.randint(0, 3, (2, 2, 2))),
                 (torch.randn(2, 3, 4, 5, dtype=dtype), torch.randint(0, 3, (2, 4, 5)))):  # fmt: skip
        args = (z.requires_grad_(True), y, code, params, ignore, every_row, reduction)
        torch.library.opcheck(torch.ops.torchcal.fused_margin_fwd.default, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_compile_operators_equal_the_eager_operator(dtype):
    """Loss and gradient of fused_margin_fwd / _bwd (with their registered autograd formula) are the eager
    operator's, bit for bit: the same C++ forward and backward."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 5, 4, 5, generator=g, dtype=dtype)  # 20 positions: the lane path
    y = torch.randint(0, 5, (3, 4, 5), generator=g)
    for code, params, ignore, every_row in ARGS.values():
        yk = y.clone()
        if ignore is not None:
            yk[0, 0, 0] = ignore
        for reduction in (0, 1, 2):
            a, b = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
            eager = torch.ops.torchcal.fused_margin(a, yk, code, params, ignore, every_row, reduction)
            pair = torch.ops.torchcal.fused_margin_fwd(b, yk, code, params, ignore, every_row, reduction)[0]
            assert torch.equal(eager.detach(), pair.detach())
            (ga,) = torch.autograd.grad(eager.sum(), a)
            (gb,) = torch.autograd.grad(pair.sum(), b)
            assert torch.equal(ga, gb)


@pytest.mark.compile
def test_compiled_losses_take_the_operator_pair_and_equal_eager():
    z, y = torch.randn(2, 4, 5, 5), torch.randint(0, 4, (2, 5, 5))  # 25 positions: the lane path
    y[0, 0, 0] = -100
    for name in ("mbls", "acls", "maxsup", "cp"):
        compiled = torch.compile(lambda a, b, n=name: LOSSES[n](a, b), fullgraph=True, backend="aot_eager")
        a, b = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
        got = compiled(a, y)
        want = LOSSES[name](b, y)
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)



# -- CALS's training statistics and update, Poly-1's class weights, the per-class operator -------------------


def _cals_sums(z, y, cpp, **kw):
    """cals_loss's (loss, gradient, statistics) with statistics=(1e-3, 1.5) on one path."""
    x = z.detach().clone().requires_grad_(True)
    with F.use_cpu_extension(cpp):
        loss, sums = _cals(x, y, statistics=(1e-3, 1.5), **kw)
        assert ("FusedMargin" in loss.grad_fn.name()) == cpp
        (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad, sums


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "shape,k", [((300,), 7), ((64,), 100), ((1500,), 100), ((3001,), 19), ((2, 5, 31), 19)]
)
@pytest.mark.parametrize("ignored_rows", ["reference", "drop"])
def test_cals_statistics_from_the_operator_equal_the_torch_paths(dtype, shape, k, ignored_rows):
    """The sums of cals_statistics that the operator returns from its forward (kept positions only, the
    λ clamp in the dtype) against the torch path's. Both compute each r_ik in the dtype alike; the torch path
    sums over the rows in the dtype (a float32 matrix product: up to M·eps relative of the sum of |terms|
    for M positions); the operator's row path sums groups of 16 rows in the dtype (m − z rounded there too)
    and the groups in float64, its lane path in float64: rtol M·eps of the dtype. (1500, 100): 9 parts of 167
    rows, whose last group is short; ignored rows are not counted in a group. (3001, 19), float32: the lane
    kernels on rows, 3 parts of 1001 rows, each ending in a partial block of lanes.)"""
    z, y = _float32_batch(shape, k, seed=k)
    z = z.to(dtype)
    (v1, g1, s1), (v2, g2, s2) = (_cals_sums(z, y, cpp, ignored_rows=ignored_rows) for cpp in (True, False))
    assert s1.dtype == s2.dtype == dtype and s1.shape == (2 * k + 1,)
    rows = y.numel()
    eps = torch.finfo(dtype).eps
    scale = torch.cat([s2[:-1].abs(), s2[-1:]])  # the count is exact on both
    assert s1[-1] == (y != -100).sum()
    assert ((s1 - s2).abs() <= rows * eps * scale + eps).all()
    torch.testing.assert_close(v1, v2, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=0)
    atol = 8 * eps * g2.abs().max().item()
    torch.testing.assert_close(g1, g2, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=atol)


def test_cals_statistics_do_not_depend_on_the_thread_count():
    """The statistics are summed in parts fixed by the shape, the parts in order: bit-equal for 1 and 3
    threads, at (N, K) (the row kernel at K = 64, the lane kernels on rows at K = 19) and (N, K, H, W)."""
    g = torch.Generator().manual_seed(4)
    cases = [(3 * torch.randn(5000, 64, generator=g), torch.randint(0, 64, (5000,), generator=g)),
             (3 * torch.randn(6001, 19, generator=g), torch.randint(0, 19, (6001,), generator=g)),
             (3 * torch.randn(3, 19, 40, 50, generator=g), torch.randint(0, 19, (3, 40, 50), generator=g))]  # fmt: skip
    for z, y in cases:
        results = for_thread_counts(_cals_sums, z, y, True)
        for a, b in zip(*results):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cals_module_update_is_the_torch_paths(dtype):
    """CALSLoss trained for a few steps on each path (its statistics accumulated from the operator's forward)
    holds the same λ, ρ and constraint means after its updates; the validation update (update(logits))
    too. float64: the two differ by summation order (1e-12 relative); float32: the sums carry the float32
    bound of the test above and λ is their mean (rtol 1e-5)."""
    g = torch.Generator().manual_seed(9)
    batches = [(25 * torch.randn(200, 10, generator=g, dtype=dtype), torch.randint(0, 10, (200,), generator=g))
               for _ in range(3)]  # fmt: skip
    modules = []
    for cpp in (True, False):
        loss_fn = CALSLoss(margin=10.0, rho_step=2, ignore_index=3)
        with F.use_cpu_extension(cpp):
            for epoch in range(4):
                for z, y in batches:
                    x = z.clone().requires_grad_(True)
                    loss_fn(x + epoch, y).backward()
                loss_fn.update(metrics={})
            loss_fn.update(batches[0][0], batches[0][1])
        modules.append(loss_fn)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    assert int(modules[0].updates) == int(modules[1].updates) == 5
    for name in ("lambdas", "rhos", "previous_constraint"):
        torch.testing.assert_close(getattr(modules[0], name), getattr(modules[1], name), **tol)
    assert (modules[0].rhos > 1).any()  # the ρ update happened


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_poly1_class_weights_through_the_operator(reduction, ignore_index):
    """Poly-1 with class weights: each row's loss times w_y, "mean" over Σ w_y of the kept rows (float64
    against the loop reference, float32 against the torch path); a weight of zero everywhere kept is NaN
    for "mean" on both."""
    from tests.reference import margin as R

    z, y = batch((6, 3, 2), ignore=ignore_index)
    w = torch.tensor([0.5, 1.0, 2.0, 1.5], dtype=torch.float64)
    za, zb = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    got = F.poly1_cross_entropy(za, y, 2.0, weight=w, ignore_index=ignore_index, reduction=reduction)
    assert "FusedMargin" in got.grad_fn.name()
    want = R.poly1(zb, y, 2.0, weight=w, ignore_index=ignore_index, reduction=reduction)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)  # float64 both: summation order only
    upstream = torch.linspace(0.5, 1.5, got.numel(), dtype=torch.float64).reshape(got.shape)
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    torch.testing.assert_close(za.grad, zb.grad, rtol=1e-10, atol=1e-12)
    zeros = torch.zeros(4)
    (v1, g1), (v2, g2) = _both_paths(lambda a, b: F.poly1_cross_entropy(a, b, weight=zeros), z.float(), y)
    assert torch.isnan(v1) and torch.isnan(v2)


def test_what_the_per_class_kinds_leave_to_the_torch_path():
    """Poly-1 with label smoothing or soft targets, a weight that requires a gradient, and CALS with λ or ρ
    as lists or with a gradient take the torch path (and give the same numbers)."""
    z, y = torch.randn(6, 4, requires_grad=True), torch.randint(0, 4, (6,))
    q = torch.softmax(torch.randn(6, 4), 1)
    w = torch.rand(4, requires_grad=True)
    lam, rho = _cals_params(4)
    assert "FusedMargin" not in F.poly1_cross_entropy(z, y, label_smoothing=0.1).grad_fn.name()
    assert "FusedMargin" not in F.poly1_cross_entropy(z, q).grad_fn.name()
    assert "FusedMargin" not in F.poly1_cross_entropy(z, y, weight=w).grad_fn.name()
    assert "FusedMargin" not in F.cals_loss(z, y, lam.tolist(), rho.tolist()).grad_fn.name()
    assert "FusedMargin" not in F.cals_loss(z, y, lam.clone().requires_grad_(True), rho).grad_fn.name()
    assert "FusedMargin" in F.cals_loss(z, y, lam, rho).grad_fn.name()
    torch.testing.assert_close(F.cals_loss(z, y, lam.tolist(), rho.tolist()), F.cals_loss(z, y, lam, rho))
    with pytest.raises(ValueError, match="one per class"):
        F.cals_loss(z, y, lam[:3], rho[:3])


def test_cals_multipliers_changed_in_place_are_seen():
    """λ and ρ changed in place between calls (also through ``.data``, which no version counter follows), a
    new K, and float32 after float64 logits: each call equals the torch path with the values it was given."""
    g = torch.Generator().manual_seed(3)
    z, y = torch.randn(20, 5, generator=g, dtype=torch.float64), torch.randint(0, 5, (20,), generator=g)
    lam, rho = _cals_params(5)

    def check(logits, lam, rho):
        got = F.cals_loss(logits, y, lam, rho, 3.0)
        with F.use_cpu_extension(False):
            want = F.cals_loss(logits, y, lam, rho, 3.0)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)

    check(z, lam, rho)
    lam.data.mul_(3.0)
    check(z, lam, rho)
    rho[2] = 7.0
    check(z, lam, rho)
    check(z.float(), lam, rho)
    z6 = torch.randn(20, 6, generator=g, dtype=torch.float64)
    check(z6, *_cals_params(6))


CLASS_ARGS = {  # (kind, params, class_params of K = 4 classes, ignore_index, penalty_all_rows, sums)
    "cals": (4, [1.0, 3.0, 1e-3, 1.5, 3.0], lambda dt: torch.rand(4, 4, dtype=dt), -100, True, True),
    "cals-drop": (4, [1.0, 1.0, 0.0, 0.0, 2.0], lambda dt: torch.rand(4, 4, dtype=dt), 255, False, False),
    "poly1": (5, [2.0], lambda dt: None, None, False, False),
    "poly1-weight": (5, [-0.5], lambda dt: torch.rand(4, dtype=dt), -100, False, False),
}


@pytest.mark.parametrize("kind", list(CLASS_ARGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_the_per_class_compile_operators_pass_opcheck(kind, dtype, reduction):
    code, params, cls, ignore, every_row, sums = CLASS_ARGS[kind]
    for z, y in ((torch.randn(6, 4, dtype=dtype), torch.tensor([0, 1, 2, 3, 0, 1])),
                 (torch.randn(2, 4, 2, 2, dtype=dtype), torch.randint(0, 4, (2, 2, 2)))):  # fmt: skip
        args = (z.requires_grad_(True), y, code, params, cls(dtype), ignore, every_row, reduction, sums)
        torch.library.opcheck(torch.ops.torchcal.fused_margin_class_fwd.default, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_per_class_compile_operators_equal_the_eager_operator(dtype):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 4, 4, 2, generator=g, dtype=dtype)
    y = torch.randint(0, 4, (3, 4, 2), generator=g)
    for code, params, cls, ignore, every_row, sums in CLASS_ARGS.values():
        c = cls(dtype)
        yk = y.clone()
        if ignore is not None:
            yk[0, 0, 0] = ignore
        for reduction in (0, 1, 2):
            a, b = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
            args = (yk, code, params, c, ignore, every_row, reduction, sums)
            eager, eager_sums = torch.ops.torchcal.fused_margin_class(a, *args)
            pair, pair_sums, _ = torch.ops.torchcal.fused_margin_class_fwd(b, *args)
            assert torch.equal(eager.detach(), pair.detach()) and torch.equal(eager_sums, pair_sums)
            assert eager_sums.numel() == (9 if sums else 0) and not eager_sums.requires_grad
            (ga,) = torch.autograd.grad(eager.sum(), a)
            (gb,) = torch.autograd.grad(pair.sum(), b)
            assert torch.equal(ga, gb)


def test_the_per_class_operator_checks_its_inputs():
    z, y = torch.randn(3, 4), torch.tensor([0, 1, 2])
    op = torch.ops.torchcal.fused_margin_class
    with pytest.raises(ValueError, match=r"`class_params` must hold 4 x 4 numbers"):
        op(z, y, 4, [1.0, 3.0, 0.0, 0.0, 3.0], None, None, False, 1, False)
    with pytest.raises(ValueError, match=r"`class_params` must hold 1 x 4 numbers of the logits' dtype"):
        op(z, y, 5, [1.0], torch.ones(4, dtype=torch.float64), None, False, 1, False)
    with pytest.raises(ValueError, match="only CALS"):
        op(z, y, 5, [1.0], None, None, False, 1, True)
    with pytest.raises(ValueError, match="not taken by kind 0"):
        op(z, y, 0, [0.1, 3.0], torch.ones(4), None, False, 1, False)
    with pytest.raises(ValueError, match=r"`targets` must lie in \[0, 4\), found label 7"):
        op(z, torch.tensor([0, 7, 1]), 5, [1.0], None, None, False, 1, False)


@pytest.mark.compile
def test_compiled_per_class_losses_take_the_operator_pair_and_equal_eager():
    z, y = torch.randn(2, 4, 3, 3), torch.randint(0, 4, (2, 3, 3))
    y[0, 0, 0] = -100
    lam, rho = _cals_params(4)
    losses = {
        "cals": lambda a, b: F.cals_loss(a, b, lam, rho, 3.0, statistics=(1e-3, 1.5)),
        "poly1": lambda a, b: (F.poly1_cross_entropy(a, b, 2.0), None),
        "poly1-weight": lambda a, b: (F.poly1_cross_entropy(a, b, 2.0, weight=torch.rand(4)), None),
    }
    for fn in losses.values():
        torch.manual_seed(0)
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        a, b = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
        got, got_sums = compiled(a, y)
        torch.manual_seed(0)
        want, want_sums = fn(b, y)
        assert "FusedMargin" in want.grad_fn.name()
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
        if want_sums is not None:
            torch.testing.assert_close(got_sums, want_sums, rtol=0, atol=0)


def test_the_backward_operators_check_their_labels():
    """A backward operator of the torch.compile pairs (and the batch terms' eager backward) called with labels
    that its forward did not check raises the forward's error for one outside [0, K) that is not ignore_index,
    before any label indexes a row: such a label would index the gradient, a write outside it. Labels equal to
    ignore_index still pass."""
    import torchcal.functional.losses as L

    ops = torch.ops.torchcal
    z = torch.randn(6, 4)
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    ignored = torch.tensor([0, -100, 2, 3, -100, 1])
    one = torch.tensor(1.0)
    message = r"`targets` must lie in \[0, 4\), found label (9|-7)"
    for bad in (torch.tensor([0, 1, 9, 3, 0, 1]), torch.tensor([0, 1, 2, -7, 0, 1], dtype=torch.int32)):
        spec = L._gamma_spec(2.0, "fcl", 0.5)[2]
        _, probs, out = ops.fused_true_class_fwd(z, y, spec.cpp_params32, None, 1, spec.brier)
        with pytest.raises(ValueError, match=message):
            ops.fused_true_class_bwd(one, probs, bad, out, spec.brier, 1)
        stats = ops.fused_margin_fwd(z, y, 0, [0.1, 3.0], -100, True, 1)[1]
        assert ops.fused_margin_bwd(one, z, ignored, stats, 0, [0.1, 3.0], -100, True, 1).shape == z.shape
        with pytest.raises(ValueError, match=message):
            ops.fused_margin_bwd(one, z, bad, stats, 0, [0.1, 3.0], -100, True, 1)
        code, params, cls, ignore, every_row, sums = CLASS_ARGS["cals"]
        numbers = cls(torch.float32)
        stats = ops.fused_margin_class_fwd(z, y, code, params, numbers, ignore, every_row, 1, sums)[2]
        kept = ops.fused_margin_class_bwd(one, z, ignored, stats, code, params, numbers, ignore, every_row, 1)
        assert kept.shape == z.shape
        with pytest.raises(ValueError, match=message):
            ops.fused_margin_class_bwd(one, z, bad, stats, code, params, numbers, ignore, every_row, 1)
        edges = torch.linspace(0, 1 + 1.1920928955078125e-07, 6)[1:-1]
        options = [5, 0, 0, 1, 0, 1]
        stats = ops.fused_ace_fwd(z, y, edges, [1.5, 0.01], options, -100)[1]
        assert ops.fused_ace_bwd(one, z, ignored, edges, stats, [1.5, 0.01], options, -100).shape == z.shape
        with pytest.raises(ValueError, match=message):
            ops.fused_ace_bwd(one, z, bad, edges, stats, [1.5, 0.01], options, -100)
        saved = ops.batch_terms_fwd(z, y, -100, 0, 1.0, 0.0, 0, False)[5]
        g_rows = torch.ones(6)
        kept = ops.batch_terms_bwd(z, ignored, saved, g_rows, None, None, None, -100, 0, 1.0, 0.0, 0)
        assert kept.shape == z.shape
        with pytest.raises(ValueError, match=message):
            ops.batch_terms_bwd(z, bad, saved, g_rows, None, None, None, -100, 0, 1.0, 0.0, 0)
