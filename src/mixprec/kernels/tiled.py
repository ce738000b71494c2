"""The "tiled" quantize backend: CPU tiles in reused buffers, bounded memory, optional error statistics.

A big weight (bf16, say) quantized whole needs an fp32 copy of itself and a pass over memory per
operation. Here it is cut into tiles aligned to the scale grid (see tile_shape) of about
TILE_ELEMENTS elements: each tile is converted to fp32 once, into a reused buffer, and every pass
over it (amax, divide, cast; with stats also decode and error) stays in cache. Scales of row and
block granularities depend only on their own rows and blocks, so a tile quantizes exactly as the
whole tensor would; scales of blocks that span all rows (per tensor, per column) come from a first
pass for their amax. The scale rule (scaling.scale_from_amax), the division by the expanded scale
(scaling.expand_scale) and the payload cast (formats.encode_inplace) are every backend's, so the
results are the eager backend's bit for bit.

stats=True also returns (amax, relative error ||x - deq(Q(x))|| / ||x||), computed from the decoded
payload of each tile (fp32 sums per tile, accumulated in float64): what the inference reports need,
at no extra pass over the weight. A NaN or inf input gives relative error NaN (the caller refuses it).
"""

from __future__ import annotations

import math

import torch

from mixprec.formats import (
    E2M1_DECODE_FACTOR,
    Format,
    decode_e2m1_unscaled_into,
    decode_e4m3_unscaled_into,
    decode_unscaled,
    encode_inplace,
    pack_nibbles,
    raise_if,
)
from mixprec.kernels import c_quantize
from mixprec.kernels.codes import encode_codes_into
from mixprec.scaling import Granularity, block_amax, expand_scale, packed_payload_shape, scale_from_amax

# Elements per tile (1 MB of fp32): big enough that the ~35 torch calls per tile cost little next to the
# ~10 passes over it, small enough that its buffers (~11 bytes per element) stay in L2/L3 between passes.
TILE_ELEMENTS = 1 << 18
# From this many elements (an fp32 working copy of 1 GiB) mixprec.quantization's "auto" quantizes CPU
# tensors here, for the memory: tiles are not faster than the whole-tensor eager code (0.6x to 3x its
# time at 2048x1024 and 4096x4096 on 2 threads, measured 2026-12), so smaller tensors stay eager.
TILED_MIN_ELEMENTS = 1 << 28
# NVFP4 (E4M3 block scales and a global scale) from this many elements: its eager code makes about ten
# whole-tensor temporaries, and fresh allocations past glibc's mmap threshold (32 MiB) fault their
# pages in on every call; tiles reuse theirs (measured: see docs/benchmarks.md, NVFP4 streaming)
NVFP4_TILED_MIN_ELEMENTS = 1 << 20


def unsupported_reason(x2: torch.Tensor) -> str | None:
    """Why the tiled backend does not take this 2-D input, or None (every format and granularity)."""
    if x2.device.type != "cpu":
        return "the tiled backend runs on the CPU"
    return None


def tile_shape(rows: int, cols: int, g: Granularity) -> tuple[int, int]:
    """Tile (height, width) aligned to the scale grid, about TILE_ELEMENTS elements.

    Blocks more than one row high: one block row high, whole blocks wide, so a tile's scale grid is one
    row of blocks and every block lies in exactly one tile. Otherwise (per row, or blocks spanning all
    rows): whole rows.
    """
    br, bc = g.block_rows, g.block_cols
    if br is not None and br > 1:
        height = min(rows, br)
        width = cols if bc is None else min(cols, max(bc, TILE_ELEMENTS // height // bc * bc))
        return height, width
    return min(rows, max(1, TILE_ELEMENTS // max(cols, 1))), cols


def quantize_tiled(
    x2: torch.Tensor,
    fmt: Format,
    g: Granularity,
    *,
    scale: torch.Tensor | None = None,
    margin: int = 0,
    power_of_two: bool = False,
    out: torch.Tensor | None = None,
    stats: bool = False,
    global_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[float, float] | None]:
    """(payload, scale, (amax, relative error) if stats) of the 2-D CPU tensor x2, tile by tile.

    scale: a given scale on the grid (fp32), or None. out: a contiguous payload tensor of x2's shape
    to write into (a buffer the caller reuses; default a new tensor), or for a 4-bit format a uint8
    [rows, cols / 2] one that takes each tile's codes packed two a byte (formats.pack_nibbles: no
    byte-per-code copy of the weight is ever made). global_scale: E4M3 (NVFP4)
    granularities only, the tensor's global scale (one fp32 element, computed or given by the
    caller): block scales are in its units, computed in x2's dtype where g.scale_math is "input".
    """
    if c_quantize.takes(x2, fmt, g, out):  # two passes of compiled C, where a C compiler built them
        done = c_quantize.quantize_compiled(
            x2, fmt, g, scale=scale, margin=margin, power_of_two=power_of_two, out=out, stats=stats,
            global_scale=global_scale,
        )  # fmt: skip
        if done is not None:  # else NaN or inf: the torch code has their rules
            return done
    return _quantize_tiles(x2, fmt, g, scale, margin, power_of_two, out, stats, global_scale)


def _quantize_tiles(x2, fmt, g, scale, margin, power_of_two, out, stats, global_scale):
    """quantize_tiled in torch code, tile by tile."""
    rows, cols = x2.shape
    grid = g.scale_shape(rows, cols)
    height, width = tile_shape(rows, cols, g)
    bufs = _Buffers(
        height * width, fmt, stats, out.dtype if out is not None else fmt.torch_dtype or torch.uint8
    )
    br, bc = g.block_rows or rows, g.block_cols or cols
    amax = 0.0
    if g.block_rows is None and (scale is None or stats):  # blocks span all rows: their amax first
        running = None
        for r0 in range(0, rows, height):
            x = bufs.x[: min(height, rows - r0) * cols].view(-1, cols)
            x.copy_(x2[r0 : r0 + height])
            a = block_amax(x, g)
            running = a if running is None else torch.maximum(running, a)
        amax = float(running.max())
        if scale is None:
            scale = scale_from_amax(running, fmt, g, margin, power_of_two)
    full_scale = scale if scale is not None else torch.empty(grid, dtype=torch.float32)
    gs = None if global_scale is None else global_scale.float().reshape(1, 1)
    rule = {"global_scale": gs, "dtype": x2.dtype} if gs is not None else {}
    data = out if out is not None else torch.empty((rows, cols), dtype=bufs.q.dtype)
    packed = tuple(data.shape) == packed_payload_shape(fmt, rows, cols)
    err2 = ref2 = 0.0
    for r0 in range(0, rows, height):
        h = min(height, rows - r0)
        for c0 in range(0, cols, width):
            wd = min(width, cols - c0)
            x = bufs.x[: h * wd].view(h, wd)
            x.copy_(x2[r0 : r0 + h, c0 : c0 + wd])  # the one conversion to fp32, into the reused buffer
            gi, gj, gh, gw = r0 // br, c0 // bc, -(-h // br), -(-wd // bc)
            tile_scale = full_scale[gi : gi + gh, gj : gj + gw]
            if scale is None:
                tile_amax = bufs.block_amax(x, g)
                tile_scale.copy_(scale_from_amax(tile_amax, fmt, g, margin, power_of_two, **rule))
                if stats:
                    amax = max(amax, float(tile_amax.max()))
            elif stats and g.block_rows is not None:  # given scales: the amax is still reported
                lo, hi = torch.aminmax(x)
                amax = max(amax, -float(lo), float(hi))
            # NVFP4 divides by block / global (fp32), as eager does for the whole grid
            xv, yv, s = _scaled_views(x, bufs.y[: h * wd].view(h, wd), tile_scale if gs is None else tile_scale / gs, g)  # fmt: skip
            torch.div(xv, s, out=yv)  # a division, as every backend: bit-identical payloads
            y = bufs.y[: h * wd].view(h, wd)
            in_place = wd == cols and not packed  # whole rows of an unpacked payload: encoded in place
            q = data[r0 : r0 + h] if in_place else bufs.q[: h * wd].view(h, wd)
            bufs.encode(y, q)
            if packed:
                pack_nibbles(q, out=data[r0 : r0 + h, c0 // 2 : (c0 + wd) // 2])
            elif not in_place:
                data[r0 : r0 + h, c0 : c0 + wd].copy_(q)
            if stats:
                t_ref, t_err = bufs.tile_error(xv, yv, q, s)
                ref2 += t_ref
                err2 += t_err
    if not stats:
        return data, full_scale, None
    rel = math.sqrt(err2 / ref2) if ref2 > 0 else (0.0 if math.isfinite(err2) else math.nan)
    return data, full_scale, (amax, rel)


def _scaled_views(x: torch.Tensor, y: torch.Tensor, tile_scale: torch.Tensor, g: Granularity):
    """(x, y, scale) broadcast against each other, one scale per element: blocks of one row (1 x bc,
    the tile a whole number of them) as [h, blocks, bc] views with the scales [h, blocks, 1] (no
    expanded copy); else the tile with scaling.expand_scale."""
    h, wd = x.shape
    bc = g.block_cols
    if g.block_rows == 1 and bc is not None and bc > 1 and wd % bc == 0:
        return x.view(h, wd // bc, bc), y.view(h, wd // bc, bc), tile_scale.view(h, wd // bc, 1)
    return x, y, expand_scale(tile_scale, g, h, wd)


class _Buffers:
    """One tile's reused buffers, and the per-tile encode and error of the payload's format."""

    def __init__(self, size: int, fmt: Format, stats: bool, payload_dtype: torch.dtype) -> None:
        self.fmt = fmt
        self.x = torch.empty(size, dtype=torch.float32)
        self.y = torch.empty(size, dtype=torch.float32)
        self.q = torch.empty(size, dtype=payload_dtype)
        self.sub_byte = fmt.bits < 8
        # the sub-byte encode's int32 scratch (kernels.codes); int16 for the E4M3 / E2M1 decodes
        self.i32 = tuple(torch.empty(size if self.sub_byte else 0, dtype=torch.int32) for _ in range(3))
        fast_decode = stats and (payload_dtype == torch.float8_e4m3fn or fmt.name == "e2m1")
        self.i16 = tuple(torch.empty(size if fast_decode else 0, dtype=torch.int16) for _ in range(2))

    def block_amax(self, x: torch.Tensor, g: Granularity) -> torch.Tensor:
        """scaling.block_amax of the tile x. Blocks of one row (the tile a whole number of them): the
        max of |x|'s bit patterns (non-negative floats order as integers; NaN's patterns lie above
        inf's, so a NaN block still reads NaN and takes block_amax's finite-only recompute), one
        integer reduction where block_amax makes two float ones (amin, amax), ~5x slower over short
        blocks."""
        h, wd = x.shape
        bc = g.block_cols
        if not (self.i32[0].numel() >= x.numel() and g.block_rows == 1 and bc is not None and wd % bc == 0):
            return block_amax(x, g)
        bits = self.i32[0][: x.numel()].view(h, wd // bc, bc)
        torch.bitwise_and(x.view(torch.int32).view(bits.shape), 0x7FFFFFFF, out=bits)
        amax = bits.amax(-1).view(torch.float32)
        if not bool(torch.isfinite(amax).all()):  # rare: block_amax's rule, over finite elements only
            return block_amax(x, g)
        return amax

    def encode(self, y: torch.Tensor, q: torch.Tensor) -> None:
        """q = the payload of the scaled tile y (y's values are kept)."""
        if not self.sub_byte:
            encode_inplace(y, self.fmt, out=q)
            return
        raise_if(torch.isnan(y.max()), f"cannot encode NaN in {self.fmt.name}: the format has no NaN code")
        encode_codes_into(y, self.fmt, q, self.i32)

    def tile_error(self, x: torch.Tensor, y: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> tuple[float, float]:  # fmt: skip
        """(sum x^2, sum (x - deq(q))^2) of one tile; y is scratch. NaN when the tile holds NaN or inf."""
        i16, sign = (t[: q.numel()].view(q.shape) for t in self.i16)
        flat = y.view(q.shape)
        if q.dtype == torch.float8_e4m3fn:
            decode_e4m3_unscaled_into(q, i16, flat)  # y = values * 2^-8
            factor = 256.0
        elif self.fmt.name == "e2m1" and self.i16[0].numel():
            decode_e2m1_unscaled_into(q, flat, i16, sign)  # y = values * 2^-14
            factor = E2M1_DECODE_FACTOR
        else:
            values, factor = decode_unscaled(q, self.fmt)
            flat.copy_(values)
        torch.addcmul(x, y, s * factor, value=-1.0, out=y)  # x - deq(Q(x)) for this tile
        xv, yv = x.reshape(-1), y.reshape(-1)
        t_ref, t_err = float(torch.dot(xv, xv)), float(torch.dot(yv, yv))  # BLAS: 2x vector_norm
        if not (math.isfinite(t_ref) and math.isfinite(t_err)):
            if not bool(torch.isfinite(x).all()):
                return math.nan, math.nan
            # huge finite values overflowed fp32 squares
            t_ref = float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2
            t_err = float(torch.linalg.vector_norm(y, dtype=torch.float64)) ** 2
        return t_ref, t_err


__all__ = [
    "NVFP4_TILED_MIN_ELEMENTS",
    "TILED_MIN_ELEMENTS",
    "TILE_ELEMENTS",
    "quantize_tiled",
    "tile_shape",
    "unsupported_reason",
]
