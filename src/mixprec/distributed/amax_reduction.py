"""Delayed-scaling amax reduction: every rank quantizes with the same scales (TE's amax reduction group).

Each rank records the amax of ITS activations and gradients into the FP8 layers' amax-history buffers.
Before the scaling state advances (amax history -> next scales), the current amaxes of every FP8 layer
of the model are gathered into ONE flat fp32 tensor, all_reduce(MAX)'d over the data-parallel group and
written back: one collective per optimizer step for all layers together, not one per tensor. Afterwards
every rank holds the same histories, computes the same scales, and a DDP run quantizes exactly as a
single process running the combined batch would (max over ranks == max over the combined batch).

NaN in an amax (a rank that overflowed) is mapped to +inf before the MAX (MAX with NaN is not defined
the same way by every backend); the scaling state's guard keeps the previous scale for an inf amax.
Current-scaling recipes keep nothing across steps and need no reduction.

The training wing does not import this service: the scaling state takes the reduction as an argument,
bound into the loop by `TrainingStep(model, optimizer, parallel=DataParallel(...))` (DataParallel's
`reduce_amax`) or passed as `reduce=reduce_amax` (advance_scaling_state, MixprecTrainerCallback).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mixprec.distributed.world import device_for_rank, world_size


def amax_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors to reduce, in a fixed (module registration) order, identical on every rank.

    A module may say exactly which tensors they are with `amax_tensors_for_reduction()` (the scaling
    state's protocol: tensors modified in place, e.g. the current-step row of its history); otherwise
    every floating buffer whose name contains "amax" is taken (reducing the whole history is correct,
    only more bytes: rows from earlier steps are identical on every rank already).
    """
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    covered: set[int] = set()
    for module in model.modules():
        if id(module) in covered:
            continue
        fn = getattr(module, "amax_tensors_for_reduction", None)
        if callable(fn):
            for sub in module.modules():
                covered.add(id(sub))
            for t in fn():
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
            continue
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and "amax" in name and buf.is_floating_point() and id(buf) not in seen:
                seen.add(id(buf))
                out.append(buf)
    return out


@torch.no_grad()
def reduce_amax(model: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """all_reduce(MAX) of every FP8 amax tensor of `model` in one collective; returns the element count.

    No-op (returns 0) outside torch.distributed, for world size 1, or for a model without amax state.
    Call on every rank, after backward and before the scaling state advances.
    """
    if world_size(group) == 1:
        return 0
    tensors = amax_tensors(model)
    if not tensors:
        return 0
    device = device_for_rank()
    flat = torch.cat([t.detach().reshape(-1).to(device, torch.float32) for t in tensors])
    flat = torch.nan_to_num(flat, nan=float("inf"))
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))
    return int(flat.numel())


def scales_agree(model: nn.Module, group: dist.ProcessGroup | None = None) -> bool:
    """True when every rank holds bit-identical amax/scale buffers (a check for tests and debugging)."""
    if world_size(group) == 1:
        return True
    tensors = [
        b
        for m in model.modules()
        for n, b in m.named_buffers(recurse=False)
        if b is not None and ("amax" in n or "scale" in n) and b.is_floating_point()
    ]
    if not tensors:
        return True
    flat = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors]).to(device_for_rank())
    bits = flat.view(torch.int32).to(torch.float64)  # compare bit patterns, NaN included
    hi, lo = bits.clone(), bits.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    return bool(torch.equal(hi, lo))


__all__ = ["amax_tensors", "reduce_amax", "scales_agree"]
