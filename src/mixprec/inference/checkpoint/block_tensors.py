"""The block formats' tensors (NVFP4, MXFP4, MXFP8): a QuantizedTensor to the tensors the layout table
names (layout.planned_tensors), and back (compressed-tensors' names, or ModelOpt's).

The dequantized weight is payload * weight_scale / weight_global_scale (NVFP4; fp32) or
payload * 2^(code - 127) (MX). ModelOpt's NVFP4 export stores `weight` (packed as compressed-tensors
packs it), `weight_scale` (E4M3), `weight_scale_2` = 1 / global scale and `input_scale` = 1 / input
global scale; it is read here by compressed-tensors' own conversion rule (global = 1 / weight_scale_2).

NVFP4 global scales: the shards of one fused GEMM (q/k/v, gate/up, an expert's w1/w3:
mixprec.select.fused_shards) share one weight global scale, from the largest amax among them
(llm-compressor does so; vLLM takes one for the fused layer, so unshared ones would dequantize wrong).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mixprec.errors import MixprecError
from mixprec.formats import E2M1, pack_nibbles, pow2, unpack_nibbles
from mixprec.inference.checkpoint.layout import (
    INPUT_GLOBAL_SCALE,
    INPUT_SCALE,
    WEIGHT,
    WEIGHT_GLOBAL_SCALE,
    WEIGHT_PACKED,
    WEIGHT_SCALE,
    WEIGHT_SCALE_2,
    planned_tensors,
)
from mixprec.inference.schemes import InferenceScheme
from mixprec.scaling import QuantizedTensor, global_scale_from_amax
from mixprec.select import fused_shards


def layer_tensors(
    module: str, q: QuantizedTensor, scheme: InferenceScheme, input_global_scale: torch.Tensor | None = None
) -> list[tuple[str, torch.Tensor]]:
    """The tensors of one quantized Linear, in planned_tensors' order."""
    payload = pack_nibbles(q.data) if q.fmt.bits == 4 and not q.packed else q.data
    nv = q.granularity.scale_format == "e4m3"
    out = [(planned_tensors(module, tuple(q.shape), scheme)[0][0], payload)]
    out.append((f"{module}.{WEIGHT_SCALE}", q.scale_e4m3() if nv else q.scale_e8m0()))
    if nv:
        out.append((f"{module}.{WEIGHT_GLOBAL_SCALE}", q.global_scale.float().reshape(1)))
    if scheme.input_global:
        if input_global_scale is None:
            raise MixprecError(f"{module}: scheme {scheme.name} needs a calibrated input global scale")
        out.append((f"{module}.{INPUT_GLOBAL_SCALE}", input_global_scale.float().reshape(1)))
    return out


def read_layer(
    tensors: dict[str, torch.Tensor], module: str, scheme: InferenceScheme, shape: tuple[int, int], where: str,
    *, modelopt: bool = False,
) -> tuple[QuantizedTensor, torch.Tensor | None]:  # fmt: skip
    """(the weight as a QuantizedTensor, the input global scale or None), popping the layer's tensors
    from `tensors` (compressed-tensors names, or ModelOpt's with modelopt=True)."""
    out_f, in_f = shape
    g = scheme.weight_granularity
    nv = g.scale_format == "e4m3"
    payload_name = f"{module}.{WEIGHT}" if modelopt or scheme.fmt.bits == 8 else f"{module}.{WEIGHT_PACKED}"
    payload = tensors.pop(payload_name, None)
    scale = tensors.pop(f"{module}.{WEIGHT_SCALE}", None)
    if payload is None or scale is None:
        raise MixprecError(
            f"{where}: {module} lacks {payload_name if payload is None else module + '.' + WEIGHT_SCALE}"
        )
    if scheme.fmt.bits == 4:
        if payload.dtype != torch.uint8 or tuple(payload.shape) != (out_f, in_f // 2):
            raise MixprecError(f"{where}: {payload_name} must be uint8 {(out_f, in_f // 2)} (packed FP4), got {payload.dtype} {tuple(payload.shape)}")  # fmt: skip
        data = unpack_nibbles(payload)
    else:
        data = payload.view(torch.float8_e4m3fn) if payload.dtype == torch.uint8 else payload
    grid = g.scale_shape(out_f, in_f)
    if scale.numel() != grid[0] * grid[1]:
        raise MixprecError(
            f"{where}: {module}.weight_scale has {scale.numel()} values, {scheme.name} needs {grid}"
        )
    scale = scale.reshape(grid)
    global_scale = input_global = None
    if nv:
        scale = scale.view(torch.float8_e4m3fn).float() if scale.dtype == torch.uint8 else scale.float()
        if modelopt:
            s2 = tensors.pop(f"{module}.{WEIGHT_SCALE_2}", None)
            if s2 is None:
                raise MixprecError(f"{where}: {module} lacks weight_scale_2 (ModelOpt NVFP4)")
            global_scale = (1 / s2.float()).reshape(1)  # compressed-tensors' ModelOpt converter's rule
            inp = tensors.pop(f"{module}.{INPUT_SCALE}", None)
            input_global = None if inp is None else (1 / inp.float()).reshape(1)
        else:
            global_scale = tensors.pop(f"{module}.{WEIGHT_GLOBAL_SCALE}", None)
            if global_scale is None:
                raise MixprecError(f"{where}: {module} lacks weight_global_scale (NVFP4)")
            global_scale = global_scale.float().reshape(1)
            inp = tensors.pop(f"{module}.{INPUT_GLOBAL_SCALE}", None)
            input_global = None if inp is None else inp.float().reshape(1)
        if not bool(torch.isfinite(global_scale).all() and (global_scale > 0).all()):
            raise MixprecError(f"{where}: {module}'s global scale is not finite and positive")
    else:
        if scale.dtype != torch.uint8:
            raise MixprecError(
                f"{where}: {module}.weight_scale must hold uint8 E8M0 codes, got {scale.dtype}"
            )
        scale = pow2(scale.to(torch.int32) - 127)
    q = QuantizedTensor(data, scale, scheme.fmt, g, torch.Size(shape), global_scale)
    return q, input_global


def fused_global_scales(amax: Mapping[str, float], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{Linear name: its NVFP4 weight global scale}: from the Linear's own amax, or the largest amax of
    its fused GEMM's shards among `amax` (one scale for q/k/v, for gate/up, for an expert's w1/w3),
    computed in the weights' dtype as compressed-tensors does."""
    shared = {n: max(amax[m] for m in members) for members in fused_shards(amax).values() for n in members}
    return {n: global_scale_from_amax(shared.get(n, a), E2M1, dtype) for n, a in amax.items()}


def input_global_scale(amax: float, dtype: torch.dtype) -> torch.Tensor:
    """nvfp4's static input global scale from a calibrated input amax (448 * 6 / amax, in `dtype`)."""
    return global_scale_from_amax(amax, E2M1, dtype)
