"""The stateful margin and penalty losses (SPEC §8): CALS's augmented-Lagrangian multiplier updates and AvUC's
threshold schedule, against float64 loop replays of the released code's update sequence, their training
accumulation (the runner's ``update(metrics=...)`` hook), checkpoints (``state_dict``) and refusals."""

import math

import pytest
import torch

import torchcal.functional as F
from torchcal.losses import ADAPTIVE_LOSSES, AvUCLoss, CALSLoss, create


def logits(n=24, k=4, seed=0, scale=8.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(n, k, generator=g, dtype=torch.float64), torch.randint(0, k, (n,), generator=g)


def cals_replay(
    batches, margin=10.0, gamma=1.2, tau=0.9, rho_step=10, lmin=1e-6, lmax=1e6, rmin=1.0, rmax=10.0
):
    """The released code's eval_epoch sequence, one validation set per epoch, with Python loops: λ_k ← clamp(
    mean_i clamp(max(0, λ_k + ρ_k h_ik), λmin, λmax)), c_k = mean_i h_ik, ρ every rho_step epochs."""
    k = batches[0].shape[1]
    lam, rho, prev = [lmin] * k, [rmin] * k, None
    for epoch, z in enumerate(batches):
        rows = z.tolist()
        grads, cons = [0.0] * k, [0.0] * k
        for row in rows:
            top = max(row)
            for c in range(k):
                h = (top - row[c] - margin) / margin
                grads[c] += min(max(max(0.0, lam[c] + rho[c] * h), lmin), lmax)
                cons[c] += h
        new_lam = [min(max(v / len(rows), lmin), lmax) for v in grads]
        c_now = [v / len(rows) for v in cons]
        if (epoch + 1) % rho_step == 0 and prev is not None:
            rho = [min(max(gamma * r if c_now[j] > tau * max(prev[j], 0.0) else r, rmin), rmax)
                   for j, r in enumerate(rho)]  # fmt: skip
        lam, prev = new_lam, c_now
    return torch.tensor(lam, dtype=torch.float64), torch.tensor(rho, dtype=torch.float64)


def test_cals_updates_are_the_released_codes_sequence():
    """Five epochs of validation logits with ρ updated every 2 epochs: λ and ρ equal the loop replay (each
    epoch's logits are scaled up so that the constraint means rise and ρ grows)."""
    batches = [logits(seed=s, scale=6.0 + 6 * s)[0] for s in range(5)]
    loss = CALSLoss(rho_step=2)
    for z in batches:
        loss.update(z)
    lam, rho = cals_replay(batches, rho_step=2)
    # float64 on both sides, sums in another order
    torch.testing.assert_close(loss.lambdas, lam, rtol=1e-12, atol=0)
    torch.testing.assert_close(loss.rhos, rho, rtol=1e-12, atol=0)
    assert (loss.rhos > 1).any() and int(loss.updates) == 5
    # the multipliers enter the next forward pass as the PHR penalty's constants
    z, y = logits(seed=9)
    torch.testing.assert_close(loss(z, y), F.cals_loss(z, y, lam, rho))


def test_cals_training_accumulation_is_the_update_of_the_epochs_positions():
    """Without logits (the runner's update(metrics=...)), update() averages over the training positions seen
    since the last update, ignored labels left out; forward passes without gradient are not counted."""
    (z, y), (z2, y2) = logits(seed=1), logits(seed=2)
    y[[0, 5]] = -100
    trained = CALSLoss(num_classes=4)
    trained(z.clone().requires_grad_(True), y)
    trained(z2.clone().requires_grad_(True), y2)
    with torch.no_grad():
        trained(3 * z, y)  # an evaluation pass: not counted
    trained.update(metrics=object())
    explicit = CALSLoss()
    explicit.update(torch.cat([z, z2]), torch.cat([y, y2]))
    torch.testing.assert_close(trained.lambdas, explicit.lambdas, rtol=1e-12, atol=0)
    assert (trained.statistics == 0).all()
    before = trained.lambdas.clone()
    trained.update()  # nothing accumulated: nothing changes
    torch.testing.assert_close(trained.lambdas, before)


def test_cals_checkpoint_restores_the_state(tmp_path):
    z, y = logits(seed=3)
    loss = CALSLoss(rho_step=1)
    for s in range(3):
        loss.update(logits(seed=s, scale=5.0 + 5 * s)[0])
    loss(z.clone().requires_grad_(True), y)  # a half-done epoch: its sums are part of the state
    torch.save({"loss": loss.state_dict()}, tmp_path / "ckpt.pt")
    restored = CALSLoss(rho_step=1)  # not sized yet: the checkpoint sizes it
    restored.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True)["loss"])
    for name in ("lambdas", "rhos", "previous_constraint", "statistics", "updates"):
        torch.testing.assert_close(getattr(restored, name), getattr(loss, name))
    loss.update()
    restored.update()
    torch.testing.assert_close(restored.lambdas, loss.lambdas)
    torch.testing.assert_close(restored.rhos, loss.rhos)


def test_cals_refusals_and_registry():
    with pytest.raises(ValueError, match="holds multipliers for 4 classes, got logits with 3"):
        CALSLoss(num_classes=4)(torch.zeros(2, 3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="`weight` is not accepted: CALS's multipliers"):
        create("cals", weight=torch.ones(3))
    with pytest.raises(ValueError, match="needs logits"):
        CALSLoss().update(torch.zeros(2, 3), from_logits=False)
    with pytest.raises(ValueError, match=r"`lambdas` and `rhos` must have shape \(3,\)"):
        F.cals_loss(torch.zeros(2, 3), torch.tensor([0, 1]), torch.ones(4), torch.ones(4))
    z, y = torch.zeros(2, 3), torch.tensor([0, 1])
    lam = torch.full((3,), 1e-6)
    # both paths: a float32 λ, ρ reach the C++ operator where it is built, a ρ with gradient the torch path
    for rho in (torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1.0, 0.0, 1.0], requires_grad=True)):
        with pytest.raises(ValueError, match=r"`rhos` must be finite and > 0 .*got 0.0 for class 1"):
            F.cals_loss(z, y, lam, rho)
    with pytest.raises(ValueError, match=r"`rhos` must be finite and > 0 .*got nan for class 2"):
        F.cals_loss(z, y, lam, torch.tensor([1.0, 1.0, float("nan")]))
    with pytest.raises(ValueError, match=r"`lambdas` must be finite and >= 0 .*got -1.0 for class 0"):
        F.cals_loss(z, y, torch.tensor([-1.0, 0.0, 0.0]), torch.ones(3))
    with pytest.raises(ValueError, match=r"`lambdas` must be finite and >= 0 .*got inf for class 1"):
        F.cals_statistics(z, y, torch.tensor([0.0, float("inf"), 0.0]), torch.ones(3))
    # checked in the logits' dtype: a float64 ρ of 1e-50 is 0 in float32 (the operator's path and the torch
    # path alike)
    for rho in (torch.full((3,), 1e-50, dtype=torch.float64), torch.full((3,), 1e-50, dtype=torch.float64,
                                                                       requires_grad=True)):  # fmt: skip
        with pytest.raises(ValueError, match=r"`rhos` must be finite and > 0 .*got 0.0 for class 0"):
            F.cals_loss(z, y, lam.double(), rho)
    # an update from NaN logits names the statistics and leaves λ, ρ and the accumulated sums as they were
    loss = CALSLoss(num_classes=3)
    before = {name: getattr(loss, name).clone() for name in ("lambdas", "rhos", "statistics")}
    bad = torch.tensor([[0.0, float("nan"), 1.0], [1.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match=r"CALSLoss.update: the statistics of class 0 are not finite"):
        loss.update(bad)
    for name, value in before.items():
        assert torch.equal(getattr(loss, name), value)
    assert (
        isinstance(create("cals"), CALSLoss) and CALSLoss in ADAPTIVE_LOSSES and AvUCLoss in ADAPTIVE_LOSSES
    )


def test_cals_phr_penalty_is_flat_below_the_constraint_while_lambda_is_small():
    """With λ = 1e-6 (the start) and h = −1 at the arg-max, P = −λ²/(2ρ): the value moves, the gradient of
    the penalty is 0 wherever λ + ρh <= 0, i.e. every distance below the margin."""
    z = torch.tensor([[1.0, 0.0, -2.0]], dtype=torch.float64, requires_grad=True)
    lam, rho = torch.full((3,), 1e-6, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    loss = F.cals_loss(z, torch.tensor([0]), lam, rho)
    (grad,) = torch.autograd.grad(loss, z)
    (ce_grad,) = torch.autograd.grad(torch.nn.functional.cross_entropy(z, torch.tensor([0])), z)
    torch.testing.assert_close(grad, ce_grad)
    # the penalty's value: the mean over the 3 entries of −λ²/(2ρ)
    penalty = loss - torch.nn.functional.cross_entropy(z, torch.tensor([0]))
    torch.testing.assert_close(penalty, torch.tensor(-(1e-6**2) / 2, dtype=torch.float64))


def avuc_threshold(z, y):
    """½(mean entropy of the correct + mean entropy of the wrong predictions), one row at a time."""
    right, wrong = [], []
    for row, label in zip(torch.softmax(z, 1).tolist(), y.tolist()):
        h = -sum(p * math.log(p + 1e-10) for p in row)
        (right if max(range(len(row)), key=row.__getitem__) == label else wrong).append(h)
    return 0.5 * (sum(right) / len(right) + sum(wrong) / len(wrong))


def test_avuc_threshold_schedule():
    """u_th starts at 1, follows the validation entropies for warmup_epochs updates, then stays."""
    loss = AvUCLoss(warmup_epochs=2)
    assert float(loss.threshold) == 1.0
    batches = [logits(seed=s, scale=2.0)[::1] for s in range(3)]
    for i, (z, y) in enumerate(batches):
        loss.update(z, y)
        want = avuc_threshold(*batches[min(i, 1)])
        assert abs(float(loss.threshold) - want) < 1e-12
    # probabilities instead of logits
    other = AvUCLoss()
    other.update(torch.softmax(batches[0][0], 1), batches[0][1], from_logits=False)
    assert abs(float(other.threshold) - avuc_threshold(*batches[0])) < 1e-9
    # the threshold in force is the loss's
    z, y = logits(seed=7, scale=2.0)
    torch.testing.assert_close(loss(z, y), F.avuc_loss(z, y, threshold=float(loss.threshold)))


def test_avuc_training_accumulation_and_checkpoint(tmp_path):
    (z, y), (z2, y2) = logits(seed=4, scale=2.0), logits(seed=5, scale=2.0)
    loss = AvUCLoss()
    loss(z.clone().requires_grad_(True), y)
    loss(z2.clone().requires_grad_(True), y2)
    state = {k: v.clone() for k, v in loss.state_dict().items()}
    loss.update(metrics=None)  # the runner's call: the training predictions of the epoch
    assert abs(float(loss.threshold) - avuc_threshold(torch.cat([z, z2]), torch.cat([y, y2]))) < 1e-12
    restored = AvUCLoss()
    restored.load_state_dict(state)
    restored.update()
    assert float(restored.threshold) == float(loss.threshold) and int(restored.updates) == 1
    # a batch without a wrong prediction leaves u_th as it is
    kept = AvUCLoss()
    zz = torch.tensor([[3.0, 0.0], [0.0, 3.0]])
    kept.update(zz, torch.tensor([0, 1]))
    assert float(kept.threshold) == 1.0 and int(kept.updates) == 1


def test_cals_and_avuc_statistics_are_the_global_ones_under_ddp(ddp_results):
    """2 gloo processes, each with half the training batch: update() all-reduces the sums, so each rank
    holds the multipliers and the threshold of the whole batch."""
    z, y = logits(n=16, seed=11)
    whole = CALSLoss()
    whole.update(z, y)
    avuc = AvUCLoss()
    avuc.update(z, y)
    for lambdas, threshold in ddp_results:
        torch.testing.assert_close(lambdas, whole.lambdas, rtol=1e-12, atol=0)
        assert abs(threshold - float(avuc.threshold)) < 1e-12


def _worker(rank, world, port, out):
    import os

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        z, y = logits(n=16, seed=11)
        z, y = z.chunk(world)[rank].clone().requires_grad_(True), y.chunk(world)[rank]
        cals, avuc = CALSLoss(), AvUCLoss()
        cals(z, y)
        avuc(z, y)
        cals.update(metrics=None)
        avuc.update(metrics=None)
        torch.save((cals.lambdas, float(avuc.threshold)), f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    import torch.multiprocessing as mp

    from tests.conftest import free_port

    out = str(tmp_path_factory.mktemp("ddp") / "rank")
    mp.start_processes(_worker, args=(2, free_port(), out), nprocs=2, start_method="spawn")
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
