"""The quantize entry (its eager backend: the reference torch code) against the reference loops of
tests/reference.py: payloads and scales bit for bit, error bounds and SNR, guards, given scales, bad input.
The other backends are held to the eager one bit for bit in tests/test_quantization_backends.py."""

from __future__ import annotations

import math

import pytest
import torch

import mixprec
import reference as ref
from mixprec.errors import MixprecError
from mixprec.formats import E2M1, E2M3, E3M2, E4M3, E5M2, decode
from mixprec.gemm import scaled_mm
from mixprec.quantization import (
    QuantizationStats,
    dequantize,
    fake_quantize,
    quantize,
    quantize_transposed,
    quantize_with_stats,
    round_scaled,
)
from mixprec.scaling import Granularity, QuantizedTensor, quantization_snr_db

pytestmark = pytest.mark.usefixtures("single_thread")

ELEMENT_FORMATS = [E4M3, E5M2, E3M2, E2M3, E2M1]
FMT_IDS = [f.name for f in ELEMENT_FORMATS]

# granularity, and small odd shapes (non-multiples of the block, 1-D, 3-D) to test it on
GRANULARITIES = {
    "tensor": (Granularity.tensor(), [(7, 13), (37,), (3, 5, 11)]),
    "rows": (Granularity.rows(), [(7, 13), (37,), (3, 5, 11)]),
    "columns": (Granularity.columns(), [(7, 13), (37,), (3, 5, 11)]),
    "1x128": (Granularity.blocks(1, 128), [(3, 300), (129,), (2, 2, 130)]),
    "128x1": (Granularity.blocks(128, 1), [(300, 3), (130,)]),
    "128x128": (Granularity.blocks(128, 128), [(130, 131)]),
    "3x5": (Granularity.blocks(3, 5), [(7, 13), (4, 2, 6)]),
    "mx32": (Granularity.mx(32), [(5, 70), (45,), (3, 2, 33)]),
    "mx32-rceil": (Granularity.mx(32, rounding="rceil"), [(5, 70), (45,)]),
    "mx32-axis0": (Granularity.mx(32, axis=0), [(70, 5), (2, 35, 3)]),
}


def _data(shape, seed: int, kind: str = "mixed") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "gaussian":
        return x
    if kind == "outliers":  # 1% of the elements 100x larger
        hot = torch.rand(shape, generator=g) < 0.01
        return torch.where(hot, x * 100, x)
    # mixed: block magnitudes over many decades, zeros, a zero row, tiny values
    x = x * torch.exp(torch.randn(shape, generator=g) * 3)
    flat = x.view(-1)
    flat[:: max(1, flat.numel() // 7)] = 0.0
    if x.dim() >= 2:
        x.reshape(-1, x.shape[-1])[1] = 0.0
    return x


def _expand(scale: torch.Tensor, g: Granularity, rows: int, cols: int) -> torch.Tensor:
    """Each element's scale, by repeating the grid (an independent way to read the block layout)."""
    br, bc = g.block_shape(rows, cols)
    return scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]


# ---------------------------------------------------------------------------------------------------
# Bit-exact against the reference loops


# 128x128 blocks put 17k elements through the slow reference: two formats suffice there (3x5 covers all
# five); the cases are left out rather than skipped, so a skip in CI always means something
REFERENCE_CASES = [
    pytest.param(fmt, gname, id=f"{fid}-{gname}")
    for gname in GRANULARITIES
    for fmt, fid in zip(ELEMENT_FORMATS, FMT_IDS)
    if gname != "128x128" or fmt in (E4M3, E2M1)
]


@pytest.mark.parametrize("fmt, gname", REFERENCE_CASES)
def test_quantize_matches_reference(fmt, gname):
    g, shapes = GRANULARITIES[gname]
    for i, shape in enumerate(shapes):
        x = _data(shape, seed=i)
        q = quantize(x, fmt, g)
        want_payload, want_scale = ref.ref_quantize(x, fmt, g)
        rows, cols = len(want_payload), len(want_payload[0])
        assert q.scale.shape == g.scale_shape(rows, cols) and q.scale.dtype == torch.float32
        assert ref.bits_equal(q.scale, torch.tensor(want_scale, dtype=torch.float64).float()), (shape, gname)
        assert q.data.shape == (rows, cols)
        assert q.data.dtype == (fmt.torch_dtype or torch.uint8)
        assert ref.bits_equal(decode(q.data, fmt), torch.tensor(want_payload).float()), (shape, gname)
        assert q.dequantize().shape == x.shape


@pytest.mark.parametrize(
    "kw", [{"margin": 2}, {"power_of_two": True}, {"margin": -1, "power_of_two": True}], ids=str
)
def test_quantize_margin_and_power_of_two_match_reference(kw):
    x = _data((9, 40), seed=3)
    for g in (Granularity.tensor(), Granularity.rows(), Granularity.blocks(4, 16)):
        q = quantize(x, E4M3, g, **kw)
        want_payload, want_scale = ref.ref_quantize(x, E4M3, g, **kw)
        assert ref.bits_equal(q.scale, torch.tensor(want_scale, dtype=torch.float64).float())
        assert ref.bits_equal(decode(q.data, E4M3), torch.tensor(want_payload).float())


def test_sub_byte_payload_codes_match_reference():
    x = _data((4, 64), seed=5)
    for fmt in (E3M2, E2M3, E2M1):
        q = quantize(x, fmt, Granularity.mx(32))
        payload, _ = ref.ref_quantize(x, fmt, Granularity.mx(32))
        codes = [[ref.ref_code(v, fmt) for v in row] for row in payload]
        assert torch.equal(q.data, torch.tensor(codes, dtype=torch.uint8))


def test_scale_e8m0_codes():
    x = _data((4, 96), seed=6)
    q = quantize(x, E4M3, Granularity.mx(32))
    exps = torch.frexp(q.scale)[1] - 1
    assert torch.equal(q.scale_e8m0(), (exps + 127).to(torch.uint8))
    with pytest.raises(MixprecError, match="not E8M0"):
        quantize(x, E4M3, Granularity.rows()).scale_e8m0()


# ---------------------------------------------------------------------------------------------------
# Error bound and SNR

# SNR in dB measured on the seeded data (gaussian, outliers); the test asserts >= measured - 1 dB.
SNR_MEASURED = {
    "e4m3": {
        "tensor": (31.5, 31.5),
        "rows": (31.6, 35.2),
        "columns": (31.7, 37.8),
        "1x128": (31.8, 38.2),
        "128x1": (31.9, 39.0),
        "128x128": (31.5, 31.7),
        "3x5": (33.1, 45.3),
        "mx32": (30.6, 27.6),
        "mx32-rceil": (31.4, 31.0),
        "mx32-axis0": (30.6, 27.5),
    },
    "e5m2": {
        "tensor": (25.6, 26.0),
        "rows": (25.6, 29.4),
        "columns": (25.7, 31.1),
        "1x128": (25.8, 32.1),
        "128x1": (25.8, 32.2),
        "128x128": (25.5, 26.1),
        "3x5": (27.0, 39.9),
        "mx32": (25.3, 24.3),
        "mx32-rceil": (25.5, 25.4),
        "mx32-axis0": (25.3, 24.3),
    },
    "e3m2": {
        "tensor": (25.6, 25.4),
        "rows": (25.6, 29.2),
        "columns": (25.7, 30.9),
        "1x128": (25.8, 31.9),
        "128x1": (25.8, 32.1),
        "128x128": (25.5, 25.6),
        "3x5": (27.0, 39.7),
        "mx32": (25.3, 24.3),
        "mx32-rceil": (25.5, 25.3),
        "mx32-axis0": (25.3, 24.2),
    },
    "e2m3": {
        "tensor": (30.6, 19.4),
        "rows": (31.2, 24.1),
        "columns": (31.5, 25.7),
        "1x128": (31.5, 27.0),
        "128x1": (31.6, 27.1),
        "128x128": (30.8, 19.7),
        "3x5": (33.0, 35.2),
        "mx32": (30.8, 27.3),
        "mx32-rceil": (30.9, 27.4),
        "mx32-axis0": (30.8, 27.3),
    },
    "e2m1": {
        "tensor": (18.1, 16.2),
        "rows": (19.0, 18.2),
        "columns": (19.2, 19.5),
        "1x128": (19.2, 20.5),
        "128x1": (19.3, 20.8),
        "128x128": (18.3, 16.4),
        "3x5": (20.5, 27.7),
        "mx32": (18.8, 17.0),
        "mx32-rceil": (18.7, 18.4),
        "mx32-axis0": (18.8, 16.9),
    },
}


def _half_ulp(xs: torch.Tensor, fmt) -> torch.Tensor:
    """Half the spacing of fmt's grid at |xs| (fp64), floored at the subnormal spacing."""
    mant, exp = torch.frexp(xs.abs())
    e = torch.where(mant > 0, exp - 1, torch.full_like(exp, fmt.emin)).clamp(min=fmt.emin)
    return torch.ldexp(torch.ones_like(xs), (e - fmt.mantissa_bits - 1).double())


@pytest.mark.parametrize("kind", ["gaussian", "outliers"])
@pytest.mark.parametrize("gname", list(GRANULARITIES))
@pytest.mark.parametrize("fmt", ELEMENT_FORMATS, ids=FMT_IDS)
def test_error_bound_and_snr(fmt, gname, kind):
    g, _ = GRANULARITIES[gname]
    x = _data((160, 320), seed=11, kind=kind)
    q = quantize(x, fmt, g)
    xq = dequantize(q)
    s = _expand(q.scale.double(), g, 160, 320)
    xs = x.double() / s
    saturated = (xs.abs() - fmt.max).clamp(min=0)
    bound = s * (_half_ulp(xs, fmt) + saturated + xs.abs() * 2.0**-23) + xq.double().abs() * 2.0**-23
    err = (x.double() - xq.double()).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    snr = quantization_snr_db(x, xq)
    print(f"SNR {fmt.name:5s} {gname:11s} {kind:9s} {snr:6.2f} dB")
    measured = SNR_MEASURED[fmt.name][gname][kind == "outliers"]
    assert snr >= measured - 1.0


# ---------------------------------------------------------------------------------------------------
# Scales are never 0, inf or NaN


def _hostile(shape=(40, 70)) -> torch.Tensor:
    """All-zero blocks, blocks with inf / NaN, subnormal-only blocks, fp32-max elements."""
    x = _data(shape, seed=9)
    x[:, :32] = 0.0  # zero blocks for every blocking
    x[0:2, 40] = math.inf
    x[3, 41] = -math.inf
    x[5, 45] = math.nan
    x[8:, 33:36] = 1e-44  # fp32 subnormals
    x[12, 50] = 1e38  # huge (near fp32 max, dequantizing a rounded-up payload could overflow fp32)
    return x


@pytest.mark.parametrize("gname", list(GRANULARITIES))
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_scales_finite_positive_with_zero_inf_nan_blocks(fmt, gname):
    g, _ = GRANULARITIES[gname]
    x = _hostile()
    q = quantize(x, fmt, g)
    assert bool(torch.isfinite(q.scale).all() and (q.scale > 0).all())
    y = q.dequantize()
    assert torch.isnan(y[5, 45]) and torch.isfinite(y[~torch.isnan(x)]).all()  # inf saturates to max*scale
    assert y[0, 40] > 0 and y[3, 41] < 0
    zero = torch.zeros(3, 5)
    assert torch.equal(quantize(zero, fmt, g).dequantize(), zero)


@pytest.mark.parametrize("fmt", [E3M2, E2M3, E2M1], ids=lambda f: f.name)
def test_sub_byte_scales_and_nan(fmt):
    x = _hostile()
    x[5, 45] = 0.0
    for g, _ in GRANULARITIES.values():
        q = quantize(x, fmt, g)
        assert bool(torch.isfinite(q.scale).all() and (q.scale > 0).all())
    x[5, 45] = math.nan
    with pytest.raises(MixprecError, match="NaN"):  # FP6/FP4 have no NaN code
        quantize(x, fmt, Granularity.mx(32))


# ---------------------------------------------------------------------------------------------------
# Given scales (delayed / static scaling)


def test_given_scales_used_as_is():
    x = _data((6, 10), seed=2)
    q = quantize(x, E4M3, scale=torch.tensor(0.5))
    assert q.scale.item() == 0.5
    payload, _ = ref.ref_quantize(x, E4M3, Granularity.tensor(), scale=0.5)
    assert ref.bits_equal(decode(q.data, E4M3), torch.tensor(payload).float())
    rows = torch.rand(6, generator=torch.Generator().manual_seed(0)) + 0.01
    for given in (rows, rows.reshape(6, 1)):
        q = quantize(x, E5M2, Granularity.rows(), scale=given)
        assert torch.equal(q.scale, rows.reshape(6, 1))
        payload, _ = ref.ref_quantize(x, E5M2, Granularity.rows(), scale=rows)
        assert ref.bits_equal(decode(q.data, E5M2), torch.tensor(payload).float())
    q = quantize(x, E4M3, Granularity.blocks(4, 4), scale=torch.full((2, 3), 0.25))
    assert torch.equal(q.scale, torch.full((2, 3), 0.25))


def test_given_scale_of_wrong_shape_or_value():
    x = torch.randn(6, 10)
    with pytest.raises(MixprecError, match=r"\(6, 1\).*\(7, 1\)"):
        quantize(x, E4M3, Granularity.rows(), scale=torch.ones(7, 1))
    with pytest.raises(MixprecError, match="shape"):
        quantize(x, E4M3, Granularity.blocks(4, 4), scale=torch.ones(2, 2))
    with pytest.raises(MixprecError, match="finite and positive"):
        quantize(x, E4M3, scale=torch.tensor(0.0))
    with pytest.raises(MixprecError, match="finite and positive"):
        quantize(x, E4M3, Granularity.rows(), scale=torch.full((6, 1), math.nan))


# ---------------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_names_the_problem():
    x = torch.randn(4, 8)
    with pytest.raises(MixprecError, match="empty"):
        quantize(torch.zeros(0, 8), E4M3)
    with pytest.raises(MixprecError, match="int32"):
        quantize(torch.zeros(4, 8, dtype=torch.int32), E4M3)
    with pytest.raises(MixprecError, match=r"torch\.Tensor"):
        quantize([[1.0]], E4M3)
    with pytest.raises(MixprecError, match="e7m7"):
        quantize(x, "e7m7")
    with pytest.raises(MixprecError, match=r"e8m0.*element format"):
        quantize(x, "e8m0")
    with pytest.raises(MixprecError, match="bf16"):
        quantize(x, "bf16")
    with pytest.raises(MixprecError, match="unknown quantize backend"):
        quantize(x, E4M3, backend="fastest")


# ---------------------------------------------------------------------------------------------------
# Determinism, inputs untouched, dtypes


def test_deterministic_and_input_untouched():
    x = _hostile()
    keep = x.clone()
    for g, _ in GRANULARITIES.values():
        a, b = quantize(x, E4M3, g), quantize(x, E4M3, g)
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
        assert torch.equal(a.scale, b.scale)
    assert ref.bits_equal(x, keep)


def test_bf16_input_and_dequantize_dtype():
    x = _data((8, 64), seed=4).bfloat16()
    q = quantize(x, E4M3, Granularity.blocks(1, 32))
    assert isinstance(q, QuantizedTensor) and q.shape == x.shape
    assert torch.equal(
        q.data.view(torch.uint8), quantize(x.float(), E4M3, Granularity.blocks(1, 32)).data.view(torch.uint8)
    )
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------------
# The transposed operand, statistics, the public names


def _wide(gen, rows, cols):
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 3, cols)  # wide dynamic range
    x[3, 5], x[7, 9], x[11, 13] = math.inf, -math.inf, math.nan
    x[20:30, 130:150] = 0.0
    return x


@pytest.mark.parametrize(
    "g",
    [Granularity.tensor(), Granularity.rows(), Granularity.blocks(1, 128), Granularity.mx(32)],
    ids=lambda g: g.name,
)
def test_quantize_transposed_equals_quantizing_the_transpose(gen, g):
    x = _wide(gen, 260, 150)
    want = quantize(x.t().contiguous(), E4M3, g)
    got = quantize_transposed(x, E4M3, g)
    assert got.shape == want.shape and got.granularity == g
    assert torch.equal(got.scale, want.scale)
    assert torch.equal(got.data.contiguous().view(torch.uint8), want.data.view(torch.uint8))
    # the transposed payload view computes alike (up to the BLAS's accumulation order)
    x = torch.randn(260, 150, generator=gen)
    got, want = quantize_transposed(x, E4M3, g), quantize(x.t().contiguous(), E4M3, g)
    qb = quantize(torch.randn(40, 260, generator=gen), E4M3, g)
    mag = want.dequantize().abs() @ qb.dequantize().abs().t()
    assert ((scaled_mm(got, qb) - scaled_mm(want, qb)).abs() <= 1e-5 * mag).all()


@pytest.mark.parametrize("backend", ["tiled", "eager"])
@pytest.mark.parametrize(
    "g", [Granularity.rows(), Granularity.tensor(), Granularity.blocks(16, 32)], ids=lambda g: g.name
)
def test_quantize_with_stats(backend, g):
    w = _data((70, 96), seed=12).bfloat16()
    q, stats = quantize_with_stats(w, E4M3, g, backend=backend)
    want = quantize(w, E4M3, g)
    assert torch.equal(q.data.view(torch.uint8), want.data.view(torch.uint8)) and torch.equal(
        q.scale, want.scale
    )
    x = w.double()
    assert isinstance(stats, QuantizationStats) and stats.amax == float(w.float().abs().max())
    assert stats.relative_error == pytest.approx(
        float((want.dequantize().double() - x).norm() / x.norm()), rel=1e-5
    )
    out = torch.empty(70, 96, dtype=torch.float8_e4m3fn)  # a buffer the caller reuses
    q2, _ = quantize_with_stats(w, E4M3, g, backend=backend, out=out)
    assert q2.data.data_ptr() == out.data_ptr() and torch.equal(
        out.view(torch.uint8), want.data.view(torch.uint8)
    )
    with pytest.raises(MixprecError, match="out must be"):
        quantize_with_stats(w, E4M3, g, backend=backend, out=torch.empty(70, 95, dtype=torch.float8_e4m3fn))
    w[3, 4] = math.nan  # NaN / inf: the statistics say so (callers refuse such a weight)
    assert math.isnan(quantize_with_stats(w, E4M3, g, backend=backend)[1].relative_error)


ROUND_SCALED_CASES = [  # E4M3 block scales with a global scale are NVFP4's: E2M1 elements only
    pytest.param(fmt, g, id=f"{fid}-{g.name}")
    for g in (Granularity.tensor(), Granularity.rows(), Granularity.blocks(128, 128), Granularity.mx(32))
    for fmt, fid in zip(ELEMENT_FORMATS, FMT_IDS)
] + [pytest.param(E2M1, Granularity.nvfp4(), id="e2m1-nvfp4")]


@pytest.mark.parametrize("fmt, g", ROUND_SCALED_CASES)
def test_round_scaled_is_quantize_then_dequantize_bit_for_bit(fmt, g):
    """With the scales quantize chose for a tensor, round_scaled of another tensor of its shape (values
    past the range, ties, subnormals, signed zeros) is quantize(..., scale=those).dequantize() exactly."""
    x = _data((200, 96), seed=5)
    q = quantize(x, fmt, g)
    multiplier = _expand(q.effective_scale(), g, 200, 96)
    y = _data((200, 96), seed=6) * 3  # a third past the scales' range, clamped
    grid = decode(quantize(x, fmt, g).data, fmt) * multiplier  # grid values: exact ties of neighbours
    y[:50] = grid[:50]
    y[50:60] = (grid[50:60] + grid[50:60].roll(1, dims=1)) / 2
    y[60] = -0.0
    got = round_scaled(y, fmt, multiplier)
    want = quantize(y, fmt, g, scale=q.scale, global_scale=q.global_scale).dequantize()
    assert ref.bits_equal(got, want)


def test_public_names_are_the_entry():
    """`mixprec.quantize` stays the function (the module is mixprec.quantization, not mixprec.quantize)."""
    assert mixprec.quantize is quantize and mixprec.dequantize is dequantize
    from mixprec import quantize as public

    assert public is quantize
    x = torch.randn(4, 64)
    assert torch.equal(
        fake_quantize(x, E4M3, Granularity.rows()), quantize(x, E4M3, Granularity.rows()).dequantize()
    )
