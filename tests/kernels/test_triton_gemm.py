"""The Triton blockwise FP8 GEMM equals the fp64 product of the dequantized operands up to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from mixprec.errors import MixprecError
from mixprec.quantization import quantize
from mixprec.scaling import Granularity

G = Granularity


@pytest.fixture(scope="module")
def tg(kernel_device):
    from mixprec.kernels import triton_blockwise_gemm

    return triton_blockwise_gemm


@pytest.mark.parametrize(
    "ga,gb",
    [
        (G.blocks(1, 128), G.blocks(128, 128)),
        (G.blocks(1, 128), G.blocks(1, 128)),
        (G.blocks(128, 128), G.blocks(128, 128)),
    ],
    ids=["1x128_128x128", "1x128_1x128", "128x128_128x128"],
)
def test_matches_fp64_reference(tg, kernel_device, ga, gb):
    gen = torch.Generator().manual_seed(0)
    m, n, k = 70, 40, 300  # K not a multiple of 128: a partial last K-block
    x = torch.randn(m, k, generator=gen) * 4
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen)
    qa, qb = quantize(x, "e4m3", ga), quantize(w, "e4m3", gb)
    ref = qa.dequantize().double() @ qb.dequantize().double().t() + bias.double()
    on = lambda q: type(q)(q.data.to(kernel_device), q.scale.to(kernel_device), q.fmt, q.granularity, q.shape)  # noqa: E731
    out = tg.blockwise_mm(on(qa), on(qb), bias=bias.to(kernel_device), block_m=32, block_n=32)
    err = float((out.double().cpu() - ref).norm() / ref.norm())
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert err < 1e-6, err  # fp32 accumulation order only


def test_refuses_other_layouts(tg, kernel_device):
    q = quantize(torch.randn(8, 128), "e4m3", G.rows())
    assert not tg.supports(q, q)
    with pytest.raises(MixprecError):
        tg.blockwise_mm(q, q)
