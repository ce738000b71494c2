"""The collectives of a quantization split across the ranks of a torch.distributed process group.
Calibration: each rank runs its share of the batches (`share`), then the statistics are combined so every
rank holds what one process running every batch would (docs/quantize.md, "Calibration and GPTQ across
processes"). Writing (producers/quantize_ranks.py): rank 0's decisions broadcast, every rank's
scales-file entries gathered, a barrier before rank 0 publishes.

What combines exactly: an amax (the max over ranks of per-rank maxima is the max over all batches, bit
for bit) and counts (integer sums). What combines up to the order of fp32 sums: a Hessian's sum of x x^T.
Every function here is a collective: every rank calls it, in the same order, with the same shapes,
including a rank whose share is empty (its amax 0, its sums zero). Outside a process group (world 1)
each one returns its input unchanged, with no collective.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from mixprec.ranks import rank, world_size

T = TypeVar("T")


def share(items: Sequence[T]) -> list[T]:
    """This rank's items, `items[rank::world]`: whole batches, so that each sequence runs exactly as
    in one process (a batch split across ranks would change the GEMM shapes, hence the rounding)."""
    return list(items[rank() :: world_size()])


def _device() -> torch.device:
    """Where a collective's tensors must live: the current GPU under NCCL, else the CPU (gloo)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def max_across_ranks(values: Sequence[float]) -> list[float]:
    """Element-wise max over ranks of `values` (the same length on every rank), in one collective.
    float64 holds every observer's amax (a float32 or a Python float) exactly."""
    if world_size() == 1:
        return list(values)
    flat = torch.tensor(list(values), dtype=torch.float64, device=_device())
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    return flat.cpu().tolist()


def sum_across_ranks(counts: Sequence[int]) -> list[int]:
    """Element-wise sum over ranks of integer `counts` (the same length on every rank)."""
    if world_size() == 1:
        return list(counts)
    flat = torch.tensor(list(counts), dtype=torch.int64, device=_device())
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    return [int(c) for c in flat.cpu().tolist()]


def sum_in_place(t: torch.Tensor) -> torch.Tensor:
    """all_reduce(SUM) of `t` in place (no second copy on the CPU): the ranks' fp32 sums added in the
    order the backend chooses, which is why the result can differ from one process's in the last bits."""
    if world_size() == 1:
        return t
    if _device().type == "cpu":
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t
    moved = t.to(_device())
    dist.all_reduce(moved, op=dist.ReduceOp.SUM)
    return t.copy_(moved)


def broadcast_tensor(t: torch.Tensor, src: int) -> torch.Tensor:
    """`t` as rank `src` holds it, on every rank (a CPU tensor); the other ranks pass a tensor of the same
    shape and dtype (overwritten). Sent as its bytes: gloo has no float8 or 4-bit payload dtypes."""
    if world_size() == 1:
        return t
    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).to(_device())
    dist.broadcast(raw, src=src)
    return raw.cpu().view(t.dtype).reshape(t.shape)


def broadcast_object(obj: Any, src: int) -> Any:
    """A small picklable record (numbers, strings, shapes) as rank `src` holds it, on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def merged_entries(entries: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every rank's scales-file entries ({Linear: entry}) merged, on every rank (a Linear two ranks
    quantized has the same entry on both)."""
    if world_size() == 1:
        return dict(entries)
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, dict(entries))
    merged: dict[str, dict[str, Any]] = {}
    for part in gathered:
        merged.update(part)
    return merged


def wait_for_all_ranks() -> None:
    """Return once every rank got here (nothing in a single process)."""
    if world_size() > 1:
        dist.barrier()


__all__ = [
    "broadcast_object",
    "broadcast_tensor",
    "max_across_ranks",
    "merged_entries",
    "share",
    "sum_across_ranks",
    "sum_in_place",
    "wait_for_all_ranks",
]
