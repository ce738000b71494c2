"""The bf16 forward of the inference Linears: exact bf16 operands, one native bf16 GEMM, the scales after.

On a CPU with AVX-512-BF16 or AMX a bf16 matmul is ~4-5x faster than fp32 (docs/benchmarks.md), so a
bf16 model's Linears outrun the fp32 emulation of the same layer quantized (decoded payload, fp32 GEMM).
Every operand this forward feeds the bf16 GEMM is exact in bf16:

- E4M3 payloads (3 mantissa bits, exponents 2^-9..2^8) are bf16 values;
- an E2M1 code times its E4M3 block scale (NVFP4) has at most 6 significant bits and lies in
  [2^-10, 2688]: a normal bf16 value — the tensor's fp32 global scale stays out of the GEMM;
- a bf16 model's input is bf16 already (A16 schemes take this path only then).

Products of two bf16 values are exact in fp32 and oneDNN accumulates them in fp32, so the
GEMM's sums are the fp32 emulation's sums up to the order of accumulation (and, for A16, up to the
bf16 dot-product instructions flushing subnormal inputs below 2^-126 to zero, as in the bf16 model's own
GEMMs; W8A8's smallest product is 2^-18, normal). What differs is where they
are rounded: torch's CPU GEMM writes bf16 only (no bf16 x bf16 -> fp32 kernel is exposed), so each sum
S is rounded to bf16 *before* the scales multiply it, where the fp32 path rounds once after:

    fp32 path:  round_out( S * row_scale * col_scale + bias )           (S in fp32)
    bf16 path:  round_out( bf16(S) * row_scale * col_scale + bias )     (the same fp32 epilogue)

So the bf16 path gives bit-identical outputs whenever S is a bf16 value (e.g. small integer payload
sums, tested), and otherwise differs by that one extra rounding: |bf16(S) - S| <= 2^-9 |S|, i.e. at
most one bf16 unit in the last place of the output for a bf16 model (tests bound it against fp64).
NVFP4 A16 divides the sums by the global scale instead of multiplying each weight by block scale /
global scale (two roundings of the fp32 path's per-weight product are gone; the bound covers both).

Only bf16 outputs take this path (an fp32 model keeps the fp32 emulation, whose precision it asks
for), and only where detect() finds native bf16 GEMMs (elsewhere bf16 is emulated in software and
slower than fp32), unless a layer forces it (tests, on any CPU).
"""

from __future__ import annotations

import torch

from mixprec.formats import E4M3, decode, decode_unscaled
from mixprec.kernels import emulation
from mixprec.kernels.hardware import detect
from mixprec.scaling import Granularity, expand_scale

BF16_MODES = ("auto", "always", "never")

_CAPABILITIES: list = []  # detect() once: a list read traces as a constant under torch.compile


def cpu_bf16_native() -> bool:
    """detect().cpu_bf16_native, memoized in a list: call it once eagerly (a layer's constructor does),
    since dynamo would trace into detect()'s probes (os.stat), a graph break."""
    if not _CAPABILITIES:
        _CAPABILITIES.append(detect())
    return _CAPABILITIES[0].cpu_bf16_native


def takes_bf16_path(mode: str, device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether a Linear with `mode` ("auto" | "always" | "never") runs the bf16 forward for this call."""
    if mode == "never" or out_dtype != torch.bfloat16:
        return False
    if mode == "always":
        return True
    # "auto" follows mixprec.kernels.emulation: --gemm-emulation fp32 (or $MIXPREC_GEMM_EMULATION)
    # keeps these layers on the fp32 emulation too, for numbers that reproduce across machines
    return device.type == "cpu" and cpu_bf16_native() and emulation.backend_for(device) == "bf16"


# ---------------------------------------------------------------------------------------------------
# Exact bf16 operands


def e4m3_to_bf16_unscaled(payload: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(values, factor): bf16 values with values * factor == the E4M3 payload's values, exactly.

    Eager on the CPU: formats.decode_unscaled's vectorized bit trick (values * 2^-8, factor 2^8; NaN
    codes decoded by torch's cast) and one fp32 -> bf16 cast, exact (the smallest, 2^-17, is normal);
    torch's float8 -> bf16 cast is scalar code there (3 ms for a 1536 x 576 weight, against ~0.6 ms)."""
    values, factor = decode_unscaled(payload, E4M3)
    return values.to(torch.bfloat16), factor


def e4m3_to_bf16(payload: torch.Tensor) -> torch.Tensor:
    """The E4M3 payload's values in bf16, exactly (the decoded-weight cache holds these)."""
    values, factor = e4m3_to_bf16_unscaled(payload)
    return values.mul_(factor) if factor != 1.0 else values  # a power of two: exact


def folded(scale: torch.Tensor, factor: float) -> torch.Tensor | None:
    """scale * factor (a power of two: exact), None where that overflows (scales near fp32's maximum)."""
    if factor == 1.0:
        return scale
    out = scale * factor
    return out if bool(torch.isfinite(out).all()) else None


def e2m1_block_weight_bf16(codes: torch.Tensor, block_scale: torch.Tensor, g: Granularity) -> torch.Tensor:
    """NVFP4 codes [N, K] times their E4M3 block scales, in bf16, exactly (6 significant bits at most;
    the global scale is left out: the caller divides the GEMM's sums by it)."""
    rows, cols = codes.shape
    values = decode(codes, "e2m1") * expand_scale(block_scale.float(), g, rows, cols)
    return values.to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------------
# The GEMM and its fp32 epilogue


def scaled_bf16_linear(
    a: torch.Tensor,
    w: torch.Tensor,
    *,
    row_scale: torch.Tensor | None,
    col_scale: torch.Tensor | None,
    divisor: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """round_out(bf16(a @ w.T) * row_scale * col_scale / divisor + bias), the epilogue in fp32.

    a: [M, K] bf16, w: [N, K] bf16 (exact operands); row_scale [M, 1] or [1, 1], col_scale [1, N] or
    [1, 1], divisor [1] (NVFP4's global scale). The scales multiply in the order of the emulated GEMM
    (mixprec.gemm): one product of two per-tensor scales, else the rows first, then the columns; the
    bias after the product is rounded (never fused into it: an FMA would round once less)."""
    out = torch.nn.functional.linear(a, w).float()
    if row_scale is not None and col_scale is not None:
        if row_scale.numel() == 1 or col_scale.numel() == 1:
            out.mul_(row_scale * col_scale)
        else:
            out.mul_(row_scale)
            out.mul_(col_scale)
    elif row_scale is not None or col_scale is not None:
        out.mul_(row_scale if row_scale is not None else col_scale)
    if divisor is not None:
        out.div_(divisor)
    if bias is not None:
        out.add_(bias.float())
    return out.to(out_dtype)


__all__ = [
    "BF16_MODES",
    "cpu_bf16_native",
    "e2m1_block_weight_bf16",
    "e4m3_to_bf16",
    "e4m3_to_bf16_unscaled",
    "folded",
    "scaled_bf16_linear",
    "takes_bf16_path",
]
