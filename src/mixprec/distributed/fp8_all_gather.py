"""FP8 all-gather of weights under FSDP2, for per-tensor current scaling (fp8-current).

FSDP2 all-gathers each weight before the forward (and again before the backward when it reshards
after the forward). A GEMM that casts the weight to FP8 anyway can gather the FP8 payload instead of
bf16: 1 byte per element instead of 2. FSDP2's extension point for this: the local shard of a
parameter is a tensor subclass with two methods,
    fsdp_pre_all_gather(mesh, ...)  -> (tensors to all-gather, metadata)   # runs on the shard
    fsdp_post_all_gather(outputs, metadata, param_dtype, out=None)          # builds the unsharded weight

Here the pre-all-gather takes the amax of the local shard, all_reduce(MAX)es it over the shard group
(so the scale is that of the WHOLE weight, the same on every rank), quantizes the shard with it
(mixprec.quantization.quantize: the same payloads a cast of the gathered weight gives) and hands FSDP2 the
E4M3 payload viewed as uint8 (gloo has no float8 dtype; FSDP2 packs mixed dtypes into a uint8 buffer).
The post-all-gather decodes the gathered payload times the scale into the compute dtype.

Numerics (measured in tests/distributed: bit-identical losses to the bf16 all-gather): the LowPrecisionLinear
re-quantizes the dense weight it receives with current scaling. Its payloads are the same (every
element is an exact E4M3 value times the scale, rounded to bf16: a relative change below 2^-8 never moves
it to another E4M3 value), and so is its scale: the amax `a` of a bf16 weight is a bf16 value and
bf16(448 * fp32(a / 448)) == a, so the recomputed scale a / 448 is the one used before the gather.
With fp32 compute weights the recomputed scale may differ from it by an ulp.

Not for: delayed scaling (the layer would record the amax of the already-quantized weight into its
history, which can never grow past the previous scale's range: refused), rowwise / blockwise / MX
recipes (their weight scales are per row or block; a shard-local cast would need the transposed
re-quantization the backward does — out of scope, refused with a clear message).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from mixprec.errors import MixprecError
from mixprec.formats import E4M3, decode
from mixprec.quantization import quantize
from mixprec.ranks import is_distributed
from mixprec.scaling import compute_scale

_aten = torch.ops.aten
# ops FSDP2 applies to a parameter while sharding it (and that views/copies must keep the subclass)
_KEEP_SUBCLASS = {
    _aten.split.Tensor,
    _aten.split_with_sizes.default,
    _aten.new_zeros.default,
    _aten.slice.Tensor,
    _aten.narrow.default,
    _aten.view.default,
    _aten.as_strided.default,
    _aten.detach.default,
    _aten.alias.default,
    _aten.clone.default,
    _aten._unsafe_view.default,
}


class Fp8AllGatherWeight(torch.Tensor):
    """A weight (or its FSDP2 shard) that all-gathers as E4M3 with one per-tensor scale."""

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            layout=data.layout,
            device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def __repr__(self) -> str:
        return f"Fp8AllGatherWeight({self._data!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        raw_args, raw_kwargs = tree_map_only(cls, lambda t: t._data, (args, kwargs))
        out = func(*raw_args, **raw_kwargs)
        first = func._schema.arguments[0].alias_info if func._schema.arguments else None
        if first is not None and first.is_write and args and isinstance(args[0], cls):
            return args[0]  # in-place ops (optimizer updates, copy_) modified the inner tensor
        if func in _KEEP_SUBCLASS:
            return tree_map_only(torch.Tensor, cls, out)
        return out

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Fp8AllGatherWeight(inner["_data"])

    # ---- FSDP2 all-gather extension ----------------------------------------------------------------
    def local_amax(self, compute_dtype: torch.dtype) -> torch.Tensor:
        """amax of this shard after rounding to the compute dtype (the plain path quantizes the gathered
        bf16 weight), NaN mapped to inf; fp32 [1]."""
        local = self._data.to(compute_dtype).float()
        amax = local.abs().amax() if local.numel() else torch.zeros((), device=local.device)
        return torch.nan_to_num(amax.reshape(1), nan=float("inf"))

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        compute_dtype = getattr(mp_policy, "param_dtype", None) or self._data.dtype
        local = self._data.to(compute_dtype).float()
        cached = getattr(self, "_precomputed", None)
        # the version counter of the sharded DTensor parameter (in-place updates through it bump it;
        # the inner tensors, updated below the autograd layer, keep theirs)
        param = cached[0]() if cached is not None else None
        if param is not None and param._version == cached[1] and cached[2] == compute_dtype:
            scale = cached[3]  # precompute_scales() after this step's update: no collective here
        else:
            amax = self.local_amax(compute_dtype)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())  # amax of the whole weight
            scale = compute_scale(amax, E4M3).reshape(1, 1)
        rows_padded = -(-outer_size[0] // mesh.size())
        payload = torch.zeros((rows_padded, *outer_size[1:]), dtype=torch.uint8, device=local.device)
        if local.numel():
            q = quantize(local, E4M3, scale=scale)
            payload[: local.shape[0]].copy_(q.data.view(torch.uint8).reshape(local.shape))
        return (payload,), (scale, torch.Size(outer_size))

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (gathered,) = all_gather_outputs
        scale, shape = metadata
        flat = gathered.reshape(-1)[: shape.numel()].view(torch.float8_e4m3fn)
        dense = (decode(flat, E4M3) * scale.reshape(())).reshape(shape).to(param_dtype)
        if out is not None:
            # refill the unsharded parameter in place, as FSDP2's own all-gather does, without bumping
            # its version counter (autograd saved it in the forward; the values are the same weights)
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(dense)
            return None
        return dense, (dense,)


def _swap(module: nn.Module) -> None:
    w = module.weight
    data = Fp8AllGatherWeight(w.data)
    module.weight = nn.Parameter(data, requires_grad=w.requires_grad)


def _is_per_tensor_current(module: nn.Module) -> bool | None:
    recipe = getattr(module, "recipe", None)
    name = type(recipe).__name__ if recipe is not None else None
    return name == "CurrentScaling"


def enable_fp8_all_gather(model: nn.Module, modules: list[nn.Module] | None = None) -> int:
    """Give every fp8-current FP8 Linear of `model` an FP8 all-gather weight; call BEFORE shard_model /
    fully_shard. Returns how many weights were swapped; MixprecError when the recipe does not allow it."""
    targets = (
        modules
        if modules is not None
        else [m for m in model.modules() if type(m).__name__ == "LowPrecisionLinear"]
    )
    if not targets:
        raise MixprecError(
            "FP8 all-gather: the model has no LowPrecisionLinear (convert it with an FP8 recipe first)"
        )
    refused = [type(getattr(m, "recipe", None)).__name__ for m in targets if not _is_per_tensor_current(m)]
    if refused:
        raise MixprecError(
            f"FP8 all-gather works with per-tensor current scaling (fp8-current); these layers use {sorted(set(refused))}"
            " — delayed scaling would record the amax of the already-quantized weight, and row/block/MX weight"
            " scales cannot be computed on a row shard alone"
        )
    for m in targets:
        _swap(m)
    return len(targets)


@torch.no_grad()
def precompute_scales(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """The scales of every FP8 all-gather weight of `model` with ONE all_reduce(MAX) for all of them.

    Call after optimizer.step() (torchao offers the same for its float8 all-gather): the following
    all-gathers — forward, and backward when FSDP2 reshards after forward — then skip their per-weight
    amax all-reduce. A scale is used only while the parameter is unchanged (its version counter, which
    every in-place update bumps), so a forgotten call costs collectives, never correctness. Returns how
    many weights got a scale.
    """
    shards = []
    for p in model.parameters():
        # the very object FSDP2 calls fsdp_pre_all_gather on (to_local() would return an alias wrapper)
        local = getattr(p, "_local_tensor", p)
        if isinstance(local, Fp8AllGatherWeight):
            shards.append((p, local))
    if not shards:
        return 0
    amax = torch.cat([local.local_amax(compute_dtype) for _, local in shards])
    group = shards[0][0].device_mesh.get_group() if hasattr(shards[0][0], "device_mesh") else None
    if is_distributed():
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scales = compute_scale(amax, E4M3)
    for (p, local), scale in zip(shards, scales):
        local._precomputed = (weakref.ref(p), p._version, compute_dtype, scale.reshape(1, 1))
    return len(shards)


__all__ = ["Fp8AllGatherWeight", "enable_fp8_all_gather", "precompute_scales"]
