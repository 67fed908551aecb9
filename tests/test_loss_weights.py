"""Class weights and label smoothing on every multiclass loss (decision 96), with ``F.cross_entropy``'s
conventions, against the float64 per-sample references of tests/reference/losses.py, on both CPU paths."""

import pytest
import torch
import torch.nn.functional as nnf

import torchcal.functional.losses as L
from tests.reference import losses as R
from torchcal.adafocal import AdaFocalLoss, CalFocalLoss
from torchcal.losses import create, list_losses

pytestmark = pytest.mark.usefixtures("loss_backend")

K = 5
# the per-sample float64 reference of every registered loss in its initial state (AdaFocal's γ_b = 1 and
# CalFocal's A = C at the start are the focal loss with γ = 1; AdaDualFocal the dual focal loss with γ = 1)
HARD_REFERENCE = {
    "ce": lambda z, y: R.ce(z, y),
    "ls-0.05": lambda z, y: R.ce(z, y, 0.05),
    "brier": R.brier,
    "fl-1": lambda z, y: R.focal(z, y, 1.0),
    "fl-2": lambda z, y: R.focal(z, y, 2.0),
    "fl-3": lambda z, y: R.focal(z, y, 3.0),
    "ifl-1": lambda z, y: R.inverse_focal(z, y, 1.0),
    "flsd-53": lambda z, y: R.flsd(z, y, (5, 3), (0.2,)),
    "flsd-532": lambda z, y: R.flsd(z, y, (5, 3, 2), (0.2, 0.5)),
    "fls-531": lambda z, y: R.focal(z, y, 5.0),
    "fls-532": lambda z, y: R.focal(z, y, 5.0),
    "dfl": lambda z, y: R.dfl(z, y, 5.0),
    "dualflsd-53": lambda z, y: R.dual_flsd(z, y, (5, 3), (0.2,)),
    "fcl": lambda z, y: R.fcl(z, y, 4.0, 1.5),
    "adafocal": lambda z, y: R.focal(z, y, 1.0),
    "adadualfocal": lambda z, y: R.dfl(z, y, 1.0),
    "calfocal": lambda z, y: R.focal(z, y, 1.0),
    "poly1": lambda z, y: R.poly1(z, y, 1.0),
}
# the batch statistics and the target-free penalties (SPEC §8, decision 133) take no class weights; DCA's
# weights enter its cross entropy only, not a per-sample loss (tests/test_margin_losses.py)
WEIGHT_REFUSED = ["mmce", "kde-xe", "mbls", "acls", "confidence-penalty", "maxsup", "mdca", "focal-mdca", "ls-mdca",
                  "sb-ece", "avuc", "s-avuc", "esd", "hl1-ace", "sl1-ace", "cals"]  # fmt: skip
WEIGHTED = [n for n in list_losses() if n not in [*WEIGHT_REFUSED, "dca"]]
# the losses that are functions of the target distribution, with their per-class term f(p_k) and λ
SMOOTHED = {
    "ce": (lambda pj, j: -R.math.log(pj), 0.0),
    "brier": (lambda pj, j: 0.0, 1.0),
    "fl-3": (R.focal_term(3.0), 0.0),
    "ifl-1": (lambda pj, j: -((1 + pj) ** 1.0) * R.math.log(pj), 0.0),
    "fcl": (R.focal_term(4.0), 1.5),
    "poly1": (lambda pj, j: -R.math.log(pj) + (1 - pj), 0.0),
}
SMOOTHING_REFUSED = ["mmce", "kde-xe", "dfl", "dualflsd-53", "adafocal", "adadualfocal", "calfocal", "mbls", "acls",
                     "confidence-penalty", "maxsup", "mdca", "focal-mdca", "ls-mdca", "dca", "sb-ece", "avuc", "s-avuc",
                     "esd", "hl1-ace", "sl1-ace", "cals"]  # fmt: skip


def batch(n=16, seed=0, scale=3.0, ignored=True):
    g = torch.Generator().manual_seed(seed)
    z = scale * torch.randn(n, K, generator=g, dtype=torch.float64)
    y = torch.randint(0, K, (n,), generator=g)
    if ignored:
        y[3] = y[n - 1] = -100
    w = 0.2 + 2 * torch.rand(K, generator=g, dtype=torch.float64)
    return z, y, w


def test_every_loss_is_covered():
    assert sorted([*HARD_REFERENCE, *WEIGHT_REFUSED, "dca"]) == sorted(list_losses())


@pytest.mark.parametrize("name", WEIGHTED)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_class_weights_match_the_float64_reference(name, reduction):
    """w_y·loss per sample, ignored labels add 0, "mean" divides by Σ w_y over the kept labels."""
    z, y, w = batch()
    got = create(name, weight=w, reduction=reduction)(z, y)
    if name == "ls-0.05":  # label smoothing: each class's term weighted, "mean" over the labels' weights
        per_sample = R.soft_general(z, R.smoothed(y.clamp(min=0), K, 0.05), SMOOTHED["ce"][0], w)
        want = R.reduce_weighted(per_sample, y, w, reduction, scale=False)
    else:
        want = R.reduce_weighted(HARD_REFERENCE[name](z, y.clamp(min=0)), y, w, reduction)
    want = torch.tensor(want, dtype=torch.float64)
    # float64 throughout; the fused path's float64 arithmetic and log-softmax differ from the reference's
    # by a few ulps per term
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", WEIGHTED)
def test_class_weights_on_spatial_inputs(name):
    """(N, K, d) logits with (N, d) labels are positions: the same as their rows."""
    g = torch.Generator().manual_seed(4)
    z = torch.randn(2, K, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, K, (2, 6), generator=g)
    y[0, 1] = -100
    w = torch.linspace(0.5, 2.0, K, dtype=torch.float64)
    got = create(name, weight=w)(z, y)
    rows = create(name, weight=w)(z.movedim(1, -1).reshape(-1, K), y.reshape(-1))
    torch.testing.assert_close(got, rows)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_focal_with_gamma_zero_is_pytorch_cross_entropy(reduction):
    """The peer: F.cross_entropy with weight, label smoothing, ignored labels and soft targets."""
    z, y, w = batch()
    q = torch.softmax(torch.randn(16, K, dtype=torch.float64), 1)
    for eps in (0.0, 0.1):
        for targets in (y, q):
            got = L.focal_loss(z, targets, 0.0, weight=w, label_smoothing=eps, reduction=reduction)
            want = nnf.cross_entropy(z, targets, w, label_smoothing=eps, reduction=reduction)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
            got = L.cross_entropy(z, targets, weight=w, label_smoothing=eps, reduction=reduction)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", sorted(SMOOTHED))
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_label_smoothing_matches_the_float64_reference(name, reduction, weighted):
    """Labels smoothed to (1 − ε)·onehot + ε/K: Σ_k w_k q_k f(p_k) (+ λ·Σ_k w_k q_k·‖p − q‖²), "mean" over
    the labels' weights."""
    z, y, w = batch()
    w = w if weighted else None
    f, lam = SMOOTHED[name]
    got = create(name, weight=w, label_smoothing=0.1, reduction=reduction)(z, y)
    per_sample = R.soft_general(z, R.smoothed(y.clamp(min=0), K, 0.1), f, w, lam)
    want = R.reduce_weighted(per_sample, y, w, reduction, scale=False)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", sorted(SMOOTHED))
def test_soft_targets_with_weights_and_smoothing(name):
    """Soft targets q: smoothed as (1 − ε)·q + ε/K, classes weighted, "mean" divides by the row count."""
    z, _, w = batch(ignored=False)
    q = torch.softmax(torch.randn(16, K, generator=torch.Generator().manual_seed(3), dtype=torch.float64), 1)
    f, lam = SMOOTHED[name]
    for reduction in ("mean", "none"):
        got = create(name, weight=w, label_smoothing=0.2, reduction=reduction)(z, q)
        per_sample = R.soft_general(z, R.smoothed(q, K, 0.2), f, w, lam)
        want = R.reduce_weighted(per_sample, None, w, reduction)
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-10, atol=1e-12)


def test_flsd_with_smoothing_picks_gamma_per_class():
    z, y, w = batch()

    def f(pj, j):
        return R.focal_term(5.0 if pj < 0.2 else 3.0)(pj, j)

    got = L.sample_dependent_focal_loss(z, y, weight=w, label_smoothing=0.1)
    want = R.reduce_weighted(
        R.soft_general(z, R.smoothed(y.clamp(min=0), K, 0.1), f, w), y, w, "mean", scale=False
    )
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-10, atol=1e-12)


GRADIENT_CASES = [(n, eps) for n in ("fl-3", "fcl", "brier", "flsd-53") for eps in (0.0, 0.1)] + [
    ("dfl", 0.0)
]


@pytest.mark.parametrize("name,smoothing", GRADIENT_CASES)
def test_weighted_gradients(name, smoothing):
    z, y, w = batch(n=6, scale=2.0)
    loss_fn = create(name, weight=w, label_smoothing=smoothing)
    assert torch.autograd.gradcheck(lambda x: loss_fn(x, y), (z.clone().requires_grad_(True),))


def test_zero_weight_classes_and_all_ignored():
    """A class of weight 0 adds nothing; when every kept label has weight 0, "mean" is 0/0 = NaN as
    F.cross_entropy."""
    z, y, _ = batch(ignored=False)
    w = torch.ones(K, dtype=torch.float64)
    w[y[0]] = 0.0
    got = L.focal_loss(z, y, 2.0, weight=w, reduction="none")
    assert (got[y == y[0]] == 0).all() and (got[y != y[0]] > 0).all()
    only = torch.full_like(y, int(y[0]))
    assert torch.isnan(L.focal_loss(z, only, 2.0, weight=w))
    assert torch.isnan(nnf.cross_entropy(z, only, w))


@pytest.mark.parametrize("name", SMOOTHING_REFUSED)
def test_losses_that_cannot_smooth_refuse_in_one_sentence(name):
    with pytest.raises(ValueError, match=r"^`label_smoothing` is not accepted: [^.]+$"):
        create(name, label_smoothing=0.1)
    assert create(name, label_smoothing=0.0) is not None  # ε = 0 is the loss itself


def test_functional_refusals():
    z, y, w = batch()
    with pytest.raises(ValueError, match=r"^`weight` is not accepted: MMCE's penalty is a kernel statistic"):
        L.mmce_loss(z, y, weight=w)
    with pytest.raises(ValueError, match="^`weight` is not accepted"):
        create("mmce", weight=w)
    with pytest.raises(ValueError, match="`label_smoothing` is not accepted: MMCE"):
        L.mmce_loss(z, y, label_smoothing=0.1)
    with pytest.raises(ValueError, match="`label_smoothing` is not accepted: the dual focal loss"):
        L.dual_focal_loss(z, y, label_smoothing=0.1)
    with pytest.raises(ValueError, match="`label_smoothing` is not accepted: the validation bin"):
        L.calfocal_loss(z, y, [0.0, 0.5, 1.0], [0.4, 0.9], label_smoothing=0.1)
    with pytest.raises(ValueError, match="`label_smoothing` is not accepted: γ is given per sample"):
        L.varying_focal_loss(z, y, torch.ones(16), label_smoothing=0.1)


def test_bad_weights_are_named():
    z, y, _ = batch()
    with pytest.raises(
        ValueError, match=r"`weight` must have shape \(5,\), one weight per class, got \(4,\)"
    ):
        L.focal_loss(z, y, weight=torch.ones(4, dtype=torch.float64))
    with pytest.raises(TypeError, match="`weight` must be a floating-point tensor"):
        L.focal_loss(z, y, weight=torch.ones(K, dtype=torch.long))
    with pytest.raises(ValueError, match="finite, non-negative"):
        L.brier_loss(z, y, weight=torch.tensor([1.0, -1.0, 1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="finite, non-negative"):
        create("fl-3", weight=[1.0, float("nan")])
    with pytest.raises(ValueError, match="1-D floating-point"):
        create("ce", weight=torch.ones(2, 2))
    # a list is taken as a tensor (float64), cast to the logits' dtype
    torch.testing.assert_close(
        L.focal_loss(z.float(), y, weight=[1.0, 2.0, 1.0, 1.0, 3.0]),
        L.focal_loss(z.float(), y, weight=torch.tensor([1.0, 2.0, 1.0, 1.0, 3.0])),
    )


def test_weight_is_a_buffer_and_in_the_repr():
    loss_fn = create("fl-2", weight=torch.tensor([1.0, 2.0]), label_smoothing=0.1)
    assert "weight" in dict(loss_fn.named_buffers())
    assert repr(loss_fn) == "FocalLoss(gamma=2.0, reduction='mean', label_smoothing=0.1, weight=[1.0, 2.0])"
    assert repr(create("fl-2")) == "FocalLoss(gamma=2.0, reduction='mean')"
    state = AdaFocalLoss(weight=torch.ones(3)).state_dict()
    assert "weight" in state and "weight" in CalFocalLoss(weight=torch.ones(3)).state_dict()


def test_float32_and_autocast_weights():
    """Half-precision logits are computed in float32, the weights cast to it."""
    z, y, w = batch()
    want = L.focal_loss(z.float(), y, weight=w.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = L.focal_loss(z.float(), y, weight=w)
    torch.testing.assert_close(got, want)
    assert L.focal_loss(z.half(), y, weight=w).dtype == torch.float32
