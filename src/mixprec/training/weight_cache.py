"""Cache of a weight's FP8 form across micro-batches (and activation-checkpointing recomputes).

Within one optimizer step the weight does not change, yet each micro-batch's forward (and its
recompute under activation checkpointing, and the backward's transposed re-quantization) would cast
it again. The cache keeps the last QuantizedTensor per (role, format, granularity, scale) and reuses
it while the weight is provably the same tensor with the same contents:

  key = (storage pointer, data_ptr, param._version, optimizer steps in this process, step,
         role/fmt/granularity/margin/pow2, data_ptr and _version of a given scale tensor)

`param._version` moves on every in-place write made through autograd-visible ops (`p.add_`,
`p.copy_` under no_grad, foreach optimizers). It does NOT move for writes through `p.data` (e.g.
`p.data.copy_(master)`) nor for `torch.optim.AdamW(fused=True)` (checked on torch 2.13: the version
stays put). So the owner also passes `step` — a counter that advances once per optimizer step (the
delayed-scaling state already keeps one) — or calls `invalidate()` after each optimizer step
(`invalidate_all(model)` does it for every layer that has a cache; `install_step_hook(optimizer,
model)` registers that as an optimizer step post-hook). As a safety net the key also holds a count
of every torch.optim optimizer step in the process (a global step post-hook, registered at the
first cache lookup): any torch optimizer — fused AdamW, mixprec.AdamW writing through `p.copy_`
— invalidates every cache when it steps, even if the owner forgot the step counter. Only writes to
a parameter outside torch optimizers and without autograd-visible ops (`p.data.copy_(...)` by hand)
need `invalidate_all(model)`. Inference tensors (torch.inference_mode)
carry no version counter: they are never cached (the inference Linear stores FP8 weights anyway).

Not used while torch.compile traces (version counters are not traceable): there the cast is part of
the compiled graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from mixprec.scaling import QuantizedTensor

CACHE_ATTRIBUTE = "_mixprec_weight_cache"


class _OptimizerSteps:
    """A process-wide count of torch.optim optimizer steps (the one piece of global state here: torch's
    global optimizer hooks are process-wide by nature). Registered once, lazily."""

    count = 0
    handle = None

    @classmethod
    def bump(cls, *_args) -> None:
        cls.count += 1

    @classmethod
    def current(cls) -> int:
        if cls.handle is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            cls.handle = register_optimizer_step_post_hook(cls.bump)
        return cls.count


def optimizer_steps() -> int:
    """How many torch.optim optimizer steps this process has run since the first cache lookup."""
    return _OptimizerSteps.current()


def _is_compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


@dataclass
class WeightCastCache:
    """Per-layer cache: role -> (key, QuantizedTensor). Holds at most one entry per role."""

    entries: dict[str, tuple[tuple, QuantizedTensor]] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0

    @staticmethod
    def key_for(
        weight: torch.Tensor, step: int | None, extra: tuple, scale: torch.Tensor | None
    ) -> tuple | None:
        if weight.is_inference() or (scale is not None and scale.is_inference()):
            return None
        # views of one scale buffer (fp8_scale[i:i+1]) are new objects each call but share its storage
        # and version counter: key on those, not on id()
        scale_key = None if scale is None else (scale.data_ptr(), scale._version)
        return (
            weight.untyped_storage().data_ptr(),
            weight.data_ptr(),
            weight._version,
            optimizer_steps(),
            step,
            extra,
            scale_key,
        )

    def get(
        self,
        role: str,
        weight: torch.Tensor,
        quantize: Callable[[], QuantizedTensor],
        *,
        step: int | None = None,
        extra: tuple = (),
        scale: torch.Tensor | None = None,
    ) -> QuantizedTensor:
        """The cached quantized weight for `role` if still valid, else `quantize()` (and remember it).

        extra: everything else the result depends on (format, granularity, margin, transposed...).
        scale: a given (delayed / static) scale tensor; its storage and version join the key.
        """
        if _is_compiling():
            return quantize()
        key = self.key_for(weight, step, extra, scale)
        if key is None:
            return quantize()
        hit = self.entries.get(role)
        if hit is not None and hit[0] == key:
            self.hits += 1
            return hit[1]
        self.misses += 1
        q = quantize()
        self.entries[role] = (key, q)
        return q

    def invalidate(self) -> None:
        self.entries.clear()

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes for _, q in self.entries.values())


def cache_of(module: nn.Module) -> WeightCastCache:
    """The module's cache, created on first use (stored as a plain attribute, not in state_dict)."""
    cache = module.__dict__.get(CACHE_ATTRIBUTE)
    if cache is None:
        cache = WeightCastCache()
        module.__dict__[CACHE_ATTRIBUTE] = cache
    return cache


def invalidate_all(model: nn.Module) -> int:
    """Drop every cached weight cast in the model; returns how many layer caches were cleared."""
    n = 0
    for m in model.modules():
        cache = m.__dict__.get(CACHE_ATTRIBUTE)
        if cache is not None:
            cache.invalidate()
            n += 1
    return n


def install_step_hook(optimizer: torch.optim.Optimizer, model: nn.Module):
    """Invalidate the model's weight caches after every optimizer step; returns the hook handle."""
    return optimizer.register_step_post_hook(lambda *_: invalidate_all(model))
