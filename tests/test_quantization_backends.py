"""Every quantize backend available on this CPU gives the eager backend's payloads and scales, bit for bit.

The eager backend is held to the reference loops in tests/test_quantization.py; here "traceable",
"tiled" (with small tiles: many of them, column tiles for blocks), "compiled" (where a C++ compiler
works; a few configurations, each compiles for seconds) and "triton" (in Triton's interpreter where
triton is installed, as tests/kernels does) are compared with it over formats x granularities x shapes:
edge blocks, 3-D and bf16/fp64 inputs, computed and given scales, power-of-two scales with a margin,
inf/-inf/-0/subnormals/zero rows, and NaN (kept by FP8, refused by FP6/FP4 in every backend).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re

import pytest
import torch

from mixprec.errors import MixprecError
from mixprec.formats import E2M1, E3M2, E4M3, E5M2
from mixprec.kernels import c_quantize, compiled, tiled
from mixprec.quantization import backend_available, choose_backend, quantize
from mixprec.scaling import Granularity

HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels (at their import)

G = Granularity
GRANULARITIES = [
    G.tensor(),
    G.rows(),
    G.columns(),
    G.blocks(1, 128),
    G.blocks(128, 1),
    G.blocks(128, 128),
    G.blocks(32, 64),
    G.blocks(3, 5),
    G.mx(32),
    G.mx(32, axis=0),
    G.mx(32, rounding="rceil"),
]
FORMATS = [E4M3, E5M2, E3M2, E2M1]
SHAPES = [(37, 300), (130, 64), (2, 4, 64)]  # edge blocks everywhere; a 3-D input


def _data(shape: tuple[int, ...], seed: int = 0, nan: bool = True) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    x2 = x.view(-1, shape[-1])
    x2.mul_(torch.logspace(-3, 3, shape[-1]))  # wide dynamic range along the rows
    x2[3, 5], x2[4, 7], x2[6, 1] = math.inf, -math.inf, -0.0
    if nan:
        x2[5, 0] = math.nan
    x2[1, :] = 0.0  # a zero row: zero blocks for every blocking
    x2[2, :] = torch.randn(shape[-1], generator=gen) * 1e-41  # fp32 subnormals
    return x


def _same(a, b) -> bool:
    return (
        torch.equal(a.scale.cpu(), b.scale.cpu())
        and a.data.dtype == b.data.dtype
        and torch.equal(a.data.cpu().view(torch.uint8), b.data.cpu().view(torch.uint8))
        and (a.fmt, a.granularity, a.shape) == (b.fmt, b.granularity, b.shape)
    )


def _check(backend: str, x: torch.Tensor, fmt, g, **kw) -> None:
    """The backend's result is eager's; or both refuse alike (NaN in FP6/FP4); or it says why not."""
    ok, why = backend_available(backend, x, fmt, g)
    if not ok:
        with pytest.raises(MixprecError, match=f"unavailable: {re.escape(why)}"):
            quantize(x, fmt, g, backend=backend, **kw)
        return
    try:
        want = quantize(x, fmt, g, backend="eager", **kw)
    except MixprecError as e:
        with pytest.raises(MixprecError, match=re.escape(str(e))):
            quantize(x, fmt, g, backend=backend, **kw)
        return
    got = quantize(x, fmt, g, backend=backend, **kw)
    assert _same(want, got), (backend, fmt.name, g.name, tuple(x.shape), x.dtype, kw)


def _check_options(backend: str, x: torch.Tensor, fmt, g) -> None:
    _check(backend, x, fmt, g)
    if g.scale_format == "fp32":
        _check(backend, x, fmt, g, power_of_two=True, margin=1)
    finite = torch.where(torch.isnan(x), 0.0, x) if fmt.torch_dtype is None else x
    given = quantize(finite, fmt, g, backend="eager").scale * 1.5  # delayed / static scaling
    _check(backend, x, fmt, g, scale=given)


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(tiled, "TILE_ELEMENTS", 500)


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize("backend", ["traceable", "tiled"])
@pytest.mark.parametrize("g", GRANULARITIES, ids=lambda g: g.name)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_backend_is_bit_identical_to_eager(backend, fmt, g):
    for i, shape in enumerate(SHAPES):
        x = _data(shape, seed=i)
        _check_options(backend, x, fmt, g)
        _check(backend, x.bfloat16(), fmt, g)
        if fmt.torch_dtype is None:  # FP6/FP4: NaN refused above; the same data without it
            _check_options(backend, _data(shape, seed=i, nan=False), fmt, g)
    _check(backend, _data((37, 300), nan=False).double(), fmt, g)  # fp64 rounds to fp32 once


@pytest.mark.slow
def test_compiled_backend_is_bit_identical_to_eager():
    if not compiled.available():
        pytest.skip("torch.compile cannot build CPU code on this machine")
    x = _data((32, 96), seed=8)
    for fmt, g, kw in (
        (E4M3, G.rows(), {}),
        (E2M1, G.mx(32), {}),
        (E5M2, G.blocks(16, 32), {"power_of_two": True, "margin": 1}),
    ):
        data = x if fmt.torch_dtype is not None else torch.where(torch.isnan(x), 0.0, x)
        _check("compiled", data, fmt, g, **kw)
    _check("compiled", x, E4M3, G.tensor(), scale=torch.tensor(0.25))
    with pytest.raises(MixprecError, match="NaN"):  # the same configuration: no new compile
        quantize(x, E2M1, G.mx(32), backend="compiled")
    for odd in (x[:, :90], x[:31], x.double()):  # partial vectors, edge blocks, fp64: declined, with why
        ok, why = backend_available("compiled", odd, E4M3, G.blocks(16, 32))
        assert not ok and why
        _check("compiled", odd, E4M3, G.blocks(16, 32))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize(
    "fmt,g",
    [(E4M3, g) for g in GRANULARITIES if g.name != "block3x5"] + [(E5M2, G.tensor()), (E5M2, G.mx(32))],
    ids=lambda v: v.name,
)
def test_triton_backend_is_bit_identical_to_eager(fmt, g):
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = _data((37, 300)).to(device)
    _check_options("triton", x, fmt, g)
    _check("triton", x.bfloat16(), fmt, g)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_backend_declines_what_its_kernels_do_not_cover():
    x = _data((8, 96))
    for fmt, g in ((E2M1, G.mx(32)), (E4M3, G.blocks(3, 5))):
        ok, why = backend_available("triton", x, fmt, g)
        assert not ok and why
        with pytest.raises(MixprecError, match="unavailable"):
            quantize(x, fmt, g, backend="triton")


def test_auto_picks_by_capability_and_size(monkeypatch):
    small = torch.randn(16, 64)
    compiled_fp8 = c_quantize.unavailable_reason() is None  # FP8 that the compiled C takes: tiled at any size
    assert choose_backend(small, E4M3, G.rows()) == ("tiled" if compiled_fp8 else "eager")
    assert choose_backend(small.half(), E4M3, G.rows()) == "eager"  # fp16: not taken by the C
    monkeypatch.setattr(c_quantize, "takes", lambda *a: False)
    assert choose_backend(small, E4M3, G.rows()) == "eager"
    monkeypatch.setattr(tiled, "TILED_MIN_ELEMENTS", small.numel())
    assert choose_backend(small, E4M3, G.rows()) == "tiled"
    assert choose_backend(small, E2M1, G.mx(32)) == "tiled"

    def traced(x):
        assert choose_backend(x, E4M3, G.rows()) == "traceable"
        return x

    torch.compile(traced, backend="eager", fullgraph=True)(small)
