"""quantize_traceable: bit-identical to scaling.quantize, and torch.compile traces it with no graph break."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.errors import MixprecError
from mixprec.kernels.compiled import assert_compiles_fullgraph, graph_break_report
from mixprec.kernels.traceable import quantize_traceable
from mixprec.scaling import Granularity, quantize

G = Granularity
GRANULARITIES = [
    G.tensor(),
    G.rows(),
    G.columns(),
    G.blocks(1, 128),
    G.blocks(128, 1),
    G.blocks(128, 128),
    G.blocks(32, 64),
    G.mx(32),
    G.mx(32, axis=0),
    G.mx(32, rounding="rceil"),
]


def _awkward(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(37, 300, generator=gen) * torch.logspace(-3, 3, 300)
    x[3, 5], x[4, 7], x[5, 0] = math.inf, -math.inf, math.nan
    x[7, :] = 0.0
    x[9, :] = torch.randn(300, generator=gen) * 1e-41
    return x


def _same(a, b) -> bool:
    return torch.equal(a.scale, b.scale) and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("g", GRANULARITIES, ids=lambda g: g.name)
def test_eager_bit_identical(fmt, g):
    x = _awkward()
    assert _same(quantize(x, fmt, g), quantize_traceable(x, fmt, g))
    assert _same(quantize(x.bfloat16(), fmt, g), quantize_traceable(x.bfloat16(), fmt, g))
    if g.scale_format == "fp32":
        for kw in ({"power_of_two": True}, {"margin": 2}):
            assert _same(quantize(x, fmt, g, **kw), quantize_traceable(x, fmt, g, **kw))
        s = quantize(x, fmt, g).scale * 2
        assert _same(quantize(x, fmt, g, scale=s), quantize_traceable(x, fmt, g, scale=s))


def test_refuses_formats_without_a_torch_dtype():
    with pytest.raises(MixprecError):
        quantize_traceable(torch.randn(4, 32), "e2m1", G.mx(32))


def test_no_graph_breaks_and_fullgraph():
    def fn(x):
        outs = []
        for g in (G.tensor(), G.rows(), G.blocks(1, 128), G.blocks(128, 128), G.mx(32)):
            q = quantize_traceable(x, "e4m3", g)
            outs += [q.data, q.scale]
        return outs

    x = _awkward(1)
    report = graph_break_report(fn, x)
    assert report["graph_breaks"] == 0, report["reasons"]
    assert report["graphs"] == 1
    outs = assert_compiles_fullgraph(fn, x)
    ref = fn(x)
    assert all(
        torch.equal(
            a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
            b.view(torch.uint8) if b.dtype.itemsize == 1 else b,
        )
        for a, b in zip(outs, ref)
    )


def test_scaling_quantize_itself_breaks_the_graph():
    """Why quantize_traceable exists: the foundation's quantize asks data-dependent questions."""
    report = graph_break_report(lambda x: quantize(x, "e4m3", G.rows()).data, torch.randn(8, 64))
    assert report["graph_breaks"] >= 1
