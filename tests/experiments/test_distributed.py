"""Data-parallel training: 2 gloo processes on CPU match one process with the same global batch, and
AdaFocal's γ agree across ranks (computed from the globally reduced validation statistics)."""

import datetime
import json
import os

import torch
import torch.multiprocessing as mp

from tests.conftest import assert_weights_match_up_to_sum_order, free_port
from torchcal.experiments.config import load_config
from torchcal.experiments.training.loop import train

# plain SGD: the ranks' gradient sums differ from the single process's in their last bits only (another order
# of the same float32 terms), and SGD keeps it so; Adam would blow a near-zero gradient's rounding noise up
# into a whole step (see assert_weights_match_up_to_sum_order)
ARGS = ["data.name=digits", "data.ood.sets=[]", "data.val_size=260", "data.loader.batch_size=64", "model.width=16",
        "train.epochs=2", "train.num_threads=1", "loss.name=adafocal", "optim.name=sgd", "optim.momentum=0",
        "optim.lr=0.05"]  # fmt: skip
STEPS = 2 * 17  # 2 epochs of 1,040 training digits in batches of 64


def _worker(rank, world, port, run_dir, out, resume, stop_after):
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
    rows = train(load_config(None, ARGS), run_dir, resume=resume, stop_after=stop_after)
    with open(f"{out}.{rank}", "w") as fh:
        json.dump(rows, fh)
    torch.distributed.destroy_process_group()


def test_two_gloo_ranks_match_one_process_across_a_resume(tmp_path):
    single = train(load_config(None, ARGS), tmp_path / "single")
    for resume, stop_after in ((False, 1), (True, None)):  # stop after epoch 1, then --resume the 2-rank run
        mp.start_processes(_worker, args=(2, free_port(), str(tmp_path / "ddp"), str(tmp_path / "rows"), resume,
                                          stop_after), nprocs=2, start_method="spawn")  # fmt: skip
    ranks = [json.loads((tmp_path / f"rows.{r}").read_text()) for r in range(2)]
    # every rank holds identical γ, equal to the single process's
    assert ranks[0][-1]["gammas"] == ranks[1][-1]["gammas"]
    a = torch.load(tmp_path / "single" / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "ddp" / "checkpoint.pt", weights_only=True)["model"]
    assert_weights_match_up_to_sum_order(a, b, STEPS)
    # metrics and γ of models that agree to ~1e-5 relative: 1e-4 leaves room for the float32 forward pass
    # (a confidence that crosses a bin edge would move an ECE by ~1/260, far above: it does not happen here)
    torch.testing.assert_close(torch.tensor(ranks[0][-1]["gammas"]), torch.tensor(single[-1]["gammas"]),
                               rtol=1e-4, atol=1e-5)  # fmt: skip
    for key in ("val_ece", "val_nll", "test_ece", "test_error", "train_loss"):
        assert abs(ranks[0][-1][key] - single[-1][key]) < 1e-4, key
    assert (tmp_path / "ddp" / "logits.pt").exists()  # rank 0 wrote the run's files


# a global batch of 3 shared 2/1 by the ranks, then a last batch of 1 that leaves rank 1 nothing
UNEVEN = ["data.name=digits", "data.ood.sets=[]", "data.val_size=260", "data.loader.batch_size=3", "data.limit_train=4",
          "model.width=16", "train.epochs=1", "train.num_threads=1", "train.calibrators=[]", "train.test_every=0",
          "loss.name=ce", "optim.name=sgd", "optim.momentum=0", "optim.lr=0.5"]  # fmt: skip


def _uneven_worker(rank, world, port, run_dir, out, args):
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
    # a rank left out of a collective fails the test in a minute instead of hanging it
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rows = train(load_config(None, args), run_dir)
    with open(f"{out}.{rank}", "w") as fh:
        json.dump(rows, fh)
    torch.distributed.destroy_process_group()


def test_uneven_and_empty_rank_shares_step_like_one_process(tmp_path):
    """Every rank joins every step's all-reduce, also one whose share of the batch is empty, and a "mean" loss
    weights every sample of the global batch alike: the 2-rank weights are the single process's."""
    single = train(load_config(None, UNEVEN), tmp_path / "single")
    mp.start_processes(_uneven_worker, args=(2, free_port(), str(tmp_path / "ddp"), str(tmp_path / "rows"), UNEVEN),
                       nprocs=2, start_method="spawn")  # fmt: skip
    a = torch.load(tmp_path / "single" / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "ddp" / "checkpoint.pt", weights_only=True)["model"]
    assert_weights_match_up_to_sum_order(a, b, steps=2)
    ranks = [json.loads((tmp_path / f"rows.{r}").read_text()) for r in range(2)]
    assert abs(ranks[0][-1]["train_loss"] - single[-1]["train_loss"]) < 1e-5


AUGMENTED = ["data.name=digits", "data.ood.sets=[]", "data.val_size=260", "data.loader.batch_size=8",
             "data.limit_train=8", "data.augment=true", "model.width=16", "train.epochs=1", "train.num_threads=1",
             "train.calibrators=[]", "train.test_every=0", "loss.name=ce", "optim.name=sgd"]  # fmt: skip


def _crop_offsets(generator: torch.Generator, batch: int, padding: int = 4) -> list:
    """The (row, column) offsets random_crop_flip draws first from ``generator`` (which it leaves as is)."""
    replay = torch.Generator()
    replay.set_state(generator.get_state())
    return [torch.randint(0, 2 * padding + 1, (batch,), generator=replay).tolist() for _ in range(2)]


def _train_recording_crops(args, run_dir) -> list:
    """Train, recording the crop offsets of every in-loop augmentation call."""
    import torchcal.experiments.training.loop as loop

    calls, crop = [], loop.random_crop_flip

    def recording(x, generator, padding=4):
        calls.append(_crop_offsets(generator, x.shape[0], padding))
        return crop(x, generator, padding)

    loop.random_crop_flip = recording
    try:
        train(load_config(None, args), run_dir)
    finally:
        loop.random_crop_flip = crop
    return calls


def _crops_worker(rank, world, port, run_dir, out):
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    calls = _train_recording_crops(AUGMENTED, run_dir)
    with open(f"{out}.{rank}", "w") as fh:
        json.dump(calls, fh)
    torch.distributed.destroy_process_group()


def _expected_first_offsets(batch: int, seed: int = 0, epoch: int = 0, n: int = 8) -> list:
    """One process's stream: seeded by (seed, epoch), advanced past the epoch's permutation."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    torch.randperm(n, generator=generator)
    return _crop_offsets(generator, batch)


def test_one_process_draws_the_seed_and_epoch_stream(tmp_path):
    calls = _train_recording_crops(AUGMENTED, tmp_path / "single")
    assert calls[0] == _expected_first_offsets(batch=8)


def test_ranks_draw_their_own_crops_and_rank_zero_the_single_process_ones(tmp_path):
    mp.start_processes(_crops_worker, args=(2, free_port(), str(tmp_path / "ddp"), str(tmp_path / "crops")),
                       nprocs=2, start_method="spawn")  # fmt: skip
    first = [json.loads((tmp_path / f"crops.{r}").read_text())[0] for r in range(2)]
    assert first[0] == _expected_first_offsets(batch=4)  # rank 0: rows 0, 2, 4, 6 of the global batch
    assert first[1] != first[0]
