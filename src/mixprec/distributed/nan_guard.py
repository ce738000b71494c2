"""One decision for all ranks: skip this optimizer step if ANY rank saw NaN/inf in its loss or gradients.

Under DDP a NaN gradient is averaged into every rank, but a NaN loss with finite gradients (a skipped
micro-batch, an overflow in the logging path) or a NaN inside one FSDP2 gradient shard is seen by one
rank only: if that rank alone skipped, the replicas would diverge silently. So every rank computes a
local flag and one all_reduce(MAX) of a single number decides for everyone.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from mixprec.distributed.world import device_for_rank, world_size


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 parameters and gradients), else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _gradients(source) -> list[torch.Tensor]:
    """The gradients a step would use: an optimizer with .grads() (mixprec.AdamW keeps bf16
    parameters' gradients in fp32 buffers and p.grad is None), a module's or tensors' .grad."""
    grads_fn = getattr(source, "grads", None)
    if callable(grads_fn):
        return [g for _, g in grads_fn()]
    if isinstance(source, torch.optim.Optimizer):
        return [p.grad for group in source.param_groups for p in group["params"] if p.grad is not None]
    params = source.parameters() if isinstance(source, nn.Module) else source
    return [p.grad for p in params if p.grad is not None]


def local_nonfinite(
    loss: torch.Tensor | float | None = None,
    gradients_of: nn.Module | torch.optim.Optimizer | Iterable[torch.Tensor] | None = None,
) -> bool:
    """True when this rank's loss or any of its (local) gradients holds a NaN or an inf.

    gradients_of: the optimizer (preferred: it knows where mixprec.AdamW keeps gradients), the
    model, or an iterable of parameters.
    """
    checks: list[torch.Tensor] = []
    if loss is not None:
        checks.append(torch.as_tensor(loss).detach().float().reshape(-1))
    if gradients_of is not None:
        grads = [_local(g).detach() for g in _gradients(gradients_of)]
        grads = [g for g in grads if g.numel()]
        if grads:
            # inf-norm per gradient: one reduction each, NaN and inf both propagate into it
            checks.append(torch.stack(torch._foreach_norm(grads, float("inf"))).float().cpu())
    if not checks:
        return False
    return not bool(torch.isfinite(torch.cat([c.cpu() for c in checks])).all())


def any_rank(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank when `flag` is True on at least one rank (one all_reduce of one number)."""
    if world_size(group) == 1:
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0], device=device_for_rank())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)


def should_skip_step(
    loss: torch.Tensor | float | None = None,
    gradients_of: nn.Module | torch.optim.Optimizer | Iterable[torch.Tensor] | None = None,
    *,
    local_flag: bool = False,
    group: dist.ProcessGroup | None = None,
) -> bool:
    """Every rank gets True when any rank's loss/gradients are non-finite (or any rank passed local_flag,
    e.g. a PrecisionMonitor's NaN report). Call after backward, before the optimizer step; on True
    zero the gradients and do not step (and do not advance the scaling state)."""
    bad = bool(local_flag) or local_nonfinite(loss, gradients_of)
    return any_rank(bad, group)


__all__ = ["any_rank", "local_nonfinite", "should_skip_step"]
