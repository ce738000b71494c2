"""CPU fast path for the sub-byte codes (FP4 E2M1, FP6): the encode. (The E2M1 decode's fast form is
formats.decode_e2m1_unscaled_into.)

The same codes as formats.saturating_codes bit for bit, with
fewer and cheaper passes, into buffers a caller reuses (the tiled quantizer's tiles):

- encode_codes_into: the saturating round-to-nearest-even of fp32 values into a format without inf/NaN,
  in int32 arithmetic on the fp32 bits. With |y| clamped to max (its bits: positive floats order as
  integers) and B the bits of its binade 2^max(floor(log2|y|), emin), M = B + (23 - m) << 23 is the bit
  pattern of binade * 2^(23 - m), whose fp32 spacing is the format's quantum binade * 2^-m; the fp32
  sum |y| + M is then rounded by the hardware to that quantum, ties to even, and k = bits(sum) - bits(M)
  = |y| / quantum rounded, in [0, 2^(m+1)]. The codes are consecutive integers in value order
  (formats.saturating_codes), so code = (binade's exponent - emin) * 2^m + k, a carry k = 2^(m+1)
  landing on the next binade's first code; the sign is bit 31 moved to the code's top bit. 12 integer
  passes instead of saturating_codes' float division, float -> int conversion and ~15 passes.

NaN is not checked here (it gives some code, as saturating_codes): callers refuse it first.
"""

from __future__ import annotations

import torch

from mixprec.formats import Format

_ABS_MASK = 0x7FFFFFFF
_EXP_MASK = 0x7F800000


def _float_bits(v: float) -> int:
    return int(torch.tensor(v, dtype=torch.float32).view(torch.int32))


def encode_codes_into(y: torch.Tensor, fmt: Format, out: torch.Tensor, scratch: tuple[torch.Tensor, ...]) -> torch.Tensor:  # fmt: skip
    """out (uint8, y's shape) = formats.saturating_codes(y, fmt) for contiguous fp32 y (left unchanged).
    scratch: three int32 tensors of at least y.numel() elements (reused)."""
    n = y.numel()
    bits = y.view(torch.int32).reshape(-1)
    a, b, s = (t.view(-1)[:n] for t in scratch[:3])
    m = fmt.mantissa_bits
    torch.bitwise_and(bits, _ABS_MASK, out=a).clamp_(max=_float_bits(fmt.max))  # |y| clamped, as bits
    torch.bitwise_and(a, _EXP_MASK, out=b).clamp_(min=_float_bits(fmt.min_normal))  # binade bits B
    torch.add(b, (23 - m) << 23, out=s)  # M
    s.view(torch.float32).add_(a.view(torch.float32))  # |y| + M, rounded to the quantum (ties to even)
    s.sub_(b)  # k
    s.add_(b.bitwise_right_shift_(23 - m))  # + (binade exponent + 127) * 2^m
    s.sub_((127 + fmt.emin) << m)
    torch.bitwise_right_shift(bits, 31 - (fmt.bits - 1), out=b)  # the sign bit at the code's top bit
    s.bitwise_or_(b.bitwise_and_(1 << (fmt.bits - 1)))
    return out.view(-1).copy_(s).view(out.shape)


__all__ = ["encode_codes_into"]
