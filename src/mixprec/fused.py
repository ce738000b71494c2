"""torch.compile'd cast and quantize: the results of formats.cast_to_format and scaling.quantize, bit for bit.

    from mixprec import fused
    q = fused.quantize(x, "e4m3", Granularity.blocks(1, 128))   # same arguments and result as scaling.quantize
    y = fused.cast_to_format(x, "e2m1")                            # same as formats.cast_to_format

Eager quantization makes one memory pass per operation (amax, divide, clamp, cast, and for the
emulated formats a dozen more); Inductor fuses them into one pass for the amax and one for the
payload. The arithmetic is the eager code's, written without in-place ops or data-dependent Python
branches so it traces into one graph — for torch's FP8 dtypes it is mixprec.kernels.traceable's
quantize_traceable itself (one traceable quantize in the package; this module adds the CPU compile
wrapper, its fallbacks and the sub-byte formats):
- amax over the finite elements: max of where(isfinite(x), |x|, 0), which is what block_amax returns;
- scales by the very same compute_scale / compute_mx_scale;
- payload = cast(x / scale): fp32 division (never a multiplication by a reciprocal), an explicit clamp
  to +-max (so torch's overflow behaviour does not matter), then torch's in-range RNE cast; for the
  formats torch lacks, the code arithmetic of formats._round_to_codes.

Where the compiled path is not used (falls back to the eager functions, same results): fp64 input,
non-saturating casts, casts into formats torch has (one torch cast already; and Inductor would drop the
rounding of x.to(bf16).float() unless emulate_precision_casts is set), E8M0, a tensor whose last dim is not a multiple of 16 or whose shape is not a
multiple of the block (edge blocks). The last-dim rule is deliberate: torch 2.13's CPU Inductor was
seen (by another engineer, 2026-11-30) to write wrong fp8 payloads in the partial last vector of
each row; whole vectors only avoids that code path, and tests/test_scaling.py checks bit-identity.

Each (format, granularity, options, shape) compiles once (seconds to tens of seconds on 2 cores) and
is reused; torch.compile's own recompile limit applies, beyond which torch runs the same code
eagerly. Use it for large tensors that are quantized many times, with fixed shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache

import torch

from mixprec import formats, scaling
from mixprec.errors import MixprecError
from mixprec.formats import Format, check_float_tensor, get_format
from mixprec.kernels import traceable
from mixprec.scaling import Granularity, QuantizedTensor

_SIGN_BIT = -(2**31)  # 0x80000000 as an int32
VECTOR = 16  # fp32 lanes of one AVX-512 vector: the compiled path only runs on whole vectors per row


def available() -> bool:
    """Whether torch.compile can build CPU code here (a C++ compiler is found); probed once."""
    return _probe()


@cache
def _probe() -> bool:
    try:
        fn = torch.compile(lambda t: t * 2.0 + 1.0, dynamic=False, fullgraph=True)
        return bool(torch.equal(fn(torch.ones(VECTOR)), torch.full((VECTOR,), 3.0)))
    except Exception:  # no compiler, unsupported platform: the eager functions remain
        return False


# ---------------------------------------------------------------------------------------------------
# Traceable pieces (no in-place ops, no Python branches on tensor values). The amax, scale, division
# and FP8 cast are mixprec.kernels.traceable's (the one graph-break-free quantize, also what
# torch.compile'd training layers and kernels.compiled run); only the sub-byte encoding is here.


def _codes(y: torch.Tensor, fmt: Format) -> torch.Tensor:
    """formats._round_to_codes, out of place (NaN is checked by the caller)."""
    m = fmt.mantissa_bits
    ax = y.abs().clamp(max=fmt.max)
    binade = (ax.view(torch.int32) & 0x7F800000).view(torch.float32).clamp(min=fmt.min_normal)
    magic = math.ldexp(1.0, 23 - m)
    significand = ((ax / binade + magic) - magic) * float(2**m)
    field = ((binade.view(torch.int32) >> 23) - (127 - fmt.bias + 1)) << m
    # The sign from the bits: torch.signbit has no vectorized CPU lowering (it made the kernel 4x slower).
    sign = (y.view(torch.int32) < 0).to(torch.int32) << (fmt.exponent_bits + m)
    return ((significand.to(torch.int32) + field) | sign).to(torch.uint8)


def _emulated_cast(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """formats._cast_emulated_saturating, out of place."""
    ax = x.abs().clamp(max=fmt.max)
    binade = (ax.view(torch.int32) & 0x7F800000).view(torch.float32).clamp(min=fmt.min_normal)
    magic = math.ldexp(1.0, 23 - fmt.mantissa_bits)
    rounded = ((ax / binade + magic) - magic) * binade
    return (rounded.view(torch.int32) | (x.view(torch.int32) & _SIGN_BIT)).view(torch.float32)  # copysign


# ---------------------------------------------------------------------------------------------------
# Compiled functions, one per configuration


@cache
def _compiled_quantize(fmt: Format, g: Granularity, margin: int, power_of_two: bool, given: bool) -> Callable:
    def run(x2: torch.Tensor, scale: torch.Tensor | None):
        if fmt.torch_dtype is not None:  # torch's FP8 dtypes: kernels.traceable as is
            q = traceable.quantize_traceable(
                x2, fmt, g, scale=scale, margin=margin, power_of_two=power_of_two
            )
            return q.data, q.scale, torch.zeros((), dtype=torch.bool)
        if not given:
            amax = traceable.finite_block_amax(x2, g)
            scale = traceable.scale_from_amax(amax, fmt, g, margin, power_of_two)
        y = traceable.divide_by_scale(x2, scale, g)
        return _codes(y, fmt), scale, torch.isnan(y).any()

    return torch.compile(run, dynamic=False, fullgraph=True)


@cache
def _compiled_cast(fmt: Format) -> Callable:
    def run(x: torch.Tensor) -> torch.Tensor:
        return _emulated_cast(x, fmt)

    return torch.compile(run, dynamic=False, fullgraph=True)


def _fits(x2: torch.Tensor, g: Granularity) -> bool:
    rows, cols = x2.shape
    br, bc = g.block_shape(rows, cols)
    return cols % VECTOR == 0 and rows % br == 0 and cols % bc == 0


# ---------------------------------------------------------------------------------------------------
# Public functions: the eager API, compiled where it applies


def quantize(
    x: torch.Tensor,
    fmt: str | Format,
    granularity: Granularity | None = None,
    *,
    scale: torch.Tensor | None = None,
    margin: int = 0,
    power_of_two: bool = False,
) -> QuantizedTensor:
    """scaling.quantize (same arguments, bit-identical result), compiled where it applies."""
    g = granularity or Granularity.tensor()
    fmt = get_format(fmt)
    check_float_tensor(x, "x")
    if x.dtype == torch.float64 or x.numel() == 0 or fmt.bits > 8 or fmt.special == "e8m0" or not available():
        return scaling.quantize(x, fmt, g, scale=scale, margin=margin, power_of_two=power_of_two)
    x2 = scaling.as_2d(x).float()
    if not _fits(x2, g):
        return scaling.quantize(x, fmt, g, scale=scale, margin=margin, power_of_two=power_of_two)
    if scale is not None:
        scale = scaling._check_scale(scale, g.scale_shape(*x2.shape), g)
    data, scale, has_nan = _compiled_quantize(fmt, g, margin, power_of_two, scale is not None)(x2, scale)
    if bool(has_nan):
        raise MixprecError(f"cannot encode NaN in {fmt.name}: the format has no NaN code")
    return QuantizedTensor(data, scale, fmt, g, x.shape)


def cast_to_format(x: torch.Tensor, fmt: str | Format, saturate: bool = True) -> torch.Tensor:
    """formats.cast_to_format (bit-identical), compiled for saturating casts into TF32, FP6 and FP4."""
    fmt = get_format(fmt)
    check_float_tensor(x, "x")
    # Only the emulated formats: for torch's own dtypes, Inductor drops the round trip
    # x.to(bf16).float() unless emulate_precision_casts is set (seen for bf16 on torch 2.13), and eager
    # is one torch cast there anyway.
    usable = (
        saturate and x.dtype != torch.float64 and fmt.torch_dtype is None and fmt.special in ("ieee", "none")
    )
    if not usable or x.dim() == 0 or x.numel() == 0 or x.shape[-1] % VECTOR != 0 or not available():
        return formats.cast_to_format(x, fmt, saturate)
    return _compiled_cast(fmt)(x.float())


__all__ = ["available", "cast_to_format", "quantize"]
