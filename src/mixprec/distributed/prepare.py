"""What a training loop calls to run data-parallel under torchrun: wrap, attach the optimizer, shard the
batch, agree on skips, clip, reduce amaxes. One object so a loop written for one process takes it as a
single argument: mixprec.training.TrainingStep's `parallel=` (the protocol training.parallel names).

    dp = DataParallel("ddp")                      # or "fsdp2"; "none": one process (or no wrapping)
    model = dp.wrap(converted_model)              # convert first, then wrap
    optimizer = dp.attach(model, mixprec.AdamW(model.parameters(), lr=...))
    step = TrainingStep(unwrap(model), optimizer, max_grad_norm=1.0, parallel=dp)
    for global_batch in batches:
        loss = loss_fn(model, step.shard(global_batch))   # this rank's rows (contiguous slice)
        step.backward(loss)   # every rank skips together; one all_reduce(MAX) of every amax, then advance

`DataParallel` is also the `prepare=` callable of mixprec.compare (which wraps, builds its optimizer
on the wrapped parameters and calls `attach`). A loop that builds the optimizer
before wrapping still works under DDP (wrap() finds mixprec AdamW through its gradient hooks and
connects it); FSDP2 replaces the parameters, so there the optimizer must be built after wrap().
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.distributed import amax_reduction, nan_guard, world
from mixprec.distributed.ddp import register_fp32_grad_hook, wrap_ddp
from mixprec.distributed.fsdp import adapt_optimizer, shard_model
from mixprec.distributed.fsdp import clip_grad_norm_ as clip_sharded
from mixprec.errors import MixprecError
from mixprec.training.step import clip_grad_norm_

STRATEGIES = ("ddp", "fsdp2", "none")


def unwrap(model: nn.Module) -> nn.Module:
    """The module DDP wraps (FSDP2 shards in place: the model is its own inner module)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def optimizer_already_built(model: nn.Module) -> Any:
    """The mixprec.AdamW whose fp32-accumulation hooks sit on `model`'s parameters, if any.

    AdamW registers a post-accumulate-grad hook (its bound method) on every bf16 parameter; finding one
    tells that the optimizer was built before wrapping. Reads torch's `_post_accumulate_grad_hooks`.
    """
    for p in model.parameters():
        for hook in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values():
            owner = getattr(hook, "__self__", None)
            if isinstance(owner, torch.optim.Optimizer) and callable(getattr(owner, "grad", None)):
                return owner
    return None


@dataclass
class DataParallel:
    strategy: str = "ddp"
    fsdp_options: dict = field(default_factory=dict)  # shard_model keyword arguments
    ddp_options: dict = field(default_factory=dict)  # DistributedDataParallel keyword arguments
    group: Any = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise MixprecError(
                f"data-parallel strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}"
            )
        if self.strategy != "none" and not world.is_distributed():
            raise MixprecError(f"--dp {self.strategy} needs torch.distributed: launch with torchrun")

    def wrap(self, model: nn.Module) -> nn.Module:
        """DDP or FSDP2 around a converted model ("none": the model itself). The amax reduction over this
        group is `reduce_amax`, which TrainingStep(..., parallel=self) runs before every advance."""
        early = optimizer_already_built(model)
        if self.strategy == "ddp":
            ddp = wrap_ddp(model, **self.ddp_options)
            if early is not None:
                # a loop that built its optimizer before wrapping (DDP keeps the Parameter objects, so
                # that optimizer is valid): connect it now, attach() need not be called
                register_fp32_grad_hook(ddp, early, self.group)
                ddp._mixprec_grad_hook = True
            return ddp
        if self.strategy == "fsdp2":
            if early is not None:
                raise MixprecError(
                    "FSDP2 replaces every parameter by a DTensor shard: build the optimizer AFTER wrapping "
                    "(model = dp.wrap(model); optimizer = dp.attach(model, AdamW(model.parameters())))"
                )
            return shard_model(model, **self.fsdp_options)
        return model

    __call__ = wrap  # mixprec.compare's prepare= hook

    def attach(self, model: nn.Module, optimizer: Any) -> Any:
        """Connect the optimizer (built on the WRAPPED model's parameters) to the wrapping; returns it."""
        if isinstance(model, nn.parallel.DistributedDataParallel):
            if not getattr(model, "_mixprec_grad_hook", False):
                register_fp32_grad_hook(model, optimizer, self.group)
                model._mixprec_grad_hook = True
        elif any(hasattr(p, "placements") for p in model.parameters()):
            adapt_optimizer(optimizer)
        return optimizer

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous slice of a global batch (world.shard_batch, the one sharding rule)."""
        return world.shard_batch(batch, self.group)

    def skip(self, loss: Any = None, optimizer: Any = None, *, local_flag: bool = False) -> bool:
        return nan_guard.should_skip_step(loss, optimizer, local_flag=local_flag, group=self.group)

    def reduce_amax(self, model: nn.Module) -> int:
        return amax_reduction.reduce_amax(unwrap(model), self.group)

    def clip(self, model: nn.Module, optimizer: Any, max_norm: float) -> torch.Tensor:
        """Global-norm clipping; over FSDP2 shards (DTensor parameters) the norm takes one all_reduce."""
        if any(hasattr(p, "placements") for p in model.parameters()):
            return clip_sharded(optimizer, max_norm, self.group)
        return clip_grad_norm_(model, optimizer, max_norm)

    def mean(self, value: Any) -> float:
        return world.mean_across_ranks(value, self.group)


__all__ = ["STRATEGIES", "DataParallel", "unwrap"]
