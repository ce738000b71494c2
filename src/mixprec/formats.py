"""Number formats from their bit layouts, and exact rounding into them.

Every figure of a format (max, min normal, min subnormal, epsilon, dynamic range) is derived from
(exponent bits, mantissa bits, bias, which codes are special); nothing is typed in.

Rounding is round-to-nearest, ties-to-even, with subnormals and signed zeros kept. Overflow is decided
as if the exponent range were unbounded above: a value overflows when it rounds to something larger
than the format's max (for E4M3 that makes 464 round to 448, a tie towards the even code, and anything
above 464 overflow). mixprec never relies on torch's own overflow behaviour, which changed between
torch 2.11 (E4M3 overflow -> NaN) and 2.12 (saturation): it clamps or maps explicitly, then uses
torch's cast only for values that are in range, where all torch versions agree bit for bit.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from functools import cache

import torch

from mixprec.errors import MixprecError

# How a format spends its top codes:
#   "ieee": the all-ones exponent holds +-inf (mantissa 0) and NaNs (mantissa != 0)   FP32 BF16 FP16 E5M2
#   "fn":   no infinities; only S.1111.111 (all-ones exponent and mantissa) is NaN    E4M3 ("fn" = finite)
#   "none": every code is a finite number: no inf, no NaN, so casts always saturate   FP6, FP4
#   "e8m0": unsigned exponent-only scale format of OCP MX: 0xFF is NaN, no zero, no sign
SPECIAL_KINDS = ("ieee", "fn", "none", "e8m0")


@dataclass(frozen=True)
class Format:
    """A binary floating-point format described by its bit layout."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    special: str
    signed: bool = True
    torch_dtype: torch.dtype | None = None
    aliases: tuple[str, ...] = ()
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.special not in SPECIAL_KINDS:
            raise ValueError(f"unknown special-value kind {self.special!r}")

    @property
    def bits(self) -> int:
        return int(self.signed) + self.exponent_bits + self.mantissa_bits

    @property
    def has_inf(self) -> bool:
        return self.special == "ieee"

    @property
    def has_nan(self) -> bool:
        return self.special != "none"

    @property
    def has_zero(self) -> bool:
        return self.special != "e8m0"

    @property
    def has_subnormals(self) -> bool:
        return self.mantissa_bits > 0 and self.special != "e8m0"

    @property
    def saturates_always(self) -> bool:
        """Formats with no inf and no NaN cannot express overflow, so every cast into them saturates."""
        return self.special == "none"

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number (E8M0 has no subnormals: code 0 is 2^-bias)."""
        return -self.bias if self.special == "e8m0" else 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite number."""
        top_field = 2**self.exponent_bits - 1
        if self.special == "ieee":
            top_field -= 1  # the all-ones exponent is reserved for inf/NaN
        elif self.special == "e8m0":
            top_field -= 1  # 0xFF is NaN
        return top_field - self.bias

    @property
    def max_mantissa_code(self) -> int:
        """Mantissa field of the largest finite number (in "fn" formats S.1111.111 is NaN)."""
        code = 2**self.mantissa_bits - 1
        return code - 1 if self.special == "fn" else code

    @property
    def max(self) -> float:
        return math.ldexp(1.0 + self.max_mantissa_code / 2**self.mantissa_bits, self.emax)

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value (the smallest normal where the format has no subnormals)."""
        if not self.has_subnormals:
            return self.min_normal
        return math.ldexp(1.0, self.emin - self.mantissa_bits)

    @property
    def epsilon(self) -> float:
        """Distance from 1.0 to the next larger value."""
        return math.ldexp(1.0, -self.mantissa_bits) if self.mantissa_bits else 1.0

    @property
    def decades(self) -> float:
        """Dynamic range in decades, log10(max / smallest positive value)."""
        return math.log10(self.max / self.min_subnormal)

    @property
    def overflow_threshold(self) -> float:
        """Smallest magnitude that rounds past max (ties at the threshold go to the even neighbour)."""
        return self.max + math.ldexp(1.0, self.emax - self.mantissa_bits - 1)

    @property
    def threshold_tie_overflows(self) -> bool:
        """At exactly the threshold, RNE picks the even mantissa: max's own when its code is even."""
        return self.max_mantissa_code % 2 == 1

    def summary(self) -> dict:
        """Every figure of the format, as plain Python values (for `mixprec formats --json`)."""
        return {
            "name": self.name,
            "bits": self.bits,
            "layout": f"{'S.' if self.signed else ''}E{self.exponent_bits}M{self.mantissa_bits}",
            "bias": self.bias,
            "max": self.max,
            "min_normal": self.min_normal,
            "min_subnormal": self.min_subnormal if self.has_subnormals else None,
            "epsilon": self.epsilon,
            "decades": round(self.decades, 3),
            "has_inf": self.has_inf,
            "has_nan": self.has_nan,
            "has_zero": self.has_zero,
            "torch_dtype": str(self.torch_dtype).replace("torch.", "") if self.torch_dtype else None,
            "aliases": list(self.aliases),
            "description": self.description,
        }


def _dtype(name: str) -> torch.dtype | None:
    return getattr(torch, name, None)


FP32 = Format("fp32", 8, 23, 127, "ieee", torch_dtype=torch.float32,
              aliases=("float32", "float"), description="IEEE single precision")  # fmt: skip
TF32 = Format("tf32", 8, 10, 127, "ieee", aliases=("tensorfloat32",),
              description="NVIDIA TensorFloat-32: FP32 range, FP16 precision; a GEMM input mode")  # fmt: skip
BF16 = Format("bf16", 8, 7, 127, "ieee", torch_dtype=torch.bfloat16, aliases=("bfloat16",),
              description="brain float: FP32 range, 8-bit significand")  # fmt: skip
FP16 = Format("fp16", 5, 10, 15, "ieee", torch_dtype=torch.float16, aliases=("float16", "half"),
              description="IEEE half precision")  # fmt: skip
E4M3 = Format("e4m3", 4, 3, 7, "fn", torch_dtype=_dtype("float8_e4m3fn"),
              aliases=("float8_e4m3fn", "fp8_e4m3", "fp8_e4m3fn", "fp8-e4m3", "e4m3fn"),
              description="FP8 for weights and activations (OCP 'fn': no inf)")  # fmt: skip
E5M2 = Format("e5m2", 5, 2, 15, "ieee", torch_dtype=_dtype("float8_e5m2"),
              aliases=("float8_e5m2", "fp8_e5m2", "fp8-e5m2"),
              description="FP8 for gradients (IEEE-like)")  # fmt: skip
E8M0 = Format("e8m0", 8, 0, 127, "e8m0", signed=False, torch_dtype=_dtype("float8_e8m0fnu"),
              aliases=("float8_e8m0fnu", "e8m0fnu"),
              description="OCP MX shared scale: unsigned powers of two")  # fmt: skip
E3M2 = Format("e3m2", 3, 2, 3, "none", aliases=("fp6_e3m2", "float6_e3m2fn"),
              description="OCP MX FP6")  # fmt: skip
E2M3 = Format("e2m3", 2, 3, 1, "none", aliases=("fp6_e2m3", "float6_e2m3fn"),
              description="OCP MX FP6")  # fmt: skip
E2M1 = Format("e2m1", 2, 1, 1, "none", aliases=("fp4", "fp4_e2m1", "float4_e2m1fn"),
              description="OCP MX FP4")  # fmt: skip

FORMATS: dict[str, Format] = {f.name: f for f in (FP32, TF32, BF16, FP16, E4M3, E5M2, E8M0, E3M2, E2M3, E2M1)}
_BY_ALIAS: dict[str, Format] = {a: f for f in FORMATS.values() for a in (f.name, *f.aliases)}


def get_format(fmt: str | Format) -> Format:
    """Look a format up by name or alias (case-insensitive); a Format passes through."""
    if isinstance(fmt, Format):
        return fmt
    if not isinstance(fmt, str):
        raise MixprecError(f"a number format must be a name or a Format, got {type(fmt).__name__}")
    key = fmt.strip().lower()
    if key not in _BY_ALIAS:
        raise MixprecError(f"unknown number format {fmt!r}; known: {', '.join(FORMATS)}")
    return _BY_ALIAS[key]


def check_float_tensor(x: object, what: str = "input") -> torch.Tensor:
    """Reject what is not a floating-point tensor, naming it."""
    if not isinstance(x, torch.Tensor):
        raise MixprecError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype.itemsize == 1:
        raise MixprecError(f"{what} must be a floating-point tensor (fp32/bf16/fp16/fp64), got {x.dtype}")
    return x


def raise_if(flag: torch.Tensor, message: str) -> None:
    """MixprecError(message) where the one-element bool tensor `flag` is true. In eager mode a Python
    check (it reads the value). Under torch.compile reading a value is a graph break, so there the
    check is an assertion inside the graph (torch._assert_async, what Dynamo makes of `assert tensor`):
    the compiled code raises RuntimeError with the same message when it runs on such an input."""
    if torch.compiler.is_compiling():
        torch._assert_async(flag.logical_not(), message)
    elif bool(flag):
        raise MixprecError(message)


# ---------------------------------------------------------------------------------------------------
# Exact rounding


def pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k as float32 for integer k in [-149, 127], built from the bits (exact, subnormals included)."""
    # 2^k = 2^(k - k//2) * 2^(k//2): both halves are normal fp32 powers of two (exponents in [-75, 64]),
    # their product is exact; shifts by a constant and one multiply vectorize (a variable shift did not).
    k = k.to(torch.int32)
    low = torch.div(k, 2, rounding_mode="floor")
    high = k - low
    return ((low + 127) << 23).view(torch.float32) * ((high + 127) << 23).view(torch.float32)


def round_to_grid(
    ax: torch.Tensor, fmt: Format, *, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """THE round-to-nearest-even step of mixprec's torch code: non-negative fp32 (or fp64) magnitudes
    rounded onto fmt's grid, exponent unbounded above, as (significand, binade): the rounded value is
    significand * binade exactly, the significand a multiple of 2^-m in [0, 2], binade a power of two.

    binade = 2^max(e, emin) with e = floor(log2 |x|), read from the exponent bits (zero and fp32
    subnormals read as 0 and are raised to the smallest normal). Dividing by it (exact) puts the value
    in [0, 2); adding 2^(P - m), with P the working type's mantissa width, makes the hardware round
    exactly at the quantum 2^-m, with ties to even because 2^(P - m) is an even multiple of it;
    subtracting it back is exact. inplace=True reuses `ax`'s storage (a temporary of the caller's, in
    eager code); inplace=False stays out of place, for code torch.compile traces. NaN and inf inputs
    give NaN (their binade is inf): callers clamp or mask first. The Triton quantize kernel
    (mixprec.kernels.triton_quant._fp8_code) has its own kernel-language copy of these lines.
    """
    if ax.dtype == torch.float64:
        itype, exp_mask, width = torch.int64, 0x7FF0000000000000, 52
    else:
        itype, exp_mask, width = torch.int32, 0x7F800000, 23
    binade = (ax.view(itype) & exp_mask).view(ax.dtype)
    magic = math.ldexp(1.0, width - fmt.mantissa_bits)
    if inplace:
        binade.clamp_(min=fmt.min_normal)
        return ax.div_(binade).add_(magic).sub_(magic), binade
    binade = binade.clamp(min=fmt.min_normal)
    return (ax / binade + magic) - magic, binade


def _round_magnitude(ax: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Finite non-negative values (fp32 or fp64) rounded to fmt's grid, exponent unbounded above."""
    significand, binade = round_to_grid(ax, fmt)
    return significand.mul_(binade)


def _cast_e8m0(x: torch.Tensor, saturate: bool) -> torch.Tensor:
    """E8M0 holds positive powers of two 2^-127..2^127 and NaN; no zero, no sign, no inf.

    Positive values round to the nearest power of two, in value; a tie (1.5 * 2^k) rounds up, as
    torch's own E8M0 cast and OCP MX scale conversion do. Values below 2^-127 go to 2^-127 (the
    nearest value the format has). Above 2^127 (after rounding) is overflow: 2^127 when saturating,
    NaN otherwise. Zero and negative values are outside the format: 2^-127 when saturating (the
    smallest value, as torch maps 0), NaN otherwise. NaN stays NaN.
    """
    xf = x.to(torch.float64)  # frexp in fp64 keeps fp32 subnormals' exponents exact
    mant, exp = torch.frexp(xf)
    k = (exp - 1) + (mant >= 0.75).to(exp.dtype)  # x in [2^(exp-1), 2^exp): nearest, ties up
    positive = xf > 0
    over = positive & ((k > E8M0.emax) | torch.isinf(xf))  # frexp(inf) has exponent 0: test inf itself
    k = torch.where(over, E8M0.emax, k).clamp(E8M0.emin, E8M0.emax)
    k = torch.where(positive, k, torch.full_like(k, E8M0.emin))
    y = pow2(k)
    invalid = torch.isnan(xf)
    if not saturate:
        invalid = invalid | over | ~positive
    return torch.where(invalid, torch.full_like(y, math.nan), y)


@cache
def torch_cast_saturates(dtype: torch.dtype) -> bool:
    """Whether this torch's CPU cast to `dtype` maps +-inf and overflow to +-max and keeps NaN: then
    clamping first is redundant (torch >= 2.12 for E4M3). Probed on the CPU, never assumed, so older
    torch stays correct; on other devices callers clamp explicitly."""
    fmax = torch.finfo(dtype).max
    probe = torch.tensor([math.inf, -math.inf, 1e30, -1e30, fmax * 1.5, math.nan])
    got = probe.to(dtype).float()
    want = torch.tensor([fmax, -fmax, fmax, -fmax, fmax, math.nan])
    return bool(torch.equal(got[:5], want[:5]) and torch.isnan(got[5]))


def _cast_native(x: torch.Tensor, fmt: Format, saturate: bool) -> torch.Tensor:
    """fp32 input, format torch has: clamp into range explicitly, then torch's cast (bit-exact in range)."""
    assert fmt.torch_dtype is not None
    if saturate:
        # the cast probe runs on the CPU: on other devices clamp explicitly (always correct)
        native_sat = x.device.type == "cpu" and torch_cast_saturates(fmt.torch_dtype)
        inside = x if native_sat else x.clamp(-fmt.max, fmt.max)
        return inside.to(fmt.torch_dtype).float()
    y = x.clamp(-fmt.max, fmt.max).to(fmt.torch_dtype).float()
    return _apply_overflow(x, y, fmt)


def _apply_overflow(x: torch.Tensor, y: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Non-saturating overflow: NaN for formats without inf, signed inf for IEEE-like ones."""
    ax = x.abs()
    over = ax > fmt.overflow_threshold
    if fmt.threshold_tie_overflows:
        over = over | (ax == fmt.overflow_threshold)
    if fmt.has_inf:
        overflow_value = torch.copysign(torch.full_like(y, math.inf), x)
    else:
        overflow_value = torch.full_like(y, math.nan)
    return torch.where(over, overflow_value, y)


_SIGN_BIT = -(2**31)  # 0x80000000 as an int32
E2M1_DECODE_FACTOR = 2.0**14  # decode_e2m1_unscaled_into's values times this are the E2M1 values


def round_saturating(x: torch.Tensor, fmt: Format, *, inplace: bool = False) -> torch.Tensor:
    """Saturating round-to-nearest-even of fp32 values into a format torch lacks, as fp32 (x untouched).

    Clamping |x| to max before rounding is exact (max is representable, and everything above it
    saturates to it); inf becomes max. NaN flows through: its binade is inf and NaN / inf is NaN.
    inplace: see round_to_grid (out of place, the sign is OR-ed in from the bits: torch.compile lowers
    that to vector code on the CPU).
    """
    ax = x.abs()
    ax = ax.clamp_(max=fmt.max) if inplace else ax.clamp(max=fmt.max)
    significand, binade = round_to_grid(ax, fmt, inplace=inplace)
    if inplace:
        return significand.mul_(binade).copysign_(x)
    rounded = significand * binade
    return (rounded.view(torch.int32) | (x.view(torch.int32) & _SIGN_BIT)).view(torch.float32)


def saturating_codes(y: torch.Tensor, fmt: Format, *, inplace: bool = False) -> torch.Tensor:
    """uint8 codes of the saturating round-to-nearest-even of fp32 y into a format without inf/NaN
    (FP6, FP4). NaN is not checked here (it gives some code): encode() refuses it, traced callers test
    isnan themselves. inplace: see round_to_grid.

    The codes of such a layout are consecutive integers in value order, so with 2^(f - bias) the
    binade of |y| clamped to the smallest normal (exponent field f >= 1) and s in [0, 2] the
    significand |y| / 2^(f - bias) rounded to m bits, code = (f - 1) * 2^m + s * 2^m: subnormals
    have f = 1 and s < 1, and a rounding carry to s = 2 lands on the next binade's first code.
    """
    m = fmt.mantissa_bits
    ax = y.abs()
    ax = ax.clamp_(max=fmt.max) if inplace else ax.clamp(max=fmt.max)
    significand, binade = round_to_grid(ax, fmt, inplace=inplace)
    # the sign from the bits: torch.signbit has no vectorized lowering in torch.compile's CPU code
    sign = (y.view(torch.int32) < 0).to(torch.int32)
    if inplace:
        sign.bitwise_left_shift_(fmt.exponent_bits + m)
        code = significand.mul_(2**m).to(torch.int32)
        field = (
            binade.view(torch.int32).bitwise_right_shift_(23).sub_(127 - fmt.bias + 1).bitwise_left_shift_(m)
        )
        return code.add_(field).bitwise_or_(sign).to(torch.uint8)
    field = ((binade.view(torch.int32) >> 23) - (127 - fmt.bias + 1)) << m
    sign = sign << (fmt.exponent_bits + m)
    return (((significand * float(2**m)).to(torch.int32) + field) | sign).to(torch.uint8)


def _round_to_codes(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """saturating_codes of fp32 x, refusing NaN (the format has no code for it)."""
    if x.numel():  # max propagates NaN: one read, no mask tensor
        raise_if(torch.isnan(x.max()), f"cannot encode NaN in {fmt.name}: the format has no NaN code")
    return saturating_codes(x, fmt, inplace=True)


def _cast_emulated(x: torch.Tensor, fmt: Format, saturate: bool) -> torch.Tensor:
    """Formats torch lacks (and fp64 inputs, to avoid double rounding through fp32)."""
    if x.dtype == torch.float32 and (saturate or fmt.saturates_always):
        return round_saturating(x, fmt, inplace=True)
    ax = x.abs()
    finite = torch.isfinite(x)
    rounded = _round_magnitude(torch.where(finite, ax, 0.0), fmt)
    if saturate or fmt.saturates_always:
        mag = torch.where(finite, rounded, ax).clamp(max=fmt.max)  # inf -> max, NaN stays NaN
        y = torch.copysign(mag, x)
    else:
        y = torch.copysign(torch.where(finite, rounded, ax), x)
        over = torch.where(finite, rounded, ax) > fmt.max
        if not fmt.has_inf:
            y = torch.where(over, math.nan, y)
        else:
            y = torch.where(over, torch.copysign(torch.full_like(y, math.inf), x), y)
    return y.float()


def cast_to_format(x: torch.Tensor, fmt: str | Format, saturate: bool = True) -> torch.Tensor:
    """Round x to the nearest value of `fmt` (ties to even) and return it as float32.

    saturate=True clamps finite out-of-range values and infinities to +-max (what FP8 training casts
    do). saturate=False follows the format's definition: overflow is NaN for E4M3 (no inf) and inf
    for E5M2/FP16/BF16/TF32. NaN stays NaN. FP6/FP4 have neither inf nor NaN and always saturate; a
    NaN input still comes back NaN in the float32 result (encode() refuses it). E8M0: see _cast_e8m0.
    Subnormals and signed zeros are kept. The input is never modified.
    """
    fmt = get_format(fmt)
    check_float_tensor(x, "x")
    if fmt.special == "e8m0":
        return _cast_e8m0(x, saturate)
    if fmt is FP32:
        xf = x.float()  # rounds fp64 once, IEEE overflow to inf; exact for bf16/fp16
        if saturate:
            return xf.clamp(-FP32.max, FP32.max)  # +-inf -> +-max as for every format; NaN stays
        return xf.clone() if xf is x else xf
    if x.dtype == torch.float64:
        return _cast_emulated(x, fmt, saturate)
    xf = x.float()
    if fmt.torch_dtype is not None:
        return _cast_native(xf, fmt, saturate)
    return _cast_emulated(xf, fmt, saturate)


# ---------------------------------------------------------------------------------------------------
# Encoding: representable float32 values <-> stored codes


def encode(y: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """Store representable values: a torch float8/16 tensor where torch has the dtype, else uint8 codes
    (one code per byte, layout sign|exponent|mantissa). Values are first rounded (saturating), so the
    result never depends on torch's overflow behaviour."""
    fmt = get_format(fmt)
    if fmt.bits < 8 and y.dtype != torch.float64:
        check_float_tensor(y, "values")
        return _round_to_codes(y.float(), fmt)  # rounds and encodes in one go
    y = cast_to_format(y, fmt, saturate=True)
    if fmt.torch_dtype is not None:
        return y.to(fmt.torch_dtype)
    if fmt is TF32:
        return y  # TF32 is a GEMM input mode; its values are stored in 32-bit words
    return values_to_codes(y, fmt)


def encode_inplace(y: torch.Tensor, fmt: Format, out: torch.Tensor | None = None) -> torch.Tensor:
    """encode() of fp32 values in a temporary the caller owns (the quantizers' scaled tensor): for
    torch's FP8 dtypes clamped in place (clamp keeps NaN; skipped where the CPU cast saturates by
    itself) and cast once, no fp32 detour; for the sub-byte formats rounded and encoded in one pass.
    `out`: a payload tensor of y's shape to write into (returned), else a new one."""
    if fmt.torch_dtype is not None and fmt.bits == 8:
        if y.device.type != "cpu" or not torch_cast_saturates(fmt.torch_dtype):
            y.clamp_(-fmt.max, fmt.max)
        return y.to(fmt.torch_dtype) if out is None else out.copy_(y)
    payload = encode(y, fmt)
    return payload if out is None else out.copy_(payload)


def values_to_codes(y: torch.Tensor, fmt: Format) -> torch.Tensor:
    """uint8 codes of float32 values already representable in a sub-byte format without NaN/inf."""
    return _round_to_codes(y.float(), fmt)  # representable values: the rounding is the identity


@cache
def _code_table(fmt: Format) -> torch.Tensor:
    return _codes_to_values(torch.arange(2**fmt.bits, dtype=torch.int64), fmt)


def codes_to_values(codes: torch.Tensor, fmt: Format) -> torch.Tensor:
    """float32 values of uint8 codes in a sub-byte format (all codes are finite numbers): a table lookup
    (E2M1 on the CPU: decode_e2m1_unscaled_into times 2^14, exact, ~5x faster than the int64 gather)."""
    if fmt is E2M1 and codes.device.type == "cpu" and codes.dtype == torch.uint8 and not torch.compiler.is_compiling():  # fmt: skip
        i16, out = torch.empty_like(codes, dtype=torch.int16), torch.empty_like(codes, dtype=torch.float32)
        return decode_e2m1_unscaled_into(codes, out, i16, torch.empty_like(i16)).mul_(E2M1_DECODE_FACTOR)
    table = _code_table(fmt) if codes.device.type == "cpu" else _code_table_on(fmt, codes.device)
    return table[(codes & (2**fmt.bits - 1)).to(torch.int32)]


@cache
def _code_table_on(fmt: Format, device: torch.device) -> torch.Tensor:
    """The lookup table on the codes' device (indexing a CPU table with CUDA codes fails)."""
    return _code_table(fmt).to(device)


def _codes_to_values(codes: torch.Tensor, fmt: Format) -> torch.Tensor:
    """The values of codes, from the bit layout (builds the lookup table)."""
    c = codes.to(torch.int64)
    m = fmt.mantissa_bits
    mant = (c & (2**m - 1)).to(torch.float64)
    exp_field = (c >> m) & (2**fmt.exponent_bits - 1)
    sign = (c >> (fmt.exponent_bits + m)) & 1
    normal = exp_field > 0
    e = torch.where(normal, exp_field - fmt.bias, torch.full_like(exp_field, fmt.emin)).to(torch.float64)
    significand = mant / 2**m + normal.to(torch.float64)
    mag = significand * torch.pow(2.0, e)
    return torch.where(sign.bool(), -mag, mag).float()


def decode(payload: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """float32 values of a payload made by encode() (or a float8 tensor from anywhere)."""
    fmt = get_format(fmt)
    if payload.dtype == torch.uint8 and fmt.torch_dtype is None:
        return codes_to_values(payload, fmt)
    if payload.dtype == torch.uint8 and fmt.torch_dtype is not None:
        payload = payload.view(fmt.torch_dtype)
    if fmt.name in ("e4m3", "e5m2"):
        values, factor = decode_unscaled(payload, fmt)
        return values.mul_(factor) if factor != 1.0 else values
    return payload.float()


def pack_nibbles(codes: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """4-bit codes (uint8, one per byte, last dim even) packed two per byte: element 2i in the low
    nibble, 2i+1 in the high one (the FP4 layout of compressed-tensors, ModelOpt and vLLM). out: a
    uint8 tensor of the packed shape to write into (a view of a larger buffer, say); returned."""
    if codes.dtype != torch.uint8 or codes.shape[-1] % 2:
        raise MixprecError(
            f"pack_nibbles takes uint8 codes with an even last dim, got {codes.dtype} {tuple(codes.shape)}"
        )
    if sys.byteorder == "little" and codes.is_contiguous():
        # a pair read as one int16 (element 2i in the low byte): half the elements, no strided pairs
        v = codes.view(torch.int16)
        packed = torch.bitwise_right_shift(v, 4).bitwise_and_(0xF0).bitwise_or_(v.bitwise_and(0x0F))
    else:
        pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
        packed = (pairs[..., 0] & 0x0F) | (pairs[..., 1] << 4)
    if out is None:
        return packed.to(torch.uint8)
    if out.dtype != torch.uint8 or out.shape != packed.shape:
        raise MixprecError(
            f"pack_nibbles: out must be uint8 {tuple(packed.shape)}, got {out.dtype} {tuple(out.shape)}"
        )
    return out.copy_(packed)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_nibbles: uint8 [..., n] -> 4-bit codes uint8 [..., 2n]."""
    if packed.dtype != torch.uint8:
        raise MixprecError(f"unpack_nibbles takes uint8, got {packed.dtype}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def decode_e2m1_unscaled_into(codes: torch.Tensor, out: torch.Tensor, i16: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """out (fp32) = E2M1 values of uint8 codes times 2^-14, exactly, via int16 scratch i16 and sign (all of
    codes' shape; the high nibble ignored): s.ee.m as the fp16 pattern s.000ee.m000000000 (bias 15 vs 1;
    0.5 is fp16's subnormal 2^-15, which the fp32 conversion keeps even with denormals flushed)."""
    i16.copy_(codes)
    torch.bitwise_and(i16, 8, out=sign).bitwise_left_shift_(12)
    i16.bitwise_and_(7).bitwise_left_shift_(9).bitwise_or_(sign)
    return out.copy_(i16.view(torch.float16))


_E4M3_NAN_MAGNITUDE = 0x7F  # S.1111.111: the only NaN codes of E4M3 ("fn": no infinities)


def decode_unscaled(payload: torch.Tensor, fmt: str | Format) -> tuple[torch.Tensor, float]:
    """(values, factor): fp32 values with values * factor == decode(payload) exactly (a power of two).

    On the CPU (eager) E4M3 and E5M2 payloads are decoded through fp16 bit patterns with vectorized
    integer ops: torch's float8 -> float32 cast is much slower on every CPU measured (AVX2 builds: 13 ms
    against 1.8 ms for 4M elements, 2 threads; AVX-512-BF16 EPYC, torch 2.13, idle: 2.9 ms against
    0.3 ms for 2M elements, the NaN check below included). E5M2 is the top byte of an fp16 (same bias, infinities and NaN included):
    shift left by 8, factor 1. E4M3 s.eeee.mmm shifted left by 7 as a sign-extended int16, with bit 14
    (a copy of the sign) cleared, is the fp16 s.0eeee.mmm0000000: the E4M3 value times 2^-8 (bias 15
    instead of 7, subnormals included), factor 2^8 — a GEMM that multiplies by scales anyway folds it
    into them. E4M3's NaN codes would come out as +-480 (not an E4M3 value): a payload holding one,
    which only a NaN input makes, is found by one byte reduction and decoded by torch's cast.
    Elsewhere (CUDA, under torch.compile, other formats) it is decode(payload), factor 1.
    """
    fmt = get_format(fmt)
    if payload.dtype == torch.uint8 and fmt.torch_dtype is not None:
        payload = payload.view(fmt.torch_dtype)
    fast = payload.device.type == "cpu" and not torch.compiler.is_compiling()
    if fast and fmt.name == "e5m2":
        bits = payload.view(torch.int8).to(torch.int16).bitwise_left_shift_(8)
        return bits.view(torch.float16).float(), 1.0
    if fast and fmt.name == "e4m3" and not _has_e4m3_nan(payload):
        out = torch.empty_like(payload, dtype=torch.float32)  # keeps a transposed view's layout
        decode_e4m3_unscaled_into(payload, torch.empty_like(payload, dtype=torch.int16), out)
        return out, 256.0
    if fmt.name in ("e4m3", "e5m2"):
        return payload.float(), 1.0
    return decode(payload, fmt), 1.0


def decode_e4m3_unscaled_into(payload: torch.Tensor, i16: torch.Tensor, out: torch.Tensor) -> None:
    """out = the E4M3 payload's values times 2^-8, exactly, through the int16 scratch `i16` (both of
    the payload's shape): the vectorized bit trick of decode_unscaled, into buffers a caller reuses.
    NaN codes are not decoded (callers check for them, or no NaN reaches them)."""
    i16.copy_(payload.view(torch.int8))  # sign-extended
    i16.bitwise_left_shift_(7).bitwise_and_(-16385)  # -16385 is 0xBFFF as an int16: clears bit 14
    out.copy_(i16.view(torch.float16))


def _has_e4m3_nan(payload: torch.Tensor) -> bool:
    codes = payload.view(torch.int8)
    return bool(codes.numel()) and int(codes.bitwise_and(_E4M3_NAN_MAGNITUDE).amax()) == 0x7F
