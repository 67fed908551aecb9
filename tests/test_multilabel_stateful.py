"""Calibrators and the streaming accumulator for sigmoid outputs: recovery of known maps, peers
(scikit-learn's IsotonicRegression, scipy's optimiser on Platt's objective), persistence, contracts, and
k updates / merge / 2-process sync equal to the one-shot functions."""

import json
import math

import pytest
import torch
import torch.multiprocessing as mp

import torchcal.functional as F
from tests.conftest import free_port
from torchcal.calibrators import (
    BinaryBBQ,
    BinaryBetaCalibration,
    BinaryFocalTemperatureScaling,
    BinaryHistogramBinning,
    BinaryIsotonicCalibration,
    BinaryTemperatureScaling,
    NotFittedError,
    PlattScaling,
    TemperatureScaling,
    from_json,
    from_spec,
    list_calibrators,
)
from torchcal.metrics import MultilabelCalibrationMetrics


def data(n=2000, labels=3, seed=0, sharp=2.5):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, labels, generator=g, dtype=torch.float64)
    y = (torch.rand(n, labels, generator=g, dtype=torch.float64) < torch.sigmoid(z)).double()
    return sharp * z, y


ALL = [BinaryTemperatureScaling, PlattScaling, BinaryHistogramBinning, BinaryIsotonicCalibration,
       BinaryFocalTemperatureScaling, BinaryBetaCalibration, BinaryBBQ]  # fmt: skip


def test_registry_and_specs():
    assert list_calibrators("multilabel") == ["bbq", "beta", "fts", "histogram", "isotonic", "platt", "ts"]
    assert isinstance(from_spec("ts:per_label=false", task="multilabel"), BinaryTemperatureScaling)
    assert from_spec("histogram:n_bins=10", task="multilabel").n_bins == 10
    with pytest.raises(ValueError, match="unknown calibrator 'ets'"):
        from_spec("ets", task="multilabel")


def test_temperature_per_label_and_shared():
    z, y = data()
    ts = BinaryTemperatureScaling().fit(z, y)
    for j in range(3):  # the binary NLL fit is the multiclass one on the two-class logits [0, z]
        rows = torch.stack([torch.zeros_like(z[:, j]), z[:, j]], 1)
        expected = TemperatureScaling().fit(rows, y[:, j].long()).temperature_
        assert abs(float(ts.temperature_[j]) - expected) < 1e-8
        assert 2.0 < float(ts.temperature_[j]) < 3.2
    shared = BinaryTemperatureScaling(per_label=False).fit(z, y)
    assert torch.unique(shared.temperature_).numel() == 1
    calibrated = ts.transform(z)
    assert F.multilabel_nll(calibrated, y) < F.multilabel_nll(z, y, from_logits=True)
    assert F.multilabel_ece(calibrated, y) < F.multilabel_ece(z, y, from_logits=True)


@pytest.mark.parametrize(
    "bounds,message",
    [((-1.0, 5.0), r"`bounds\[0\]` must be > 0"), ((10.0, 1.0), r"`bounds\[1\]` must be > 10.0"),
     ((0.0, 1.0), r"`bounds\[0\]` must be > 0"), ((1.0, math.inf), r"`bounds\[1\]` must be finite"),
     ((0.5, 0.5), r"`bounds\[1\]` must be > 0.5"), ((1.0,), r"`bounds` must be a pair"),
     ("ab", r"`bounds` must be a pair")],
)  # fmt: skip
def test_temperature_bounds_are_checked(bounds, message):
    # the binary fit took any bounds: (-1, 5) gave T = 1 and (10, 1) gave T = 10 (each with a "hit the
    # bound" warning), (0, 1) a ZeroDivisionError; the multiclass TemperatureScaling refuses all of them
    z, y = data(n=200, labels=2, seed=8)
    with pytest.raises(ValueError, match=message):
        BinaryTemperatureScaling(bounds=bounds).fit(z, y)
    with pytest.raises(ValueError, match=message):
        BinaryTemperatureScaling(bounds=bounds).check_params()
    narrow = BinaryTemperatureScaling(bounds=[4.0, 5.0])  # a list, as from_json gives it back
    with pytest.warns(UserWarning, match="hit the bound"):
        assert narrow.fit(z, y).temperature_.tolist() == [4.0, 4.0]  # the optimum (about 2.5) lies below


def test_platt_matches_scipy_on_its_objective():
    from scipy.optimize import minimize

    z, y = data(n=1500, labels=2, seed=1)
    platt = PlattScaling().fit(z, y)
    for j in range(2):
        zj, yj = z[:, j].numpy(), y[:, j].numpy()
        n_pos = yj.sum()
        n_neg = len(yj) - n_pos
        t = [(n_pos + 1) / (n_pos + 2) if v > 0.5 else 1 / (n_neg + 2) for v in yj]

        def objective(w, zj=zj, t=t):
            total = 0.0
            for zi, ti in zip(zj, t):
                s = w[0] * zi + w[1]
                total += max(s, 0) + math.log1p(math.exp(-abs(s))) - ti * s
            return total

        best = minimize(objective, [1.0, 0.0], method="Nelder-Mead", options={"xatol": 1e-9, "fatol": 1e-12})
        assert abs(float(platt.slope_[j]) - best.x[0]) < 1e-4
        assert abs(float(platt.intercept_[j]) - best.x[1]) < 1e-4
    separable = PlattScaling().fit(torch.tensor([-2.0, -1.0, 1.0, 2.0]), torch.tensor([0, 0, 1, 1]))
    assert math.isfinite(float(separable.slope_)) and float(separable.slope_) > 0  # target smoothing


def test_binary_fts_is_the_two_class_fts():
    from torchcal.calibrators import FocalTemperatureScaling

    z, y = data(n=600, labels=2, seed=7)
    fts = BinaryFocalTemperatureScaling().fit(z, y)
    for j in range(2):
        rows = torch.stack([torch.zeros_like(z[:, j]), z[:, j]], 1)
        ref = FocalTemperatureScaling().fit(rows, y[:, j].long())
        assert (float(fts.gamma_[j]), float(fts.temperature_[j])) == (ref.gamma_, ref.temperature_)
        torch.testing.assert_close(fts.transform(z)[:, j], ref.transform(rows)[:, 1])


def test_histogram_and_isotonic():
    from sklearn.isotonic import IsotonicRegression

    z, y = data(n=800, labels=2, seed=2)
    p = torch.sigmoid(z)
    iso = BinaryIsotonicCalibration().fit(z, y)
    z_test, _ = data(n=300, labels=2, seed=3)
    for j in range(2):
        peer = IsotonicRegression(out_of_bounds="clip").fit(p[:, j].numpy(), y[:, j].numpy())
        expected = peer.predict(torch.sigmoid(z_test[:, j]).numpy())
        torch.testing.assert_close(
            iso.transform(z_test)[:, j], torch.from_numpy(expected), rtol=1e-10, atol=1e-12
        )
    hb = BinaryHistogramBinning(n_bins=4).fit(
        torch.tensor([[-3.0], [-2.0], [0.1], [3.0]]), torch.tensor([[0], [1], [1], [1]])
    )
    # p = 0.047, 0.119 (bin 0: 1 of 2 positive), 0.525 (bin 2), 0.953 (bin 3); bin 1 is empty
    torch.testing.assert_close(hb.frequencies_, torch.tensor([[0.5, math.nan, 1.0, 1.0]], dtype=torch.float64),
                               equal_nan=True)  # fmt: skip
    out = hb.transform(torch.tensor([[-4.0], [-0.5], [1.0]]))  # bin 0, bin 1 (empty: unchanged), bin 3
    torch.testing.assert_close(out, torch.tensor([[0.5], [float(torch.sigmoid(torch.tensor(-0.5)))], [1.0]]))


@pytest.mark.parametrize("cls", ALL)
def test_calibrator_contract(cls):
    from sklearn.base import clone

    z, y = data(n=400, labels=2, seed=4)
    with pytest.raises(NotFittedError, match="not fitted yet"):
        cls().transform(z)
    cal = cls().fit(z, y)
    out = cal.transform(z)
    assert out.shape == z.shape and bool(((out >= 0) & (out <= 1)).all())
    assert cal.transform(z[:, :1].expand(-1, 2)).shape == (400, 2)
    again = from_json(cal.to_json())
    torch.testing.assert_close(again.transform(z), out)
    assert type(again) is cls and again.num_labels_ == 2
    assert not clone(cal).is_fitted and clone(cal).get_params() == cal.get_params()
    with pytest.raises(ValueError, match="has 3 labels but this"):
        cal.transform(torch.zeros(5, 3))
    with pytest.raises(ValueError, match="must be 0 or 1"):
        cls().fit(z, y * 0.5)
    single = cls().fit(z[:, 0], y[:, 0])  # binary (N,)
    assert single.transform(z[:, 0]).shape == (400,)
    with pytest.raises(ValueError, match=r"`logits` must have shape \(N,\) or \(N, L\) with L >= 1"):
        cls().fit(z[:, :0], y[:, :0])  # no labels: was a RuntimeError of aminmax


def test_streaming_equals_one_shot_and_merges():
    z, y = data(n=700, labels=4, seed=5)
    m = MultilabelCalibrationMetrics(num_labels=4, from_logits=True)
    for i in range(0, 700, 128):
        m.update(z[i : i + 128], y[i : i + 128])
    out = m.compute()
    expected = {
        "ece": F.multilabel_ece(z, y, from_logits=True),
        "ece_micro": F.multilabel_ece(z, y, from_logits=True, average="micro"),
        "mce": F.multilabel_mce(z, y, from_logits=True),
        "adaece": F.multilabel_adaece(z, y, from_logits=True),
        "adaece_micro": F.multilabel_adaece(z, y, from_logits=True, average="micro"),
        "auroc": F.multilabel_auroc(z, y),
        "brier": F.multilabel_brier_score(z, y, from_logits=True),
        "nll": F.multilabel_nll(z, y, from_logits=True),
        "error": ((torch.sigmoid(z) >= 0.5).double() != y).double().mean(),
        "ece_per_label": F.multilabel_ece(z, y, from_logits=True, average="none"),
    }
    for name, value in expected.items():
        torch.testing.assert_close(out[name], value.double(), rtol=1e-10, atol=1e-12, msg=name)
    a, b = (
        MultilabelCalibrationMetrics(4, from_logits=True),
        MultilabelCalibrationMetrics(4, from_logits=True),
    )
    a.update(z[:300], y[:300])
    b.update(z[300:], y[300:])
    merged = a.merge(b).compute()
    for name in expected:
        torch.testing.assert_close(merged[name], out[name], rtol=1e-10, atol=1e-12)
    probs = MultilabelCalibrationMetrics(4)
    probs.update(torch.sigmoid(z), y)
    torch.testing.assert_close(probs.compute()["ece"], out["ece"])
    with pytest.raises(RuntimeError, match="before any update"):
        MultilabelCalibrationMetrics(2).compute()
    with pytest.raises(ValueError, match="expected num_labels=4"):
        MultilabelCalibrationMetrics(4).update(torch.rand(3, 2), torch.zeros(3, 2))


def _worker(rank, world, port, path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    z, y = data(n=500, labels=3, seed=6)
    shard = slice(0, 320) if rank == 0 else slice(320, 500)
    m = MultilabelCalibrationMetrics(3, from_logits=True)
    m.update(z[shard], y[shard])
    out = m.sync().compute()
    with open(f"{path}.{rank}", "w") as fh:
        json.dump({k: float(v) for k, v in out.items() if v.ndim == 0}, fh)
    dist.destroy_process_group()


def test_sync_over_two_gloo_processes(tmp_path):
    mp.start_processes(_worker, args=(2, free_port(), str(tmp_path / "out")), nprocs=2, start_method="spawn")
    z, y = data(n=500, labels=3, seed=6)
    ref = MultilabelCalibrationMetrics(3, from_logits=True)
    ref.update(z, y)
    expected = {k: float(v) for k, v in ref.compute().items() if v.ndim == 0}
    for rank in range(2):
        got = json.loads((tmp_path / f"out.{rank}").read_text())
        assert got.keys() == expected.keys()
        for name in expected:
            assert abs(got[name] - expected[name]) < 1e-10, (rank, name)
