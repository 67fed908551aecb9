"""What every loss takes besides (N, K) logits and (N,) labels (decision 73): ignored labels, (N, K, d1, ...)
inputs and soft targets, for every registered loss on both CPU paths, against float64 references and
``F.cross_entropy`` as the peer."""

import pytest
import torch
import torch.nn.functional as nnf

import torchcal.functional.losses as L
from tests.reference import losses as R
from torchcal.losses import create, list_losses

pytestmark = pytest.mark.usefixtures("loss_backend")

ALL = list_losses()
SOFT_REFUSED = {
    "mmce",
    "kde-xe",
    "dfl",
    "dualflsd-53",
    "adafocal",
    "adadualfocal",
    "calfocal",
    "dca",
    "ls-mdca",
    "sb-ece",
    "avuc",
    "s-avuc",
    "esd",
}
SOFT_OK = [n for n in ALL if n not in SOFT_REFUSED]
PER_BATCH = {"hl1-ace": {"per_image": False}, "sl1-ace": {"per_image": False}}


def batch(n=12, k=5, seed=0, scale=3.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    z = scale * torch.randn(n, k, generator=g, dtype=dtype)
    return z, torch.randint(0, k, (n,), generator=g)


def soft_targets(n=12, k=5, seed=1, dtype=torch.float64):
    """Rows of every kind a pipeline makes: one-hot, label-smoothed, mixup of two labels, a dense row."""
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(2 * torch.randn(n, k, generator=g, dtype=torch.float64), 1)
    q[0] = nnf.one_hot(torch.tensor(2), k).double()
    q[1] = 0.9 * nnf.one_hot(torch.tensor(0), k).double() + 0.1 / k
    q[2] = 0.7 * nnf.one_hot(torch.tensor(1), k).double() + 0.3 * nnf.one_hot(torch.tensor(k - 1), k).double()
    return q.to(dtype)


# ----------------------------------------------------------------------------- ignore_index


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ignored_labels_are_left_out(name, reduction):
    """A loss with some labels −100 equals the loss of the kept samples alone; ignored samples get loss 0
    and gradient 0 (MMCE's batch term is over the kept samples too)."""
    z, y = batch()
    y[[1, 4, 5, 9]] = -100
    keep = y != -100
    z1 = z.clone().requires_grad_(True)
    # MbLS's, ACLS's and CALS's released code keep rows labelled −100 in their margin terms (decisions 131, 138,
    # tested in tests/test_margin_losses.py); the contract is their option
    options = {"ignored_rows": "drop"} if name in ("mbls", "acls", "cals") else {}
    full = create(name, reduction=reduction, **options)(z1, y)
    kept = create(name, reduction=reduction, **options)(z[keep], y[keep])
    if reduction == "none":
        assert full.shape == (12,)
        torch.testing.assert_close(full[keep], kept)
        assert (full[~keep] == 0).all()
    else:
        torch.testing.assert_close(full, kept)
    full.sum().backward()
    assert (z1.grad[~keep] == 0).all() and z1.grad[keep].abs().sum() > 0


@pytest.mark.parametrize("name", ALL)
def test_ignore_index_inside_the_label_range(name):
    """ignore_index = 0 (e.g. a background class) drops the samples labelled 0; other labels still count."""
    z, y = batch(seed=3)
    keep = y != 0
    assert 0 < keep.sum() < len(y)
    # ACLS's released code never filters its regulariser (decision 138); the contract is its option
    options = {"ignored_rows": "drop"} if name in ("acls", "cals") else {}
    got = create(name, ignore_index=0, **options)(z, y)
    torch.testing.assert_close(got, create(name, ignore_index=0, **options)(z[keep], y[keep]))
    torch.testing.assert_close(got, create(name, **options)(z[keep], y[keep]))


@pytest.mark.parametrize("name", ALL)
def test_every_label_ignored(name):
    """As F.cross_entropy: "mean" over no sample is NaN, "sum" is 0, "none" all zeros."""
    z, _ = batch(n=4)
    y = torch.full((4,), -100)
    assert torch.isnan(nnf.cross_entropy(z, y))  # the peer's convention
    options = {"ignored_rows": "drop"} if name in ("mbls", "acls", "cals") else {}  # as above
    assert torch.isnan(create(name, **options)(z, y))
    assert create(name, reduction="sum", **options)(z, y) == 0
    assert (create(name, reduction="none", **options)(z, y) == 0).all()


@pytest.mark.parametrize("name", ALL)
def test_ignore_index_none_and_bad_labels(name):
    z, y = batch(n=4, k=3)
    with pytest.raises(ValueError, match=r"must lie in \[0, 3\), found label -100"):
        create(name, ignore_index=None)(z, torch.tensor([0, -100, 1, 2]))
    for bad in (7, -5):  # a label that is neither in range nor ignored is an error, beside ignored ones
        with pytest.raises(ValueError, match=rf"must lie in \[0, 3\), found label {bad}"):
            create(name)(z, torch.tensor([0, -100, bad, 2]))
    for wrong in (1.5, True, "x"):
        with pytest.raises(TypeError, match="`ignore_index` must be an integer or None"):
            create(name, ignore_index=wrong)


def test_ignore_index_in_repr_and_functional_names():
    assert repr(create("fl-3")) == "FocalLoss(gamma=3.0, reduction='mean')"
    assert (
        repr(create("fl-3", ignore_index=255)) == "FocalLoss(gamma=3.0, reduction='mean', ignore_index=255)"
    )
    z, y = batch(n=6)
    y[2] = 255
    torch.testing.assert_close(L.focal_loss(z, y, ignore_index=255), L.focal_loss(z[y != 255], y[y != 255]))


def test_cross_entropy_matches_pytorch_with_ignore_and_smoothing():
    z, y = batch(n=20)
    y[::3] = -100
    for eps in (0.0, 0.1):
        for reduction in ("mean", "sum", "none"):
            torch.testing.assert_close(
                L.cross_entropy(z, y, label_smoothing=eps, reduction=reduction),
                nnf.cross_entropy(z, y, label_smoothing=eps, reduction=reduction),
            )


# ----------------------------------------------------------------------------- (N, K, d1, ...) inputs


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_spatial_inputs_are_positions(name, reduction):
    """(N, K, d1, d2) logits with (N, d1, d2) labels: every position is a sample, exactly as the (N·d1·d2, K)
    rows with the class dimension last (segmentation, token classification)."""
    g = torch.Generator().manual_seed(5)
    z = 3 * torch.randn(2, 5, 3, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (2, 3, 4), generator=g)
    y[0, 1, 2] = y[1, 0, 0] = -100
    # mL1-ACE bins each image's positions apart (the reference's per-image ACE, tests/test_margin_losses.py);
    # pooled over the batch it is a function of the positions alone
    options = PER_BATCH.get(name, {})
    got = create(name, reduction=reduction, **options)(z, y)
    rows = create(name, reduction="none" if reduction == "none" else reduction, **options)(
        z.movedim(1, -1).reshape(-1, 5), y.reshape(-1)
    )
    if reduction == "none":
        assert got.shape == (2, 3, 4)
        rows = rows.reshape(2, 3, 4)
    torch.testing.assert_close(got, rows)


def test_spatial_cross_entropy_matches_pytorch():
    g = torch.Generator().manual_seed(6)
    z = torch.randn(3, 4, 7, generator=g)
    y = torch.randint(0, 4, (3, 7), generator=g)
    y[1, :3] = -100
    for reduction in ("mean", "none"):
        torch.testing.assert_close(
            L.cross_entropy(z, y, label_smoothing=0.1, reduction=reduction),
            nnf.cross_entropy(z, y, label_smoothing=0.1, reduction=reduction),
        )
    with pytest.raises(ValueError, match=r"`targets` must have shape \(3, 7\) to match `logits`"):
        L.focal_loss(z, y[:, :6])


def test_varying_focal_loss_takes_gamma_of_the_label_shape():
    g = torch.Generator().manual_seed(7)
    z = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (2, 5), generator=g)
    gamma = torch.rand(2, 5, generator=g, dtype=torch.float64) * 4 - 1
    got = L.varying_focal_loss(z, y, gamma, reduction="none")
    rows = L.varying_focal_loss(
        z.movedim(1, -1).reshape(-1, 3), y.reshape(-1), gamma.reshape(-1), reduction="none"
    )
    torch.testing.assert_close(got, rows.reshape(2, 5))
    with pytest.raises(ValueError, match=r"`gamma` must have shape \(2, 5\)"):
        L.varying_focal_loss(z, y, gamma.reshape(-1))


# ----------------------------------------------------------------------------- soft targets

SOFT_CASES = [
    ("ce", lambda z, q: L.cross_entropy(z, q, reduction="none"), lambda z, q: R.soft_ce(z, q)),
    (
        "ls",
        lambda z, q: L.label_smoothing_loss(z, q, 0.1, reduction="none"),
        lambda z, q: R.soft_ce(z, q, 0.1),
    ),
    (
        "focal-0.5",
        lambda z, q: L.focal_loss(z, q, 0.5, reduction="none"),
        lambda z, q: R.soft_focal(z, q, 0.5),
    ),
    ("focal-3", lambda z, q: L.focal_loss(z, q, 3.0, reduction="none"), lambda z, q: R.soft_focal(z, q, 3.0)),
    (
        "inv-2",
        lambda z, q: L.inverse_focal_loss(z, q, 2.0, reduction="none"),
        lambda z, q: R.soft_inverse_focal(z, q, 2.0),
    ),
    (
        "flsd-532",
        lambda z, q: L.sample_dependent_focal_loss(z, q, (5, 3, 2), (0.2, 0.5), reduction="none"),
        lambda z, q: R.soft_flsd(z, q, (5, 3, 2), (0.2, 0.5)),
    ),
    ("brier", lambda z, q: L.brier_loss(z, q, reduction="none"), lambda z, q: R.soft_brier(z, q)),
    (
        "fcl",
        lambda z, q: L.focal_calibration_loss(z, q, 4.0, 1.5, reduction="none"),
        lambda z, q: R.soft_fcl(z, q, 4.0, 1.5),
    ),
]


@pytest.mark.parametrize("name,fast,ref", SOFT_CASES, ids=[c[0] for c in SOFT_CASES])
def test_soft_targets_match_the_float64_reference(name, fast, ref):
    z, _ = batch()
    q = soft_targets()
    torch.testing.assert_close(
        fast(z, q), torch.tensor(ref(z, q), dtype=torch.float64), rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize("name,fast,ref", SOFT_CASES, ids=[c[0] for c in SOFT_CASES])
def test_soft_target_gradients(name, fast, ref):
    z, _ = batch(n=5, k=4, scale=2.0)
    q = soft_targets(n=5, k=4)
    assert torch.autograd.gradcheck(lambda x: fast(x, q), (z.clone().requires_grad_(True),))


@pytest.mark.parametrize("name", SOFT_OK)
def test_one_hot_soft_targets_are_the_labels(name):
    """One-hot class probabilities give the hard-label loss and gradient (float32)."""
    z, y = batch(dtype=torch.float32)
    q = nnf.one_hot(y, 5).float()
    za, zb = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    a = create(name, reduction="none")(za, y)
    b = create(name, reduction="none")(zb, q)
    torch.testing.assert_close(a, b)
    a.sum().backward()
    b.sum().backward()
    torch.testing.assert_close(za.grad, zb.grad)


def test_soft_cross_entropy_matches_pytorch():
    z, _ = batch()
    q = soft_targets()
    for eps in (0.0, 0.2):
        torch.testing.assert_close(
            L.cross_entropy(z, q, label_smoothing=eps), nnf.cross_entropy(z, q, label_smoothing=eps)
        )


@pytest.mark.parametrize("name", SOFT_OK)
def test_soft_spatial_targets(name):
    g = torch.Generator().manual_seed(8)
    z = torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
    q = torch.softmax(torch.randn(2, 4, 3, generator=g, dtype=torch.float64), 1)
    got = create(name, reduction="none", **PER_BATCH.get(name, {}))(z, q)
    rows = create(name, reduction="none", **PER_BATCH.get(name, {}))(
        z.movedim(1, -1).reshape(-1, 4), q.movedim(1, -1).reshape(-1, 4)
    )
    assert got.shape == (2, 3)
    torch.testing.assert_close(got, rows.reshape(2, 3))


@pytest.mark.parametrize("name", sorted(SOFT_REFUSED))
def test_losses_that_need_a_true_class_refuse_soft_targets(name):
    z, _ = batch()
    with pytest.raises(TypeError, match="soft \\(floating\\) `targets` are not accepted: "):
        create(name)(z, soft_targets())
    with pytest.raises(TypeError, match="γ is given per sample"):
        L.varying_focal_loss(z, soft_targets(), torch.ones(12))


def test_bad_soft_targets_are_named():
    z, _ = batch(n=3, k=3)
    q = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0]], dtype=torch.float64)
    for bad, message in (
        (torch.tensor([[1.5, -0.5, 0.0]]), "negative entry -0.5"),
        (torch.tensor([[0.5, 0.2, 0.0]]), "must sum to 1 over the classes"),
        (torch.tensor([[float("nan"), 0.5, 0.5]]), "NaN or infinite"),
    ):
        with pytest.raises(ValueError, match=message):
            L.focal_loss(z, torch.cat([q[:2], bad.double()]))
    with pytest.raises(ValueError, match=r"must have the shape of `logits` \(3, 3\)"):
        L.brier_loss(z, q[:, :2])


@pytest.mark.parametrize("name", SOFT_OK)
def test_soft_targets_stay_finite(name):
    """Extreme logits (p_k rounding to 0 and 1), γ < 1 included, and bf16 autocast: finite loss and gradient."""
    z = torch.tensor([[1e4, -1e4, 0.0], [-1e4, 1e4, 1e4], [30.0, 0.0, -30.0]], requires_grad=True)
    q = torch.tensor([[0.9, 0.05, 0.05], [0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    for fn in (create(name), lambda a, b: L.focal_loss(a, b, 0.5)):
        z.grad = None
        loss = fn(z, q)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(z.grad).all()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(z.bfloat16(), q)
        assert torch.isfinite(out)
