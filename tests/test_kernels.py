"""The CPU accelerator (the C++ operators) against the torch path, through the backend seam: the metrics'
scan entry by entry, including the awkward inputs, the sort, and the fused losses."""

import math

import pytest
import torch

import torchcal.functional as F
from tests.conftest import for_thread_counts, make_probs
from torchcal.functional import _backend, _extension


@pytest.fixture
def fused(cpp_extension):
    """The accelerated path under test, the C++ operator (``use_cpu_extension(True)`` selects it;
    ``use_cpu_extension(False)`` is the plain torch path it is compared with)."""
    with F.use_cpu_extension(True):
        yield "cpp"


def both_paths(probs, targets, n_bins=15, classwise_bins=15):
    with F.use_cpu_extension(True):
        assert _extension.scan_applies(probs)
        fused = _backend.scan(probs, targets, classwise_bins, n_bins)
    with F.use_cpu_extension(False):
        plain = _backend.scan(probs, targets, classwise_bins, n_bins)
    return fused, plain


def assert_same_scan(fused, plain, probs, targets):
    assert torch.equal(fused.conf, plain.conf)
    assert torch.equal(fused.correct, plain.correct)
    assert torch.equal(fused.top[0], plain.top[0])
    assert torch.equal(fused.top[2], plain.top[2])
    torch.testing.assert_close(fused.top[1], plain.top[1], rtol=1e-12, atol=1e-12)
    for a, b in zip(fused.classwise.finish(probs, targets), plain.classwise.finish(probs, targets)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    assert fused.stats[1] == plain.stats[1]
    assert fused.stats[2] == plain.stats[2]
    assert abs(fused.stats[0] - plain.stats[0]) < 1e-6


# K spans the C++ scan's vector cascade (16-byte lanes, wide lanes, scalar tails) and its passes compiled
# for rows of 2-16 classes (exact multiples of the vector widths among them)
@pytest.mark.parametrize(
    "n,k",
    [
        (1, 2),
        (7, 3),
        (50, 4),
        (60, 8),
        (500, 10),
        (70, 16),
        (300, 17),
        (200, 32),
        (200, 33),
        (100, 100),
        (64, 1000),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_scan_equals_torch_path(n, k, dtype, fused):
    probs, targets = make_probs(n, k, seed=n + k, dtype=dtype)
    fused, plain = both_paths(probs, targets)
    assert_same_scan(fused, plain, probs, targets)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ties_in_the_maximum_predict_the_lowest_index(dtype, fused):
    probs = torch.tensor(
        [[0.4, 0.4, 0.2], [0.4, 0.4, 0.2], [0.2, 0.4, 0.4], [1 / 3, 1 / 3, 1 / 3], [0.0, 0.5, 0.5]],
        dtype=dtype,
    )
    probs = probs / probs.sum(1, keepdim=True)
    targets = torch.tensor([0, 1, 2, 2, 1])
    fused, plain = both_paths(probs, targets)
    assert fused.correct.tolist() == [True, False, False, False, True]
    assert_same_scan(fused, plain, probs, targets)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_confidences_on_bin_edges_and_at_one(dtype, fused):
    # 0.6 and 0.2 are edges of 5 and 15 bins; 1.0 and an exact 0 sit at the ends
    probs = torch.tensor(
        [[0.6, 0.4], [0.4, 0.6], [1.0, 0.0], [0.0, 1.0], [0.8, 0.2], [0.5, 0.5]], dtype=dtype
    )
    targets = torch.tensor([0, 0, 0, 1, 1, 1])
    for bins in (1, 2, 5, 10, 15):
        fused, plain = both_paths(probs, targets, bins, bins)
        assert_same_scan(fused, plain, probs, targets)


@pytest.mark.parametrize("k", [10, 16, 33, 40, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_classwise_entries_on_edges_at_every_lane(k, dtype, fused):
    # entries exactly on a classwise edge b/15 (as the dtype rounds it) and one ulp either side, placed at
    # every position of the row in turn: vector lanes, vector boundaries and the scalar tail
    values = []
    for b in (1, 2, 3, 5):
        edge = torch.tensor(b / 15, dtype=dtype)
        values += [edge, torch.nextafter(edge, torch.tensor(1.0, dtype=dtype))]
        values += [torch.nextafter(edge, torch.tensor(0.0, dtype=dtype))]
    rows = []
    for pos in range(k):
        value = values[pos % len(values)]
        row = torch.full((k,), float((1 - value) / (k - 1)), dtype=dtype)
        row[pos] = value
        rows.append(row)
    probs = torch.stack(rows)
    targets = torch.arange(k) % k
    fused, plain = both_paths(probs, targets)
    assert_same_scan(fused, plain, probs, targets)
    count = fused.classwise.finish(probs, targets)[0]
    above = (probs.double() > 1 / 15).sum(0)  # per class, entries outside bin 0 (float64 comparison)
    assert torch.equal(count[:, 1:].sum(1), above.double())


def test_negative_zero_is_a_valid_probability(fused):
    probs = torch.tensor([[1.0, -0.0], [0.25, 0.75]])
    fused, plain = both_paths(probs, torch.tensor([0, 1]))
    assert fused.stats[1] == 0.0
    assert_same_scan(fused, plain, probs, torch.tensor([0, 1]))


@pytest.mark.parametrize(
    "bad,message",
    [
        (float("nan"), "NaN or infinite"),
        (float("inf"), "NaN or infinite"),
        (-0.25, "negative entries"),
        (0.7, "must sum to 1"),
    ],
)
def test_invalid_probabilities_give_the_same_error_on_both_paths(bad, message, fused):
    probs, targets = make_probs(50, 4, dtype=torch.float32)
    probs[17, 2] = bad
    for enabled in (True, False):
        with F.use_cpu_extension(enabled), pytest.raises(ValueError, match=message):
            F.expected_calibration_error(probs, targets)


def test_strided_input_takes_the_torch_path_with_the_same_value(fused):
    probs, targets = make_probs(40, 5, dtype=torch.float32)
    wide = torch.zeros(40, 10)
    wide[:, ::2] = probs
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    assert not _extension.scan_applies(strided) and _extension.scan_applies(probs)
    torch.testing.assert_close(
        F.expected_calibration_error(strided, targets), F.expected_calibration_error(probs, targets)
    )


def test_targets_of_other_integer_dtypes(fused):
    probs, targets = make_probs(100, 6, dtype=torch.float32)
    ref = F.expected_calibration_error(probs, targets)
    for dtype in (torch.int32, torch.int16, torch.uint8):
        torch.testing.assert_close(F.expected_calibration_error(probs, targets.to(dtype)), ref)


def test_use_cpu_extension_rejects_non_bool_and_restores_state():
    before = F.cpu_extension_available()
    with pytest.raises(TypeError, match="enabled"):
        with F.use_cpu_extension(1):
            pass
    with pytest.raises(RuntimeError):
        with F.use_cpu_extension(not before):
            raise RuntimeError
    assert F.cpu_extension_available() == before


def test_retired_numba_switches_are_deprecated_aliases():
    with pytest.warns(DeprecationWarning, match="use_cpu_extension"):
        with F.use_cpu_kernels(False):
            assert not F.cpu_extension_available()
    with pytest.warns(DeprecationWarning, match="cpu_extension_available"):
        assert F.cpu_kernels_available() == F.cpu_extension_available()


def test_probs_requiring_grad_are_scanned(fused):
    logits = torch.randn(30, 4, requires_grad=True)
    targets = torch.randint(0, 4, (30,))
    with F.use_cpu_extension(True):
        fused = F.expected_calibration_error(logits, targets, from_logits=True)
    with F.use_cpu_extension(False):
        plain = F.expected_calibration_error(logits, targets, from_logits=True)
    # from logits the two paths compute 1 / Σ exp(z − max) with different float32 exps: rounding apart
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-7)
    with F.use_cpu_extension(True):  # from probabilities the scan is exact on both paths
        fused = F.expected_calibration_error(torch.softmax(logits, 1), targets)
    with F.use_cpu_extension(False):
        plain = F.expected_calibration_error(torch.softmax(logits, 1), targets)
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 15, 1000, 4097])
def test_sort_with_flags_keeps_tied_values_in_input_order(n):
    g = torch.Generator().manual_seed(n)
    values = (torch.randint(0, 7, (n,), generator=g) / 6).float()  # few distinct values: many ties
    values[0] = 0.0
    want_order = torch.tensor(sorted(range(n), key=lambda i: (float(values[i]), i)))  # stable by definition
    correct = torch.arange(n) % 3 == 0
    for enabled in (True, False):  # the seam's sort with flags: C++ radix sort and torch
        with F.use_cpu_extension(enabled):
            s_values, s_flags = _backend.sort_with_flags(values, correct)
        assert torch.equal(s_values, values[want_order]) and torch.equal(s_flags, correct[want_order])
        assert s_values.dtype == torch.float32 and s_flags.dtype == torch.bool


@pytest.mark.parametrize("n,m", [(3, 15), (15, 15), (16, 15), (1000, 15), (1001, 7), (7, 1)])
def test_equal_mass_sums_match_array_split(n, m):
    import numpy as np

    from torchcal.functional._binning import equal_mass_sums

    g = torch.Generator().manual_seed(n + m)
    conf = torch.sort(torch.rand(n, generator=g)).values
    correct = torch.rand(n, generator=g) < conf
    count, conf_sum, correct_sum = equal_mass_sums(conf, correct, m)
    groups = np.array_split(np.arange(n), m)
    assert count.tolist() == [len(gr) for gr in groups]
    for b, gr in enumerate(groups):
        assert conf_sum[b].item() == pytest.approx(conf.double().numpy()[gr].sum(), rel=1e-12, abs=0)
        assert correct_sum[b].item() == correct.numpy()[gr].sum()


# ----------------------------------------------------------------------------- fused focal-family losses


def test_fused_losses_run_where_they_apply(fused):
    import torchcal.functional.losses as L

    z = torch.randn(8, 3, requires_grad=True)
    with F.use_cpu_extension(True):
        assert _backend._fast_cpu_call(z, torch.zeros(8, dtype=torch.long), "mean")
        name = L.focal_loss(z, torch.zeros(8, dtype=torch.long)).grad_fn.name()
        assert name.endswith("FusedTrueClass>")
    with F.use_cpu_extension(False):
        assert "Fused" not in L.focal_loss(z, torch.zeros(8, dtype=torch.long)).grad_fn.name()


def test_fused_losses_refuse_second_order_gradients(fused):
    import torchcal.functional.losses as L

    z = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 1, 2, 3, 0, 1])
    with F.use_cpu_extension(True):
        (g,) = torch.autograd.grad(L.focal_loss(z, t, 2.0), z, create_graph=False)
        # (the error names the switch to the torch path that exists, not the retired use_cpu_kernels)
        with pytest.raises(RuntimeError, match=r"differentiable once(.|\n)*use_cpu_extension\(False\)"):
            torch.autograd.grad(L.focal_loss(z, t, 2.0), z, create_graph=True)
    with F.use_cpu_extension(False):
        (g_torch,) = torch.autograd.grad(L.focal_loss(z, t, 2.0), z)
    torch.testing.assert_close(g, g_torch, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_flsd_compares_p_t_with_thresholds_in_the_input_dtype(dtype, fused):
    import torchcal.functional.losses as L

    # p_t = 0.5 exactly (two equal logits) and p_t = 0.2 as nearly as the dtype allows
    z = torch.tensor([[0.0, 0.0], [math.log(0.2), math.log(0.8)]], dtype=dtype)
    t = torch.tensor([0, 0])
    with F.use_cpu_extension(True):
        fused = L.sample_dependent_focal_loss(z, t, (5, 3, 2), (0.2, 0.5), reduction="none")
    with F.use_cpu_extension(False):
        plain = L.sample_dependent_focal_loss(z, t, (5, 3, 2), (0.2, 0.5), reduction="none")
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=0)
    assert fused[0].item() == pytest.approx(0.5**2 * math.log(2), rel=1e-6)  # γ = 2 at p_t = 0.5


def test_fused_loss_label_errors_name_the_label(fused):
    import torchcal.functional.losses as L

    with F.use_cpu_extension(True), pytest.raises(ValueError, match=r"must lie in \[0, 3\), found label -2"):
        L.focal_loss(torch.randn(4, 3), torch.tensor([0, -2, 1, 5]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_every_registered_loss_is_the_same_on_both_paths(dtype, reduction, fused):
    from torchcal.losses import create, list_losses

    g = torch.Generator().manual_seed(3)
    z = (2.5 * torch.randn(50, 6, generator=g)).to(dtype)
    z[0] = 0.0  # an all-equal row (no runner-up for the dual losses)
    z[1, :2] = 4.0  # a tie in the maximum
    z[2] = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0, 0.0])  # tied runner-ups: the first one is p_j
    t = torch.randint(0, 6, (50,), generator=g)
    t[1], t[2] = 1, 0
    upstream = (
        torch.rand(50, generator=g).to(dtype) if reduction == "none" else torch.tensor(1.0, dtype=dtype)
    )
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-12}
    for name in list_losses():
        loss_fn = create(name)
        loss_fn.reduction = reduction
        if name.startswith("ada"):  # both signs: focal (or dual) and inverse focal bins
            loss_fn.gamma_per_bin.copy_(torch.linspace(-2.0, 3.0, loss_fn.gamma_per_bin.shape[0]))
        results = []
        for enabled in (True, False):
            x = z.clone().requires_grad_(True)
            with F.use_cpu_extension(enabled):
                value = loss_fn(x, t)
                (grad,) = torch.autograd.grad(value, x, upstream)
            results.append((value.detach(), grad))
        (v1, g1), (v2, g2) = results
        torch.testing.assert_close(v1, v2, **tol, msg=name)
        torch.testing.assert_close(g1, g2, **tol, msg=name)


@pytest.mark.parametrize("dual", [False, True])
def test_fused_adafocal_follows_gamma_updates(dual, fused):
    from torchcal.adafocal import AdaFocalLoss

    g = torch.Generator().manual_seed(5)
    z, t = 2 * torch.randn(64, 5, generator=g), torch.randint(0, 5, (64,), generator=g)
    loss = AdaFocalLoss(n_bins=4, dual=dual)
    with F.use_cpu_extension(True):
        before = loss(z, t)
        loss.update(torch.softmax(z, 1), t)  # new γ and new equal-mass bins, changed in place
        after = loss(z, t)
    with F.use_cpu_extension(False):
        expected = loss(z, t)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-6)


def test_threaded_scan_matches_one_thread(fused):
    from torchcal.metrics import CalibrationMetrics

    probs, targets = make_probs(120_000, 10, seed=7, dtype=torch.float32)

    def metrics():
        m = CalibrationMetrics(10, equal_mass=False)
        with F.use_cpu_extension(True):
            m.update(probs, targets)
        return m.compute()

    results = for_thread_counts(metrics)
    for name in results[0]:  # parts depend on N and K only, summed in order: identical for any thread count
        assert torch.equal(results[0][name], results[1][name]), name


def test_cpp_scan_skips_what_it_does_not_handle(cpp_extension):
    probs, _ = make_probs(40, 5, dtype=torch.float32)
    assert _extension.scan_applies(probs)
    assert not _extension.scan_applies(probs[:, ::2])  # strided: the torch path
    assert not _extension.scan_applies(probs.half())
    with F.use_cpu_extension(False):
        assert not _extension.scan_applies(probs)


def test_cpp_scan_names_the_bad_label(cpp_extension):
    probs, targets = make_probs(40, 5, dtype=torch.float32)
    targets[9], targets[30] = 7, -1
    with pytest.raises(ValueError, match=r"`targets` must lie in \[0, 5\), found label 7"):
        _extension.top_label_scan(probs, targets, 15, 15)


def test_fused_losses_without_gradients(fused):
    import torchcal.functional.losses as L

    z, t = torch.randn(16, 5), torch.randint(0, 5, (16,))
    with F.use_cpu_extension(False):
        expected = [L.focal_loss(z, t, 2.0), L.focal_calibration_loss(z, t)]
    with F.use_cpu_extension(True), torch.no_grad():
        got = [L.focal_loss(z, t, 2.0), L.focal_calibration_loss(z, t)]
    for a, b in zip(got, expected):
        assert not a.requires_grad
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
