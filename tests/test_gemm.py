"""The FP8 GEMM seam: scaled_mm emulated vs an fp64 reference and vs the native CPU kernel; transposed
operands re-viewed from symmetric blockings; layouts no kernel runs are refused. (The operands come
from mixprec.quantization, tested in tests/test_quantization*.py.)"""

from __future__ import annotations

import pytest
import torch

from mixprec.errors import MixprecError
from mixprec.formats import E4M3, E5M2, decode
from mixprec.gemm import dequantize_blockwise, scaled_mm, transpose_quantized, with_decoded
from mixprec.kernels.hardware import detect
from mixprec.quantization import quantize
from mixprec.scaling import Granularity, QuantizedTensor, expand_scale


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("g", [Granularity.tensor(), Granularity.blocks(128, 128)], ids=lambda g: g.name)
def test_transpose_quantized_reuses_symmetric_blocks(gen, g):
    x = torch.randn(300, 200, generator=gen)
    got = transpose_quantized(quantize(x, E4M3, g))
    want = quantize(x.t().contiguous(), E4M3, g)
    assert torch.equal(got.scale, want.scale) and _bits_equal(got.data.contiguous(), want.data)
    with pytest.raises(MixprecError, match="re-quantize"):
        transpose_quantized(quantize(x, E4M3, Granularity.rows()))


def _fp64_reference(qa, qb, bias=None):
    out = qa.dequantize(torch.float64).reshape(-1, qa.data.shape[1]) @ qb.dequantize(torch.float64).t()
    return out if bias is None else out + bias.double()


PAIRS = [
    (Granularity.tensor(), Granularity.tensor()),
    (Granularity.rows(), Granularity.rows()),
    (Granularity.rows(), Granularity.tensor()),
    (Granularity.blocks(1, 128), Granularity.blocks(128, 128)),
    (Granularity.blocks(1, 128), Granularity.blocks(1, 128)),
    (Granularity.mx(32), Granularity.mx(32)),
]


@pytest.mark.parametrize("ga,gb", PAIRS, ids=lambda g: g.name)
def test_emulated_matches_fp64_reference(gen, ga, gb):
    a = torch.randn(70, 300, generator=gen) * torch.logspace(-2, 2, 70)[:, None]
    b = torch.randn(90, 300, generator=gen)
    bias = torch.randn(90, generator=gen)
    qa, qb = quantize(a, E4M3, ga), quantize(b, E5M2, gb)
    out = scaled_mm(qa, qb, bias=bias, backend="emulated")
    ref = _fp64_reference(qa, qb, bias)
    assert out.dtype == torch.float32 and out.shape == (70, 90)
    # fp32 accumulation of 300 products: a few ulps of the largest partial sums
    scale = (
        qa.dequantize(torch.float64).abs() @ qb.dequantize(torch.float64).abs().t()
    ) + bias.double().abs()
    assert ((out.double() - ref).abs() <= 1e-5 * scale).all()
    bf = scaled_mm(qa, qb, bias=bias, out_dtype=torch.bfloat16, backend="emulated")
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, out.to(torch.bfloat16))


def test_leading_dims_are_kept(gen):
    qa = quantize(torch.randn(2, 3, 64, generator=gen), E4M3, Granularity.rows())
    qb = quantize(torch.randn(32, 64, generator=gen), E4M3)
    assert scaled_mm(qa, qb).shape == (2, 3, 32)


@pytest.mark.skipif(not detect().scaled_mm_cpu, reason="torch._scaled_mm does not run on this CPU build")
@pytest.mark.parametrize("ga", [Granularity.tensor(), Granularity.rows()], ids=lambda g: g.name)
@pytest.mark.parametrize("fmts", [(E4M3, E4M3), (E5M2, E4M3)], ids=lambda f: f"{f[0].name}x{f[1].name}")
def test_native_cpu_agrees_with_emulation(gen, ga, fmts):
    # tiny: torch's CPU _scaled_mm is a slow reference loop
    a = torch.randn(32, 64, generator=gen) * torch.logspace(-2, 2, 32)[:, None]
    b = torch.randn(48, 64, generator=gen)
    qa, qb = quantize(a, fmts[0], ga), quantize(b, fmts[1], ga)
    emu = scaled_mm(qa, qb, backend="emulated")
    nat = scaled_mm(qa, qb, backend="native")
    mag = qa.dequantize().abs() @ qb.dequantize().abs().t()
    assert ((emu - nat).abs() <= 1e-5 * mag).all()
    assert scaled_mm(qa, qb, backend="auto").equal(emu)  # auto emulates on CPU (native is a slow loop here)


def test_bad_layouts_and_arguments_are_refused(gen):
    a = torch.randn(64, 256, generator=gen)
    b = torch.randn(32, 256, generator=gen)
    qb = quantize(b, E4M3)
    for g in (Granularity.columns(), Granularity.blocks(128, 1), Granularity.mx(32, axis=0)):
        with pytest.raises(MixprecError, match="vary along K"):
            scaled_mm(quantize(a, E4M3, g), qb)
    with pytest.raises(MixprecError, match="K differs"):
        scaled_mm(quantize(a[:, :128], E4M3), qb)
    with pytest.raises(MixprecError, match="backend"):
        scaled_mm(quantize(a, E4M3), qb, backend="fast")
    with pytest.raises(MixprecError, match="native backend unavailable"):
        scaled_mm(
            quantize(a, E4M3, Granularity.blocks(1, 128)),
            quantize(b, E4M3, Granularity.blocks(128, 128)),
            backend="native",
        )
    with pytest.raises(MixprecError, match="QuantizedTensor"):
        scaled_mm(a, qb)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ga,gb", PAIRS[:2] + PAIRS[3:4], ids=lambda g: g.name)
def test_native_cuda_agrees_with_emulation(ga, gb):
    if not detect().fp8_native:
        pytest.skip("no FP8 tensor cores")
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(256, 512, device="cuda", generator=gen)
    b = torch.randn(384, 512, device="cuda", generator=gen)
    qa, qb = quantize(a, E4M3, ga), quantize(b, E4M3, gb)
    emu = scaled_mm(qa, qb, backend="emulated", out_dtype=torch.float32)
    try:
        nat = scaled_mm(qa, qb, backend="native", out_dtype=torch.bfloat16).float()
    except MixprecError as exc:
        pytest.skip(str(exc))
    mag = qa.dequantize().abs() @ qb.dequantize().abs().t()
    assert ((emu - nat).abs() <= 2**-8 * mag + 1e-6).all()


@pytest.mark.parametrize("granularity", [Granularity.tensor(), Granularity.rows()], ids=["tensor", "rows"])
@pytest.mark.parametrize("magnitude", [1e-12, 1.0, 1e12, 1e30])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_folding_the_cpu_decode_factor_into_the_scales_changes_no_bit(granularity, magnitude, out_dtype):
    # the CPU decodes E4M3 as values * 2^-8 and moves 2^16 into the scales (formats.decode_unscaled);
    # operands that carry their exactly decoded values take the plain path: both must agree bit for bit
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, 96, generator=gen) * magnitude
    w = torch.randn(48, 96, generator=gen) * magnitude
    bias = torch.randn(48, generator=gen)
    qa, qb = quantize(x, E4M3, granularity), quantize(w, E4M3, granularity)
    for b in (None, bias):
        folded = scaled_mm(qa, qb, out_dtype=out_dtype, bias=b, backend="emulated")
        exact = scaled_mm(with_decoded(qa), with_decoded(qb), out_dtype=out_dtype, bias=b, backend="emulated")
        assert torch.equal(folded.view(torch.int16 if out_dtype != torch.float32 else torch.int32),
                           exact.view(torch.int16 if out_dtype != torch.float32 else torch.int32))  # fmt: skip


@pytest.mark.parametrize(
    "granularity",
    [Granularity.blocks(1, 128), Granularity.blocks(128, 128), Granularity.mx(32)],
    ids=lambda g: g.name,
)
@pytest.mark.parametrize("magnitude", [1e-12, 1.0, 1e12])
@pytest.mark.parametrize("transposed", [False, True])
def test_blockwise_dequantization_with_the_folded_decode_factor_is_exact(granularity, magnitude, transposed):
    # dequantize_blockwise multiplies the CPU decode (values * 2^-8) by scale * 2^8: the same products
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(256, 384, generator=gen) * magnitude
    q = quantize(x, E4M3, granularity)
    if transposed:  # a transposed payload view with the transposed grid, as the backward GEMMs use
        q = QuantizedTensor(
            q.data.t(), q.scale.t().contiguous(), q.fmt, granularity.transposed(), q.data.t().shape
        )
    rows, cols = q.data.shape
    want = decode(q.data, E4M3) * expand_scale(q.scale, q.granularity, rows, cols)
    assert torch.equal(dequantize_blockwise(q).view(torch.int32), want.view(torch.int32))
