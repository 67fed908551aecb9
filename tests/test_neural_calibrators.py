"""PTS and IOP: their maps against float64 row-by-row references (tests/reference/neural.py) and, for IOP,
against probmetrics' port of the reference code (golden values from tests/data/make_iop_goldens.py);
hand-computed special cases, argmax and order preservation, seeding, device placement and errors."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.reference import neural as ref
from tests.reference.calibration_data import split, synthetic_logits
from torchcal.calibrators import IntraOrderPreserving, ParameterizedTemperatureScaling, create, from_json
from torchcal.calibrators.neural import _torch_linear_init, iop_logits

GOLDENS = json.loads((Path(__file__).parent / "data" / "iop_goldens.json").read_text())


def _keras(cal):
    """The fitted network in Keras' (in, out) layout, float64 numpy."""
    return [w.double().T.numpy() for w in cal.weights_], [b.double().numpy() for b in cal.biases_]


def _nll(probs, y):
    return float(-torch.log(probs.double().gather(1, y[:, None])).mean())


# ----------------------------------------------------------------------------- PTS


def _pts_unclipped(logits, kernels, biases, top_k):
    """The reference's temperature (its network on the top-k of the clipped logits) dividing the unclipped
    logits, softmax((z − max z) / T) row by row in float64."""
    out = []
    for z in np.asarray(logits, dtype=np.float64):
        top = np.sort(np.clip(z, -100.0, 100.0))[::-1][:top_k]
        temp = float(np.clip(abs(ref._mlp(top[None, :], kernels, biases)[0, 0]), 1e-12, 1e12))
        e = np.exp((z - z.max()) / temp)
        out.append(e / e.sum())
    return np.array(out)


def test_pts_map_matches_the_reference():
    (zc, yc), (zt, _) = split(*synthetic_logits(600, 12, seed=1, dtype=torch.float64))
    assert float(zt.abs().max()) <= 100
    big = 80 * zt[:5]  # logits beyond the ±100 clip
    cal = ParameterizedTemperatureScaling(steps=30, lr=1e-2, batch_size=128).fit(zc, yc)
    # within ±100 the reference's map itself; beyond, its network's temperature on the unclipped logits.
    # float64 throughout; softmax and the MLP in another order of operations: rounding only
    expected = ref.pts_probs(zt.numpy(), *_keras(cal), top_k=10)
    np.testing.assert_allclose(cal.transform(zt).numpy(), expected, rtol=0, atol=1e-13)
    expected = _pts_unclipped(big.numpy(), *_keras(cal), top_k=10)
    np.testing.assert_allclose(cal.transform(big).numpy(), expected, rtol=0, atol=1e-13)
    assert cal.top_k_ == 10


def _constant_pts(temperature, k=4, top_k=4):
    """A PTS whose network is constant: zero kernels and the output bias ``temperature``, so T(z) = it."""
    cal = ParameterizedTemperatureScaling(hidden_sizes=(3,), top_k=top_k)
    state = cal.state_dict()
    state["fitted"] = {
        "num_classes_": k,
        "weights_": [torch.zeros(3, top_k, dtype=torch.float64), torch.zeros(1, 3, dtype=torch.float64)],
        "biases_": [torch.zeros(3, dtype=torch.float64), torch.tensor([temperature], dtype=torch.float64)],
        "top_k_": top_k,
        "loss_": 0.0,
    }
    return cal.load_state_dict(state)


def test_pts_keeps_the_argmax_of_logits_beyond_the_clip():
    """Top logits above 100 are not tied by the clip: [120, 150, 0] / 2 is [60, 75, 0], so class 1 keeps
    the argmax (the reference's clipped [100, 100, 0] / 2 would tie classes 0 and 1)."""
    cal = _constant_pts(2.0, k=3, top_k=3)
    z = torch.tensor(
        [[120.0, 150.0, 0.0], [300.0, 101.0, 0.0], [-150.0, -120.0, -200.0]], dtype=torch.float64
    )
    probs = cal.transform(z)
    assert probs.argmax(1).tolist() == [1, 0, 1]
    # e^(−15) / (1 + e^(−15) + e^(−75)) and its complement, by hand; the third row is the first shifted
    p0 = math.exp(-15) / (1 + math.exp(-15) + math.exp(-75))
    expected = torch.tensor([[p0, 1 - p0, 0.0], [1.0, 0.0, 0.0], [p0, 1 - p0, 0.0]], dtype=torch.float64)
    # softmax in float64: a few ulps of 1; the third entry (e^(−75) ≈ 3e-33 and e^(−100)) is below atol
    torch.testing.assert_close(probs, expected, rtol=0, atol=1e-15)


def test_pts_equals_the_clipped_reference_form_within_the_clip():
    """Where every |z| <= 100 dividing the unclipped logits is the reference's softmax(clip(z) / T): fitted
    networks (float64 and float32) and logits up to ±100."""
    for dtype in (torch.float64, torch.float32):
        (zc, yc), (zt, _) = split(*synthetic_logits(600, 12, seed=4, dtype=dtype))
        edge = (100 * zt[:20] / zt[:20].abs().amax(1, keepdim=True)).clamp(-100, 100)  # rows reaching ±100
        zt = torch.cat([zt, edge])
        assert float(zt.abs().max()) == 100
        cal = ParameterizedTemperatureScaling(steps=30, lr=1e-2, batch_size=128).fit(zc, yc)
        t = cal.temperature(zt)
        clipped = torch.softmax(zt.clamp(-100, 100) / t[:, None], dim=1)
        # the shift by max z is exact or rounds once: the exponents differ by a few ulps of |z| / T
        # (|z| <= 100, T >= 0.2 here), so the probabilities by about 1e3 ulps relative at most
        assert float(t.min()) >= 0.2
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(cal.transform(zt), clipped, rtol=1e3 * eps, atol=1e3 * eps)


@pytest.mark.parametrize("bias", [2.0, -2.0])
def test_pts_with_a_constant_network_is_temperature_scaling(bias):
    # zero kernels and a output bias b: T = |b| for every sample, so softmax(z / |b|), unclipped
    cal = _constant_pts(bias)
    z = torch.tensor([[3.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 250.0]], dtype=torch.float64)
    torch.testing.assert_close(cal.transform(z), torch.softmax(z / 2.0, 1), rtol=0, atol=1e-15)
    torch.testing.assert_close(cal.temperature(z), torch.full((2,), 2.0, dtype=torch.float64))


def test_pts_recovers_a_known_temperature_and_keeps_the_argmax():
    # targets drawn from softmax(t), logits 2.5·t: the Brier-optimal temperature is 2.5 for every sample
    g = torch.Generator().manual_seed(0)
    t = 1.5 * torch.randn(20000, 5, generator=g)
    y = torch.multinomial(torch.softmax(t, 1), 1, generator=g)[:, 0]
    z = 2.5 * t
    cal = ParameterizedTemperatureScaling(steps=1500, lr=1e-2).fit(z, y)
    temps = cal.temperature(z)
    # 20,000 samples: the fitted map's median temperature within 10% of 2.5 (sampling noise of the Brier
    # optimum is ~2%; the network need not be exactly constant)
    assert float(temps.median()) == pytest.approx(2.5, rel=0.1)
    assert torch.equal(cal.transform(z).argmax(1), z.argmax(1))
    assert _nll(cal.transform(z), y) < _nll(torch.softmax(z, 1), y)


def test_pts_is_seeded_and_uses_all_logits_below_top_k():
    z, y = synthetic_logits(500, 4, seed=2)
    a = ParameterizedTemperatureScaling(steps=20).fit(z, y)
    b = ParameterizedTemperatureScaling(steps=20).fit(z, y)
    c = ParameterizedTemperatureScaling(steps=20, seed=1).fit(z, y)
    assert all(torch.equal(u, v) for u, v in zip(a.weights_, b.weights_))
    assert not torch.equal(a.weights_[0], c.weights_[0])
    assert a.top_k_ == 4 and a.weights_[0].shape == (5, 4)


def test_pts_weight_decay_acts_on_the_hidden_kernels_only():
    z, y = synthetic_logits(2000, 6, seed=3)
    free = ParameterizedTemperatureScaling(steps=400, lr=1e-2).fit(z, y)
    decayed = ParameterizedTemperatureScaling(steps=400, lr=1e-2, weight_decay=10.0).fit(z, y)
    # a strong penalty drives the hidden kernels towards 0 (Adam steps of lr = 1e-2 around it), the
    # unpenalised output kernel is not pulled towards 0 the same way
    for w_free, w_decay in zip(free.weights_[:-1], decayed.weights_[:-1]):
        assert float(w_decay.abs().max()) < 0.05 < float(w_free.abs().max())


# ----------------------------------------------------------------------------- IOP


@pytest.mark.parametrize("name", sorted(GOLDENS["cases"]))
def test_iop_map_matches_probmetrics_port(name):
    case = GOLDENS["cases"][name]
    weights = [torch.tensor(w, dtype=torch.float32) for w in case["weights"]]
    biases = [torch.tensor(b, dtype=torch.float32) for b in case["biases"]]
    x = torch.tensor(case["inputs"], dtype=torch.float32)
    out = iop_logits(x, weights, biases, invariant=case["invariant"])
    peer = torch.tensor(case["logits"], dtype=torch.float32)
    # the same float32 products summed in the same order; only sort tie order could differ (no ties here):
    # float32 rounding of values up to ~50
    torch.testing.assert_close(out, peer, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("invariant", [True, False])
def test_iop_map_matches_the_reference(invariant):
    (zc, yc), (zt, _) = split(*synthetic_logits(600, 6, seed=4, dtype=torch.float64))
    cal = IntraOrderPreserving(hidden_sizes=(16,), epochs=2, invariant=invariant).fit(zc, yc)
    x = np.maximum(torch.log_softmax(zt, 1).numpy(), math.log(1e-15))
    expected = ref.iop_logits(x, *_keras(cal), invariant=invariant)
    np.testing.assert_allclose(cal.transform_logits(zt).numpy(), expected, rtol=0, atol=1e-12)


def _iop_autograd_fit(z, y, hidden, invariant, decay, batch, epochs, seed, lr=5e-3):
    """IOP's training written the plain way, as the reference writes it: autograd through iop_logits and
    mean cross entropy, torch.optim.Adam, one permutation per epoch; the same seeded initialisation."""
    x = torch.log_softmax(z, 1).clamp_min(math.log(1e-15))
    n, k = x.shape
    g = torch.Generator().manual_seed(seed)
    widths = (k, *hidden, k)
    layers = [_torch_linear_init(a, b, x.dtype, x.device, g) for a, b in zip(widths[:-1], widths[1:])]
    weights, biases = [w.requires_grad_() for w, _ in layers], [b.requires_grad_() for _, b in layers]
    opt = torch.optim.Adam(weights + biases, lr=lr, weight_decay=decay)
    batch = min(batch, n)
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g)
        for start in range(0, n, batch):
            rows = perm[start : start + batch]
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(iop_logits(x[rows], weights, biases, invariant), y[rows])
            loss.backward()
            opt.step()
    return [w.detach() for w in weights + biases], float(loss.detach())


@pytest.mark.parametrize(
    "invariant, hidden, decay, n", [(True, (12, 7), 5e-4, 701), (False, (9,), 0.0, 701), (True, (), 1e-3, 50)]
)
def test_iop_training_equals_autograd_and_torch_adam(invariant, hidden, decay, n):
    """The written-out forward, backward and flat-buffer Adam (decision 214) against autograd and
    torch.optim.Adam, in float64, with ties among the log-probabilities (a tied label, rows at the 1e-15
    floor) and a last batch smaller than the others (N = 701, batch 64) or one batch of all rows (N = 50)."""
    z, y = synthetic_logits(n - 3, 6, seed=3, dtype=torch.float64)
    extra = torch.tensor([[1.0, 1.0, 0.0, -2.0, 1.0, 0.5], [50.0, -9.0, -9.0, 0.0, 1.0, 2.0]] * 2)
    z, y = torch.cat([z, extra[:3].double()]), torch.cat([y, torch.tensor([4, 2, 0])])
    kw = {"hidden_sizes": hidden, "invariant": invariant, "weight_decay": decay, "batch_size": 64}
    cal = IntraOrderPreserving(epochs=3, seed=2, **kw).fit(z, y)
    expected, loss = _iop_autograd_fit(z, y, hidden, invariant, decay, 64, 3, seed=2)
    # the same arithmetic in another order (sums of the matrix products, the cumulative sums, the
    # gradient of the cumulative sum as −cumsum(p − onehot)): differences of ~1e-16 per step, which Adam's
    # normalisation m / √v can enlarge where v is small; 33 steps stay below 1e-13 (1e-11 leaves room)
    for got, want in zip(cal.weights_ + cal.biases_, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)
    assert cal.loss_ == pytest.approx(loss, abs=1e-12)


def test_iop_hand_computed_identity_and_temperature():
    # zero kernels: m is the output bias; softplus(m_i) = c on every gap gives o = c·(s − s_min), i.e.
    # softmax(c·ln p): c = 1 is the identity, c = 1/2 temperature scaling with T = 2
    k = 4
    z = torch.tensor([[2.0, -1.0, 0.5, 0.0], [0.0, 0.0, 3.0, 1.0]], dtype=torch.float64)
    for c in (1.0, 0.5):
        b = math.log(math.expm1(c))
        weights = [torch.zeros(3, k, dtype=torch.float64), torch.zeros(k, 3, dtype=torch.float64)]
        biases = [torch.zeros(3, dtype=torch.float64), torch.full((k,), b, dtype=torch.float64)]
        o = iop_logits(torch.log_softmax(z, 1), weights, biases)
        ell = torch.log_softmax(z, 1)
        torch.testing.assert_close(o, c * (ell - ell.amin(1, keepdim=True)), rtol=0, atol=1e-14)
        torch.testing.assert_close(torch.softmax(o, 1), torch.softmax(c * z, 1), rtol=0, atol=1e-14)


def test_iop_keeps_the_order_ties_and_permutations():
    (zc, yc), (zt, _) = split(*synthetic_logits(1000, 5, seed=5))
    zt = torch.cat([zt, torch.tensor([[1.0, 1.0, 0.0, -2.0, 1.0]])])  # a three-way tie at the top
    cal = create("iop", epochs=3).fit(zc, yc)
    o = cal.transform_logits(zt)
    assert (o.amin(1) == 0).all()
    # the order of every row is kept (not only the argmax) and ties stay ties; in float32 a gap's term
    # softplus(m)·gap can round to 0 (softplus of a very negative m underflows), so the order is kept
    # weakly, and strictly for almost all pairs
    x = torch.log_softmax(zt, 1)
    i, j = torch.triu_indices(5, 5, 1)
    above = x[:, i] > x[:, j]
    assert (above <= (o[:, i] >= o[:, j])).all() and ((x[:, i] < x[:, j]) <= (o[:, i] <= o[:, j])).all()
    assert ((x[:, i] == x[:, j]) <= (o[:, i] == o[:, j])).all()
    assert float((above & (o[:, i] > o[:, j])).sum() / above.sum()) > 0.95
    # the argmax, ties aside: where the learned weight of the top gap is tiny, the top two calibrated
    # logits round to the same float32 value (a tie), and then argmax picks the lower index
    probs = cal.transform(zt)
    top = zt.argmax(1, keepdim=True)
    assert torch.equal(probs.gather(1, top)[:, 0], probs.amax(1))
    changed = probs.argmax(1) != zt.argmax(1)
    assert float(changed.double().mean()) < 0.2
    perm = torch.tensor([3, 0, 4, 1, 2])  # invariant=True: permutation-equivariant
    # up to float32 rounding: log_softmax sums the permuted row in another order (1 ulp of x), which the
    # 150-wide MLP carries to ~1e-6 on logits of a few units
    torch.testing.assert_close(cal.transform_logits(zt[:, perm]), o[:, perm], rtol=1e-5, atol=1e-5)


def test_iop_is_seeded_and_round_trips():
    z, y = synthetic_logits(700, 4, seed=6)
    a = IntraOrderPreserving(epochs=2).fit(z, y)
    b = IntraOrderPreserving(epochs=2).fit(z, y)
    assert all(torch.equal(u, v) for u, v in zip(a.weights_, b.weights_))
    again = from_json(a.to_json())
    assert isinstance(again, IntraOrderPreserving) and torch.equal(again.transform(z), a.transform(z))


# ----------------------------------------------------------------------------- both


@pytest.mark.parametrize("name, kwargs", [("pts", {"steps": 20}), ("iop", {"epochs": 1}), ("bbq", {})])
def test_fit_makes_no_host_round_trip(name, kwargs, monkeypatch):
    """Fitting keeps tensors on the input's device: .cpu(), .numpy() and .tolist() of more than a few
    scalars are trapped while fitting (on CPU they would be no-ops)."""
    logits, targets = synthetic_logits(600, 5, seed=12)
    originals = {attr: getattr(torch.Tensor, attr) for attr in ("cpu", "numpy", "tolist")}

    def trapped(attr):
        def call(self, *args, **kw):
            if self.numel() > 16:
                raise AssertionError(f"host round trip during fit: .{attr}() of {tuple(self.shape)}")
            return originals[attr](self, *args, **kw)

        return call

    cal = create(name, **kwargs)
    for attr in originals:
        monkeypatch.setattr(torch.Tensor, attr, trapped(attr))
    cal.fit(logits, targets)
    monkeypatch.undo()
    fitted = cal.weights_[0] if isinstance(cal.weights_, list) else cal.weights_
    assert fitted.device == logits.device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name, kwargs", [("pts", {"steps": 50}), ("iop", {"epochs": 2}), ("bbq", {})])
def test_fit_on_cuda_stays_on_cuda(name, kwargs):
    logits, targets = synthetic_logits(3000, 7, seed=13)
    cal = create(name, **kwargs).fit(logits.cuda(), targets.cuda())
    fitted = cal.weights_[0] if isinstance(cal.weights_, list) else cal.weights_
    assert fitted.is_cuda
    probs = cal.transform(logits.cuda())
    assert probs.is_cuda and torch.isfinite(probs).all()
    if name == "bbq":  # deterministic: the same map as on the CPU
        cpu = create(name, **kwargs).fit(logits, targets)
        torch.testing.assert_close(probs.cpu(), cpu.transform(logits), atol=1e-6, rtol=0)


def test_bad_arguments_are_named():
    z, y = synthetic_logits(100, 3, seed=1)
    with pytest.raises(ValueError, match="`hidden_sizes` must be a sequence of positive layer widths"):
        create("pts", hidden_sizes=(5, 0)).fit(z, y)
    with pytest.raises(ValueError, match="`lr` must be > 0"):
        create("iop", lr=0.0).fit(z, y)
    with pytest.raises(TypeError, match="`invariant` must be a bool"):
        create("iop", invariant="yes").fit(z, y)
    with pytest.raises(ValueError, match="`steps` must be >= 1"):
        create("pts", steps=0).fit(z, y)
