"""Binary / multi-label (sigmoid) losses and metrics (SPEC §6): float64 references, F.binary_cross_entropy_
with_logits, scikit-learn's roc_auc_score and torchmetrics' BinaryCalibrationError as peers, edge cases."""

import math

import pytest
import torch
import torch.nn.functional as nnf

import torchcal.functional as F
from torchcal.functional import binary as B

pytestmark = pytest.mark.usefixtures("loss_backend")


def data(n=40, labels=3, seed=0, scale=3.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    z = scale * torch.randn(n, labels, generator=g, dtype=dtype)
    y = (torch.rand(n, labels, generator=g, dtype=torch.float64) < torch.sigmoid(z.double() / 2)).to(dtype)
    return z, y


def sig(v):
    return 1 / (1 + math.exp(-v))


def ref(z, y, f):
    """Elementwise float64 reference: f(p, y) with p = σ(z), plain Python math."""
    return torch.tensor([[f(sig(a), b) for a, b in zip(ra, rb)] for ra, rb in zip(z.tolist(), y.tolist())],
                        dtype=torch.float64)  # fmt: skip


def focal_ref(gamma, alpha=None, pw=1.0):
    def f(p, y):
        a_pos, a_neg = (alpha, 1 - alpha) if alpha is not None else (1.0, 1.0)
        return -a_pos * pw * y * (1 - p) ** gamma * math.log(p) - a_neg * (1 - y) * p**gamma * math.log(1 - p)

    return f


def dfl_ref(gamma):
    def f(p, y):
        pt = p if y == 1 else 1 - p
        pj = 1 - pt if 1 - pt < pt else 0.0
        return -((1 - pt + pj) ** gamma) * math.log(pt)

    return f


CASES = [
    ("bce", lambda z, y: B.binary_cross_entropy(z, y, reduction="none"), focal_ref(0.0)),
    ("focal-2", lambda z, y: B.binary_focal_loss(z, y, 2.0, reduction="none"), focal_ref(2.0)),
    ("focal-0.5", lambda z, y: B.binary_focal_loss(z, y, 0.5, reduction="none"), focal_ref(0.5)),
    ("focal-alpha", lambda z, y: B.binary_focal_loss(z, y, 2.0, alpha=0.25, reduction="none"), focal_ref(2.0, 0.25)),
    ("brier", lambda z, y: B.binary_brier_loss(z, y, reduction="none"), lambda p, y: (p - y) ** 2),
    ("fcl", lambda z, y: B.binary_focal_calibration_loss(z, y, 3.0, 0.5, reduction="none"),
     lambda p, y: focal_ref(3.0)(p, y) + 0.5 * (p - y) ** 2),
    ("dfl", lambda z, y: B.binary_dual_focal_loss(z, y, 2.0, reduction="none"), dfl_ref(2.0)),
]  # fmt: skip


@pytest.mark.parametrize("name,fast,f", CASES, ids=[c[0] for c in CASES])
def test_losses_match_the_float64_reference(name, fast, f):
    z, y = data()
    torch.testing.assert_close(fast(z, y), ref(z, y, f), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fast(z[:, 0], y[:, 0]), ref(z[:, :1], y[:, :1], f)[:, 0])  # binary (N,)


@pytest.mark.parametrize("name,fast,f", CASES, ids=[c[0] for c in CASES])
def test_loss_gradients(name, fast, f):
    z, y = data(n=6, labels=2, scale=2.0)
    assert torch.autograd.gradcheck(lambda x: fast(x, y), (z.clone().requires_grad_(True),))


def test_gamma_zero_and_pos_weight_equal_pytorch_bce():
    z, y = data()
    pw = torch.tensor([0.5, 2.0, 3.0], dtype=torch.float64)
    for reduction in ("mean", "sum", "none"):
        expected = nnf.binary_cross_entropy_with_logits(z, y, pos_weight=pw, reduction=reduction)
        torch.testing.assert_close(B.binary_cross_entropy(z, y, pos_weight=pw, reduction=reduction), expected)
        torch.testing.assert_close(
            B.binary_focal_loss(z, y, 0.0, pos_weight=pw, reduction=reduction), expected
        )
    ref_pw = ref(z, y, focal_ref(2.0))  # pos_weight on the positive term of the focal loss
    pos = torch.tensor([[focal_ref(2.0, pw=float(w))(sig(a), 1.0) for a, w in zip(r, pw)] for r in z.tolist()],
                       dtype=torch.float64)  # fmt: skip
    expected = torch.where(y == 1, pos, ref_pw)
    torch.testing.assert_close(B.binary_focal_loss(z, y, 2.0, pos_weight=pw, reduction="none"), expected)


def test_soft_targets_and_label_smoothing():
    z, _ = data(n=10)
    g = torch.Generator().manual_seed(3)
    y = torch.rand(10, 3, generator=g, dtype=torch.float64)  # soft targets
    torch.testing.assert_close(B.binary_focal_loss(z, y, 2.0, reduction="none"), ref(z, y, focal_ref(2.0)))
    torch.testing.assert_close(
        B.binary_focal_loss(z, y, 2.0, alpha=0.3, pos_weight=torch.tensor([1.0, 2.0, 0.5]), reduction="none"),
        torch.tensor([[focal_ref(2.0, 0.3, w)(sig(a), b) for a, b, w in zip(ra, rb, (1.0, 2.0, 0.5))]
                      for ra, rb in zip(z.tolist(), y.tolist())], dtype=torch.float64),
    )  # fmt: skip
    hard = (y > 0.5).double()
    torch.testing.assert_close(
        B.binary_cross_entropy(z, hard, label_smoothing=0.1),
        nnf.binary_cross_entropy_with_logits(z, hard * 0.9 + 0.05),
    )
    with pytest.raises(ValueError, match="must be 0 or 1 here"):
        B.binary_dual_focal_loss(z, y)


WEIGHTS = [(None, None), (0.0, None), (1.0, None), (0.25, None), (None, (0.0, 1.0, 2.0)), (None, (0.0, 0.0, 0.0)),
           (1.0, (0.0, 3.0, 0.5)), (0.0, (0.0, 3.0, 0.5))]  # fmt: skip


@pytest.mark.parametrize("alpha, pw", WEIGHTS)
def test_soft_targets_with_zero_weights_match_the_reference(alpha, pw):
    """Soft multi-label targets never sum to 1 across labels and may hold exact 0s and 1s beside
    fractions: with α = 0 or 1, or a ``pos_weight`` entry of 0, an element's weights can all be 0, and its
    loss is 0 (not a refusal). Float64 reference per element; the same values on hard targets."""
    z, _ = data(n=12)
    y = torch.tensor(
        [[0.0, 1.0, 0.3], [1.0, 0.0, 0.7], [0.5, 0.0, 1.0], [0.0, 0.0, 0.0]] * 3, dtype=torch.float64
    )
    weights = pw if pw is not None else (1.0, 1.0, 1.0)
    pos_weight = torch.tensor(pw, dtype=torch.float64) if pw is not None else None

    def expected(f, targets):
        return torch.tensor([[f(w)(sig(a), b) for a, b, w in zip(ra, rb, weights)]
                             for ra, rb in zip(z.tolist(), targets.tolist())], dtype=torch.float64)  # fmt: skip

    focal = expected(lambda w: focal_ref(2.0, alpha, w), y)
    got = B.binary_focal_loss(z, y, 2.0, alpha=alpha, pos_weight=pos_weight, reduction="none")
    torch.testing.assert_close(got, focal, rtol=1e-10, atol=1e-12)
    fcl = expected(lambda w: lambda p, t: focal_ref(3.0, alpha, w)(p, t) + 0.5 * (p - t) ** 2, y)
    got = B.binary_focal_calibration_loss(
        z, y, 3.0, 0.5, alpha=alpha, pos_weight=pos_weight, reduction="none"
    )
    torch.testing.assert_close(got, fcl, rtol=1e-10, atol=1e-12)
    hard = (y > 0.5).double()
    got = B.binary_focal_loss(z, hard, 2.0, alpha=alpha, pos_weight=pos_weight, reduction="none")
    torch.testing.assert_close(
        got, expected(lambda w: focal_ref(2.0, alpha, w), hard), rtol=1e-10, atol=1e-12
    )
    zg = z[:4, :].clone().requires_grad_(True)  # the zero-weight elements' gradient is 0, the rest exact
    fn = lambda a: B.binary_focal_loss(a, y[:4], 2.0, alpha=alpha, pos_weight=pos_weight, reduction="none")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (zg,))


def test_the_accelerator_path_serves_zero_weights_and_the_dual_focal_loss(monkeypatch):
    """Off CPU float 0/1 targets take the soft path (no synchronisation): zero weights give 0 there too, and
    the dual focal loss (0/1 targets only) checks its targets with one synchronisation and takes the hard
    path rather than refusing float 0/1 targets."""
    z, y = data()
    check = B._check_binary_targets
    pw = torch.tensor([0.0, 2.0, 1.0], dtype=torch.float64)
    hard = {a: B.binary_focal_loss(z, y, 2.0, alpha=a, pos_weight=pw, reduction="none") for a in (0.0, 1.0)}
    dual = B.binary_dual_focal_loss(z, y, 2.0, reduction="none")
    monkeypatch.setattr(B, "_check_binary_targets", lambda *a, **k: (check(*a, **k)[0], False))
    for a in (0.0, 1.0):
        torch.testing.assert_close(
            B.binary_focal_loss(z, y, 2.0, alpha=a, pos_weight=pw, reduction="none"), hard[a]
        )
    monkeypatch.undo()

    class OnAccelerator(torch.Tensor):  # a CPU tensor that reports an accelerator, for the check only
        @property
        def device(self):
            return torch.device("meta")

    fake = y.as_subclass(OnAccelerator)
    targets, is_hard = B._check_binary_targets(fake, y.shape, torch.device("meta"), soft=False)
    assert is_hard
    with pytest.raises(ValueError, match="must be 0 or 1 here"):
        B._check_binary_targets(
            (y * 0.5).as_subclass(OnAccelerator), y.shape, torch.device("meta"), soft=False
        )
    assert not B._check_binary_targets(fake, y.shape, torch.device("meta"))[1]
    torch.testing.assert_close(dual, ref(z, y, dfl_ref(2.0)), rtol=1e-10, atol=1e-12)


def test_the_accelerator_path_equals_the_hard_path(monkeypatch):
    """Off CPU the targets' 0/1-ness is not checked (no sync): the soft path must give the same loss and
    gradient as the hard (fused) path."""
    z, y = data()
    pw = torch.tensor([0.5, 2.0, 3.0], dtype=torch.float64)
    check = B._check_binary_targets
    for fn in (lambda a: B.binary_focal_loss(a, y, 2.0, alpha=0.25, pos_weight=pw, reduction="none"),
               lambda a: B.binary_focal_calibration_loss(a, y, reduction="none")):  # fmt: skip
        za, zb = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
        hard = fn(za)
        monkeypatch.setattr(B, "_check_binary_targets", lambda *a, **k: (check(*a, **k)[0], False))
        soft = fn(zb)
        monkeypatch.undo()
        torch.testing.assert_close(hard, soft)
        hard.sum().backward()
        soft.sum().backward()
        torch.testing.assert_close(za.grad, zb.grad)


@pytest.mark.parametrize("fn", [B.binary_focal_loss, B.binary_focal_calibration_loss, B.binary_dual_focal_loss,
                                B.binary_cross_entropy, B.binary_brier_loss])  # fmt: skip
def test_extreme_logits_and_autocast_stay_finite(fn):
    z = torch.tensor([[1e4, -1e4, 0.0], [-1e4, 1e4, 30.0]], requires_grad=True)
    y = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    loss = fn(z, y)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(z.grad).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(fn(z.bfloat16(), y))
    if fn is B.binary_focal_loss:  # γ < 1: the power's derivative is infinite at p = 1
        z.grad = None
        B.binary_focal_loss(z, y, 0.3).backward()
        assert torch.isfinite(z.grad).all()


def test_loss_input_errors():
    z, y = data(n=4)
    with pytest.raises(ValueError, match=r"must have the shape of the scores \(4, 3\)"):
        B.binary_focal_loss(z, y[:, :2])
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\]"):
        B.binary_focal_loss(z, y * 2)
    with pytest.raises(ValueError, match=r"must be 0 or 1 \(1 = the label is present\), found 2"):
        B.binary_focal_loss(z, (y * 2).long())  # integer targets: checked without a float copy
    with pytest.raises(ValueError, match=r"`pos_weight` must have shape \(3,\)"):
        B.binary_focal_loss(z, y, pos_weight=torch.ones(2))
    with pytest.raises(ValueError, match="`alpha` must be <= 1"):
        B.binary_focal_loss(z, y, alpha=1.5)
    with pytest.raises(ValueError, match=r"shape \(N,\) or \(N, L\)"):
        B.binary_brier_loss(torch.zeros(2, 2, 2), torch.zeros(2, 2, 2))


# ----------------------------------------------------------------------------- metrics


def ece_ref(p, y, n_bins=15, norm="l1"):
    """Per-label equal-width calibration error of p (bins (m/M, (m+1)/M], 0 in bin 0), plain Python."""
    bins = [[] for _ in range(n_bins)]
    for pi, yi in zip(p, y):
        m = max(0, math.ceil(pi * n_bins) - 1)
        bins[m].append((pi, yi))
    gaps = [(len(b), abs(sum(x for x, _ in b) / len(b) - sum(t for _, t in b) / len(b))) for b in bins if b]
    if norm == "max":
        return max(g for _, g in gaps)
    return sum(c * g for c, g in gaps) / len(p)


def test_metrics_match_the_reference_and_peers():
    from sklearn.metrics import roc_auc_score
    from torchmetrics.classification import BinaryCalibrationError

    z, y = data(n=500, labels=4, seed=1)
    p = torch.sigmoid(z)
    per_label = B.multilabel_ece(p, y, average="none")
    for j in range(4):
        assert abs(float(per_label[j]) - ece_ref(p[:, j].tolist(), y[:, j].tolist())) < 1e-12
        peer = BinaryCalibrationError(n_bins=15, norm="l1")(p[:, j].float(), y[:, j].long())
        assert abs(float(per_label[j]) - float(peer)) < 1e-5  # the same reliability of p
        assert abs(float(B.multilabel_mce(p, y, average="none")[j]) - ece_ref(p[:, j].tolist(), y[:, j].tolist(),
                                                                                norm="max")) < 1e-12  # fmt: skip
    assert abs(float(B.multilabel_ece(p, y)) - float(per_label.mean())) < 1e-15  # macro
    micro = ece_ref(p.reshape(-1).tolist(), y.reshape(-1).tolist())
    assert abs(float(B.multilabel_ece(p, y, average="micro")) - micro) < 1e-12
    torch.testing.assert_close(B.multilabel_ece(z, y, from_logits=True), B.multilabel_ece(p, y))
    auroc = B.multilabel_auroc(p, y, average="none")
    for j in range(4):
        assert abs(float(auroc[j]) - roc_auc_score(y[:, j].numpy(), p[:, j].numpy())) < 1e-12
    torch.testing.assert_close(B.multilabel_brier_score(p, y), ((p - y) ** 2).mean())
    torch.testing.assert_close(
        B.multilabel_nll(z, y, from_logits=True), nnf.binary_cross_entropy_with_logits(z, y)
    )
    torch.testing.assert_close(B.multilabel_nll(p, y), nnf.binary_cross_entropy(p, y), rtol=1e-9, atol=1e-9)


def test_equal_mass_and_top_label_variants():
    z, y = data(n=300, labels=2, seed=2)
    p = torch.sigmoid(z)
    for j in range(2):  # AdaECE of p equals the top-label AdaECE of the pair (conf, correct) = (p, y)
        conf, correct = p[:, j], y[:, j]
        order = torch.argsort(conf, stable=True)
        chunks = torch.tensor_split(torch.arange(300), 15)
        expected = sum(
            len(c) / 300 * abs(float(conf[order][c].mean() - correct[order][c].mean())) for c in chunks
        )
        assert abs(float(B.multilabel_adaece(p, y, average="none")[j]) - expected) < 1e-12
    top = B.multilabel_calibration_error(p, y, top_label=True, average="none")
    for j in range(2):  # the binary top label: the multiclass ECE of the two columns (1 − p, p)
        two = torch.stack([1 - p[:, j], p[:, j]], 1)
        expected = F.expected_calibration_error(two, y[:, j].long())
        assert abs(float(top[j]) - float(expected)) < 1e-12


def test_binary_top_label_at_a_tie_predicts_class_0_as_the_multiclass_argmax():
    # hand-computed, one bin: p = 0.5 predicts class 0 (the first maximum of (1 − p, p)), so with y = 0 the
    # three ties are correct and 0.9 → 1 is too: accuracy 1, mean confidence (3·0.5 + 0.9)/4 = 0.6, ECE 0.4
    # (predicting 1 at the tie would give accuracy 1/4 and ECE 0.35)
    p = torch.tensor([0.5, 0.5, 0.5, 0.9], dtype=torch.float64)
    y = torch.tensor([0, 0, 0, 1])
    for binning in ("equal_width", "equal_mass"):
        got = B.multilabel_calibration_error(p, y, n_bins=1, binning=binning, top_label=True)
        assert float(got) == pytest.approx(0.4, abs=1e-15)


@pytest.mark.parametrize(
    "binning,norm", [("equal_width", "l1"), ("equal_width", "max"), ("equal_mass", "l1")]
)
def test_binary_top_label_is_the_multiclass_ece_of_two_columns_with_ties(binning, norm):
    # the documented identity, on labels where a quarter of the probabilities are exactly 0.5 (both targets),
    # against the float64 loop references of the multiclass metrics on the rows (1 − p, p) (first maximum);
    # both sum the same float64 values in another order: 1e-12
    from tests.reference import metrics as RM

    z, y = data(n=200, labels=3, seed=5)
    p = torch.sigmoid(z)
    p[::4] = 0.5
    ref = {("equal_width", "l1"): RM.ece, ("equal_width", "max"): RM.mce, ("equal_mass", "l1"): RM.adaece}
    top = B.multilabel_calibration_error(
        p, y, n_bins=7, norm=norm, binning=binning, average="none", top_label=True
    )
    for j in range(3):
        rows = torch.stack([1 - p[:, j], p[:, j]], 1)
        assert float(top[j]) == pytest.approx(ref[binning, norm](rows, y[:, j].long(), 7), abs=1e-12)


def test_auroc_of_a_one_class_label_is_missing():
    p = torch.tensor([[0.9, 0.2], [0.8, 0.6], [0.3, 0.7]])
    y = torch.tensor([[1, 0], [0, 0], [1, 0]])
    with pytest.warns(UserWarning, match=r"AUROC is undefined for label\(s\) \['Edema'\]"):
        values = B.multilabel_auroc(p, y, average="none", label_names=["Atelectasis", "Edema"])
    assert math.isnan(values[1]) and values[0] == 0.5
    with pytest.warns(UserWarning):
        assert float(B.multilabel_auroc(p, y)) == 0.5  # the mean leaves the missing label out


def test_metric_input_errors():
    p = torch.tensor([[0.2, 0.9]])
    with pytest.raises(ValueError, match=r"`probs` must lie in \[0, 1\].*from_logits=True"):
        B.multilabel_ece(p * 3, torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="must be 0 or 1"):
        B.multilabel_ece(p, torch.tensor([[0.5, 1.0]]))
    with pytest.raises(ValueError, match="norm='max'"):
        B.multilabel_calibration_error(p, torch.tensor([[0, 1]]), norm="max", binning="equal_mass")
    with pytest.raises(ValueError, match="`average` must be one of"):
        B.multilabel_ece(p, torch.tensor([[0, 1]]), average="weighted")


def test_loss_modules_and_registry():
    from torchcal.losses import create, list_losses, loss_task

    z, y = data(n=8)
    pw = torch.tensor([1.0, 2.0, 0.5])
    expected = {
        "bce": B.binary_cross_entropy(z, y),
        "binary-ls-0.1": B.binary_cross_entropy(z, y, label_smoothing=0.1),
        "binary-fl-3": B.binary_focal_loss(z, y, 3.0),
        "binary-fcl": B.binary_focal_calibration_loss(z, y),
        "binary-brier": B.binary_brier_loss(z, y),
        "binary-dfl": B.binary_dual_focal_loss(z, y),
    }
    for name, value in expected.items():
        assert loss_task(name) == "multilabel"
        torch.testing.assert_close(create(name)(z, y), value)
    module = create("binary-fl-2", pos_weight=pw, reduction="sum")
    torch.testing.assert_close(module(z, y), B.binary_focal_loss(z, y, 2.0, pos_weight=pw, reduction="sum"))
    assert module.pos_weight.dtype == torch.float64 and "pos_weight" in dict(module.named_buffers())
    assert repr(create("binary-fl-2")) == "BinaryFocalLoss(gamma=2.0, alpha=None, reduction='mean')"
    assert list_losses("multilabel") == ["bce", "binary-brier", "binary-dfl", "binary-fcl", "binary-fl-2",
                                         "binary-hl1-ace", "binary-ls-0.05", "binary-sl1-ace"]  # fmt: skip
    assert loss_task("fl-3") == "multiclass" and "bce" not in list_losses()
    with pytest.raises(ValueError, match="for sigmoid outputs"):
        create("binary-focal")


def test_metrics_and_calibrators_treat_inputs_as_data():
    """As their multiclass siblings: tensors that carry gradients are detached, not refused."""
    from torchcal.calibrators import PlattScaling

    z, y = data(n=50)
    z = z.clone().requires_grad_(True)
    assert not B.multilabel_ece(z, y, from_logits=True).requires_grad
    assert not B.multilabel_auroc(z, y).requires_grad
    out = PlattScaling().fit(z, y).transform(z)
    assert not out.requires_grad and out.shape == z.shape


def test_sigmoid_probabilities_passed_as_logits_warn():
    """multilabel_ece(sigmoid(z), y, from_logits=True) would apply a second sigmoid (0.237 where 0.066 is
    right in the issue's example); like the softmax path it warns, and so does a sigmoid calibrator's fit."""
    import warnings

    from torchcal.calibrators import BinaryTemperatureScaling
    from torchcal.metrics import MultilabelCalibrationMetrics

    g = torch.Generator().manual_seed(0)
    z = 2 * torch.randn(300, 3, generator=g, dtype=torch.float64)
    y = (torch.rand(300, 3, generator=g, dtype=torch.float64) < torch.sigmoid(z)).long()
    p = torch.sigmoid(z)
    with pytest.warns(UserWarning, match="look like sigmoid probabilities"):
        F.multilabel_ece(p, y, from_logits=True)
    with pytest.warns(UserWarning, match="look like sigmoid probabilities"):
        MultilabelCalibrationMetrics(3, from_logits=True).update(p, y)
    with pytest.warns(UserWarning, match="look like sigmoid probabilities"):
        F.multilabel_nll(p, y, from_logits=True)
    with pytest.warns(UserWarning, match="sigmoid calibrators take logits"):
        BinaryTemperatureScaling().fit(p, y)
    with warnings.catch_warnings():  # real logits (and probabilities given as such) do not warn
        warnings.simplefilter("error")
        F.multilabel_ece(z, y, from_logits=True)
        F.multilabel_nll(z, y, from_logits=True)
        F.multilabel_ece(p, y)
        BinaryTemperatureScaling().fit(z, y)
    with pytest.raises(ValueError, match="contains NaN"):
        F.multilabel_ece(torch.tensor([[float("nan")]]), torch.tensor([[1]]), from_logits=True)
