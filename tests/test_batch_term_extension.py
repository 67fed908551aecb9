"""The C++ operator of the batch-term losses (MDCA with its three bases, DCA, SB-ECE, AvUC, S-AvUC, ESD;
torch.ops.torchcal.batch_terms_fwd / _bwd, decision 202) against the plain torch path: values and gradients
at (N, K) and (N, K, d1, ...) (positions as vector lanes for float32), ignored labels, the three reductions,
ties in the maximum, the label errors, threads, the loss options that read its outputs (AvUC's statistics,
ESD's hold-out), a numerical gradient check and torch.compile."""

import pytest
import torch

import torchcal.functional as F
from tests.conftest import for_thread_counts
from torchcal.functional import _extension
from torchcal.losses import AvUCLoss

pytestmark = pytest.mark.usefixtures("cpp_extension")

EPS32 = torch.finfo(torch.float32).eps

# each loss with options that make every part of its term active at unit-scale logits (SB-ECE's bins a
# little wider than the default T = 0.01, so that the memberships are not all 0 or 1)
LOSSES = {
    "mdca": lambda z, y, **kw: F.mdca_loss(z, y, 0.7, **kw),
    "focal-mdca": lambda z, y, **kw: F.mdca_loss(z, y, 0.7, base="focal", gamma=2.0, **kw),
    "focal-mdca-g0.5": lambda z, y, **kw: F.mdca_loss(z, y, 1.0, base="focal", gamma=0.5, **kw),
    "ls-mdca": lambda z, y, **kw: F.mdca_loss(z, y, 1.0, base="ls", smoothing=0.2, **kw),
    "dca": lambda z, y, **kw: F.dca_loss(z, y, 3.0, **kw),
    "sb-ece": lambda z, y, **kw: F.sbece_loss(z, y, 2.0, temperature=0.05, **kw),
    "sb-ece-binned": lambda z, y, **kw: F.sbece_loss(z, y, 2.0, temperature=0.05, form="binned", **kw),
    "avuc": lambda z, y, **kw: F.avuc_loss(z, y, 3.0, threshold=1.0, **kw),
    "s-avuc": lambda z, y, **kw: F.soft_avuc_loss(z, y, 1.0, temperature=0.3, kappa=0.4, **kw),
    "esd": lambda z, y, **kw: F.esd_loss(z, y, 4.0, **kw),
    "esd-holdout": lambda z, y, **kw: F.esd_loss(z, y, 4.0, holdout=0.34, **kw),
}

# Tolerances. float64: both paths evaluate the same float64 formulas, the operator from a float64
# log-sum-exp per row and the torch path from log_softmax, so they differ by rounding only (a few ulp per
# row, summed over <= 200 rows). float32: the operator computes each row's numbers in float64 (or in float32
# lanes for spatial inputs) and rounds once, while the torch path rounds after every float32 operation;
# the difference is a few float32 ulp of each per-row number, which the batch terms average, and the
# gradients, compared against their largest entry, carry the same relative error times the condition of
# the batch term (the softmax memberships of SB-ECE with T = 0.05 amplify it ~10x).
TOL = {torch.float64: (1e-11, 1e-12, 1e-10), torch.float32: (2e-6, 2e-6, 5e-5)}


def _both_paths(fn, z, y, upstream=None):
    """fn(z, y) and its gradient (of Σ upstream·loss) with the C++ operator and on the plain torch path,
    checking that each path ran (the operator's autograd node is in the graph or not)."""
    results = []
    for cpp in (True, False):
        x = z.detach().clone().requires_grad_(True)
        with F.use_cpu_extension(cpp):
            calls = _count_calls()
            value = fn(x, y)
            assert (calls() > 0) == cpp
            weights = torch.ones_like(value) if upstream is None else upstream(value)
            (grad,) = torch.autograd.grad((value * weights).sum(), x)
        results.append((value.detach(), grad))
    return results


def _count_calls():
    """A counter of the operator's calls from now on (the forward of _BatchRows)."""
    start = _CALLS[0]
    return lambda: _CALLS[0] - start


_CALLS = [0]


@pytest.fixture(autouse=True)
def _count_operator_calls(monkeypatch):
    """Counts the operator's forward calls during each test of this module, of the per-row operator alone
    (_BatchRows) and of the whole-loss node (fused_batch_loss), patched for the test only: a counter in the
    traced forward would make torch.compile retrace elsewhere."""
    forward = _extension._BatchRows.forward
    whole = _extension.fused_batch_loss

    def counted(ctx, *args):
        _CALLS[0] += 1
        return forward(ctx, *args)

    def counted_whole(*args):
        _CALLS[0] += 1
        return whole(*args)

    monkeypatch.setattr(_extension._BatchRows, "forward", staticmethod(counted))
    monkeypatch.setattr(_extension, "fused_batch_loss", counted_whole)


def _close(got, want, dtype, grad=False):
    rtol, atol, grad_tol = TOL[dtype]
    if grad:  # against the gradient's scale: the entries of a row differ by orders of magnitude
        scale = float(want.abs().max()) + 1e-30
        torch.testing.assert_close(got / scale, want / scale, rtol=0, atol=grad_tol)
    else:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)


def _inputs(shape, dtype, seed=0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    z = (2 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    y = torch.randint(0, shape[1], (shape[0], *shape[2:]), generator=g)
    if ignore:
        y.view(-1)[::5] = -100
    return z, y


def _float32_near_float64(fn, z, y, grad_atol=5e-5):
    """fn(z, y) with float32 logits (the operator) against the float64 torch path: the value to 1e-5
    relative, the gradient (finite) to ``grad_atol`` (5e-5) of its largest entry."""
    x32 = z.float().requires_grad_(True)
    value = fn(x32, y)
    value.backward()
    x64 = z.clone().requires_grad_(True)
    with F.use_cpu_extension(False):
        want = fn(x64, y)
    want.backward()
    torch.testing.assert_close(value.double(), want.detach(), rtol=1e-5, atol=1e-6)
    got, ref = x32.grad, x64.grad
    assert got is not None and ref is not None
    assert torch.isfinite(got).all()
    scale = float(ref.abs().max())
    torch.testing.assert_close(got.double() / scale, ref / scale, rtol=0, atol=grad_atol)


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(48, 7), (6, 130), (3, 5, 7, 5), (2, 19, 37)], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_operator_equals_the_torch_path(name, dtype, shape, reduction):
    z, y = _inputs(shape, dtype)
    fn = LOSSES[name]
    upstream = None
    if reduction == "none":  # the same weights on both paths
        upstream = lambda v: torch.randn(v.shape, generator=torch.Generator().manual_seed(1), dtype=v.dtype)  # noqa: E731
    (va, ga), (vb, gb) = _both_paths(lambda a, b: fn(a, b, reduction=reduction), z, y, upstream)
    _close(va, vb, dtype)
    _close(ga, gb, dtype, grad=True)


@pytest.mark.parametrize("name", list(LOSSES))
def test_numerical_gradient_of_the_operator(name):
    """The analytic backward against finite differences (float64; (N, K) and positions)."""
    for shape in [(7, 4), (2, 3, 4)]:
        z, y = _inputs(shape, torch.float64, seed=3, ignore=False)
        y.view(-1)[1] = -100
        x = z.clone().requires_grad_(True)
        torch.autograd.gradcheck(lambda a, b=y: LOSSES[name](a, b, reduction="sum"), (x,), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(6, 5), (2, 5, 20)], ids=str)
def test_ties_in_the_maximum_predict_the_first_class(dtype, shape):
    """Rows whose maximum is tied: the prediction (correctness) and r's gradient go to the first of them,
    as torch's max(dim) on CPU."""
    z = torch.zeros(shape, dtype=dtype)
    z[:, 1] = 2.0
    z[:, 3] = 2.0
    y = torch.full((shape[0], *shape[2:]), 3)
    y.view(-1)[::2] = 1
    for name in ("dca", "avuc", "esd", "sb-ece"):
        (va, ga), (vb, gb) = _both_paths(lambda a, b, n=name: LOSSES[n](a, b), z, y)
        _close(va, vb, dtype)
        _close(ga, gb, dtype, grad=True)


def test_label_errors_are_the_torch_paths():
    z = torch.randn(4, 3)
    for labels in ([0, 3, 1, 2], [0, -1, 1, 2], [0, -100, 1, 7]):
        y = torch.tensor(labels)
        messages = []
        for cpp in (True, False):
            with F.use_cpu_extension(cpp), pytest.raises(ValueError) as err:
                F.mdca_loss(z, y)
            messages.append(str(err.value))
        assert messages[0] == messages[1]
        assert "targets" in messages[0]
    with pytest.raises(ValueError, match="lie in"):
        torch.ops.torchcal.batch_terms_fwd(z, torch.tensor([0, 3, 1, 2]), -100, 0, 1.0, 0.0, 0, False)


def test_every_label_ignored_is_the_torch_paths():
    z = torch.randn(5, 4)
    y = torch.full((5,), -100)
    for name in ("mdca", "dca", "avuc", "esd"):
        (va, ga), (vb, gb) = _both_paths(lambda a, b, n=name: LOSSES[n](a, b), z, y)
        torch.testing.assert_close(va, vb, equal_nan=True, rtol=0, atol=0)
        torch.testing.assert_close(ga, gb, equal_nan=True, rtol=1e-6, atol=1e-7)


def test_results_do_not_depend_on_the_thread_count():
    """The column sums are added per fixed block of rows and the blocks in order: bitwise the same for
    any thread count."""
    z, y = _inputs((3000, 40), torch.float32)
    zs, ys = _inputs((3, 19, 40, 40), torch.float32)

    def steps():
        out = []
        for a, b in ((z, y), (zs, ys)):
            x = a.clone().requires_grad_(True)
            value = F.mdca_loss(x, b, base="ls")
            value.backward()
            out += [value.detach(), x.grad]
        return out

    results = for_thread_counts(steps, counts=(1, 2))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_avuc_statistics_and_threshold_state_are_the_torch_paths():
    z, y = _inputs((40, 6), torch.float32)
    sums = []
    for cpp in (True, False):
        with F.use_cpu_extension(cpp):
            module = AvUCLoss(threshold=0.8)
            module(z.clone().requires_grad_(True), y).backward()
            module.update()
            sums.append((module.threshold.clone(), module(z, y).detach()))
    torch.testing.assert_close(sums[0][0], sums[1][0], rtol=1e-6, atol=0)
    torch.testing.assert_close(sums[0][1], sums[1][1], rtol=2e-6, atol=2e-6)


def test_second_order_gradients_are_refused():
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    loss = F.avuc_loss(x, torch.tensor([0, 1, 2, 3, 0]))
    assert isinstance(loss, torch.Tensor)
    with pytest.raises(RuntimeError, match="differentiable once only"):
        torch.autograd.grad(loss, x, create_graph=True)


def test_what_the_operator_leaves_to_the_torch_path():
    """Soft targets, half precision and extension off take the torch path (no operator call)."""
    z = torch.randn(6, 4)
    calls = _count_calls()
    F.mdca_loss(z, torch.softmax(torch.randn(6, 4), 1))
    F.dca_loss(z.half(), torch.randint(0, 4, (6,)))
    with F.use_cpu_extension(False):
        F.avuc_loss(z, torch.randint(0, 4, (6,)))
    assert calls() == 0
    F.avuc_loss(z, torch.randint(0, 4, (6,)))
    assert calls() == 1


@pytest.mark.compile
def test_compiled_losses_take_the_operator_and_equal_eager():
    z, y = torch.randn(2, 4, 3, 3), torch.randint(0, 4, (2, 3, 3))
    y[0, 0, 0] = -100
    for name in ("mdca", "avuc"):
        compiled = torch.compile(lambda a, b, n=name: LOSSES[n](a, b), fullgraph=True, backend="aot_eager")
        a, b = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
        calls = _count_calls()
        got = compiled(a, y)
        assert calls() > 0  # traced through the operator
        want = LOSSES[name](b, y)
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_layouts_and_label_dtypes_match_the_torch_path():
    """Non-contiguous logits (a transposed view, channels-last images) and int32 / uint8 labels."""
    g = torch.Generator().manual_seed(1)
    z = (3 * torch.randn(7, 40, generator=g)).t()[:, :7]
    y = torch.randint(0, 7, (40,), generator=g, dtype=torch.int32)
    images = (3 * torch.randn(2, 5, 6, 7, generator=g)).to(memory_format=torch.channels_last)
    labels = torch.randint(0, 5, (2, 6, 7), generator=g, dtype=torch.uint8)
    for name in ("mdca", "avuc", "sb-ece"):
        for logits, targets in ((z, y), (images, labels)):
            (va, ga), (vb, gb) = _both_paths(lambda a, b, n=name: LOSSES[n](a, b), logits, targets)
            _close(va, vb, torch.float32)
            _close(ga, gb, torch.float32, grad=True)


def test_eager_losses_run_as_one_node_without_the_row_function():
    """In eager mode every loss of LOSSES but SB-ECE's binned form is one call of the whole-loss node
    (fused_batch_loss, decision 217), not the per-row function plus torch terms; the binned form, class
    weights and a batch with no kept row stay on the per-row function / torch path."""
    z, y = _inputs((40, 6), torch.float32)
    whole, rows = [0], [0]
    node, function = _extension.fused_batch_loss, _extension._BatchRows.apply

    def count(counter, fn):
        def counted(*args):
            counter[0] += 1
            return fn(*args)

        return counted

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_extension, "fused_batch_loss", count(whole, node))
        mp.setattr(_extension._BatchRows, "apply", count(rows, function))
        for name, fn in LOSSES.items():
            whole[0] = rows[0] = 0
            fn(z, y)
            binned = name == "sb-ece-binned"
            assert (whole[0], rows[0]) == ((0, 1) if binned else (1, 0)), name
        whole[0] = rows[0] = 0
        F.dca_loss(z, y, weight=torch.rand(6))
        F.avuc_loss(z, torch.full_like(y, -100))
        assert whole[0] == 1 and rows[0] == 2  # (the empty batch: the node's answer is not taken)


@pytest.mark.parametrize(
    "name", ["mdca", "focal-mdca", "ls-mdca", "dca", "sb-ece", "avuc", "s-avuc", "esd", "esd-holdout"]
)
@pytest.mark.parametrize("classes", [10, 100])
def test_batch_scale_float32_is_near_the_float64_torch_path(name, classes):
    """At 4096 rows (ESD's radix sort moves every digit; confidences tie between rows) the float32 node is
    compared with the float64 torch path: the node rounds each per-row number to float32 once and sums in
    float64, so both differ from the float64 truth by a few float32 ulp of each row's numbers (relative
    ~1e-6 after averaging; the gradient against its largest entry ~1e-5, SB-ECE's memberships amplifying).
    K = 10 takes the lane kernels, K = 100 the rows with the exps kept for the backward."""
    g = torch.Generator().manual_seed(7)
    z = 2 * torch.randn(4096, classes, generator=g, dtype=torch.float64)
    z[:64] = z[64:128]  # 64 pairs of equal rows: equal confidences
    y = torch.randint(0, classes, (4096,), generator=g)
    y[::9] = -100
    _float32_near_float64(LOSSES[name], z, y)


def test_esd_over_many_chunks_with_long_ties():
    """ESD at 2^17 + 5000 rows, whose passes run on 16 chunks and whose sort of the ~122,500 kept rows on 3:
    400 distinct rows repeated, so runs of equal confidences (~340 rows) cross the chunks' nominal cuts, and
    a tenth of the rows ignored.
    float64 through the operator against the float64 torch path (sums in another order: ~1e-12 relative);
    float32 against float64 (the radix sort's chunks) with the batch-scale test's tolerances; and the
    float32 result bitwise the same with 1 and 2 threads (the chunks depend on the row count only)."""
    g = torch.Generator().manual_seed(5)
    rows = (1 << 17) + 5000
    distinct = 2 * torch.randn(400, 10, generator=g, dtype=torch.float64)
    z = distinct[torch.randint(0, 400, (rows,), generator=g)]
    y = torch.randint(0, 10, (rows,), generator=g)
    y[::10] = -100
    fn = LOSSES["esd"]
    (va, ga), (vb, gb) = _both_paths(fn, z, y)
    torch.testing.assert_close(va, vb, rtol=1e-11, atol=1e-13)
    scale = float(gb.abs().max())
    torch.testing.assert_close(ga / scale, gb / scale, rtol=0, atol=1e-11)
    _float32_near_float64(fn, z, y)

    def step():
        x = z.float().requires_grad_(True)
        value = fn(x, y)
        value.backward()
        return value.detach(), x.grad

    results = for_thread_counts(step, counts=(1, 2))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("name", ["sb-ece", "esd"])
def test_a_nan_logit_makes_the_batch_term_nan_on_both_paths(name):
    """A NaN logit in one kept row: the batch term (a square root of a batch statistic) is NaN, so every
    row's "none" loss is NaN on both paths (the torch path's guarded square root had turned NaN into 0)."""
    g = torch.Generator().manual_seed(13)
    z = 2 * torch.randn(40, 7, generator=g, dtype=torch.float64)
    y = torch.randint(0, 7, (40,), generator=g)
    z[5, 2] = float("nan")
    for cpp in (True, False):
        with F.use_cpu_extension(cpp):
            out = LOSSES[name](z, y, reduction="none")
        assert torch.isnan(out).all(), (cpp, out)


@pytest.mark.parametrize("classes", [7, 100], ids=["lanes", "rows"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_focal_base_below_gamma_one_at_certain_rows(classes, dtype):
    """FL+MDCA with γ = 0.5 on rows whose p_y is 1 to the dtype (a margin of 40, the max first or last):
    u^γ's derivative is infinite at u = 0 and multiplies log p_y = 0; the term's gradient tends to 0
    (−γ u^γ), and both paths give that, finite, not inf·0 = NaN. The other rows random; the operator
    against the torch path on the same input with the batch-scale test's tolerances (float64 to 1e-10)."""
    g = torch.Generator().manual_seed(12)
    z = 2 * torch.randn(32, classes, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (32,), generator=g)
    z[:2] = 0.0
    z[0, 0] = z[1, classes - 1] = 40.0
    y[0], y[1] = 0, classes - 1
    z = z.to(dtype)
    fn = LOSSES["focal-mdca-g0.5"]
    (va, ga), (vb, gb) = _both_paths(fn, z, y)
    assert torch.isfinite(ga).all() and torch.isfinite(gb).all()
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(va, vb, rtol=tol, atol=tol)
    scale = float(gb.abs().max())
    torch.testing.assert_close(ga / scale, gb / scale, rtol=0, atol=tol * 5)


@pytest.mark.parametrize("shape", [(64, 7), (2, 19, 8, 9)], ids=str)
def test_label_smoothing_base_keeps_its_digits_under_a_shared_offset(shape):
    """float32 MDCA with the label-smoothing base on the lanes (K <= 32 rows, positions): logits sharing an
    offset of 1e4 (their float32 ulp 1e-3; x − max is exact there, Sterbenz) against the float64 torch path
    on the same float32 numbers. Σ_j log p_j is taken from Σ_j (x_j − max): per row a float32 sum of K terms
    of a few units, ~K·6e-8 relative, so 1e-5 of the row's loss (~3) holds; a sum of the raw logits less
    K·max had lost 3 digits here (2.6e-4)."""
    g = torch.Generator().manual_seed(4)
    z = (2 * torch.randn(shape, generator=g, dtype=torch.float64) + 1e4).float()
    y = torch.randint(0, shape[1], (shape[0], *shape[2:]), generator=g)
    fn = LOSSES["ls-mdca"]
    got = fn(z, y, reduction="none")
    with F.use_cpu_extension(False):
        want = fn(z.double(), y, reduction="none")
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_esd_float32_sort_on_sixteen_chunks():
    """float32 ESD sorts its kept rows' confidences with a radix sort of three 11-bit digits on chunks (16 at
    2^19 + 7 rows); each pass after the first must count the chunks of the order the previous pass left. Two
    classes whose confidences r are distinct and 16 float32 ulps apart or more (r from 0.5 to 1, every
    digit of their bits moves), so the float32 operator sorts the rows as the float64 torch path does, and
    the two agree to float32 rounding: the value to 1e-5 relative, the gradient to 5e-5 of its largest
    entry (the tolerances of the batch-scale test)."""
    g = torch.Generator().manual_seed(8)
    rows = (1 << 19) + 7
    r = torch.linspace(0.5 + 2**-20, 1 - 2**-20, rows, dtype=torch.float64)[torch.randperm(rows, generator=g)]
    z = torch.zeros(rows, 2, dtype=torch.float64)
    z[:, 1] = torch.log(r) - torch.log1p(-r)
    y = torch.randint(0, 2, (rows,), generator=g)
    _float32_near_float64(LOSSES["esd"], z, y)


@pytest.mark.parametrize("name", ["focal-mdca", "avuc"])
@pytest.mark.parametrize("classes", [10, 100])
def test_extreme_rows_float32_are_near_the_float64_torch_path(name, classes):
    """The float32 shortcuts of decisions 220-221 at their edges: rows with probabilities far below 1e-10
    (AvUC's log floor, spread 80), a -inf logit off the label (p = 0 exactly), and near-certain rows whose
    1 − p_y is ~1e-8 (the focal base's (Σ − e_y)/Σ). Against the float64 torch path with the tolerances of
    the batch-scale test: the value to 1e-5 relative, the gradient to 5e-5 of its largest entry."""
    g = torch.Generator().manual_seed(11)
    z = 2 * torch.randn(64, classes, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (64,), generator=g)
    z[:16] += 80 * torch.rand(16, classes, generator=g, dtype=torch.float64)  # spread 80: p down to e^-80
    z[16:24, 1] = -torch.inf
    y[16:24] = 0
    z[24:32] = 0.0
    z[24:32, 3] = 20.0  # p_y = 1 − ~(K − 1)e^-20
    y[24:32] = 3
    _float32_near_float64(LOSSES[name], z, y)


def _entropy_sweep(shape, seed):
    """float64 rows (as many as ``shape``'s positions, K = shape[1]) whose entropy sweeps from ~1e-9 (a margin
    of 25 of one class over logits of spread 0.05) to about log K (a margin of 0), 70% labelled with that
    class: (z (rows, K), y (rows,))."""
    k = shape[1]
    rows = shape[0] * (shape[2] if len(shape) > 2 else 1)
    g = torch.Generator().manual_seed(seed)
    margin = torch.linspace(0.0, 25.0, rows, dtype=torch.float64)[torch.randperm(rows, generator=g)]
    z = 0.05 * torch.randn(rows, k, generator=g, dtype=torch.float64)
    top = torch.randint(0, k, (rows,), generator=g)
    z[torch.arange(rows), top] += margin
    y = torch.where(torch.rand(rows, generator=g) < 0.7, top, torch.randint(0, k, (rows,), generator=g))
    return z, y


def _in_layout(shape, z, y):
    """Rows z (rows, K), labels y as ``shape`` lays them out: (N, K) rows, or (N, K, P) positions."""
    if len(shape) == 2:
        return z, y
    n, k, p = shape
    return z.reshape(n, p, k).permute(0, 2, 1).contiguous(), y.reshape(n, p)


@pytest.mark.parametrize("temperature", [0.02, 0.3, 5.0])
@pytest.mark.parametrize("shape", [(96, 100), (96, 10), (2, 10, 48)], ids=str)
def test_savuc_float32_per_row_lanes_are_near_the_float64_torch_path(shape, temperature):
    """float32 S-AvUC's per-row tanh H and soft uncertainty q = σ((logit e − logit κ)/T) in float32 lanes
    (the rows' blocks; float64 rows stay scalar) over rows whose entropy sweeps from ~1e-9 (e clamped at the
    machine epsilon) to log K (equal logits: e clamped below 1), with temperatures that saturate σ on both
    sides (T = 0.02: |u| up to ~800, e^(−|u|) underflows to 0) or keep it near 1/2 (T = 5), on the row
    kernel (K = 100), the lanes (K = 10) and positions. Against the float64 torch path: the value to 1e-5
    relative; the gradient to 2e-4 of its largest entry, wider than the batch-scale test's 5e-5 because of
    the near-uniform rows: q's derivative divides by e(1 − e), which multiplies the float32 entropy's
    rounding (a few ulp of log K) by log K/(log K − H), ~100 at a margin of 0.5 over equal logits (measured
    5.8e-5 at K = 10, T = 5, with t and q in float64 from the float32 H as well as in float32 lanes)."""
    z, y = _entropy_sweep(shape, seed=9)

    def loss(x, labels):
        return F.soft_avuc_loss(x, labels, 1.0, temperature=temperature, kappa=0.4)

    _float32_near_float64(loss, *_in_layout(shape, z, y), grad_atol=2e-4)
    uniform, labels = _in_layout(shape, torch.zeros_like(z).float(), y)
    want = _both_paths(loss, uniform, labels)
    torch.testing.assert_close(want[0][0], want[1][0], rtol=1e-5, atol=1e-6)


def test_the_penalties_sqrt_has_zero_gradient_at_and_below_zero():
    """SB-ECE's and ESD's sqrt (margin._safe_sqrt) passes no gradient where its argument is <= 0 (its
    derivative there would be infinite), above 0 that of sqrt."""
    from torchcal.functional.margin import _safe_sqrt

    v = torch.tensor([-1.0, 0.0, 4.0], dtype=torch.float64, requires_grad=True)
    out = _safe_sqrt(v)
    out.sum().backward()
    assert out.tolist() == [0.0, 0.0, 2.0]
    assert v.grad is not None and v.grad.tolist() == [0.0, 0.0, 0.25]


def test_the_node_flags_a_batch_with_no_row_and_takes_a_threshold_tensor():
    """The whole-loss node answers NaN with a zero gradient (and flags it) when the base or the term has no
    kept row, and takes a 0-d threshold tensor as the torch path does."""
    z = torch.randn(6, 4, requires_grad=True)
    y = torch.full((6,), -100)
    loss, stats = torch.ops.torchcal.fused_batch_loss(z, y, -100, 0, 1.0, 0.0, 3, [3.0, 1.0], 1, 6)
    assert stats[4] == 1 and torch.isnan(loss)
    loss.backward()
    assert z.grad is not None and torch.equal(z.grad, torch.zeros_like(z))
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    threshold = torch.tensor(0.9, dtype=torch.float64)
    got = F.avuc_loss(z.detach(), y, threshold=threshold)
    with F.use_cpu_extension(False):
        want = F.avuc_loss(z.detach(), y, threshold=threshold)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("shape", [(96, 100), (96, 10), (2, 10, 48)], ids=str)
def test_avuc_float32_across_entropies_is_near_the_float64_torch_path(shape):
    """float32 AvUC's entropy from the exp pass's moments and its tanh in float32 lanes (decision 222) over
    rows whose entropy sweeps from ~1e-9 (a margin of 25 over the other classes: tanh's polynomial branch,
    and probabilities below AvUC's log floor, which take the entry-wise pass) to log K (equal logits: the
    exponential branch), on the row kernel (K = 100) and the lanes (K = 10, positions). Against the float64
    torch path: the value to 1e-6 relative, the gradient to 5e-5 of its largest entry, AvUC's four
    statistics (Σ H and the counts) to 1e-6 relative."""
    z, y = _in_layout(shape, *_entropy_sweep(shape, seed=5))

    def loss(x):
        return F.avuc_loss(x, y, 3.0, threshold=0.5, statistics=True)

    x32 = z.float().requires_grad_(True)
    calls = _count_calls()
    value, stats = loss(x32)
    assert calls() > 0  # (the operator ran)
    value.backward()
    x64 = z.clone().requires_grad_(True)
    with F.use_cpu_extension(False):
        want, want_stats = loss(x64)
    want.backward()
    torch.testing.assert_close(value.double(), want.detach(), rtol=1e-6, atol=1e-9)
    assert stats is not None and want_stats is not None
    torch.testing.assert_close(stats.double(), want_stats.double(), rtol=1e-6, atol=1e-9)
    got, ref = x32.grad, x64.grad
    assert got is not None and ref is not None
    scale = float(ref.abs().max())
    torch.testing.assert_close(got.double() / scale, ref / scale, rtol=0, atol=5e-5)


@pytest.mark.parametrize("k", [1000, 16], ids=["rows", "lanes"])
def test_float32_exps_over_their_whole_domain(k):
    """The float32 exps of the operators (exp_nonpositive, csrc/true_class.h) against float64 over
    x − max in [−87.3, 0] (200001 points), through NLL's gradient p_j = e_j / Σ: each row's max is 0, so
    p_j / p_0 = e_j with one float32 rounding (the product by 1/Σ; p_0 = 1·(1/Σ) is exact). Bound: the exp's
    own ≤ 1 ulp (at most eps relative) plus that rounding (eps/2). Below −87.34 the exps are exactly 0 (a
    documented flush: e^−87.34 is float32's smallest normal). K = 1000 takes the rows, K = 16 the lanes."""
    sweep = torch.linspace(-87.3, 0, 200001, dtype=torch.float64).to(torch.float32)
    flushed = -87.34 - 100 * torch.rand(5000, generator=torch.Generator().manual_seed(0))
    s = torch.cat([sweep, flushed])
    per = k - 1
    n = (s.numel() + per - 1) // per
    s = torch.cat([s, torch.full((n * per - s.numel(),), -1.0)])
    z = torch.cat([torch.zeros(n, 1), s.reshape(n, per)], 1).requires_grad_()
    y = torch.ones(n, dtype=torch.long)  # (the label's entry, p − 1, is left out below)
    F.mdca_loss(z, y, 0.0, reduction="sum").backward()
    g = z.grad.double()[:, 2:]
    x = z.detach()[:, 2:]
    ratio = g / z.grad.double()[:, :1]
    exact = x.double().exp()
    normal = x >= -87.3
    rel = ((ratio - exact).abs() / exact)[normal]
    assert rel.max().item() <= 1.5 * EPS32
    assert (g[x < -87.34] == 0).all()
