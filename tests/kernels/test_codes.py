"""The CPU fast paths for sub-byte codes (kernels.codes) against mixprec.formats' own code, bit for bit:
the integer encode against saturating_codes on a sweep of fp32 bit patterns plus every grid value,
midpoint (tie) and their neighbours, signed zeros, fp32 subnormals, max, beyond max and infinities;
the E2M1 decode (and codes_to_values, which uses it) against the value list for every byte; nibble packing against the plain pairs."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.formats import (
    E2M1,
    E2M1_DECODE_FACTOR,
    codes_to_values,
    decode_e2m1_unscaled_into,
    get_format,
    pack_nibbles,
    saturating_codes,
)
from mixprec.kernels.codes import encode_codes_into

E2M1_TABLE = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 32) * torch.tensor(
    [1.0] * 8 + [-1.0] * 8
).repeat(16)


def _inputs(fmt) -> torch.Tensor:
    sweep = (
        torch.arange(-(2**31), 2**31 - 1, 2**13 + 1, dtype=torch.int64).to(torch.int32).view(torch.float32)
    )
    grid = codes_to_values(torch.arange(2**fmt.bits).to(torch.uint8), fmt).unique()
    ties = (grid[:-1] + grid[1:]) / 2
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, -3e-39, fmt.max, fmt.overflow_threshold,
                            fmt.max * 4, 1e38, math.inf, -math.inf])  # fmt: skip
    base = torch.cat([grid, ties, special])
    up, down = (torch.nextafter(base, torch.tensor(d)) for d in (math.inf, -math.inf))
    near = torch.cat([base, up, down])
    x = torch.cat([sweep, near, -near, near * 2**-3, near * 2**3])
    return x[~x.isnan()].contiguous()


@pytest.mark.parametrize("name", ["e2m1", "e3m2", "e2m3"])
def test_integer_encode_is_saturating_codes_bit_for_bit(name):
    fmt = get_format(name)
    x = _inputs(fmt)
    want = saturating_codes(x.clone(), fmt, inplace=True)
    scratch = tuple(torch.empty(x.numel() + 5, dtype=torch.int32) for _ in range(3))  # larger: sliced
    out = torch.empty(x.shape, dtype=torch.uint8)
    before = x.clone()
    got = encode_codes_into(x, fmt, out, scratch)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, want)
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))  # the input is read only


@pytest.mark.parametrize("flush_denormal", [False, True])
def test_e2m1_decode_is_the_table_for_every_byte(flush_denormal):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16)
    out = torch.empty(16, 16)
    torch.set_flush_denormal(flush_denormal)  # fp16's subnormal 0.5 * 2^-14 must survive it
    try:
        decode_e2m1_unscaled_into(codes, out, torch.empty(16, 16, dtype=torch.int16), torch.empty(16, 16, dtype=torch.int16))  # fmt: skip
    finally:
        torch.set_flush_denormal(False)
    want = E2M1_TABLE[codes.long()]
    assert torch.equal(codes_to_values(codes, E2M1).view(torch.int32), want.view(torch.int32))
    assert torch.equal((out * E2M1_DECODE_FACTOR).view(torch.int32), want.view(torch.int32))


def test_pack_nibbles_is_the_plain_pairs():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (7, 34), generator=g, dtype=torch.int64).to(torch.uint8)
    for c in (codes, codes[:, :16], codes.t().contiguous().t()[:, :8]):  # contiguous, a slice, strided
        pairs = c.reshape(c.shape[0], -1, 2)
        want = (pairs[..., 0] & 0x0F) | (pairs[..., 1] << 4)
        assert torch.equal(pack_nibbles(c), want)
