"""GPU checks of issue 8 (run by bench/gpu.sh): the GPU path quantizes exactly as the CPU path, and its
GEMMs agree with the emulation up to accumulation order.

Skipped without CUDA. A developer without a GPU can dry-run the logic on CPU tensors through the
Triton interpreter with MIXPREC_GPU_TESTS_ON_CPU=1 (small shapes; native torch kernels are skipped).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from mixprec.quantization import quantize
from mixprec.scaling import Granularity, QuantizedTensor

G = Granularity
DRY_RUN = os.environ.get("MIXPREC_GPU_TESTS_ON_CPU") == "1" and not torch.cuda.is_available()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() or DRY_RUN), reason="needs a CUDA GPU"),
]

GRANULARITIES = [
    G.tensor(),
    G.rows(),
    G.columns(),
    G.blocks(1, 128),
    G.blocks(128, 1),
    G.blocks(128, 128),
    G.mx(32),
    G.mx(32, axis=0),
    G.mx(32, rounding="rceil"),
]


@pytest.fixture(scope="module")
def dev() -> str:
    return "cpu" if DRY_RUN else "cuda"


def _size(big: int, small: int) -> int:
    return small if DRY_RUN else big


def _data(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """CPU data with a wide range, edge blocks and special values (the reference runs on CPU)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-2, 2, cols)
    x[3, 5], x[4, 7], x[5, 0] = math.inf, -math.inf, math.nan
    x[7, :] = 0.0
    x[9, : cols // 2] = torch.randn(cols // 2, generator=gen) * 1e-41
    return x


def _to(q: QuantizedTensor, device) -> QuantizedTensor:
    return QuantizedTensor(q.data.to(device), q.scale.to(device), q.fmt, q.granularity, q.shape)


def _assert_same(cpu_q: QuantizedTensor, gpu_q: QuantizedTensor, what: str) -> None:
    assert torch.equal(cpu_q.scale, gpu_q.scale.cpu()), f"{what}: scales differ"
    same = cpu_q.data.view(torch.uint8) == gpu_q.data.cpu().view(torch.uint8)
    assert bool(same.all()), f"{what}: {int((~same).sum())} payload bytes differ"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("g", GRANULARITIES, ids=lambda g: g.name)
def test_fused_quantize_matches_cpu(dev, fmt, g):
    x = _data(_size(1000, 40), _size(4160, 300))  # not multiples of the blocks: edge blocks
    for dtype in (torch.float32, torch.bfloat16):
        ref = quantize(x.to(dtype), fmt, g, backend="eager")  # the CPU path
        got = quantize(x.to(dtype).to(dev), fmt, g, backend="triton")
        _assert_same(ref, got, f"{fmt} {g.name} {dtype}")


def test_fused_quantize_options_and_given_scales(dev):
    x = _data(_size(512, 40), _size(2048, 300), seed=1)
    for g in (G.tensor(), G.rows(), G.blocks(1, 128), G.blocks(128, 128)):
        for kw in ({"power_of_two": True}, {"margin": 1}):
            _assert_same(
                quantize(x, "e4m3", g, **kw),
                quantize(x.to(dev), "e4m3", g, backend="triton", **kw),
                f"{g.name} {kw}",
            )
        s = quantize(x, "e4m3", g).scale * 1.5
        _assert_same(
            quantize(x, "e4m3", g, scale=s),
            quantize(x.to(dev), "e4m3", g, scale=s.to(dev), backend="triton"),
            f"{g.name} given",
        )


def test_auto_quantize_matches_cpu(dev):
    x = _data(_size(256, 32), _size(1024, 256), seed=2).bfloat16()
    for g in (G.tensor(), G.rows(), G.blocks(1, 128), G.blocks(128, 128), G.mx(32)):
        _assert_same(quantize(x, "e4m3", g), quantize(x.to(dev), "e4m3", g), g.name)


@pytest.mark.skipif(DRY_RUN, reason="Inductor's CPU code generation is not what runs on the GPU")
def test_compiled_quantize_matches_cpu(dev):
    from mixprec.kernels.compiled import compiled_quantize, division_rounding_option

    x = _data(1000, 4160, seed=3)
    for g in (G.rows(), G.blocks(1, 128), G.blocks(128, 128), G.mx(32)):
        fn = compiled_quantize("e4m3", g)
        data, scale, _ = fn(x.to(dev), None)
        ref = quantize(x, "e4m3", g)
        what = f"compiled {g.name} (division option: {division_rounding_option() or 'none'})"
        _assert_same(ref, QuantizedTensor(data, scale, ref.fmt, g, ref.shape), what)


def _blockwise_pair(m: int, n: int, k: int, b_rows: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 3
    w = torch.randn(n, k, generator=gen) * 0.05
    qa = quantize(x, "e4m3", G.blocks(1, 128))
    qb = quantize(w, "e4m3", G.blocks(b_rows, 128))
    ref = qa.dequantize().double() @ qb.dequantize().double().t()
    return qa, qb, ref


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref).norm() / ref.norm())


@pytest.mark.parametrize("b_rows", [128, 1], ids=["1x128_128x128", "1x128_1x128"])
def test_triton_blockwise_gemm(dev, b_rows):
    from mixprec.kernels.triton_blockwise_gemm import blockwise_mm

    for m, n, k in [
        (_size(512, 64), _size(384, 48), _size(1024, 256)),
        (_size(300, 40), _size(200, 40), _size(1000, 200)),
    ]:
        qa, qb, ref = _blockwise_pair(m, n, k, b_rows)
        bm = 32 if DRY_RUN else 128
        out = blockwise_mm(_to(qa, dev), _to(qb, dev), block_m=bm, block_n=bm)
        assert not torch.isnan(out).any()
        err = _rel(out, ref)
        assert err < 1e-3, f"{m}x{n}x{k}: relative error {err:.2e}"  # FP8 MMA accumulation over 128 only


@pytest.mark.skipif(DRY_RUN, reason="native torch kernels need CUDA")
@pytest.mark.parametrize("b_rows", [128, 1], ids=["1x128_128x128", "1x128_1x128"])
def test_native_blockwise_backends(dev, b_rows):
    from mixprec.kernels import native

    probe = native.probe_blockwise(native._device_key(dev), b_rows)
    print(f"blockwise probe (b_rows={b_rows}):", probe["backend"], probe["layout_a"], probe["layout_b"])
    for line in probe["tried"]:
        print("   ", line)
    qa, qb, ref = _blockwise_pair(1024, 768, 2048, b_rows, seed=4)
    backends = [b for b in ("F.scaled_mm", "torch._scaled_mm") if b == probe["backend"]]
    if native.triton_usable(dev):
        backends.append("triton")
    assert backends, "neither a torch blockwise kernel nor triton is usable on this GPU"
    for backend in backends:
        fp32 = backend == "triton" or probe["fp32_out"]
        out_dtype, tol = (torch.float32, 1e-3) if fp32 else (torch.bfloat16, 1e-2)
        out = native.blockwise_mm(_to(qa, dev), _to(qb, dev), out_dtype=out_dtype, backend=backend)
        err = _rel(out.float(), ref)
        print(f"{backend}: {out_dtype} output, relative error {err:.2e}")
        assert err < tol, f"{backend}: relative error {err:.2e}"
    bias = torch.randn(768)
    out = native.native_gemm(_to(qa, dev), _to(qb, dev), out_dtype=torch.bfloat16, bias=bias.to(dev))
    assert out is not None and out.dtype == torch.bfloat16
    assert _rel(out.float(), ref + bias.double()) < 1e-2  # bf16 output rounding


@pytest.mark.skipif(DRY_RUN, reason="native torch kernels need CUDA")
def test_seam_native_tensorwise_rowwise_match_emulation(dev):
    from mixprec.gemm import scaled_mm

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(512, 1024, generator=gen)
    w = torch.randn(768, 1024, generator=gen) * 0.05
    for g in (G.tensor(), G.rows()):
        qa, qb = quantize(x, "e4m3", g), quantize(w, "e4m3", g)
        ref = qa.dequantize().double() @ qb.dequantize().double().t()
        out = scaled_mm(_to(qa, dev), _to(qb, dev), out_dtype=torch.float32, backend="native")
        assert _rel(out, ref) < 1e-4, g.name


@pytest.mark.skipif(DRY_RUN, reason="needs CUDA")
def test_native_kernel_report_on_hopper(dev):
    from mixprec.kernels.native import native_kernel_report

    report = native_kernel_report(dev)
    print(report)
    cap = torch.cuda.get_device_capability()
    if cap >= (8, 9):
        assert report["gemm"]["tensorwise"]["native"] and report["gemm"]["rowwise"]["native"]
        assert report["gemm"]["blockwise_1x128_128x128"]["backend"] != "emulated"
    if cap < (10, 0):
        assert (
            report["gemm"]["mxfp8"]["backend"] == "emulated" and "emulated" in report["gemm"]["mxfp8"]["note"]
        )


@pytest.mark.skipif(DRY_RUN, reason="needs CUDA")
@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-blockwise"])
def test_low_precision_linear_compiles_on_gpu(dev, recipe):
    """Inductor-compiled LowPrecisionLinear forward+backward (native/fused kernels wired into mixprec.gemm): no
    graph breaks, results close to eager."""
    low_precision_linear = pytest.importorskip("mixprec.training.low_precision_linear")
    from mixprec.kernels.compiled import compile_options, graph_break_report

    torch._dynamo.reset()
    layer = low_precision_linear.LowPrecisionLinear(
        1024, 512, recipe=recipe, device=dev, dtype=torch.bfloat16
    )
    x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    ref = layer(x)  # eager first: kernel choices are made outside any trace
    ref.float().sum().backward()
    gx = x.grad.clone()
    x.grad = None
    report = graph_break_report(layer, x)
    torch._dynamo.reset()
    compiled = torch.compile(layer, options=compile_options())
    out = compiled(x)
    out.float().sum().backward()
    assert _rel(out.float(), ref.double().cpu()) < 1e-2
    assert _rel(x.grad.float(), gx.double().cpu()) < 2e-2
    assert report["graph_breaks"] == 0, report["reasons"]


def test_seam_blockwise_native_matches_emulation(dev):
    """scaled_mm's "auto" runs 1x128 x 128x128 natively on the GPU (probed torch kernel or Triton)."""
    from mixprec.gemm import native_available, scaled_mm, will_emulate

    qa, qb, ref = _blockwise_pair(_size(512, 64), _size(768, 128), _size(1024, 256), 128, seed=6)
    qa, qb = _to(qa, dev), _to(qb, dev)
    ok, why = native_available(qa, qb, torch.bfloat16)
    if DRY_RUN:
        assert not ok  # CPU tensors: emulated
        return
    assert ok, why
    assert not will_emulate(qa, qb, "auto", torch.bfloat16)
    out = scaled_mm(qa, qb, out_dtype=torch.bfloat16)
    assert _rel(out.float(), ref) < 1e-2
    out32 = scaled_mm(
        qa, qb, out_dtype=torch.float32, backend="auto"
    )  # torch kernel if probed, else Triton/emulated
    assert _rel(out32, ref) < 1e-3
