"""Kernel selection on a machine without a GPU: everything reports emulation and falls back cleanly."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from mixprec.kernels import native
from mixprec.quantization import choose_backend, quantize
from mixprec.scaling import Granularity


def test_report_on_cpu_says_emulated():
    if torch.cuda.is_available():
        return
    report = native.native_kernel_report("cpu")
    assert report["schema_version"] == 1
    assert set(report["gemm"]) == {
        "tensorwise",
        "rowwise",
        "blockwise_1x128_128x128",
        "blockwise_1x128_1x128",
        "mxfp8",
    }
    assert all(not e["native"] for e in report["gemm"].values())
    assert "emulated" in report["gemm"]["mxfp8"]["note"]
    assert native.describe_report(report)
    assert native.blockwise_backend("cpu") == "emulated"


def test_native_gemm_declines_on_cpu_and_the_report_says_what_quantizes():
    x = torch.randn(16, 256)
    qa = quantize(x, "e4m3", Granularity.blocks(1, 128))
    qb = quantize(torch.randn(128, 256), "e4m3", Granularity.blocks(128, 128))
    assert native.native_gemm(qa, qb, out_dtype=torch.float32, bias=None) is None
    # what the report names for CPU quantization is what the quantize entry picks
    assert native.quantize_backend("cpu").startswith(choose_backend(x, "e4m3", Granularity.rows()))


def test_imports_and_reports_without_triton():
    """CI machines may not have triton: the package must import and report, with triton blocked."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import importlib.util
        importlib.util.find_spec = (lambda f: (lambda name, *a, **k: None if name.startswith("triton") else f(name, *a, **k)))(importlib.util.find_spec)
        import mixprec.kernels as k
        from mixprec.kernels import compiled, tiled, traceable  # noqa: F401
        import mixprec.quantization  # noqa: F401
        r = k.native_kernel_report("cpu")
        assert r["triton"] is None, r["triton"]
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def _kernel_wanting(layout_a_strides, b_shape_fn, fp32: bool):
    """A fake blockwise kernel that, like torch's, reads scales only in one layout (by shape and strides)."""

    def call(a, b, sa, sb, out_dtype, bias):
        m, k = a.data.shape
        n = b.data.shape[0]
        kb = -(-k // 128)
        if tuple(sa.shape) != (m, kb) or sa.stride() != layout_a_strides(m, kb):
            raise RuntimeError("scale_a layout")
        want_shape, want_strides = b_shape_fn(n, kb)
        if tuple(sb.shape) != want_shape or sb.stride() != want_strides:
            raise RuntimeError("scale_b layout")
        if out_dtype == torch.float32 and not fp32:
            raise RuntimeError("no fp32 output")
        grid_b = sb[:kb].t() if b.granularity.block_rows == 128 else sb  # back to our [N/128 or N, K/128]
        qa = type(a)(a.data, sa.contiguous(), a.fmt, a.granularity, a.shape)
        qb = type(b)(b.data, grid_b.contiguous(), b.fmt, b.granularity, b.shape)
        return (qa.dequantize() @ qb.dequantize().t()).to(out_dtype)

    return call


def test_probe_finds_the_layout_torch_documents():
    """The search keeps the first layout whose result matches the emulation (with fake kernels on CPU)."""
    l4 = lambda kb: -(-kb // 4) * 4  # noqa: E731
    col_major = lambda m, kb: (1, m)  # noqa: E731
    block_b = _kernel_wanting(col_major, lambda n, kb: ((l4(kb), n // 128), (1, l4(kb))), fp32=False)
    wrong = lambda *args: torch.zeros(256, 256, dtype=args[4])  # noqa: E731  (accepts anything, computes nonsense)
    calls = {"wrong": wrong, "torch._scaled_mm": block_b}
    probe = native._probe(torch.device("cpu"), 128, calls)
    assert (probe["backend"], probe["layout_a"], probe["layout_b"]) == (
        "torch._scaled_mm",
        "grid_outer_major",
        "padded_k4_transposed",
    )
    assert probe["fp32_out"] is False and any("wrong" in t for t in probe["tried"])
    tile_b = _kernel_wanting(col_major, lambda n, kb: ((n, kb), (1, n)), fp32=True)
    probe = native._probe(torch.device("cpu"), 1, {"F.scaled_mm": tile_b})
    assert (probe["layout_a"], probe["layout_b"], probe["fp32_out"]) == (
        "grid_outer_major",
        "grid_outer_major",
        True,
    )
    assert native._probe(torch.device("cpu"), 128, {"wrong": wrong})["backend"] is None


def test_blockwise_plan_on_cpu_declines_with_a_reason():
    qa = quantize(torch.randn(128, 256), "e4m3", Granularity.blocks(1, 128))
    qb = quantize(torch.randn(128, 256), "e4m3", Granularity.blocks(128, 128))
    backend, why = native.blockwise_plan(qa, qb, torch.bfloat16)
    assert backend is None and "CUDA" in why
    assert native.blockwise_plan(qa, qa, torch.bfloat16)[0] is None  # 1x128 x 1x128: still CPU
    assert "scales" in native.blockwise_plan(qb, qa, torch.bfloat16)[1]  # 128x128 as A: no kernel
