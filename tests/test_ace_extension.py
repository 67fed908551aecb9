"""The C++ operator of mL1-ACE plus cross entropy (torch.ops.torchcal.fused_ace, csrc/ace.h) against the float64
loop reference and the plain torch path: values and gradients at (N, K) and (N, K, d1, ...), hard and soft bins,
every reduction and option, ignored labels, label errors, threads, layouts, the torch.compile operators and the
cases it leaves to the torch path."""

import pytest
import torch

import torchcal.functional as F
from tests.conftest import for_thread_counts
from tests.reference import margin as R

pytestmark = pytest.mark.usefixtures("cpp_extension")

OPTIONS = [
    {},
    {"binning": "soft"},
    {"n_bins": 3, "lambda_": 2.5},
    {"binning": "soft", "n_bins": 6, "include_background": False},
    {"include_background": False, "ignore_empty_classes": False},
    {"binning": "soft", "ignore_empty_classes": False, "empty_weight": 0.3},
    {"per_image": True},
    {"binning": "soft", "per_image": False},
    {"n_bins": 1},
    {"binning": "soft", "n_bins": 1},
    {"ignore_index": 2},
    {"binning": "soft", "ignore_index": None},
]
IDS = ["-".join(f"{k}={v}" for k, v in o.items()) or "default" for o in OPTIONS]


def _batch(shape, k, seed=0, scale=3.0, dtype=torch.float64, ignore=-100):
    g = torch.Generator().manual_seed(seed)
    z = (scale * torch.randn(shape[0], k, *shape[1:], generator=g)).to(dtype)
    y = torch.randint(0, k, (shape[0], *shape[1:]), generator=g)
    if ignore is not None:
        flat = y.view(-1)
        flat[:: max(2, flat.numel() // 5)] = ignore  # a few ignored positions
    return z, y


def _split(options):
    kw = dict(options)
    return kw.pop("lambda_", 1.0), kw


def _fused(z, y, options, reduction="mean"):
    lam, kw = _split(options)
    return F.ml1ace_loss(z, y, lam, reduction=reduction, **kw)


def _both_paths(z, y, options, reduction, upstream=None):
    """The loss and the gradient of Σ upstream·loss on the C++ operator (asserted by its autograd node) and on
    the plain torch path."""
    results = []
    for cpp in (True, False):
        x = z.detach().clone().requires_grad_(True)
        with F.use_cpu_extension(cpp):
            value = _fused(x, y, options, reduction)
            assert ("FusedAce" in value.grad_fn.name()) == cpp
            weights = torch.ones_like(value) if upstream is None else upstream(value)
            (grad,) = torch.autograd.grad((value * weights).sum(), x)
        results.append((value.detach(), grad))
    return results


def _upstream(v):
    return torch.linspace(0.5, 1.5, v.numel(), dtype=v.dtype).reshape(v.shape)


@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
@pytest.mark.parametrize("shape", [(9,), (2, 3, 2), (2, 9, 11)], ids=["NK", "NKHW", "NKHW99"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_operator_matches_the_float64_loop_reference(options, shape, reduction):
    """float64 through the operator against the loop reference, value and gradient; (2, 9, 11) has 99
    positions per image: a full tile's vector blocks and a partial tile."""
    ignore = options.get("ignore_index", -100)
    z, y = _batch(shape, 5, seed=len(shape), ignore=ignore if ignore is not None else 0)
    za, zb = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    got = _fused(za, y, options, reduction)
    assert "FusedAce" in got.grad_fn.name()
    lam, kw = _split(options)
    want = R.ml1ace(zb, y, lam, reduction=reduction, **kw)
    # float64 on both sides; the loops and the operator's float64 sums add in other orders: a few ulps a term
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    (got * _upstream(got)).sum().backward()
    (want * _upstream(want)).sum().backward()
    torch.testing.assert_close(za.grad, zb.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("binning", ["hard", "soft"])
@pytest.mark.parametrize("shape", [(5,), (2, 2, 3)], ids=["NK", "NKHW"])
def test_gradcheck_float64(binning, shape):
    """Finite differences: the bins of p (hard) and the soft bins' occupancy are constant within gradcheck's
    step at these logits (a p within 1e-6 of an edge would make the check meaningless; none is)."""
    z, y = _batch(shape, 4, seed=3, ignore=None)
    for reduction in ("mean", "none"):
        x = z.clone().requires_grad_(True)
        fn = lambda a, r=reduction: F.ml1ace_loss(a, y, binning=binning, n_bins=5, reduction=r)  # noqa: E731
        assert "FusedAce" in fn(x).grad_fn.name()
        assert torch.autograd.gradcheck(fn, (x,))


def _edge_distance(z, n_bins):
    """The smallest distance (in p) of a float64 softmax probability of z to an inner hard-bin edge."""
    p = torch.softmax(z.double(), 1)
    edges = torch.linspace(0, 1 + 1.1920928955078125e-07, n_bins + 1, dtype=torch.float64)[1:-1]
    return (p.reshape(-1, 1) - edges).abs().min().item()


def _centre_distance(z, n_bins):
    """The smallest distance (in p) of a float64 softmax probability of z to a soft bin's centre
    (l + 1/2)(1 + eps)/M, where the pieces of the soft bins' u = dACE/dp meet (and where it is clamped)."""
    p = torch.softmax(z.double(), 1)
    centres = (torch.arange(n_bins, dtype=torch.float64) + 0.5) * (1 + 1.1920928955078125e-07) / n_bins
    return (p.reshape(-1, 1) - centres).abs().min().item()


# K: short rows (the tail lanes), vector blocks with tails, long rows; (N, K, S) with S below, at and above
# a tile of 64 positions
@pytest.mark.parametrize(
    "shape,k", [((300,), 3), ((300,), 10), ((64,), 37), ((64,), 100), ((16,), 1027), ((2, 5, 31), 19),
                ((3, 64), 7), ((1, 3, 3), 200)],
)  # fmt: skip
@pytest.mark.parametrize("binning", ["hard", "soft"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_float32_operator_equals_the_torch_path(shape, k, binning, reduction):
    """float32 values and gradients against the torch path. The two compute p with different exponentials
    (a few float32 ulps apart), so a hard bin could differ for a p within ulps of an edge: the data are
    checked to keep every p 1e-6 away from the edges. The bins' sums are float64 in the operator and float32
    in torch (index_add over up to ~1000 entries), the cross entropy's row sums likewise: rtol 1e-5 on the
    values. The gradient is p ⊙ (u − <u, p>) with u = sign/count per bin, cancelling in float32 on the torch
    path: atol 16 float32 ulps of its largest entry."""
    z, y = _batch(shape, k, seed=k, dtype=torch.float32)
    if binning == "hard":
        assert _edge_distance(z, 20) > 1e-6
    (v1, g1), (v2, g2) = _both_paths(z, y, {"binning": binning}, reduction, _upstream)
    torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-6)
    atol = 16 * torch.finfo(torch.float32).eps * g2.abs().max().item()
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=atol)


@pytest.mark.parametrize(
    "shape,k", [((300,), 3), ((300,), 10), ((300,), 32), ((2, 5, 31), 19), ((3, 64), 7)],
)  # fmt: skip
@pytest.mark.parametrize("binning", ["hard", "soft"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_float32_without_background(shape, k, binning, reduction):
    """float32 with the background class left out (its column unbinned, its p in every row's softmax) and
    ignored labels: (N, K) rows of at most 32 classes through the tiles (decision 267; 300 rows are four full
    tiles of 64 and a partial one) and (N, K, S) positions. Values against the torch path at the tolerances of
    test_float32_operator_equals_the_torch_path; hard bins' gradients likewise. The soft bins' gradient moves
    with the rounding of p itself (r = p·M − l − 1/2 scales p's error by M = 20): both float32 paths land
    10-30 float32 ulps of the largest entry from float64 at these seeds, in either direction, so their
    distance to each other is not bounded by 16 ulps. The operator is held instead to twice the float32 torch
    path's distance from the float64 gradient of the same inputs plus two ulps, as in
    test_planes_gradient_at_every_table_size_and_confident_positions."""
    z, y = _batch(shape, k, seed=k, dtype=torch.float32)
    if binning == "hard":
        assert _edge_distance(z, 20) > 1e-6
    options = {"binning": binning, "include_background": False}
    (v1, g1), (v2, g2) = _both_paths(z, y, options, reduction, _upstream)
    torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-6)
    if binning == "hard":
        atol = 16 * torch.finfo(torch.float32).eps * g2.abs().max().item()
        torch.testing.assert_close(g1, g2, rtol=1e-5, atol=atol)
        return
    assert _centre_distance(z, 20) > 1e-6  # both precisions take the same pieces of u
    _, (_, g_want) = _both_paths(z.double(), y, options, reduction, _upstream)  # (the torch path in float64)
    ulp = torch.finfo(torch.float32).eps * g_want.abs().max().item()
    plain = (g2.double() - g_want).abs().max().item()
    assert (g1.double() - g_want).abs().max().item() <= 2 * plain + 2 * ulp


@pytest.mark.parametrize("binning", ["hard", "soft"])
def test_float32_operator_is_as_close_to_float64_as_the_torch_path(binning):
    """Against the loss of the float32 inputs in float64, the operator's float32 error is at most the torch
    path's plus two float32 ulps of the result: its sums are float64."""
    z, y = _batch((2000,), 50, seed=7, scale=4.0, dtype=torch.float32)
    assert binning == "soft" or _edge_distance(z, 20) > 1e-7
    with F.use_cpu_extension(False):
        exact = F.ml1ace_loss(z.double(), y, binning=binning)
        plain = F.ml1ace_loss(z, y, binning=binning)
    fused = F.ml1ace_loss(z, y, binning=binning)
    ulp = torch.finfo(torch.float32).eps * abs(exact.item())
    assert abs(fused.double() - exact) <= abs(plain.double() - exact) + 2 * ulp


@pytest.mark.parametrize("n_bins", [2, 15, 31, 32, 45])
@pytest.mark.parametrize("binning", ["hard", "soft"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_planes_gradient_at_every_table_size_and_confident_positions(n_bins, binning, dtype):
    """The (N, K, S) backward takes u = ∂ACE/∂p of every entry in vector lanes from per-class tables of M + 1
    entries (two-register permutes for float32 up to M = 31 with AVX-512, a load per lane above and for
    float64), soft u as γ + δ·r about each bin's centre. Logits of scale 6 put many positions above the last
    soft centre (u clamped, r = 1) and the rest across every bin; some labels are ignored. Against the torch
    path in float64 on the same inputs: float64 to 1e-10 (sums in another order). In float32 the soft bins'
    gradient moves with the rounding of p itself (r = p·M − l − 1/2 scales p's error by M; at M = 45 the
    float32 torch path lands ~100 float32 ulps of the largest entry from float64): the operator, whose p
    comes from another exponential, is held to twice the float32 torch path's distance plus two ulps (it
    measured 0.4-1.3x of that distance at these seeds, as the previous scalar code did; a wrong table entry
    or index moves whole bins' terms). Every p is kept 1e-6 from the hard edges and the soft centres, where
    the bins (and u's pieces) change, so both precisions take the same bins."""
    z, y = _batch((2, 130), 6, seed=n_bins, scale=6.0, dtype=dtype)
    p = torch.softmax(z.double(), 1)
    assert (p > 1 - 0.5 / n_bins).sum() > 20  # positions above the last soft centre
    assert (_edge_distance if binning == "hard" else _centre_distance)(z, n_bins) > 1e-6
    options = {"binning": binning, "n_bins": n_bins}
    x = z.clone().requires_grad_(True)
    got = _fused(x, y, options)
    assert "FusedAce" in got.grad_fn.name()
    (g_got,) = torch.autograd.grad(got, x)
    xr = z.double().requires_grad_(True)
    with F.use_cpu_extension(False):
        want = _fused(xr, y, options)
    (g_want,) = torch.autograd.grad(want, xr)
    if dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-12)
    else:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        xp = z.clone().requires_grad_(True)
        with F.use_cpu_extension(False):
            (g_plain,) = torch.autograd.grad(_fused(xp, y, options), xp)
        ulp = torch.finfo(torch.float32).eps * g_want.abs().max().item()
        plain = (g_plain.double() - g_want).abs().max().item()
        assert (g_got.double() - g_want).abs().max().item() <= 2 * plain + 2 * ulp


@pytest.mark.parametrize("ignore_index", [None, 0, 255])
def test_ignore_index_forms(ignore_index):
    """ignore_index None (every label counts), a class index (its labels leave the loss and the bins) and 255."""
    z, y = _batch((3, 4, 5), 6, seed=1, dtype=torch.float64, ignore=255 if ignore_index == 255 else 0)
    for options in ({"ignore_index": ignore_index}, {"ignore_index": ignore_index, "binning": "soft"}):
        for reduction in ("mean", "none"):
            (v1, g1), (v2, g2) = _both_paths(z, y, options, reduction)
            torch.testing.assert_close(v1, v2, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)


def test_every_label_ignored_gives_nan_mean_and_zero_gradient_like_the_torch_path():
    for z, y in ((torch.randn(4, 3), torch.full((4,), -100)), (torch.randn(2, 3, 4), torch.full((2, 4), -100))):
        for binning in ("hard", "soft"):
            (v1, g1), (v2, g2) = _both_paths(z, y, {"binning": binning}, "mean")
            assert torch.isnan(v1) and torch.isnan(v2)
            torch.testing.assert_close(g1, g2, equal_nan=True)
            (v1, g1), (v2, g2) = _both_paths(z, y, {"binning": binning}, "none")
            torch.testing.assert_close(v1, v2)
            torch.testing.assert_close(g1, g2)


def test_ignored_positions_with_large_logits_get_a_zero_gradient():
    """An ignored position's logits above 88 (exp(x) overflows float32 unless x − max is taken): its gradient
    is 0 and the others are the torch path's, float32 (N, K, H, W) and (N, K)."""
    for shape in ((2, 70), (70,)):
        z, y = _batch(shape, 5, seed=6, dtype=torch.float32, ignore=None)
        at = (slice(None), slice(None), 3) if z.dim() == 3 else (3,)
        z[at] += 120.0
        y[at[:1] + at[2:]] = -100
        for binning in ("hard", "soft"):
            (v1, g1), (v2, g2) = _both_paths(z, y, {"binning": binning}, "mean")
            assert torch.isfinite(g1).all()
            assert (g1[at] == 0).all()
            # float32 sums over 140 positions in another order: a few ulp of the loss's scale
            torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("fill", [float("nan"), -float("inf")], ids=["nan", "-inf"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_non_finite_logits_at_ignored_positions_leave_the_loss(fill, dtype):
    """An ignored position whose logits are NaN or all −inf (masked padding) takes no part in the loss: the
    operator's value and gradient are bitwise those it gives with those logits set to 0 (the same sums in
    the same order), its gradient there is 0, and in float64 both equal the torch path's on the clean input
    to 1e-10 (sums in another order). Position 3 lies in a vector block of its 64-position tile (where the
    simple entries' p had been added as p·kept: NaN·0 poisoned bin 0 of every class), position 66 in the
    scalar tail; (N, K) rows too. The torch path on the padded input gives its clean result too (it had
    cast a NaN soft-bin position to an index, and taken NaN gradients through the softmax)."""
    for shape in ((2, 70), (70,)):
        for pos in (3, 66):
            z, y = _batch(shape, 5, seed=7, dtype=dtype, ignore=None)
            at = (slice(None), slice(None), pos) if z.dim() == 3 else (pos,)
            y[at[:1] + at[2:]] = -100
            clean = z.clone()
            clean[at] = 0.0
            z[at] = fill
            for binning in ("hard", "soft"):
                for reduction in ("mean", "none"):
                    x = z.clone().requires_grad_(True)
                    out = _fused(x, y, {"binning": binning}, reduction)
                    assert "FusedAce" in out.grad_fn.name()
                    value = out.detach()
                    (grad,) = torch.autograd.grad((out * _upstream(out)).sum(), x)
                    (v_clean, g_clean), (v_ref, g_ref) = _both_paths(
                        clean, y, {"binning": binning}, reduction, _upstream
                    )
                    assert (grad[at] == 0).all()
                    assert torch.equal(value, v_clean) and torch.equal(grad, g_clean)
                    if dtype == torch.float64:
                        torch.testing.assert_close(value, v_ref, rtol=1e-10, atol=1e-12)
                        torch.testing.assert_close(grad, g_ref, rtol=1e-10, atol=1e-12)
                    x = z.clone().requires_grad_(True)
                    with F.use_cpu_extension(False):
                        out = _fused(x, y, {"binning": binning}, reduction)
                    (g_torch,) = torch.autograd.grad((out * _upstream(out)).sum(), x)
                    assert torch.equal(out.detach(), v_ref) and torch.equal(g_torch, g_ref)


def test_an_image_without_kept_positions_leaves_the_mean():
    z, y = _batch((3, 4, 4), 5, seed=4)
    y[1] = -100
    for binning in ("hard", "soft"):
        for reduction in ("mean", "sum", "none"):
            (v1, g1), (v2, g2) = _both_paths(z, y, {"binning": binning}, reduction, _upstream)
            torch.testing.assert_close(v1, v2, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)


def test_label_errors_are_the_torch_paths():
    """A label outside [0, K) that is not ignore_index: the operator refuses it and the torch path raises
    its named error."""
    z = torch.randn(3, 4)
    for bad in (torch.tensor([0, 4, 1]), torch.tensor([0, -1, 1])):
        messages = []
        for cpp in (True, False):
            with F.use_cpu_extension(cpp), pytest.raises(ValueError) as info:
                F.ml1ace_loss(z, bad)
            messages.append(str(info.value))
        assert messages[0] == messages[1]
    edges = torch.linspace(0, 1, 21)[1:-1]
    with pytest.raises(ValueError, match=r"`targets` must lie in \[0, 4\), found label 4"):
        torch.ops.torchcal.fused_ace(z, torch.tensor([0, 4, 1]), edges, [1.0, 0.01], [20, 0, 0, 1, 0, 1], None)


def _hard_ace_on_given_edges(z, y, edges, lam):
    """CE mean + λ·the mean over classes of the hard-bin ACE, with each p's bin from torch.bucketize of the
    input dtype's softmax on ``edges`` (right=False: the edges below p) and the sums in float64: the
    reference semantics of the operator's bins for any sorted edges."""
    p_in = torch.softmax(z.detach(), 1)
    bins = torch.bucketize(p_in, edges, right=False)
    p = torch.softmax(z.double(), 1)
    y1 = torch.nn.functional.one_hot(y, z.shape[1]).double()
    aces = []
    for c in range(z.shape[1]):
        gaps = [(p[bins[:, c] == m, c].sum() - y1[bins[:, c] == m, c].sum()).abs() / (bins[:, c] == m).sum()
                for m in range(edges.numel() + 1) if (bins[:, c] == m).any()]  # fmt: skip
        aces.append(torch.stack(gaps).mean())
    return torch.nn.functional.cross_entropy(z.double(), y) + lam * torch.stack(aces).mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("first", ["equal", "below", "above"])
@pytest.mark.parametrize("second", ["equal", "below"])
@pytest.mark.parametrize("layout", ["NK", "NKS"])
def test_hard_bins_of_p_on_and_one_ulp_from_an_edge(dtype, first, second, layout):
    """Rows of three equal logits give p = 1/3 in the input dtype, rows (0, 0, −200) give (1/2, 1/2, 0):
    exactly these numbers in the operator, which takes e = 1 over Σ e. With an edge at, one ulp below or
    one ulp above 1/3 (and at or one ulp below 1/2), a p on an edge stays in the lower bin and a p one ulp
    above it goes up (torch.bucketize, right=False); the class-2 entries p = 1/3 and p = 0 share a bin or
    not, which changes the ACE. Value and gradient against the float64 reference on the same bins; NKS: the
    same rows as the positions of one (1, 3, 11) image (the tiles' path)."""
    third = torch.tensor(1.0, dtype=dtype) / 3
    half = torch.tensor(0.5, dtype=dtype)
    toward = {"equal": None, "below": torch.tensor(0.0, dtype=dtype), "above": torch.tensor(1.0, dtype=dtype)}
    e1 = third if toward[first] is None else torch.nextafter(third, toward[first])
    e2 = half if toward[second] is None else torch.nextafter(half, toward[second])
    edges = torch.stack([e1, e2])
    z = torch.zeros(11, 3, dtype=dtype)
    z[6:, 2] = -200.0
    y = torch.tensor([0, 1, 2, 0, 0, 0, 0, 1, 1, 0, 1])  # no bin's Σ p − Σ y is 0 (|·| has no derivative there)
    assert (torch.softmax(z, 1)[:6] == third).all() and (torch.softmax(z, 1)[6:, :2] == half).all()
    x = z.clone().requires_grad_(True)
    xs, ys = (x, y) if layout == "NK" else (x.T[None], y[None])
    got = torch.ops.torchcal.fused_ace(xs, ys, edges, [1.5, 0.01], [3, 0, 0, 1, 0, 1], None)
    xr = z.double().requires_grad_(True)
    want = _hard_ace_on_given_edges(xr, y, edges, 1.5)
    # float64 reference sums; float32 inputs: p rounded once, a few ulps of the value
    tol = {"rtol": 1e-6, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-13}
    torch.testing.assert_close(got.double(), want.detach(), **tol)
    got.backward()
    want.backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, **tol)


def test_results_do_not_depend_on_the_thread_count():
    """The bins are summed in chunks fixed by the shape, in chunk order: the same bits on 1 and 3 threads. Both
    shapes have several chunks per group (Spec's rule, at least 1,024 rows: 4 for the rows, 7 per image)."""
    g = torch.Generator().manual_seed(2)
    cases = [(3 * torch.randn(5000, 64, generator=g), torch.randint(0, 64, (5000,), generator=g)),
             (3 * torch.randn(2, 19, 80, 100, generator=g), torch.randint(0, 19, (2, 80, 100), generator=g))]  # fmt: skip

    def step(z, y, binning):
        x = z.clone().requires_grad_(True)
        loss = F.ml1ace_loss(x, y, binning=binning)
        loss.backward()
        return loss.detach(), x.grad

    for z, y in cases:
        for binning in ("hard", "soft"):
            results = for_thread_counts(step, z, y, binning)
            assert torch.equal(results[0][0], results[1][0])
            assert torch.equal(results[0][1], results[1][1])


def test_layouts_and_label_dtypes_match_the_torch_path():
    """Non-contiguous logits (a transposed view, channels-last images) and int32 / uint8 labels."""
    g = torch.Generator().manual_seed(1)
    z = (3 * torch.randn(7, 40, generator=g, dtype=torch.float64)).t()[:, :7]
    y = torch.randint(0, 7, (40,), generator=g, dtype=torch.int32)
    images = (3 * torch.randn(2, 5, 6, 7, generator=g, dtype=torch.float64)).to(memory_format=torch.channels_last)
    labels = torch.randint(0, 5, (2, 6, 7), generator=g, dtype=torch.uint8)
    for logits, targets in ((z, y), (images, labels)):
        assert not logits.is_contiguous()
        for binning in ("hard", "soft"):
            (v1, g1), (v2, g2) = _both_paths(logits, targets, {"binning": binning}, "none")
            torch.testing.assert_close(v1, v2, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)


def test_what_the_operator_leaves_to_the_torch_path():
    """Soft targets, multi-label outputs, half-precision logits (upcast by the torch path), the penalty alone
    and a disabled extension take the torch path; float32 logits inside an autocast region take the operator
    unchanged."""
    z, y = torch.randn(6, 4, requires_grad=True), torch.randint(0, 4, (6,))
    q = torch.softmax(torch.randn(6, 4), 1)
    assert "FusedAce" not in F.ml1ace_loss(z, q).grad_fn.name()
    assert "FusedAce" not in F.ml1ace_loss(z, (q > 0.3).float(), multilabel=True).grad_fn.name()
    assert "FusedAce" not in F.ml1ace_loss(z.detach().bfloat16().requires_grad_(True), y).grad_fn.name()
    assert "FusedAce" not in F.ml1ace_penalty(z, y).grad_fn.name()
    with F.use_cpu_extension(False):
        assert "FusedAce" not in F.ml1ace_loss(z, y).grad_fn.name()
        expected = F.ml1ace_loss(z, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.ml1ace_loss(z, y)
    assert "FusedAce" in loss.grad_fn.name() and loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_no_graph_without_gradients_and_extreme_logits():
    z = torch.tensor([[1e4, -1e4, 0.0], [-1e4, 1e4, 1e4], [0.0, 0.0, 0.0]], dtype=torch.float64)
    y = torch.tensor([1, 2, 0])
    with torch.no_grad():
        assert not F.ml1ace_loss(z, y).requires_grad
    for binning in ("hard", "soft"):
        (v1, g1), (v2, g2) = _both_paths(z, y, {"binning": binning}, "mean")
        assert torch.isfinite(v1) and torch.isfinite(g1).all()
        torch.testing.assert_close(v1, v2, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)


def test_second_order_gradients_are_refused():
    z, y = torch.randn(5, 4, dtype=torch.float64, requires_grad=True), torch.tensor([0, 1, 2, 3, 0])
    with pytest.raises(RuntimeError, match="differentiable once only"):
        torch.autograd.grad(F.ml1ace_loss(z, y), z, create_graph=True)


def _operator_args(z, y, soft, reduction, per_image=0, first=0):
    edges = torch.linspace(0, 1 + 1.1920928955078125e-07, 6, dtype=z.dtype)[1:-1]
    return (z, y, edges, [1.5, 0.01], [5, int(soft), first, 1, per_image, reduction], -100)


@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_the_compile_operators_pass_opcheck(soft, dtype, reduction):
    """The forward/backward pair that torch.compile traces: schema, fake implementation (shapes, dtypes) and
    autograd registration checked by torch.library.opcheck, at (N, K) and (N, K, H, W)."""
    for z, y, per_image in ((torch.randn(6, 4, dtype=dtype), torch.tensor([0, 1, 2, 3, 0, 1]), 0),
                            (torch.randn(2, 3, 2, 2, dtype=dtype), torch.randint(0, 3, (2, 2, 2)), 1)):  # fmt: skip
        args = _operator_args(z.requires_grad_(True), y, soft, reduction, per_image)
        torch.library.opcheck(torch.ops.torchcal.fused_ace_fwd.default, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_compile_operators_equal_the_eager_operator(dtype):
    """Loss and gradient of fused_ace_fwd / _bwd (with their registered autograd formula) are the eager
    operator's, bit for bit: the same C++ forward and backward."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 5, 4, 2, generator=g, dtype=dtype)
    y = torch.randint(0, 5, (3, 4, 2), generator=g)
    y[0, 0, 0] = -100
    for soft in (False, True):
        for reduction in (0, 1, 2):
            a, b = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
            eager = torch.ops.torchcal.fused_ace(*_operator_args(a, y, soft, reduction, 1, 1))
            pair = torch.ops.torchcal.fused_ace_fwd(*_operator_args(b, y, soft, reduction, 1, 1))[0]
            assert torch.equal(eager.detach(), pair.detach())
            (ga,) = torch.autograd.grad(eager.sum(), a)
            (gb,) = torch.autograd.grad(pair.sum(), b)
            assert torch.equal(ga, gb)


@pytest.mark.compile
def test_compiled_loss_takes_the_operator_pair_and_equals_eager():
    z, y = torch.randn(2, 4, 3, 3), torch.randint(0, 4, (2, 3, 3))
    y[0, 0, 0] = -100
    for binning in ("hard", "soft"):
        fn = lambda a, b, m=binning: F.ml1ace_loss(a, b, binning=m)  # noqa: E731
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        a, b = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
        got = compiled(a, y)
        want = fn(b, y)
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_soft_weights_are_the_same_number_at_every_use():
    """The soft bins' r enters the count, Σ w y and the backward at different places of the operator; a
    multiply-add contracted at one and not another made them differ by an ulp, which a bin of weight 1 − r =
    0.026 amplified to a 5e-4 error in the gradient (this row; one image per row). With one rounding
    everywhere, the float32 gradient is within float32 rounding of the float64 one."""
    z = torch.tensor([[0.7917, -3.6390, -1.9500, -1.6310, 0.6377, -6.3890, -7.6901]])
    y = torch.tensor([4])
    fn = lambda a: F.ml1ace_loss(a, y, binning="soft", per_image=True, reduction="none").sum()  # noqa: E731
    x = z.clone().requires_grad_(True)
    assert "FusedAce" in F.ml1ace_loss(x, y, binning="soft", per_image=True).grad_fn.name()
    (got,) = torch.autograd.grad(fn(x), x)
    with F.use_cpu_extension(False):
        xd = z.double().requires_grad_(True)
        (want,) = torch.autograd.grad(fn(xd), xd)
    # entries up to ~0.6; float32 p and products, a few ulps each
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)


def test_edges_made_once_serve_graphs_after_inference_mode():
    """The hard bins' edges are made once per (M, dtype) and reused. Made first under inference mode, an
    inference tensor could not be saved by a later call's graph ("Inference tensors cannot be saved for
    backward"): they are made outside it, and the later step equals the torch path's."""
    from torchcal.functional._backend import _ace_edges

    _ace_edges.cache_clear()
    z, y = _batch((40,), 7, seed=3)
    with torch.inference_mode():
        F.ml1ace_loss(z, y, n_bins=13)
    (v1, g1), (v2, g2) = _both_paths(z, y, {"n_bins": 13}, "mean")
    torch.testing.assert_close(v1, v2, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)
    want = torch.linspace(0, 1 + 1.1920928955078125e-07, 14, dtype=torch.float64)[1:-1]
    assert torch.equal(_ace_edges(13, torch.float64), want)
