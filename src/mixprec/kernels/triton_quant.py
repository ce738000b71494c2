"""The "triton" quantize backend: amax, scale and cast in one pass over memory (two for per-tensor).

Bit-identical to the eager backend of mixprec.quantization by construction, not by luck:
- amax is taken over the finite elements of each block (NaN/inf count as 0), as `block_amax` does;
- the scale follows `scaling.scale_from_amax` exactly (fp32 division rounded to nearest, the
  frexp-based power-of-two rules, the guards for zero / non-finite amax and fp32 underflow): the
  host side calls it, the kernels carry its kernel-language copy (_scale_from_amax);
- the payload is cast(x / scale) with `tl.math.div_rn` (Triton's plain `/` on fp32 is the approximate
  `div.full.f32`, one ulp off now and then), saturated to ±max with NaN kept;
- rounding to the FP8 grid is done here in fp32 (round-to-nearest-even by the magic-number trick: a
  kernel-language copy of `formats.round_to_grid`, the torch original) and the payload byte is
  assembled from the rounded value's bits (NaN -> S.1111111, as torch's casts give). No fp32->fp8
  conversion instruction is used: the payload is independent of it, of the GPU generation (no fp8
  type support needed) and of the Triton interpreter, whose fp32->fp8 conversion drops the carry into
  the next binade and maps NaN to 0x7C (seen with Triton 3.9: 31.6 -> 16 instead of 32).

Per-tensor scaling takes two passes (per-tile amax partials, their max, then the cast); rows, 1xN
tiles, NxN blocks and MX blocks take one (each program owns whole blocks). Rows longer than
`MAX_TILE` elements, and column-like blocks, run on the transposed strides or as amax-then-cast.

This module imports triton at import time: mixprec.quantization imports it only where triton is
installed. With TRITON_INTERPRET=1 set before the import, the kernels run on CPU tensors (slowly) —
that is how the CPU tests check bit-identity.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from mixprec.errors import MixprecError
from mixprec.formats import E4M3, E5M2, Format, get_format
from mixprec.scaling import Granularity, scale_from_amax

# Elements one program owns (visited in pieces of SUB_TILE): a 128x128 block, or a row up to 64k wide.
MAX_TILE = 65536
SUB_TILE = 4096  # elements in registers at once (8 warps: 16 per thread; 16384 at once spilled on sm_90)
_FP32_TINY = torch.finfo(torch.float32).tiny
SUPPORTED_FORMATS = (E4M3, E5M2)

# scale kinds
_FP32, _POW2, _MX_FLOOR, _MX_RCEIL = 0, 1, 2, 3
# modes
_FUSED, _CAST, _AMAX = 0, 1, 2


@triton.jit
def _pow2(k):
    """2**k as fp32 for integer k in [-127, 127] (2^-127 is subnormal: its own bit pattern)."""
    normal = ((k + 127) << 23).to(tl.float32, bitcast=True)
    sub = tl.full(k.shape, 0x00400000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(k >= -126, normal, sub)


@triton.jit
def _scale_from_amax(amax, DENOM: tl.constexpr, QMAX: tl.constexpr, EMAX: tl.constexpr, KIND: tl.constexpr):
    """scaling.scale_from_amax in kernel language: compute_scale (KIND 0/1) or compute_mx_scale
    (KIND 2/3) of a finite, non-negative amax."""
    if KIND == 0 or KIND == 1:
        s = tl.math.div_rn(amax, DENOM)
        usable = (amax > 0) & (s < float("inf"))
        s = tl.where(usable, tl.maximum(s, 1.1754943508222875e-38), 1.0)
        if KIND == 1:  # smallest power of two >= s (s is a normal fp32 number here)
            bits = s.to(tl.int32, bitcast=True)
            e = (bits >> 23) & 0xFF
            m = bits & 0x7FFFFF
            s = _pow2(tl.minimum(e - 127 + (m != 0).to(tl.int32), 127))
        return s
    else:
        if KIND == 2:  # floor(log2 amax) - emax
            e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
            k = tl.where(e == 0, -127, e - 127 - EMAX)
        else:  # smallest power of two >= amax / max
            v = tl.math.div_rn(amax, QMAX)
            bits = v.to(tl.int32, bitcast=True)
            e = (bits >> 23) & 0xFF
            m = bits & 0x7FFFFF
            k = tl.where(e == 0, tl.where(bits <= 0x00400000, -127, -126), e - 127 + (m != 0).to(tl.int32))
        k = tl.where(amax > 0, k, -127)
        k = tl.minimum(tl.maximum(k, -127), 127)
        return _pow2(k)


@triton.jit
def _fp8_code(y, QMAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """Saturate fp32 y to ±QMAX, round to the format's grid (nearest, ties to even), return the uint8 code.

    NaN gives S.1111111 (0x7F / 0xFF, what torch's casts give), the sign of zero is kept. The code is
    assembled from the rounded value's bits, so no fp32->fp8 conversion instruction is involved.
    """
    yc = tl.where(y > QMAX, QMAX, tl.where(y < -QMAX, -QMAX, y))
    sign = (yc.to(tl.int32, bitcast=True) >> 24) & 0x80
    ax = tl.abs(yc)
    binade = (ax.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    binade = tl.maximum(binade, MIN_NORMAL)
    magic = 2.0 ** (23 - MANT)
    # formats.round_to_grid in kernel language (the torch original): exact on the format's grid
    r = ((tl.math.div_rn(ax, binade) + magic) - magic) * binade
    rb = r.to(tl.int32, bitcast=True)
    normal = ((((rb >> 23) & 0xFF) - 127 + BIAS) << MANT) | ((rb & 0x7FFFFF) >> (23 - MANT))
    r_num = tl.minimum(tl.where(r == r, r, 0.0), MIN_NORMAL)  # keeps the (unused) branch in int range
    sub = (r_num * (1.0 / MIN_NORMAL) * (2.0**MANT)).to(tl.int32)  # 0 .. 2^MANT - 1 quanta, exact
    code = tl.where(r >= MIN_NORMAL, normal, sub) | sign
    code = tl.where(y != y, sign | 0x7F, code)
    return code.to(tl.uint8)


@triton.jit
def _quant_kernel(
    x_ptr, q_ptr, s_ptr,
    R, C,
    sxr, sxc, sqr, sqc, ssr, ssc,
    MODE: tl.constexpr, PER_ROW: tl.constexpr, TR: tl.constexpr, BC: tl.constexpr,
    SUB_R: tl.constexpr, SUB_C: tl.constexpr, TPB_R: tl.constexpr, TPB_C: tl.constexpr,
    QMAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL: tl.constexpr,
    DENOM: tl.constexpr, EMAX: tl.constexpr, KIND: tl.constexpr,
):  # fmt: skip
    """One program = a [TR, BC] tile: TR rows of one 1xBC block each (PER_ROW) or one TRxBC block.

    The tile is visited in [SUB_R, SUB_C] pieces (at most a few thousand elements, so nothing spills
    to local memory): once for the amax, once for the cast (the second read comes from cache).
    MODE 0: compute the scale(s), store them at s_ptr, cast. MODE 1: load the scale(s) and cast; a
    block may span TPB_R x TPB_C tiles, and a scale stride of 0 broadcasts one scale along that axis.
    MODE 2: store the tile's amax(es) at s_ptr (partials, reduced by the caller).
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r_base = pid_r * TR
    c_base = pid_c * BC
    if PER_ROW:
        rows = r_base + tl.arange(0, TR)
        s_offs = rows * ssr + (pid_c // TPB_C) * ssc
        if MODE == 1:
            scale = tl.load(s_ptr + s_offs, mask=rows < R, other=1.0)
        else:
            amax = tl.zeros([TR], dtype=tl.float32)
            for c0 in range(0, BC, SUB_C):
                cols = c_base + c0 + tl.arange(0, SUB_C)
                mask = (rows[:, None] < R) & (cols[None, :] < C)
                x = tl.load(x_ptr + rows[:, None] * sxr + cols[None, :] * sxc, mask=mask, other=0.0).to(
                    tl.float32
                )
                a = tl.abs(x)
                a = tl.where(a < float("inf"), a, 0.0)  # finite elements only (NaN compares false)
                amax = tl.maximum(amax, tl.max(a, axis=1))
            if MODE == 2:
                tl.store(s_ptr + s_offs, amax, mask=rows < R)
            else:
                scale = _scale_from_amax(amax, DENOM, QMAX, EMAX, KIND)
                tl.store(s_ptr + s_offs, scale, mask=rows < R)
        if MODE != 2:
            for c0 in range(0, BC, SUB_C):
                cols = c_base + c0 + tl.arange(0, SUB_C)
                mask = (rows[:, None] < R) & (cols[None, :] < C)
                x = tl.load(x_ptr + rows[:, None] * sxr + cols[None, :] * sxc, mask=mask, other=0.0).to(
                    tl.float32
                )
                code = _fp8_code(tl.math.div_rn(x, scale[:, None]), QMAX, MANT, BIAS, MIN_NORMAL)
                tl.store(q_ptr + rows[:, None] * sqr + cols[None, :] * sqc, code, mask=mask)
    else:
        cols = c_base + tl.arange(0, BC)
        s_offs = (pid_r // TPB_R) * ssr + (pid_c // TPB_C) * ssc
        if MODE == 1:
            scale = tl.load(s_ptr + s_offs)
        else:
            col_max = tl.zeros([BC], dtype=tl.float32)
            for r0 in range(0, TR, SUB_R):
                rows = r_base + r0 + tl.arange(0, SUB_R)
                mask = (rows[:, None] < R) & (cols[None, :] < C)
                x = tl.load(x_ptr + rows[:, None] * sxr + cols[None, :] * sxc, mask=mask, other=0.0).to(
                    tl.float32
                )
                a = tl.abs(x)
                a = tl.where(a < float("inf"), a, 0.0)
                col_max = tl.maximum(col_max, tl.max(a, axis=0))
            amax = tl.max(col_max, axis=0)
            if MODE == 2:
                tl.store(s_ptr + s_offs, amax)
            else:
                scale = _scale_from_amax(amax, DENOM, QMAX, EMAX, KIND)
                tl.store(s_ptr + s_offs, scale)
        if MODE != 2:
            for r0 in range(0, TR, SUB_R):
                rows = r_base + r0 + tl.arange(0, SUB_R)
                mask = (rows[:, None] < R) & (cols[None, :] < C)
                x = tl.load(x_ptr + rows[:, None] * sxr + cols[None, :] * sxc, mask=mask, other=0.0).to(
                    tl.float32
                )
                code = _fp8_code(tl.math.div_rn(x, scale), QMAX, MANT, BIAS, MIN_NORMAL)
                tl.store(q_ptr + rows[:, None] * sqr + cols[None, :] * sqc, code, mask=mask)


def _p2(n: int) -> int:
    """Smallest power of two >= n."""
    return 1 << max(0, (int(n) - 1).bit_length())


def unsupported_reason(x: torch.Tensor, fmt: str | Format, granularity: Granularity | None) -> str | None:
    """Why the fused kernels cannot take this case (then another backend), or None."""
    fmt = get_format(fmt)
    g = granularity or Granularity.tensor()
    if fmt not in SUPPORTED_FORMATS:
        return f"fused kernels cover e4m3/e5m2 payloads, not {fmt.name}"
    if fmt.torch_dtype is None:
        return f"this torch has no {fmt.name} dtype"
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        return f"input dtype {x.dtype}"
    for side in (g.block_rows, g.block_cols):
        if side is not None and side & (side - 1):
            return f"block side {side} is not a power of two"
    if x.numel() >= 2**31:
        return "more than 2^31 elements (the kernels index with int32)"
    return None


@dataclass(frozen=True)
class _Plan:
    """How tiles cover the blocks of a (possibly transposed) [rows, cols] view."""

    per_row: bool  # each tile row is its own block (block_rows == 1)
    tr: int  # tile rows
    bc: int  # tile cols
    sub_r: int  # rows / cols of the piece held in registers at once
    sub_c: int
    tpb_r: int  # tiles per block along rows (1 when broadcast)
    tpb_c: int
    bcast_r: bool  # one block spans every row: scale row stride 0
    bcast_c: bool
    fused: bool  # one tile == one block: amax, scale and cast in a single pass


def _plan(rows: int, cols: int, br: int | None, bc: int | None) -> _Plan:
    if br == 1:
        width = cols if bc is None else bc
        if _p2(width) <= MAX_TILE:
            tile_c = _p2(width)
            tr = max(1, min(_p2(rows), SUB_TILE // tile_c))
            sub_c = min(tile_c, SUB_TILE)
            return _Plan(True, tr, tile_c, tr, sub_c, 1, 1, False, bc is None, True)
        tile_c = SUB_TILE
        return _Plan(
            True, 1, tile_c, 1, tile_c, 1, 1 if bc is None else bc // tile_c, False, bc is None, False
        )
    if br is not None and bc is not None and br * bc <= MAX_TILE and bc <= SUB_TILE:
        return _Plan(False, br, bc, max(1, min(br, SUB_TILE // bc)), bc, 1, 1, False, False, True)
    tr, tc = min(br or 32, 32), min(bc or 256, 256)
    return _Plan(
        False,
        tr,
        tc,
        tr,
        tc,
        1 if br is None else br // tr,
        1 if bc is None else bc // tc,
        br is None,
        bc is None,
        False,
    )


def _launch(x2, q, s, xs, qs, ss, rows, cols, mode, plan, fmt, g, margin, power_of_two):
    if g.scale_format == "e8m0":
        kind = _MX_FLOOR if g.mx_rounding == "floor" else _MX_RCEIL
    else:
        kind = _POW2 if power_of_two else _FP32
    grid = (triton.cdiv(rows, plan.tr), triton.cdiv(cols, plan.bc))
    num_warps = 4 if plan.sub_r * plan.sub_c <= 1024 else 8
    _quant_kernel[grid](
        x2, q.view(torch.uint8), s, rows, cols, xs[0], xs[1], qs[0], qs[1], ss[0], ss[1],
        MODE=mode, PER_ROW=plan.per_row, TR=plan.tr, BC=plan.bc, SUB_R=plan.sub_r, SUB_C=plan.sub_c, TPB_R=plan.tpb_r, TPB_C=plan.tpb_c,
        QMAX=float(fmt.max), MANT=fmt.mantissa_bits, BIAS=fmt.bias, MIN_NORMAL=float(fmt.min_normal),
        DENOM=float(fmt.max * 2.0**margin), EMAX=fmt.emax, KIND=kind, num_warps=num_warps,
    )  # fmt: skip


def _reduce_partials(part: torch.Tensor, plan: _Plan, grid: tuple[int, int]) -> torch.Tensor:
    """Tile amax partials -> block amax on the scale grid (max is exact in any order)."""
    a = part
    if plan.bcast_r:
        a = a.amax(dim=0, keepdim=True)
    elif plan.tpb_r > 1:
        a = torch.nn.functional.pad(a, (0, 0, 0, (-a.shape[0]) % plan.tpb_r))
        a = a.reshape(-1, plan.tpb_r, a.shape[1]).amax(dim=1)
    if plan.bcast_c:
        a = a.amax(dim=1, keepdim=True)
    elif plan.tpb_c > 1:
        a = torch.nn.functional.pad(a, (0, (-a.shape[1]) % plan.tpb_c))
        a = a.reshape(a.shape[0], -1, plan.tpb_c).amax(dim=2)
    assert tuple(a.shape) == grid, (a.shape, grid)
    return a


def fused_quantize(
    x2: torch.Tensor,
    fmt: str | Format,
    g: Granularity,
    *,
    scale: torch.Tensor | None = None,
    margin: int = 0,
    power_of_two: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, scale) of the 2-D x2 in Triton; scale: given on the grid (fp32, x2's device) or None.

    MixprecError for what the kernels do not cover (see unsupported_reason).
    """
    fmt = get_format(fmt)
    reason = unsupported_reason(x2, fmt, g)
    if reason:
        raise MixprecError(f"fused quantize: {reason}")
    if x2.dtype == torch.float64:
        x2 = x2.float()  # every backend rounds fp64 to fp32 first; so must the kernel
    grid_shape = g.scale_shape(*x2.shape)
    q = torch.empty(tuple(x2.shape), dtype=fmt.torch_dtype, device=x2.device)
    given = scale is not None
    s = scale.contiguous() if given else torch.empty(grid_shape, dtype=torch.float32, device=x2.device)

    rows, cols = x2.shape
    br, bc = g.block_rows, g.block_cols
    xs, qs, ss = (x2.stride(0), x2.stride(1)), (q.stride(0), q.stride(1)), (s.stride(0), s.stride(1))
    transposed = bc == 1 and br != 1
    if transposed:  # column-like blocks are row-like on the transposed view: swap all strides
        rows, cols, br, bc = cols, rows, bc, br
        xs, qs, ss = xs[::-1], qs[::-1], ss[::-1]
    plan = _plan(rows, cols, br, bc)
    cast_ss = (0 if plan.bcast_r else ss[0], 0 if plan.bcast_c else ss[1])

    if given:
        _launch(x2, q, s, xs, qs, cast_ss, rows, cols, _CAST, plan, fmt, g, margin, power_of_two)
    elif plan.fused:
        _launch(x2, q, s, xs, qs, cast_ss, rows, cols, _FUSED, plan, fmt, g, margin, power_of_two)
    else:
        n_r = rows if plan.per_row else triton.cdiv(rows, plan.tr)
        part = torch.empty((n_r, triton.cdiv(cols, plan.bc)), dtype=torch.float32, device=x2.device)
        one = replace(plan, tpb_r=1, tpb_c=1)
        _launch(x2, q, part, xs, qs, part.stride(), rows, cols, _AMAX, one, fmt, g, margin, power_of_two)
        amax = _reduce_partials(part, plan, grid_shape[::-1] if transposed else grid_shape)
        if transposed:
            amax = amax.t()
        s.copy_(scale_from_amax(amax, fmt, g, margin, power_of_two))
        _launch(x2, q, s, xs, qs, cast_ss, rows, cols, _CAST, plan, fmt, g, margin, power_of_two)
    return q, s
