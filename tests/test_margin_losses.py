"""The margin and penalty losses (SPEC §8, torchcal.functional.margin): MbLS, Poly-1, the confidence penalty
and MaxSup, against the float64 per-position loop references of tests/reference/margin.py (values and
gradients, (N, K) and (N, K, H, W), ignored labels, the three reductions), gradcheck, hand-computed cases, the
released code's conventions, the schedules, the registry and autocast."""

import math

import pytest
import torch
import torch.nn.functional as nnf

import torchcal.functional as F
from tests.reference import margin as R
from torchcal.losses import (
    ConfidencePenaltyLoss,
    LogitMarginL1Loss,
    MaxSupLoss,
    Poly1CrossEntropyLoss,
    create,
)

K = 4
# CALS's multipliers and penalty parameters per class, one of them small enough that its PHR term is flat
CALS_LAMBDA = torch.tensor([1e-6, 0.5, 2.0, 0.1], dtype=torch.float64)
CALS_RHO = torch.tensor([1.0, 3.0, 1.5, 10.0], dtype=torch.float64)


def batch(shape=(7,), k=K, seed=0, scale=6.0, ignore=-100, dtype=torch.float64):
    """Logits of shape (N, K, *spatial) spread wide enough that some logit distances exceed MbLS's margin of
    10, and labels with two ignored positions."""
    g = torch.Generator().manual_seed(seed)
    n, spatial = shape[0], shape[1:]
    z = (scale * torch.randn(n, k, *spatial, generator=g, dtype=torch.float64)).to(dtype)
    y = torch.randint(0, k, (n, *spatial), generator=g)
    flat = y.view(-1)
    flat[1] = flat[-1] = ignore
    return z, y


# (name, the torchcal function, the reference), each with its keyword options
CASES = [
    ("mbls", lambda z, y, **kw: F.logit_margin_l1_loss(z, y, **kw), R.mbls, {}),
    ("mbls-m3-drop", lambda z, y, **kw: F.logit_margin_l1_loss(z, y, 3.0, 0.5, ignored_rows="drop", **kw),
     lambda z, y, **kw: R.mbls(z, y, 3.0, 0.5, ignored_rows="drop", **kw), {}),
    ("mbls-255", lambda z, y, **kw: F.logit_margin_l1_loss(z, y, 3.0, **kw),
     lambda z, y, **kw: R.mbls(z, y, 3.0, **kw), {"ignore_index": 255}),
    ("acls", lambda z, y, **kw: F.acls_loss(z, y, **kw), R.acls, {}),
    ("acls-m3-drop", lambda z, y, **kw: F.acls_loss(z, y, 0.5, 3.0, lambda_neg=0.3, ignored_rows="drop", **kw),
     lambda z, y, **kw: R.acls(z, y, 0.5, 3.0, lambda_neg=0.3, ignored_rows="drop", **kw), {}),
    ("acls-255", lambda z, y, **kw: F.acls_loss(z, y, margin=3.0, **kw),
     lambda z, y, **kw: R.acls(z, y, margin=3.0, **kw), {"ignore_index": 255}),
    ("poly1", lambda z, y, **kw: F.poly1_cross_entropy(z, y, **kw), R.poly1, {}),
    ("poly1-neg", lambda z, y, **kw: F.poly1_cross_entropy(z, y, -0.5, **kw),
     lambda z, y, **kw: R.poly1(z, y, -0.5, **kw), {}),
    ("cp", lambda z, y, **kw: F.confidence_penalty_loss(z, y, **kw), R.confidence_penalty, {}),
    ("cp-exact", lambda z, y, **kw: F.confidence_penalty_loss(z, y, 0.3, eps=0.0, **kw),
     lambda z, y, **kw: R.confidence_penalty(z, y, 0.3, eps=0.0, **kw), {}),
    ("cp-mbls", lambda z, y, **kw: F.confidence_penalty_loss(z, y, 0.1, form="mbls", **kw),
     lambda z, y, **kw: R.confidence_penalty(z, y, 0.1, form="mbls", **kw), {}),
    ("maxsup", lambda z, y, **kw: F.maxsup_loss(z, y, **kw), R.maxsup, {}),
    ("maxsup-0.2", lambda z, y, **kw: F.maxsup_loss(z, y, 0.2, **kw),
     lambda z, y, **kw: R.maxsup(z, y, 0.2, **kw), {}),
    ("mdca", lambda z, y, **kw: F.mdca_loss(z, y, **kw), R.mdca, {}),
    ("focal-mdca", lambda z, y, **kw: F.mdca_loss(z, y, 2.0, base="focal", **kw),
     lambda z, y, **kw: R.mdca(z, y, 2.0, base="focal", **kw), {}),
    ("ls-mdca", lambda z, y, **kw: F.mdca_loss(z, y, base="ls", smoothing=0.2, **kw),
     lambda z, y, **kw: R.mdca(z, y, base="ls", smoothing=0.2, **kw), {}),
    ("dca", lambda z, y, **kw: F.dca_loss(z, y, **kw), R.dca, {}),
    ("sb-ece", lambda z, y, **kw: F.sbece_loss(z, y, **kw), R.sbece, {}),
    ("sb-ece-binned", lambda z, y, **kw: F.sbece_loss(z, y, 1.0, n_bins=5, temperature=0.05, form="binned", **kw),
     lambda z, y, **kw: R.sbece(z, y, 1.0, n_bins=5, temperature=0.05, form="binned", **kw), {}),
    ("dca-weighted", lambda z, y, **kw: F.dca_loss(z, y, 3.0, weight=torch.tensor([0.5, 1.0, 2.0, 1.5],
     dtype=torch.float64), **kw), lambda z, y, **kw: R.dca(z, y, 3.0, weight=[0.5, 1.0, 2.0, 1.5], **kw), {}),
    ("avuc", lambda z, y, **kw: F.avuc_loss(z, y, **kw), R.avuc, {}),
    ("avuc-th", lambda z, y, **kw: F.avuc_loss(z, y, 1.5, threshold=0.05, **kw),
     lambda z, y, **kw: R.avuc(z, y, 1.5, threshold=0.05, **kw), {}),
    ("s-avuc", lambda z, y, **kw: F.soft_avuc_loss(z, y, temperature=0.1, kappa=0.5, **kw), R.soft_avuc, {}),
    ("s-avuc-2", lambda z, y, **kw: F.soft_avuc_loss(z, y, 2.0, temperature=0.5, kappa=0.2, **kw),
     lambda z, y, **kw: R.soft_avuc(z, y, 2.0, temperature=0.5, kappa=0.2, **kw), {}),
    ("esd", lambda z, y, **kw: F.esd_loss(z, y, **kw), R.esd, {}),
    ("esd-holdout", lambda z, y, **kw: F.esd_loss(z, y, 2.0, holdout=0.34, **kw),
     lambda z, y, **kw: R.esd(z, y, 2.0, holdout=0.34, **kw), {}),
    ("ml1ace-hard", lambda z, y, **kw: F.ml1ace_loss(z, y, **kw), R.ml1ace, {}),
    ("ml1ace-soft", lambda z, y, **kw: F.ml1ace_loss(z, y, 0.5, binning="soft", n_bins=6, **kw),
     lambda z, y, **kw: R.ml1ace(z, y, 0.5, binning="soft", n_bins=6, **kw), {}),
    ("ml1ace-soft-nobg", lambda z, y, **kw: F.ml1ace_loss(z, y, binning="soft", n_bins=3, include_background=False,
     ignore_empty_classes=False, per_image=False, **kw), lambda z, y, **kw: R.ml1ace(z, y, binning="soft",
     n_bins=3, include_background=False, ignore_empty_classes=False, per_image=False, **kw), {}),
    ("cals", lambda z, y, **kw: F.cals_loss(z, y, CALS_LAMBDA, CALS_RHO, 3.0, **kw),
     lambda z, y, **kw: R.cals(z, y, CALS_LAMBDA, CALS_RHO, 3.0, **kw), {}),
    ("cals-drop-raw", lambda z, y, **kw: F.cals_loss(z, y, CALS_LAMBDA, CALS_RHO, 5.0, normalize=False,
     ignored_rows="drop", **kw), lambda z, y, **kw: R.cals(z, y, CALS_LAMBDA, CALS_RHO, 5.0, normalize=False,
     ignored_rows="drop", **kw), {}),
]  # fmt: skip
IDS = [c[0] for c in CASES]
# ACLS's negative term detaches the max logit (released code), so its gradient is not the derivative of its
# value wherever that term is active, and gradcheck's finite differences cannot agree; the loop reference's
# gradients (same detach) check it above. gradcheck covers ACLS's positive term alone, a true gradient.
GRADCHECK_CASES = [c for c in CASES if not c[0].startswith("acls")] + [
    ("acls-positive", lambda z, y, **kw: F.acls_loss(z, y, 1.0, 3.0, lambda_neg=0.0, **kw), None, {})
]


@pytest.mark.parametrize("name,fast,ref,options", CASES, ids=IDS)
@pytest.mark.parametrize("shape", [(9,), (2, 3, 2)], ids=["NK", "NKHW"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_value_and_gradient_match_the_float64_loop_reference(name, fast, ref, options, shape, reduction):
    ignore = options.get("ignore_index", -100)
    z, y = batch(shape, ignore=ignore)
    za, zb = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    got = fast(za, y, reduction=reduction, **options)
    want = ref(zb, y, reduction=reduction, **options)
    # float64 on both sides; the loops sum in another order than the vectorised code, a few ulps per term
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    upstream = torch.linspace(0.5, 1.5, got.numel(), dtype=torch.float64).reshape(got.shape)
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    torch.testing.assert_close(za.grad, zb.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name,fast,ref,options", GRADCHECK_CASES, ids=[c[0] for c in GRADCHECK_CASES])
@pytest.mark.parametrize("shape", [(5,), (2, 2, 2)], ids=["NK", "NKHW"])
def test_gradcheck(name, fast, ref, options, shape):
    # scale 4: no logit distance within gradcheck's step of the margin, where the hinge has a kink
    z, y = batch(shape, seed=3, scale=4.0, ignore=options.get("ignore_index", -100))
    for reduction in ("mean", "none"):
        assert torch.autograd.gradcheck(
            lambda x, r=reduction: fast(x, y, reduction=r, **options), (z.clone().requires_grad_(True),)
        )


def test_soft_targets_enter_the_cross_entropy_term():
    """Class probabilities: the CE term is −Σ q log p (Poly-1: Σ q_k(−log p_k + ε(1 − p_k))); the margin
    penalties do not depend on the target, MDCA's label frequencies become mean_i q_ik and mL1-ACE's bins
    average q_ik in place of the one-hot labels."""
    g = torch.Generator().manual_seed(5)
    z = 6 * torch.randn(6, K, 3, generator=g, dtype=torch.float64)
    q = torch.softmax(torch.randn(6, K, 3, generator=g, dtype=torch.float64), 1)
    pairs = [
        (F.logit_margin_l1_loss(z, q, 3.0, reduction="none"), R.mbls(z, q, 3.0, reduction="none")),
        (F.poly1_cross_entropy(z, q, 2.0, label_smoothing=0.1), R.poly1(z, q, 2.0, label_smoothing=0.1)),
        (F.confidence_penalty_loss(z, q), R.confidence_penalty(z, q)),
        (F.maxsup_loss(z, q, reduction="sum"), R.maxsup(z, q, reduction="sum")),
        (F.mdca_loss(z, q, reduction="none"), R.mdca(z, q, reduction="none")),
        (F.mdca_loss(z, q, base="focal", gamma=2.0), R.mdca(z, q, base="focal", gamma=2.0)),
        (F.acls_loss(z, q, margin=3.0, reduction="none"), R.acls(z, q, margin=3.0, reduction="none")),
        (F.cals_loss(z, q, CALS_LAMBDA, CALS_RHO, 3.0), R.cals(z, q, CALS_LAMBDA, CALS_RHO, 3.0)),
        (F.ml1ace_loss(z, q, n_bins=4, reduction="none"), R.ml1ace(z, q, n_bins=4, reduction="none")),
        (F.ml1ace_loss(z, q, binning="soft", n_bins=4), R.ml1ace(z, q, binning="soft", n_bins=4)),
    ]
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_losses_that_need_labels_refuse_soft_targets():
    z, _ = batch()
    q = torch.full((7, K), 1 / K, dtype=torch.float64)
    with pytest.raises(TypeError, match="not accepted: DCA compares the confidence with the accuracy"):
        F.dca_loss(z, q)
    with pytest.raises(TypeError, match="not accepted: the MDCA repository's label smoothing"):
        create("ls-mdca")(z, q)


def test_sbece_vanishes_on_a_calibrated_batch_and_its_sqrt_has_a_finite_gradient():
    """Every confidence 0.5 with half the positions correct: each bin's accuracy is 0.5 = r, SB-ECE = 0,
    and the sqrt at 0 gives the gradient of cross entropy alone (no NaN)."""
    z = torch.tensor([[0.0, 0.0, -50.0]] * 4, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 0, 1, 1])  # the arg-max is class 0 (first of the tie): two right, two wrong
    assert F.sbece_penalty(z, y).item() == pytest.approx(0.0, abs=1e-15)
    F.sbece_loss(z, y).backward()
    (ce_grad,) = torch.autograd.grad(nnf.cross_entropy(z, y), z)
    torch.testing.assert_close(z.grad, ce_grad, rtol=1e-12, atol=1e-15)
    with pytest.raises(TypeError, match="not accepted: SB-ECE compares"):
        F.sbece_loss(z.detach(), torch.full((4, 3), 1 / 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="`temperature` must be > 0"):
        create("sb-ece", temperature=0.0)


def test_dca_weights_its_cross_entropy_as_the_official_function():
    """The official cross_entropy_with_dca_loss passes its weights to F.cross_entropy: a weighted CE mean
    plus β·abs(mean r − mean a), the batch term unweighted."""
    z, y = batch((10,))
    w = torch.tensor([0.5, 1.0, 2.0, 1.5], dtype=torch.float64)
    p = torch.softmax(z, 1)
    keep = y != -100
    conf, pred = p.max(1)
    term = (conf[keep].mean() - (pred == y)[keep].double().mean()).abs()
    want = nnf.cross_entropy(z, y, w) + 10 * term
    torch.testing.assert_close(F.dca_loss(z, y, weight=w), want, rtol=1e-12, atol=0)
    torch.testing.assert_close(create("dca", weight=w)(z, y), want, rtol=1e-12, atol=0)


def test_mdca_compares_class_means_with_label_frequencies():
    """Hand-computed: p = (0.8808, 0.1192) and (0.2689, 0.7311) against labels (0, 0): both classes are
    0.4251 away from the frequencies (1, 0); against (0, 1): 0.0749 each."""
    z = torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    p = torch.softmax(z, 1)
    assert F.mdca_penalty(z, torch.tensor([0, 0])).item() == pytest.approx(
        1 - p[:, 0].mean().item(), rel=1e-14
    )
    assert F.mdca_penalty(z, torch.tensor([0, 1])).item() == pytest.approx(
        abs(p[:, 0].mean().item() - 0.5), rel=1e-13
    )
    # the repository's LS base: 1 − α on the label, α/(K − 1) on each other class (not PyTorch's α/K)
    z3 = torch.tensor([[1.0, 0.0, -1.0]], dtype=torch.float64)
    logp = torch.log_softmax(z3, 1)[0]
    want = -(0.9 * logp[0] + 0.05 * logp[1] + 0.05 * logp[2])
    got = F.mdca_loss(z3, torch.tensor([0]), 0.0, base="ls")
    assert got.item() == pytest.approx(want.item(), rel=1e-14)
    assert got.item() != pytest.approx(nnf.cross_entropy(z3, torch.tensor([0]), label_smoothing=0.1).item())


# ----------------------------------------------------------------------------- MbLS


def test_mbls_hand_computed_and_the_arg_max_entry_counts():
    """z = (12, 0, 1), m = 10: distances (0, 12, 11) give hinges (0, 2, 1), averaged over all K = 3 entries
    (the arg-max entry's 0 included): α·3/3."""
    z = torch.tensor([[12.0, 0.0, 1.0]], dtype=torch.float64)
    ce = nnf.cross_entropy(z, torch.tensor([0]))
    got = F.logit_margin_l1_loss(z, torch.tensor([0]))
    assert got.item() == pytest.approx(ce.item() + 0.1 * 3 / 3, rel=1e-14)
    # no distance above the margin: cross entropy
    z = torch.tensor([[3.0, 0.0, -5.0]], dtype=torch.float64)
    assert (
        F.logit_margin_l1_loss(z, torch.tensor([2])).item() == nnf.cross_entropy(z, torch.tensor([2])).item()
    )


def test_mbls_gradient_reaches_the_max_logit():
    """The max is not detached (released code): the hinge's gradient is +α/(NK) on the max logit per active
    entry and −α/(NK) on each active entry."""
    z = torch.tensor([[20.0, 0.0, 15.0]], dtype=torch.float64, requires_grad=True)
    F.logit_margin_l1_loss(z, torch.tensor([0]), alpha=1.0).backward()
    p = torch.softmax(z.detach(), 1)[0]
    ce_grad = p - torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    hinge = torch.tensor([1 / 3, -1 / 3, 0.0], dtype=torch.float64)  # only class 1 is 20 > 10 away
    torch.testing.assert_close(z.grad[0], ce_grad + hinge, rtol=1e-12, atol=1e-15)


def test_mbls_ignored_rows_follow_the_released_code():
    """ignore_index < 0 (the default −100): CE leaves the ignored rows out but the margin term's mean covers
    every row; ignore_index >= 0 (255) or ignored_rows="drop": both terms leave them out."""
    z = torch.tensor([[12.0, 0.0, 1.0], [0.0, 30.0, 0.0], [1.0, 2.0, 0.0]], dtype=torch.float64)
    ce = nnf.cross_entropy(z, torch.tensor([0, 1, 1]), reduction="none")
    hinge = torch.tensor([3 / 3, 40 / 3, 0.0], dtype=torch.float64)
    y = torch.tensor([0, -100, 1])
    want = (ce[0] + ce[2]) / 2 + 0.1 * hinge.mean()
    assert F.logit_margin_l1_loss(z, y).item() == pytest.approx(want.item(), rel=1e-14)
    none = F.logit_margin_l1_loss(z, y, reduction="none")
    torch.testing.assert_close(none, torch.stack([ce[0] + 0.1, 0.1 * hinge[1], ce[2]]), rtol=1e-14, atol=0)
    dropped = (ce[0] + ce[2] + 0.1 * (hinge[0] + hinge[2])) / 2
    assert F.logit_margin_l1_loss(z, y, ignored_rows="drop").item() == pytest.approx(
        dropped.item(), rel=1e-14
    )
    y255 = torch.tensor([0, 255, 1])
    assert F.logit_margin_l1_loss(z, y255, ignore_index=255).item() == pytest.approx(
        dropped.item(), rel=1e-14
    )
    every = torch.full((3,), -100)
    assert torch.isnan(F.logit_margin_l1_loss(z, every, ignored_rows="drop"))


def test_mbls_alpha_schedule_is_the_released_codes():
    """α after the end-of-epoch updates of epochs 0 … e − 1, each capped at max_alpha."""
    assert F.mbls_alpha(0.1, 0, "add", mu=0.5) == 0.1
    assert [F.mbls_alpha(0.1, e, "add", mu=0.5, max_alpha=1.0) for e in range(4)] == [0.1, 0.6, 1.0, 1.0]
    assert [F.mbls_alpha(0.1, e, "multiply", mu=2.0) for e in range(4)] == [0.1, 0.2, 0.4, 0.8]
    # "step" multiplies at the end of epochs 2, 5, ... ((e + 1) % 3 == 0)
    steps = [F.mbls_alpha(1.0, e, "step", mu=10.0, step_size=3) for e in range(7)]
    assert steps == [1, 1, 1, 10, 10, 10, 100]
    assert F.mbls_alpha(0.1, 500, "") == 0.1  # the paper's setting
    assert F.mbls_alpha(0.1, 3, "multiply") == 0.0  # μ = 0, the code's default, zeroes α
    with pytest.raises(ValueError, match="`schedule` must be one of"):
        F.mbls_alpha(0.1, 1, "cosine")
    with pytest.raises(ValueError, match="`step_size` must be >= 1"):
        F.mbls_alpha(0.1, 1, "step", step_size=0)


def test_mbls_module_schedule_and_checkpoint():
    z, y = batch()
    loss_fn = LogitMarginL1Loss(margin=3.0, schedule="add", mu=0.2)
    loss_fn.set_epoch(2)
    assert loss_fn.current_alpha == pytest.approx(0.5)
    torch.testing.assert_close(loss_fn(z, y), F.logit_margin_l1_loss(z, y, 3.0, 0.5))
    restored = LogitMarginL1Loss(margin=3.0, schedule="add", mu=0.2)
    restored.load_state_dict(loss_fn.state_dict())
    assert restored.epoch == 2 and restored.current_alpha == loss_fn.current_alpha


def test_acls_hand_computed_ties_and_detached_max():
    """z = (12, 0, −1), m = 10: positive 1·(12 − 10)², negative 0.1·((12 − 0 − 10)² + (12 + 1 − 10)²)/2;
    the negative term's max is detached (only the other logits get its gradient), the positive keeps it."""
    z = torch.tensor([[12.0, 0.0, -1.0]], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0])
    loss = F.acls_loss(z, y, alpha=1.0)
    ce = nnf.cross_entropy(z.detach(), y)
    assert loss.item() == pytest.approx(ce.item() + 4.0 + 0.1 * (4 + 9) / 2, rel=1e-14)
    loss.backward()
    ce_grad = torch.softmax(z.detach(), 1)[0] - torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    reg = torch.tensor([2 * 2.0, -0.1 * 2 * 2.0 / 2, -0.1 * 2 * 3.0 / 2], dtype=torch.float64)
    torch.testing.assert_close(z.grad[0], ce_grad + reg, rtol=1e-12, atol=1e-15)
    # tied maxima are each positive, the divisor stays N: 2·(11 − 10)²
    tied = torch.tensor([[11.0, 11.0, 0.0]], dtype=torch.float64)
    reg = F.acls_loss(tied, y, alpha=1.0, lambda_neg=0.0) - nnf.cross_entropy(tied, y)
    assert reg.item() == pytest.approx(2.0, rel=1e-12)


# ----------------------------------------------------------------------------- Poly-1, CP, MaxSup


def test_poly1_with_epsilon_zero_is_cross_entropy_and_hand_value():
    z, y = batch()
    w = torch.tensor([0.5, 1.0, 2.0, 1.5], dtype=torch.float64)
    for eps in (0.0, 0.1):
        want = nnf.cross_entropy(z, y, w, label_smoothing=eps)
        torch.testing.assert_close(F.poly1_cross_entropy(z, y, 0.0, weight=w, label_smoothing=eps), want)
    z = torch.tensor([[2.0, 0.0]], dtype=torch.float64)
    p = 1 / (1 + math.exp(-2))
    assert F.poly1_cross_entropy(z, torch.tensor([0])).item() == pytest.approx(
        -math.log(p) + 1 - p, rel=1e-14
    )


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_poly1_weights_and_smoothing_match_the_reference(reduction, smoothing):
    """Σ_k w_k q_k(−log p_k + ε(1 − p_k)) over the smoothed labels (1 − α)·onehot + α/K, not 1 − p_y."""
    z, y = batch((3, 2, 2))
    w = torch.tensor([0.5, 1.0, 2.0, 1.5], dtype=torch.float64)
    za, zb = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    got = F.poly1_cross_entropy(za, y, 2.0, weight=w, label_smoothing=smoothing, reduction=reduction)
    want = R.poly1(zb, y, 2.0, weight=w, label_smoothing=smoothing, reduction=reduction)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(za.grad, zb.grad, rtol=1e-10, atol=1e-12)


def test_confidence_penalty_is_zero_at_the_uniform_distribution():
    """log K − H(p) vanishes at the uniform p (up to the 1e-6 inside the log of torch-uncertainty's code)."""
    z = torch.zeros(2, 5, dtype=torch.float64)
    y = torch.tensor([0, 3])
    ce = math.log(5)
    assert F.confidence_penalty_loss(z, y, eps=0.0).item() == pytest.approx(ce, rel=1e-14)
    # Σ_k (1/5) log(1/5 + 1e-6) − log(1/5) = log(1 + 5e-6)
    assert F.confidence_penalty_loss(z, y).item() == pytest.approx(ce + math.log1p(5e-6), rel=1e-13)


def test_maxsup_is_label_smoothing_with_the_top_logit():
    """LS-CE = CE + α(z_y − mean_k z): where the label is the arg-max, MaxSup with α equals cross entropy with
    label_smoothing α; elsewhere MaxSup penalises the top logit instead of the label's."""
    z, _ = batch(ignore=0)
    top = z.argmax(1)
    for alpha in (0.1, 0.3):
        torch.testing.assert_close(
            F.maxsup_loss(z, top, alpha), nnf.cross_entropy(z, top, label_smoothing=alpha), rtol=1e-12, atol=0
        )
    y = (top + 1) % K
    diff = F.maxsup_loss(z, y, 0.1, reduction="none") - nnf.cross_entropy(z, y, reduction="none")
    torch.testing.assert_close(diff, 0.1 * (z.amax(1) - z.mean(1)), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("cpp", [False, True])
def test_maxsup_rows_of_huge_equal_logits(cpp):
    """A float32 row of equal logits near the largest float: its float32 sum overflows, a float64 one (the
    operator's, and the torch path's mean) does not. The penalty is 0 and the loss log K, on both paths."""
    z = torch.full((2, 4), 3e38, requires_grad=True)
    with F.use_cpu_extension(cpp):
        loss = F.maxsup_loss(z, torch.tensor([0, 3]), 0.2)
        loss.backward()
    assert loss.item() == pytest.approx(math.log(4), rel=1e-6)
    assert torch.isfinite(z.grad).all()
    # CE's gradient (1/4 − y)/2 plus α/2·(1/4 − [k = the max's index]) on each row: its entries sum to 0
    torch.testing.assert_close(z.grad.sum(1), torch.zeros(2), rtol=0, atol=1e-7)
    # a row whose spread exceeds the largest float: max − z would overflow, max − mean(z) = 3e38 does not;
    # the label is the max, so CE is 0 and the loss α·3e38
    spread = torch.tensor([[3e38, -3e38, 0.0, 0.0]])
    with F.use_cpu_extension(cpp):
        value = F.maxsup_loss(spread, torch.tensor([0]), 0.2)
    assert value.item() == pytest.approx(0.2 * 3e38, rel=1e-6)


def test_maxsup_ramp():
    """α_t = 0.1 + 0.1·t/(E − 1) (the official ResNet train.py); constant before the epoch count is known
    and with alpha_end=None."""
    loss_fn = MaxSupLoss()
    assert loss_fn.current_alpha == 0.1
    loss_fn.set_total_epochs(5)
    alphas = []
    for t in range(5):
        loss_fn.set_epoch(t)
        alphas.append(loss_fn.current_alpha)
    assert alphas == pytest.approx([0.1, 0.125, 0.15, 0.175, 0.2], abs=1e-15)
    restored = MaxSupLoss()
    restored.load_state_dict(loss_fn.state_dict())
    assert restored.current_alpha == pytest.approx(0.2)
    const = MaxSupLoss(0.3, alpha_end=None, epochs=10)
    const.set_epoch(9)
    assert const.current_alpha == 0.3
    z, y = batch()
    torch.testing.assert_close(loss_fn(z, y), F.maxsup_loss(z, y, 0.2))


# ----------------------------------------------------------------------------- contract


def test_batch_terms_refuse_what_they_do_not_define():
    z, y = batch()
    with pytest.raises(ValueError, match=r"^`weight` is not accepted: MDCA's penalty is a statistic"):
        create("mdca", weight=torch.ones(K))
    with pytest.raises(ValueError, match=r"^`label_smoothing` is not accepted: MDCA's penalty"):
        F.mdca_loss(z, y, label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"^`label_smoothing` is not accepted: DCA compares"):
        create("dca", label_smoothing=0.1)
    with pytest.raises(ValueError, match="`base` must be one of"):
        F.mdca_loss(z, y, base="brier")


@pytest.mark.parametrize("name", ["mbls", "acls", "confidence-penalty", "maxsup"])
def test_penalties_refuse_weights_and_smoothing_in_one_sentence(name):
    z, y = batch()
    with pytest.raises(ValueError, match=r"^`weight` is not accepted: the [^.]+ term does not depend"):
        create(name, weight=torch.ones(K))
    with pytest.raises(ValueError, match=r"^`label_smoothing` is not accepted: the [^.]+$"):
        create(name, label_smoothing=0.1)
    fn = {"mbls": F.logit_margin_l1_loss, "acls": F.acls_loss, "confidence-penalty": F.confidence_penalty_loss,
          "maxsup": F.maxsup_loss}[name]  # fmt: skip
    with pytest.raises(ValueError, match="`weight` is not accepted"):
        fn(z, y, weight=torch.ones(K, dtype=torch.float64))


def test_bad_arguments_are_named():
    z, y = batch()
    with pytest.raises(ValueError, match="`margin` must be >= 0"):
        F.logit_margin_l1_loss(z, y, margin=-1.0)
    with pytest.raises(ValueError, match="`ignored_rows` must be one of"):
        F.logit_margin_l1_loss(z, y, ignored_rows="all")
    with pytest.raises(ValueError, match="`epsilon` must be >= -1"):
        F.poly1_cross_entropy(z, y, -2.0)
    with pytest.raises(ValueError, match="`form` must be one of"):
        ConfidencePenaltyLoss(form="paper")
    with pytest.raises(ValueError, match="`beta` must be >= 0"):
        F.confidence_penalty_loss(z, y, -1.0)
    with pytest.raises(ValueError, match="`alpha` must be >= 0"):
        F.maxsup_loss(z, y, -0.1)
    with pytest.raises(ValueError, match=r"`targets` must have shape \(9,\)"):
        F.maxsup_loss(torch.zeros(9, K), y)
    # CALS's statistics check the multipliers as the loss does: missing ones, and a (1,) tensor that would
    # broadcast over the classes
    with pytest.raises(ValueError, match="`lambdas` and `rhos` must be given"):
        F.cals_statistics(z)
    with pytest.raises(ValueError, match=r"`lambdas` and `rhos` must have shape \(4,\)"):
        F.cals_statistics(z, None, torch.ones(1), torch.ones(K))


BATCH_TERMS = {
    "mdca": lambda z, y, **kw: F.mdca_loss(z, y, **kw),
    "focal-mdca": lambda z, y, **kw: F.mdca_loss(z, y, base="focal", **kw),
    "ls-mdca": lambda z, y, **kw: F.mdca_loss(z, y, base="ls", **kw),
    "dca": lambda z, y, **kw: F.dca_loss(z, y, **kw),
    "sb-ece": lambda z, y, **kw: F.sbece_loss(z, y, **kw),
    "sb-ece-binned": lambda z, y, **kw: F.sbece_loss(z, y, form="binned", **kw),
    "avuc": lambda z, y, **kw: F.avuc_loss(z, y, **kw),
    "s-avuc": lambda z, y, **kw: F.soft_avuc_loss(z, y, temperature=0.1, kappa=0.5, **kw),
    "esd": lambda z, y, **kw: F.esd_loss(z, y, **kw),
}


@pytest.mark.parametrize("name", sorted(BATCH_TERMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(5,), (2, 3, 2)], ids=["NK", "NKHW"])
@pytest.mark.parametrize("cpp", [True, False], ids=["cpp", "torch"])
def test_a_batch_with_every_label_ignored_has_the_zero_gradient_of_cross_entropy(name, dtype, shape, cpp):
    """No kept position: "sum" and "none" are 0, "mean" NaN (the reduction's convention), each with the
    gradient of ``F.cross_entropy`` on the same batch, exactly zero: a 0/0 in the batch statistics would put
    NaN into every row's gradient, also where the reductions mask the term (a silent NaN update under "sum",
    or one spread by DDP's gradient averaging from a rank whose crop is all void)."""
    z, _ = batch(shape, K, dtype=dtype)
    y = torch.full((shape[0], *shape[1:]), -100)
    for reduction in ("mean", "sum", "none"):
        zz = z.clone().requires_grad_(True)
        with F.use_cpu_extension(cpp):
            out = BATCH_TERMS[name](zz, y, reduction=reduction)
        want = nnf.cross_entropy(z, y, reduction=reduction)  # NaN, 0 or zeros, as the value must be
        torch.testing.assert_close(out.detach(), want, equal_nan=True, rtol=0, atol=0)
        out.sum().backward()
        assert zz.grad is not None and torch.equal(zz.grad, torch.zeros_like(z)), (reduction, zz.grad)


@pytest.mark.parametrize(
    "name",
    ["mbls", "acls", "poly1", "confidence-penalty", "maxsup", "mdca", "focal-mdca", "ls-mdca", "dca", "sb-ece",
     "avuc", "s-avuc", "esd", "hl1-ace", "sl1-ace", "cals"],
)  # fmt: skip
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_dense_autocast_is_finite_and_float32(name, autocast_dtype):
    """A segmentation-shaped batch under CPU autocast: computed in float32, finite loss and gradients."""
    g = torch.Generator().manual_seed(1)
    conv = torch.nn.Conv2d(3, K, 1)
    x = 20 * torch.randn(2, 3, 5, 5, generator=g)
    y = torch.randint(0, K, (2, 5, 5), generator=g)
    y[0, 0, 0] = -100
    with torch.autocast("cpu", dtype=autocast_dtype):
        loss = create(name)(conv(x), y)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in conv.parameters())


@pytest.mark.parametrize("name", ["binary-hl1-ace", "binary-sl1-ace"])
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_multilabel_ace_autocast_is_finite_and_float32(name, autocast_dtype):
    """The sigmoid mL1-ACE on a segmentation-shaped batch of 0/1 label maps under CPU autocast."""
    g = torch.Generator().manual_seed(1)
    conv = torch.nn.Conv2d(3, K, 1)
    x = 20 * torch.randn(2, 3, 5, 5, generator=g)
    t = (torch.rand(2, K, 5, 5, generator=g) < 0.3).float()
    with torch.autocast("cpu", dtype=autocast_dtype):
        loss = create(name)(conv(x), t)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in conv.parameters())


def test_registry_names_and_modules_equal_functions():
    z, y = batch((3, 2, 2))
    pairs = [
        (create("mbls"), F.logit_margin_l1_loss(z, y)),
        (create("acls", margin=3.0), F.acls_loss(z, y, margin=3.0)),
        (create("poly1", epsilon=2.0), F.poly1_cross_entropy(z, y, 2.0)),
        (Poly1CrossEntropyLoss(weight=torch.ones(K, dtype=torch.float64)), F.poly1_cross_entropy(z, y)),
        (create("confidence-penalty", form="mbls", beta=0.1), F.confidence_penalty_loss(z, y, 0.1, form="mbls")),
        (create("maxsup"), F.maxsup_loss(z, y)),
        (create("mdca"), F.mdca_loss(z, y)),
        (create("focal-mdca"), F.mdca_loss(z, y, base="focal")),
        (create("ls-mdca", smoothing=0.2), F.mdca_loss(z, y, base="ls", smoothing=0.2)),
        (create("dca", beta=25.0), F.dca_loss(z, y, 25.0)),
        (create("sb-ece", form="binned"), F.sbece_loss(z, y, form="binned")),
        (create("avuc", threshold=0.3), F.avuc_loss(z, y, threshold=0.3)),
        (create("s-avuc", temperature=0.2, kappa=0.3), F.soft_avuc_loss(z, y, temperature=0.2, kappa=0.3)),
        (create("esd", holdout=0.5), F.esd_loss(z, y, holdout=0.5)),
        (create("hl1-ace", n_bins=5), F.ml1ace_loss(z, y, n_bins=5)),
        (create("sl1-ace", include_background=False), F.ml1ace_loss(z, y, binning="soft", include_background=False)),
        # the module's float64 buffers: λ_min = 1e-6 as a float32 literal would round to another number
        (create("cals", margin=3.0),
         F.cals_loss(z, y, torch.full((K,), 1e-6, dtype=torch.float64), torch.ones(K, dtype=torch.float64), 3.0)),
    ]  # fmt: skip
    for module, want in pairs:
        torch.testing.assert_close(module(z, y), want, rtol=0, atol=0)
    with pytest.raises(
        ValueError, match="loss 'ls-mdca' is MDCALoss with base = ls, so base cannot be passed"
    ):
        create("ls-mdca", base="nll")
    assert repr(create("mbls", ignore_index=255)) == (
        "LogitMarginL1Loss(margin=10.0, alpha=0.1, schedule='', reduction='mean', ignore_index=255)"
    )


@pytest.mark.compile
def test_scheduled_alpha_compiles_without_a_graph_break():
    """A schedule changes α every epoch; torch.compile then recompiles with α as a symbolic float, which the
    losses take without checking values while tracing (fullgraph=True raises on any break)."""
    torch._dynamo.reset()
    z, y = batch()
    for loss_fn in (MaxSupLoss(epochs=3), LogitMarginL1Loss(margin=3.0, schedule="add", mu=0.05)):
        compiled = torch.compile(lambda a, b, f=loss_fn: f(a, b), fullgraph=True, backend="aot_eager")
        for epoch in range(3):
            loss_fn.set_epoch(epoch)
            # the same float64 ATen kernels eager and compiled; AOTAutograd may reassociate a few sums
            torch.testing.assert_close(compiled(z, y), loss_fn(z, y), rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------- AvUC, S-AvUC, ESD, mL1-ACE


def test_avuc_hand_computed():
    """Two positions, u_th = 0.5: a correct confident one (H = 0.1407 <= u_th, certain) and a wrong
    uncertain one (H = 0.6931, uniform): n_AC = 0.9526(1 − tanh 0.1407), n_IU = 0.5·tanh 0.6931, no AU or
    IC, so AvU = 1 and AvUC = −log(1 + 1e-10) ≈ 0."""
    z = torch.tensor([[3.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    assert abs(float(F.avuc_penalty(z, torch.tensor([0, 1]), threshold=0.5))) < 1e-9
    # the same two positions with u_th = 0.05: the first is uncertain now (n_AU), AvU = n_IU/(n_AU + n_IU)
    p = torch.softmax(z, 1)
    h = -(p * torch.log(p + 1e-10)).sum(1)
    n_au, n_iu = p[0, 0] * torch.tanh(h[0]), 0.5 * torch.tanh(h[1])
    want = -torch.log(n_iu / (n_au + n_iu + 1e-10) + 1e-10)
    torch.testing.assert_close(F.avuc_penalty(z, torch.tensor([0, 1]), threshold=0.05), want)


def test_soft_avuc_is_small_when_uncertainty_matches_errors():
    """Confident correct positions and uniform wrong ones: q ≈ 0 on the first, ≈ 1 on the others, so
    n_AU + n_IC ≈ 0 and S-AvUC ≈ 0; swapping which ones are correct makes it large."""
    z = torch.tensor([[9.0, 0.0, 0.0]] * 3 + [[0.0, 0.0, 0.0]] * 3, dtype=torch.float64)
    good = F.soft_avuc_penalty(z, torch.tensor([0, 0, 0, 1, 1, 2]), temperature=0.05, kappa=0.5)
    bad = F.soft_avuc_penalty(z, torch.tensor([1, 1, 2, 0, 0, 0]), temperature=0.05, kappa=0.5)
    assert float(good) < 1e-6 and float(bad) > 1.0


def test_esd_is_the_pairwise_u_statistic_and_its_sqrt_is_safe():
    """ESD against the matrix form Σ_{j≠k; j,k≠i} x_ij x_ik / ((n − 1)(n − 2)) averaged over i, with ties in
    the confidences; a negative ESD gives CE's gradient alone (relu before the sqrt, no NaN)."""
    g = torch.Generator().manual_seed(2)
    z = 2 * torch.randn(10, 3, generator=g, dtype=torch.float64)
    z[4] = z[7]  # a tie: r_4 = r_7, each counts the other
    y = torch.randint(0, 3, (10,), generator=g)
    p = torch.softmax(z, 1)
    r, pred = p.max(1)
    x = (pred == y).double() - r
    n = 10
    total = 0.0
    for i in range(n):
        xi = [float(x[j]) if float(r[j]) <= float(r[i]) else 0.0 for j in range(n) if j != i]
        pairs = sum(a * b for ja, a in enumerate(xi) for jb, b in enumerate(xi) if ja != jb)
        total += pairs / ((n - 1) * (n - 2))
    assert abs(float(F.esd_penalty(z, y)) - total / n) < 1e-14
    zz = torch.tensor(
        [[3.0, 0.0], [0.0, 0.2], [2.0, 0.0], [0.5, 0.0]], dtype=torch.float64, requires_grad=True
    )
    yy = torch.tensor([0, 1, 1, 1])
    assert float(F.esd_penalty(zz, yy).detach()) < 0
    (grad,) = torch.autograd.grad(F.esd_loss(zz, yy), zz)
    (ce,) = torch.autograd.grad(torch.nn.functional.cross_entropy(zz, yy), zz)
    torch.testing.assert_close(grad, ce)
    assert float(F.esd_penalty(zz[:2], yy[:2]).detach()) == 0.0  # fewer than 3 positions


def test_esd_holdout_is_the_reference_protocol_with_two_batches():
    """holdout = h: cross entropy on the first samples, ESD on the last ceil(h·N) alone."""
    z, y = batch((10,))
    got = F.esd_loss(z, y, 2.0, holdout=0.3)
    want = nnf.cross_entropy(z[:7], y[:7]) + 2.0 * F.esd_penalty(z[7:], y[7:]).clamp(min=0).sqrt()
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="holds out all 10 samples"):
        F.esd_loss(z, y, holdout=1.0)


def test_ml1ace_hand_computed_hard_and_soft():
    """One image of 4 pixels, 2 classes, M = 2 hard bins: class 0's p = (0.9, 0.8, 0.3, 0.2) with labels
    (1, 0, 0, 0): bin (0.5, 1] holds 0.9, 0.8 (mean p 0.85, mean y 0.5), bin [0, 0.5] holds 0.3, 0.2 (0.25 vs
    0): ACE_0 = (0.35 + 0.25)/2; class 1 mirrors it (p 1 − p, y 1 − y): the same gaps."""
    p0 = torch.tensor([0.9, 0.8, 0.3, 0.2], dtype=torch.float64)
    z = torch.stack([torch.log(p0), torch.log(1 - p0)])[None, :, :, None]  # (1, 2, 4, 1)
    y = torch.tensor([0, 1, 1, 1])[None, :, None]
    ace = F.ml1ace_penalty(z, y, n_bins=2, reduction="none")
    torch.testing.assert_close(ace, torch.tensor([[0.3, 0.3]], dtype=torch.float64))
    # soft bins, centres 0.25 and 0.75: 0.9 and 0.8 sit above 0.75 (all in bin 1); 0.3 splits 0.9/0.1 and
    # 0.2 is below 0.25 (all in bin 0)
    w0 = torch.tensor([0.0, 0.0, 0.9, 1.0], dtype=torch.float64)
    w1 = 1 - w0
    y0 = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    c = 1 + 1.1920928955078125e-07
    w0[2] = 1 - (0.3 / c * 2 - 0.5)
    w1[2] = 1 - w0[2]
    gaps = [((w * p0).sum() - (w * y0).sum()).abs() / w.sum() for w in (w0, w1)]
    soft = F.ml1ace_penalty(z, y, n_bins=2, binning="soft", reduction="none")
    torch.testing.assert_close(soft[0, 0], sum(gaps) / 2)


def test_ml1ace_empty_classes_and_images():
    """A class absent from an image counts 0 and stays in the mean (the reference's ignore_empty_classes);
    an image whose every position is ignored leaves the mean; include_background drops class 0."""
    z, y = batch((2, 3, 2))
    y[0] = 1  # image 0 holds class 1 only
    ace = F.ml1ace_penalty(z, y, reduction="none")
    assert (ace[0, [0, 2, 3]] == 0).all() and ace[0, 1] > 0
    full = F.ml1ace_penalty(z, y, ignore_empty_classes=False, reduction="none")
    assert (full[0, [0, 2, 3]] > 0).all()
    torch.testing.assert_close(F.ml1ace_penalty(z, y), ace.mean())
    y[1] = -100
    torch.testing.assert_close(F.ml1ace_penalty(z, y), F.ml1ace_penalty(z[:1], y[:1]))
    nobg = F.ml1ace_penalty(z, y, include_background=False, reduction="none")
    assert nobg.shape == (2, 3)


def test_ml1ace_multilabel_matches_the_loop_reference():
    """Sigmoid outputs (N, L, H, W) with 0/1 targets: BCE + λ·mL1-ACE per image and label, values and
    gradients against the loop reference, soft bins included; (N, L) inputs pool the batch."""
    g = torch.Generator().manual_seed(6)
    for shape in ((2, 3, 3, 2), (7, 3)):
        z = 3 * torch.randn(*shape, generator=g, dtype=torch.float64)
        t = (torch.rand(*shape, generator=g) < 0.4).double()
        for binning in ("hard", "soft"):
            for reduction in ("mean", "none", "sum"):
                za, zb = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
                got = F.ml1ace_loss(
                    za, t, 0.5, binning=binning, n_bins=4, multilabel=True, reduction=reduction
                )
                want = R.ml1ace(zb, t, 0.5, binning=binning, n_bins=4, multilabel=True, reduction=reduction)
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
                got.sum().backward()
                want.sum().backward()
                torch.testing.assert_close(za.grad, zb.grad, rtol=1e-10, atol=1e-12)
    module = create("binary-sl1-ace", n_bins=4)
    torch.testing.assert_close(module(z, t), F.ml1ace_loss(z, t, binning="soft", n_bins=4, multilabel=True))
    with pytest.raises(ValueError, match="`ignore_index` is not accepted with multilabel=True"):
        F.ml1ace_loss(z, t, multilabel=True, ignore_index=255)


def test_new_batch_terms_refuse_what_they_do_not_define():
    z, y = batch()
    q = torch.full((9, K), 1 / K, dtype=torch.float64)
    for name, message in (("avuc", "AvUC is a statistic"), ("s-avuc", "S-AvUC is a statistic"),
                          ("esd", "ESD is a statistic"), ("hl1-ace", "mL1-ACE is a statistic")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"^`weight` is not accepted: {message}"):
            create(name, weight=torch.ones(K))
        with pytest.raises(ValueError, match=rf"^`label_smoothing` is not accepted: {message}"):
            create(name, label_smoothing=0.1)
    for fn in (F.avuc_loss, F.esd_loss, lambda a, b: F.soft_avuc_loss(a, b, temperature=0.1, kappa=0.5)):
        with pytest.raises(TypeError, match="soft \\(floating\\) `targets` are not accepted"):
            fn(z, q)
    with pytest.raises(ValueError, match="`kappa` must lie in \\(0, 1\\)"):
        F.soft_avuc_loss(z, y, temperature=0.1, kappa=1.0)
    with pytest.raises(ValueError, match="`temperature` must be > 0"):
        F.soft_avuc_penalty(z, y, temperature=0.0, kappa=0.5)
    with pytest.raises(TypeError, match="temperature"):
        F.soft_avuc_loss(z, y)  # no default in the functional form
    with pytest.raises(ValueError, match="`binning` must be one of"):
        F.ml1ace_loss(z, y, binning="kde")
    with pytest.raises(ValueError, match="`holdout` must be"):
        F.esd_loss(z, y, holdout=1.5)


def test_margin_terms_are_differentiable_once():
    """MbLS, ACLS and CALS compute their margin terms' gradient analytically (one (N, K) array): a gradient
    with create_graph=True (for a second derivative) is refused rather than missing the terms' Hessian."""
    z, y = batch()
    for fn in (
        lambda a: F.logit_margin_l1_loss(a, y, 3.0),
        lambda a: F.acls_loss(a, y, margin=3.0),
        lambda a: F.cals_loss(a, y, CALS_LAMBDA, CALS_RHO, 3.0),
    ):
        za = z.clone().requires_grad_(True)
        torch.autograd.grad(fn(za), za)  # first order
        with pytest.raises(RuntimeError, match="differentiable once only"):
            torch.autograd.grad(fn(za), za, create_graph=True)


@pytest.mark.compile
def test_pooled_ml1ace_compiles_with_inductor():
    """(N, K) inputs pool the batch into one group; a scatter-add into that one group's sums made Inductor's
    CPU code generation fail (torch 2.13), so the per-group sums are block sums. The default backend,
    float32: generated code reorders float32 sums (a few ulps)."""
    g = torch.Generator().manual_seed(4)
    z = (3 * torch.randn(32, K, generator=g)).requires_grad_(True)
    y = torch.randint(0, K, (32,), generator=g)
    y[3] = -100
    torch._dynamo.reset()
    compiled = torch.compile(create("hl1-ace"), backend="inductor")
    got = compiled(z, y)
    (got_grad,) = torch.autograd.grad(got, z)
    want = create("hl1-ace")(z, y)
    (want_grad,) = torch.autograd.grad(want, z)
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)
