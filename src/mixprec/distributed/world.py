"""The process group and the small helpers a training loop needs to run under torchrun: join the job,
shard the batch per rank, average a loss over ranks, let only rank 0 write.

Rank, world size and main process are read in mixprec.ranks (the one module that asks; re-exported here).
`shard_batch` is THE sharding rule: every rank takes a contiguous slice of the global batch, as
DistributedSampler does (DataParallel.shard, and through it TrainingStep and the comparison run, use it).

Everything degrades to the single-process answer when torch.distributed is not initialized, so a loop
written with these helpers runs unchanged with `python` and with `torchrun --nproc-per-node N`.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from mixprec.errors import MixprecError
from mixprec.ranks import (
    is_distributed,
    is_main_process,
    launched_by_torchrun,
    launched_world_size,
    local_rank,
    rank,
    world_size,
)


def init_from_env(backend: str | None = None, timeout_s: float = 1800.0) -> bool:
    """Initialize the default process group from torchrun's environment; no-op outside torchrun.

    backend None picks "nccl" when CUDA is available (one GPU per local rank, chosen by LOCAL_RANK), else
    "gloo". Returns True when this process is part of a multi-process job afterwards.
    """
    if is_distributed():
        return world_size() > 1
    if launched_world_size() <= 1:  # 1 outside torchrun
        return False
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return True


def device_for_rank() -> torch.device:
    """The device this rank computes on: its GPU under nccl, else the CPU."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard_batch(batch: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's contiguous slice of a global batch (dim 0), as DistributedSampler would give it.

    The global batch must divide evenly, so the mean loss over ranks equals the mean over the whole
    batch and a DDP run sees exactly the samples a single-process run on the combined batch sees.
    """
    world = world_size(group)
    if world == 1:
        return batch
    if batch.shape[0] % world:
        raise MixprecError(
            f"the global batch of {batch.shape[0]} samples does not split evenly over {world} ranks; "
            f"use a batch size that is a multiple of {world}"
        )
    per_rank = batch.shape[0] // world
    start = rank(group) * per_rank
    return batch[start : start + per_rank]


def mean_across_ranks(value: float | torch.Tensor, group: dist.ProcessGroup | None = None) -> float:
    """The mean of a scalar over ranks (fp64 sum, so every rank gets the same number)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().reshape(()).to(device_for_rank(), torch.float64).clone()
    else:  # a Python float is fp64 already: never round it through fp32
        t = torch.tensor(float(value), dtype=torch.float64, device=device_for_rank())
    if world_size(group) == 1:
        return float(t)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return float(t) / world_size(group)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if is_distributed():
        dist.barrier(group=group)


def broadcast_object(obj, src: int = 0, group: dist.ProcessGroup | None = None):
    """Rank src's Python object on every rank (small metadata only)."""
    if world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


__all__ = [
    "barrier",
    "broadcast_object",
    "device_for_rank",
    "init_from_env",
    "is_distributed",
    "is_main_process",
    "launched_by_torchrun",
    "mean_across_ranks",
    "rank",
    "shard_batch",
    "world_size",
]
