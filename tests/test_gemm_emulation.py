"""The emulated GEMM on the bf16 units (mixprec.kernels.emulation, mixprec.gemm): forced on every CPU.

On a CPU without native bf16 the forced backend runs the same operand construction with fp32
arithmetic, so these tests check on every machine kind what the bf16 GEMM is handed (every operand
exact in bf16), how the scales are applied (per row, per K-chunk, global divisors) and the results:
bit-identical to the fp32 backend where the fp32 sums are exact, within the fp32 summation bound of an
fp64 reference everywhere. The rest of the suite pins the fp32 backend (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from mixprec import gemm
from mixprec.errors import MixprecError
from mixprec.formats import decode
from mixprec.gemm import scaled_mm
from mixprec.kernels import emulation
from mixprec.quantization import quantize
from mixprec.scaling import Granularity

pytestmark = pytest.mark.usefixtures("single_thread")

CASES = {  # name: (format of a, granularity of a, format of b, granularity of b)
    "per-tensor e4m3": ("e4m3", Granularity.tensor(), "e4m3", Granularity.tensor()),
    "rowwise e4m3": ("e4m3", Granularity.rows(), "e4m3", Granularity.rows()),
    "e5m2 x e4m3": ("e5m2", Granularity.tensor(), "e4m3", Granularity.tensor()),
    "1x128 x 128x128": ("e4m3", Granularity.blocks(1, 128), "e4m3", Granularity.blocks(128, 128)),
    "1x128 x 1x128": ("e4m3", Granularity.blocks(1, 128), "e4m3", Granularity.blocks(1, 128)),
    "1x128 x rowwise": ("e4m3", Granularity.blocks(1, 128), "e4m3", Granularity.rows()),
    "1x96 x 1x128": ("e4m3", Granularity.blocks(1, 96), "e4m3", Granularity.blocks(1, 128)),  # chunks of 32
    "mxfp8": ("e4m3", Granularity.mx(), "e4m3", Granularity.mx()),
    "mxfp4": ("e2m1", Granularity.mx(), "e2m1", Granularity.mx()),
    "nvfp4": ("e2m1", Granularity.nvfp4(), "e2m1", Granularity.nvfp4()),
    "nvfp4 16x16": ("e2m1", Granularity.nvfp4(), "e2m1", Granularity.nvfp4(16, 16)),
}


def _operands(case: str, m: int, n: int, k: int, gen: torch.Generator):
    fa, ga, fb, gb = CASES[case]
    x = torch.randn(m, k, generator=gen) * 3
    w = torch.randn(n, k, generator=gen) / 5
    return quantize(x, fa, ga), quantize(w, fb, gb)


def _reference(a, b) -> torch.Tensor:
    return a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()


def _bound(a, b, k: int) -> torch.Tensor:
    """fp32 summation (and one rounding per scaled value or partial) of K terms: (K + 4) * 2^-24 * sum |a||b|."""
    magnitude = a.dequantize(torch.float64).abs() @ b.dequantize(torch.float64).abs().t()
    return (k + 4) * 2.0**-24 * magnitude + 1e-30


@pytest.fixture
def checked_operands(monkeypatch):
    """Every matmul of the bf16 backend gets operands exact in bf16; counts the calls."""
    calls = []
    original = gemm._matmul

    def checking(arith, x, y, op=torch.mm, bf16_out=False):
        if arith == "bf16":
            assert emulation.is_bf16_exact(x), "left operand not exact in bf16"
            assert emulation.is_bf16_exact(y), "right operand not exact in bf16"
            calls.append((tuple(x.shape), tuple(y.shape), bf16_out))
        return original(arith, x, y, op, bf16_out)

    monkeypatch.setattr(gemm, "_matmul", checking)
    return calls


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("k", [256, 200])
def test_bf16_backend_operands_are_exact_and_results_within_bound(case, k, gen, checked_operands):
    a, b = _operands(case, 48, 64, k, gen)
    with emulation.forced("bf16"):
        out = scaled_mm(a, b)
    assert checked_operands, "the bf16 backend ran no GEMM of its own"
    ref = _reference(a, b)
    assert bool(((out.double() - ref).abs() <= _bound(a, b, k)).all())
    with emulation.forced("fp32"):
        fp32 = scaled_mm(a, b)
    assert bool(((fp32.double() - ref).abs() <= _bound(a, b, k)).all())


def test_blockwise_scales_multiply_fp32_partials_per_k_chunk(gen, checked_operands):
    a, b = _operands("1x128 x 128x128", 32, 256, 512, gen)
    with emulation.forced("bf16"):
        scaled_mm(a, b)
    assert checked_operands == [((4, 32, 128), (4, 128, 256), False)]  # one batched GEMM over 4 K-chunks


def test_fp4_with_k_uniform_scales_is_exact_then_scaled_once(gen):
    # E2M1 products are multiples of 1/4 up to 36: any order of fp32 sums is exact for these K, so
    # the bf16 backend gives the exact sums times the scales, each multiplication rounded once: per
    # row bit-identical to the fp32 backend; per tensor the correctly rounded fl(sum * alpha), where
    # the fp32 backend's BLAS alpha may differ in the last bit
    for g in (Granularity.tensor(), Granularity.rows()):
        a = quantize(torch.randn(40, 1024, generator=gen), "e2m1", g)
        b = quantize(torch.randn(24, 1024, generator=gen), "e2m1", g)
        with emulation.forced("bf16"):
            bf16 = scaled_mm(a, b)
        sums = (decode(a.data, a.fmt).double() @ decode(b.data, b.fmt).double().t()).float()
        sa, sb = a.scale.float(), b.scale.float().t()
        expected = sums * (sa * sb) if g == Granularity.tensor() else sums * sa * sb
        assert torch.equal(bf16, expected)
        with emulation.forced("fp32"):
            fp32 = scaled_mm(a, b)
        if g == Granularity.rows():
            assert torch.equal(bf16, fp32)


@pytest.mark.parametrize("case", ["mxfp4", "mxfp8", "rowwise e4m3"])
def test_exact_sums_are_bit_identical(case, gen):
    # integers up to 16 are E4M3 and E2M1-times-power-of-two values; their products' sums stay below 2^24
    fa, ga, fb, gb = CASES[case]
    top = 6 if fa == "e2m1" else 16
    x = torch.randint(-top, top + 1, (32, 512), generator=gen).float()
    w = torch.randint(-top, top + 1, (48, 512), generator=gen).float()
    x[:, 0], w[:, 0] = top, top  # every block holds the amax: one scale for all
    a, b = quantize(x, fa, ga), quantize(w, fb, gb)
    with emulation.forced("fp32"):
        fp32 = scaled_mm(a, b)
    with emulation.forced("bf16"):
        bf16 = scaled_mm(a, b)
    assert torch.equal(bf16, fp32)


@pytest.mark.parametrize("case", ["mxfp4", "mxfp8"])
def test_bf16_output_comes_from_the_bf16_gemm_when_no_scale_is_left(case, gen, checked_operands):
    # MX scales sit inside the operands: with a bf16 output and no bias the GEMM rounds its own fp32
    # sums to bf16 (one rounding, as the fp32 path's cast): bit-identical where the sums are exact
    fa, ga, fb, gb = CASES[case]
    top = 6 if fa == "e2m1" else 16
    x = torch.randint(-top, top + 1, (32, 512), generator=gen).float()
    w = torch.randint(-top, top + 1, (48, 512), generator=gen).float()
    x[:, ::32], w[:, ::32] = top, top  # every block holds the amax: one scale for all
    a, b = quantize(x, fa, ga), quantize(w, fb, gb)
    with emulation.forced("fp32"):
        fp32 = scaled_mm(a, b, out_dtype=torch.bfloat16)
    with emulation.forced("bf16"):
        bf16 = scaled_mm(a, b, out_dtype=torch.bfloat16)
    assert checked_operands == [((32, 512), (512, 48), True)]
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, fp32)
    # random operands: within the fp32 summation bound plus the one bf16 rounding of the result
    a, b = _operands(case, 40, 24, 256, gen)
    with emulation.forced("bf16"):
        out = scaled_mm(a, b, out_dtype=torch.bfloat16).double()
    ref = _reference(a, b)
    assert bool(((out - ref).abs() <= _bound(a, b, 256) + ref.abs() * 2.0**-8).all())


@pytest.mark.parametrize("bias", [True, False])
def test_outputs_that_need_fp32_sums_keep_them(bias, gen, checked_operands):
    # a bias (added to the fp32 sums before the one rounding) or NVFP4's global scale (divides them)
    case = "mxfp8" if bias else "nvfp4"
    a, b = _operands(case, 16, 32, 128, gen)
    extra = torch.randn(32, generator=gen) if bias else None
    with emulation.forced("bf16"):
        out = scaled_mm(a, b, out_dtype=torch.bfloat16, bias=extra)
    assert out.dtype == torch.bfloat16 and [c[2] for c in checked_operands] == [False]


def test_bias_and_leading_dims_follow_the_fp32_path(gen):
    a = quantize(torch.randn(2, 8, 64, generator=gen), "e4m3", Granularity.mx())
    b = quantize(torch.randn(16, 64, generator=gen), "e4m3", Granularity.mx())
    bias = torch.randn(16, generator=gen)
    with emulation.forced("bf16"):
        out = scaled_mm(a, b, bias=bias, out_dtype=torch.bfloat16)
    with emulation.forced("fp32"):
        ref = scaled_mm(a, b, bias=bias, out_dtype=torch.bfloat16)
    assert out.shape == ref.shape == (2, 8, 16)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-5)


def test_auto_keeps_fp32_k_block_scales_on_the_fp32_backend(gen, checked_operands, monkeypatch):
    monkeypatch.setattr(emulation, "native_bf16", lambda: True)
    with emulation.forced("auto"):
        scaled_mm(*_operands("1x128 x 128x128", 16, 128, 256, gen))
        assert checked_operands == []  # the per-chunk partials cost more than the bf16 units save
        scaled_mm(*_operands("mxfp8", 16, 128, 256, gen))
        scaled_mm(*_operands("rowwise e4m3", 16, 128, 256, gen))
    assert len(checked_operands) == 2


def test_scales_outside_the_normal_range_fall_back_to_fp32(gen, checked_operands):
    # MX block scales of 2^-127 put products below fp32's normal range: the dot-product units would flush
    a = quantize(torch.randn(8, 64, generator=gen) * 1e-37, "e4m3", Granularity.mx())
    b = quantize(torch.randn(8, 64, generator=gen), "e4m3", Granularity.mx())
    with emulation.forced("bf16"):
        out = scaled_mm(a, b)
    assert checked_operands == []
    with emulation.forced("fp32"):
        assert torch.equal(out, scaled_mm(a, b))


def test_non_nesting_blocks_fall_back_to_fp32(gen, checked_operands):
    # 1x40 and 1x128 blocks share K-chunks of 8 only: below any kernel's K-block, not worth a GEMM each
    a = quantize(torch.randn(8, 640, generator=gen), "e4m3", Granularity.blocks(1, 40))
    b = quantize(torch.randn(8, 640, generator=gen), "e4m3", Granularity.blocks(1, 128))
    with emulation.forced("bf16"):
        out = scaled_mm(a, b)
    assert checked_operands == []
    with emulation.forced("fp32"):
        assert torch.equal(out, scaled_mm(a, b))


def test_compiled_graph_keeps_fullgraph_under_the_bf16_backend(gen):
    a, b = _operands("rowwise e4m3", 16, 32, 64, gen)
    compiled = torch.compile(lambda x, y: scaled_mm(x, y), fullgraph=True, backend="eager")
    with emulation.forced("bf16"):
        out = compiled(a, b)
    ref = _reference(a, b)
    assert bool(((out.double() - ref).abs() <= _bound(a, b, 64)).all())


# ---------------------------------------------------------------------------------------------------
# Policy


def test_environment_variable_is_checked(monkeypatch):
    monkeypatch.setenv(emulation.ENV_VAR, "fp16")
    with pytest.raises(MixprecError, match=emulation.ENV_VAR):
        emulation.requested()
    monkeypatch.setenv(emulation.ENV_VAR, " BF16 ")
    assert emulation.requested() == "bf16"


def test_forced_and_set_backend_nest_and_restore(monkeypatch):
    monkeypatch.setenv(emulation.ENV_VAR, "fp32")
    with emulation.forced("bf16"):
        assert emulation.requested() == "bf16"
        with emulation.forced("auto"):
            assert emulation.requested() == "auto"
        assert emulation.requested() == "bf16"
    assert emulation.requested() == "fp32"
    try:
        emulation.set_backend("bf16")
        assert emulation.requested() == "bf16"
    finally:
        emulation.set_backend(None)
    assert emulation.requested() == "fp32"
    with pytest.raises(MixprecError, match="unknown GEMM emulation backend"):
        emulation.set_backend("int8")


@pytest.mark.parametrize("native", [True, False])
def test_auto_follows_the_cpu_and_reports_it(native, monkeypatch):
    monkeypatch.setattr(emulation, "native_bf16", lambda: native)
    with emulation.forced("auto"):
        assert emulation.backend_for(torch.device("cpu")) == ("bf16" if native else "fp32")
        assert emulation.backend_for(torch.device("meta")) == "fp32"  # only CPUs take the bf16 mode
        words = emulation.describe("cpu")
    assert words == (
        "FP8/FP4 emulation on native bf16 GEMMs"
        if native
        else "FP8/FP4 emulation in fp32 (no native bf16 GEMM on this CPU)"
    )
    with emulation.forced("fp32"):
        assert emulation.describe("cpu") == "FP8/FP4 emulation in fp32 (forced)"


def test_native_bf16_agrees_with_the_detected_cpu():
    from mixprec.kernels.hardware import detect

    if not detect().cpu_bf16_native:
        assert not emulation.native_bf16()
