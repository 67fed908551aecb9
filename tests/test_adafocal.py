"""AdaFocal's state machine on crafted validation sets, its loss, resume, and CalFocal."""

import math
import warnings

import pytest
import torch

from tests.reference import losses as R
from torchcal.adafocal import AdaFocalLoss, CalFocalLoss
from torchcal.metrics import CalibrationMetrics

# every test here runs on the C++ CPU losses and on the torch path
pytestmark = pytest.mark.usefixtures("loss_backend")


def two_class(confs, correct):
    """Validation probabilities with the given top-label confidences; targets make them right or wrong."""
    c = torch.tensor(confs, dtype=torch.float64)
    probs = torch.stack([c, 1 - c], 1)
    targets = torch.tensor([0 if ok else 1 for ok in correct])
    return probs, targets


def test_update_with_known_gaps():
    probs, targets = two_class([0.9, 0.8, 0.7, 0.6, 0.95, 0.55], [1, 0, 1, 0, 1, 1])
    loss = AdaFocalLoss(n_bins=3, lambda_=2.0)
    loss.update(probs, targets)
    # equal-mass groups (.55 ok, .6 wrong), (.7 ok, .8 wrong), (.9 ok, .95 ok)
    gaps = [0.575 - 0.5, 0.75 - 0.5, 0.925 - 1.0]
    torch.testing.assert_close(loss.gap_history[0], torch.tensor(gaps, dtype=torch.float64))
    torch.testing.assert_close(
        loss.gammas, torch.tensor([math.exp(2 * g) for g in gaps], dtype=torch.float64)
    )
    torch.testing.assert_close(loss.bin_edges, torch.tensor([0.0, 0.6, 0.8, 1.0], dtype=torch.float64))


def test_empty_bins_keep_their_gamma_and_edges_repeat():
    probs, targets = two_class([0.9, 0.6], [0, 1])
    loss = AdaFocalLoss(n_bins=4)
    loss.update(probs, targets)
    # two groups of one, two empty groups: gaps .6 - 1 and .9 - 0, then 0, 0
    torch.testing.assert_close(loss.gap_history[0], torch.tensor([-0.4, 0.9, 0.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(loss.gammas[2:], torch.ones(2, dtype=torch.float64))
    assert loss.bin_edges.tolist() == [0.0, 0.6, 0.9, 0.9, 1.0]


def test_switch_to_inverse_focal_and_back():
    probs, targets = two_class([0.6, 0.6, 0.6, 0.6], [1, 1, 1, 1])  # under-confident: gap -0.4
    loss = AdaFocalLoss(n_bins=1, lambda_=5.0, gamma_init=0.5)
    loss.update(probs, targets)  # 0.5 * e^-2 = 0.068 < 0.2 -> switch to -0.2
    assert loss.gammas.tolist() == [-0.2]
    loss.update(probs, targets)  # negative: -0.2 * e^{+2} = -1.48 (more inverse-focal)
    assert loss.gammas.item() == pytest.approx(-0.2 * math.exp(2.0))
    over, over_t = two_class([0.9] * 4, [0, 0, 0, 0])  # over-confident: gap +0.9
    loss.update(over, over_t)  # -1.48 * e^{-4.5} = -0.016 -> |γ| < 0.2 -> switch to +0.2
    assert loss.gammas.tolist() == [0.2]


def test_clipping_at_gamma_max_and_min():
    over, over_t = two_class([0.95] * 4, [0, 0, 0, 0])
    loss = AdaFocalLoss(n_bins=1, lambda_=10.0, gamma_init=5.0)
    loss.update(over, over_t)
    assert loss.gammas.tolist() == [20.0]
    under, under_t = two_class([0.55] * 4, [1] * 4)
    neg = AdaFocalLoss(n_bins=1, lambda_=10.0, gamma_init=-1.5)
    neg.update(under, under_t)  # -1.5 * e^{4.5} -> clipped at -2
    assert neg.gammas.tolist() == [-2.0]


def test_forward_uses_the_bin_of_the_true_class_probability():
    loss = AdaFocalLoss(n_bins=2, reduction="none")
    loss.gamma_per_bin.copy_(torch.tensor([3.0, -1.5], dtype=torch.float64))
    loss.bin_edges.copy_(torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64))
    # true-class p: 0.3 (bin 0, focal γ=3), 0.5 (edge: bin 0, right-closed), 0.8 (bin 1, inverse γ=1.5),
    # and a sample whose top class is wrong but whose p_t = 0.2 still picks bin 0
    p = torch.tensor([[0.3, 0.7], [0.5, 0.5], [0.8, 0.2], [0.8, 0.2]], dtype=torch.float64)
    t = torch.tensor([0, 0, 0, 1])
    got = loss(torch.log(p), t)
    expected = [
        R.focal(torch.log(p[:1]), t[:1], 3.0)[0],
        R.focal(torch.log(p[1:2]), t[1:2], 3.0)[0],
        R.inverse_focal(torch.log(p[2:3]), t[2:3], 1.5)[0],
        R.focal(torch.log(p[3:]), t[3:], 3.0)[0],
    ]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64))


def test_ada_dual_focal_uses_the_dual_form():
    loss = AdaFocalLoss(n_bins=1, dual=True, reduction="none")
    loss.gamma_per_bin.fill_(2.0)
    z = torch.log(torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64))
    torch.testing.assert_close(
        loss(z, torch.tensor([1])), torch.tensor(R.dfl(z, torch.tensor([1]), 2.0), dtype=torch.float64)
    )


def test_update_from_streaming_metrics_equals_update_from_probs():
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(500, 4, generator=g)
    targets = torch.randint(0, 4, (500,), generator=g)
    a, b = AdaFocalLoss(), AdaFocalLoss()
    a.update(logits, targets, from_logits=True)
    m = CalibrationMetrics(4, from_logits=True)
    for i in range(0, 500, 128):
        m.update(logits[i : i + 128], targets[i : i + 128])
    b.update(metrics=m)
    torch.testing.assert_close(a.gammas, b.gammas)
    torch.testing.assert_close(a.bin_edges, b.bin_edges)


def test_state_dict_resumes_exactly():
    g = torch.Generator().manual_seed(1)
    loss = AdaFocalLoss(n_bins=5)
    for _ in range(3):
        loss.update(
            torch.softmax(2 * torch.randn(200, 3, generator=g), 1), torch.randint(0, 3, (200,), generator=g)
        )
    fresh = AdaFocalLoss(n_bins=5)
    fresh.load_state_dict(loss.state_dict())
    for name in ("gamma_per_bin", "bin_edges", "gamma_history", "gap_history"):
        torch.testing.assert_close(getattr(fresh, name), getattr(loss, name))
    assert fresh.gamma_history.shape == (3, 5)
    z, t = torch.randn(16, 3, generator=g), torch.randint(0, 3, (16,), generator=g)
    torch.testing.assert_close(fresh(z, t), loss(z, t))


def test_loaded_histories_keep_the_modules_dtype_and_device():
    # a checkpoint read with map_location="cpu" into a module that lives elsewhere: the histories take the
    # module's dtype and device, as the other buffers do (the meta device stands in for an accelerator)
    g = torch.Generator().manual_seed(2)
    loss = AdaFocalLoss(n_bins=3)
    for _ in range(2):
        loss.update(
            torch.softmax(2 * torch.randn(60, 4, generator=g), 1), torch.randint(0, 4, (60,), generator=g)
        )
    state = loss.state_dict()  # float64, CPU
    single = AdaFocalLoss(n_bins=3).float()
    single.load_state_dict(state)
    for name, value in single.state_dict().items():
        assert value.dtype == torch.float32, name
    # the saved float64 values rounded to float32, exactly
    torch.testing.assert_close(single.gamma_history, state["gamma_history"].float(), rtol=0, atol=0)
    assert single.gamma_history.shape == (2, 3)
    elsewhere = AdaFocalLoss(n_bins=3).to("meta")
    with warnings.catch_warnings():  # torch's notice that copying into meta tensors keeps no values
        warnings.simplefilter("ignore", UserWarning)
        elsewhere.load_state_dict(state)
    assert {value.device.type for value in elsewhere.state_dict().values()} == {"meta"}


def test_calfocal_cases():
    edges = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    case1 = CalFocalLoss(n_bins=2, lambda_=4.0, case=1, reduction="none")
    case2 = CalFocalLoss(n_bins=2, lambda_=4.0, case=2, reduction="none")
    for loss in (case1, case2):
        loss.bin_edges.copy_(edges)
        loss.bin_accuracy.copy_(torch.tensor([0.3, 0.9], dtype=torch.float64))
        loss.bin_confidence.copy_(torch.tensor([0.4, 0.85], dtype=torch.float64))
    p = torch.tensor([[0.2, 0.8], [0.7, 0.3]], dtype=torch.float64)
    t = torch.tensor([0, 0])  # p_t = 0.2 (bin 0), 0.7 (bin 1)
    g1 = [math.exp(4 * (0.2 - 0.3)), math.exp(4 * (0.7 - 0.9))]
    g2 = [math.exp(4 * (0.4 - 0.3)), math.exp(4 * (0.85 - 0.9))]
    for loss, gammas in ((case1, g1), (case2, g2)):
        expected = [-((1 - q) ** g) * math.log(q) for q, g in zip((0.2, 0.7), gammas)]
        torch.testing.assert_close(loss(torch.log(p), t), torch.tensor(expected, dtype=torch.float64))


def test_bad_arguments():
    with pytest.raises(ValueError, match="`gamma_min`"):
        AdaFocalLoss(gamma_min=30.0)
    with pytest.raises(ValueError, match="`n_bins`"):
        AdaFocalLoss(n_bins=0)
    with pytest.raises(ValueError, match="`case` must be one of"):
        CalFocalLoss(case=3)


def test_calfocal_module_follows_updates_and_loaded_states():
    """The module caches its fused description; it must match the functional loss after every change."""
    import torchcal.functional.losses as Lf
    from torchcal.adafocal import CalFocalLoss

    g = torch.Generator().manual_seed(4)
    z, t = 2 * torch.randn(40, 4, generator=g), torch.randint(0, 4, (40,), generator=g)

    def functional(m):
        conf = m.bin_confidence if m.case == 2 else None
        return Lf.calfocal_loss(z, t, m.bin_edges, m.bin_accuracy, m.lambda_, bin_confidence=conf)

    for case in (1, 2):
        loss = CalFocalLoss(n_bins=3, lambda_=2.0, case=case)
        before = loss(z, t)
        torch.testing.assert_close(before, functional(loss))
        loss.update(torch.softmax(z, 1), t)
        after = loss(z, t)
        assert not torch.allclose(before, after)
        torch.testing.assert_close(after, functional(loss))
        fresh = CalFocalLoss(n_bins=3, lambda_=2.0, case=case)
        fresh(z, t)  # cache the initial bins, then load others
        fresh.load_state_dict(loss.state_dict())
        torch.testing.assert_close(fresh(z, t), after)
