"""MDCA's, DCA's, SB-ECE's, AvUC's, S-AvUC's and ESD's batch terms under torch.distributed, with 2 gloo processes on CPU: ``sync=False`` (the
reference's behaviour) is each rank's batch; ``sync=True`` is the global batch, its value that of one
process holding the whole batch, and its gradients, once averaged over the ranks as data parallelism does,
those of the whole batch's loss."""

import os

import pytest
import torch
import torch.multiprocessing as mp

import torchcal.functional as F
from tests.conftest import free_port

K = 4
LOSSES = {
    "mdca": lambda z, y, sync: F.mdca_loss(z, y, 2.0, sync=sync),
    "focal-mdca": lambda z, y, sync: F.mdca_loss(z, y, base="focal", sync=sync),
    "dca": lambda z, y, sync: F.dca_loss(z, y, sync=sync),
    "sb-ece": lambda z, y, sync: F.sbece_loss(z, y, sync=sync),
    "sb-ece-binned": lambda z, y, sync: F.sbece_loss(z, y, form="binned", sync=sync),
    "avuc": lambda z, y, sync: F.avuc_loss(z, y, threshold=0.8, sync=sync),
    "s-avuc": lambda z, y, sync: F.soft_avuc_loss(z, y, temperature=0.2, kappa=0.3, sync=sync),
    "esd": lambda z, y, sync: F.esd_loss(z, y, sync=sync),
}


def _batch():
    """A global batch of 12 positions: 2 ranks × (3, K, 2) logits, one ignored label on rank 1."""
    g = torch.Generator().manual_seed(0)
    z = 3 * torch.randn(6, K, 2, generator=g, dtype=torch.float64)
    y = torch.randint(0, K, (6, 2), generator=g)
    y[4, 1] = -100
    return z, y


def _worker(rank, world, port, out):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        z, y = _batch()
        z, y = z.chunk(world)[rank].clone().requires_grad_(True), y.chunk(world)[rank]
        results = {}
        for name, fn in LOSSES.items():
            for sync in (False, True):
                z.grad = None
                loss = fn(z, y, sync)
                loss.backward()
                results[name, sync] = (loss.detach(), z.grad.clone())
        torch.save(results, f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ddp") / "rank")
    mp.start_processes(_worker, args=(2, free_port(), out), nprocs=2, start_method="spawn")
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_sync_is_the_global_batch(ranks, name):
    """Each rank's loss is its own base term plus the batch term of the whole batch (one process's value);
    the ranks' gradients, averaged as DDP does, are those of mean_r(base_r) + β·term(whole batch)."""
    z, y = _batch()
    fn = LOSSES[name]
    whole_term = fn(z, y, False) - _base(name, z, y)  # the global batch term, computed in one process
    for r in range(2):
        value = ranks[r][name, True][0]
        # float64 on both sides; the all-reduce adds the two ranks' sums in another order
        torch.testing.assert_close(value - _base(name, *_part(z, y, r)), whole_term, rtol=1e-12, atol=1e-14)
    zz = z.clone().requires_grad_(True)
    bases = [_base(name, *_part(zz, y, r)) for r in range(2)]
    global_loss = (bases[0] + bases[1]) / 2 + fn(zz, y, False) - _base(name, zz, y)
    (grad,) = torch.autograd.grad(global_loss, zz)
    ddp = torch.cat([ranks[0][name, True][1], ranks[1][name, True][1]]) / 2
    torch.testing.assert_close(ddp, grad, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_without_sync_each_rank_has_its_own_batch_term(ranks, name):
    z, y = _batch()
    for r in range(2):
        part = _part(z, y, r)
        value, grad = ranks[r][name, False]
        zz = part[0].clone().requires_grad_(True)
        want = LOSSES[name](zz, part[1], False)
        torch.testing.assert_close(value, want.detach(), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, torch.autograd.grad(want, zz)[0], rtol=1e-12, atol=1e-14)
    # and the per-rank term is not the global one on this batch
    assert not torch.allclose(ranks[0][name, False][0], ranks[0][name, True][0])


def _part(z, y, r):
    return z.chunk(2)[r], y.chunk(2)[r]


def _base(name, z, y):
    """The per-rank base term (the loss with β = 0)."""
    if name == "dca":
        return F.dca_loss(z, y, 0.0)
    if name.startswith("sb-ece"):
        return F.sbece_loss(z, y, 0.0)
    if name == "avuc":
        return F.avuc_loss(z, y, 0.0)
    if name == "s-avuc":
        return F.soft_avuc_loss(z, y, 0.0, temperature=0.2, kappa=0.3)
    if name == "esd":
        return F.esd_loss(z, y, 0.0)
    return F.mdca_loss(z, y, 0.0, base="focal" if name == "focal-mdca" else "nll")
