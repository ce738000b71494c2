"""THE FP8 GEMM seam: out = dequant(a) @ dequant(b).T with fp32 accumulation, native or emulated.

    out = scaled_mm(q_a, q_b, out_dtype=torch.bfloat16)     # q_a: [M, K], q_b: [N, K] QuantizedTensors

Operands are quantized with scales constant along K inside a kernel's K-block: per tensor, per row
(1, None), tiles (1, 128), blocks (128, 128), MX (1, 32), NVFP4 (1, 16) and (16, 16) with E4M3 block
scales times a per-tensor global scale (the multiplier is QuantizedTensor.effective_scale(): block
scale / global scale in fp32, as compressed-tensors and vLLM dequantize). Scales that vary along K element by element
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
  FP4 (E2M1 payloads, NVFP4 and MXFP4 scales): emulated everywhere. kernels.hardware reports FP4
  tensor cores (SM 10.0+, fp4_native); native FP4 GEMMs (swizzled scale layouts) are not wired up
  yet, and native_available says so.

Operands come from mixprec.quantization (the one quantizer); this module holds no quantizer. It only
re-views payloads: `transpose_quantized` reuses a symmetric blocking's payload and scales for the
transposed operand.

Under torch.compile the emulation has no graph breaks either: the per-tensor alpha and the blockwise
dequantization are tensor ops there (same math; eager keeps the faster BLAS alpha / in-place forms).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mixprec.errors import MixprecError
from mixprec.formats import decode, decode_unscaled
from mixprec.kernels import emulation, native
from mixprec.kernels.hardware import detect
from mixprec.scaling import Granularity, QuantizedTensor, apply_blockwise, as_transposed, expand_scale

BACKENDS = ("auto", "emulated", "native")
# FP8 tensor-core GEMMs (torch._scaled_mm / cuBLASLt) take K and N multiples of 16 only: the one home
# of that rule. mixprec.select builds on it to leave such Linears in high precision.
FP8_DIM_MULTIPLE = 16
_MIN_K_BLOCK = 16  # smaller K-blocks than any kernel's (MX: 32, DeepSeek tiles: 128) count as columnwise


# ---------------------------------------------------------------------------------------------------
# Transposed operands


def transpose_quantized(q: QuantizedTensor) -> QuantizedTensor:
    """The transposed 2-D operand from the same payload and scales, when the blocking is symmetric
    under transposition (per tensor, square blocks): no re-quantization needed, bit-identical to it."""
    g = q.granularity
    if not transposable(g):
        raise MixprecError(f"{g.name} scales change under transposition: re-quantize along the new K instead")
    t = as_transposed(q, g)
    values = getattr(q, "values", None)
    if values is not None:
        return DecodedTensor(t.data, t.scale, t.fmt, g, t.shape, t.global_scale, values=values.t())
    return t


def transposable(g: Granularity) -> bool:
    """Whether the transposed operand reuses the payload and scales (per tensor, square blocks with
    fp32 or NVFP4 E4M3 scales; a square block's one scale and the global scale do not change)."""
    return g.block_rows == g.block_cols and g.scale_format in ("fp32", "e4m3")


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


def dequantize_blockwise(q: QuantizedTensor) -> torch.Tensor:
    """fp32 [rows, K] values: decoded payload times its block's scale (in place when blocks tile exactly)."""
    rows, cols = q.data.shape
    if torch.compiler.is_compiling():  # out of place, no data_ptr() (a graph break); same products
        return decode(q.data, q.fmt) * expand_scale(q.effective_scale(), q.granularity, rows, cols)
    # the CPU's E4M3 decode gives values * 2^-8 (formats.decode_unscaled): the 2^8 joins the scales,
    # exactly (a power of two), so each product is the same real number as decoded value * scale
    values, factor = decode_unscaled(q.data, q.fmt)
    multiplier = q.effective_scale()
    scale = _folded_scale(multiplier, factor)
    if scale is None:  # scales near fp32's maximum: the exact values instead
        values, scale = values.mul_(factor), multiplier
    if values.data_ptr() == q.data.data_ptr():
        values = values.clone()
    return _times_block_scales(values, scale, q.granularity)


def _times_block_scales(values: torch.Tensor, scale: torch.Tensor, g: Granularity) -> torch.Tensor:
    """values (fp32 [rows, K], owned by the caller) times each block's scale: in place, in storage
    order, where the blocks tile it exactly (a transposed payload view's decode is strided, and a
    multiply that reads it across its storage is ~10x slower); else a new tensor."""
    rows, cols = values.shape
    br, bc = g.block_shape(rows, cols)
    if rows % br == 0 and cols % bc == 0:
        if values.is_contiguous():
            values.view(rows // br, br, cols // bc, bc).mul_(scale[:, None, :, None])
            return values
        if values.t().is_contiguous():  # a transposed payload view: scale its storage in order
            values.t().view(cols // bc, bc, rows // br, br).mul_(scale.t()[:, None, :, None])
            return values
    return apply_blockwise(values, scale, g, torch.mul)


def _folded_scale(scale: torch.Tensor, factor: float) -> torch.Tensor | None:
    """scale * factor (a power of two from formats.decode_unscaled: exact), None if that overflows."""
    if factor == 1.0:
        return scale
    folded = scale * factor
    return folded if bool(torch.isfinite(folded).all()) else None


@dataclass(frozen=True)
class DecodedTensor(QuantizedTensor):
    """A QuantizedTensor that carries its decoded payload (fp32, unscaled), so that an operand used by
    two emulated GEMMs (dY in both backward GEMMs of a per-tensor recipe) is decoded once."""

    values: torch.Tensor | None = None


def with_decoded(q: QuantizedTensor) -> DecodedTensor:
    return DecodedTensor(
        q.data, q.scale, q.fmt, q.granularity, q.shape, q.global_scale, values=decode(q.data, q.fmt)
    )


def _values_unscaled(q: QuantizedTensor) -> tuple[torch.Tensor, float]:
    """(values, factor): the decoded payload is values * factor (a power of two), see decode_unscaled."""
    v = getattr(q, "values", None)
    return (v, 1.0) if v is not None else decode_unscaled(q.data, q.fmt)


def _with_exact_values(q: QuantizedTensor) -> DecodedTensor:
    return q if getattr(q, "values", None) is not None else with_decoded(q)


def _emulated(
    a: QuantizedTensor, b: QuantizedTensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """fp32-accumulated GEMM of the decoded operands; scales, bias and the output cast in as few passes
    as possible, on the arithmetic mixprec.kernels.emulation picks (fp32, or the CPU's bf16 units)."""
    k = a.data.shape[1]
    arith = emulation.backend_for(a.data.device)
    if arith == "bf16" and not (_bf16_exact_format(a.fmt) and _bf16_exact_format(b.fmt)):
        arith = "fp32"
    if k_block(a.granularity, k) != k or k_block(b.granularity, k) != k:
        # without a bias a bf16 output may come straight from the bf16 GEMM (_blocked_bf16 says when)
        bf16_out = out_dtype == torch.bfloat16 and bias is None
        out = _blocked_bf16(a, b, bf16_out) if arith == "bf16" else None
        if out is None:
            out = dequantize_blockwise(a) @ dequantize_blockwise(b).t()
        if bias is not None:
            out.add_(bias.float())
        return out if out.dtype == out_dtype else out.to(out_dtype)
    # payload products accumulated in fp32, then the scales: what a tensorwise/rowwise kernel does
    (va, fa), (vb, fb) = _values_unscaled(a), _values_unscaled(b)
    vb = vb.t()
    # K-constant scales: one column, expanded along the rows to [rows, 1] (or kept [1, 1])
    sa = expand_scale(a.effective_scale(), a.granularity, *a.data.shape)
    sb = expand_scale(b.effective_scale(), b.granularity, *b.data.shape).t()
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
    if sa.numel() == 1 and sb.numel() == 1 and arith == "fp32":
        # per tensor: BLAS alpha scales the sums; bias is the beta term. (oneDNN's bf16 GEMM would
        # apply alpha to an input, inexactly: the bf16 backend multiplies the fp32 sums below instead)
        alpha = float(sa * sb)
        base = bias.float() if bias is not None else torch.zeros((), device=va.device)
        out = torch.addmm(base, va, vb, beta=1 if bias is not None else 0, alpha=alpha)
        return out if out_dtype == torch.float32 else out.to(out_dtype)
    out = _matmul(arith, va, vb)
    if sa.numel() == 1 or sb.numel() == 1:
        last = sa * sb  # one broadcast vector: [M, 1] or [1, N]
    else:
        out.mul_(sa)
        last = sb
    # the last scale and the bias in fp32, in place, then one rounding to out_dtype. (One fused
    # torch.mul(..., out=<bf16 tensor>) would save a pass, but mixed-dtype kernels are scalar code on
    # the CPU: ~5x slower than these two vectorized passes.) The bias is added after the product is
    # rounded, never fused into it: eager addcmul rounds once (an FMA) where Inductor's mul + add
    # rounds twice, so a compiled model would differ in the last bit (as vLLM's CPU kernel: product, then bias)
    out.mul_(last)
    if bias is not None:
        out.add_(bias.float())
    return out if out_dtype == torch.float32 else out.to(out_dtype)


# ---------------------------------------------------------------------------------------------------
# Emulation on the CPU's bf16 units (mixprec.kernels.emulation says when)
#
# The bf16 GEMM takes fp32 tensors whose every value is exact in bf16 (_matmul's contract; tests check
# each operand): decoded payloads, alone or times an E8M0 / E4M3 block scale (a product of at most
# 2 + 4 significant bits: exact). Its products are exact in fp32 and summed in fp32, so K-uniform
# scales (per tensor, per row) give the fp32 path's result up to the order of the fp32 sums: where those
# sums are exact (E2M1 payloads; FP8 over short K) the result is bit-identical. K-blocked fp32 scales
# (1x128, 128x128) are not bf16 values: the GEMM is split per K-chunk and the scales multiply the fp32
# partials, as a blockwise kernel does (each partial is exact where the fp32 path rounds each scaled
# element instead: a bound, not bit-identity). NVFP4's global scales divide the result once. Where
# every scale sits inside the operands (MX) and the output is bf16 without a bias, the GEMM runs on bf16
# tensors with bf16 output: its fp32 sums rounded once, as the fp32 path rounds its sums once.

_BF16_TINY = 2.0**-63  # operand values at or above it keep every product above fp32/bf16 subnormals
_BF16_HUGE = 2.0**63  # and below it every product below fp32's overflow
_PARTIALS_BYTES = 256 << 20  # fp32 partial results held at once by the K-chunked GEMM


def _bf16_exact_format(fmt) -> bool:
    """Every value of the payload format is a normal bf16 value (FP8, FP6, FP4: not fp16 or bf16)."""
    return fmt.mantissa_bits <= 7 and fmt.exponent_bits < 8


def _matmul(
    arith: str, x: torch.Tensor, y: torch.Tensor, op=torch.mm, bf16_out: bool = False
) -> torch.Tensor:
    """op(x, y) on the chosen arithmetic: the one place the emulation's matmuls run (bf16-exact x, y).
    bf16_out: the fp32 sums rounded once to bf16 — on the bf16 units a GEMM of bf16 operands with bf16
    output (its own single rounding; no fp32 result is written), else op(x, y)
    rounded to bf16."""
    if bf16_out and emulation.on_bf16_units(arith):
        return op(x.to(torch.bfloat16), y.to(torch.bfloat16))
    with emulation.gemm_context(arith):
        out = op(x, y)
    return out.to(torch.bfloat16) if bf16_out else out


@dataclass(frozen=True)
class _Bf16Operand:
    """dequant(q)[:, K-block j] == values[:, K-block j] * row_scales[j] / divisor, with values exact in
    bf16: the block scales inside values (E8M0, E4M3), or fp32 scales per (K-block, row) outside."""

    values: torch.Tensor  # fp32 [rows, K], every value bf16-exact
    row_scales: torch.Tensor  # fp32 [K-blocks, rows] or [K-blocks, 1] or [1, 1]
    k_block: int  # K elements per row of row_scales (K when one row covers all of K)
    divisor: torch.Tensor | None  # NVFP4's global scale, divides the result once


def _bf16_operand(q: QuantizedTensor) -> _Bf16Operand | None:
    """q as bf16-exact values and outside scales; None when a scaled value would leave the range in
    which products stay normal fp32 numbers (the bf16 dot-product instructions flush subnormals)."""
    rows, k = q.data.shape
    g = q.granularity
    if g.scale_format == "fp32":
        values, factor = _values_unscaled(q)
        grid = q.scale.float() * factor  # [row blocks, K blocks] or [1, 1]; factor: a power of two
        if not bool(torch.isfinite(grid).all()):  # scales near fp32's maximum: the exact values instead
            values, grid = decode(q.data, q.fmt), q.scale.float()
        if grid.shape[0] > 1:
            grid = grid.repeat_interleave(g.block_shape(rows, k)[0], dim=0)[:rows]
        return _Bf16Operand(values, grid.t().contiguous(), k_block(g, k), None)
    scales = q.scale.float()
    # the smallest non-zero scale without boolean indexing (its nonzero() cost ~0.9 ms a 2048x1024x1024
    # NVFP4 GEMM); no non-zero scale: +inf and 0, which pass both checks
    smallest = torch.where(scales > 0, scales, math.inf).amin()
    if float(smallest) * q.fmt.min_subnormal < _BF16_TINY or float(scales.amax()) * q.fmt.max >= _BF16_HUGE:
        return None
    # E8M0 / E4M3 block scales times the decode's power of two (no overflow: checked above)
    unscaled, factor = decode_unscaled(q.data, q.fmt)
    if unscaled.data_ptr() == q.data.data_ptr():
        unscaled = unscaled.clone()
    values = _times_block_scales(unscaled, scales * factor if factor != 1.0 else scales, g)
    divisor = None if q.global_scale is None else q.global_scale.float().reshape(())
    return _Bf16Operand(values, torch.ones(1, 1, device=values.device), k, divisor)


def _blocked_bf16(a: QuantizedTensor, b: QuantizedTensor, bf16_out: bool = False) -> torch.Tensor | None:
    """fp32 [M, N] for operands with K-blocked scales, on the bf16 units; None where it cannot.
    bf16_out: the caller wants the result rounded to bf16; where no scale is left to multiply the sums
    (E8M0 block scales, NVFP4 without a global scale) it comes back in bf16 from the GEMM itself."""
    k = a.data.shape[1]
    if emulation.requested() != "bf16" and any(
        q.granularity.scale_format == "fp32" and k_block(q.granularity, k) != k for q in (a, b)
    ):
        # "auto": the K-chunked GEMM's partials cost more than the bf16 units save (1x128 x 128x128,
        # 2048x1024x1024: 328 ms against 172 ms for the fp32 backend, AVX-512-BF16 EPYC, loaded);
        # decided before any operand is built
        return None
    pa, pb = _bf16_operand(a), _bf16_operand(b)
    if pa is None or pb is None:
        return None
    # K-chunks: the K-blocks of the operands whose outside scales vary along K (both nest, or none)
    blocks = [op.k_block for op in (pa, pb) if op.row_scales.shape[0] > 1]
    chunk = math.gcd(*blocks) if blocks else k
    if chunk < min(_MIN_K_BLOCK, k):  # blockings sharing only short chunks (1x40 and 1x128: 8)
        return None
    if chunk == k and bf16_out and _scales_inside(pa) and _scales_inside(pb):
        return _matmul("bf16", pa.values, pb.values.t(), bf16_out=True)
    if chunk == k:
        out = _matmul("bf16", pa.values, pb.values.t())
        out.mul_(pa.row_scales[0][:, None]).mul_(pb.row_scales[0][None, :])
    else:
        out = _chunked_bf16(pa, pb, chunk)
    for divisor in (pa.divisor, pb.divisor):
        if divisor is not None:
            out.div_(divisor)
    return out


def _scales_inside(op: _Bf16Operand) -> bool:
    """Every scale of the operand is inside its bf16-exact values: nothing multiplies or divides the sums."""
    return op.divisor is None and op.row_scales.numel() == 1 and bool(op.row_scales.eq(1).all())


def _chunk_scales(op: _Bf16Operand, chunks: int, chunk: int) -> torch.Tensor:
    """[chunks, rows] row scales: chunk c lies inside K-block (c * chunk) // k_block (chunk divides it)."""
    index = torch.arange(chunks, device=op.values.device) * chunk // op.k_block
    return op.row_scales[index.clamp_max(op.row_scales.shape[0] - 1)]


def _chunked_bf16(pa: _Bf16Operand, pb: _Bf16Operand, chunk: int) -> torch.Tensor:
    """sum over K-chunks c of (a_c @ b_c.T) * a's row scales of c * b's row scales of c, in fp32: one
    batched bf16 GEMM per group of chunks whose partials fit _PARTIALS_BYTES."""
    (m, k), n = pa.values.shape, pb.values.shape[0]
    chunks = -(-k // chunk)
    va, vb = pa.values, pb.values
    if chunks * chunk != k:  # zero columns contribute nothing to any partial
        va = torch.nn.functional.pad(va, (0, chunks * chunk - k))
        vb = torch.nn.functional.pad(vb, (0, chunks * chunk - k))
    sa, sb = _chunk_scales(pa, chunks, chunk), _chunk_scales(pb, chunks, chunk)
    a3 = va.reshape(m, chunks, chunk).transpose(0, 1)  # [C, M, chunk]
    b3 = vb.reshape(n, chunks, chunk).permute(1, 2, 0)  # [C, chunk, N]
    out = torch.zeros(m, n, device=va.device)
    group = max(1, _PARTIALS_BYTES // max(1, m * n * 4))
    for start in range(0, chunks, group):
        part = slice(start, start + group)
        partials = _matmul("bf16", a3[part], b3[part], torch.bmm)
        partials.mul_(sa[part][:, :, None]).mul_(sb[part][:, None, :])
        out.add_(partials.sum(0))
    return out


# ---------------------------------------------------------------------------------------------------
# Native


_CAPABILITIES: list = []  # detect()'s result once known: a plain read traces as a constant under torch.compile


def _capabilities():
    """hardware.detect(), memoized here too: dynamo traces through functools.cache into the probes
    (os.stat, subprocesses), a graph break; a list lookup it reads as a constant. Warm up eagerly."""
    if not _CAPABILITIES:
        _CAPABILITIES.append(detect())
    return _CAPABILITIES[0]


def native_kind(a: QuantizedTensor, b: QuantizedTensor) -> str | None:
    """Which native kernel family takes this pair of operands on their device, or None."""
    ga, gb = a.granularity, b.granularity
    if a.fmt.bits == 4 or b.fmt.bits == 4:
        return "fp4" if a.fmt == b.fmt and ga.scale_format == gb.scale_format != "fp32" else None
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


def fp8_gemm_dims_ok(k: int, n: int, multiple: int = FP8_DIM_MULTIPLE) -> bool:
    """Whether FP8 GEMM kernels take a reduction dim K and output dim N (both multiples of `multiple`)."""
    return k % multiple == 0 and n % multiple == 0


def native_available(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype = torch.bfloat16
) -> tuple[bool, str]:
    """(available, why not) for the native path of this operand pair on its device.

    CUDA conditions are the conservative ones torch documents: K and N multiples of 16; rowwise,
    blockwise and MX scaling with E4M3 operands and a bf16 output; blockwise with 128-multiples."""
    kind = native_kind(a, b)
    if kind is None:
        return False, f"no native kernel takes {a.granularity.name} x {b.granularity.name} scales"
    if kind == "fp4":
        return False, fp4_native_reason(a.data.device)
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
        if not fp8_gemm_dims_ok(k, n):
            return False, f"FP8 kernels need K and N multiples of {FP8_DIM_MULTIPLE} (K={k}, N={n})"
        if kind == "rowwise":
            if out_dtype != torch.bfloat16:
                return False, f"{kind} FP8 kernels write bf16 outputs, not {out_dtype}"
            if a.fmt.name != "e4m3" or b.fmt.name != "e4m3":
                return False, f"{kind} FP8 kernels take E4M3 operands"
        if kind == "blockwise":  # the probed torch kernel or the Triton one (mixprec.kernels.native)
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


def fp4_native_reason(device: torch.device) -> str:
    """Why an FP4 GEMM on `device` is emulated (FP4 tensor cores detected, or not)."""
    if device.type != "cuda":
        return f"no native FP4 GEMM on device {device.type}"
    if not _capabilities().fp4_native:
        return "this GPU has no FP4 tensor cores (SM 10.0+ with torch's float4_e2m1fn_x2)"
    return "native FP4 GEMMs are not wired up yet (SM 10.0+, swizzled E4M3 / E8M0 scales): emulated"


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
    "FP8_DIM_MULTIPLE",
    "DecodedTensor",
    "check_operand",
    "dequantize_blockwise",
    "fp4_native_reason",
    "fp8_gemm_dims_ok",
    "k_block",
    "native_available",
    "native_kind",
    "scaled_mm",
    "transposable",
    "transpose_quantized",
    "will_emulate",
    "with_decoded",
]
