"""The models of Dual Focal Loss's Table 10: ResNet-110 with stochastic depth (Huang et al. 2016) and the original
DenseNet-40 (Huang et al. 2017): parameter counts against closed forms and the published ones, output shapes,
and the stochastic-depth rule (survival schedule, expectation scaling in evaluation, seeded drops in training)."""

import pytest
import torch

from torchcal.experiments.models.cifar import (
    BasicBlock,
    CifarDenseNet,
    CifarResNet,
    StochasticDepthResNet,
    survival_probabilities,
)
from torchcal.experiments.models.registry import create_model, list_models


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def resnet110_params(k, c=3, widths=(16, 32, 64), per_stage=18):
    """He et al.'s CIFAR ResNet counted by hand: 3 × 3 stem + BN; each basic block two 3 × 3 convolutions and
    two BNs (weight and bias); a 1 × 1 projection + BN where the width changes; the classifier."""
    total = c * widths[0] * 9 + 2 * widths[0]
    prev = widths[0]
    for w in widths:
        for j in range(per_stage):
            cin = prev if j == 0 else w
            total += cin * w * 9 + 2 * w + w * w * 9 + 2 * w
            if cin != w:
                total += cin * w + 2 * w
        prev = w
    return total + widths[-1] * k + k


def densenet40_params(k, c=3, growth=12, layers=12):
    """DenseNet-40 counted by hand: 3 × 3 stem of 16 channels; each layer BN + 3 × 3 conv to `growth`;
    transitions BN + 1 × 1 conv keeping the channels; final BN and the classifier."""
    planes = 16
    total = c * planes * 9
    for block in range(3):
        for _ in range(layers):
            total += 2 * planes + planes * growth * 9
            planes += growth
        if block < 2:
            total += 2 * planes + planes * planes
    return total + 2 * planes + planes * k + k


@pytest.mark.parametrize("k", [10, 100])
def test_parameter_counts_match_the_closed_forms_and_the_published_ones(k):
    sd, dense = create_model("resnet110_sd", k, (3, 32, 32)), create_model("densenet40", k, (3, 32, 32))
    assert n_params(sd) == resnet110_params(k) == n_params(create_model("resnet110_he", k, (3, 32, 32)))
    assert n_params(dense) == densenet40_params(k)
    if k == 10:  # the papers print 1.7M (He et al., Huang et al. 2016) and 1.0M (Huang et al. 2017, k = 12),
        # rounded to 0.1M: the counts must round to those
        assert round(n_params(sd) / 1e6, 1) == 1.7 and round(n_params(dense) / 1e6, 1) == 1.0


@pytest.mark.parametrize("name", ["resnet110_sd", "densenet40"])
@pytest.mark.parametrize("channels", [1, 3])
def test_outputs_for_one_and_three_channel_images(name, channels):
    stats = ((0.5,), (0.25,)) if channels == 1 else None
    model = create_model(name, 7, (channels, 32, 32), stats=stats)
    first = model.conv1 if name == "densenet40" else model.stem[0]
    assert first.in_channels == channels
    x = torch.rand(2, channels, 32, 32)
    with torch.no_grad():
        assert model.eval()(x).shape == (2, 7)
    assert model.train()(x).shape == (2, 7)
    assert name in list_models()


def test_densenet40_layout():
    """36 dense layers of BN-ReLU-conv 3 × 3 adding 12 channels each; transitions keep the channels (no
    compression) and halve the resolution; 16 + 3 · 12 · 12 = 448 features reach the classifier."""
    model = CifarDenseNet(40, 12, 10)
    convs = [m for m in model.features.modules() if isinstance(m, torch.nn.Conv2d)]
    kernels = [c.kernel_size for c in convs]
    assert kernels.count((3, 3)) == 36 and kernels.count((1, 1)) == 2
    assert all(c.out_channels == 12 for c in convs if c.kernel_size == (3, 3))
    assert [(c.in_channels, c.out_channels) for c in convs if c.kernel_size == (1, 1)] == [
        (160, 160),
        (304, 304),
    ]
    assert model.fc.in_features == 448
    assert not any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    with pytest.raises(ValueError, match="`depth` must be 3·n \\+ 4"):
        CifarDenseNet(41, 12, 10)


def test_survival_probabilities_follow_the_linear_rule():
    model = create_model("resnet110_sd", 10, (3, 32, 32))
    L = 54  # noqa: N806 - the paper's name
    expected = [1 - (i / L) * (1 - 0.5) for i in range(1, L + 1)]  # Huang et al.: p_l = 1 - l/L (1 - p_L)
    assert model.survival == pytest.approx(expected, abs=1e-15)
    assert [block.survival for block in model.layers] == model.survival
    assert model.survival[-1] == 0.5 and model.survival[0] == pytest.approx(1 - 0.5 / 54, abs=1e-15)
    steps = [a - b for a, b in zip(model.survival, model.survival[1:])]
    assert max(steps) - min(steps) < 1e-12  # linear: a constant step of (1 - p_L) / L
    assert survival_probabilities(2, 1.0) == [1.0, 1.0]
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="`final`"):
            survival_probabilities(3, bad)
    with pytest.raises(ValueError, match="`num_blocks`"):
        survival_probabilities(0)


def tiny_sd(final=0.5, channels=3):
    torch.manual_seed(0)
    return StochasticDepthResNet((2, 2, 2), 5, widths=(4, 8, 16), final_survival=final, in_channels=channels)


def by_hand(model, x, keep):
    """The network evaluated block by block: ReLU(keep_l · f_l(h) + shortcut_l(h)), keep_l a number."""
    h = model.stem(model.norm(x))
    for block, b in zip(model.layers, keep, strict=True):
        h = torch.relu(block.body(h) * b + block.shortcut(h))
    return model.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(h, 1), 1))


def test_evaluation_is_deterministic_and_scales_each_residual_by_its_survival_probability():
    model = tiny_sd().eval()
    x = torch.rand(3, 3, 16, 16)
    with torch.no_grad():
        out = model(x)
        assert torch.equal(out, model(x))
        # the same operations in the same order (× 1.0 and + 0 are exact): equal to the bit
        torch.testing.assert_close(out, by_hand(model, x, model.survival), rtol=0, atol=0)
        # and not the unscaled network: the scaling matters
        assert not torch.allclose(out, by_hand(model, x, [1.0] * 6), atol=1e-3)


def test_without_dropping_it_is_the_plain_resnet():
    """p_L = 1: every block survives, and the network is He et al.'s ResNet with the same weights, in
    training (batch statistics) and in evaluation."""
    model = tiny_sd(final=1.0)
    plain = CifarResNet(BasicBlock, (2, 2, 2), 5, widths=(4, 8, 16))
    plain.load_state_dict(model.state_dict())
    x = torch.rand(4, 3, 16, 16)
    torch.testing.assert_close(model.train()(x), plain.train()(x), rtol=0, atol=0)
    torch.testing.assert_close(model.eval()(x), plain.eval()(x), rtol=0, atol=0)


def called_blocks(model, x):
    """Which residual branches ran in one forward pass (a dropped branch is not computed)."""
    ran = []
    hooks = [block.body.register_forward_hook(lambda m, i, o, j=j: ran.append(j))
             for j, block in enumerate(model.layers)]  # fmt: skip
    out = model(x)
    for hook in hooks:
        hook.remove()
    return ran, out


def test_training_drops_whole_blocks_with_one_seeded_draw_each():
    """Each block draws b ~ Bernoulli(p_l) from the default CPU generator, in order; the same seed drops
    the same blocks, and the output is the network with the dropped branches removed."""
    model = tiny_sd().train()
    x = torch.rand(3, 3, 16, 16)
    for seed in range(5):
        torch.manual_seed(seed)
        expected_keep = [bool(torch.rand(()) < p) for p in model.survival]
        torch.manual_seed(seed)
        ran, out = called_blocks(model, x)
        assert ran == [j for j, k in enumerate(expected_keep) if k]
        keep = [float(k) for k in expected_keep]
        torch.testing.assert_close(out, by_hand(model, x, keep), rtol=0, atol=0)  # × 1.0, + 0: exact
    assert any(len(called_blocks(model, x)[0]) < 6 for _ in range(20))  # p_L = 0.5: drops happen


def test_a_dropped_block_gives_its_parameters_zero_gradients():
    """A dropped branch is not computed, yet each of its parameters gets a gradient of exactly 0 (not None):
    SGD's weight decay and momentum then update every block alike, and DistributedDataParallel finds every
    parameter used; a kept branch gets its ordinary gradient."""
    model = tiny_sd().train()
    x = torch.rand(3, 3, 16, 16)
    torch.manual_seed(1)
    keep = [bool(torch.rand(()) < p) for p in model.survival]
    assert not all(keep) and any(keep)  # this seed drops some blocks and keeps others
    torch.manual_seed(1)
    model(x).square().sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    for block, kept in zip(model.layers, keep, strict=True):
        grads = [p.grad for p in block.body.parameters()]
        if kept:
            assert any(g.abs().sum() > 0 for g in grads)
        else:
            assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


class Counting(torch.nn.Module):
    """A residual branch that counts its calls and returns its input (cheap, so 2,000 passes take little)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x


def test_training_survival_frequencies_follow_the_schedule():
    """Over 2,000 passes each block's survival frequency is within 4.5 binomial standard deviations of p_l
    (σ ≤ √(0.25 / 2000) ≈ 0.011): a false alarm has probability below 1e-5 per block. One stage of six blocks
    whose branches only count their calls (the drawing is the block's own code)."""
    model = StochasticDepthResNet((6,), 5, widths=(4,), final_survival=0.5, in_channels=1).train()
    for block in model.layers:
        block.body = Counting()
    x = torch.rand(2, 4, 4, 4)
    torch.manual_seed(123)
    n = 2000
    with torch.no_grad():
        for _ in range(n):  # the blocks as the network calls them, in order, without the stem and head
            for block in model.layers:
                block(x)
    assert model.survival == pytest.approx([1 - j / 12 for j in range(1, 7)], abs=1e-15)
    for block, p in zip(model.layers, model.survival, strict=True):
        sigma = (p * (1 - p) / n) ** 0.5
        assert abs(block.body.calls / n - p) <= 4.5 * sigma, (block.body.calls / n, p)


def test_the_presets_of_dual_focal_table_10_and_adafocal_svhn():
    """Table 10: {ResNet-110 (SD), DenseNet-40} x {CIFAR-10, CIFAR-100} x {CE, KDE-XE, DFL} on the CIFAR
    protocol (decision 184); AdaFocal Fig. 53: ResNet-110 on SVHN with CE, FLSD-53, AdaFocal for 50 epochs
    (decision 185)."""
    from torchcal.experiments.cli import list_presets
    from torchcal.experiments.config import load_config

    presets = list_presets()
    table10 = {name for name in presets if "_resnet110sd_" in name or "_densenet40_" in name}
    assert table10 == {f"{d}_{m}_{loss}" for d in ("cifar10", "cifar100") for m in ("resnet110sd", "densenet40")
                       for loss in ("ce", "kdexe", "dfl")}  # fmt: skip
    for name in sorted(table10):
        cfg = load_config(presets[name])
        dataset, short, loss = name.split("_")
        assert cfg.data.name == dataset and cfg.data.augment and cfg.data.val_size == 5000
        assert cfg.model.name == {"resnet110sd": "resnet110_sd", "densenet40": "densenet40"}[short]
        assert cfg.loss.name == {"ce": "ce", "kdexe": "kde-xe", "dfl": "dfl"}[loss], name
        assert (cfg.train.epochs, cfg.optim.lr, cfg.optim.milestones, cfg.optim.weight_decay) == (
            350, 0.1, [150, 250], 5e-4)  # fmt: skip
        assert cfg.data.loader.batch_size == 128 and cfg.loss.reduction == "sum"
    assert load_config(presets["cifar10_densenet40_kdexe"]).loss.kwargs == {
        "lambda_": 1.0,
        "bandwidth": "auto",
    }
    assert load_config(presets["cifar100_resnet110sd_dfl"]).loss.kwargs == {"gamma": 5.0}
    svhn = {name for name in presets if name.startswith("svhn")}
    assert svhn == {"svhn_resnet110_ce", "svhn_resnet110_flsd53", "svhn_resnet110_adafocal",
                    "svhn_resnet110_adafocal_schedule"}  # fmt: skip
    for name in sorted(svhn):
        cfg = load_config(presets[name])
        assert (cfg.data.name, cfg.model.name, cfg.train.epochs, cfg.optim.milestones) == (
            "svhn", "resnet110", 50, [25, 40])  # fmt: skip
        assert not cfg.data.augment and cfg.data.ood.sets == [] and cfg.data.shift.name == ""
        loss = name.removeprefix("svhn_resnet110_").removesuffix("_schedule")
        assert cfg.loss.name == loss.replace("flsd53", "flsd-53") and cfg.train.select == "last"
        # AdaFocal-schedule (Fig. 53's caption): per epoch to epoch 25, every 100 batches to 40, then every batch
        schedule = [[25, 100], [40, 1]] if name.endswith("_schedule") else []
        assert (cfg.loss.update_every, cfg.loss.update_schedule) == (0, schedule), name
