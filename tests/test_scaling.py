"""mixprec.scaling: the amax -> scale rules against tests/reference.py, the scale grid (given scales,
expansion, transposition) and Granularity's checks."""

from __future__ import annotations

import math

import pytest
import torch

import reference as ref
from mixprec.errors import MixprecError
from mixprec.formats import E2M1, E4M3, E5M2
from mixprec.quantization import quantize
from mixprec.scaling import (
    Granularity,
    apply_blockwise,
    as_transposed,
    check_scale,
    compute_mx_scale,
    compute_scale,
    expand_scale,
    scale_from_amax,
)


def test_compute_scale_rules():
    assert compute_scale(448.0, E4M3).item() == 1.0
    assert compute_scale(448.0, "e4m3", margin=1).item() == 0.5
    assert compute_scale(100.0, E4M3, power_of_two=True).item() == 0.25  # smallest 2^k >= 100/448
    assert compute_scale(112.0, E4M3, power_of_two=True).item() == 0.25  # exact power stays
    amax = torch.tensor([[0.0], [math.inf], [math.nan], [-1.0], [1e-45], [3.4e38]])
    for kw in ({}, {"power_of_two": True}, {"margin": 3}, {"margin": -100}):
        s = compute_scale(amax, E2M1, **kw)
        assert s.shape == amax.shape and s.dtype == torch.float32
        assert bool(torch.isfinite(s).all() and (s > 0).all()), kw
        assert s[:4].eq(1.0).all()
        want = [
            ref.ref_scale(a, E2M1, kw.get("margin", 0), kw.get("power_of_two", False))
            for a in amax.view(-1).tolist()
        ]
        assert ref.bits_equal(s.view(-1), torch.tensor(want, dtype=torch.float64).float()), kw


def test_mx_floor_uses_exponent_bits_not_log2():
    """Just below a power of two, fp32 log2 rounds up to the integer: floor would be one too high."""
    amax = ref.next_down(2.0**10)
    assert math.floor(torch.log2(torch.tensor(amax)).item()) == 10  # the trap
    x = torch.full((1, 32), 1.0)
    x[0, 7] = amax
    q = quantize(x, E4M3, Granularity.mx(32))
    assert q.scale.item() == 2.0 ** (9 - 8)  # floor(log2 amax) = 9, emax(E4M3) = 8
    assert compute_mx_scale(torch.tensor([amax]), E4M3).item() == 2.0
    assert compute_mx_scale(torch.tensor([amax]), E4M3, "rceil").item() == 4.0  # 1023.99/448 -> 2^2
    assert compute_mx_scale(torch.tensor([2.0**-149, 0.0]), E4M3, "rceil").tolist() == [2.0**-127] * 2
    assert compute_mx_scale(torch.tensor([2.0**-149]), E4M3).item() == 2.0**-127


def test_scale_from_amax_is_the_rule_of_each_granularity():
    amax = torch.tensor([[0.0, 3.0, 1e-30, 448.0, math.inf]])
    for fmt in (E4M3, E5M2, E2M1):
        for kw in ({}, {"margin": 2, "power_of_two": True}):
            got = scale_from_amax(amax, fmt, Granularity.rows(), **kw)
            assert torch.equal(got, compute_scale(amax, fmt, **kw))
        for rounding in ("floor", "rceil"):
            got = scale_from_amax(
                amax, fmt, Granularity.mx(32, rounding=rounding), margin=5, power_of_two=True
            )
            assert torch.equal(got, compute_mx_scale(amax, fmt, rounding))  # MX ignores margin / pow2


def test_check_scale_puts_given_scales_on_the_grid():
    g = Granularity.rows()
    assert check_scale(0.5, (1, 1), Granularity.tensor()).shape == (1, 1)
    assert check_scale(torch.tensor([0.5]), (1, 1), Granularity.tensor()).dtype == torch.float32
    assert check_scale(torch.ones(6, dtype=torch.float64), (6, 1), g).shape == (6, 1)
    assert check_scale(torch.ones(4), (1, 4), Granularity.columns()).shape == (1, 4)
    with pytest.raises(MixprecError, match=r"row scale .* shape \(6, 1\), got \(7, 1\)"):
        check_scale(torch.ones(7, 1), (6, 1), g)
    with pytest.raises(MixprecError, match="shape"):
        check_scale(torch.ones(6), (2, 3), Granularity.blocks(4, 4))  # flat only for one row / column
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(MixprecError, match="finite and positive"):
            check_scale(torch.full((6, 1), bad), (6, 1), g)


@pytest.mark.parametrize(
    "g",
    [
        Granularity.tensor(),
        Granularity.rows(),
        Granularity.columns(),
        Granularity.blocks(1, 128),
        Granularity.blocks(128, 1),
        Granularity.blocks(3, 5),
        Granularity.mx(32, axis=0),
    ],
    ids=lambda g: g.name,
)
def test_expand_scale_gives_each_element_its_block_scale(g):
    rows, cols = 130, 261
    grid = g.scale_shape(rows, cols)
    scale = torch.arange(1, grid[0] * grid[1] + 1, dtype=torch.float32).reshape(grid)
    got = expand_scale(scale, g, rows, cols).expand(rows, cols)
    want = torch.empty(rows, cols)
    br, bc = g.block_shape(rows, cols)
    for i in range(rows):
        for j in range(0, cols, 7):  # every 7th column: the block index, read independently
            want[i, j] = scale[i // br, j // bc]
    assert torch.equal(got[:, ::7], want[:, ::7])
    # and dividing by it is apply_blockwise's division, bit for bit
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x / expand_scale(scale, g, rows, cols), apply_blockwise(x, scale, g, torch.div))
    with pytest.raises(ValueError, match=r"torch\.div or torch\.mul"):
        apply_blockwise(x, scale, g, torch.add)


def test_as_transposed_re_views_the_payload():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    g = Granularity.blocks(1, 32)
    q = as_transposed(quantize(x, E4M3, g.transposed()), g)
    want = quantize(x.t().contiguous(), E4M3, g)
    assert q.shape == (256, 64) and q.granularity == g and q.scale.is_contiguous()
    assert torch.equal(q.data.contiguous().view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(q.scale, want.scale)


def test_granularity_checks_name_the_problem():
    for bad in (0, -1, 1.5, "128"):
        with pytest.raises(MixprecError, match="block sides"):
            Granularity.blocks(bad, 128)
        with pytest.raises(MixprecError, match="block sides"):
            Granularity(1, bad)
    with pytest.raises(MixprecError, match="axis"):
        Granularity.mx(32, axis=2)
    with pytest.raises(MixprecError, match="scale_format"):
        Granularity(1, 32, "e5m2")
    with pytest.raises(MixprecError, match="mx_rounding"):
        Granularity.mx(32, rounding="nearest")


@pytest.mark.parametrize(
    ("fmt", "granularity", "want"),
    [
        (E2M1, Granularity.nvfp4(), 16 / 15 * (1 + 2**-7)),
        (E2M1, Granularity.mx(32), 8 / 6),
        (E2M1, Granularity.mx(32, rounding="even"), 7 / 6),
        (E2M1, Granularity.mx(32, rounding="rceil"), 1.0),
        (E4M3, Granularity.mx(32), 512 / 448),
        (E4M3, Granularity.rows(), 1.0),
    ],
)
def test_clip_headroom_bounds_what_the_scale_rule_clips_and_is_reached(fmt, granularity, want):
    """Quantizing blocks whose maxima sweep many binades: the largest |x / scale| the scale rule leaves
    is within fmt.max * clip_headroom, and comes close to it (the bound is the rule's, not slack)."""
    assert granularity.clip_headroom(fmt) == pytest.approx(want, rel=1e-12)
    g = torch.Generator().manual_seed(0)
    rows = 4096
    # one block per row (K = 32): the first element of each row is its block maximum, spread over
    # 2^-6 .. 2^6 with every mantissa; the others below it
    top = torch.exp2(torch.rand(rows, 1, generator=g) * 12 - 6)
    x = torch.cat([top, top * torch.rand(rows, 31, generator=g) * 0.99], dim=1)
    q = quantize(x, fmt, granularity)
    ratio = float((x.abs() / expand_scale(q.effective_scale(), q.granularity, *x.shape)).max()) / fmt.max
    assert ratio <= granularity.clip_headroom(fmt) * (1 + 2**-22)  # fp32 scales: x / (amax / max) rounds
    assert ratio >= (granularity.clip_headroom(fmt) - 1) * 0.7 + 0.999
