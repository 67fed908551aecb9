"""Where a run executes: the device ("auto" picks the local rank's GPU under torchrun) and the process
group of data-parallel training (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import os

import torch

from ..errors import ConfigError

__all__ = ["resolve_device", "init_distributed", "barrier"]


def resolve_device(name: str) -> torch.device:
    """ "auto": CUDA when available (the local rank's GPU under torchrun), else CPU. A device this torch
    build or machine does not have (``cuda`` on a CPU-only build, ``mps`` off Apple silicon, ``cuda:3`` on a
    machine with one GPU) is a :class:`ConfigError` in one sentence."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(
            f"train.device={name!r} is not a device (auto, cpu, cuda, cuda:1, mps, ...)"
        ) from None
    if device.type == "cpu":
        return device
    if device.type == "mps":
        backend = getattr(torch.backends, "mps", None)
    else:
        backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        why = {"cuda": f"this torch build ({torch.__version__}) has no CUDA or sees no NVIDIA GPU",
               "mps": "MPS needs an Apple-silicon Mac with a torch build that has it"}.get(
                   device.type, f"this torch build ({torch.__version__}) has no {device.type} device")  # fmt: skip
        raise ConfigError(f"train.device={name} is not available here: {why}; use train.device=cpu (or auto)")
    count = getattr(backend, "device_count", None)
    if device.index is not None and count is not None and device.index >= count():
        raise ConfigError(
            f"train.device={name} is not available here: this machine has {count()} {device.type} device(s) "
            f"({', '.join(f'{device.type}:{i}' for i in range(count()))})"
        )
    return device


def init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; initialises the process group (gloo on CPU, NCCL on
    CUDA) when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
