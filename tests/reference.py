"""Slow, obvious reference quantizers: pure Python on floats and Fractions, one element at a time.

Nothing here reuses mixprec's arithmetic. A format is read only as its bit layout (exponent bits,
mantissa bits, bias, signedness, which codes are special); its values come from decoding every code,
and rounding is done by comparing exact distances (Fractions) to the neighbouring values, ties going to
the neighbour whose code is even. Every finite value of every format here, every midpoint between two
fp32 neighbours and every fp32 value is exactly a Python float (a double), so floats carry values and
Fractions carry arithmetic.

Rules implemented (the definitions in the issue / docs/formats.md):
- round to nearest, ties to even, subnormals and signed zeros kept; overflow is decided as if the
  exponent range were unbounded: a value overflows when it rounds above max (E4M3: 464 -> 448);
- saturate=True: overflow and +-inf -> +-max; saturate=False: NaN for "fn" formats (E4M3), +-inf for
  IEEE-like ones; formats without inf/NaN (FP6, FP4) always saturate; NaN stays NaN;
- E8M0: positive values to the nearest power of two (ties up), below 2^-127 -> 2^-127, overflow and +inf
  -> 2^127 (saturate) or NaN; zero and negative -> 2^-127 (saturate) or NaN; NaN -> NaN.
- quantize: scale = fp32(amax / (max * 2^margin)) (optionally rounded up to a power of two), payload =
  cast(fp32(x / scale)); MX: X = 2^(floor(log2 amax) - emax_elem) ("floor") or the smallest power of two
  >= fp32(amax / max) ("rceil"), exponent clamped to [-127, 127].
"""

from __future__ import annotations

import bisect
import math
import struct
from fractions import Fraction
from functools import cache

import torch

NAN = math.nan
INF = math.inf


# ---------------------------------------------------------------------------------------------------
# Decoding codes from the bit layout


def code_value(fmt, code: int) -> float:
    """The value of one code, read from the bit layout: sign | exponent | mantissa."""
    e_bits, m_bits, bias = fmt.exponent_bits, fmt.mantissa_bits, fmt.bias
    sign = (code >> (e_bits + m_bits)) & 1 if fmt.signed else 0
    e = (code >> m_bits) & (2**e_bits - 1)
    m = code & (2**m_bits - 1)
    all_ones_e, all_ones_m = 2**e_bits - 1, 2**m_bits - 1
    if fmt.special == "ieee" and e == all_ones_e:
        return (-INF if sign else INF) if m == 0 else NAN
    if fmt.special == "fn" and e == all_ones_e and m == all_ones_m:
        return NAN
    if fmt.special == "e8m0":
        return NAN if code == 0xFF else float(Fraction(2) ** (e - bias))
    if e == 0:  # subnormal: 0.m * 2^(1 - bias)
        mag = Fraction(m, 2**m_bits) * Fraction(2) ** (1 - bias)
    else:
        mag = (1 + Fraction(m, 2**m_bits)) * Fraction(2) ** (e - bias)
    return -float(mag) if sign else float(mag)


@cache
def nonnegative_values(fmt) -> tuple[tuple[Fraction, ...], tuple[int, ...]]:
    """Every finite non-negative value of a format of <= 8 bits, sorted, with its code."""
    assert fmt.bits <= 8
    pairs = []
    for code in range(2 ** (fmt.bits - int(fmt.signed))):  # sign bit 0
        v = code_value(fmt, code)
        if math.isfinite(v):
            pairs.append((Fraction(v), code))
    pairs.sort()
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def all_codes(fmt) -> list[int]:
    return list(range(2**fmt.bits))


@cache
def largest_code(fmt) -> int:
    """Code of the largest finite value, found by decoding (the reference derives nothing else)."""
    best = max(
        (c for c in range(2 ** (fmt.bits - int(fmt.signed))) if math.isfinite(code_value(fmt, c)))
        if fmt.bits <= 16
        else [_ieee_like_largest_code(fmt)],
        key=lambda c: code_value(fmt, c),
    )
    return best


def _ieee_like_largest_code(fmt) -> int:
    # fp32/tf32: too many codes to scan; the largest finite one is just below the all-ones exponent.
    assert fmt.special == "ieee"
    return ((2**fmt.exponent_bits - 2) << fmt.mantissa_bits) | (2**fmt.mantissa_bits - 1)


@cache
def ref_max(fmt) -> float:
    return code_value(fmt, largest_code(fmt))


@cache
def ref_min_positive(fmt) -> float:
    if fmt.bits <= 16:
        return min(
            v
            for c in range(2 ** (fmt.bits - int(fmt.signed)))
            if math.isfinite(v := code_value(fmt, c)) and v > 0
        )
    return code_value(fmt, 1)


# ---------------------------------------------------------------------------------------------------
# Rounding


def _overflow(fmt, negative: bool, saturate: bool) -> float:
    if saturate or fmt.special == "none":
        mag = ref_max(fmt)
    elif fmt.special == "ieee":
        mag = INF
    else:
        return NAN
    return -mag if negative else mag


def _virtual_next(fmt) -> Fraction:
    """The value one step above max if the exponent range went on (what overflow rounds to)."""
    top = Fraction(ref_max(fmt))
    e = math.floor(math.log2(top))  # max is far from a power of two boundary: exact enough here
    return top + Fraction(2) ** (e - fmt.mantissa_bits)


@cache
def _extended_values(fmt) -> tuple[tuple[Fraction, ...], tuple[int, ...]]:
    values, codes = nonnegative_values(fmt)
    return (*values, _virtual_next(fmt)), (*codes, codes[-1] + 1)


def round_by_comparison(x: float, fmt, saturate: bool = True) -> float:
    """Nearest value of a <= 8-bit format by comparing distances to its enumerated values."""
    if math.isnan(x):
        return NAN
    negative = math.copysign(1.0, x) < 0
    if math.isinf(x):
        return _overflow(fmt, negative, saturate)
    values, codes = _extended_values(fmt)
    mag = abs(Fraction(x))
    if mag > values[-1]:
        return _overflow(fmt, negative, saturate)
    hi = bisect.bisect_left(values, mag)
    if values[hi] == mag:
        pick = hi
    else:
        lo = hi - 1
        d_lo, d_hi = mag - values[lo], values[hi] - mag
        if d_lo != d_hi:
            pick = lo if d_lo < d_hi else hi
        else:
            pick = lo if codes[lo] % 2 == 0 else hi
    if pick == len(values) - 1:  # rounded onto the virtual value past max
        return _overflow(fmt, negative, saturate)
    v = float(values[pick])
    return -v if negative else v


def _floor_log2(q: Fraction) -> int:
    """floor(log2 q) for q > 0, exactly."""
    n, d = q.numerator, q.denominator
    e = n.bit_length() - d.bit_length()  # floor(log2 q) is e or e - 1
    if (n << max(-e, 0)) < (d << max(e, 0)):  # q < 2^e
        e -= 1
    return e


def round_by_quantum(x: float | Fraction, fmt, saturate: bool = True) -> float:
    """Nearest value of a wide IEEE-like format: count quanta 2^(e - mantissa_bits), ties to even count."""
    if isinstance(x, float):
        if math.isnan(x):
            return NAN
        if math.isinf(x):
            return _overflow(fmt, x < 0, saturate)
        negative = math.copysign(1.0, x) < 0
    else:
        negative = x < 0
    mag = abs(Fraction(x))
    if mag == 0:
        return -0.0 if negative else 0.0
    emin = 1 - fmt.bias
    e = max(_floor_log2(mag), emin)
    quantum = Fraction(2) ** (e - fmt.mantissa_bits)
    n = mag / quantum
    count = math.floor(n)
    rest = n - count
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and count % 2 == 1):
        count += 1
    result = count * quantum
    if result > Fraction(ref_max(fmt)):
        return _overflow(fmt, negative, saturate)
    v = float(result)
    return -v if negative else v


_E8M0_CANDIDATES = [Fraction(2) ** k for k in range(-127, 129)]  # 2^128: the virtual value past max


def round_e8m0(x: float, saturate: bool = True) -> float:
    """E8M0: powers of two 2^-127..2^127; nearest in value, ties to the larger."""
    if math.isnan(x):
        return NAN
    if x <= 0:  # zero (either sign), negative, -inf: outside the format
        return 2.0**-127 if saturate else NAN
    if math.isinf(x):
        return 2.0**127 if saturate else NAN
    mag = Fraction(x)
    candidates = _E8M0_CANDIDATES
    hi = bisect.bisect_left(candidates, mag)
    if hi == 0:
        pick = 0
    elif hi == len(candidates):
        pick = hi - 1
    elif candidates[hi] == mag:
        pick = hi
    else:
        d_lo, d_hi = mag - candidates[hi - 1], candidates[hi] - mag
        pick = hi - 1 if d_lo < d_hi else hi  # a tie goes up
    if pick == len(candidates) - 1:
        return 2.0**127 if saturate else NAN
    return float(candidates[pick])


def ref_cast(x: float, fmt, saturate: bool = True) -> float:
    """The reference cast of one value (a Python float; fp32 and fp64 inputs are both exact here)."""
    if fmt.special == "e8m0":
        return round_e8m0(x, saturate)
    if fmt.bits <= 8:
        return round_by_comparison(x, fmt, saturate)
    return round_by_quantum(x, fmt, saturate)


def ref_code(value: float, fmt) -> int:
    """The code of a representable value (for sub-byte encodings)."""
    values, codes = nonnegative_values(fmt)
    mag = abs(Fraction(value))
    code = codes[values.index(mag)]
    if math.copysign(1.0, value) < 0:
        code |= 1 << (fmt.exponent_bits + fmt.mantissa_bits)
    return code


# ---------------------------------------------------------------------------------------------------
# fp32 arithmetic (what the vectorized code does in float32)


def f32(q: float | Fraction) -> float:
    """Round a quotient of fp32 values to fp32 (IEEE: overflow to inf).

    float(Fraction) is correctly rounded to double, and the C double -> float conversion is RNE. For
    quotients of fp32 values (the only use here) that double rounding is innocuous (53 >= 2*24 + 2
    bits), so this equals exact rounding; tests/test_formats.py checks it against round_by_quantum.
    """
    d = float(q)
    try:
        return struct.unpack("<f", struct.pack("<f", d))[0]
    except OverflowError:
        return math.copysign(INF, d)


def f32_div(a: float, b: float) -> float:
    """fp32 division of two fp32 values, correctly rounded (inf / finite = inf)."""
    if math.isnan(a) or math.isnan(b):
        return NAN
    if math.isinf(a):
        return math.copysign(INF, a) * math.copysign(1.0, b)
    if a == 0:
        return math.copysign(0.0, a) * math.copysign(1.0, b)
    return f32(Fraction(a) / Fraction(b))


def next_up(x: float) -> float:
    """Next fp32 value above x."""
    return torch.nextafter(torch.tensor(x), torch.tensor(INF)).item()


def next_down(x: float) -> float:
    return torch.nextafter(torch.tensor(x), torch.tensor(-INF)).item()


# ---------------------------------------------------------------------------------------------------
# Scales and per-block quantization loops


def ref_scale(amax: float, fmt, margin: int = 0, power_of_two: bool = False) -> float:
    """scale = fp32(amax / (max * 2^margin)); amax 0, inf, NaN (or an unusable result) -> 1."""
    if not (math.isfinite(amax) and amax > 0):
        return 1.0
    s = f32(Fraction(amax) / (Fraction(ref_max(fmt)) * Fraction(2) ** margin))
    if not math.isfinite(s):
        return 1.0
    s = max(s, 2.0**-126)  # never below the smallest normal fp32 (never 0)
    if power_of_two:
        k = _floor_log2(Fraction(s))
        if Fraction(2) ** k < Fraction(s):
            k += 1
        s = 2.0**k
    return s


def ref_mx_scale(amax: float, fmt, rounding: str = "floor") -> float:
    """OCP MX shared scale, a power of two with exponent in [-127, 127]; all-zero block -> 2^-127."""
    emax_elem = _floor_log2(Fraction(ref_max(fmt)))
    if amax == 0:
        k = -127
    elif rounding == "floor":
        k = _floor_log2(Fraction(amax)) - emax_elem
    else:
        r = f32(Fraction(amax) / Fraction(ref_max(fmt)))
        if r == 0:
            k = -127
        else:
            k = _floor_log2(Fraction(r))
            if Fraction(2) ** k < Fraction(r):
                k += 1
    k = min(max(k, -127), 127)
    return 2.0**k


def ref_quantize(x: torch.Tensor, fmt, granularity, scale=None, margin: int = 0, power_of_two: bool = False):
    """(payload values [R][C] as floats, scales [nR][nC] as floats), by plain loops over elements."""
    x2 = x.reshape(1, 1) if x.dim() == 0 else x.reshape(-1, x.shape[-1])
    rows = x2.float().double().tolist()
    n_rows, n_cols = len(rows), len(rows[0])
    br = n_rows if granularity.block_rows is None else granularity.block_rows
    bc = n_cols if granularity.block_cols is None else granularity.block_cols
    grid = (-(-n_rows // br), -(-n_cols // bc))
    if scale is None:
        amax = [[0.0] * grid[1] for _ in range(grid[0])]
        for i in range(n_rows):
            for j in range(n_cols):
                v = rows[i][j]
                if math.isfinite(v):
                    amax[i // br][j // bc] = max(amax[i // br][j // bc], abs(v))
        if granularity.scale_format == "e8m0":
            scales = [[ref_mx_scale(a, fmt, granularity.mx_rounding) for a in r] for r in amax]
        else:
            scales = [[ref_scale(a, fmt, margin, power_of_two) for a in r] for r in amax]
    else:
        scales = torch.as_tensor(scale, dtype=torch.float32).reshape(grid).double().tolist()
    payload = [
        [ref_cast(f32_div(rows[i][j], scales[i // br][j // bc]), fmt, True) for j in range(n_cols)]
        for i in range(n_rows)
    ]
    return payload, scales


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical float32 tensors, any NaN matching any NaN."""
    a, b = a.float().contiguous(), b.float().contiguous()
    if a.shape != b.shape:
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    return torch.equal(a.view(torch.int32)[~nan_a], b.view(torch.int32)[~nan_b])
