"""The losses of the papers' ablations: FCL's L1 term (FCL A.15) and the dual focal loss's p_j variants (DFL
Table 4), against float64 references, with gradcheck, edge cases and the registry / config route."""

import math

import pytest
import torch

import torchcal.functional.losses as L
from tests.reference import ablations as A
from tests.reference import losses as R
from torchcal.losses import create

# every test here runs on the C++ CPU losses and on the torch path
pytestmark = pytest.mark.usefixtures("loss_backend")

DUAL_LOGITS = ["second", "third", "mean2", "mean3", "mean", 0.0, 0.1, 0.2]


def batch(n=40, k=5, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(n, k, generator=g, dtype=torch.float64), torch.randint(0, k, (n,), generator=g)


# float64 against float64 math over ~10 operations: agreement to a few ulps of the values (~1e-16 relative)
TOL = {"rtol": 1e-10, "atol": 1e-12}


@pytest.mark.parametrize("k", [2, 3, 10])
@pytest.mark.parametrize("gamma,lam", [(0.0, 1.0), (4.0, 1.5), (0.5, 3.0)])
def test_fcl_l1_matches_float64_reference(k, gamma, lam):
    z, t = batch(40, k, seed=k)
    got = L.focal_calibration_loss(z, t, gamma, lam, distance="l1", reduction="none")
    torch.testing.assert_close(got, torch.tensor(A.fcl_l1(z, t, gamma, lam), dtype=torch.float64), **TOL)


def test_fcl_l1_gradcheck_and_l2_default_unchanged():
    z, t = batch(6, 4, seed=1, scale=1.5)
    z.requires_grad_(True)
    fn = lambda x: L.focal_calibration_loss(x, t, 2.0, 1.5, distance="l1").sum()  # noqa: E731
    assert torch.autograd.gradcheck(fn, (z,), eps=1e-6, atol=1e-5)
    zd = z.detach()
    torch.testing.assert_close(
        L.focal_calibration_loss(zd, t, 4.0, 1.5, distance="l2", reduction="none"),
        torch.tensor(R.fcl(zd, t, 4.0, 1.5), dtype=torch.float64),
        **TOL,
    )


def test_fcl_l1_by_hand_and_inputs():
    # p = (0.5, 0.5), label 0: log 2 + λ·(0.5 + 0.5)
    got = L.focal_calibration_loss(torch.zeros(1, 2), torch.tensor([0]), 0.0, 2.0, distance="l1")
    assert got.item() == pytest.approx(math.log(2) + 2.0, rel=1e-6)
    z, t = batch(12, 4, seed=3)
    t[3] = -100  # ignored label and class weights as for every loss
    w = torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=torch.float64)
    per = torch.tensor(A.fcl_l1(z, t.clamp(min=0), 2.0, 1.5), dtype=torch.float64)
    keep = t != -100
    wt = w[t.clamp(min=0)] * keep
    expected = (per * wt).sum() / wt.sum()
    got = L.focal_calibration_loss(z, t, 2.0, 1.5, distance="l1", weight=w)
    torch.testing.assert_close(got, expected, **TOL)


def test_fcl_l1_refusals():
    z, t = batch(4, 3)
    with pytest.raises(ValueError, match="`distance` must be one of"):
        L.focal_calibration_loss(z, t, distance="l3")
    with pytest.raises(TypeError, match="distance='l1' is defined for labels"):
        L.focal_calibration_loss(z, torch.softmax(z, 1), distance="l1")
    with pytest.raises(ValueError, match="label_smoothing"):
        L.focal_calibration_loss(z, t, distance="l1", label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        create("fcl", distance="l1", label_smoothing=0.1)


@pytest.mark.parametrize("k", [2, 3, 10])
@pytest.mark.parametrize("dual_logit", DUAL_LOGITS, ids=str)
def test_dfl_variants_match_float64_reference(k, dual_logit):
    z, t = batch(40, k, seed=k)
    got = L.dual_focal_loss(z, t, 2.0, dual_logit=dual_logit, reduction="none")
    ref = A.dfl_variant(z, t, 2.0, dual_logit)
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64), **TOL)


def test_dfl_reference_default_is_the_papers_loss():
    z, t = batch(40, 6, seed=5)
    assert A.dfl_variant(z, t, 2.0, "largest") == pytest.approx(R.dfl(z, t, 2.0), rel=1e-15)


@pytest.mark.parametrize("dual_logit", DUAL_LOGITS, ids=str)
def test_dfl_variants_gradcheck(dual_logit):
    z, t = batch(6, 5, seed=1, scale=1.5)
    z.requires_grad_(True)
    fn = lambda x: L.dual_focal_loss(x, t, 2.0, dual_logit=dual_logit).sum()  # noqa: E731
    assert torch.autograd.gradcheck(fn, (z,), eps=1e-6, atol=1e-5)


def test_dfl_variants_edge_cases():
    # all-equal rows: no class below p_t, every ranked variant is 0 and the loss is the focal loss
    z = torch.zeros(2, 4, dtype=torch.float64)
    t = torch.tensor([0, 3])
    focal = L.focal_loss(z, t, 2.0, reduction="none")
    for v in ("second", "third", "mean2", "mean3", "mean"):
        torch.testing.assert_close(L.dual_focal_loss(z, t, 2.0, dual_logit=v, reduction="none"), focal)
    # fixed c = 0 is focal loss; K = 2 has no 2nd class below p_t
    z, t = batch(20, 2, seed=7)
    torch.testing.assert_close(
        L.dual_focal_loss(z, t, 3.0, dual_logit=0.0), L.focal_loss(z, t, 3.0), rtol=1e-12, atol=0
    )
    torch.testing.assert_close(
        L.dual_focal_loss(z, t, 3.0, dual_logit="second"), L.focal_loss(z, t, 3.0), rtol=1e-12, atol=0
    )
    # by hand: p = softmax(3, 2, 1, 0), true class 0, "mean3" = mean(p1, p2, p3) = (1 − p0)/3
    z = torch.tensor([[3.0, 2.0, 1.0, 0.0]], dtype=torch.float64)
    p = torch.softmax(z, 1)[0]
    want = -((1 - p[0] + (1 - p[0]) / 3) ** 2) * torch.log(p[0])
    torch.testing.assert_close(L.dual_focal_loss(z, torch.tensor([0]), 2.0, dual_logit="mean3"), want)


def test_dfl_variants_inputs_and_refusals():
    z, t = batch(12, 5, seed=2)
    t[0] = -100
    keep = t != -100
    w = torch.tensor([1.0, 2.0, 0.5, 3.0, 1.0], dtype=torch.float64)
    per = torch.tensor(A.dfl_variant(z, t.clamp(min=0), 2.0, "mean"), dtype=torch.float64)
    wt = w[t.clamp(min=0)] * keep
    got = L.dual_focal_loss(z, t, 2.0, dual_logit="mean", weight=w)
    torch.testing.assert_close(got, (per * wt).sum() / wt.sum(), **TOL)
    # (N, K, d) inputs: positions are samples
    z3 = z.reshape(3, 4, 5).movedim(2, 1)
    t3 = t.clamp(min=0).reshape(3, 4)
    flat = L.dual_focal_loss(z, t.clamp(min=0), 2.0, dual_logit="third", reduction="none")
    torch.testing.assert_close(
        L.dual_focal_loss(z3, t3, 2.0, dual_logit="third", reduction="none"), flat.reshape(3, 4)
    )
    with pytest.raises(ValueError, match="`dual_logit` must be one of"):
        L.dual_focal_loss(z, t, dual_logit="fourth")
    with pytest.raises(ValueError, match="dual_logit"):
        L.dual_focal_loss(z, t, dual_logit=1.5)
    with pytest.raises(TypeError, match="dual_logit"):
        L.dual_focal_loss(z, t, dual_logit=True)
    with pytest.raises(TypeError, match="true class"):
        L.dual_focal_loss(z, torch.softmax(z, 1), dual_logit="mean")


def test_registry_and_config_route():
    z, t = batch(16, 5, seed=4)
    m = create("dfl", gamma=2.0, dual_logit="mean2", reduction="sum")
    assert "dual_logit='mean2'" in repr(m)
    torch.testing.assert_close(m(z, t), L.dual_focal_loss(z, t, 2.0, dual_logit="mean2", reduction="sum"))
    m = create("fcl", distance="l1")
    assert "distance='l1'" in repr(m)
    torch.testing.assert_close(m(z, t), L.focal_calibration_loss(z, t, 4.0, 1.5, distance="l1"))


@pytest.mark.parametrize(
    "preset,override,arg,value",
    [
        ("cifar10_resnet50_dfl", "loss.kwargs.dual_logit=0.1", "dual_logit", 0.1),
        ("cifar10_resnet50_dfl", "loss.kwargs.dual_logit=mean2", "dual_logit", "mean2"),
        ("cifar10_resnet50_fcl", "loss.kwargs.distance=l1", "distance", "l1"),
    ],
)
def test_reachable_from_a_preset_by_config_key(preset, override, arg, value):
    from pathlib import Path

    from torchcal.experiments.config import load_config

    path = Path(__file__).resolve().parents[1] / "configs" / f"{preset}.yaml"
    cfg = load_config(path, [override])
    loss = create(cfg.loss.name, reduction=cfg.loss.reduction, **cfg.loss.kwargs)
    assert getattr(loss, arg) == value


def test_bad_option_by_config_key_is_one_clear_error():
    from pathlib import Path

    from torchcal.experiments.config import ConfigError, load_config

    path = Path(__file__).resolve().parents[1] / "configs" / "cifar10_resnet50_dfl.yaml"
    with pytest.raises(ConfigError, match="dual_logit"):
        load_config(path, ["loss.kwargs.dual_logit=fourth"])


def test_adafocal_unconstrained_gamma_max():
    """AdaFocal App. N: γ_max = ∞ lets γ grow past the default cap of 20."""
    import math

    from torchcal.adafocal import AdaFocalLoss

    # every validation sample sure and wrong: gap = conf − acc = 0.99 in every bin, γ ← γ·exp(λ·0.99)
    val = torch.tensor([[0.99, 0.01]] * 30, dtype=torch.float64)
    wrong = torch.ones(30, dtype=torch.long)
    capped = AdaFocalLoss(n_bins=3, gamma_init=15.0, lambda_=1.0)
    free = create("adafocal", n_bins=3, gamma_init=15.0, lambda_=1.0, gamma_max="inf")
    assert free.gamma_max == math.inf and AdaFocalLoss(gamma_max=math.inf).gamma_max == math.inf
    capped.update(val, wrong)
    free.update(val, wrong)
    torch.testing.assert_close(capped.gammas, torch.full((3,), 20.0, dtype=torch.float64))
    torch.testing.assert_close(free.gammas, torch.full((3,), 15.0 * math.exp(0.99), dtype=torch.float64))
    z, t = batch(8, 2, seed=1)
    assert bool(torch.isfinite(free(z, t)))
    with pytest.raises(ValueError, match="gamma_max"):
        AdaFocalLoss(gamma_max=-math.inf)
    with pytest.raises(TypeError, match="gamma_max"):
        AdaFocalLoss(gamma_max="big")


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("h", [0.05, 0.5])
def test_kde_xe_matches_float64_reference(k, h):
    z, t = batch(24, k, seed=k)
    got = L.kde_xe_loss(z, t, 0.7, bandwidth=h)
    # float64 against float64 math: lgamma / exp / sums of 24² terms, relative agreement ~1e-13
    assert got.item() == pytest.approx(A.kde_xe(z, t, 0.7, h), rel=1e-10)


def test_kde_xe_is_the_metric_plus_cross_entropy_and_picks_the_metrics_bandwidth():
    from torchcal.functional import kde_calibration_error
    from torchcal.functional.calibration import _kde_select_bandwidth

    z, t = batch(40, 3, seed=3)
    ce = torch.nn.functional.cross_entropy(z, t)
    for h in ("auto", 0.1):
        want = ce + 2.0 * kde_calibration_error(z, t, from_logits=True, bandwidth=h)
        torch.testing.assert_close(L.kde_xe_loss(z, t, 2.0, bandwidth=h), want, rtol=1e-12, atol=0)
    # the "auto" rule is the metric's leave-one-out maximiser: the loss with that bandwidth fixed agrees
    f = torch.softmax(z, 1)
    h = _kde_select_bandwidth(f, f.log(), 1024)
    torch.testing.assert_close(L.kde_xe_loss(z, t, 2.0), L.kde_xe_loss(z, t, 2.0, bandwidth=h))


@pytest.mark.parametrize("h", [0.1, 0.6])
def test_kde_xe_gradcheck(h):
    z, t = batch(7, 3, seed=1, scale=1.0)
    z.requires_grad_(True)
    fn = lambda x: L.kde_xe_loss(x, t, 1.5, bandwidth=h)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (z,), eps=1e-6, atol=1e-5)


def test_kde_xe_reductions_ignored_labels_and_refusals():
    z, t = batch(12, 4, seed=2)
    none = L.kde_xe_loss(z, t, 1.0, bandwidth=0.2, reduction="none")
    torch.testing.assert_close(none.mean(), L.kde_xe_loss(z, t, 1.0, bandwidth=0.2))
    torch.testing.assert_close(none.sum(), L.kde_xe_loss(z, t, 1.0, bandwidth=0.2, reduction="sum"))
    # ignored positions are left out of both terms
    t2 = t.clone()
    t2[:3] = -100
    torch.testing.assert_close(
        L.kde_xe_loss(z, t2, 1.0, bandwidth=0.2), L.kde_xe_loss(z[3:], t[3:], 1.0, bandwidth=0.2)
    )
    assert L.kde_xe_loss(z, t2, 1.0, bandwidth=0.2, reduction="none")[:3].eq(0).all()
    # fewer than 2 kept samples: no KDE term, cross entropy
    one = L.kde_xe_loss(z[:1], t[:1], 1.0)
    torch.testing.assert_close(one, torch.nn.functional.cross_entropy(z[:1], t[:1]))
    with pytest.raises(ValueError, match="bandwidth"):
        L.kde_xe_loss(z, t, bandwidth=0.0)
    with pytest.raises(ValueError, match="bandwidth"):
        L.kde_xe_loss(z, t, bandwidth="silverman")
    with pytest.raises(ValueError, match="`weight` is not accepted"):
        L.kde_xe_loss(z, t, weight=torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="label_smoothing"):
        create("kde-xe", label_smoothing=0.1)
    with pytest.raises(TypeError, match="one-hot label"):
        L.kde_xe_loss(z, torch.softmax(z, 1))
    m = create("kde-xe", lambda_=0.5, bandwidth=0.2, reduction="sum")
    assert repr(m) == "KDEXELoss(lambda_=0.5, bandwidth=0.2, reduction='sum')"
    torch.testing.assert_close(m(z, t), L.kde_xe_loss(z, t, 0.5, bandwidth=0.2, reduction="sum"))


def test_kde_xe_trains_in_float32_and_reduces_the_term():
    """A few steps of KDE-XE on a fixed batch lower its KDE calibration term (float32 logits)."""
    from torchcal.functional import kde_calibration_error

    g = torch.Generator().manual_seed(0)
    z = (4 * torch.randn(64, 3, generator=g)).requires_grad_(True)
    t = torch.randint(0, 3, (64,), generator=g)
    before = kde_calibration_error(z.detach(), t, from_logits=True, bandwidth=0.1)
    opt = torch.optim.SGD([z], lr=2.0)
    for _ in range(30):
        opt.zero_grad()
        loss = L.kde_xe_loss(z, t, 5.0, bandwidth=0.1)
        assert loss.dtype == torch.float32
        loss.backward()
        opt.step()
    assert kde_calibration_error(z.detach(), t, from_logits=True, bandwidth=0.1) < before


def test_kde_xe_reachable_by_config_key():
    from pathlib import Path

    from torchcal.experiments.config import load_config

    path = Path(__file__).resolve().parents[1] / "configs" / "cifar10_resnet50_ce.yaml"
    cfg = load_config(path, ["loss.name=kde-xe", "loss.reduction=mean", "loss.kwargs.bandwidth=0.1"])
    loss = create(cfg.loss.name, reduction=cfg.loss.reduction, **cfg.loss.kwargs)
    assert (loss.lambda_, loss.bandwidth, loss.reduction) == (1.0, 0.1, "mean")
