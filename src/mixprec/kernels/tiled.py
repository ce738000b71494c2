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

from mixprec.formats import Format, decode_e4m3_unscaled_into, decode_unscaled, encode_inplace
from mixprec.scaling import Granularity, block_amax, expand_scale, scale_from_amax

# Elements per tile (1 MB of fp32): big enough that the ~35 torch calls per tile cost little next to the
# ~10 passes over it, small enough that its buffers (~11 bytes per element) stay in L2/L3 between passes.
TILE_ELEMENTS = 1 << 18
# From this many elements (an fp32 working copy of 1 GiB) mixprec.quantization's "auto" quantizes CPU
# tensors here, for the memory: tiles are not faster than the whole-tensor eager code (0.6x to 3x its
# time at 2048x1024 and 4096x4096 on 2 threads, measured 2026-12), so smaller tensors stay eager.
TILED_MIN_ELEMENTS = 1 << 28


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
) -> tuple[torch.Tensor, torch.Tensor, tuple[float, float] | None]:
    """(payload, scale, (amax, relative error) if stats) of the 2-D CPU tensor x2, tile by tile.

    scale: a given scale on the grid (fp32), or None. out: a contiguous payload tensor of x2's shape
    to write into (a buffer the caller reuses; default a new tensor).
    """
    rows, cols = x2.shape
    grid = g.scale_shape(rows, cols)
    height, width = tile_shape(rows, cols, g)
    x_buf = torch.empty(height * width, dtype=torch.float32)
    y_buf = torch.empty(height * width, dtype=torch.float32)
    br, bc = g.block_rows or rows, g.block_cols or cols
    amax = 0.0
    if g.block_rows is None and (scale is None or stats):  # blocks span all rows: their amax first
        running = None
        for r0 in range(0, rows, height):
            x = x_buf[: min(height, rows - r0) * cols].view(-1, cols)
            x.copy_(x2[r0 : r0 + height])
            a = block_amax(x, g)
            running = a if running is None else torch.maximum(running, a)
        amax = float(running.max())
        if scale is None:
            scale = scale_from_amax(running, fmt, g, margin, power_of_two)
    full_scale = scale if scale is not None else torch.empty(grid, dtype=torch.float32)
    data = out if out is not None else torch.empty((rows, cols), dtype=fmt.torch_dtype or torch.uint8)
    q_buf = torch.empty(height * width, dtype=data.dtype)
    e4m3 = stats and data.dtype == torch.float8_e4m3fn
    i16_buf = torch.empty(height * width if e4m3 else 0, dtype=torch.int16)
    err2 = ref2 = 0.0
    for r0 in range(0, rows, height):
        h = min(height, rows - r0)
        for c0 in range(0, cols, width):
            wd = min(width, cols - c0)
            x = x_buf[: h * wd].view(h, wd)
            x.copy_(x2[r0 : r0 + h, c0 : c0 + wd])  # the one conversion to fp32, into the reused buffer
            gi, gj, gh, gw = r0 // br, c0 // bc, -(-h // br), -(-wd // bc)
            if scale is None:
                tile_amax = block_amax(x, g)
                full_scale[gi : gi + gh, gj : gj + gw] = scale_from_amax(
                    tile_amax, fmt, g, margin, power_of_two
                )
                if stats:
                    amax = max(amax, float(tile_amax.max()))
            elif stats and g.block_rows is not None:  # given scales: the amax is still reported
                lo, hi = torch.aminmax(x)
                amax = max(amax, -float(lo), float(hi))
            s = expand_scale(full_scale[gi : gi + gh, gj : gj + gw], g, h, wd)
            y = y_buf[: h * wd].view(h, wd)
            torch.div(x, s, out=y)  # a division, as every backend: bit-identical payloads
            whole_rows = wd == cols
            q = data[r0 : r0 + h] if whole_rows else q_buf[: h * wd].view(h, wd)
            encode_inplace(y, fmt, out=q)
            if not whole_rows:
                data[r0 : r0 + h, c0 : c0 + wd].copy_(q)
            if stats:
                t_ref, t_err = _tile_error(x, y, q, s, fmt, i16_buf[: h * wd].view(h, wd) if e4m3 else None)
                ref2 += t_ref
                err2 += t_err
    if not stats:
        return data, full_scale, None
    rel = math.sqrt(err2 / ref2) if ref2 > 0 else (0.0 if math.isfinite(err2) else math.nan)
    return data, full_scale, (amax, rel)


def _tile_error(
    x: torch.Tensor, y: torch.Tensor, q: torch.Tensor, s: torch.Tensor, fmt: Format, i16: torch.Tensor | None
) -> tuple[float, float]:
    """(sum x^2, sum (x - deq(q))^2) of one tile; y is scratch. NaN when the tile holds NaN or inf."""
    if i16 is not None:
        decode_e4m3_unscaled_into(q, i16, y)  # y = values * 2^-8
        factor = 256.0
    else:
        values, factor = decode_unscaled(q, fmt)
        y.copy_(values)
    torch.addcmul(x, y, s * factor, value=-1.0, out=y)  # x - deq(Q(x)) for this tile
    xv, yv = x.view(-1), y.view(-1)
    t_ref, t_err = float(torch.dot(xv, xv)), float(torch.dot(yv, yv))  # BLAS: 2x vector_norm
    if not (math.isfinite(t_ref) and math.isfinite(t_err)):
        if not bool(torch.isfinite(x).all()):
            return math.nan, math.nan
        # huge finite values overflowed fp32 squares
        t_ref = float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2
        t_err = float(torch.linalg.vector_norm(y, dtype=torch.float64)) ** 2
    return t_ref, t_err


__all__ = ["TILED_MIN_ELEMENTS", "TILE_ELEMENTS", "quantize_tiled", "tile_shape", "unsupported_reason"]
