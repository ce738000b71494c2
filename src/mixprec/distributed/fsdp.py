"""FSDP2 (torch.distributed.fsdp.fully_shard) for models converted by mixprec.

Order: convert first (mixprec.convert_for_training), then shard. fully_shard replaces every parameter
by a DTensor shard; converting afterwards would swap modules and dtypes under FSDP's feet.

What FSDP2 means for FP8:
- Activations and gradients are per-rank tensors: current-scaling recipes need no reduction; delayed
  scaling reduces its amax histories once per step (amax_reduction.reduce_amax).
- Weights: FSDP2 all-gathers the whole weight before the forward, so the LowPrecisionLinear sees the unsharded
  weight and its weight amax (current scaling) is the amax of the whole weight, identical on every rank:
  every rank casts the gathered weight with one scale. With FP8 all-gather (fp8_all_gather.py) the cast
  happens on the shard BEFORE the all-gather, so there the amax is reduced over the shards first.
- mixprec.AdamW on DTensor shards: its state (fp32 master, bf16 moments, fp32 gradient buffers)
  follows the parameters and is sharded the same way; FSDP2 runs post-accumulate-grad hooks on the
  sharded parameter after the reduce-scatter, so the fp32 gradient buffers hold reduced gradients.
  One thing needs help: the stochastic rounding noise of the moments is a hash of each element's index
  in the whole tensor — adapt_optimizer() rounds each shard with the global indices of its elements,
  so a sharded run rounds exactly as a DDP run does (and no rank computes another rank's noise).
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mixprec.distributed.fp8_all_gather import enable_fp8_all_gather
from mixprec.errors import MixprecError
from mixprec.ranks import is_distributed, world_size
from mixprec.rounding import flat_indices, stochastic_round
from mixprec.training.optim import AdamW


def _is_dtensor(t: Any) -> bool:
    return callable(getattr(t, "to_local", None)) and hasattr(t, "placements")


def default_mesh():
    """A 1-D device mesh over the whole job: "cuda" under nccl, else "cpu" (gloo)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not is_distributed():
        raise MixprecError("FSDP2 needs torch.distributed initialized (launch with torchrun)")
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (world_size(),))


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The units to shard one by one: the classes a transformers model lists in _no_split_modules
    (its decoder layers), else every module that owns a weight matrix (Linear, LowPrecisionLinear, Embedding)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names]
        if found:
            return found
    out = []
    for m in model.modules():
        w = m._parameters.get("weight")
        if m is not model and w is not None and w.dim() >= 2:
            out.append(m)
    return out


def shard_model(
    model: nn.Module,
    mesh=None,
    *,
    reshard_after_forward: bool = True,
    mp_policy=None,
    master_weights: str = "auto",
    fp8_all_gather: bool = False,
) -> nn.Module:
    """fully_shard every block of `model`, then the root; returns `model` (sharded in place).

    master_weights: where the fp32 master copy of the bf16 parameters lives. "auto" (default): "fsdp"
      when every floating parameter is bf16 (what convert_for_training makes of bf16 and FP8 recipes),
      else "optimizer".
      "optimizer": parameters stay bf16 shards; mixprec.AdamW keeps fp32 master shards
        (call adapt_optimizer on it). Gradients are reduce-scattered in fp32 and handed back in bf16.
      "fsdp": the sharded parameters become fp32 (they are the masters) and FSDP2's mixed precision
        all-gathers them in bf16 for compute (MixedPrecisionPolicy(param_dtype=bf16,
        reduce_dtype=fp32)); gradient shards arrive in fp32; AdamW then keeps no extra master and no
        gradient buffer (12 B/param sharded instead of 16). Same arithmetic as DDP + mixprec AdamW +
        register_fp32_grad_hook, rounding included (measured: identical losses). Needs every floating
        parameter in bf16. state_dict() then holds fp32 parameters.
    mp_policy: your own MixedPrecisionPolicy (overrides the above).
    fp8_all_gather=True first swaps the weights of per-tensor-scaled LowPrecisionLinear layers for the FP8
    all-gather weight (fp8_all_gather.enable_fp8_all_gather), halving the all-gather bytes.
    """
    from torch.distributed.fsdp import fully_shard

    if any(_is_dtensor(p) for p in model.parameters()):
        raise MixprecError("shard_model: the model is already sharded (its parameters are DTensors)")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise MixprecError(
            "shard_model: the model is wrapped in DistributedDataParallel; shard the inner model"
        )
    mesh = mesh or default_mesh()
    from torch.distributed.fsdp import MixedPrecisionPolicy

    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if master_weights == "auto":
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        master_weights = "fsdp" if dtypes == {torch.bfloat16} else "optimizer"
    if master_weights not in ("optimizer", "fsdp"):
        raise MixprecError(
            f"shard_model: master_weights must be 'optimizer' or 'fsdp', got {master_weights!r}"
        )
    if mp_policy is None and master_weights == "fsdp":
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if dtypes != {torch.bfloat16}:
            raise MixprecError(
                f"shard_model(master_weights='fsdp') needs all floating parameters in bf16, found {sorted(map(str, dtypes))}"
            )
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.float()  # exact: the bf16 values become the fp32 masters
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif mp_policy is None:
        mp_policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    kwargs["mp_policy"] = mp_policy
    if fp8_all_gather:  # after the dtype change above: the swapped weights keep their dtype
        enable_fp8_all_gather(model)
    for block in _blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    if master_weights == "fsdp" and mp_policy.param_dtype is not None:
        # the fp32 shards are masters of bf16 compute weights: adapt_optimizer keeps bf16 moments for them
        for p in model.parameters():
            if p.is_floating_point():
                p._mixprec_compute_dtype = mp_policy.param_dtype
    return model


# ---- mixprec.AdamW on DTensor shards ------------------------------------------------------------


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the model's state dict, whole: DTensor shards all-gathered (a collective: every rank
    calls it), plain tensors as they are."""
    return {name: t.full_tensor() if _is_dtensor(t) else t for name, t in model.state_dict().items()}


def _shard_slices(t) -> tuple[slice, ...]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def stochastic_round_dtensor(x, dtype: torch.dtype, key: int | None, lane: int):
    """mixprec.training.optim's rounding of a DTensor shard: with its slice of the noise the whole tensor would
    get (the noise is a hash of each element's global index), so sharded == unsharded rounding."""
    from torch.distributed.tensor import DTensor

    local = x.to_local()
    if key is None or dtype != torch.bfloat16:
        rounded = local.to(dtype)
    else:
        index = flat_indices(tuple(x.shape), _shard_slices(x), device=local.device)
        rounded = stochastic_round(local, key, lane, index=index)
    return DTensor.from_local(
        rounded, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride()
    )


def adapt_optimizer(optimizer: Any) -> Any:
    """Let mixprec.AdamW step DTensor (FSDP2) parameters; other optimizers are returned unchanged.

    Patches this optimizer instance's moment rounding (see the module docstring). Returns `optimizer`.
    """
    if not isinstance(optimizer, AdamW) or getattr(optimizer, "_mixprec_dtensor_rounding", False):
        return optimizer
    plain_round = optimizer.round_to_storage

    def round_to_storage(
        self, x: torch.Tensor, dtype: torch.dtype, key: int | None, lane: int
    ) -> torch.Tensor:
        if _is_dtensor(x):
            return stochastic_round_dtensor(x, dtype, key, lane)
        return plain_round(x, dtype, key, lane)

    optimizer.round_to_storage = types.MethodType(round_to_storage, optimizer)
    plain_moment_dtype = optimizer.moment_dtype_for

    # An fp32 shard that FSDP2 all-gathers in bf16 (shard_model's "fsdp" masters) is the master of a
    # bf16 parameter: give it the moments a bf16 parameter gets (bf16 unless moment_dtype is set),
    # so the arithmetic is that of DDP + mixprec AdamW.
    def moment_dtype_for(self, p: torch.Tensor) -> torch.dtype:
        compute = getattr(p, "_mixprec_compute_dtype", None)
        if self.moment_dtype is None and compute is not None and compute != p.dtype:
            return torch.bfloat16
        return plain_moment_dtype(p)

    optimizer.moment_dtype_for = types.MethodType(moment_dtype_for, optimizer)
    optimizer._mixprec_dtensor_rounding = True
    return optimizer


@torch.no_grad()
def clip_grad_norm_(optimizer: Any, max_norm: float, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip the gradients the optimizer will use to a global L2 norm, DTensor shards included.

    One all_reduce of one number for the sharded part: the sum of squares over local shards (replicated
    gradients counted once). Works for mixprec AdamW's fp32 buffers (.grads()) and plain .grad.
    """
    grads_fn = getattr(optimizer, "grads", None)
    if callable(grads_fn):
        grads = [g for _, g in grads_fn()]
    else:
        grads = [p.grad for grp in optimizer.param_groups for p in grp["params"] if p.grad is not None]
    if not grads:
        return torch.zeros(())
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for g in grads:
        if _is_dtensor(g):
            sharded += g.to_local().double().pow(2).sum().cpu()
        else:
            replicated += g.double().pow(2).sum().cpu()
    if any(_is_dtensor(g) for g in grads) and is_distributed():
        device = grads[0].to_local().device if _is_dtensor(grads[0]) else grads[0].device
        t = sharded.to(device)
        dist.all_reduce(t, group=group)
        sharded = t.cpu()
    total = float((sharded + replicated).sqrt())
    coef = min(1.0, max_norm / (total + 1e-6))
    if coef < 1.0:
        for g in grads:
            (g.to_local() if _is_dtensor(g) else g).mul_(coef)
    return torch.tensor(total if math.isfinite(total) else float("nan"))


__all__ = ["adapt_optimizer", "clip_grad_norm_", "default_mesh", "shard_model", "stochastic_round_dtensor"]
