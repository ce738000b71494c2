"""The compiled quantize (kernels.c_quantize, the tiled backend's fast path) gives the eager backend's
payloads and scales bit for bit: at every E4M3 / E5M2 / E2M1 rounding boundary (each code's value, the
ties between neighbours and one fp32 ulp either side, the subnormals, past the max), over a dense sweep
of fp32 patterns, over granularities x dtypes x computed / given / power-of-two scales, in one slab of
rows or many, NVFP4 with its global scale, E2M1 packed two a byte, rows with a stride; its statistics
match the torch code's; NaN and inf hand the tensor back to the torch code; and it says why when it is
not used."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.formats import E2M1, E4M3, E5M2, pack_nibbles
from mixprec.kernels import c_quantize
from mixprec.quantization import quantize, quantize_with_stats
from mixprec.scaling import Granularity as G

pytestmark = pytest.mark.skipif(
    c_quantize.unavailable_reason() is not None,
    reason=f"compiled quantize: {c_quantize.unavailable_reason()}",
)
FORMATS = [E4M3, E5M2, E2M1]
GRANULARITIES = [
    G.tensor(),
    G.rows(),
    G.blocks(1, 128),
    G.blocks(128, 128),
    G.blocks(3, 17),  # odd blocks, edge blocks in both directions
    G.mx(32),
]
NARROW = [G.columns(), G.blocks(128, 1), G.blocks(3, 5), G.mx(32, axis=0)]  # left to the torch code


def _compiled(x, fmt, g, scale=None, margin=0, power_of_two=False, stats=False, global_scale=None, out=None):
    assert c_quantize.takes(x, fmt, g, out)
    done = c_quantize.quantize_compiled(
        x, fmt, g, scale=scale, margin=margin, power_of_two=power_of_two, out=out, stats=stats,
        global_scale=global_scale,
    )  # fmt: skip
    assert done is not None
    return done


def _codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _boundaries(fmt) -> torch.Tensor:
    """Every code's value, the midpoints between neighbouring values (ties), and the fp32 neighbours of
    both, both signs, up to twice the max (saturation), and +-0."""
    if fmt.torch_dtype is None:  # E2M1: its eight magnitudes
        values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    else:
        values = torch.arange(256, dtype=torch.uint8).view(fmt.torch_dtype).float()
    values = values[torch.isfinite(values) & (values >= 0)].unique()  # sorted, non-negative
    mids = (values[1:] + values[:-1]) / 2  # exact in fp32
    points = torch.cat([values, mids, values * 1.5, values * 2, torch.tensor([fmt.max * 2, 1e30])])
    bits = points.view(torch.int32)
    near = torch.cat([bits - 1, bits, bits + 1]).clamp(min=0).view(torch.float32)
    return torch.cat([near, -near]).reshape(-1, 1)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_every_rounding_boundary_rounds_as_torch(fmt):
    x = _boundaries(fmt).reshape(1, -1).contiguous()
    want = quantize(x, fmt, G.tensor(), scale=1.0, backend="eager")
    data, _, _ = _compiled(x, fmt, G.tensor(), scale=torch.ones(1, 1))
    assert torch.equal(_codes(data), _codes(want.data))
    negative_zero = x[0].view(torch.int32) == -(2**31)
    sign = 0x80 if fmt.bits == 8 else 0x08
    assert negative_zero.any() and bool((_codes(data)[0, negative_zero] == sign).all())  # its sign kept


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_dense_sweep_of_fp32_patterns(fmt):
    top = torch.tensor(fmt.max * 1.25).view(torch.int32).item()
    bits = torch.arange(0, top, 97, dtype=torch.int32)  # every 97th pattern: all exponents, odd mantissas
    x = torch.cat([bits, bits | -(2**31)]).view(torch.float32).reshape(1, -1)
    want = quantize(x, fmt, G.tensor(), scale=1.0, backend="eager")
    data, _, _ = _compiled(x, fmt, G.tensor(), scale=torch.ones(1, 1))
    assert torch.equal(_codes(data), _codes(want.data))


def _weights(shape, dtype, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[1])
    x[1] = 0.0  # a zero row
    x[2] = torch.randn(shape[1], generator=gen) * 1e-41  # fp32 subnormals
    x[0, 3] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("slab", [c_quantize.SLAB_ELEMENTS, 600])  # 600: a slab per few block rows
@pytest.mark.parametrize("g", GRANULARITIES, ids=lambda g: g.name)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bit_identical_to_eager_over_granularities(monkeypatch, fmt, g, dtype, slab):
    monkeypatch.setattr(c_quantize, "SLAB_ELEMENTS", slab)
    for shape in [(37, 300), (130, 64)]:
        x = _weights(shape, dtype)
        options = [{}, {"power_of_two": True, "margin": 1}] if g.scale_format == "fp32" else [{}]
        for kw in options:
            want = quantize(x, fmt, g, backend="eager", **kw)
            data, scale, _ = _compiled(x, fmt, g, **kw)
            assert torch.equal(_codes(data), _codes(want.data)) and torch.equal(scale, want.scale), kw
        given = want.scale * 1.5
        want = quantize(x, fmt, g, scale=given, backend="eager")
        data, scale, _ = _compiled(x, fmt, g, scale=given)
        assert torch.equal(_codes(data), _codes(want.data)) and torch.equal(scale, want.scale)


def test_rows_with_a_stride():
    wide = _weights((64, 512), torch.bfloat16)
    x = wide[:, 100:400]  # rows 512 elements apart
    want = quantize(x.contiguous(), E4M3, G.blocks(1, 128), backend="eager")
    data, scale, _ = _compiled(x, E4M3, G.blocks(1, 128))
    assert torch.equal(_codes(data), _codes(want.data)) and torch.equal(scale, want.scale)


@pytest.mark.parametrize(
    "fmt,g", [(E4M3, G.rows()), (E4M3, G.blocks(128, 128)), (E2M1, G.nvfp4()), (E2M1, G.mx(32))], ids=str
)
def test_statistics_match_the_torch_code(monkeypatch, fmt, g):
    monkeypatch.setattr(c_quantize, "SLAB_ELEMENTS", 5000)  # the sums of several slabs
    x = _weights((130, 320), torch.bfloat16, seed=3)
    if fmt is E4M3:  # squares past fp32's range: redone in double (NVFP4's torch code gives NaN there)
        x[5, :4] = torch.tensor([3e19, -1e25, 2e30, 1e38])
    gs = quantize(x, fmt, g, backend="eager").global_scale
    _, _, got = _compiled(x, fmt, g, stats=True, global_scale=gs)
    monkeypatch.setattr(c_quantize, "takes", lambda *a: False)  # the tiled backend's torch code
    _, want = quantize_with_stats(x, fmt, g, backend="tiled", global_scale=gs)
    assert got[0] == want.amax
    assert math.isfinite(got[1]) and got[1] == pytest.approx(want.relative_error, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g", [G.nvfp4(), G.nvfp4(scale_math="input"), G.nvfp4(16, 16)], ids=lambda g: g.name)
def test_nvfp4_with_its_global_scale_and_packed(g, dtype):
    for shape in [(37, 320), (130, 64)]:
        x = _weights(shape, dtype, seed=5)
        want = quantize(x, E2M1, g, backend="eager")
        gs = want.global_scale
        data, scale, _ = _compiled(x, E2M1, g, global_scale=gs)
        assert torch.equal(data, want.data) and torch.equal(scale, want.scale)
        packed = torch.empty(shape[0], shape[1] // 2, dtype=torch.uint8)
        data, scale, _ = _compiled(x, E2M1, g, global_scale=gs, out=packed)
        assert data is packed and torch.equal(packed, pack_nibbles(want.data))
        given = quantize(x, E2M1, g, scale=want.scale, global_scale=gs * 2, backend="eager")
        data, scale, _ = _compiled(x, E2M1, g, scale=want.scale, global_scale=gs * 2)
        assert torch.equal(data, given.data) and torch.equal(scale, given.scale)


def test_packing_needs_an_even_width_only():
    x = _weights((8, 34), torch.float32)
    packed = torch.empty(8, 17, dtype=torch.uint8)
    got, scale, _ = _compiled(x, E2M1, G.blocks(1, 17), out=packed)  # pairs straddle two scales
    want = quantize(x, E2M1, G.blocks(1, 17), backend="eager")
    assert got is packed and torch.equal(packed, pack_nibbles(want.data)) and torch.equal(scale, want.scale)
    assert not c_quantize.takes(x, E4M3, G.rows(), packed)  # FP8 is never packed
    assert not c_quantize.takes(x[:, :33], E2M1, G.rows(), torch.empty(8, 16, dtype=torch.uint8))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_inf_hand_the_tensor_back(bad):
    x = _weights((16, 64), torch.float32)
    x[7, 9] = bad
    for scale, stats in ((None, False), (torch.ones(16, 1), False), (torch.ones(16, 1), True)):
        got = c_quantize.quantize_compiled(
            x, E4M3, G.rows(), scale=scale, margin=0, power_of_two=False, out=None, stats=stats
        )
        assert got is None
    want = quantize(x, E4M3, G.rows(), backend="eager")  # and the tiled backend still gives eager's
    assert torch.equal(_codes(quantize(x, E4M3, G.rows(), backend="tiled").data), _codes(want.data))


def test_says_why_it_is_not_used(monkeypatch, tmp_path):
    for env, why in (({"MIXPREC_C_KERNELS": "off"}, "disabled by MIXPREC_C_KERNELS=off"),
                     ({"CC": "/bin/false", "MIXPREC_CACHE_DIR": str(tmp_path)}, "failed")):  # fmt: skip
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        c_quantize._load.cache_clear()
        try:
            assert why in c_quantize.unavailable_reason()
            assert not c_quantize.takes(_weights((4, 8), torch.float32), E4M3, G.rows(), None)
            assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # nothing half-written is left
        finally:
            for k in env:
                monkeypatch.delenv(k)
            c_quantize._load.cache_clear()
    assert c_quantize.unavailable_reason() is None


def test_declines_what_it_does_not_take():
    x = _weights((16, 64), torch.float32)
    assert not c_quantize.takes(x.half(), E4M3, G.rows(), None)  # fp16 input
    assert not c_quantize.takes(x.t(), E4M3, G.rows(), None)  # column-major
    assert not c_quantize.takes(x[:1].expand(16, 64), E4M3, G.rows(), None)  # every row the same memory
    assert not c_quantize.takes(x.double(), E4M3, G.rows(), None)  # fp64 input
    for g in NARROW:  # blocks narrower than 16 columns: slower in C than in torch
        assert not c_quantize.takes(x, E4M3, g, None), g.name
    assert c_quantize.takes(x[:, :5], E4M3, G.blocks(3, 5), None)  # a block as wide as the row
    assert not c_quantize.takes(x, E4M3, G.rows(), torch.empty(16, 64))  # an fp32 out


def test_builds_without_march_native_where_the_compiler_refuses_it(monkeypatch, tmp_path):
    compiler = tmp_path / "cc-without-native"
    real = c_quantize.find_compiler()
    compiler.write_text(f'#!/bin/sh\ncase "$*" in *-march=native*) exit 1;; esac\nexec {real} "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path / "cache"))
    c_quantize._load.cache_clear()
    try:
        assert c_quantize.unavailable_reason() is None
        x = _weights((16, 64), torch.bfloat16)
        data, scale, _ = _compiled(x, E4M3, G.rows())
        want = quantize(x, E4M3, G.rows(), backend="eager")
        assert torch.equal(_codes(data), _codes(want.data)) and torch.equal(scale, want.scale)
    finally:
        monkeypatch.undo()
        c_quantize._load.cache_clear()
