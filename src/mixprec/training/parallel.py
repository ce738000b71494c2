"""What a training step needs from data parallelism, as a protocol: the training wing cannot import
mixprec.distributed (a floor above it), so the data-parallel object is passed in.

mixprec.distributed.DataParallel is the implementation ("ddp", "fsdp2", or "none": one process, or ranks
that only share the default group); a test double needs only these four methods. TrainingStep takes one
(`TrainingStep(model, optimizer, parallel=dp)`) and from it:
- `shard(batch)`: this rank's share of a global batch (mixprec.distributed.world.shard_batch, the one
  sharding rule: contiguous slices);
- `skip(local_flag=...)`: one decision for every rank (a NaN/inf on one rank skips the step on all);
- `reduce_amax(model)`: the amax reduction that runs before every scaling-state advance of the step;
- `clip(model, optimizer, max_norm)`: global-norm clipping, over FSDP2 shards too.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class DataParallelism(Protocol):
    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's share of a global batch (dim 0)."""
        ...

    def skip(self, loss: Any = None, optimizer: Any = None, *, local_flag: bool = False) -> bool:
        """True on every rank when any rank's flag (or non-finite loss/gradients) says skip."""
        ...

    def reduce_amax(self, model: nn.Module) -> object:
        """Make every rank's current amax rows agree (all_reduce MAX) before the scaling state advances."""
        ...

    def clip(self, model: nn.Module, optimizer: Any, max_norm: float) -> torch.Tensor:
        """Clip the gradients the optimizer will use to a global L2 norm; returns the norm before."""
        ...


__all__ = ["DataParallelism"]
