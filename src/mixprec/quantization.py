"""THE quantize / dequantize entry: one function, several backends, bit-identical payloads and scales.

    from mixprec.quantization import quantize, dequantize
    q = quantize(x, "e4m3", Granularity.blocks(1, 128))   # QuantizedTensor: payload + scales
    x_hat = dequantize(q)                                  # fp32, exact: payload * scale

Every caller in mixprec (training, inference, ONNX, FSDP all-gather, benchmarks) quantizes here. The
backends compute one thing in different ways, from pieces each written once: the amax -> scale rule
(scaling.scale_from_amax), the scale grid expanded per element (scaling.expand_scale), a division by
the scale (never a multiplication by its reciprocal), and a saturating round-to-nearest-even cast
(torch's in-range cast for FP8, formats.round_to_grid for the formats torch lacks).

    backend      runs on         how
    "eager"      any device      the reference torch code: one fp32 working copy, reduced, divided
                                 and cast in place; validates given scales; refuses NaN for FP6/FP4
    "traceable"  any device      the same arithmetic without data-dependent Python (kernels.traceable)
    "compiled"   CPU             "traceable" compiled by Inductor (kernels.compiled): one fused pass
                                 for the amax, one for the payload; each configuration and shape
                                 compiles once, for seconds
    "triton"     CUDA + triton   fused Triton kernels for E4M3/E5M2 (kernels.triton_quant)
    "tiled"      CPU             tiles in reused buffers (kernels.tiled): bounded memory for big
                                 weights, and the statistics quantize_with_stats reports; E4M3,
                                 E5M2 and E2M1 of fp32 or bf16 input in two passes of compiled C
                                 (kernels.c_quantize) where the machine's C compiler built them

backend="auto" picks the way gemm.scaled_mm picks its GEMM, by capability and size: "traceable"
inside torch.compile; "triton" on CUDA where triton is installed and its kernels take the case; on
the CPU "tiled" for memory from kernels.tiled.TILED_MIN_ELEMENTS elements (an fp32 working copy of
1 GiB; tiles are not faster than eager there, see kernels.tiled), for NVFP4 from
kernels.tiled.NVFP4_TILED_MIN_ELEMENTS (eager's whole-tensor temporaries cost more there), always
for quantize_with_stats, and for every case the compiled C takes (FP8 per tensor, per row and 1 x 128
measured 1.4-6x faster than eager from 128 x 128 to 2048 x 4096 on the AVX-512-BF16 EPYC, 2026-12;
FP4 training steps unchanged within noise); else "eager". Never "compiled" (its compile time). A
forced backend that cannot take the case raises MixprecError saying why (`backend_available` asks
first). Checks that read a value (the FP6/FP4 NaN check, a given global scale) are Python checks
raising MixprecError in eager mode and, under torch.compile, assertions inside the graph
(formats.raise_if): no graph break, the same message (as a RuntimeError) when the compiled code
meets such an input.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from mixprec.errors import MixprecError
from mixprec.formats import (
    Format,
    cast_to_format,
    check_float_tensor,
    encode_inplace,
    get_format,
    pack_nibbles,
    raise_if,
)
from mixprec.kernels import c_quantize, compiled, tiled
from mixprec.kernels.codes import encode_codes_into
from mixprec.kernels.native import triton_usable, triton_version
from mixprec.kernels.traceable import quantize_traceable
from mixprec.rounding import stochastic_round_to_grid
from mixprec.scaling import (
    Granularity,
    QuantizedTensor,
    apply_blockwise,
    as_2d,
    as_transposed,
    block_amax,
    check_scale,
    global_scale_from_amax,
    packed_payload_shape,
    scale_from_amax,
)

BACKENDS = ("auto", "eager", "traceable", "compiled", "triton", "tiled")


@dataclass(frozen=True)
class QuantizationStats:
    """What the inference reports record about a quantized tensor."""

    amax: float  # max |x| (over the finite elements where the scales were computed)
    relative_error: float  # ||x - dequantize(quantize(x))||_F / ||x||_F; NaN when x holds NaN or inf


def quantize(
    x: torch.Tensor,
    fmt: str | Format,
    granularity: Granularity | None = None,
    *,
    scale: torch.Tensor | float | None = None,
    margin: int = 0,
    power_of_two: bool = False,
    backend: str = "auto",
    validate_scale: bool = True,
    global_scale: torch.Tensor | float | None = None,
    rounding_key: int | None = None,
) -> QuantizedTensor:
    """Quantize x (saturating) to `fmt` with one scale per block of `granularity` (default per tensor).

    scale=None computes scales from x's amax (divided by fmt.max * 2^margin, rounded up to a power of
    two if power_of_two; E8M0 granularities follow OCP MX). A given scale (delayed or static scaling)
    is used as is and must fit the scale grid; validate_scale=False skips its finite/positive check,
    for hot-path callers that computed it (the check syncs with a GPU; under torch.compile it is never
    made). The input is read, never modified; it is converted to fp32 first (exact for bf16/fp16).
    E4M3 (NVFP4) granularities: global_scale=None computes the per-tensor global scale from x's amax
    (scaling.global_scale_from_amax); give one to share it (fused q/k/v shards, a calibrated
    activation scale); a given `scale` then holds E4M3 block scales in its units. Eager and tiled.
    rounding_key: None rounds to nearest even; an integer rounds stochastically onto the format's grid
    with the counter-based noise of that key (mixprec.rounding.stochastic_round_to_grid; element i of
    the row-major 2-D view gets noise i): FP4 training's gradients. Eager only.
    backend: see the module docstring.
    """
    q, _ = _quantize(
        x, fmt, granularity, scale, margin, power_of_two, backend, validate_scale, None, False, global_scale,
        rounding_key,
    )  # fmt: skip
    return q


def quantize_with_stats(
    x: torch.Tensor,
    fmt: str | Format,
    granularity: Granularity | None = None,
    *,
    scale: torch.Tensor | float | None = None,
    margin: int = 0,
    power_of_two: bool = False,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    global_scale: torch.Tensor | float | None = None,
) -> tuple[QuantizedTensor, QuantizationStats]:
    """quantize(x, ...) and its QuantizationStats (what inference reports for each weight).

    On the CPU ("auto") the tiled backend computes the statistics from the same pass over the tiles,
    in bounded memory; other backends compute them afterwards. out: a contiguous payload tensor of
    x's 2-D shape to write the payload into (a buffer the caller reuses).
    """
    return _quantize(x, fmt, granularity, scale, margin, power_of_two, backend, True, out, True, global_scale)


def quantize_transposed(
    x2: torch.Tensor,
    fmt: str | Format,
    granularity: Granularity,
    *,
    scale: torch.Tensor | None = None,
    margin: int = 0,
    power_of_two: bool = False,
    backend: str = "auto",
    validate_scale: bool = True,
    global_scale: torch.Tensor | float | None = None,
    rounding_key: int | None = None,
) -> QuantizedTensor:
    """The operand x2ᵀ quantized with `granularity` on the transposed [cols, rows] view.

    Computed on x2's own layout with the transposed blocking (no copy of the wide input), then the
    scales are transposed (scaling.as_transposed): bit-identical to quantize(x2.t(), ...). The
    payload is a transposed view (the emulated GEMM reads it as is; a native kernel makes it
    contiguous).
    """
    q = quantize(
        x2, fmt, granularity.transposed(), scale=scale, margin=margin, power_of_two=power_of_two,
        backend=backend, validate_scale=validate_scale, global_scale=global_scale, rounding_key=rounding_key,
    )  # fmt: skip
    return as_transposed(q, granularity)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """payload * scale, exactly (in fp32), in the original shape, returned in `dtype`."""
    return q.dequantize(dtype)


def fake_quantize(
    x: torch.Tensor, fmt: str | Format, granularity: Granularity | None = None, **kw
) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype: what a quantized operand contributes to a GEMM."""
    return quantize(x, fmt, granularity, **kw).dequantize(x.dtype)


def round_scaled(x: torch.Tensor, fmt: str | Format, effective: torch.Tensor) -> torch.Tensor:
    """quantize(x, fmt, g, scale=...).dequantize() for fp32 x, given each element's dequantization
    multiplier (`effective`, broadcast against x: QuantizedTensor.effective_scale() spread over its
    blocks): x / effective rounded saturating to the nearest (even) value of fmt, times effective. The
    eager backend's division, rounding and product, without its encode and decode (bit for bit, tested),
    for loops that round a few hundred values per call against scales fixed once (GPTQ's columns: a
    960 x 576 NVFP4 solve took 61 ms against 151 ms through quantize, one thread, AMX Xeon). x must be
    finite; nothing is checked."""
    return cast_to_format(x / effective, fmt).mul_(effective)


def backend_available(
    backend: str, x: torch.Tensor, fmt: str | Format, granularity: Granularity | None = None
) -> tuple[bool, str]:
    """(available, why not) for quantizing x to fmt with this backend here."""
    if backend not in BACKENDS:
        raise MixprecError(f"unknown quantize backend {backend!r}; valid: {', '.join(BACKENDS)}")
    why = _unavailable(backend, as_2d(x), get_format(fmt), granularity or Granularity.tensor())
    return why is None, why or ""


def choose_backend(x: torch.Tensor, fmt: str | Format, granularity: Granularity | None = None) -> str:
    """The backend backend="auto" runs for this tensor here."""
    return _auto(as_2d(x), get_format(fmt), granularity or Granularity.tensor(), stats=False)


# ---------------------------------------------------------------------------------------------------
# Dispatch


def _quantize(
    x, fmt, granularity, scale, margin, power_of_two, backend, validate_scale, out, stats, gscale, key=None
):
    if backend not in BACKENDS:
        raise MixprecError(f"unknown quantize backend {backend!r}; valid: {', '.join(BACKENDS)}")
    g = granularity or Granularity.tensor()
    fmt = get_format(fmt)
    check_float_tensor(x, "x")
    if fmt.bits > 8 or fmt.special == "e8m0":
        raise MixprecError(
            f"{fmt.name} is not an element format to quantize to (use e4m3, e5m2, e3m2, e2m3, e2m1)"
        )
    if x.numel() == 0:
        raise MixprecError(f"cannot quantize an empty tensor (shape {tuple(x.shape)})")
    x2 = as_2d(x)
    if key is not None and backend not in ("auto", "eager"):
        raise MixprecError(
            f"stochastic rounding (rounding_key) is done by the eager backend only, not {backend!r}"
        )
    if backend == "auto":
        backend = "eager" if key is not None else _auto(x2, fmt, g, stats)
    else:
        why = _unavailable(backend, x2, fmt, g)
        if why is not None:
            raise MixprecError(f"quantize backend {backend!r} unavailable: {why}")
    if gscale is not None and g.scale_format != "e4m3":
        raise MixprecError(f"a global scale applies to E4M3 (NVFP4) block scales, not to {g.name}")
    if scale is not None and g.scale_format == "e4m3" and gscale is None:
        raise MixprecError("given E4M3 block scales need the global scale they are in units of")
    if scale is not None:
        scale = _given_scale(scale, x2, g, validate_scale)
    packed = _packed_out(out, x2, fmt)
    has_nan = tile_stats = None
    if g.scale_format == "e4m3" and backend == "eager":  # eager and tiled take it (see _unavailable)
        data, scale, gscale = _eager_global(x2, fmt, g, scale, gscale, validate_scale, key)
    elif g.scale_format == "e4m3":
        gscale = _global_scale(x2, fmt, g, None, gscale, validate_scale)
        data, scale, tile_stats = tiled.quantize_tiled(
            x2, fmt, g, scale=scale, out=out, stats=stats, global_scale=gscale
        )
    elif backend == "eager":
        data, scale = _eager(x2, fmt, g, scale, margin, power_of_two, key)
    elif backend == "traceable":
        data, scale, has_nan = quantize_traceable(
            x2, fmt, g, scale=scale, margin=margin, power_of_two=power_of_two
        )
    elif backend == "compiled":
        data, scale, has_nan = compiled.quantize_compiled(
            x2, fmt, g, scale=scale, margin=margin, power_of_two=power_of_two
        )
    elif backend == "triton":
        from mixprec.kernels.triton_quant import fused_quantize  # imports triton: only where installed

        data, scale = fused_quantize(x2, fmt, g, scale=scale, margin=margin, power_of_two=power_of_two)
    else:
        data, scale, tile_stats = tiled.quantize_tiled(
            x2, fmt, g, scale=scale, margin=margin, power_of_two=power_of_two, out=out, stats=stats
        )
    if has_nan is not None:  # formats without a NaN code (an in-graph assertion if traced)
        raise_if(has_nan, f"cannot encode NaN in {fmt.name}: the format has no NaN code")
    if out is not None and data is not out:
        data = pack_nibbles(data, out=out) if packed else out.copy_(data)
    q = QuantizedTensor(data, scale, fmt, g, x.shape, gscale, packed)
    if not stats:
        return q, None
    if tile_stats is not None:
        return q, QuantizationStats(*tile_stats)
    if g.scale_format == "e4m3":  # NVFP4 on the eager backend: the fp32 form, without fp64 copies
        return q, _stats_fp32(x2, q)
    return q, _stats_of(x2, q)


def _packed_out(out: torch.Tensor | None, x2: torch.Tensor, fmt: Format) -> bool:
    """Whether `out` takes the payload packed (4-bit codes two a byte) rather than one per element;
    MixprecError when it is neither shape, not contiguous or of another dtype."""
    if out is None:
        return False
    dtype = fmt.torch_dtype or torch.uint8
    rows, cols = x2.shape
    packed_shape = packed_payload_shape(fmt, rows, cols)
    packed = packed_shape is not None and tuple(out.shape) == packed_shape
    if out.dtype != dtype or not out.is_contiguous() or not (packed or out.shape == x2.shape):
        also = f" (or {packed_shape}, packed two a byte)" if packed_shape else ""
        raise MixprecError(f"out must be a contiguous {dtype} tensor of shape {tuple(x2.shape)}{also}")
    return packed


def _auto(x2: torch.Tensor, fmt: Format, g: Granularity, stats: bool) -> str:
    if torch.compiler.is_compiling():
        return "eager" if g.scale_format == "e4m3" else "traceable"
    if c_quantize.takes(x2, fmt, g, None):  # compiled C: see the module docstring
        return "tiled"
    if g.scale_format == "e4m3":  # NVFP4: eager's whole-tensor temporaries cost more than tiles
        cpu = x2.device.type == "cpu"
        return "tiled" if cpu and (stats or x2.numel() >= tiled.NVFP4_TILED_MIN_ELEMENTS) else "eager"
    if x2.is_cuda and triton_usable(x2.device) and _triton_unavailable(x2, fmt, g) is None:
        return "triton"
    if x2.device.type == "cpu" and (stats or x2.numel() >= tiled.TILED_MIN_ELEMENTS):
        return "tiled"
    return "eager"


def _unavailable(backend: str, x2: torch.Tensor, fmt: Format, g: Granularity) -> str | None:
    if g.scale_format == "e4m3" and backend not in ("eager", "auto", "tiled"):
        return (
            "E4M3 block scales with a global scale (NVFP4) are quantized by the eager and tiled backends only"
        )
    if backend == "compiled":
        return compiled.unsupported_reason(x2, g)
    if backend == "tiled":
        return tiled.unsupported_reason(x2)
    if backend == "triton":
        return _triton_unavailable(x2, fmt, g)
    return None  # eager and traceable run anywhere; auto picks one that does


def _triton_unavailable(x2: torch.Tensor, fmt: Format, g: Granularity) -> str | None:
    if triton_version() is None:
        return "triton is not installed"
    if not x2.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return "the Triton kernels run on CUDA tensors (on CPU tensors only in TRITON_INTERPRET=1 mode)"
    if g.mx_rounding == "even":
        return "the Triton kernels compute E8M0 scales by the floor and rceil rules, not even"
    from mixprec.kernels.triton_quant import unsupported_reason  # imports triton: only where installed

    return unsupported_reason(x2, fmt, g)


def _given_scale(scale, x2: torch.Tensor, g: Granularity, validate: bool) -> torch.Tensor:
    """A given scale as fp32 on the grid, on x2's device (validated: scaling.check_scale)."""
    grid = g.scale_shape(*x2.shape)
    if validate and not torch.compiler.is_compiling():  # the check reads the values: a graph break
        scale = check_scale(scale, grid, g)
    elif isinstance(scale, torch.Tensor):
        scale = scale.float().reshape(grid)
    else:
        scale = torch.full(grid, float(scale))
    return scale.to(x2.device)


def _eager(x2, fmt, g, scale, margin, power_of_two, key=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference backend. bf16 / fp16 / fp64 inputs get one fp32 working copy (exact for bf16 and
    fp16; fp64 rounds once), reduced, divided and cast in place; fp32 inputs are divided into a new
    tensor, cast in place. On the CPU, torch's mixed-dtype kernel (bf16 tensor / fp32 scale -> fp32)
    is scalar code, ~20x slower than the conversion plus an fp32 division, and its bf16 min/max over
    blocks of 32 or 128 is ~6x slower than over fp32 (both measured at [2048, 1024]); the amax of the
    exact copy is the same."""
    own = x2.dtype != torch.float32
    work = x2.float() if own else x2
    if scale is None:
        scale = scale_from_amax(block_amax(work, g), fmt, g, margin, power_of_two)
    scaled = apply_blockwise(work, scale, g, torch.div, out=work if own else None)
    return _encode(_round_stochastically(scaled, fmt, key), fmt), scale


def _eager_global(
    x2, fmt, g, scale, gscale, validate, key=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4: E4M3 block scales in the units of an fp32 global scale (computed from x's amax when not
    given); the payload is x / (scale / global), the division compressed-tensors and vLLM make."""
    work = x2.float()
    amax = block_amax(work, g) if scale is None else None
    gscale = _global_scale(work, fmt, g, amax, gscale, validate, x2.dtype)
    if scale is None:
        scale = scale_from_amax(amax, fmt, g, global_scale=gscale, dtype=x2.dtype)
    effective = scale / gscale.reshape(1, 1)
    scaled = apply_blockwise(work, effective, g, torch.div, out=work if work is not x2 else None)
    return _encode(_round_stochastically(scaled, fmt, key), fmt), scale, gscale


def _encode(y: torch.Tensor, fmt: Format) -> torch.Tensor:
    """formats.encode_inplace of the scaled temporary y; sub-byte formats on the CPU (eager) through
    the integer encode of kernels.codes (the same codes, fewer passes), NaN refused first."""
    if fmt.bits >= 8 or y.device.type != "cpu" or not y.is_contiguous() or torch.compiler.is_compiling():
        return encode_inplace(y, fmt)
    raise_if(torch.isnan(y.max()), f"cannot encode NaN in {fmt.name}: the format has no NaN code")
    scratch = tuple(torch.empty(y.numel(), dtype=torch.int32) for _ in range(3))
    return encode_codes_into(y, fmt, torch.empty(y.shape, dtype=torch.uint8), scratch)


def _global_scale(x2, fmt, g, amax, gscale, validate, dtype=None) -> torch.Tensor:
    """NVFP4's global scale as a one-element fp32 tensor: the given one (validated), or computed from
    the tensor's amax over its finite elements (the block amaxes' max when given) with compressed-
    tensors' arithmetic in the input's dtype (`dtype`, default x2's) where g.scale_math is "input"."""
    if gscale is None:
        tensor_amax = amax.max() if amax is not None else block_amax(x2, Granularity.tensor())
        math_dtype = (dtype or x2.dtype) if g.scale_math == "input" else None
        return global_scale_from_amax(tensor_amax, fmt, math_dtype)
    gscale = torch.as_tensor(gscale, dtype=torch.float32).float().reshape(1).to(x2.device)
    if validate:
        bad = (~torch.isfinite(gscale) | (gscale <= 0)).any()
        if torch.compiler.is_compiling():  # the value is not known while tracing: assert in the graph
            raise_if(bad, "a global scale must be finite and positive")
        elif bool(bad):
            raise MixprecError(f"a global scale must be finite and positive, got {float(gscale[0])}")
    return gscale


def _round_stochastically(scaled: torch.Tensor, fmt: Format, key: int | None) -> torch.Tensor:
    """The scaled values rounded stochastically onto fmt's grid when a key is given (they are then
    grid values, which the round-to-nearest-even encode keeps as they are); unchanged otherwise."""
    if key is None:
        return scaled
    return stochastic_round_to_grid(
        scaled, key, mantissa_bits=fmt.mantissa_bits, emin=fmt.emin, max_value=fmt.max
    )


def _stats_fp32(x2: torch.Tensor, q: QuantizedTensor) -> QuantizationStats:
    """_stats_of with the difference formed in fp32 (exact for bf16/fp16 inputs up to one rounding of
    the difference) and the norms accumulated in fp64: no fp64 copy of the tensor (a third of the time
    of quantizing a weight to NVFP4 on the CPU, against two thirds for _stats_of)."""
    x = x2.float()
    amax = float(torch.maximum(-x.amin(), x.amax()))
    ref = float(torch.linalg.vector_norm(x, dtype=torch.float64))
    err = float(torch.linalg.vector_norm(q.dequantize().reshape(x.shape).sub_(x), dtype=torch.float64))
    if not (math.isfinite(ref) and math.isfinite(err)):
        return QuantizationStats(amax, math.nan)
    return QuantizationStats(amax, err / ref if ref > 0 else 0.0)


def _stats_of(x2: torch.Tensor, q: QuantizedTensor) -> QuantizationStats:
    """Statistics computed after the fact (backends other than "tiled"), whole-tensor."""
    x = x2.double()
    amax = float(x.abs().max())
    ref = float(torch.linalg.vector_norm(x))
    err = float(torch.linalg.vector_norm(q.dequantize().reshape(x.shape).double() - x))
    if not (math.isfinite(ref) and math.isfinite(err)):
        return QuantizationStats(amax, math.nan)
    return QuantizationStats(amax, err / ref if ref > 0 else 0.0)


__all__ = [
    "BACKENDS",
    "QuantizationStats",
    "backend_available",
    "choose_backend",
    "dequantize",
    "fake_quantize",
    "quantize",
    "quantize_transposed",
    "quantize_with_stats",
    "round_scaled",
]
