"""mixprec.formats against torch's casts (where torch has the dtype) and tests/reference.py (everywhere)."""

from __future__ import annotations

import math
from functools import cache

import pytest
import torch

import mixprec.formats as F
import reference as ref
from mixprec.errors import MixprecError
from mixprec.formats import (
    BF16,
    E2M1,
    E2M3,
    E3M2,
    E4M3,
    E5M2,
    E8M0,
    FORMATS,
    FP16,
    FP32,
    TF32,
    cast_to_format,
    decode,
    encode,
    get_format,
    round_saturating,
    saturating_codes,
)

pytestmark = pytest.mark.usefixtures("single_thread")

NATIVE = [E4M3, E5M2, BF16, FP16]
SUB_BYTE = [E3M2, E2M3, E2M1]
ROUNDING = [E4M3, E5M2, BF16, FP16, TF32, E3M2, E2M3, E2M1]  # everything but fp32 and e8m0


def _f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).float()


def _up(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, math.inf))


def _down(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, -math.inf))


def _positive_values(fmt) -> torch.Tensor:
    """All finite positive values of a format, sorted (decoded from codes by the reference or torch)."""
    if fmt.bits <= 8:
        return torch.tensor([float(v) for v in ref.nonnegative_values(fmt)[0]], dtype=torch.float64)
    codes = torch.arange(2**15, dtype=torch.int32).to(torch.int16)  # sign bit 0
    vals = codes.view(fmt.torch_dtype).double()
    return vals[torch.isfinite(vals)].unique()


@cache
def _structured(fmt) -> torch.Tensor:
    """Representable values, exact midpoints (ties), the fp32 neighbours of both, values just below max."""
    v = _positive_values(fmt)
    mids = (v[1:] + v[:-1]) / 2  # exact in fp64, and in fp32 for every format here
    top = torch.tensor([ref.ref_max(fmt)], dtype=torch.float64)
    base = torch.cat([v, mids]).float()
    out = torch.cat([base, _up(base), _down(base), _down(top.float())])
    out = out[out.abs() <= ref.ref_max(fmt)]
    return torch.cat([out, -out])


def _random_in_range(fmt, n: int, gen: torch.Generator) -> torch.Tensor:
    """Random fp32 bit patterns with |x| <= max: half over every binade, half over the format's own."""
    top = torch.tensor(ref.ref_max(fmt), dtype=torch.float32).view(torch.int32).item()
    low = torch.tensor(ref.ref_min_positive(fmt) / 8, dtype=torch.float32).view(torch.int32).item()
    a = torch.randint(0, top + 1, (n // 2,), generator=gen, dtype=torch.int32)
    b = torch.randint(low, top + 1, (n - n // 2,), generator=gen, dtype=torch.int32)
    sign = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int32) << 31
    return (torch.cat([a, b]) | sign).view(torch.float32)


# ---------------------------------------------------------------------------------------------------
# Codes


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_all_256_fp8_codes_round_trip(fmt):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = decode(codes.view(fmt.torch_dtype), fmt)
    assert ref.bits_equal(values, _f32([ref.code_value(fmt, c) for c in range(256)]))
    assert ref.bits_equal(decode(codes, fmt), values)  # uint8 codes decode alike
    nan = torch.isnan(values)
    assert int(nan.sum()) == (2 if fmt is E4M3 else 6)
    finite = torch.isfinite(values)
    back = encode(values, fmt)  # encode saturates: E5M2's +-inf are stored as +-max
    assert back.dtype == fmt.torch_dtype
    assert torch.equal(back.view(torch.uint8)[finite], codes[finite])  # bit-exact, -0 included
    assert torch.isnan(decode(back[nan], fmt)).all()  # NaN codes stay NaN (torch may pick another one)
    exact = cast_to_format(values, fmt, saturate=False)  # every code's value, inf included, is kept
    assert ref.bits_equal(exact, values)
    assert torch.equal(exact.to(fmt.torch_dtype).view(torch.uint8)[~nan], codes[~nan])
    assert ref.bits_equal(cast_to_format(values[finite], fmt), values[finite])


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_fast_cpu_decode_is_exact_and_keeps_nan(fmt):
    # decode() takes integer bit tricks on the CPU (torch's float8 cast is scalar code there); payloads
    # holding an E4M3 NaN code take torch's cast. Both must give the reference bits, NaN kept as NaN.
    want = _f32([ref.code_value(fmt, c) for c in range(256)])
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = ~torch.isnan(want)
    tiled = codes[finite].repeat(40).view(-1, 8)  # every non-NaN code, no NaN: the integer path
    got = decode(tiled.view(fmt.torch_dtype), fmt)
    assert ref.bits_equal(got, want[finite].repeat(40).view(-1, 8))
    assert ref.bits_equal(decode(tiled.t().view(fmt.torch_dtype), fmt), got.t())  # a transposed view
    with_nan = codes.repeat(4)  # NaN codes among the others
    got = decode(with_nan.view(fmt.torch_dtype), fmt)
    assert torch.equal(torch.isnan(got), torch.isnan(want.repeat(4)))
    assert ref.bits_equal(got[finite.repeat(4)], want.repeat(4)[finite.repeat(4)])


@pytest.mark.parametrize("fmt", SUB_BYTE, ids=lambda f: f.name)
def test_sub_byte_codes_round_trip(fmt):
    codes = torch.arange(2**fmt.bits, dtype=torch.int32).to(torch.uint8)
    values = decode(codes, fmt)
    assert ref.bits_equal(values, _f32([ref.code_value(fmt, c) for c in range(2**fmt.bits)]))
    assert torch.isfinite(values).all()  # FP6/FP4: every code is a number
    back = encode(values, fmt)
    assert back.dtype == torch.uint8
    assert torch.equal(back, codes)  # -0 keeps its own code
    with pytest.raises(MixprecError, match="NaN"):
        encode(torch.tensor([1.0, math.nan]), fmt)


def test_e8m0_codes_round_trip():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = decode(codes, E8M0)
    assert ref.bits_equal(values, _f32([ref.code_value(E8M0, c) for c in range(256)]))
    assert torch.isnan(values[255]) and torch.isfinite(values[:255]).all()
    assert torch.equal(encode(values[:255], E8M0).view(torch.uint8), codes[:255])


# ---------------------------------------------------------------------------------------------------
# Bit-identical to torch in range


@pytest.mark.parametrize("fmt", NATIVE, ids=lambda f: f.name)
@pytest.mark.parametrize("path", ["probed", "clamp"])
def test_cast_bit_identical_to_torch_in_range(fmt, path, gen, monkeypatch):
    if path == "clamp":  # the path taken where torch's cast does not saturate (torch 2.11)
        monkeypatch.setattr(F, "torch_cast_saturates", lambda dtype: False)
    n = 2**20 if path == "probed" else 2**16  # >= 10^6 values on the path this torch takes
    x = torch.cat([_structured(fmt), _random_in_range(fmt, n, gen)])
    assert (x.numel() >= 10**6 or path == "clamp") and bool((x.abs() <= fmt.max).all())
    got = cast_to_format(x, fmt)
    assert got.dtype == torch.float32
    assert ref.bits_equal(got, x.to(fmt.torch_dtype).float())
    # Non-saturating casts agree in range too.
    assert ref.bits_equal(cast_to_format(x, fmt, saturate=False), got)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_torch_and_reference_agree_on_ties(fmt):
    """Ties the torch comparison relies on are also the reference's: torch is right for fp8 in range."""
    x = _structured(fmt)
    want = _f32([ref.ref_cast(v, fmt) for v in x.tolist()])
    assert ref.bits_equal(cast_to_format(x, fmt), want)


# ---------------------------------------------------------------------------------------------------
# Out of range, signed zeros, NaN, inf


def _specials(fmt) -> torch.Tensor:
    """0, -0, NaN, +-inf, max, the overflow threshold (a tie) and its neighbours, far out of range."""
    top = ref.ref_max(fmt)
    thr = (top + float(ref._virtual_next(fmt))) / 2
    vals = [0.0, math.nan, math.inf, top, thr, 2 * top, 3.0e38, ref.ref_min_positive(fmt) / 2]
    x = _f32([v for v in vals if v <= 3.4e38 or math.isinf(v)])
    x = torch.cat([x, _up(x[3:5]), _down(x[3:5])])
    return torch.cat([x, -x])


def _check_specials(fmt, dtype=torch.float32):
    x = _specials(fmt).to(dtype)
    for saturate in (True, False):
        got = cast_to_format(x, fmt, saturate=saturate)
        want = _f32([ref.ref_cast(v, fmt, saturate) for v in x.tolist()])
        assert ref.bits_equal(got, want), (fmt.name, saturate, x[~torch.eq(got, want)], got, want)


@pytest.mark.parametrize("fmt", ROUNDING, ids=lambda f: f.name)
@pytest.mark.parametrize("path", ["probed", "clamp"])
def test_out_of_range_zero_nan_inf(fmt, path, monkeypatch):
    if path == "clamp":
        monkeypatch.setattr(F, "torch_cast_saturates", lambda dtype: False)
    _check_specials(fmt)
    _check_specials(fmt, torch.float64)


def test_out_of_range_definitions_spelled_out():
    x = torch.tensor([464.0, 465.0, 1e9, math.inf, -math.inf, math.nan, -0.0])
    sat = cast_to_format(x, E4M3)
    assert sat[:5].tolist() == [448.0, 448.0, 448.0, 448.0, -448.0]
    fn = cast_to_format(x, E4M3, saturate=False)
    assert fn[0] == 448.0 and torch.isnan(fn[1:6]).all()  # 464 is a tie that rounds down to 448
    assert torch.signbit(sat[6]) and torch.signbit(fn[6])
    e5 = cast_to_format(torch.tensor([61439.0, 61440.0, -1e9, math.inf]), E5M2, saturate=False)
    assert e5.tolist() == [57344.0, math.inf, -math.inf, math.inf]  # the tie at 61440 overflows
    for fmt in SUB_BYTE:  # no inf, no NaN: always saturate; NaN stays NaN in the float32 result
        y = cast_to_format(torch.tensor([1e9, -math.inf, math.nan]), fmt, saturate=False)
        assert y[:2].tolist() == [fmt.max, -fmt.max] and torch.isnan(y[2])
    fp32 = cast_to_format(torch.tensor([math.inf, -math.inf, math.nan, 1.0]), FP32)
    assert fp32[:2].tolist() == [FP32.max, -FP32.max] and torch.isnan(fp32[2]) and fp32[3] == 1.0
    assert cast_to_format(torch.tensor([math.inf]), FP32, saturate=False).item() == math.inf


def _torch_211_style_to(original):
    """torch.Tensor.to as torch 2.11 behaves for E4M3: overflow and inf become NaN (no saturation)."""

    def to(self, *args, **kwargs):
        dtype = kwargs.get("dtype", args[0] if args else None)
        if dtype == torch.float8_e4m3fn and self.is_floating_point() and self.dtype.itemsize > 1:
            out = original(self, *args, **kwargs)
            bad = ~(self.abs() < 464.0) & ~torch.isnan(self)  # 2.11: rounds past 448 -> NaN code
            return torch.where(bad, torch.full_like(out, math.nan), out)
        return original(self, *args, **kwargs)

    return to


def test_same_answers_with_a_torch_211_style_cast(monkeypatch):
    """mixprec clamps before torch's cast when the probe finds a non-saturating cast, so a torch whose
    cast maps overflow to NaN (2.11) gives the same results as a saturating one (>= 2.12)."""
    monkeypatch.setattr(torch.Tensor, "to", _torch_211_style_to(torch.Tensor.to))
    F.torch_cast_saturates.cache_clear()
    try:
        assert F.torch_cast_saturates(torch.float8_e4m3fn) is False
        _check_specials(E4M3)
        q = torch.tensor([1e6, -math.inf, 3.0])
        assert cast_to_format(q, E4M3).tolist() == [448.0, -448.0, 3.0]
        from mixprec.quantization import quantize  # quantize's payload cast takes the same clamp

        payload = decode(
            quantize(torch.tensor([[1e6, -math.inf, 3.0, math.nan]]), E4M3, scale=1.0).data, E4M3
        )
        assert payload[0, :3].tolist() == [448.0, -448.0, 3.0] and torch.isnan(payload[0, 3])
    finally:
        monkeypatch.undo()
        F.torch_cast_saturates.cache_clear()


# ---------------------------------------------------------------------------------------------------
# Emulated formats, exhaustively against the reference


def _exhaustive(fmt) -> torch.Tensor:
    v = _positive_values(fmt)
    mids = (v[1:] + v[:-1]) / 2
    thr = torch.tensor([(ref.ref_max(fmt) + float(ref._virtual_next(fmt))) / 2], dtype=torch.float64)
    extra = _f32(
        [0.0, v[0].item() / 2, v[0].item() / 4, 1e3, 1e38, 3.4028234663852886e38, math.inf, math.nan]
    )
    base = torch.cat([v, mids, thr]).float()
    x = torch.cat([base, _up(base), _down(base), extra, _up(extra[:6]), _down(extra[:6])])
    return torch.cat([x, -x])


@pytest.mark.parametrize("fmt", SUB_BYTE, ids=lambda f: f.name)
@pytest.mark.parametrize("saturate", [True, False])
def test_sub_byte_exhaustive_against_reference(fmt, saturate):
    x = _exhaustive(fmt)
    want = _f32([ref.ref_cast(v, fmt, saturate) for v in x.tolist()])
    assert ref.bits_equal(cast_to_format(x, fmt, saturate=saturate), want)
    assert ref.bits_equal(cast_to_format(x.double(), fmt, saturate=saturate), want)


@pytest.mark.parametrize("fmt", [*SUB_BYTE, TF32], ids=lambda f: f.name)
def test_traced_forms_of_the_rounding_are_the_eager_ones(fmt):
    """round_to_grid's out-of-place form (what torch.compile traces) rounds as its in-place form."""
    if fmt.bits < 8:
        x = _exhaustive(fmt)
    else:  # TF32: a wide-range sample with the special values
        x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(2)) * torch.logspace(
            -40, 38, 1 << 16
        )
        x[:4] = torch.tensor([math.inf, -math.inf, math.nan, -0.0])
    eager = round_saturating(x, fmt, inplace=True)
    assert ref.bits_equal(round_saturating(x, fmt), eager)
    assert ref.bits_equal(eager, cast_to_format(x, fmt))
    if fmt.bits < 8:
        finite = x[~torch.isnan(x)]
        codes = saturating_codes(finite, fmt)
        assert torch.equal(codes, saturating_codes(finite, fmt, inplace=True))
        assert torch.equal(codes, encode(finite, fmt))


def test_enumeration_and_quantum_references_agree():
    """The two reference roundings (comparison against enumerated values, counting quanta) agree."""
    for fmt in (E4M3, E5M2, *SUB_BYTE):
        for v in _exhaustive(fmt).tolist():
            if math.isfinite(v):
                a, b = ref.round_by_comparison(v, fmt), ref.round_by_quantum(v, fmt)
                assert a == b or (math.isnan(a) and math.isnan(b)), (fmt.name, v, a, b)


def test_tf32_dense_sample_against_reference(gen):
    rand = torch.randint(0, 0x7F800000, (3000,), generator=gen, dtype=torch.int32).view(torch.float32)
    # every value, midpoint and neighbour of [1, 2) and of the subnormals; every 16th of the top binade
    grid = torch.arange(2**11, dtype=torch.float64) / 2**11
    v = torch.cat([1 + grid, grid * 2.0**-126, (1 + grid[::16]) * 2.0**127]).float()
    x = torch.cat([rand, v, _up(v), _down(v)])
    x = torch.cat([x, -x])
    want = _f32([ref.ref_cast(t, TF32) for t in x.tolist()])
    assert ref.bits_equal(cast_to_format(x, TF32), want)
    _check_specials(TF32)  # both saturation modes on the out-of-range values


def test_bf16_fp16_match_reference_on_a_sample(gen):
    for fmt in (BF16, FP16):
        x = torch.cat([_structured(fmt)[::401], _random_in_range(fmt, 2000, gen), _specials(fmt)])
        want = _f32([ref.ref_cast(t, fmt) for t in x.tolist()])
        assert ref.bits_equal(cast_to_format(x, fmt), want)


def _e8m0_inputs() -> torch.Tensor:
    k = torch.arange(-127, 128, dtype=torch.float64)
    powers = torch.pow(2.0, k)
    mids = 1.5 * powers  # ties
    base = torch.cat([powers, mids]).float()
    extra = _f32([0.0, -0.0, -1.0, -math.inf, math.inf, math.nan, 2.0**-149, 2.0**-128, 3.4e38])
    return torch.cat([base, _up(base), _down(base), extra])


@pytest.mark.parametrize("saturate", [True, False])
def test_e8m0_exhaustive_against_reference(saturate):
    x = _e8m0_inputs()
    want = _f32([ref.round_e8m0(v, saturate) for v in x.tolist()])
    assert ref.bits_equal(cast_to_format(x, E8M0, saturate=saturate), want)
    assert ref.bits_equal(cast_to_format(x.double(), E8M0, saturate=saturate), want)


def test_e8m0_rules_spelled_out():
    x = torch.tensor([1.5, 1.49, 3.0, 0.0, -2.0, math.inf, math.nan, 2.0**-140])
    assert cast_to_format(x, E8M0).tolist()[:6] == [2.0, 1.0, 4.0, 2.0**-127, 2.0**-127, 2.0**127]
    strict = cast_to_format(x, E8M0, saturate=False)
    assert torch.isnan(strict[3:7]).all() and strict[7] == 2.0**-127


def test_e8m0_matches_torch_for_positive_in_range_values():
    if E8M0.torch_dtype is None:
        pytest.skip("this torch has no float8_e8m0fnu")
    x = _e8m0_inputs()
    # From the smallest normal fp32 up: torch rounds fp32 subnormals in (2^-127, 2^-126) up to 2^-126,
    # mixprec to the nearest power of two (2^-127 below 1.5 * 2^-127).
    x = x[(x >= 2.0**-126) & (x < 1.5 * 2.0**127)]
    assert ref.bits_equal(cast_to_format(x, E8M0), x.to(E8M0.torch_dtype).float())


# ---------------------------------------------------------------------------------------------------
# fp64 inputs round once


@pytest.mark.parametrize("fmt", [*ROUNDING, E8M0], ids=lambda f: f.name)
def test_fp64_rounds_directly(fmt):
    """A value just above a tie in fp64 lands exactly on the tie in fp32; rounding via fp32 would then
    go to the even (lower) neighbour, direct rounding goes up."""
    if fmt is E8M0:
        x, direct, twice = 1.5 - 2.0**-40, 1.0, 2.0  # E8M0 ties go up: the mirror image
    else:
        x, direct, twice = 1.0 + fmt.epsilon / 2 + 2.0**-40, 1.0 + fmt.epsilon, 1.0
    x64 = torch.tensor([x, -x], dtype=torch.float64)
    assert cast_to_format(x64.float(), fmt)[0].item() == twice  # the double-rounding trap is real
    got = cast_to_format(x64, fmt)
    assert got.dtype == torch.float32
    assert got[0].item() == direct
    if fmt is not E8M0:
        assert got[1].item() == -direct


def test_fp64_dense_sample_against_reference(gen):
    x = torch.randn(3000, generator=gen, dtype=torch.float64) * torch.pow(
        2.0, torch.randint(-20, 20, (3000,), generator=gen).double()
    )
    for fmt in (E4M3, E5M2, BF16, FP16, TF32, E2M1):
        want = _f32([ref.ref_cast(v, fmt) for v in x.tolist()])
        assert ref.bits_equal(cast_to_format(x, fmt), want), fmt.name


def test_fp32_target():
    x = torch.tensor([1.0, -0.0, 3.0e-45])
    assert ref.bits_equal(cast_to_format(x, FP32), x)
    assert ref.bits_equal(cast_to_format(x.half(), FP32), x.half().float())
    x64 = torch.tensor([1.0 + 2.0**-24 + 2.0**-40, 1e39], dtype=torch.float64)
    assert cast_to_format(x64, FP32).tolist() == [1.0 + 2.0**-23, FP32.max]
    assert cast_to_format(x64, FP32, saturate=False)[1].item() == math.inf


def test_input_not_modified_and_dtypes():
    x = torch.tensor([500.0, -0.3, math.inf])
    keep = x.clone()
    for fmt in FORMATS.values():
        cast_to_format(x, fmt)
    assert ref.bits_equal(x, keep)
    for dtype in (torch.bfloat16, torch.float16):
        y = torch.tensor([3.0, -0.2], dtype=dtype)
        assert ref.bits_equal(cast_to_format(y, E4M3), y.float().to(torch.float8_e4m3fn).float())


# ---------------------------------------------------------------------------------------------------
# Derived figures


KNOWN = {  # name: (max, min normal, min subnormal or None, epsilon)
    "e4m3": (448.0, 2.0**-6, 2.0**-9, 2.0**-3),
    "e5m2": (57344.0, 2.0**-14, 2.0**-16, 2.0**-2),
    "e3m2": (28.0, 2.0**-2, 2.0**-4, 2.0**-2),
    "e2m3": (7.5, 1.0, 2.0**-3, 2.0**-3),
    "e2m1": (6.0, 1.0, 0.5, 0.5),
    "e8m0": (2.0**127, 2.0**-127, None, 1.0),
    "fp16": (65504.0, 2.0**-14, 2.0**-24, 2.0**-10),
    "bf16": ((2 - 2.0**-7) * 2.0**127, 2.0**-126, 2.0**-133, 2.0**-7),
    "tf32": ((2 - 2.0**-10) * 2.0**127, 2.0**-126, 2.0**-136, 2.0**-10),
    "fp32": ((2 - 2.0**-23) * 2.0**127, 2.0**-126, 2.0**-149, 2.0**-23),
}


@pytest.mark.parametrize("name", list(KNOWN))
def test_derived_figures(name):
    fmt = get_format(name)
    top, normal, sub, eps = KNOWN[name]
    assert (fmt.max, fmt.min_normal, fmt.epsilon) == (top, normal, eps)
    assert fmt.min_subnormal == (normal if sub is None else sub)
    assert fmt.has_subnormals == (sub is not None)
    assert fmt.max == ref.ref_max(fmt) and fmt.min_subnormal == ref.ref_min_positive(fmt)
    assert fmt.decades == pytest.approx(math.log10(fmt.max / fmt.min_subnormal))
    summary = fmt.summary()
    assert summary["max"] == top and summary["min_normal"] == normal


def test_special_values_per_format():
    assert (E4M3.has_inf, E4M3.has_nan) == (False, True)
    assert (E5M2.has_inf, E5M2.has_nan) == (True, True)
    for fmt in SUB_BYTE:
        assert (fmt.has_inf, fmt.has_nan, fmt.saturates_always) == (False, False, True)
    assert (E8M0.has_zero, E8M0.signed, E8M0.has_nan, E8M0.has_inf) == (False, False, True, False)


def test_guide_fp8_ranges_are_not_the_table():
    """The guide quotes E4M3 ~1e-6..1e4 and E5M2 ~1e-14..1e4; the definitions give something else."""
    assert E4M3.max < 1e3 and E4M3.min_subnormal > 1e-3  # 448 and 2^-9 ~ 1.95e-3
    assert E5M2.max > 5e4 and E5M2.min_subnormal > 1e-5  # 57344 and 2^-16 ~ 1.5e-5
    assert round(E4M3.decades, 2) == 5.36 and round(E5M2.decades, 2) == 9.57


# ---------------------------------------------------------------------------------------------------
# Names and bad input


def test_names_and_aliases():
    assert [get_format(n) for n in ("float8_e4m3fn", "FP8_E4M3", " e4m3 ")] == [E4M3] * 3
    assert get_format("float8_e5m2") is E5M2 and get_format("bfloat16") is BF16
    assert get_format(E2M1) is E2M1
    assert list(FORMATS) == ["fp32", "tf32", "bf16", "fp16", "e4m3", "e5m2", "e8m0", "e3m2", "e2m3", "e2m1"]


def test_bad_input_names_the_problem():
    with pytest.raises(MixprecError, match="e9m9"):
        get_format("e9m9")
    with pytest.raises(MixprecError, match="int"):
        get_format(3)
    with pytest.raises(MixprecError, match="int64"):
        cast_to_format(torch.arange(3), "e4m3")
    with pytest.raises(MixprecError, match=r"torch\.Tensor.*list"):
        cast_to_format([1.0, 2.0], "e4m3")
    with pytest.raises(MixprecError, match="float8"):
        cast_to_format(torch.zeros(2).to(torch.float8_e4m3fn), "bf16")
    with pytest.raises(MixprecError, match="nope"):
        cast_to_format(torch.zeros(2), "nope")
