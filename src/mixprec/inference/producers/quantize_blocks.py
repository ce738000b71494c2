"""The block formats (NVFP4, MXFP4, MXFP8) in offline streaming quantization (producers/quantize.py calls these).

NVFP4's weight global scales are per fused GEMM (block_tensors.fused_global_scales): the shards of
q/k/v or gate/up are read together, once, by one task (quantize_group_task): their amax gives the shared
global scale, and each is quantized from the buffer it was read into (a fused GEMM's inputs in memory
at once, where an earlier pre-pass read every NVFP4 weight a second time for its amax). Calibration-free schemes (nvfp4a16, mxfp4a16, mxfp4, mxfp8) never build
the model; nvfp4 calibrates input amax as fp8-static does and stores 448 * 6 / amax (in the weights'
dtype, as llm-compressor computes it) as each Linear's input_global_scale.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mixprec.inference.algorithms.gptq_pass import rounding_stats
from mixprec.inference.algorithms.scale_search import search_weight
from mixprec.inference.checkpoint.block_tensors import fused_global_scales, input_global_scale, layer_tensors
from mixprec.inference.checkpoint.safetensors_io import Checkpoint, ShardReader
from mixprec.inference.checkpoint.scales_file import compact_entry
from mixprec.inference.schemes import InferenceScheme, check_finite, quantize_weight
from mixprec.quantization import QuantizationStats
from mixprec.scaling import QuantizedTensor
from mixprec.select import fused_shards


def nvfp4_groups(
    ckpt: Checkpoint, targets: dict[str, tuple[int, int]], schemes: dict[str, InferenceScheme]
) -> tuple[dict[str, tuple[str, ...]], torch.dtype]:
    """({NVFP4 target: the targets that share its weight global scale, its fused GEMM's shards in
    order, or itself alone}, the dtype the global scales are computed in: the NVFP4 weights' own, fp32
    when they mix). Metadata only: nothing is read."""
    nv = [m for m in targets if schemes[m].weight_granularity.scale_format == "e4m3"]
    groups = {m: (m,) for m in nv}
    for members in fused_shards(nv).values():
        groups.update(dict.fromkeys(members, tuple(members)))
    dtypes = {ckpt.tensors[f"{m}.weight"].dtype for m in nv}
    return groups, dtypes.pop() if len(dtypes) == 1 else torch.float32


def quantize_group_task(
    reader: ShardReader, infos: list, shapes: list[tuple[int, int]], schemes: list[InferenceScheme],
    in_amax: list[float | None], in_pool, out_pool, dtype: torch.dtype, search: bool = False,
) -> dict[str, tuple[list[tuple[str, torch.Tensor]], dict[str, Any], torch.Tensor]]:  # fmt: skip
    """The NVFP4 weights of one fused GEMM (or one weight alone), each read once: their amax gives the
    shared global scale (block_tensors.fused_global_scales, in `dtype`), then each is quantized from
    the same buffer. {module: (output tensors in plan order, report entry, payload buffer)}."""
    bufs: list[torch.Tensor] = []
    try:
        ws = _read_packed(reader, infos, in_pool, bufs)
        modules = [info.name[: -len(".weight")] for info in infos]
        amax = {m: _finite_amax(w, info.name) for m, w, info in zip(modules, ws, infos)}
        shared = fused_global_scales(amax, dtype)
        return {
            m: _quantize_read(w, info, m, shape, sch, a, out_pool, shared[m], search)
            for m, w, info, shape, sch, a in zip(modules, ws, infos, shapes, schemes, in_amax)
        }
    finally:
        for buf in bufs:
            in_pool.release(buf)


def _read_packed(reader: ShardReader, infos: list, in_pool, bufs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The weights of `infos`, read one after another into as few pool buffers as they fit in (q/k/v
    share one buffer sized for the largest weight); the buffers taken are appended to `bufs` (for the
    caller to release, also when a read fails)."""
    ws = []
    for info, (index, offset) in zip(infos, packed_layout([i.nbytes for i in infos], in_pool.size)):
        if index == len(bufs):
            bufs.append(in_pool.get())
        ws.append(reader.get(info, out=bufs[index][offset:]))
    return ws


def packed_layout(sizes: list[int], buffer_bytes: int) -> list[tuple[int, int]]:
    """Where a group's weights go when read into buffers of `buffer_bytes` one after another: (buffer
    index, byte offset) each. A plan counts the buffers a group task takes from this too."""
    out, index, used = [], -1, buffer_bytes
    for nbytes in sizes:
        if used + nbytes > buffer_bytes:
            index, used = index + 1, 0
        out.append((index, used))
        used += -(-nbytes // _ALIGN) * _ALIGN
    return out


# where the next weight of a shared read buffer starts: a multiple of this many bytes
_ALIGN = 64


def _finite_amax(w: torch.Tensor, name: str) -> float:
    lo, hi = torch.aminmax(w)
    a = max(-float(lo), float(hi))
    if not math.isfinite(a):
        check_finite(w, name)  # raises, naming the tensor and the count
    return a


def quantize_block_task(
    reader: ShardReader,
    info,
    module: str,
    shape: tuple[int, int],
    sch: InferenceScheme,
    in_amax: float | None,
    in_pool,
    out_pool,
    search: bool = False,
) -> dict[str, tuple[list[tuple[str, torch.Tensor]], dict[str, Any], torch.Tensor]]:
    """quantize._quantize_task for a block scheme without a shared global scale (MX): {module: (output
    tensors in plan order, report entry, payload buffer to release once written)}."""
    buf = in_pool.get()
    try:
        return {
            module: _quantize_read(
                reader.get(info, out=buf), info, module, shape, sch, in_amax, out_pool, search=search
            )
        }
    finally:
        in_pool.release(buf)


def _quantize_read(w, info, module, shape, sch, in_amax, out_pool, global_scale=None, search=False):
    """One weight already read: (output tensors, report entry, the payload buffer the writer releases,
    or None when it is already free); search: its block scales from the scale search
    (scale_search.py), the global scale with the search's headroom."""
    if search:
        check_finite(w, info.name)
        q = search_weight(w, sch.fmt, sch.weight_granularity, global_scale)
        return (*block_outputs(q, rounding_stats(w, q), info, module, shape, sch, in_amax), None)
    payload = out_pool.get()
    data = payload_view(payload, shape, sch)
    q, stats = quantize_weight(w, sch, name=info.name, out=data, global_scale=global_scale)
    return (*block_outputs(q, stats, info, module, shape, sch, in_amax), payload)


def payload_bytes(shape: tuple[int, int], sch: InferenceScheme) -> int:
    """The bytes of a weight's payload as streaming writes it: one a code for 8-bit formats, half a
    byte for 4-bit ones (packed). A streaming run's payload buffers are the largest of these."""
    return math.prod(shape) * sch.fmt.bits // 8


def payload_view(buffer: torch.Tensor, shape: tuple[int, int], sch: InferenceScheme) -> torch.Tensor:
    """The payload a streaming weight is quantized into, from the start of a reused uint8 buffer: the
    format's float8 dtype [rows, cols] for FP8; uint8 [rows, cols / 2] for 4-bit codes, packed two a byte
    as they are quantized (kernels/tiled.py) and written."""
    rows, cols = shape
    dtype = sch.fmt.torch_dtype if sch.fmt.bits == 8 else torch.uint8
    return buffer[: payload_bytes(shape, sch)].view(dtype).view(rows, cols * sch.fmt.bits // 8)


def block_outputs(q: QuantizedTensor, stats: QuantizationStats, info, module: str, shape: tuple[int, int],
                  sch: InferenceScheme, in_amax: float | None) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:  # fmt: skip
    """A block-format weight's output tensors in plan order and its report entry, from its quantized
    form (rounded here, or by an algorithm: producers/quantize_stream.py)."""
    in_global = input_global_scale(in_amax, info.dtype) if sch.input_global else None
    return layer_tensors(module, q, sch, in_global), compact_entry(q, sch, stats, shape, in_global, in_amax)


__all__ = [
    "block_outputs",
    "nvfp4_groups",
    "packed_layout",
    "payload_bytes",
    "payload_view",
    "quantize_block_task",
    "quantize_group_task",
]
