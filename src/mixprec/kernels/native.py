"""Which fast kernel runs what on this machine — probed with a real call, never assumed.

    from mixprec.kernels.native import native_kernel_report, blockwise_backend, native_gemm

- Blockwise (1x128 x 128x128, 1x128 x 1x128) FP8 GEMM: `F.scaled_mm` (torch >= 2.10's v2 API) or
  `torch._scaled_mm` with blockwise scales, where the installed torch/CUDA accepts it: each candidate
  scale layout is tried on a small random problem and kept only if its result matches the emulation;
  otherwise the Triton kernel (mixprec.kernels.triton_blockwise_gemm); otherwise emulation.
- MXFP8 (1x32 blocks, E8M0 scales): emulated on every device. SM 10.0+ (Blackwell) has the tensor
  cores and F.scaled_mm takes them with swizzled E8M0 scales, which is not wired up yet;
  `native_kernel_report()` says so (for `mixprec doctor`).
- Quantization is not chosen here: mixprec.quantization.quantize picks among the quantize backends
  of this package (traceable, compiled, tiled, triton); `quantize_backend` says what it picks for
  FP8 on a device, for the report.

Everything here imports on a CPU-only machine without triton: triton modules load lazily.
"""

from __future__ import annotations

import importlib.util
from functools import cache

import torch

from mixprec.errors import MixprecError
from mixprec.formats import E4M3
from mixprec.kernels import c_quantize
from mixprec.kernels.compiled import division_rounding_option
from mixprec.kernels.hardware import detect
from mixprec.kernels.tiled import TILED_MIN_ELEMENTS
from mixprec.kernels.traceable import quantize_traceable
from mixprec.scaling import Granularity, QuantizedTensor

SCHEMA_VERSION = 1
BLOCK = 128


# ---------------------------------------------------------------------------------------------------
# Triton


@cache
def triton_version() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        import triton
    except Exception:  # a broken triton install is "no triton", not a crash of mixprec
        return None
    return str(getattr(triton, "__version__", "unknown"))


def triton_usable(device: torch.device | str) -> bool:
    """Triton kernels can run on this device (CUDA with triton installed)."""
    return torch.device(device).type == "cuda" and triton_version() is not None


# ---------------------------------------------------------------------------------------------------
# Blockwise GEMM: scale layouts the torch kernels may want, probed


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _outer_major(s: torch.Tensor) -> torch.Tensor:
    """Same shape, column-major strides ([1, rows])."""
    return s.t().contiguous().t()


def _layout_candidates(q: QuantizedTensor, k: int) -> dict[str, torch.Tensor]:
    """Scale tensors in the layouts torch versions have asked for, keyed by name.

    Our grid is [rows or rows/128, K/128] (row-major). torch 2.13's F.scaled_mm documents (meta
    checks): 1x128 scales as [rows, K/128] with strides [1, rows]; 128x128 scales of the second
    operand as [round_up(K/128, 4), N/128] with strides [1, round_up(K/128, 4)].
    """
    s = q.scale.float()
    out = {"grid": s.contiguous(), "grid_outer_major": _outer_major(s), "transposed": s.t().contiguous()}
    if q.granularity.block_rows == BLOCK:
        kb = s.shape[1]
        l4 = _round_up(kb, 4)
        padded = torch.nn.functional.pad(s, (0, l4 - kb), value=1.0)  # [N/128, L4] row-major
        out["padded_k4_transposed"] = padded.t()  # [L4, N/128], strides [1, L4]
    return out


def _f_scaled_mm_call(a, b, sa, sb, out_dtype, bias):
    import torch.nn.functional as F

    st = F.ScalingType
    ra = st.BlockWise1x128
    rb = st.BlockWise128x128 if b.granularity.block_rows == BLOCK else st.BlockWise1x128
    return F.scaled_mm(a.data, b.data.t(), sa, ra, sb, rb, bias=bias, output_dtype=out_dtype)


def _legacy_scaled_mm_call(a, b, sa, sb, out_dtype, bias):
    return torch._scaled_mm(a.data, b.data.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype)


_CALLS = {"F.scaled_mm": _f_scaled_mm_call, "torch._scaled_mm": _legacy_scaled_mm_call}


def _emulate(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    return a.dequantize().double() @ b.dequantize().double().t()


def _fp32_out_ok(call, qa, qb, sa, sb, ref) -> bool:
    try:
        out = call(qa, qb, sa, sb, torch.float32, None)
        _sync(qa.data.device)
        return float((out.double().cpu() - ref).norm() / ref.norm()) < 1e-3
    except Exception:
        return False


@cache
def probe_blockwise(device_str: str, b_rows: int) -> dict:
    """Find a torch kernel + scale layouts that compute 1x128 x (b_rows)x128 right on this device.

    Returns {"backend": name or None, "layout_a": key, "layout_b": key, "fp32_out": bool, "tried": [...],
    "error": str}: the layouts are found with bf16 output, then fp32 output is tried with them.
    """
    if torch.device(device_str).type != "cuda":
        return {**_empty_probe(), "error": "blockwise scaled_mm runs on CUDA only"}
    return _probe(torch.device(device_str), b_rows, _CALLS)


def _empty_probe() -> dict:
    return {"backend": None, "layout_a": None, "layout_b": None, "fp32_out": False, "tried": [], "error": ""}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _probe_operand(x: torch.Tensor, g: Granularity) -> QuantizedTensor:
    """An E4M3 operand for the probe (kernels.traceable: the payloads every quantize backend gives)."""
    data, scale, _ = quantize_traceable(x, E4M3, g)
    return QuantizedTensor(data, scale, E4M3, g, x.shape)


def _probe(device: torch.device, b_rows: int, calls: dict) -> dict:
    """probe_blockwise's search over `calls` (name -> fn(a, b, sa, sb, out_dtype, bias)) on any device."""
    result = _empty_probe()
    gen = torch.Generator(device="cpu").manual_seed(0)
    m, n, k = 256, 256, 512
    x = torch.randn(m, k, generator=gen) * 3
    w = torch.randn(n, k, generator=gen) * 0.05
    qa = _probe_operand(x, Granularity.blocks(1, BLOCK))
    qb = _probe_operand(w, Granularity.blocks(b_rows, BLOCK))
    ref = _emulate(qa, qb)
    qa = QuantizedTensor(qa.data.to(device), qa.scale.to(device), qa.fmt, qa.granularity, qa.shape)
    qb = QuantizedTensor(qb.data.to(device), qb.scale.to(device), qb.fmt, qb.granularity, qb.shape)
    cands_a, cands_b = _layout_candidates(qa, k), _layout_candidates(qb, k)
    order_a = ["grid_outer_major", "grid", "transposed"]
    order_b = ["padded_k4_transposed", "grid_outer_major", "grid", "transposed"]
    for name, call in calls.items():
        if name == "F.scaled_mm" and not hasattr(torch.nn.functional, "scaled_mm"):
            continue
        for la in order_a:
            for lb in order_b:
                if lb not in cands_b:
                    continue
                try:  # bf16 output: what every blockwise kernel offers
                    out = call(qa, qb, cands_a[la], cands_b[lb], torch.bfloat16, None)
                    _sync(device)
                    err = float((out.double().cpu() - ref).norm() / ref.norm())
                except Exception as exc:  # any refusal means "not this layout"
                    result["tried"].append(f"{name} a={la} b={lb}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                result["tried"].append(f"{name} a={la} b={lb}: rel err {err:.2e} (bf16 out)")
                if err < 1e-2:  # bf16 rounding of the output is ~2e-3; a wrong layout is O(1)
                    result.update(
                        backend=name,
                        layout_a=la,
                        layout_b=lb,
                        fp32_out=_fp32_out_ok(call, qa, qb, cands_a[la], cands_b[lb], ref),
                    )
                    result["tried"].append(
                        f"{name}: fp32 output {'ok' if result['fp32_out'] else 'refused or wrong'}"
                    )
                    return result
    result["error"] = "no torch blockwise kernel matched the emulation"
    return result


# (device, b_rows) -> (backend, layout_a, layout_b): filled outside torch.compile, read inside it (a plain
# dict lookup traces as a constant; probing inside a trace would run GEMMs and break the graph).
_SELECTED: dict[tuple[str, int], tuple[str, str | None, str | None, bool]] = {}


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def _device_key(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def _select(device: torch.device | str, b_rows: int) -> tuple[str, str | None, str | None, bool]:
    """(backend, layout_a, layout_b, fp32 output supported) for this device and B blocking."""
    key = (_device_key(device), b_rows)
    hit = _SELECTED.get(key)
    if hit is not None:
        return hit
    if _compiling():  # not warmed up: decide nothing inside a trace (call native_kernel_report() first)
        return ("emulated", None, None, False)
    if torch.device(device).type != "cuda":
        choice = ("emulated", None, None, False)
    else:
        if not detect().fp8_native:
            choice = ("emulated", None, None, False)
        else:
            probe = probe_blockwise(key[0], b_rows)
            if probe["backend"]:
                choice = (probe["backend"], probe["layout_a"], probe["layout_b"], probe["fp32_out"])
            else:
                choice = ("triton" if triton_usable(device) else "emulated", None, None, True)
    _SELECTED[key] = choice
    return choice


def blockwise_backend(device: torch.device | str, b_rows: int = BLOCK) -> str:
    """ "F.scaled_mm" | "torch._scaled_mm" | "triton" | "emulated" for 1x128 x (b_rows)x128 on device.

    Decided once per (device, b_rows), outside torch.compile; inside a trace a decision not made yet
    reads as "emulated" (the emulation computes the same values), so warm up eagerly first.
    """
    return _select(device, b_rows)[0]


def _is_blockwise_pair(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    ga, gb = a.granularity, b.granularity
    return (
        ga.scale_format == "fp32"
        and gb.scale_format == "fp32"
        and (ga.block_rows, ga.block_cols) == (1, BLOCK)
        and (gb.block_rows, gb.block_cols) in ((BLOCK, BLOCK), (1, BLOCK))
    )


def blockwise_mm(
    a: QuantizedTensor,
    b: QuantizedTensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """a_deq @ b_deq.T for 1x128 x 128x128 (or 1x128) operands on CUDA, by the probed backend."""
    if not _is_blockwise_pair(a, b):
        raise MixprecError(
            f"blockwise_mm takes 1x128 x 128x128 / 1x128 scales, got {a.granularity.name} x {b.granularity.name}"
        )
    device = a.data.device
    chosen, layout_a, layout_b, fp32_out = _select(device, b.granularity.block_rows)
    backend = backend or chosen
    if backend in _CALLS:
        if backend != chosen or layout_a is None:
            raise MixprecError(
                f"{backend} blockwise GEMM did not pass its probe on {device}; available: {chosen}"
            )
        if out_dtype == torch.float32 and not fp32_out:
            raise MixprecError(
                f"{backend} blockwise GEMM on {device} gives no fp32 output (use bf16, or triton)"
            )
        k = a.data.shape[1]
        sa = _layout_candidates(a, k)[layout_a]
        sb = _layout_candidates(b, k)[layout_b]
        return _CALLS[backend](a, b, sa, sb, out_dtype, None if bias is None else bias.to(out_dtype))
    if backend == "triton":
        from mixprec.kernels.triton_blockwise_gemm import blockwise_mm as triton_mm

        return triton_mm(a, b, out_dtype=out_dtype, bias=bias)
    raise MixprecError(f"no native blockwise FP8 GEMM on {device} (backend {backend!r})")


def blockwise_plan(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> tuple[str | None, str]:
    """(the backend native_gemm runs this blockwise pair with, or None; why not) — no GEMM is run.

    The torch kernels get M, N, K multiples of 128 only (what torch documents; the probe ran such a
    shape) and fp32 outputs only where the probe saw them right; other shapes go to the Triton kernel.
    """
    if not _is_blockwise_pair(a, b):
        return None, f"no blockwise kernel takes {a.granularity.name} x {b.granularity.name} scales"
    if a.data.device.type != "cuda":
        return None, "blockwise FP8 kernels run on CUDA only"
    if a.data.dtype.itemsize != 1 or b.data.dtype.itemsize != 1:
        return None, "payloads are not 1-byte FP8"
    backend = blockwise_backend(a.data.device, b.granularity.block_rows)
    if backend == "emulated":
        return None, "no blockwise FP8 kernel on this device (the torch probe failed and triton is missing)"
    (m, k), n = a.data.shape, b.data.shape[0]
    e4m3 = a.data.dtype == b.data.dtype == torch.float8_e4m3fn  # what the probe ran
    torch_ok = (
        e4m3
        and not (m % BLOCK or n % BLOCK or k % BLOCK)
        and (out_dtype != torch.float32 or _select(a.data.device, b.granularity.block_rows)[3])
    )
    if backend in _CALLS and not torch_ok:  # a shape or an fp32 output the torch kernel is not known to take
        if _compiling() or not triton_usable(a.data.device):
            return None, f"{backend} is used for E4M3, M/N/K multiples of 128 (fp32 out if probed); no triton"
        backend = "triton"
    return backend, ""


def native_gemm(
    a: QuantizedTensor, b: QuantizedTensor, *, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """The hook for mixprec.gemm: the blockwise result from a native kernel, or None (then emulate)."""
    backend, _ = blockwise_plan(a, b, out_dtype)
    if backend is None:
        return None
    return blockwise_mm(a, b, out_dtype=out_dtype, bias=bias, backend=backend)


# ---------------------------------------------------------------------------------------------------
# Quantization


def quantize_backend(device: torch.device | str) -> str:
    """The backend mixprec.quantization.quantize picks for FP8 on `device` outside torch.compile (see
    there: under torch.compile it is "traceable")."""
    if triton_usable(device):
        return "triton"
    if torch.device(device).type == "cpu":
        why_not = c_quantize.unavailable_reason()
        if why_not is None:
            return "tiled: FP8 and FP4 in compiled C (kernels.c_quantize)"
        return f"eager; tiled from {TILED_MIN_ELEMENTS} elements (compiled C quantize unavailable: {why_not})"
    return "eager"


# ---------------------------------------------------------------------------------------------------
# Report (for `mixprec doctor` and the GPU benchmark)


def _mx_status(caps) -> tuple[str, bool, str]:
    """MX GEMMs run emulated on every device, SM 10.0+ included: F.scaled_mm wants swizzled E8M0 scales
    there, which mixprec does not produce yet, so mixprec.gemm.native_available refuses MX (the same
    answer; tests/test_doctor.py checks the two agree under faked capabilities)."""
    if not caps.cuda_available:
        return "emulated", False, "no CUDA device: MXFP8 is emulated (dequantize + fp32 matmul)"
    if not caps.mxfp8_native:
        cap = ".".join(map(str, caps.cuda_capability or ()))
        return "emulated", False, f"SM {cap} has no MXFP8 tensor cores (SM 10.0+): MXFP8 is emulated"
    return (
        "emulated",
        False,
        "this GPU has MXFP8 tensor cores, but mixprec's native MXFP8 GEMM is not wired up yet "
        "(swizzled E8M0 scales): MXFP8 is emulated",
    )


def native_kernel_report(device: torch.device | str | None = None) -> dict:
    """What runs natively here, per GEMM scaling kind and for quantization, and why.

    {"schema_version", "device", "triton", "gemm": {kind: {"backend", "native", "note"}},
     "quantize": {...}, "compile": {...}}. Probes run once per process (a few small GEMMs on CUDA).
    The "gemm" entries are what the backends offer here; `mixprec doctor` shows the GEMM seam's own
    choice per kind (mixprec.gemm.will_emulate), which tests keep equal to these.
    """
    caps = detect()
    if device is None:
        device = "cuda" if caps.cuda_available else "cpu"
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    fp8 = caps.fp8_native and on_cuda
    gemm: dict[str, dict] = {}
    for kind in ("tensorwise", "rowwise"):
        if fp8:
            gemm[kind] = {"backend": "torch._scaled_mm", "native": True, "note": ""}
        elif caps.scaled_mm_cpu:
            gemm[kind] = {
                "backend": "emulated",
                "native": False,
                "note": "torch._scaled_mm runs on this CPU but is a reference loop; mixprec emulates (same numerics)",
            }
        else:
            gemm[kind] = {"backend": "emulated", "native": False, "note": "no FP8 tensor cores"}
    for kind, b_rows in (("blockwise_1x128_128x128", BLOCK), ("blockwise_1x128_1x128", 1)):
        if not fp8:
            gemm[kind] = {"backend": "emulated", "native": False, "note": "no FP8 tensor cores"}
            continue
        backend = blockwise_backend(device, b_rows)
        probe = probe_blockwise(_device_key(device), b_rows)
        note = "" if probe["backend"] else probe["error"]
        if backend == "triton":
            note += "; Triton kernel with FP32 promotion every 128 of K"
        gemm[kind] = {
            "backend": backend,
            "native": backend != "emulated",
            "note": note.strip("; "),
            "probe": probe["tried"],
        }
    mx_backend, mx_native, mx_note = _mx_status(caps)
    gemm["mxfp8"] = {"backend": mx_backend, "native": mx_native, "note": mx_note}
    div = division_rounding_option()
    return {
        "schema_version": SCHEMA_VERSION,
        "device": caps.cuda_device if on_cuda else f"CPU {caps.cpu_model}",
        "cuda_capability": list(caps.cuda_capability) if caps.cuda_capability else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version(),
        "gemm": gemm,
        "quantize": {
            "backend": quantize_backend(device),
            "bit_identical_to": "mixprec.quantization.quantize(backend='eager')",
        },
        "compile": {
            "quantize": "mixprec.kernels.traceable.quantize_traceable (no graph breaks)",
            "inductor_eager_division": (
                next(iter(div))
                if div
                else "not available in this torch: compiled fp32 division may differ by 1 ulp on GPU"
            ),
        },
    }


def describe_report(report: dict) -> list[tuple[str, str]]:
    """(label, text) rows for a table: one per GEMM kind plus quantize and triton."""
    rows = []
    for kind, entry in report["gemm"].items():
        text = entry["backend"] + (
            "" if entry["native"] else " (emulated)" if entry["backend"] != "emulated" else ""
        )
        if entry.get("note"):
            text += f" — {entry['note']}"
        rows.append((f"{'FP4' if 'fp4' in kind else 'FP8'} GEMM {kind}", text))
    rows.append(("quantize", report["quantize"]["backend"]))
    rows.append(("triton", report["triton"] or "not installed"))
    return rows


__all__ = [
    "blockwise_backend",
    "blockwise_mm",
    "blockwise_plan",
    "describe_report",
    "native_gemm",
    "native_kernel_report",
    "probe_blockwise",
    "quantize_backend",
    "triton_usable",
    "triton_version",
]
