"""Conformance with peer libraries, with the known convention differences written down as tests.

Peers: torchmetrics (ECE, MCE), netcal (ECE), relplot (smECE), scikit-learn (NLL, AUROC, isotonic).
"""

import warnings

import numpy as np
import pytest
import torch

import torchcal.functional as F
from tests.conftest import make_probs

# every test here runs on the C++ CPU operators and on the torch path
pytestmark = pytest.mark.usefixtures("cpu_backend")

torchmetrics = pytest.importorskip("torchmetrics")  # dev extra: installed by `make test`


@pytest.mark.parametrize("n,k,n_bins", [(1000, 10, 15), (500, 3, 10), (2000, 100, 20)])
def test_ece_and_mce_match_torchmetrics_on_continuous_data(n, k, n_bins):
    from torchmetrics.functional.classification import multiclass_calibration_error

    probs, targets = make_probs(n, k, seed=n + k, dtype=torch.float32)
    ours = F.ece(probs, targets, n_bins=n_bins)
    theirs = multiclass_calibration_error(probs, targets, num_classes=k, n_bins=n_bins, norm="l1")
    assert ours.item() == pytest.approx(theirs.item(), abs=2e-6)
    ours_max = F.mce(probs, targets, n_bins=n_bins)
    theirs_max = multiclass_calibration_error(probs, targets, num_classes=k, n_bins=n_bins, norm="max")
    assert ours_max.item() == pytest.approx(theirs_max.item(), abs=2e-6)


def test_known_difference_torchmetrics_bins_are_closed_on_the_left():
    """Documented difference: torchmetrics puts a confidence equal to an interior edge in the upper bin
    ([m/M, (m+1)/M)); SPEC §3 (and the papers' code) put it in the lower one ((m/M, (m+1)/M])."""
    from torchmetrics.functional.classification import multiclass_calibration_error

    probs = torch.tensor([[0.5, 0.5], [0.75, 0.25]])  # 0.5 is exact in float32; 2 bins
    targets = torch.tensor([0, 1])
    ours = F.ece(probs, targets, n_bins=2)  # 0.5 in bin 0 (gap 0.5), 0.75 in bin 1 (gap 0.75)
    theirs = multiclass_calibration_error(probs, targets, num_classes=2, n_bins=2, norm="l1")
    assert ours.item() == pytest.approx((0.5 + 0.75) / 2)
    assert theirs.item() == pytest.approx(abs(0.5 - (0.5 + 0.75) / 2))  # both in their bin 1


@pytest.mark.parametrize("n,k", [(1000, 10), (3000, 5)])
def test_ece_matches_netcal(n, k):
    netcal_ece = pytest.importorskip("netcal.metrics").ECE
    probs, targets = make_probs(n, k, seed=k)
    theirs = netcal_ece(bins=15).measure(probs.numpy(), targets.numpy())
    assert F.ece(probs, targets).item() == pytest.approx(theirs, abs=1e-9)


@pytest.mark.parametrize("n,k,sharp", [(500, 10, 3.0), (2000, 4, 1.0), (5000, 100, 5.0), (50, 2, 2.0)])
def test_smece_matches_relplot(n, k, sharp):
    relplot = pytest.importorskip("relplot")
    probs, targets = make_probs(n, k, seed=n, sharpness=sharp)
    conf, pred = probs.max(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = relplot.smECE(conf.numpy(), (pred == targets).double().numpy())
    assert F.smece(probs, targets).item() == pytest.approx(theirs, abs=1e-6)


def test_smece_fixed_sigma_matches_relplot():
    relplot = pytest.importorskip("relplot")
    probs, targets = make_probs(700, 5, seed=1)
    conf, pred = probs.max(1)
    for sigma in (0.01, 0.05, 0.3):
        theirs = relplot.smECE_sigma(conf.numpy(), (pred == targets).double().numpy(), sigma)
        assert F.smece(probs, targets, sigma=sigma).item() == pytest.approx(theirs, abs=1e-9)


def test_nll_matches_sklearn_log_loss():
    metrics = pytest.importorskip("sklearn.metrics")
    probs, targets = make_probs(800, 6, seed=2)
    theirs = metrics.log_loss(targets.numpy(), probs.numpy(), labels=list(range(6)))
    assert F.nll(probs, targets).item() == pytest.approx(theirs, abs=1e-10)


def test_brier_matches_sklearn_multiclass_brier():
    """scikit-learn's multiclass ``brier_score_loss`` sums over classes like Mukhoti et al. (range [0, 2])."""
    metrics = pytest.importorskip("sklearn.metrics")
    probs, targets = make_probs(300, 4, seed=3)
    theirs = metrics.brier_score_loss(targets.numpy(), probs.numpy(), labels=list(range(4)))
    assert F.brier(probs, targets).item() == pytest.approx(theirs, abs=1e-12)


@pytest.mark.parametrize("score", ["entropy", "max_prob"])
def test_ood_auroc_matches_sklearn(score):
    metrics = pytest.importorskip("sklearn.metrics")
    p_in, _ = make_probs(300, 10, seed=1, sharpness=5)
    p_out, _ = make_probs(200, 10, seed=2, sharpness=2)

    def s(p):
        p = p.numpy()
        return -(p * np.log(p)).sum(1) if score == "entropy" else -p.max(1)

    labels = np.r_[np.zeros(300), np.ones(200)]
    theirs = metrics.roc_auc_score(labels, np.r_[s(p_in), s(p_out)])
    assert F.ood_auroc(p_in, p_out, score=score).item() == pytest.approx(theirs, abs=1e-12)
