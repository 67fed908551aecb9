"""The optional C++ loss operator (torchcal.functional._extension): build and load rules, and its losses
against the plain torch path (values, gradients, gradcheck, layouts, threads, sizes)."""

import math
import os
import subprocess
import sys

import pytest
import torch

import torchcal.functional as F
import torchcal.functional.losses as L
from tests.conftest import for_thread_counts
from torchcal.functional import _extension

pytestmark = pytest.mark.usefixtures("cpp_extension")


def _both_paths(fn, *tensors):
    """fn(*tensors) and its gradients on the C++ operator and on the plain torch path."""
    results = []
    for cpp in (True, False):
        inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
        with F.use_cpu_extension(cpp):
            value = fn(*inputs)
            grads = torch.autograd.grad(value.sum(), [t for t in inputs if t.requires_grad])
        results.append((value.detach(), grads))
    return results


def test_the_operator_computes_the_losses():
    z, t = torch.randn(5, 4, requires_grad=True), torch.tensor([0, 1, 2, 3, 0])
    assert F.cpu_extension_available()
    assert "FusedTrueClass" in L.focal_loss(z, t).grad_fn.name()
    with F.use_cpu_extension(False):
        assert not F.cpu_extension_available()


def test_use_cpu_extension_rejects_non_bool_and_restores_state():
    with pytest.raises(TypeError, match="`enabled` must be a bool"):
        with F.use_cpu_extension(1):
            pass
    with pytest.raises(KeyError):
        with F.use_cpu_extension(False):
            raise KeyError("inside")
    assert F.cpu_extension_available()


def test_library_name_follows_source_flags_and_torch(monkeypatch):
    name = _extension.extension_name()
    assert name.startswith("torchcal_fused_") and name == _extension.extension_name()
    assert name == _extension.extension_name(_extension.FLAG_SETS[0])  # the preferred flags by default
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert _extension.extension_name() != name
    monkeypatch.undo()
    assert _extension.extension_name(["-O2"]) != name


def test_clang_gets_no_openmp_runtime_of_its_own(monkeypatch, tmp_path):
    clang = tmp_path / "clang++-17"
    clang.write_text("#!/bin/sh\n")
    clang.chmod(0o755)
    (tmp_path / "c++").symlink_to(clang)
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + os.environ["PATH"])
    monkeypatch.delenv("CXX", raising=False)
    assert _extension._compiler_is_clang()  # c++ resolves to clang
    assert "-fopenmp" not in _extension._native_flags()
    monkeypatch.setenv("CXX", "g++")
    assert not _extension._compiler_is_clang()


def test_only_a_native_build_is_named_after_the_cpu(monkeypatch):
    native, portable = ["-O3", "-march=native"], _extension.PORTABLE_FLAGS
    names = (_extension.extension_name(native), _extension.extension_name(portable))
    monkeypatch.setattr(_extension, "_cpu_key", lambda: "another CPU|flags : sse2")
    assert _extension.extension_name(native) != names[0]  # a shared cache never serves another ISA
    assert _extension.extension_name(portable) == names[1]


def test_preferred_flags_follow_the_platform():
    flags = _extension._native_flags()
    assert flags[0] == "-O3"
    assert ("-fopenmp" in flags) == (_extension._torch_uses_libgomp() and not _extension._compiler_is_clang())
    assert _extension.FLAG_SETS[-1] == _extension.PORTABLE_FLAGS  # the portable fallback is always last
    assert len(_extension.FLAG_SETS) == len({tuple(f) for f in _extension.FLAG_SETS})  # no set twice


def test_a_refused_flag_set_falls_back_to_the_portable_build(tmp_path):
    """A compiler that refuses the preferred flags: the portable build (16-byte vectors, torch's
    log_softmax for float32 rows over 64 classes) is made, with a warning, and computes the same losses."""
    code = """
import warnings, torch
import torchcal.functional as F, torchcal.functional.losses as L
from torchcal.functional import _extension as E
E.FLAG_SETS = [["-O3", "-fno-such-flag-for-torchcal"], E.PORTABLE_FLAGS]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    path = F.build_cpu_extension()
assert path.parent.name == E.extension_name(E.PORTABLE_FLAGS), path
assert any("portable flags" in str(w.message) for w in caught), [str(w.message) for w in caught]
g = torch.Generator().manual_seed(0)
for k in (10, 100, 1000):
    z, t = 3 * torch.randn(64, k, generator=g), torch.randint(0, k, (64,), generator=g)
    for fn in (L.focal_loss, L.dual_focal_loss, L.focal_calibration_loss):
        values = []
        for cpp in (True, False):
            x = z.clone().requires_grad_(True)
            with F.use_cpu_extension(cpp):
                v = fn(x, t, reduction="none")
            v.sum().backward()
            values.append((v.detach(), x.grad))
        torch.testing.assert_close(values[0][0], values[1][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(values[0][1], values[1][1], rtol=1e-4, atol=1e-7)
print("ok")
"""
    env = dict(os.environ, TORCHCAL_EXTENSION_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
    refused = tmp_path / _extension.extension_name(["-O3", "-fno-such-flag-for-torchcal"])
    assert not list(refused.glob("*.so"))  # nothing half-built is left to be loaded


def test_a_damaged_library_counts_as_not_built(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHCAL_EXTENSION_DIR", str(tmp_path))
    path = _extension._library_path()
    assert path.parent.parent == tmp_path and not path.exists()
    assert _extension._load_built() is None  # nothing there: nothing loaded, nothing compiled
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a shared library")
    with pytest.warns(RuntimeWarning, match="rebuild it with `torchcal build-extension`"):
        assert _extension._load_built() is None


@pytest.mark.parametrize("setting,expected", [("1", "True"), ("0", "False")])
def test_new_processes_load_the_built_library_unless_disabled(setting, expected):
    env = dict(os.environ, TORCHCAL_CPP=setting)
    code = (
        "import torchcal.functional as F, torchcal.functional._extension as E;"
        "print(F.cpu_extension_available(), E._state['loaded'] is not None and bool(E._state['loaded']))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    available, loaded = out.stdout.split()
    assert available == expected
    assert loaded == ("True" if setting == "1" else "False")  # disabled: not even looked for


@pytest.mark.parametrize(
    "loss",
    [
        lambda z, t: L.focal_loss(z, t, 2.0, reduction="none"),
        lambda z, t: L.focal_loss(z, t, 0.5, reduction="sum"),
        lambda z, t: L.inverse_focal_loss(z, t, 1.5),
        lambda z, t: L.sample_dependent_focal_loss(z, t, (5.0, 3.0, 2.0), (0.2, 0.5), reduction="none"),
        lambda z, t: L.dual_focal_loss(z, t, 2.0, reduction="none"),
        lambda z, t: L.dual_sample_dependent_focal_loss(z, t),
        lambda z, t: L.focal_calibration_loss(z, t, 3.0, 0.7, reduction="none"),
        lambda z, t: L.brier_loss(z, t),
        lambda z, t: L.varying_focal_loss(z, t, torch.tensor([2.0, -1.0, 0.0, 3.0, -0.5, 1.0])),
    ],
)
def test_gradcheck_float64(loss):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 1, 2, 3, 4, 0])
    assert torch.autograd.gradcheck(lambda x: loss(x, t), (z,))
    (cpp, _), (plain, _) = _both_paths(loss, z, t)
    torch.testing.assert_close(cpp, plain, rtol=1e-12, atol=1e-14)


def test_layouts_and_label_dtypes_match_the_torch_path():
    g = torch.Generator().manual_seed(1)
    wide = 3 * torch.randn(7, 40, generator=g)
    z = wide.t()[:, :7]  # (40, 7), not contiguous
    assert not z.is_contiguous()
    t = torch.randint(0, 7, (40,), generator=g, dtype=torch.int32)
    (v1, (g1,)), (v2, (g2,)) = _both_paths(lambda x, y: L.dual_focal_loss(x, y, reduction="none"), z, t)
    torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,k", [(1, 2), (3000, 700)])  # one sample; more than 2**20 logits
def test_sizes_match_the_torch_path(n, k):
    g = torch.Generator().manual_seed(n)
    z, t = 4 * torch.randn(n, k, generator=g), torch.randint(0, k, (n,), generator=g)
    for fn in (L.focal_loss, L.dual_focal_loss, L.focal_calibration_loss):
        (v1, (g1,)), (v2, (g2,)) = _both_paths(fn, z, t)
        torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-7)


def test_results_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(2)
    z, t = 3 * torch.randn(5000, 64, generator=g), torch.randint(0, 64, (5000,), generator=g)

    def step():
        x = z.clone().requires_grad_(True)
        loss = L.dual_focal_loss(x, t)
        loss.backward()
        return loss.detach(), x.grad

    results = for_thread_counts(step)
    assert torch.equal(results[0][0], results[1][0])  # the reduction is summed in row order
    assert torch.equal(results[0][1], results[1][1])


def test_no_graph_without_gradients_and_extreme_logits():
    z = torch.tensor([[1e4, -1e4, 0.0], [-1e4, 1e4, 1e4], [0.0, 0.0, 0.0]])
    t = torch.tensor([1, 2, 0])
    with torch.no_grad():
        value = L.dual_focal_loss(z, t)
    assert not value.requires_grad
    with torch.inference_mode():
        assert torch.isfinite(L.focal_loss(z, t, 0.5))
    x = z.clone().requires_grad_(True)
    L.focal_calibration_loss(x, t).backward()
    assert torch.isfinite(x.grad).all()


def test_autocast_bfloat16_logits():
    z, t = torch.randn(16, 10), torch.randint(0, 10, (16,))
    x = z.bfloat16().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = L.dual_focal_loss(x, t)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad.float()).all()
    with F.use_cpu_extension(False):
        expected = L.dual_focal_loss(z.bfloat16().float(), t)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_float32_logits_inside_autocast_take_the_operator():
    z, t = torch.randn(16, 10), torch.randint(0, 10, (16,))
    x = z.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = L.focal_calibration_loss(x, t)
    assert "FusedTrueClass" in loss.grad_fn.name() and loss.dtype == torch.float32
    loss.backward()
    (v, (g,)), _ = _both_paths(L.focal_calibration_loss, z, t)
    torch.testing.assert_close(loss.detach(), v, rtol=0, atol=0)  # autocast changes nothing
    torch.testing.assert_close(x.grad, g, rtol=0, atol=0)


# short rows on 16-byte vectors, wide (AVX/AVX-512) spans with 16-byte and scalar tails, 256-entry blocks
@pytest.mark.parametrize("k", [3, 10, 37, 64, 65, 100, 131, 1027])
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_float32_losses_against_a_float64_reference(k, scale):
    """The fused pipeline's own exp (float32 rows up to 64 classes, any length in an AVX build) and torch's
    (the portable build's longer rows) against the float64 per-sample definition on the same float32 logits."""
    g = torch.Generator().manual_seed(k)
    z = (scale * torch.randn(64, k, generator=g)).float()
    t = torch.randint(0, k, (64,), generator=g)
    log_p = torch.log_softmax(z.double(), 1)
    lpt = log_p.gather(1, t[:, None]).squeeze(1)
    p = log_p.exp()
    masked = torch.where(log_p < lpt[:, None], p, torch.zeros_like(p))
    p_j = masked.max(1).values
    focal = -((1 - lpt.exp()) ** 2) * lpt
    dual = -((1 - lpt.exp() + p_j) ** 2) * lpt
    brier = (p**2).sum(1) - 2 * lpt.exp() + 1
    for fn, want in (
        (lambda x, y: L.focal_loss(x, y, 2.0, reduction="none"), focal),
        (lambda x, y: L.dual_focal_loss(x, y, 2.0, reduction="none"), dual),
        (lambda x, y: L.brier_loss(x, y, reduction="none"), brier),
    ):
        got = fn(z, t)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dual_runner_up_ties_are_decided_on_the_logits(dtype):
    """x_j one ulp below x_t: different classes, so p_j < p_t exactly, although log_softmax may round both
    log-probabilities to the same value (the torch path then calls them tied and takes the next class)."""
    below = torch.nextafter(torch.tensor(1.0, dtype=dtype), torch.tensor(0.0, dtype=dtype))
    z = torch.stack(
        [
            torch.tensor(20.0, dtype=dtype),
            torch.tensor(1.0, dtype=dtype),
            below,
            torch.tensor(-3.0, dtype=dtype),
        ]
    )
    z, t = z[None], torch.tensor([1])
    log_p = torch.log_softmax(z.double(), 1)[0]
    want = -((1 - log_p[1].exp() + log_p[2].exp()) ** 2) * log_p[1]  # runner-up: class 2
    got = L.dual_focal_loss(z, t, 2.0)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("value,expected", [(None, True), ("1", True), ("0", False), (" Off ", False),
                                            ("no", False), ("FALSE", False), ("yes", True)])  # fmt: skip
def test_switches_from_the_environment(monkeypatch, value, expected):
    from torchcal.functional._spec import env_enabled

    if value is None:
        monkeypatch.delenv("TORCHCAL_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("TORCHCAL_TEST_SWITCH", value)
    assert env_enabled("TORCHCAL_TEST_SWITCH") is expected


# -- the radix sort of the equal-mass estimators (csrc/sort.h) --------------------------------------------


def _reference_sort(values, flags):
    """The stable order by an independent route: Python's sort (stable) of float64 values."""
    order = sorted(range(len(values)), key=lambda i: float(values[i]))
    return [float(values[i]) for i in order], [bool(flags[i]) for i in order]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000, 5000, 300_000])  # 300k: several chunks sorted at once
def test_radix_sort_is_stable_and_carries_the_flags(n, dtype):
    g = torch.Generator().manual_seed(n)
    # few distinct values (many ties), 0, 1 and values that differ in their lowest mantissa bit only
    base = torch.tensor([0.0, 1.0, 0.5, 1 / 3, 0.1, 0.75], dtype=dtype)
    near = torch.nextafter(base[2:], torch.ones(4, dtype=dtype))
    pool = torch.cat([base, near])
    values = pool[torch.randint(0, pool.numel(), (n,), generator=g)]
    flags = torch.rand(n, generator=g) < 0.5
    got_values, got_flags = _extension.sort_with_flags(values, flags)
    want_values, want_flags = _reference_sort(values.tolist(), flags.tolist())
    assert got_values.dtype == dtype and got_flags.dtype == torch.bool
    assert got_values.tolist() == want_values
    assert got_flags.tolist() == want_flags


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_radix_sort_of_continuous_values_matches_torch(dtype):
    g = torch.Generator().manual_seed(3)
    values = torch.rand(200_000, generator=g, dtype=dtype) ** 3  # exponents and mantissas both vary
    flags = torch.rand(200_000, generator=g) < 0.3
    got_values, got_flags = _extension.sort_with_flags(values, flags)
    want_values, order = torch.sort(values, stable=True)
    assert torch.equal(got_values, want_values)
    assert torch.equal(got_flags, flags[order])


def test_radix_sort_treats_negative_zero_as_zero_and_keeps_order():
    values = torch.tensor([0.5, -0.0, 0.0, -0.0, 0.25])
    flags = torch.tensor([True, True, False, False, True])
    got_values, got_flags = _extension.sort_with_flags(values, flags)
    assert got_values.tolist() == [0.0, 0.0, 0.0, 0.25, 0.5]
    assert got_flags.tolist() == [True, False, False, True, True]  # the three zeros in input order


@pytest.mark.parametrize("bad", [-0.25, float("nan"), -float("inf")])
def test_radix_sort_rejects_negative_and_nan(bad):
    values = torch.tensor([0.5, bad, 0.25])
    with pytest.raises(ValueError, match="non-negative and not NaN"):
        _extension.sort_with_flags(values, torch.tensor([True, False, True]))


def test_radix_sort_checks_its_arguments():
    with pytest.raises(ValueError, match="1-D"):
        _extension.sort_with_flags(torch.rand(3, 2), torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        _extension.sort_with_flags(torch.rand(3), torch.zeros(3))
    with pytest.raises(ValueError, match="float32 or float64"):
        _extension.sort_with_flags(torch.rand(3).half(), torch.zeros(3, dtype=torch.bool))


def test_sorted_by_confidence_takes_the_radix_sort_and_agrees_with_the_torch_path():
    from torchcal.functional.calibration import sorted_by_confidence

    g = torch.Generator().manual_seed(5)
    conf = (torch.randint(1, 40, (3000,), generator=g) / 40).float()  # many ties
    correct = torch.rand(3000, generator=g) < 0.6
    assert _extension.sort_applies(conf)
    fast = sorted_by_confidence(conf, correct)
    with F.use_cpu_extension(False):
        assert not _extension.sort_applies(conf)
        plain = sorted_by_confidence(conf, correct)
    assert torch.equal(fast[0], plain[0]) and torch.equal(fast[1], plain[1])


# -- the per-sample sums of the C++ scan (CalibrationMetrics.update, NLL) --------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scan_sums_match_their_definitions(dtype):
    from tests.conftest import make_probs

    probs, targets = make_probs(2000, 7, seed=3, sharpness=8, dtype=dtype)
    probs[5] = 0.0  # a true class of probability 0 costs −log(tiny of the dtype)
    probs[5, (int(targets[5]) + 1) % 7] = 1.0
    threshold = 0.9
    *_, sums, _vectors = _extension.top_label_scan(probs, targets, 15, None, threshold)
    p64 = probs.double()
    p_true = p64[torch.arange(2000), targets]
    tiny = torch.finfo(dtype).tiny
    nll = -torch.log(p_true.clamp(min=tiny)).sum().item()  # float64 reference
    assert sums.nll == pytest.approx(nll, rel=1e-13)
    assert -math.log(tiny) > 80  # row 5's share
    assert sums.p_true == pytest.approx(p_true.sum().item(), rel=1e-13)
    conf, pred = probs.max(1)
    correct = pred == targets
    confident = conf >= threshold  # torch's comparison of the dtype with a Python number
    assert sums.correct == correct.sum().item()
    assert sums.confident == confident.sum().item()
    assert sums.confident_correct == (confident & correct).sum().item()


def test_scan_sums_compare_the_confidence_in_the_input_dtype():
    # float32(0.7) = 0.69999998...: a float32 confidence equal to it is >= 0.7 for torch, which compares in
    # float32, though below 0.7 in float64; the scan's S99 counts follow torch
    probs = torch.tensor([[0.3, 0.7], [0.7, 0.3]], dtype=torch.float32)
    assert float(probs[0, 1]) < 0.7
    threshold = 0.7
    *_, sums, _vectors = _extension.top_label_scan(probs, torch.tensor([1, 0]), None, None, threshold)
    assert int((probs.max(1).values >= threshold).sum()) == 2
    assert sums.confident == 2 and sums.confident_correct == 2


def test_no_sums_without_a_threshold():
    probs = torch.tensor([[0.25, 0.75]])
    *_, sums, _vectors = _extension.top_label_scan(probs, torch.tensor([1]), 15, 15)
    assert sums is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_the_compile_operators_pass_opcheck(dtype, reduction):
    """The forward/backward pair that torch.compile traces: schema, fake implementation (shapes, dtypes,
    strides) and autograd registration checked by torch.library.opcheck."""
    spec = L._gamma_spec(2.0, "fcl", 0.5)[2]
    z = torch.randn(6, 4, dtype=dtype, requires_grad=True)
    t = torch.tensor([0, 1, 2, 3, 0, 1])
    params = spec.cpp_params32 if dtype == torch.float32 else spec.cpp_params64
    torch.library.opcheck(
        torch.ops.torchcal.fused_true_class_fwd.default, (z, t, params, None, reduction, spec.brier)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_compile_operators_equal_the_eager_operator(dtype):
    """Loss and gradient of fused_true_class_fwd / _bwd (with their registered autograd formula) are the
    eager operator's, bit for bit: the same C++ forward and backward."""
    spec = L._gamma_spec(3.0, "fcl", 1.5)[2]
    params = spec.cpp_params32 if dtype == torch.float32 else spec.cpp_params64
    g = torch.Generator().manual_seed(0)
    z = torch.randn(9, 5, generator=g, dtype=dtype)
    t = torch.randint(0, 5, (9,), generator=g)
    for reduction in (0, 1, 2):
        a, b = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
        eager = torch.ops.torchcal.fused_true_class(a, t, params, None, reduction)
        pair = torch.ops.torchcal.fused_true_class_fwd(b, t, params, None, reduction, spec.brier)[0]
        assert torch.equal(eager, pair.detach())
        (ga,) = torch.autograd.grad(eager.sum(), a)
        (gb,) = torch.autograd.grad(pair.sum(), b)
        assert torch.equal(ga, gb)
    with pytest.raises(ValueError, match="`brier` must repeat the λ of `params`"):
        torch.ops.torchcal.fused_true_class_fwd(z, t, params, None, 0, 0.25)
