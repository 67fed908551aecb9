"""Training losses: float64 references, gradcheck, reductions, edge cases, numerics, properness, registry."""

import math

import pytest
import torch
import torch.nn.functional as nnf

import torchcal.functional.losses as L
from tests.reference import losses as R
from torchcal.functional import focal_calibration_map
from torchcal.losses import (
    DualFocalLoss,
    FocalCalibrationLoss,
    FusedLinearLoss,
    MMCELoss,
    create,
    list_losses,
)

# every test here runs on the C++ CPU losses and on the torch path
pytestmark = pytest.mark.usefixtures("loss_backend")


def batch(n=64, k=5, seed=0, scale=3.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(n, k, generator=g, dtype=dtype), torch.randint(0, k, (n,), generator=g)


CASES = [
    ("ce", lambda z, t: L.cross_entropy(z, t, reduction="none"), lambda z, t: R.ce(z, t)),
    ("ls", lambda z, t: L.label_smoothing_loss(z, t, 0.05, reduction="none"), lambda z, t: R.ce(z, t, 0.05)),
    ("focal-0.5", lambda z, t: L.focal_loss(z, t, 0.5, reduction="none"), lambda z, t: R.focal(z, t, 0.5)),
    ("focal-3", lambda z, t: L.focal_loss(z, t, 3.0, reduction="none"), lambda z, t: R.focal(z, t, 3.0)),
    (
        "inv-2",
        lambda z, t: L.inverse_focal_loss(z, t, 2.0, reduction="none"),
        lambda z, t: R.inverse_focal(z, t, 2.0),
    ),
    (
        "flsd-532",
        lambda z, t: L.sample_dependent_focal_loss(z, t, (5, 3, 2), (0.2, 0.5), reduction="none"),
        lambda z, t: R.flsd(z, t, (5, 3, 2), (0.2, 0.5)),
    ),
    ("dfl", lambda z, t: L.dual_focal_loss(z, t, 2.0, reduction="none"), lambda z, t: R.dfl(z, t, 2.0)),
    (
        "dualflsd",
        lambda z, t: L.dual_sample_dependent_focal_loss(z, t, reduction="none"),
        lambda z, t: R.dual_flsd(z, t, (5, 3), (0.2,)),
    ),
    ("brier", lambda z, t: L.brier_loss(z, t, reduction="none"), R.brier),
    (
        "fcl",
        lambda z, t: L.focal_calibration_loss(z, t, 4.0, 1.5, reduction="none"),
        lambda z, t: R.fcl(z, t, 4.0, 1.5),
    ),
    # the default is the released code's normalisation (SPEC §1); the paper's is the option
    ("mmce", lambda z, t: L.mmce_loss(z, t, 2.0, reduction="none"), lambda z, t: R.mmce(z, t, 2.0, "code")),
    (
        "mmce-paper",
        lambda z, t: L.mmce_loss(z, t, 2.0, normalization="paper", reduction="none"),
        lambda z, t: R.mmce(z, t, 2.0, "paper"),
    ),
]


@pytest.mark.parametrize("name,fast,ref", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("k", [2, 5, 10])
def test_matches_float64_reference(name, fast, ref, k):
    z, t = batch(40, k, seed=k)
    torch.testing.assert_close(
        fast(z, t), torch.tensor(ref(z, t), dtype=torch.float64), rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize("name,fast,ref", CASES, ids=[c[0] for c in CASES])
def test_gradcheck(name, fast, ref):
    z, t = batch(6, 4, seed=1, scale=1.5)
    z.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: fast(x, t).sum(), (z,), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("name", list_losses())
def test_reductions_agree_and_module_equals_functional(name):
    z, t = batch(32, 6, seed=2)
    none = create(name, reduction="none")(z, t)
    assert none.shape == (32,)
    torch.testing.assert_close(create(name, reduction="sum")(z, t), none.sum())
    torch.testing.assert_close(create(name, reduction="mean")(z, t), none.mean())


def test_gamma_zero_is_cross_entropy():
    z, t = batch(50, 7, seed=3, dtype=torch.float32)
    ce = nnf.cross_entropy(z, t)
    for loss in (
        L.focal_loss(z, t, 0.0),
        L.inverse_focal_loss(z, t, 0.0),
        L.dual_focal_loss(z, t, 0.0),
        L.focal_calibration_loss(z, t, 0.0, 0.0),
        L.sample_dependent_focal_loss(z, t, (0.0, 0.0)),
    ):
        torch.testing.assert_close(loss, ce)
    torch.testing.assert_close(
        L.cross_entropy(z, t, label_smoothing=0.1), nnf.cross_entropy(z, t, label_smoothing=0.1)
    )


def test_flsd_thresholds_go_to_the_upper_gamma():
    values = torch.tensor([0.1999, 0.2, 0.4999, 0.5, 0.9], dtype=torch.float64)
    assert L._pick_gamma(values, (0.2, 0.5), (5.0, 3.0, 2.0)).tolist() == [5.0, 3.0, 3.0, 2.0, 2.0]
    # p_t exactly 0.5 (two equal logits) takes gamma 2 under FLSD-532
    z = torch.zeros(1, 2, dtype=torch.float64)
    assert torch.log_softmax(z, 1).exp()[0, 0].item() == 0.5
    got = L.sample_dependent_focal_loss(z, torch.tensor([0]), (5, 3, 2), (0.2, 0.5))
    assert got.item() == pytest.approx(0.5**2 * math.log(2), rel=1e-15)


def test_flsd_gamma_is_chosen_without_gradient():
    z = torch.tensor([[0.3, 0.0]], dtype=torch.float64, requires_grad=True)
    L.sample_dependent_focal_loss(z, torch.tensor([0])).backward()
    p = torch.softmax(z.detach(), 1)[0, 0].item()
    # derivative of -(1-p)^3 log p at fixed γ = 3, times dp/dz0 = p(1-p)
    d_dp = 3 * (1 - p) ** 2 * math.log(p) - (1 - p) ** 3 / p
    assert z.grad[0, 0].item() == pytest.approx(d_dp * p * (1 - p), rel=1e-10)


class TestDualFocal:
    def test_true_class_not_argmax_uses_largest_class_below_it(self):
        z = torch.log(torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64))
        # target 1: p_t = 0.3, p_j = 0.2 (not 0.5)
        got = L.dual_focal_loss(z, torch.tensor([1]), 2.0)
        assert got.item() == pytest.approx((1 - 0.3 + 0.2) ** 2 * -math.log(0.3), rel=1e-12)

    def test_ties_with_the_true_class_are_excluded(self):
        z = torch.log(torch.tensor([[0.4, 0.4, 0.2]], dtype=torch.float64))
        got = L.dual_focal_loss(z, torch.tensor([0]), 2.0)
        assert got.item() == pytest.approx((1 - 0.4 + 0.2) ** 2 * -math.log(0.4), rel=1e-12)

    def test_all_equal_rows_have_no_runner_up(self):
        z = torch.zeros(2, 4, dtype=torch.float64)
        got = L.dual_focal_loss(z, torch.tensor([0, 3]), 2.0, reduction="none")
        torch.testing.assert_close(got, torch.full((2,), 0.75**2 * math.log(4), dtype=torch.float64))

    def test_gradient_flows_through_the_runner_up(self):
        z = torch.log(torch.tensor([[0.6, 0.3, 0.1]], dtype=torch.float64)).requires_grad_(True)
        L.dual_focal_loss(z, torch.tensor([0]), 2.0).backward()
        zz = z.detach().clone().requires_grad_(True)
        p = torch.softmax(zz, 1)[0]
        (-((1 - p[0] + p[1]) ** 2) * torch.log(p[0])).backward()
        torch.testing.assert_close(z.grad, zz.grad)


@pytest.mark.parametrize("name", list_losses())
@pytest.mark.parametrize("dtype", [torch.float32])
def test_finite_at_extreme_logits(name, dtype):
    z = torch.tensor([[1e4, -1e4, 0.0], [-1e4, 1e4, 0.0], [0.0, 0.0, 0.0], [50.0, 0.0, -50.0]], dtype=dtype)
    z.requires_grad_(True)
    t = torch.tensor([0, 0, 2, 0])  # confident right, confident wrong, uniform, p_t rounding to 1
    loss = create(name)(z, t)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(z.grad).all()


@pytest.mark.parametrize("gamma", [0.1, 0.5, 0.9])
def test_sub_unit_gamma_has_finite_gradient_as_p_t_goes_to_one(gamma):
    for fn in (L.focal_loss, L.dual_focal_loss):
        z = torch.tensor([[200.0, 0.0], [40.0, 0.0]], requires_grad=True)
        fn(z, torch.tensor([0, 0]), gamma).backward()
        assert torch.isfinite(z.grad).all()


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="runs where a CUDA device exists")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list_losses())
def test_autocast_runs_without_inf_or_nan(name, autocast_dtype, device):
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(8, 5).to(device)
    x = (30 * torch.randn(16, 8, generator=g)).to(device)
    t = torch.randint(0, 5, (16,), generator=g).to(device)
    with torch.autocast(device, dtype=autocast_dtype):
        loss = create(name).to(device)(layer(x), t)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


def test_batch_of_one_and_two_classes():
    z, t = torch.tensor([[0.3, -0.2]]), torch.tensor([1])
    for name in list_losses():
        assert torch.isfinite(create(name)(z, t))


def test_mmce_defaults_to_the_released_codes_normalisation():
    """SPEC §1: every published MMCE number used the released code's double normalisation, so the functional
    form, the module and create("mmce") default to it; the paper's single normalisation is an option."""
    g = torch.Generator().manual_seed(3)
    z, t = 2 * torch.randn(32, 4, generator=g, dtype=torch.float64), torch.randint(0, 4, (32,), generator=g)
    code = torch.tensor(R.mmce(z, t, 2.0, "code"), dtype=torch.float64).mean()
    paper = torch.tensor(R.mmce(z, t, 2.0, "paper"), dtype=torch.float64).mean()
    assert abs(float(code - paper)) > 1e-3  # the two normalisations differ on this batch
    for loss in (L.mmce_loss(z, t), MMCELoss()(z, t), create("mmce")(z, t)):
        torch.testing.assert_close(loss, code, rtol=1e-12, atol=0)
    torch.testing.assert_close(MMCELoss(normalization="paper")(z, t), paper, rtol=1e-12, atol=0)
    code_penalty = torch.tensor(
        R.mmce(z, t, 1.0, "code")[0] - R.mmce(z, t, 0.0, "code")[0], dtype=torch.float64
    )
    torch.testing.assert_close(L.mmce_penalty(z, t), code_penalty, rtol=1e-12, atol=1e-15)


def test_mmce_is_zero_for_all_correct_or_all_wrong_batches():
    z = torch.tensor([[2.0, 0.0], [0.0, 3.0]])
    assert L.mmce_penalty(z, torch.tensor([0, 1])).item() == 0.0
    assert L.mmce_penalty(z, torch.tensor([1, 0])).item() == 0.0


def test_bad_arguments():
    z, t = batch(4, 3)
    with pytest.raises(ValueError, match="`reduction` must be one of"):
        L.focal_loss(z, t, reduction="avg")
    with pytest.raises(ValueError, match="`gamma` must be >= 0"):
        L.focal_loss(z, t, gamma=-1.0)
    with pytest.raises(ValueError, match="`lambda_` must be >= 0"):
        L.focal_calibration_loss(z, t, lambda_=-0.5)
    with pytest.raises(ValueError, match=r"`targets` must lie in \[0, 3\), found label 3"):
        L.focal_loss(z, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match=r"`targets` must have shape \(4,\)"):
        L.focal_loss(z, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"soft `targets` \(class probabilities\) must have the shape"):
        L.focal_loss(z, torch.zeros(4))  # floating targets are class probabilities, of the logits' shape
    with pytest.raises(TypeError, match="integer class indices"):
        L.focal_loss(z, torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="at least 2 classes"):
        L.focal_loss(torch.zeros(4, 1), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="one more entry than `thresholds`"):
        L.sample_dependent_focal_loss(z, t, gammas=(5.0,), thresholds=(0.2,))
    with pytest.raises(ValueError, match="strictly increasing"):
        L.sample_dependent_focal_loss(z, t, gammas=(5.0, 3.0, 2.0), thresholds=(0.5, 0.2))
    with pytest.raises(ValueError, match="unknown loss 'focal-3'"):
        create("focal-3")
    with pytest.raises(TypeError, match="`thresholds` must be a sequence of numbers, got float"):
        L.sample_dependent_focal_loss(z, t, gammas=(5.0, 3.0), thresholds=0.2)
    with pytest.raises(TypeError, match="`gammas` must be a sequence of numbers, got float"):
        L.sample_dependent_focal_loss(z, t, gammas=5.0, thresholds=())


@pytest.mark.parametrize(
    "edges,acc,conf,match",
    [
        ([0.0, 0.7, 0.3, 1.0], [0.2, 0.5, 0.9], None, "`bin_edges` must be non-decreasing"),
        ([0.0, 0.3, 1.5, 2.0], [0.2, 0.5, 0.9], None, r"`bin_edges` must lie in \[0, 1\]"),
        ([0.0, 0.3, 0.6, 1.0], [0.2, math.nan, 0.9], None, r"`bin_accuracy` must lie in \[0, 1\]"),
        ([0.0, 0.3, 0.6, 1.0], [0.2, 0.5, 1.2], None, r"`bin_accuracy` must lie in \[0, 1\]"),
        ([0.0, 0.3, 0.6, 1.0], [0.2, 0.5, 0.9], [0.1, -0.5, 0.9], r"`bin_confidence` must lie in \[0, 1\]"),
        ([0.0], [], None, "M >= 1"),
    ],
)
def test_calfocal_refuses_bins_that_would_pick_gamma_silently_wrong(edges, acc, conf, match):
    # unsorted edges sent p_t to an arbitrary bin of torch.bucketize and NaN accuracies gave a NaN loss
    z, t = batch(4, 3)
    with pytest.raises(ValueError, match=match):
        L.calfocal_loss(z, t, edges, acc, bin_confidence=conf)


@pytest.mark.parametrize(
    "module,match",
    [
        (lambda: FocalCalibrationLoss(distance="l1"), "distance='l1'"),
        (lambda: DualFocalLoss(dual_logit="mean"), "dual_logit='mean'"),
        (lambda: DualFocalLoss(dual_logit=0.3), "dual_logit=0.3"),
    ],
    ids=["fcl-l1", "dfl-mean", "dfl-fixed"],
)
def test_fused_head_refuses_the_variants_it_does_not_compute(module, match):
    # the fused head has the squared-error FCL and the largest-runner-up DFL only: these variants were
    # silently computed as those (FCL-L1 gave 5.09 instead of 5.75 on a 8 × 5 batch)
    with pytest.raises(TypeError, match=f"{match}.*has no fused form"):
        FusedLinearLoss(module())


def test_calfocal_accepts_repeated_edges():
    # a repeated edge is an empty validation bin (AdaFocal's and CalFocal's update produce them)
    z, t = batch(4, 3)
    assert torch.isfinite(L.calfocal_loss(z, t, [0.0, 0.5, 0.5, 1.0], [0.2, 0.0, 0.9]))


# ----------------------------------------------------------------------------- properness


def _minimiser(fn, eta):
    k = eta.shape[0]
    z = torch.log(torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)).requires_grad_(True)
    opt = torch.optim.LBFGS(
        [z], lr=1, max_iter=1000, tolerance_grad=1e-13, tolerance_change=1e-16, line_search_fn="strong_wolfe"
    )

    def closure():
        opt.zero_grad()
        loss = sum(eta[j] * fn(z, torch.tensor([j])) for j in range(k))
        loss.backward()
        return loss

    opt.step(closure)
    return torch.softmax(z, 1).detach()[0]


ETA = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)


@pytest.mark.parametrize("fn", [L.cross_entropy, L.brier_loss], ids=["ce", "brier"])
def test_proper_losses_are_minimised_at_the_true_distribution(fn):
    torch.testing.assert_close(_minimiser(fn, ETA), ETA, atol=1e-6, rtol=0)


@pytest.mark.parametrize("gamma", [1.0, 3.0])
def test_focal_minimiser_maps_to_the_true_distribution_through_the_focal_map(gamma):
    """The link between the losses and the calibrators: focal_calibration_map(q*, γ) = η."""
    q = _minimiser(lambda z, t: L.focal_loss(z, t, gamma), ETA)
    assert not torch.allclose(q, ETA, atol=1e-2)  # focal loss alone is not proper
    torch.testing.assert_close(focal_calibration_map(q[None], gamma)[0], ETA, atol=1e-6, rtol=0)


def test_fcl_is_not_proper_for_finite_lambda_but_approaches_it():
    """Documented finding (docs/decisions.md): the FCL paper calls focal + λ·Brier proper; numerically its
    minimiser lies strictly between the focal one and η, and tends to η as λ grows."""
    focal_q = _minimiser(lambda z, t: L.focal_loss(z, t, 3.0), ETA)
    errors = []
    for lam in (0.5, 2.0, 20.0):
        q = _minimiser(lambda z, t, lam=lam: L.focal_calibration_loss(z, t, 3.0, lam), ETA)
        errors.append((q - ETA).abs().max().item())
    assert errors[0] > errors[1] > errors[2]
    assert errors[0] < (focal_q - ETA).abs().max().item()
    assert errors[0] > 1e-3


# ----------------------------------------------------------------------------- γ*


@pytest.mark.parametrize("p0,expected", [(0.2, 4.85), (0.25, 3.07)])
def test_gamma_star_values_of_the_paper(p0, expected):
    assert L.focal_gamma_star(p0) == pytest.approx(expected, abs=5e-3)


def test_gamma_star_has_no_nonzero_root_at_one_half():
    with pytest.raises(ValueError, match="no non-zero γ"):
        L.focal_gamma_star(0.5)


@pytest.mark.parametrize("p0", [0.05, 0.1, 0.2, 0.3, 0.45, 0.7])
def test_gamma_star_solves_the_equation(p0):
    g = L.focal_gamma_star(p0)
    value = (1 - p0) ** g - g * p0 * (1 - p0) ** (g - 1) * math.log(p0)
    assert value == pytest.approx(1.0, abs=1e-10)
    assert abs(g) > 1e-6  # not the trivial root


def _gamma_star_high_precision(p0):
    """The non-zero root of g(p0, γ) = 1 at 60 digits, by geometric bisection of γ (|γ| for p0 > 1/2, where
    γ* lies in (−1, 0)): g − 1 > 0 between 0 and γ*, < 0 beyond (g rises from g(0) = 1 towards γ*)."""
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(60):
        p = mpmath.mpf(p0)
        sign = 1 if p0 < 0.5 else -1

        def excess(magnitude):
            g = sign * magnitude
            return (1 - p) ** g - g * p * (1 - p) ** (g - 1) * mpmath.log(p) - 1

        lo, hi = mpmath.mpf("1e-40"), mpmath.mpf("1e40") if sign > 0 else mpmath.mpf(1)
        for _ in range(400):
            mid = mpmath.sqrt(lo * hi)
            lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
        return float(sign * mpmath.sqrt(lo * hi))


@pytest.mark.parametrize(
    "p0,rel",
    [
        # tiny p0: ln(1 − p0) must be log1p(−p0) (math.log(1 − 1e-9) has relative error ~1e-8; below
        # p0 ≈ 1e-16 it is 0); the remaining error is a few ulp of the arithmetic: 1e-13
        (1e-17, 1e-13),
        (1e-9, 1e-13),
        # near 1/2 the Lambert-W argument nears its branch point −1/e, where W loses half the digits (the
        # previous result had a relative error of 0.23 at 0.49999999 and 1.4e-3 at 0.5000001); refined, the
        # error is that of c = −log1p(−p0)/L, a few ulp of 1, amplified by 1/|1 − c| (~2e7 at 0.49999999):
        # ~1e-8, so rel 1e-6; 1e-11 at 0.4999 (|1 − c| ≈ 2e-4)
        (0.4999, 1e-11),
        (0.49999999, 1e-6),
        (0.5000001, 1e-6),
        (0.2, 1e-13),
        (0.9, 1e-13),
    ],
)
def test_gamma_star_matches_a_high_precision_root(p0, rel):
    assert L.focal_gamma_star(p0) == pytest.approx(_gamma_star_high_precision(p0), rel=rel)


def test_lambert_w_against_scipy():
    special = pytest.importorskip("scipy.special")
    for x in (-0.36, -0.3, -0.1, -0.01, -1e-5):
        assert L._lambert_w(x, -1) == pytest.approx(special.lambertw(x, -1).real, rel=1e-12)
    for x in (-0.36, -0.1, 0.5, 3.0):
        assert L._lambert_w(x, 0) == pytest.approx(special.lambertw(x, 0).real, rel=1e-12)


# ----------------------------------------------------------------------------- scheduled focal


def test_scheduled_focal_follows_epochs_and_resumes():
    loss = create("fls-531")
    seen = []
    for epoch in (0, 99, 100, 249, 250, 349):
        loss.set_epoch(epoch)
        seen.append(loss.gamma)
    assert seen == [5.0, 5.0, 3.0, 3.0, 1.0, 1.0]
    loss.set_epoch(120)
    fresh = create("fls-531")
    fresh.load_state_dict(loss.state_dict())
    assert fresh.gamma == 3.0
    z, t = batch(8, 3)
    torch.testing.assert_close(fresh(z, t), L.focal_loss(z, t, 3.0))


def test_varying_focal_loss_matches_the_per_sample_reference():
    """Per-sample γ: focal with γ_i >= 0, inverse focal with |γ_i| for γ_i < 0 (AdaFocal's convention)."""
    z, t = batch(6, 4, seed=9)
    gamma = torch.tensor([0.0, 0.5, 3.0, -0.2, -1.5, 5.0], dtype=torch.float64)
    expected = [
        (
            R.focal(z[i : i + 1], t[i : i + 1], g)[0]
            if g >= 0
            else R.inverse_focal(z[i : i + 1], t[i : i + 1], -g)[0]
        )
        for i, g in enumerate(gamma.tolist())
    ]
    got = L.varying_focal_loss(z, t, gamma, reduction="none")
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    zz = z.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: L.varying_focal_loss(x, t, gamma).sum(), (zz,), eps=1e-6, atol=1e-5
    )
    with pytest.raises(ValueError, match="one γ per sample"):
        L.varying_focal_loss(z, t, gamma[:3])


@pytest.mark.parametrize("label", [-100, -1, 3])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_with_ignore_index_none_ignores_no_label(label, smoothing):
    """With ``ignore_index=None`` every label outside [0, K) raises, −100 included (decisions 40, 73)."""
    import torchcal.functional.losses as Lf

    with pytest.raises(ValueError, match=rf"must lie in \[0, 3\), found label {label}"):
        Lf.cross_entropy(
            torch.randn(4, 3), torch.tensor([0, label, 1, 2]), label_smoothing=smoothing, ignore_index=None
        )
    if label != -100:  # the default ignores −100 only
        with pytest.raises(ValueError, match=rf"must lie in \[0, 3\), found label {label}"):
            Lf.cross_entropy(torch.randn(4, 3), torch.tensor([0, label, -100, 2]), label_smoothing=smoothing)
