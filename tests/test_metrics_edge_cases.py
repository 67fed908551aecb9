"""Hand-computed cases: bin edges, confidence 1.0, ties, empty bins, one sample."""

import math

import pytest
import torch

import torchcal.functional as F

# every test here runs on the C++ CPU operators and on the torch path
pytestmark = pytest.mark.usefixtures("cpu_backend")


def two_class(confs, dtype=torch.float64):
    c = torch.tensor(confs, dtype=dtype)
    return torch.stack([c, 1 - c], dim=1)


def test_confidence_on_a_bin_edge_goes_to_the_lower_bin():
    # conf 0.6 with 5 bins: edge 3/5 belongs to bin (0.4, 0.6]; the other sample lands in (0.6, 0.8].
    probs = two_class([0.6, 0.7])
    targets = torch.tensor([0, 1])
    from torchcal.plotting import reliability_diagram_data

    data = reliability_diagram_data(probs, targets, n_bins=5)
    assert data.count.tolist() == [0, 0, 1, 1, 0]
    # ECE = 1/2 |1 - 0.6| + 1/2 |0 - 0.7| = 0.55
    assert F.ece(probs, targets, n_bins=5).item() == pytest.approx(0.55, abs=1e-15)


def test_float32_edge_compared_as_float64():
    # float32(0.6) = 0.60000002384 > 0.6, so it belongs to the upper bin (0.6, 0.8]
    probs = two_class([0.6], dtype=torch.float32)
    from torchcal.plotting import reliability_diagram_data

    assert reliability_diagram_data(probs, torch.tensor([0]), n_bins=5).count.tolist() == [0, 0, 0, 1, 0]
    # float32(0.2) = 0.20000000298 > 0.2 likewise; float32(0.5) is exact and stays in the lower bin
    half = two_class([0.5], dtype=torch.float32)
    assert reliability_diagram_data(half, torch.tensor([0]), n_bins=2).count.tolist() == [1, 0]


def test_confidence_one_is_in_the_last_bin_and_zero_gap_when_right():
    probs = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    targets = torch.tensor([0, 1])
    assert F.ece(probs, targets).item() == 0.0
    assert F.mce(probs, targets).item() == 0.0
    assert F.nll(probs, targets).item() == 0.0
    assert F.brier(probs, targets).item() == 0.0
    # wrong at confidence 1: NLL is -log(tiny) of float32, not inf
    wrong = F.nll(probs, torch.tensor([1, 0]))
    assert wrong.item() == pytest.approx(-math.log(torch.finfo(torch.float32).tiny))
    assert F.ece(probs, torch.tensor([1, 0])).item() == 1.0


def test_ties_in_the_maximum_predict_the_lowest_index():
    probs = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    assert F.error_rate(probs, torch.tensor([0, 1])).item() == 0.5
    # conf 0.5 in bin (0.4, 0.5] of 10; correct for row 0 only: ECE = |0.5 - 0.5| = 0
    assert F.ece(probs, torch.tensor([0, 1]), n_bins=10).item() == 0.0


def test_empty_bins_add_nothing_and_mce_skips_them():
    probs = two_class([0.95, 0.95, 0.55])
    targets = torch.tensor([0, 0, 0])
    # bins of 10: (0.9, 1.0] holds two correct at 0.95 -> gap 0.05; (0.5, 0.6] holds one correct at 0.55 -> 0.45
    assert F.ece(probs, targets, n_bins=10).item() == pytest.approx((2 * 0.05 + 0.45) / 3, abs=1e-15)
    assert F.mce(probs, targets, n_bins=10).item() == pytest.approx(0.45, abs=1e-15)


def test_one_sample():
    probs = two_class([0.8])
    assert F.ece(probs, torch.tensor([0])).item() == pytest.approx(0.2, abs=1e-15)
    assert F.adaece(probs, torch.tensor([1])).item() == pytest.approx(0.8, abs=1e-15)
    assert F.debiased_ece(probs, torch.tensor([0])).item() == 0.0  # a bin of one sample adds 0
    value, b = F.ece_sweep(probs, torch.tensor([0]), return_n_bins=True)
    assert b == 1 and value.item() == pytest.approx(0.2, abs=1e-15)


def test_equal_mass_with_fewer_samples_than_bins_and_ties():
    # 3 samples, 15 bins: three groups of one, twelve empty; AdaECE = mean |correct - conf|
    probs = two_class([0.7, 0.7, 0.9])
    targets = torch.tensor([0, 1, 0])
    assert F.adaece(probs, targets).item() == pytest.approx((0.3 + 0.7 + 0.1) / 3, abs=1e-15)
    # 2 bins, sizes 2 and 1: sorted (0.7 ok, 0.7 wrong | 0.9 ok) -> 2/3*|0.5-0.7| + 1/3*|1-0.9|
    assert F.adaece(probs, targets, n_bins=2).item() == pytest.approx(2 / 3 * 0.2 + 1 / 3 * 0.1, abs=1e-15)


def test_classwise_hand_computed():
    probs = two_class([0.9, 0.6, 0.3])
    targets = torch.tensor([0, 1, 1])
    # class 0 (10 bins): p = .9 (y=1), .6 (y=0), .3 (y=0): gaps .1, .6, .3 -> 1/3; class 1 the mirror -> 1/3
    assert F.classwise_ece(probs, targets, n_bins=10).item() == pytest.approx(1 / 3, abs=1e-15)


def test_classwise_averages_over_all_columns_including_unseen_classes():
    probs = torch.tensor([[0.8, 0.2, 0.0], [0.3, 0.7, 0.0]], dtype=torch.float64)
    targets = torch.tensor([0, 1])
    # columns 0 and 1: |1-.8|/2 + |0-.3|/2 = .25 each ; column 2 contributes 0; mean over K = 3
    assert F.classwise_ece(probs, targets, n_bins=10).item() == pytest.approx(0.5 / 3, abs=1e-15)


def test_debiased_hand_computed():
    probs = two_class([0.9, 0.8, 0.6, 0.7])
    targets = torch.tensor([1, 1, 1, 1])  # all wrong: acc 0, variance term 0
    # groups (.6,.7) and (.8,.9): gaps .65 and .85 -> sqrt(.5*.65^2 + .5*.85^2)
    expected = math.sqrt(0.5 * 0.65**2 + 0.5 * 0.85**2)
    assert F.debiased_ece(probs, targets, n_bins=2).item() == pytest.approx(expected, abs=1e-15)


def test_debiased_clamps_negative_estimates_to_zero():
    probs = two_class([0.5, 0.5, 0.5, 0.5])
    targets = torch.tensor([0, 1, 0, 1])  # perfectly calibrated: gap 0, variance term > 0
    assert F.debiased_ece(probs, targets, n_bins=1).item() == 0.0


def test_sweep_monotone_data_uses_every_sample_as_a_bin():
    probs = two_class([0.6, 0.7, 0.8, 0.9])
    targets = torch.tensor([1, 1, 0, 0])  # sorted correctness 0,0,1,1 is monotone
    value, b = F.ece_sweep(probs, targets, return_n_bins=True)
    assert b == 4
    assert value.item() == pytest.approx((0.6 + 0.7 + 0.2 + 0.1) / 4, abs=1e-15)


def test_s99_none_confident_gives_nan_accuracy():
    frac, acc = F.confidence_at_least(two_class([0.6, 0.7]), torch.tensor([0, 0]))
    assert frac.item() == 0.0 and math.isnan(acc.item())


def test_ood_auroc_identical_sets_is_half_and_separable_is_one():
    p, _ = two_class([0.9, 0.8]), None
    assert F.ood_auroc(p, p).item() == 0.5
    assert F.ood_auroc(two_class([0.99, 0.98]), two_class([0.5, 0.55])).item() == 1.0
    assert F.ood_auroc(two_class([0.99, 0.98]), two_class([0.5, 0.55]), score="max_prob").item() == 1.0


def test_perfectly_calibrated_samples_have_small_ece():
    # targets drawn from the model's own probabilities: every estimator should be near 0
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(2 * torch.randn(200_000, 4, generator=g, dtype=torch.float64), 1)
    targets = torch.multinomial(probs, 1, generator=g).squeeze(1)
    assert F.ece(probs, targets).item() < 0.006
    assert F.adaece(probs, targets).item() < 0.006
    assert F.classwise_ece(probs, targets).item() < 0.006
    assert F.smece(probs, targets).item() < 0.01
    assert F.debiased_ece(probs, targets).item() < 0.006
    # and clearly positive for a sharpened model
    sharp = torch.softmax(2 * torch.log(probs), 1)
    assert F.ece(sharp, targets).item() > 0.05


@pytest.mark.parametrize("k", [20, 40])  # the C++ scan: a bit mask up to 32 classes, a search beyond
def test_ties_with_many_classes_predict_the_lowest_index(k):
    # equal maxima at classes 3 and 7
    probs = torch.full((2, k), 0.02, dtype=torch.float64)
    probs[:, 3] = probs[:, 7] = 0.32
    probs = probs / probs.sum(1, keepdim=True)
    assert F.error_rate(probs, torch.tensor([3, 7])).item() == 0.5  # class 3 is the prediction
    uniform = torch.full((3, k), 1 / k, dtype=torch.float64)
    assert F.error_rate(uniform, torch.tensor([0, 1, k - 1])).item() == pytest.approx(2 / 3)


@pytest.mark.parametrize("sigma", [0.003, 0.01, 0.0625, 0.4, 1.0])  # G = 3334 below σ = 0.01, else 1001
def test_smece_at_a_bandwidth_equals_a_direct_convolution(sigma, cpu_backend):
    """The FFT convolution in numpy (every device) against the float64 reference's direct convolution."""
    from tests.reference import metrics as R
    from torchcal.functional.calibration import _smooth_ece_at

    g = torch.Generator().manual_seed(3)
    conf = 0.3 + 0.7 * torch.rand(3000, generator=g, dtype=torch.float64)
    correct = torch.rand(3000, generator=g, dtype=torch.float64) < conf**2
    got = _smooth_ece_at(conf, correct, sigma)
    assert got.dtype == torch.float64 and got.device == conf.device
    want = R.smece_at(conf.numpy(), correct.numpy(), sigma)
    assert 0.0 < want < 1.0
    assert abs(got.item() - want) < 1e-10


@pytest.mark.parametrize("g", [2, 3, 1001, 1334, 3334])
def test_smece_fft_length_keeps_the_wanted_outputs_free_of_aliasing(g):
    """The convolution's FFT length is the smallest 5-smooth length holding the reflected grid; the G
    outputs smECE keeps equal those of a full linear convolution."""
    import numpy as np

    from torchcal.functional.calibration import _fft_size

    size = _fft_size(g)
    assert size >= 3 * g - 2
    assert _is_5_smooth(size)
    assert not any(_is_5_smooth(m) for m in range(3 * g - 2, size))  # the smallest such length
    rng = np.random.default_rng(g)
    ext, kernel = rng.random(3 * g - 2), rng.random(g)
    full = np.convolve(ext, kernel)  # the linear convolution, 4G - 3 values
    circular = np.fft.irfft(np.fft.rfft(ext, size) * np.fft.rfft(kernel, size), size)
    start = g - 1 + g // 2
    np.testing.assert_allclose(circular[start : start + g], full[start : start + g], rtol=1e-10, atol=1e-10)


def _is_5_smooth(m):
    for p in (2, 3, 5):
        while m % p == 0:
            m //= p
    return m == 1


@pytest.mark.parametrize("m", [3, 1000, 1777, 2999])
def test_sweep_blocks_find_the_same_bin_count_as_a_loop_over_b(m):
    """One swapped pair in otherwise sorted correctness: the sweep stops at a large b (thousands), so the
    search crosses several blocks; a plain loop over b (numpy's array_split sizes) is the reference."""
    import numpy as np

    n = 3000
    conf = torch.linspace(0.5, 0.99, n, dtype=torch.float64)
    correct = np.zeros(n)
    correct[m:] = 1.0
    correct[m - 1], correct[m] = 1.0, 0.0

    def bins(b):  # array_split: the first n mod b parts one longer
        sizes = np.full(b, n // b)
        sizes[: n % b] += 1
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        return starts, sizes

    best = 1
    for b in range(2, n + 1):
        starts, sizes = bins(b)
        if (np.diff(np.add.reduceat(correct, starts) / sizes) < 0).any():
            break
        best = b
    probs = torch.stack([conf, 1 - conf], 1)
    value, b = F.ece_sweep(probs, torch.from_numpy(1 - correct).long(), return_n_bins=True)
    assert b == best and b > 64
    starts, sizes = bins(b)
    gaps = np.abs(np.add.reduceat(correct, starts) - np.add.reduceat(conf.numpy(), starts)) / n
    assert value.item() == pytest.approx(gaps.sum(), abs=1e-12)
