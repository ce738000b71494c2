"""Scaling: which elements share a scale, amax -> scale, the scale grid, and QuantizedTensor.

Convention (the one compressed-tensors checkpoints use): the scale is the DEQUANTIZATION multiplier,
    scale = amax / (fmt.max * 2**margin),   value ~= payload * scale,   payload = cast(x / scale).
Quantization divides by the scale (never multiplies by a reciprocal), in every backend of
mixprec.quantization, so they all produce bit-identical payloads. The pieces every backend shares
live here, each written once: `scale_from_amax` (the amax -> scale rule), `expand_scale` (the scale
grid repeated to one scale per element), `check_scale` (a given scale, validated onto the grid).

A tensor is viewed as 2-D [rows, cols] (rows = product of the leading dims, cols = the last dim) and
cut into blocks of `block_rows x block_cols`; `None` means the whole dimension. So per-tensor is
(None, None), per-row (per token, or per output channel of a weight [out, in]) is (1, None), per-column
is (None, 1), DeepSeek-V3 tiles are (1, 128) / (128, 1) and weight blocks (128, 128), and OCP MX is
(1, 32) with power-of-two E8M0 scales. When a dimension is not a multiple of the block, the last block
along it is smaller and gets its own scale from the elements it has (the scale grid is
ceil(rows / block_rows) x ceil(cols / block_cols), as compressed-tensors' block layout stores it).

NVFP4 (scale_format "e4m3") is two-level: one fp32 global scale per tensor, E4M3.max * fmt.max / amax,
and E4M3 block scales in its units, E4M3(global * amax(block) / fmt.max); the dequantization multiplier
is block / global (QuantizedTensor.effective_scale), the layout compressed-tensors, ModelOpt and vLLM use.

Scales are never 0, inf or NaN: amax is taken over the finite elements of a block (inf elements then
saturate to +-max; NaN elements stay NaN in formats that have NaN); an all-zero block gets scale 1
(2^-127 for E8M0 scales, the smallest code); a scale that would underflow fp32 is raised to the
smallest normal fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mixprec.errors import MixprecError
from mixprec.formats import E4M3, E8M0, Format, decode, encode, get_format, pow2, unpack_nibbles

_FP32_TINY = torch.finfo(torch.float32).tiny
SCALE_FORMATS = ("fp32", "e8m0", "e4m3")
MX_ROUNDINGS = ("floor", "rceil", "even")
# a block scale that rounds to 0 in E4M3 is stored as this (compressed-tensors' rule: its E4M3 "eps")
E4M3_ZERO_SCALE = 0.125


@dataclass(frozen=True)
class Granularity:
    """Which elements share one scale: blocks of block_rows x block_cols of the 2-D view."""

    block_rows: int | None
    block_cols: int | None
    # "fp32"; "e8m0" for OCP MX power-of-two scales; "e4m3" for NVFP4: E4M3 block scales in the units
    # of one fp32 per-tensor global scale (QuantizedTensor.global_scale)
    scale_format: str = "fp32"
    # E8M0 only: "floor" (OCP MX v1.0), "rceil" (round the scale up: TransformerEngine / cuBLAS) or
    # "even" (torchao's; compressed-tensors' mxfp4): see compute_mx_scale
    mx_rounding: str = "floor"
    # E4M3 only: "fp32" computes amax/max and the global scale in fp32 (TransformerEngine); "input"
    # rounds both to the input's dtype first, as compressed-tensors / llm-compressor do (bf16 weights)
    scale_math: str = "fp32"

    def __post_init__(self) -> None:
        for side in (self.block_rows, self.block_cols):
            if side is not None and (not isinstance(side, int) or side < 1):
                raise MixprecError(f"block sides must be positive integers or None, got {side!r}")
        if self.scale_format not in SCALE_FORMATS:
            raise MixprecError(f"scale_format must be one of {SCALE_FORMATS}, got {self.scale_format!r}")
        if self.mx_rounding not in MX_ROUNDINGS:
            raise MixprecError(f"mx_rounding must be one of {MX_ROUNDINGS}, got {self.mx_rounding!r}")
        if self.scale_math not in ("fp32", "input"):
            raise MixprecError(f"scale_math must be 'fp32' or 'input', got {self.scale_math!r}")

    @classmethod
    def tensor(cls) -> Granularity:
        return cls(None, None)

    @classmethod
    def rows(cls) -> Granularity:
        return cls(1, None)

    @classmethod
    def columns(cls) -> Granularity:
        return cls(None, 1)

    @classmethod
    def blocks(cls, block_rows: int, block_cols: int) -> Granularity:
        return cls(block_rows, block_cols)

    @classmethod
    def mx(cls, size: int = 32, axis: int = -1, rounding: str = "floor") -> Granularity:
        """OCP MX blocks of `size` consecutive elements along the last dim (axis=-1) or the rows (axis=0)."""
        if axis in (-1, 1):
            return cls(1, size, "e8m0", rounding)
        if axis == 0:
            return cls(size, 1, "e8m0", rounding)
        raise MixprecError(f"MX blocks run along axis -1 or 0 of the 2-D view, got axis={axis}")

    @classmethod
    def nvfp4(cls, block_rows: int = 1, block_cols: int = 16, scale_math: str = "fp32") -> Granularity:
        """NVFP4 blocks: E4M3 block scales times one fp32 global scale; 1x16 along K, or 16x16 (2-D
        weight blocks of TransformerEngine's recipe). scale_math="input" for compressed-tensors' rule."""
        return cls(block_rows, block_cols, "e4m3", "floor", scale_math)

    @property
    def name(self) -> str:
        if self.scale_format == "e8m0":
            if self.block_rows == 1:
                shape = f"{self.block_cols}"
            elif self.block_cols == 1:
                shape = f"{self.block_rows}-col"  # blocks down the columns: a transposed operand's
            else:
                shape = f"{self.block_rows}x{self.block_cols}"  # 2-D blocks (fp4-mxfp4 weights with 2d)
            return f"mx{shape}" + ("" if self.mx_rounding == "floor" else f"-{self.mx_rounding}")
        if self.scale_format == "e4m3":
            shape = f"{self.block_cols}" if self.block_rows == 1 else f"{self.block_rows}x{self.block_cols}"
            return f"nv{shape}" + ("-input" if self.scale_math == "input" else "")
        return {
            (None, None): "tensor",
            (1, None): "row",
            (None, 1): "column",
        }.get((self.block_rows, self.block_cols), f"block{self.block_rows}x{self.block_cols}")

    def clip_headroom(self, fmt: Format) -> float:
        """How far above fmt.max |x / scale| may reach because of how this granularity's scales are
        rounded, as a factor (1.0 for fp32 scales): elements clipped within it are the scale rule's
        rounding, not a range problem, and do not count as saturated (monitor, profile). E4M3 block
        scales round amax / max to nearest: at most 2^-4 below it in E4M3's normal range, so up to
        max / (1 - 2^-4) (6.4 for E2M1), widened by 2^-7 for compressed-tensors' bf16 arithmetic
        (about 3 % of an NVFP4 tensor lands there: one block maximum in two). E8M0 "floor" takes
        2^(floor(log2 amax) - emax): up to 2^(emax+1) (8 for E2M1); "even" bumps the exponent
        from mantissa 2 - 2^-(m+1) up (7 for E2M1); "rceil" never clips a block in range."""
        fmt = get_format(fmt)
        if self.scale_format == "e4m3":
            return (1 / (1 - 2.0**-4)) * (1 + 2.0**-7)
        if self.scale_format == "e8m0":
            top = {"floor": 2.0, "even": 2.0 - 2.0 ** -(fmt.mantissa_bits + 1), "rceil": 0.0}[
                self.mx_rounding
            ]
            return max(top * 2.0**fmt.emax / fmt.max, 1.0)
        return 1.0

    def transposed(self) -> Granularity:
        """The same blocking for the transposed 2-D view (1x128 tiles become 128x1)."""
        return Granularity(
            self.block_cols, self.block_rows, self.scale_format, self.mx_rounding, self.scale_math
        )

    def block_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return (
            rows if self.block_rows is None else self.block_rows,
            cols if self.block_cols is None else self.block_cols,
        )

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int]:
        br, bc = self.block_shape(rows, cols)
        return (math.ceil(rows / br), math.ceil(cols / bc))


def as_2d(x: torch.Tensor) -> torch.Tensor:
    """The 2-D view every granularity is defined on: [prod(leading dims), last dim]."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    return x.reshape(-1, x.shape[-1])


def _regions(rows: int, cols: int, br: int, bc: int):
    """The rectangles of whole blocks: the part that is a multiple of the block, and the edge strips.

    Yields (r0, r1, h, c0, c1, w): rows r0:r1 in blocks of h rows, columns c0:c1 in blocks of w.
    Working on these views (instead of a zero-padded copy) costs no extra memory pass.
    """
    rm, cm = rows - rows % br, cols - cols % bc
    row_parts = ([(0, rm, br)] if rm else []) + ([(rm, rows, rows - rm)] if rm < rows else [])
    col_parts = ([(0, cm, bc)] if cm else []) + ([(cm, cols, cols - cm)] if cm < cols else [])
    for r0, r1, h in row_parts:
        for c0, c1, w in col_parts:
            yield r0, r1, h, c0, c1, w


def _block_view(t: torch.Tensor, r0: int, r1: int, h: int, c0: int, c1: int, w: int) -> torch.Tensor:
    """t[r0:r1, c0:c1] as [blocks down, h, blocks across, w] (a view)."""
    return t[r0:r1, c0:c1].unflatten(1, ((c1 - c0) // w, w)).unflatten(0, ((r1 - r0) // h, h))


def _abs_max(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return torch.maximum(lo.neg_(), hi)


def _min_max(v: torch.Tensor, dim: int, keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    # amin + amax: two vectorized passes beat aminmax along a dim (2-5x slower on torch 2.13 CPU)
    return v.amin(dim, keepdim=keepdim), v.amax(dim, keepdim=keepdim)


def _amax(x2: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """Per-block max |x| (NaN if a block holds NaN): aminmax on views, no |x| or padded copy."""
    rows, cols = x2.shape
    g = granularity
    if g.block_rows is None and g.block_cols is None:
        return _abs_max(*torch.aminmax(x2)).reshape(1, 1).float()
    if g.block_rows == 1 and g.block_cols is None:
        return _abs_max(*_min_max(x2, 1, keepdim=True)).float()
    if g.block_rows is None and g.block_cols == 1:
        return _abs_max(*_min_max(x2, 0, keepdim=True)).float()
    br, bc = g.block_shape(rows, cols)
    out = torch.empty(g.scale_shape(rows, cols), dtype=torch.float32, device=x2.device)
    for r0, r1, h, c0, c1, w in _regions(rows, cols, br, bc):
        v = _block_view(x2, r0, r1, h, c0, c1, w)  # [nR, h, nC, w]
        if h == 1:
            a = _abs_max(*_min_max(v[:, 0], -1))
        elif w == 1:
            a = _abs_max(*_min_max(v[..., 0], 1))
        else:  # reduce along the rows of each block first (contiguous), then down the h rows
            a = _abs_max(*_min_max(v, -1)).amax(dim=1)
        out[r0 // br : r0 // br + (r1 - r0) // h, c0 // bc : c0 // bc + (c1 - c0) // w] = a
    return out


def packed_payload_shape(fmt: Format, rows: int, cols: int) -> tuple[int, int] | None:
    """The shape of a [rows, cols] payload whose 4-bit codes are packed two a byte (formats.pack_nibbles),
    or None where the format is not 4-bit or the width is odd."""
    return (rows, cols // 2) if fmt.bits == 4 and cols % 2 == 0 else None


def block_amax(x2: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """Per-block max |x| over the finite elements, on the scale grid (fp32)."""
    if torch.compiler.is_compiling():  # no data-dependent branch in a graph: always mask (same result)
        return _amax(torch.where(torch.isfinite(x2), x2, 0.0), granularity)
    amax = _amax(x2, granularity)
    if not bool(torch.isfinite(amax).all()):  # rare: recompute over finite elements only
        amax = _amax(torch.where(torch.isfinite(x2), x2, 0.0), granularity)
    return amax


def round_scale_up_to_power_of_two(scale: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= scale (exact, from the exponent bits), so no element saturates."""
    mant, exp = torch.frexp(scale)
    k = torch.where(mant == 0.5, exp - 1, exp)
    return pow2(k.clamp(-149, 127))


def compute_scale(
    amax: torch.Tensor | float, fmt: str | Format, margin: int = 0, power_of_two: bool = False
) -> torch.Tensor:
    """scale = amax / (fmt.max * 2**margin), guarded: amax 0, inf or NaN gives 1, never 0/inf/NaN."""
    fmt = get_format(fmt)
    amax = torch.as_tensor(amax, dtype=torch.float32)
    scale = amax.float() / (fmt.max * 2.0**margin)
    # amax 0, negative or NaN fails the first test; amax inf (or a scale that overflowed) the second.
    usable = (amax > 0) & (scale < math.inf)
    # Clamp before rounding to a power of two: a scale that underflowed to 0 must not become 2^0.
    scale = torch.where(usable, scale.clamp_(min=_FP32_TINY), 1.0)
    if power_of_two:
        scale = round_scale_up_to_power_of_two(scale)
    return scale


def compute_mx_scale(amax: torch.Tensor, fmt: Format, rounding: str = "floor") -> torch.Tensor:
    """OCP MX shared scale X = 2^(floor(log2 amax) - emax_elem), a float32 power of two.

    floor(log2 amax) comes from the exponent bits (frexp): torch.log2 in fp32 rounds values just below
    a power of two up to it and would give one too many. "rceil" instead takes the smallest power of
    two >= amax / fmt.max, so nothing saturates. "even" (torchao's, which compressed-tensors uses for
    MXFP4/MXFP6) first rounds amax to the element format's mantissa width (half up) and then takes
    floor: a block whose amax would round past the top binade's last value gets the next power.
    Block amax 1.75 gives E8M0 codes 125 / 126 / 126 (floor / rceil / even) in E2M1, 6.5 gives
    127 / 128 / 127. Exponents are clamped to E8M0's range [-127, 127]; an all-zero block gets
    2^-127 (code 0).
    """
    if rounding in ("floor", "even"):
        # floor(log2 amax) is the biased exponent field minus 127 for normal fp32 (cheaper than frexp). A
        # subnormal amax (field 0) reads as -127 instead of its true exponent (<= -127): after
        # subtracting emax_elem >= 2 both clamp to -127, so the scale is the same.
        bits = amax.float().contiguous().view(torch.int32)
        if rounding == "even":  # add half of the element's last mantissa place: a carry bumps the field
            bits = bits + (1 << (23 - fmt.mantissa_bits - 1))
        k = ((bits >> 23) & 0xFF) - 127 - fmt.emax
    else:
        ratio = amax.float() / fmt.max
        mant, exp = torch.frexp(ratio)
        k = torch.where(mant == 0.5, exp - 1, exp)
        k = torch.where(ratio > 0, k, torch.full_like(k, E8M0.emin))  # ratio underflowed: far below 2^-127
    k = torch.where(amax > 0, k, torch.full_like(k, E8M0.emin))
    return pow2(k.clamp(E8M0.emin, E8M0.emax))


def global_scale_from_amax(
    amax: torch.Tensor | float, fmt: str | Format, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """NVFP4's per-tensor global scale, E4M3.max * fmt.max / amax (448 * 6 / amax for E2M1), as a
    one-element fp32 tensor: the factor that maps the tensor's amax onto the top of the E4M3 block
    scales' range. dtype=None: one fp32 division. dtype given: compressed-tensors' arithmetic in that
    dtype (the weight's own): its `448 * 6 / amax` is torch's reverse division, amax.reciprocal() * 2688,
    each step rounded to dtype (bf16: 788.0 where fp32 gives 789.14; and 2688 / 0.08447265625 gives
    31744.0, not the correctly rounded 31872.0). amax 0, NaN or inf, or a scale that overflows, gives
    1.0 (compressed-tensors' fallback)."""
    fmt = get_format(fmt)
    amax = torch.as_tensor(amax, dtype=torch.float32).float().reshape(1)
    top = E4M3.max * fmt.max
    if dtype is None:
        g = top / amax.clamp(min=_FP32_TINY)
    else:  # fp32 arithmetic rounded to dtype after each op: what torch's bf16/fp16 CPU kernels do
        inverse = (1.0 / amax.to(dtype).float().clamp(min=torch.finfo(dtype).tiny)).to(dtype).float()
        g = (inverse * top).to(dtype).float()
    return torch.where(torch.isfinite(g) & (g > 0), g, torch.ones_like(g))


def e4m3_block_scale(
    amax: torch.Tensor, fmt: Format, global_scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """NVFP4 block scales in the global scale's units: E4M3(global * (amax / fmt.max)), as fp32 values.

    amax / fmt.max is rounded to `dtype` first (compressed-tensors computes it in the weight's dtype),
    the product is rounded to nearest-even E4M3 (saturating at 448), and a scale that rounds to 0 (an
    all-zero block, or one far below the tensor's amax) is stored as E4M3_ZERO_SCALE, so the
    dequantization multiplier scale / global is never 0."""
    per_block = (amax.float() / fmt.max).to(dtype).float()
    s = (per_block * global_scale.float().reshape(1, 1)).clamp_(max=E4M3.max)
    s = torch.where(torch.isfinite(s), s, torch.full_like(s, E4M3.max))
    s = s.to(E4M3.torch_dtype).float()
    return torch.where(s > 0, s, torch.full_like(s, E4M3_ZERO_SCALE))


def scale_from_amax(
    amax: torch.Tensor,
    fmt: Format,
    g: Granularity,
    margin: int = 0,
    power_of_two: bool = False,
    *,
    global_scale: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """THE amax -> scale rule of every quantize backend: OCP MX's for E8M0 scales (compute_mx_scale,
    margin and power_of_two do not apply); NVFP4's for E4M3 scales (e4m3_block_scale, in the units of
    `global_scale`, with amax / max rounded to `dtype` when g.scale_math is "input"); else
    amax / (fmt.max * 2^margin) (compute_scale)."""
    if g.scale_format == "e8m0":
        return compute_mx_scale(amax, fmt, g.mx_rounding)
    if g.scale_format == "e4m3":
        if global_scale is None:
            raise MixprecError("E4M3 block scales need the tensor's global scale")
        return e4m3_block_scale(amax, fmt, global_scale, dtype if g.scale_math == "input" else torch.float32)
    return compute_scale(amax, fmt, margin, power_of_two)


def check_scale(scale: torch.Tensor | float, grid: tuple[int, int], g: Granularity) -> torch.Tensor:
    """A given scale (delayed or static scaling) as fp32 on the scale grid: a number or one-element
    tensor for a [1, 1] grid, a flat vector for a one-row or one-column grid; MixprecError for another
    shape, or for a scale that is not finite and positive."""
    scale = torch.as_tensor(scale, dtype=torch.float32)
    if scale.numel() == 1 and grid == (1, 1):
        scale = scale.reshape(1, 1)
    elif tuple(scale.shape) == (grid[0] * grid[1],) and 1 in grid:
        scale = scale.reshape(grid)
    if tuple(scale.shape) != grid:
        raise MixprecError(
            f"a {g.name} scale for this tensor must have shape {grid}, got {tuple(scale.shape)}"
        )
    if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
        raise MixprecError("scales must be finite and positive")
    return scale.float()


def expand_scale(scale: torch.Tensor, g: Granularity, rows: int, cols: int) -> torch.Tensor:
    """THE scale expansion: the scale grid of a [rows, cols] tensor repeated to one scale per element
    (or kept broadcastable to it: [1, 1], [rows, 1], [1, cols]).

    Traced code divides by it instead of apply_blockwise's block views (one broadcast op, which
    torch.compile lowers well); the tiled backend applies it to one tile's part of the grid (tiles
    start on block boundaries).
    """
    br, bc = g.block_shape(rows, cols)
    if scale.shape[0] > 1 and br > 1:
        scale = scale.repeat_interleave(br, dim=0)[:rows]
    if scale.shape[1] > 1 and bc > 1:
        scale = scale.repeat_interleave(bc, dim=1)[:, :cols]
    return scale


def apply_blockwise(
    x2: torch.Tensor, scale: torch.Tensor, g: Granularity, op, out: torch.Tensor | None = None
) -> torch.Tensor:
    """op(x, scale) for op torch.div or torch.mul, with each block's scale broadcast over its elements
    (on block views, no expanded scale); returns a new [R, C] tensor, or writes into `out` (which may
    be x2 itself: in place)."""
    if op not in (torch.div, torch.mul):
        raise ValueError("apply_blockwise applies torch.div or torch.mul")
    rows, cols = x2.shape
    if (
        g.block_rows in (None, 1)
        and g.block_cols in (None, 1)
        and scale.shape in ((1, 1), (rows, 1), (1, cols))
    ):
        return op(x2, scale) if out is None else op(x2, scale, out=out)
    br, bc = g.block_shape(rows, cols)
    if out is None:
        out = torch.empty((rows, cols), dtype=torch.promote_types(x2.dtype, scale.dtype), device=x2.device)
    for r0, r1, h, c0, c1, w in _regions(rows, cols, br, bc):
        i, j = r0 // br, c0 // bc
        s = scale[i : i + (r1 - r0) // h, j : j + (c1 - c0) // w]
        block_out = _block_view(out, r0, r1, h, c0, c1, w)
        op(_block_view(x2, r0, r1, h, c0, c1, w), s[:, None, :, None], out=block_out)
    return out


@dataclass(frozen=True)
class QuantizedTensor:
    """Payload + scales + granularity; dequantize() is exact (payload * scale, in fp32).

    E4M3 (NVFP4) granularities carry a global scale: `scale` then holds the E4M3 block scales (as fp32
    values) in its units and the dequantization multiplier is scale / global_scale, computed in fp32
    (effective_scale), as compressed-tensors and vLLM compute it. Other granularities have none.
    """

    data: torch.Tensor  # torch float8 dtype, or uint8 codes for formats torch lacks; 2-D [R, C]
    scale: torch.Tensor  # fp32, shape granularity.scale_shape(R, C); powers of two for E8M0 scales
    fmt: Format
    granularity: Granularity
    shape: torch.Size  # the original shape
    global_scale: torch.Tensor | None = None  # fp32, one element; E4M3 scale formats only
    # 4-bit formats: data is uint8 [R, C / 2], two codes a byte (formats.pack_nibbles' layout), as a
    # quantize into a packed `out` writes it (streaming quantization: no byte-per-code copy)
    packed: bool = False

    def effective_scale(self) -> torch.Tensor:
        """The dequantization multiplier per block: scale, or scale / global_scale (fp32)."""
        if self.global_scale is None:
            return self.scale
        return self.scale / self.global_scale.float().reshape(1, 1)

    def codes(self) -> torch.Tensor:
        """The payload, one code (or float8 value) per element: data, unpacked where packed."""
        return unpack_nibbles(self.data) if self.packed else self.data

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        values = decode(self.codes(), self.fmt)
        out = apply_blockwise(values, self.effective_scale(), self.granularity, torch.mul)
        return out.reshape(self.shape).to(dtype)

    def scale_e4m3(self) -> torch.Tensor:
        """The E4M3 block scales as torch.float8_e4m3fn (exact: they are E4M3 values)."""
        if self.granularity.scale_format != "e4m3":
            raise MixprecError(f"{self.granularity.name} scales are not E4M3")
        return self.scale.to(E4M3.torch_dtype)

    def scale_e8m0(self) -> torch.Tensor:
        """E8M0 codes (uint8) of power-of-two scales."""
        if self.granularity.scale_format != "e8m0":
            raise MixprecError(f"{self.granularity.name} scales are fp32, not E8M0")
        return encode(self.scale, E8M0).view(torch.uint8)

    @property
    def nbytes(self) -> int:
        scale_bytes = self.scale.numel() * (4 if self.granularity.scale_format == "fp32" else 1)
        global_bytes = 0 if self.global_scale is None else 4
        return self.data.numel() * self.data.element_size() + scale_bytes + global_bytes


def as_transposed(q: QuantizedTensor, granularity: Granularity) -> QuantizedTensor:
    """The operand q.dataᵀ with `granularity` on the transposed view, from q quantized with
    granularity.transposed() on its own layout: a payload view, the scales transposed (no
    re-quantization; bit-identical to quantizing the transposed tensor)."""
    rows, cols = q.data.shape
    return QuantizedTensor(
        q.data.t(), dense(q.scale.t()), q.fmt, granularity, torch.Size((cols, rows)), q.global_scale
    )


def dense(t: torch.Tensor) -> torch.Tensor:
    """A row-major copy with canonical strides (contiguous() keeps odd strides of size-1 dims)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def quantization_snr_db(x: torch.Tensor, xq: torch.Tensor) -> float:
    """Signal-to-noise ratio of an approximation, in dB: 10 log10(sum x^2 / sum (x - xq)^2)."""
    x, xq = x.double(), xq.double()
    noise = (x - xq).pow(2).sum()
    if noise == 0:
        return math.inf
    return float(10 * torch.log10(x.pow(2).sum() / noise))


__all__ = [
    "E4M3_ZERO_SCALE",
    "MX_ROUNDINGS",
    "SCALE_FORMATS",
    "Granularity",
    "QuantizedTensor",
    "apply_blockwise",
    "as_2d",
    "as_transposed",
    "block_amax",
    "check_scale",
    "compute_mx_scale",
    "compute_scale",
    "dense",
    "e4m3_block_scale",
    "expand_scale",
    "global_scale_from_amax",
    "quantization_snr_db",
    "round_scale_up_to_power_of_two",
    "scale_from_amax",
]
