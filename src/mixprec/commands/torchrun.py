"""A `mixprec` command under torchrun: join the job from its environment, one printer, one writer.

    torchrun --standalone --nproc-per-node 2 $(which mixprec) compare --recipes bf16,fp8-delayed --out runs/c
    torchrun --standalone --nproc-per-node 2 -m mixprec compare --recipes bf16,fp8-delayed --out runs/c
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
             --rdzv-id job1 -m mixprec compare ...

torchrun exports WORLD_SIZE, RANK and LOCAL_RANK to every process it starts. A command that runs
data-parallel (TORCHRUN = True in its module: `compare`) joins the process group inside `session()`;
rank 0 alone prints and writes. Every other command refuses a multi-process launch before any work
(`refuse_reason`, checked by mixprec.cli): N copies of it would race into the same output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from mixprec.distributed.world import device_for_rank, init_from_env
from mixprec.errors import MixprecError
from mixprec.ranks import is_distributed, launched_world_size, world_size


def refuse_reason(command: str, data_parallel: bool) -> str | None:
    """Why `command` must not run in this environment (several torchrun processes, and it does not run
    data-parallel), or None."""
    world = launched_world_size()
    if world > 1 and not data_parallel:
        return (
            f"`mixprec {command}` does not run data-parallel: under torchrun with {world} processes every one "
            "would do the whole job into the same output; run it without torchrun (or --nproc-per-node 1). "
            "`mixprec compare` runs data-parallel under torchrun (docs/distributed.md)"
        )
    return None


@contextlib.contextmanager
def session() -> Iterator[int]:
    """The process group from torchrun's environment for the block (gloo on CPU, nccl on GPU; nothing
    outside torchrun); yields the world size and tears the group down afterwards, error or not."""
    init_from_env()
    try:
        yield world_size()
    finally:
        if is_distributed():
            dist.destroy_process_group()


def check_batch(batch_size: int, world: int) -> None:
    if batch_size % world:
        raise MixprecError(
            f"--batch-size {batch_size} does not split evenly over {world} ranks; use a multiple of {world} "
            "(the global batch is the same as in a single-process run, each rank takes its slice)"
        )


def replicas_identical(model) -> bool:
    """Every rank holds bit-identical parameters and FP8 scaling buffers; True in one process."""
    if world_size() == 1:
        return True
    # parameters and floating buffers (the FP8 amax histories and scales: amax reduction keeps them equal);
    # FSDP2 shards differ by design: compare the whole parameters (full_tensor is a collective, called in
    # the same order on every rank)
    params = [p.full_tensor() if hasattr(p, "placements") else p for p in model.parameters()]
    tensors = [*params, *(b for b in model.buffers() if b.is_floating_point())]
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors]).to(device_for_rank())
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return bool(torch.equal(hi, lo))
