"""The tiled backend of the quantize entry gives the eager backend's payloads and scales bit for bit, with
many tiles (column tiles for blocks) as with one, through its compiled fast path (kernels.c_quantize) and
through its torch code, and the statistics it computes from the same pass (amax, relative error within
1e-5 relative of the float64 reference); FP4 (NVFP4 and MX blocks) likewise, also with the codes packed
two a byte into the caller's buffer."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.errors import MixprecError
from mixprec.formats import decode_e4m3_unscaled_into, pack_nibbles
from mixprec.kernels import c_quantize, tiled
from mixprec.quantization import quantize, quantize_with_stats
from mixprec.scaling import Granularity

GRANULARITIES = [
    Granularity.rows(),
    Granularity.tensor(),
    Granularity.columns(),
    Granularity.blocks(128, 128),
    Granularity.blocks(16, 32),
    Granularity.mx(32),
]


def _weight(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    w = torch.randn(shape, generator=g, dtype=torch.float64) * torch.rand(
        shape[0], 1, generator=g, dtype=torch.float64
    )
    w[-1] = 0  # an all-zero row: scale 1
    w[0, :3] *= 1e-6  # subnormal E4M3 codes
    return (w * 0.05).to(dtype)


@pytest.fixture(params=[True, False], ids=["c", "torch"])
def compiled(request, monkeypatch):
    """The tiled backend through its compiled C, or its torch code."""
    if request.param and c_quantize.unavailable_reason() is not None:
        pytest.skip(f"compiled quantize: {c_quantize.unavailable_reason()}")
    if not request.param:
        monkeypatch.setattr(c_quantize, "takes", lambda *a: False)
    return request.param


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("tile", [1 << 18, 300])  # 300 elements: many tiles, column tiles for blocks
@pytest.mark.parametrize("g", GRANULARITIES, ids=lambda g: g.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bit_identical_to_the_eager_backend(monkeypatch, tile, g, dtype):
    monkeypatch.setattr(tiled, "TILE_ELEMENTS", tile)
    for shape in [(16, 48), (130, 300), (257, 129)]:
        w = _weight(shape, dtype)
        for given in (False, True):
            ref = quantize(w, "e4m3", g, backend="eager")
            scale = ref.scale * 1.25 if given else None
            if given:
                ref = quantize(w, "e4m3", g, scale=scale, backend="eager")
            out = torch.empty(shape, dtype=torch.float8_e4m3fn)
            q, stats = quantize_with_stats(w, "e4m3", g, scale=scale, out=out, backend="tiled")
            assert q.data.data_ptr() == out.data_ptr()
            assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)), (shape, given)
            assert torch.equal(q.scale, ref.scale), (shape, given)
            x = w.double()
            want = float((ref.dequantize().double() - x).norm() / x.norm())
            assert stats.relative_error == pytest.approx(want, rel=1e-5)
            assert stats.amax == float(w.float().abs().max())
            plain = quantize(w, "e4m3", g, scale=scale, backend="tiled")  # no statistics: the same payload
            assert torch.equal(plain.data.view(torch.uint8), ref.data.view(torch.uint8))


def test_payload_decode_is_exact_for_every_code():
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    out = torch.empty(256)
    decode_e4m3_unscaled_into(q, torch.empty(256, dtype=torch.int16), out)
    want = q.float()
    finite = ~want.isnan()
    assert torch.equal((out * 256)[finite].view(torch.int32), want[finite].view(torch.int32))


def test_tiles_follow_the_scale_grid():
    assert tiled.tile_shape(1000, 4096, Granularity.rows()) == (64, 4096)  # whole rows, 2^18 elements
    assert tiled.tile_shape(1000, 4096, Granularity.blocks(128, 128)) == (128, 2048)  # one block row high
    assert tiled.tile_shape(100, 4096, Granularity.tensor()) == (64, 4096)
    assert tiled.unsupported_reason(torch.empty(2, 2, device="meta")) is not None


NVFP4_AND_MX = [
    Granularity.nvfp4(),
    Granularity.nvfp4(scale_math="input"),
    Granularity.nvfp4(16, 16),
    Granularity.mx(32),
    Granularity.mx(32, rounding="even"),
]


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("tile", [1 << 18, 300])
@pytest.mark.parametrize("g", NVFP4_AND_MX, ids=lambda g: g.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp4_blocks_bit_identical_to_the_eager_backend(monkeypatch, tile, g, dtype):
    """E2M1 payloads with E4M3 (NVFP4: computed, given and shared global scales) and E8M0 block scales."""
    monkeypatch.setattr(tiled, "TILE_ELEMENTS", tile)
    for shape in [(16, 48), (130, 320), (257, 136), (3, 40)]:  # 40, 136: a partial block at the edge
        w = _weight(shape, dtype)
        w[1, :4] = torch.tensor([6.0, -5.0, 0.25, -0.0], dtype=dtype) * float(w.abs().max())  # ties, -0
        nv = g.scale_format == "e4m3"
        for given_global in [None, torch.tensor([123.5])] if nv else [None]:
            kw = {"global_scale": given_global} if nv else {}
            ref = quantize(w, "e2m1", g, backend="eager", **kw)
            out = torch.empty(shape, dtype=torch.uint8)
            q, stats = quantize_with_stats(w, "e2m1", g, out=out, backend="tiled", **kw)
            assert q.data.data_ptr() == out.data_ptr()
            assert torch.equal(q.data, ref.data), (shape, given_global)
            assert torch.equal(q.scale, ref.scale)
            assert (q.global_scale is None) == (ref.global_scale is None)
            if nv:
                assert torch.equal(q.global_scale, ref.global_scale)
                given = quantize(
                    w, "e2m1", g, scale=ref.scale, global_scale=ref.global_scale, backend="tiled"
                )
                assert torch.equal(given.data, ref.data)
            x = w.double()
            want = float((ref.dequantize().double() - x).norm() / x.norm())
            assert stats.relative_error == pytest.approx(want, rel=2e-5)
            assert stats.amax == float(w.float().abs().max())


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("tile", [1 << 18, 300])  # 300: column tiles for the 16 x 16 blocks
@pytest.mark.parametrize("g", NVFP4_AND_MX, ids=lambda g: g.name)
@pytest.mark.parametrize("backend", ["tiled", "eager"])
def test_fp4_codes_packed_into_a_half_size_out(monkeypatch, tile, g, backend):
    """A uint8 [R, C / 2] out takes the codes packed two a byte: pack_nibbles of the unpacked payload,
    bit for bit, the same scales and statistics; the packed tensor dequantizes as the unpacked one."""
    monkeypatch.setattr(tiled, "TILE_ELEMENTS", tile)
    for shape in [(130, 320), (3, 40)]:
        w = _weight(shape, torch.bfloat16)
        ref, ref_stats = quantize_with_stats(w, "e2m1", g, backend=backend)
        out = torch.full((shape[0], shape[1] // 2), 0xAA, dtype=torch.uint8)
        q, stats = quantize_with_stats(w, "e2m1", g, out=out, backend=backend)
        assert q.packed and not ref.packed and q.data.data_ptr() == out.data_ptr()
        assert torch.equal(q.data, pack_nibbles(ref.data)), shape
        assert torch.equal(q.codes(), ref.data) and torch.equal(q.scale, ref.scale)
        assert stats == ref_stats
        assert torch.equal(q.dequantize(), ref.dequantize())


def test_a_payload_out_of_neither_shape_is_refused():
    w = torch.randn(4, 64)
    for fmt, shape in [("e2m1", (4, 31)), ("e2m1", (2, 64)), ("e4m3", (4, 32))]:
        dtype = torch.float8_e4m3fn if fmt == "e4m3" else torch.uint8
        with pytest.raises(MixprecError, match="out must be a contiguous"):
            quantize_with_stats(w, fmt, Granularity.mx(32), out=torch.empty(shape, dtype=dtype))


def test_fp4_tiles_refuse_nan_and_saturate_infinities():
    w = torch.randn(4, 64)
    w[2, 5] = math.nan
    with pytest.raises(MixprecError, match="NaN"):
        quantize(w, "e2m1", Granularity.nvfp4(), backend="tiled")
    w[2, 5] = math.inf
    for g in (Granularity.nvfp4(), Granularity.mx(32)):
        ref, got = (quantize(w, "e2m1", g, backend=b) for b in ("eager", "tiled"))
        assert torch.equal(got.data, ref.data) and torch.equal(got.scale, ref.scale)


def test_auto_quantizes_big_nvfp4_weights_in_tiles(monkeypatch):
    from mixprec.quantization import choose_backend

    g = Granularity.nvfp4()
    small = torch.empty(16, 64)
    assert choose_backend(small, "e2m1", g) == (
        "tiled" if c_quantize.unavailable_reason() is None else "eager"
    )
    monkeypatch.setattr(c_quantize, "takes", lambda *a: False)  # without the compiled C: by size
    assert choose_backend(small, "e2m1", g) == "eager"
    assert choose_backend(torch.empty(1024, tiled.NVFP4_TILED_MIN_ELEMENTS // 1024), "e2m1", g) == "tiled"
