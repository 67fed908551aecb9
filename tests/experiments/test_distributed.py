"""Data-parallel training: 2 gloo processes on CPU match one process with the same global batch, and
AdaFocal's γ agree across ranks (computed from the globally reduced validation statistics)."""

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
