"""The block formats (NVFP4, MXFP4, MXFP8) in offline streaming quantization (producers/quantize.py calls these).

NVFP4's weight global scales are per fused GEMM (block_tensors.fused_global_scales): before streaming, one
read-only pass takes the amax of every NVFP4 target weight (a few weights in memory at a time, the
same buffer reused), so each shard of q/k/v or gate/up is then quantized on its own, in plan order,
with the shared global scale. Calibration-free schemes (nvfp4a16, mxfp4a16, mxfp4, mxfp8) never build
the model; nvfp4 calibrates input amax as fp8-static does and stores 448 * 6 / amax (in the weights'
dtype, as llm-compressor computes it) as each Linear's input_global_scale.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mixprec.inference.checkpoint.block_tensors import fused_global_scales, input_global_scale, layer_tensors
from mixprec.inference.checkpoint.safetensors_io import Checkpoint, ShardReader
from mixprec.inference.checkpoint.scales_file import compact_entry
from mixprec.inference.schemes import InferenceScheme, check_finite, quantize_weight


def weight_global_scales(
    ckpt: Checkpoint, targets: dict[str, tuple[int, int]], schemes: dict[str, InferenceScheme]
) -> dict[str, torch.Tensor]:
    """{Linear: its NVFP4 weight global scale, shared across its fused GEMM's shards} for the targets
    whose scheme has E4M3 block scales; empty when there are none."""
    nv = [m for m in targets if schemes[m].weight_granularity.scale_format == "e4m3"]
    if not nv:
        return {}
    infos = {m: ckpt.tensors[f"{m}.weight"] for m in nv}
    buf = torch.empty(max(i.nbytes for i in infos.values()), dtype=torch.uint8)
    amax: dict[str, float] = {}
    dtypes = set()
    with ShardReader() as reader:
        for m, info in infos.items():
            w = reader.get(info, out=buf)
            lo, hi = torch.aminmax(w)
            a = max(-float(lo), float(hi))
            if not math.isfinite(a):
                check_finite(w, info.name)  # raises, naming the tensor and the count
            amax[m] = a
            dtypes.add(info.dtype)
    # the weights' own dtype (a checkpoint of one dtype; fp32 when they mix)
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    return fused_global_scales(amax, dtype)


def quantize_block_task(
    reader: ShardReader,
    info,
    module: str,
    shape: tuple[int, int],
    sch: InferenceScheme,
    in_amax: float | None,
    in_pool,
    out_pool,
    global_scale: torch.Tensor | None,
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any], torch.Tensor]:
    """quantize._quantize_task for a block scheme: (output tensors in plan order, report entry, payload
    buffer to release once written)."""
    buf = in_pool.get()
    try:
        w = reader.get(info, out=buf)
        payload = out_pool.get()
        dtype = sch.fmt.torch_dtype if sch.fmt.bits == 8 else torch.uint8
        data = payload[: w.numel()].view(dtype).view(shape)
        q, stats = quantize_weight(w, sch, name=info.name, out=data, global_scale=global_scale)
    finally:
        in_pool.release(buf)
    in_global = input_global_scale(in_amax, info.dtype) if sch.input_global else None
    out = layer_tensors(module, q, sch, in_global)
    return out, compact_entry(q, sch, stats, shape, in_global, in_amax), payload


__all__ = ["quantize_block_task", "weight_global_scales"]
