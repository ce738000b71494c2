"""The tiled backend of the quantize entry gives the eager backend's payloads and scales bit for bit, with
many tiles (column tiles for blocks) as with one, and the statistics it computes from the same pass
(amax, relative error within 1e-5 relative of the float64 reference)."""

from __future__ import annotations

import pytest
import torch

from mixprec.formats import decode_e4m3_unscaled_into
from mixprec.kernels import tiled
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
