"""The traceable backend: bit-identical to the eager one, and torch.compile traces the quantize entry
(which picks it there) with no graph break."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.errors import MixprecError
from mixprec.kernels.compiled import assert_compiles_fullgraph, graph_break_report
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

    def traceable(t, **kw):
        return quantize(t, fmt, g, backend="traceable", **kw)

    assert _same(quantize(x, fmt, g, backend="eager"), traceable(x))
    assert _same(quantize(x.bfloat16(), fmt, g, backend="eager"), traceable(x.bfloat16()))
    if g.scale_format == "fp32":
        for kw in ({"power_of_two": True}, {"margin": 2}):
            assert _same(quantize(x, fmt, g, backend="eager", **kw), traceable(x, **kw))
        s = quantize(x, fmt, g).scale * 2
        assert _same(quantize(x, fmt, g, backend="eager", scale=s), traceable(x, scale=s))


def test_refuses_nan_in_formats_without_a_nan_code():
    x = torch.randn(4, 32)
    x[1, 2] = math.nan
    with pytest.raises(MixprecError, match="NaN"):
        quantize(x, "e2m1", G.mx(32), backend="traceable")


def test_no_graph_breaks_and_fullgraph():
    def fn(x):
        outs = []
        for g in (G.tensor(), G.rows(), G.blocks(1, 128), G.blocks(128, 128), G.mx(32)):
            q = quantize(x, "e4m3", g)  # the entry picks the traceable backend under torch.compile
            outs += [q.data, q.scale]
        s = torch.full((1, 1), 0.5)
        outs.append(quantize(x, "e4m3", scale=s).data)  # a given scale: not validated in a graph
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


def test_the_eager_backend_breaks_the_graph():
    """Why the traceable backend exists: the eager one asks data-dependent questions."""
    report = graph_break_report(
        lambda x: quantize(x, "e4m3", G.rows(), backend="eager").data, torch.randn(8, 64)
    )
    assert report["graph_breaks"] >= 1
