"""THE FP8 GEMM seam: out = dequant(a) @ dequant(b).T with fp32 accumulation, native or emulated.

    out = scaled_mm(q_a, q_b, out_dtype=torch.bfloat16)     # q_a: [M, K], q_b: [N, K] QuantizedTensors

Operands are quantized with scales constant along K inside a kernel's K-block: per tensor, per row
(1, None), tiles (1, 128), blocks (128, 128), MX (1, 32). Scales that vary along K element by element
(per column, (None, 1) or (128, 1) on the [rows, K] view) are refused: no kernel runs them, so the
emulation never uses them either. Training's backward GEMMs take transposed operands re-quantized
along their new K (see mixprec.recipes).

Backends
- "emulated": decode the payloads (exact), then an fp32 matmul. When neither operand's scale varies
  along K, the payload product is formed first and the scales multiply the fp32 result, as a hardware
  kernel does; otherwise the scales are applied blockwise before the matmul. Same inputs, same
  payloads; only the fp32 accumulation order differs from a native kernel.
- "native": torch._scaled_mm (tensorwise, rowwise); 1x128 x 128x128 / 1x128 blocks on CUDA through
  mixprec.kernels.native (F.scaled_mm / torch._scaled_mm with the scale layout a probe found right on
  this device, else the Triton kernel; emulated when neither). MX: not wired up (emulated).
- "auto": native on CUDA where mixprec.kernels.hardware.detect() and the blockwise probe say the device runs
  them, else emulated. On CPU torch._scaled_mm works but is slower than the emulation (measured
  here: tensorwise with fp32 output is a reference loop, ~30x slower at 256³, ~250x at 512³;
  rowwise with bf16 output ~1.7x slower at 2048x1024x1024), so "auto" emulates on CPU; "native"
  still runs it (tests compare the two).

`quantize_operand` is scaling.quantize for torch's FP8 dtypes with fewer passes over memory (one amax
reduction, one division, one saturating cast); payloads and scales are bit-identical (tested). Under
torch.compile it runs mixprec.kernels.traceable (no graph breaks), on CUDA with triton the fused
Triton kernels (mixprec.kernels.native.quantize_fast); on the CPU its own eager code, which is faster
there than scaling.quantize (no fp32 copy of bf16 inputs, no scale validation).

Under torch.compile the emulation has no graph breaks either: the per-tensor alpha and the blockwise
dequantization are tensor ops there (same math; eager keeps the faster BLAS alpha / in-place forms).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.errors import MixprecError
from mixprec.formats import Format, decode, decode_unscaled, get_format
from mixprec.scaling import (
    Granularity,
    QuantizedTensor,
    apply_blockwise,
    as_2d,
    block_amax,
    compute_mx_scale,
    compute_scale,
    encode_cast,
    quantize,
)

BACKENDS = ("auto", "emulated", "native")
_MIN_K_BLOCK = 16  # smaller K-blocks than any kernel's (MX: 32, DeepSeek tiles: 128) count as columnwise


# ---------------------------------------------------------------------------------------------------
# Operand quantization (hot path)


def scale_for(amax: torch.Tensor, fmt: Format, g: Granularity, margin: int = 0, power_of_two: bool = False):
    """Scales from per-block amax, by the foundation's rules (E8M0 MX rule or amax / (max * 2^margin))."""
    if g.scale_format == "e8m0":
        return compute_mx_scale(amax, fmt, g.mx_rounding)
    return compute_scale(amax, fmt, margin, power_of_two)


def quantize_operand(
    x: torch.Tensor,
    fmt: str | Format,
    granularity: Granularity | None = None,
    *,
    scale: torch.Tensor | None = None,
    margin: int = 0,
    power_of_two: bool = False,
) -> QuantizedTensor:
    """scaling.quantize with fewer memory passes, for torch FP8 dtypes (other formats: delegated).

    bf16/fp16 inputs get one fp32 working copy (exact), reduced, divided and clamped in place. A given
    `scale` must already be on the grid (callers on the hot path computed it), it is not validated. The payload is scaling.encode_cast(x / scale): the foundation's saturating cast.
    """
    fmt = get_format(fmt)
    g = granularity or Granularity.tensor()
    if fmt.torch_dtype is None or fmt.bits != 8 or x.dtype == torch.float64:
        return quantize(x, fmt, g, scale=scale, margin=margin, power_of_two=power_of_two)
    from mixprec.kernels import native  # lazy: triton (if any) loads only on CUDA

    if native.fused_quantize_applies(x, fmt, g):  # under torch.compile, or CUDA with triton
        return native.quantize_fast(
            x, fmt, g, scale=scale, margin=margin, power_of_two=power_of_two, validate=False
        )
    x2 = as_2d(x)
    # bf16 / fp16: converted to fp32 first (exact), then reduced and divided in place. On the CPU,
    # torch's mixed-dtype kernel (bf16 tensor / fp32 scale -> fp32) is scalar code, ~20x slower than
    # the conversion plus an fp32 division, and its bf16 min/max over blocks of 32 or 128 is ~6x
    # slower than over fp32 (both measured at [2048, 1024]); the amax of the exact copy is the same.
    own = x2.dtype != torch.float32
    work = x2.float() if own else x2
    if scale is None:
        scale = scale_for(block_amax(work, g), fmt, g, margin, power_of_two)
    else:
        scale = scale.reshape(g.scale_shape(*x2.shape)).float()
    if own:
        scaled = apply_blockwise(work, scale, g, torch.div, out=work)
    else:
        scaled = apply_blockwise(x2, scale, g, torch.div)
    return QuantizedTensor(encode_cast(scaled, fmt, clamp_in_place=True), scale, fmt, g, x.shape)


def transpose_quantized(q: QuantizedTensor) -> QuantizedTensor:
    """The transposed 2-D operand from the same payload and scales, when the blocking is symmetric
    under transposition (per tensor, square blocks): no re-quantization needed, bit-identical to it."""
    g = q.granularity
    if g.block_rows != g.block_cols or g.scale_format != "fp32":
        raise MixprecError(f"{g.name} scales change under transposition: re-quantize along the new K instead")
    rows, cols = q.data.shape
    shape = torch.Size((cols, rows))
    values = getattr(q, "values", None)
    if values is not None:
        return DecodedTensor(q.data.t(), _dense(q.scale.t()), q.fmt, g, shape, values.t())
    return QuantizedTensor(q.data.t(), _dense(q.scale.t()), q.fmt, g, shape)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A row-major copy with canonical strides (contiguous() keeps odd strides of size-1 dims)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def quantize_transposed(
    x2: torch.Tensor,
    fmt: str | Format,
    granularity: Granularity,
    *,
    scale: torch.Tensor | None = None,
    margin: int = 0,
    power_of_two: bool = False,
) -> QuantizedTensor:
    """The operand x2ᵀ quantized with `granularity` on the transposed [cols, rows] view.

    Computed on x2's own layout with the transposed blocking (no copy of the wide input), then the
    scales are transposed: bit-identical to quantize_operand(x2.t(), ...). The payload is a transposed
    view (the emulation reads it as is; the native path makes it contiguous).
    """
    q = quantize_operand(
        x2, fmt, granularity.transposed(), scale=scale, margin=margin, power_of_two=power_of_two
    )
    return as_transposed(q, granularity)


def as_transposed(q: QuantizedTensor, granularity: Granularity) -> QuantizedTensor:
    """The operand q.dataᵀ with `granularity` on the transposed view, from q quantized with
    granularity.transposed() on its own layout (a payload view; the scales transposed)."""
    rows, cols = q.data.shape
    return QuantizedTensor(q.data.t(), _dense(q.scale.t()), q.fmt, granularity, torch.Size((cols, rows)))


# ---------------------------------------------------------------------------------------------------
# Layout checks


def k_block(g: Granularity, k: int) -> int:
    """How many consecutive K elements share one scale (k for scales constant along all of K)."""
    return k if g.block_cols is None else min(g.block_cols, k)


def check_operand(q: QuantizedTensor, what: str) -> None:
    if not isinstance(q, QuantizedTensor):
        raise MixprecError(f"scaled_mm: {what} must be a QuantizedTensor, got {type(q).__name__}")
    if q.data.dim() != 2:
        raise MixprecError(
            f"scaled_mm: {what} payload must be 2-D [rows, K], got shape {tuple(q.data.shape)}"
        )
    k = q.data.shape[1]
    if k_block(q.granularity, k) < min(_MIN_K_BLOCK, k):
        raise MixprecError(
            f"scaled_mm: {what} has {q.granularity.name} scales, which vary along K (the reduction dimension) "
            "element by element; no FP8 kernel accepts that: quantize the transposed operand along its rows "
            "(e.g. Granularity.rows() or 1x128 tiles of the [rows, K] view) instead"
        )


# ---------------------------------------------------------------------------------------------------
# Emulation


def _row_scales(q: QuantizedTensor, rows: int) -> torch.Tensor:
    """Scales along rows only (K-constant operands), expanded to [rows, 1] or kept [1, 1]."""
    s = q.scale
    br = q.granularity.block_rows
    if s.shape[0] == 1:
        return s[:, :1]
    if br in (None, 1):
        return s
    return s.repeat_interleave(br, dim=0)[:rows]


def dequantize_blockwise(q: QuantizedTensor) -> torch.Tensor:
    """fp32 [rows, K] values: decoded payload times its block's scale (in place when blocks tile exactly)."""
    rows, cols = q.data.shape
    br, bc = q.granularity.block_shape(rows, cols)
    if torch.compiler.is_compiling():  # out of place, no data_ptr() (a graph break); same products
        return decode(q.data, q.fmt) * _expand_scale(q.scale, br, bc, rows, cols)
    # the CPU's E4M3 decode gives values * 2^-8 (formats.decode_unscaled): the 2^8 joins the scales,
    # exactly (a power of two), so each product is the same real number as decoded value * scale
    values, factor = decode_unscaled(q.data, q.fmt)
    scale = _folded_scale(q.scale, factor)
    if scale is None:  # scales near fp32's maximum: the exact values instead
        values, scale = values.mul_(factor), q.scale
    if values.data_ptr() == q.data.data_ptr():
        values = values.clone()
    if rows % br == 0 and cols % bc == 0:
        if values.is_contiguous():
            values.view(rows // br, br, cols // bc, bc).mul_(scale[:, None, :, None])
            return values
        if values.t().is_contiguous():  # a transposed payload view: scale its storage in order
            values.t().view(cols // bc, bc, rows // br, br).mul_(scale.t()[:, None, :, None])
            return values
    return apply_blockwise(values, scale, q.granularity, torch.mul)


def _folded_scale(scale: torch.Tensor, factor: float) -> torch.Tensor | None:
    """scale * factor (a power of two from formats.decode_unscaled: exact), None if that overflows."""
    if factor == 1.0:
        return scale
    folded = scale * factor
    return folded if bool(torch.isfinite(folded).all()) else None


def _expand_scale(scale: torch.Tensor, br: int, bc: int, rows: int, cols: int) -> torch.Tensor:
    """The scale grid repeated to one scale per element (broadcastable to [rows, cols])."""
    if scale.shape[0] > 1 and br > 1:
        scale = scale.repeat_interleave(br, dim=0)[:rows]
    if scale.shape[1] > 1 and bc > 1:
        scale = scale.repeat_interleave(bc, dim=1)[:, :cols]
    return scale


@dataclass(frozen=True)
class DecodedTensor(QuantizedTensor):
    """A QuantizedTensor that carries its decoded payload (fp32, unscaled), so that an operand used by
    two emulated GEMMs (dY in both backward GEMMs of a per-tensor recipe) is decoded once."""

    values: torch.Tensor | None = None


def with_decoded(q: QuantizedTensor) -> DecodedTensor:
    return DecodedTensor(q.data, q.scale, q.fmt, q.granularity, q.shape, decode(q.data, q.fmt))


def _values_unscaled(q: QuantizedTensor) -> tuple[torch.Tensor, float]:
    """(values, factor): the decoded payload is values * factor (a power of two), see decode_unscaled."""
    v = getattr(q, "values", None)
    return (v, 1.0) if v is not None else decode_unscaled(q.data, q.fmt)


def _with_exact_values(q: QuantizedTensor) -> DecodedTensor:
    return q if getattr(q, "values", None) is not None else with_decoded(q)


def _emulated(
    a: QuantizedTensor, b: QuantizedTensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """fp32 GEMM of the decoded operands; scales, bias and the output cast in as few passes as possible."""
    k = a.data.shape[1]
    k_uniform = k_block(a.granularity, k) == k and k_block(b.granularity, k) == k
    if not k_uniform:
        out = dequantize_blockwise(a) @ dequantize_blockwise(b).t()
        if bias is not None:
            out.add_(bias.float())
        return out if out_dtype == torch.float32 else out.to(out_dtype)
    # payload products accumulated in fp32, then the scales: what a tensorwise/rowwise kernel does
    (va, fa), (vb, fb) = _values_unscaled(a), _values_unscaled(b)
    vb = vb.t()
    sa, sb = _row_scales(a, a.data.shape[0]), _row_scales(b, b.data.shape[0]).t()
    # decoded values times 2^-8 (formats.decode_unscaled): exact, the sums scale with them (they stay
    # far above fp32's subnormals), so the power of two moves into a's scale, which multiplies the sums
    # first: every product below is the same real number as without it, bit-identically
    sa = _folded_scale(sa, fa * fb)
    if sa is None:  # only scales near fp32's maximum: decode exactly
        return _emulated(_with_exact_values(a), _with_exact_values(b), bias, out_dtype)
    if sa.numel() == 1 and sb.numel() == 1 and torch.compiler.is_compiling():
        # float(scale) would be a graph break: multiply by the scale tensor (same math; the fused
        # BLAS alpha/beta of eager may round the bias addition once less)
        out = torch.mm(va, vb) * (sa * sb)
        if bias is not None:
            out = out + bias.float()
        return out if out_dtype == torch.float32 else out.to(out_dtype)
    if sa.numel() == 1 and sb.numel() == 1:  # per tensor: BLAS alpha scales the sums; bias is the beta term
        alpha = float(sa * sb)
        base = bias.float() if bias is not None else torch.zeros((), device=va.device)
        out = torch.addmm(base, va, vb, beta=1 if bias is not None else 0, alpha=alpha)
        return out if out_dtype == torch.float32 else out.to(out_dtype)
    out = torch.mm(va, vb)
    if sa.numel() == 1 or sb.numel() == 1:
        last = sa * sb  # one broadcast vector: [M, 1] or [1, N]
    else:
        out.mul_(sa)
        last = sb
    # the last scale and the bias in fp32, in place, then one rounding to out_dtype. (One fused
    # torch.mul(..., out=<bf16 tensor>) would save a pass, but mixed-dtype kernels are scalar code on
    # the CPU: ~5x slower than these two vectorized passes.)
    if bias is None:
        out.mul_(last)
    else:
        torch.addcmul(bias.float(), out, last, out=out)
    return out if out_dtype == torch.float32 else out.to(out_dtype)


# ---------------------------------------------------------------------------------------------------
# Native


_CAPABILITIES: list = []  # detect()'s result once known: a plain read traces as a constant under torch.compile


def _capabilities():
    """hardware.detect(), memoized here too: dynamo traces through functools.cache into the probes
    (os.stat, subprocesses), a graph break; a list lookup it reads as a constant. Warm up eagerly."""
    if not _CAPABILITIES:
        from mixprec.kernels.hardware import detect

        _CAPABILITIES.append(detect())
    return _CAPABILITIES[0]


def native_kind(a: QuantizedTensor, b: QuantizedTensor) -> str | None:
    """Which native kernel family takes this pair of operands on their device, or None."""
    ga, gb = a.granularity, b.granularity
    if ga.scale_format != "fp32" or gb.scale_format != "fp32":
        return "mx" if ga == gb and ga.block_cols == 32 and ga.block_rows == 1 else None
    if (ga.block_rows, ga.block_cols, gb.block_rows, gb.block_cols) == (None, None, None, None):
        return "tensorwise"
    if (ga.block_rows, ga.block_cols, gb.block_rows, gb.block_cols) == (1, None, 1, None):
        return "rowwise"
    if (ga.block_rows, ga.block_cols) == (1, 128) and (gb.block_rows, gb.block_cols) in (
        (128, 128),
        (1, 128),
    ):
        return "blockwise"
    return None


def native_available(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype = torch.bfloat16
) -> tuple[bool, str]:
    """(available, why not) for the native path of this operand pair on its device.

    CUDA conditions are the conservative ones torch documents: K and N multiples of 16; rowwise,
    blockwise and MX scaling with E4M3 operands and a bf16 output; blockwise with 128-multiples."""
    kind = native_kind(a, b)
    if kind is None:
        return False, f"no native kernel takes {a.granularity.name} x {b.granularity.name} scales"
    if a.fmt.torch_dtype is None or b.fmt.torch_dtype is None:
        return False, f"{a.fmt.name}/{b.fmt.name} payloads are not torch FP8 dtypes"
    if a.fmt.name == "e5m2" and b.fmt.name == "e5m2":
        return False, "no kernel multiplies two E5M2 operands"
    caps = _capabilities()
    if a.data.device.type == "cuda":
        if not caps.fp8_native:
            return False, "this GPU has no FP8 tensor cores (or torch._scaled_mm fails on it)"
        if kind == "mx":  # F.scaled_mm wants swizzled E8M0 scales on SM 10.0+: not wired up yet
            return False, "native MXFP8 GEMMs are not wired up yet (SM 10.0+, swizzled E8M0 scales)"
        k = a.data.shape[1]
        n = b.data.shape[0]
        if k % 16 or n % 16:
            return False, f"FP8 kernels need K and N multiples of 16 (K={k}, N={n})"
        if kind == "rowwise":
            if out_dtype != torch.bfloat16:
                return False, f"{kind} FP8 kernels write bf16 outputs, not {out_dtype}"
            if a.fmt.name != "e4m3" or b.fmt.name != "e4m3":
                return False, f"{kind} FP8 kernels take E4M3 operands"
        if kind == "blockwise":  # the probed torch kernel or the Triton one (mixprec.kernels.native)
            from mixprec.kernels import native

            backend, why = native.blockwise_plan(a, b, out_dtype)
            return backend is not None, why
        return True, ""
    if a.data.device.type == "cpu":
        if kind not in ("tensorwise", "rowwise"):
            return False, f"torch runs {kind} scaled_mm on CUDA only"
        if not caps.scaled_mm_cpu:
            return False, "torch._scaled_mm does not run on this CPU build"
        return True, ""
    return False, f"no native FP8 GEMM on device {a.data.device.type}"


def _native(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> torch.Tensor:
    kind = native_kind(a, b)
    a = QuantizedTensor(a.data.contiguous(), a.scale, a.fmt, a.granularity, a.shape)
    bt = b.data.contiguous().t()  # [K, N] column-major, the layout the kernels want for the second operand
    if kind == "tensorwise":
        return torch._scaled_mm(
            a.data, bt, scale_a=a.scale.reshape(()), scale_b=b.scale.reshape(()), bias=_bias(bias, out_dtype),
            out_dtype=out_dtype,
        )  # fmt: skip
    if kind == "rowwise":
        return torch._scaled_mm(
            a.data, bt, scale_a=a.scale.flatten().unsqueeze(1), scale_b=b.scale.flatten().unsqueeze(0),
            bias=_bias(bias, out_dtype),
            out_dtype=out_dtype,
        )  # fmt: skip
    if kind == "blockwise":
        # mixprec.kernels.native: the torch kernel with the scale layout its probe found (torch wants
        # [K/128, N/128]-shaped, column-major, padded scales, not our [N/128, K/128] grid), or Triton
        from mixprec.kernels import native

        b = QuantizedTensor(b.data.contiguous(), b.scale, b.fmt, b.granularity, b.shape)
        out = native.native_gemm(a, b, out_dtype=out_dtype, bias=bias)
        if out is None:
            raise MixprecError(
                f"scaled_mm: no native blockwise kernel: {native.blockwise_plan(a, b, out_dtype)[1]}"
            )
        return out
    # MX: native_available refuses it (swizzled E8M0 scales on SM 10.0+ are not wired up yet)
    raise MixprecError(f"scaled_mm: no native kernel wired up for {kind} scaling")


def _bias(bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor | None:
    return None if bias is None else bias.to(out_dtype)


# ---------------------------------------------------------------------------------------------------
# The seam


def will_emulate(
    a: QuantizedTensor, b: QuantizedTensor, backend: str = "auto", out_dtype: torch.dtype = torch.float32
) -> bool:
    """Whether scaled_mm(a, b, backend=backend, out_dtype=out_dtype) takes the emulated path."""
    if backend == "emulated":
        return True
    if backend == "native":
        return False
    if a.data.device.type != "cuda" or native_kind(a, b) not in ("tensorwise", "rowwise", "blockwise"):
        return True
    return not native_available(a, b, out_dtype)[0]


def scaled_mm(
    a: QuantizedTensor,
    b: QuantizedTensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """dequant(a) @ dequant(b).T (+ bias) with fp32 accumulation, returned in out_dtype.

    a: [M, K] (any leading dims: the result keeps them, [..., N]); b: [N, K] (nn.Linear weight layout).
    backend: "auto" | "emulated" | "native" (MixprecError when no native kernel takes these operands).
    """
    if backend not in BACKENDS:
        raise MixprecError(f"unknown scaled_mm backend {backend!r}; valid: {', '.join(BACKENDS)}")
    check_operand(a, "a")
    check_operand(b, "b")
    if a.data.shape[1] != b.data.shape[1]:
        raise MixprecError(
            f"scaled_mm: K differs: a is {tuple(a.data.shape)} and b is {tuple(b.data.shape)} (computes a @ b.T)"
        )
    if backend == "native":
        ok, why = native_available(a, b, out_dtype)
        if not ok:
            raise MixprecError(f"scaled_mm: native backend unavailable: {why}")
    if not will_emulate(a, b, backend, out_dtype):
        out = _native(a, b, out_dtype, bias)
    else:
        out = _emulated(a, b, bias, out_dtype)
    lead = a.shape[:-1] if len(a.shape) >= 1 else ()
    return out.reshape(*lead, b.data.shape[0]) if len(a.shape) != 2 else out


__all__ = [
    "BACKENDS",
    "DecodedTensor",
    "as_transposed",
    "check_operand",
    "dequantize_blockwise",
    "k_block",
    "native_available",
    "native_kind",
    "quantize_operand",
    "quantize_transposed",
    "scale_for",
    "scaled_mm",
    "transpose_quantized",
    "will_emulate",
    "with_decoded",
]
