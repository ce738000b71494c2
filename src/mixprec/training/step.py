"""Helpers for a plain training loop: loss scaling, clipping, the optimizer step, the scaling-state advance.

    step = TrainingStep(model, optimizer, grad_accumulation_steps=4, max_grad_norm=1.0)
    for batch in batches:
        loss = model(**batch).loss
        step.backward(loss)          # divides by the accumulation steps, scales for fp16, steps every 4th call

The FP8 delayed-scaling state advances once per optimizer step, never per micro-batch. Data-parallel:
`TrainingStep(model, optimizer, parallel=dp)` with dp a mixprec.distributed.DataParallel; then
`step.shard(global_batch)` is this rank's share, skips agree across ranks, and the amax reduction runs
before every advance. A loop that checks each step itself (the comparison run checks for NaN/inf):

    if step.accumulate(loss):
        step.step(skip=not monitor.check_step(loss).ok)
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.recipes import QUANTIZED_KINDS
from mixprec.training import scaling_state
from mixprec.training.convert import conversion_state, resolve_recipe
from mixprec.training.optim import AdamW
from mixprec.training.parallel import DataParallelism
from mixprec.training.scaling_state import AmaxReduction


def advance_scaling_state(model: nn.Module, *, reduce: AmaxReduction | Literal[False] | None = None) -> None:
    """Advance the FP8 scaling state (amax history -> next scales) of every FP8 module, once.

    Call after each optimizer step (TrainingStep and MixprecTrainerCallback do). Models without FP8
    layers: nothing happens. reduce: the amax reduction over data-parallel ranks (see
    scaling_state.advance; None: none, with a warning under torch.distributed for delayed scaling).
    """
    st = conversion_state(model)
    if st is not None and st.kind not in QUANTIZED_KINDS:
        return  # bf16 / amp / fp32: no scaling state (FP4 layers advance their rounding-noise step)
    scaling_state.advance(model, reduce=reduce)


def make_grad_scaler(model_or_recipe: Any = None, device: str | None = None) -> torch.amp.GradScaler:
    """A GradScaler with the guide's settings (init_scale 2**14, growth_interval 1000) or the recipe's.

    Accepts a converted model (its recipe is used), a recipe object, a recipe name, or None (defaults).
    For recipes other than fp16-amp the scaler is disabled (scale 1, no skipping).
    """
    recipe = model_or_recipe
    if isinstance(model_or_recipe, nn.Module):
        st = conversion_state(model_or_recipe)
        if st is None:
            raise MixprecError(
                "make_grad_scaler: the model was not converted by mixprec.convert_for_training"
            )
        recipe = st.recipe
        if device is None:
            p = next(model_or_recipe.parameters())
            device = p.device.type
    kind = "fp16-amp"
    if recipe is not None:
        kind, recipe, _ = resolve_recipe(recipe)
    init_scale = float(getattr(recipe, "init_scale", 2.0**14))
    growth_interval = int(getattr(recipe, "growth_interval", 1000))
    return torch.amp.GradScaler(
        device or "cpu", init_scale=init_scale, growth_interval=growth_interval, enabled=kind == "fp16-amp"
    )


def clip_grad_norm_(model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """Clip the gradients the optimizer will use (mixprec AdamW's fp32 buffers, else the params' .grad)."""
    if isinstance(optimizer, AdamW):
        return optimizer.clip_grad_norm_(max_norm)
    return torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)


class TrainingStep:
    """Backward with loss scaling and accumulation; optimizer step, clipping and scaling advance.

    optimizer: None for passes that only measure (a sensitivity profile at lr 0): the step zeroes the
    gradients and moves no parameter.
    parallel: the data-parallel object (mixprec.distributed.DataParallel, see training.parallel): the
    step agrees with the other ranks on skipping, clips through it (FSDP2 shards) and runs its amax
    reduction before every scaling-state advance; `shard(batch)` gives this rank's rows.
    reduce: the amax reduction, when it is not the parallel object's (False: none).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        grad_accumulation_steps: int = 1,
        max_grad_norm: float | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        parallel: DataParallelism | None = None,
        reduce: AmaxReduction | Literal[False] | None = None,
    ) -> None:
        if grad_accumulation_steps < 1:
            raise MixprecError(f"grad_accumulation_steps must be >= 1, got {grad_accumulation_steps}")
        if parallel is not None and not isinstance(parallel, DataParallelism):
            raise MixprecError(
                f"parallel must offer shard, skip, reduce_amax and clip (mixprec.distributed.DataParallel), "
                f"got {type(parallel).__name__}"
            )
        self.model = model
        self.optimizer = optimizer
        self.accum = grad_accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.parallel = parallel
        self.reduce = parallel.reduce_amax if reduce is None and parallel is not None else reduce
        st = conversion_state(model)
        if grad_scaler is None and st is not None and st.kind == "fp16-amp":
            grad_scaler = make_grad_scaler(model)
        self.scaler = grad_scaler
        self.micro = 0
        self.steps = 0

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's share of a global batch (the whole batch without a parallel object)."""
        return self.parallel.shard(batch) if self.parallel is not None else batch

    def accumulate(self, loss: torch.Tensor) -> bool:
        """Backward of one micro-batch's loss (divided by the accumulation steps, scaled for fp16);
        True when this micro-batch completes an optimizer step (call step() then)."""
        if self.accum > 1:
            loss = loss / self.accum
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()
        self.micro += 1
        return self.micro % self.accum == 0

    def backward(self, loss: torch.Tensor) -> dict[str, Any] | None:
        """Backward of one micro-batch's loss; after every `grad_accumulation_steps` calls, step."""
        return self.step() if self.accumulate(loss) else None

    def step(self, *, skip: bool = False) -> dict[str, Any]:
        """Unscale, clip, step the optimizer, zero gradients, advance the FP8 scaling state.

        skip: this rank saw a NaN/inf (e.g. PrecisionMonitor.check_step): with a parallel object every
        rank skips when one does. A skipped step zeroes the gradients and moves no parameter; the
        scaling state advances all the same (its guards keep the previous scale for a non-finite amax).
        Returns {"grad_norm", and with loss scaling "skipped", "loss_scale"}; {"skipped": True} if skipped.
        """
        if self.parallel is not None:
            skip = self.parallel.skip(local_flag=skip)
        info = {"skipped": True} if skip else self._update()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)
        advance_scaling_state(self.model, reduce=self.reduce)
        self.steps += 1
        return info

    def _update(self) -> dict[str, Any]:
        """Unscale, clip and step the optimizer (the scaler may still skip an overflowing step)."""
        info: dict[str, Any] = {}
        if self.optimizer is None:
            return info
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.max_grad_norm is not None:
            clip = self.parallel.clip if self.parallel is not None else clip_grad_norm_
            info["grad_norm"] = float(clip(self.model, self.optimizer, self.max_grad_norm))
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            info["skipped"] = self.scaler.get_scale() < scale
            info["loss_scale"] = self.scaler.get_scale()
        else:
            self.optimizer.step()
        return info
