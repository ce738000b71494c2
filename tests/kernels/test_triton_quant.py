"""The triton backend of the quantize entry is bit-identical to the eager one (interpreter on CPU, GPU on CUDA)."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.errors import MixprecError
from mixprec.quantization import quantize
from mixprec.scaling import Granularity

G = Granularity
GRANULARITIES = [
    G.tensor(),
    G.rows(),
    G.columns(),
    G.blocks(1, 128),
    G.blocks(128, 1),
    G.blocks(128, 128),
    G.blocks(32, 64),
    G.blocks(None, 64),
    G.mx(32),
    G.mx(32, axis=0),
    G.mx(32, rounding="rceil"),
]


@pytest.fixture(scope="module")
def tq(kernel_device):
    from mixprec.kernels import triton_quant

    return triton_quant


def _awkward(rows: int, cols: int, device: str, seed: int = 0) -> torch.Tensor:
    """Wide dynamic range per column, edge blocks, and the special values quantize must handle."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 3, cols)
    x[3, 5], x[4, 7], x[5, 0], x[6, 1] = math.inf, -math.inf, math.nan, -math.nan
    x[7, :] = 0.0
    x[8, 9] = -0.0
    x[9, :] = torch.randn(cols, generator=gen) * 1e-41  # fp32 subnormals
    return x.to(device)


def _eager(x, fmt, g=None, **kw):
    return quantize(x, fmt, g, backend="eager", **kw)


def _triton(x, fmt, g=None, **kw):
    return quantize(x, fmt, g, backend="triton", **kw)


def _assert_same(a, b):
    assert torch.equal(a.scale.cpu(), b.scale.cpu()), "scales differ"
    assert torch.equal(a.data.cpu().view(torch.uint8), b.data.cpu().view(torch.uint8)), "payloads differ"
    assert a.granularity == b.granularity and a.fmt == b.fmt and a.shape == b.shape


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("g", GRANULARITIES, ids=lambda g: g.name)
def test_bit_identical_to_the_eager_backend(tq, kernel_device, fmt, g):
    x = _awkward(37, 300, kernel_device)
    _assert_same(_eager(x, fmt, g), _triton(x, fmt, g))
    xb = x.bfloat16()
    _assert_same(_eager(xb, fmt, g), _triton(xb, fmt, g))


@pytest.mark.parametrize(
    "g", [G.tensor(), G.rows(), G.blocks(1, 128), G.blocks(128, 128)], ids=lambda g: g.name
)
@pytest.mark.parametrize("kw", [{"power_of_two": True}, {"margin": 2}], ids=["pow2", "margin2"])
def test_scale_options(tq, kernel_device, g, kw):
    x = _awkward(37, 300, kernel_device, seed=1)
    _assert_same(_eager(x, "e4m3", g, **kw), _triton(x, "e4m3", g, **kw))


def test_given_scales_and_long_rows(tq, kernel_device):
    x = _awkward(37, 300, kernel_device, seed=2)
    s = _eager(x, "e4m3", G.rows()).scale * 3
    _assert_same(_eager(x, "e4m3", G.rows(), scale=s), _triton(x, "e4m3", G.rows(), scale=s))
    t = torch.tensor(0.5)
    _assert_same(_eager(x, "e5m2", scale=t), _triton(x, "e5m2", scale=t))
    long_rows = torch.randn(3, tq.SUB_TILE + 900, device=kernel_device)  # one program, two pieces per row
    wide = torch.randn(
        2, tq.MAX_TILE + 300, device=kernel_device
    )  # rows wider than one program: amax then cast
    for t in (long_rows, wide):
        for g in (G.rows(), G.tensor()):
            _assert_same(_eager(t, "e4m3", g), _triton(t, "e4m3", g))


def test_tiny_amax_edge_cases(tq, kernel_device):
    """Subnormal amax: scale underflow guards, power-of-two rounding of 0, E8M0 clamping."""
    gen = torch.Generator().manual_seed(3)
    t = torch.randn(4, 64, generator=gen) * 1e-40
    t[1] *= 1e-5  # amax of a few ulps of the smallest subnormal: amax / 448 rounds to 0
    t = t.to(kernel_device)
    for g, kw in [
        (G.rows(), {}),
        (G.rows(), {"power_of_two": True}),
        (G.mx(32), {}),
        (G.mx(32, rounding="rceil"), {}),
    ]:
        _assert_same(_eager(t, "e4m3", g, **kw), _triton(t, "e4m3", g, **kw))


def test_shapes_and_dtypes(tq, kernel_device):
    x3 = torch.randn(2, 3, 64, device=kernel_device)
    _assert_same(_eager(x3, "e4m3", G.blocks(1, 32)), _triton(x3, "e4m3", G.blocks(1, 32)))
    xt = torch.randn(64, 48, device=kernel_device).t()  # non-contiguous
    _assert_same(_eager(xt, "e4m3", G.columns()), _triton(xt, "e4m3", G.columns()))
    x64 = torch.randn(8, 32, dtype=torch.float64, device=kernel_device)
    _assert_same(_eager(x64, "e4m3", G.rows()), _triton(x64, "e4m3", G.rows()))
    x = torch.randn(8, 32, device=kernel_device)
    before = x.clone()
    _triton(x, "e4m3", G.rows())
    assert torch.equal(x, before)  # input untouched


def test_refusals(tq, kernel_device):
    x = torch.randn(8, 96, device=kernel_device)
    assert tq.unsupported_reason(x, "e2m1", G.mx(32)) is not None
    assert tq.unsupported_reason(x, "e4m3", G.blocks(1, 96)) is not None
    with pytest.raises(MixprecError):
        _triton(x, "e4m3", G.blocks(1, 96))
    with pytest.raises(MixprecError):
        _triton(torch.empty(0, 8, device=kernel_device), "e4m3")
