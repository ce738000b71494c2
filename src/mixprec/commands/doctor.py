"""`mixprec doctor`: what this machine has, what mixprec runs on it, and the recipe that fits it.

The hardware rows are facts about the chips (mixprec.kernels.hardware.detect). Every "what runs" row is
the decision the code itself takes, asked the same way the code asks it, so the two cannot disagree:
the FP8 GEMM of each scaling kind from the GEMM seam (mixprec.gemm.will_emulate on operands of that
kind on this device, the function scaled_mm calls), the bf16 GEMM path on a CPU from
mixprec.kernels.bf16_cpu.should_install (what convert_for_training calls), quantization, compile
and triton from mixprec.kernels.native.native_kernel_report. A GPU with MXFP8 tensor cores therefore
shows "MXFP8 tensor cores: yes" next to "FP8 GEMM mxfp8: emulated", because mixprec emulates MX GEMMs.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch import nn

from mixprec.formats import get_format
from mixprec.gemm import native_available, native_kind, will_emulate
from mixprec.kernels.bf16_cpu import should_install
from mixprec.kernels.hardware import Capabilities, detect
from mixprec.kernels.native import blockwise_plan, describe_report, native_kernel_report
from mixprec.scaling import Granularity, QuantizedTensor

NAME = "doctor"
HELP = "report native BF16/FP8 support on this machine and the recipe and kernels mixprec would choose"
SCHEMA_VERSION = 2  # 2: recommendation without gemm_kernels (kernels.gemm is the seam's choice); bf16_gemm

# the GEMM kinds of native_kernel_report, as operand granularities (a, b) of mixprec.gemm.scaled_mm
GEMM_KINDS = {
    "tensorwise": (Granularity.tensor(), Granularity.tensor()),
    "rowwise": (Granularity.rows(), Granularity.rows()),
    "blockwise_1x128_128x128": (Granularity.blocks(1, 128), Granularity.blocks(128, 128)),
    "blockwise_1x128_1x128": (Granularity.blocks(1, 128), Granularity.blocks(1, 128)),
    "mxfp8": (Granularity.mx(32), Granularity.mx(32)),
    "nvfp4": (Granularity.nvfp4(), Granularity.nvfp4()),
    "mxfp4": (Granularity.mx(32), Granularity.mx(32)),
}
FP4_KINDS = ("nvfp4", "mxfp4")  # E2M1 operands (packed codes); the others E4M3
PLAN_SIZE = 256  # M = N = K of the operands asked about: a multiple of every kernel's block
PLAN_OUT_DTYPE = torch.bfloat16  # what the forward GEMMs of bf16 training write


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")


def sample_operand(
    granularity: Granularity, device: torch.device | str, fmt: str = "e4m3"
) -> QuantizedTensor:
    """An operand of this format and granularity on `device` (contents irrelevant: only its layout is
    asked). E2M1 payloads are codes in uint8, as mixprec.quantization stores them."""
    fmt = get_format(fmt)
    n = PLAN_SIZE
    data = torch.zeros(n, n, dtype=fmt.torch_dtype or torch.uint8, device=device)
    scale = torch.ones(granularity.scale_shape(n, n), device=device)
    return QuantizedTensor(data, scale, fmt, granularity, torch.Size((n, n)))


def gemm_plan(device: torch.device | str) -> dict[str, dict]:
    """{kind: {"backend", "native", "note"}}: what mixprec.gemm.scaled_mm (backend "auto") runs for
    each scaling kind on `device`, decided by the seam's own will_emulate / native_available."""
    plan = {}
    for kind, (ga, gb) in GEMM_KINDS.items():
        fmt = "e2m1" if kind in FP4_KINDS else "e4m3"
        a, b = sample_operand(ga, device, fmt), sample_operand(gb, device, fmt)
        available, why = native_available(a, b, PLAN_OUT_DTYPE)
        if not will_emulate(a, b, "auto", PLAN_OUT_DTYPE):
            backend = (
                blockwise_plan(a, b, PLAN_OUT_DTYPE)[0]
                if native_kind(a, b) == "blockwise"
                else "torch._scaled_mm"
            )
            plan[kind] = {"backend": backend, "native": True, "note": ""}
            continue
        if available:  # the CPU: torch._scaled_mm runs, "auto" emulates (mixprec.gemm's docstring)
            why = (
                "torch._scaled_mm runs on this CPU but is a reference loop, slower than the emulation "
                "(same numerics); backend='native' forces it"
            )
        plan[kind] = {"backend": "emulated", "native": False, "note": why}
    return plan


def bf16_gemm(caps: Capabilities, device: torch.device | str) -> dict:
    """{"path": "native" | "fp32-compute", "note"}: how bf16 GEMMs of a converted model run here."""
    if torch.device(device).type == "cpu":
        if should_install(nn.Linear(1, 1), "auto"):  # the question convert_for_training asks, on a CPU model
            return {
                "path": "fp32-compute",
                "note": "computed in fp32, rounded to bf16 (mixprec.kernels.bf16_cpu): no AVX-512-BF16 or "
                "AMX here, where a native bf16 matmul is 4-25x slower than fp32",
            }
        return {"path": "native", "note": "native bf16 GEMMs (oneDNN, fp32 accumulation): AVX-512-BF16/AMX"}
    if caps.bf16_tensor_cores:
        return {"path": "native", "note": "bf16 tensor cores"}
    return {"path": "native", "note": "no bf16 tensor cores below SM 8.0: bf16 GEMMs are slow on this GPU"}


def recommend(caps: Capabilities, plan: dict[str, dict], bf16: dict) -> dict:
    """The recipe that fits this machine, from what runs natively (`plan`), and the FP8 recipe to train
    or to check FP8 numerics with here."""
    native = {kind for kind, entry in plan.items() if entry["native"]}
    if "mxfp8" in native:
        recipe, why = "fp8-mxfp8", "MXFP8 GEMMs run natively here (E8M0 scales per 32 elements)"
    elif "tensorwise" in native:
        recipe = "fp8-delayed"
        why = "FP8 tensor cores via torch._scaled_mm; per-tensor scales make the fastest FP8 GEMMs"
        if caps.mxfp8_native:
            why += (
                " (the MXFP8 tensor cores stay unused: mixprec emulates MX GEMMs, so fp8-mxfp8 would be slow)"
            )
    else:
        return _recommend_without_fp8(caps, bf16)
    return {"recipe": recipe, "reason": why, "fp8_recipe": recipe, "fp8_note": "FP8 GEMMs run natively here"}


def _recommend_without_fp8(caps: Capabilities, bf16: dict) -> dict:
    if caps.cuda_available and caps.bf16_tensor_cores:
        recipe, why = "bf16", "BF16 tensor cores and no FP8 ones: FP8 would run emulated, slower than bf16"
    elif caps.cuda_available:
        recipe, why = (
            "fp16-amp",
            "no BF16 or FP8 tensor cores (SM < 8.0): fp16 tensor cores with loss scaling",
        )
    else:
        recipe = "bf16"
        why = (
            "a CPU has no FP8 units: FP8 recipes run emulated, exact but 1.15-1.32x an fp32 training step "
            "(docs/benchmarks.md), no gain here; "
        ) + (
            "bf16 GEMMs run natively on AVX-512-BF16/AMX (about 3x faster than fp32, docs/benchmarks.md)"
            if bf16["path"] == "native"
            else "bf16 GEMMs run in fp32 and are rounded (about 1.1x an fp32 step, docs/benchmarks.md): "
            "this machine checks bf16 numerics, it does not speed them up"
        )
    fp8_note = (
        "to check FP8 numerics here before an FP8 GPU: emulated (exact numerics, no speed-up); current "
        "scaling keeps no amax history to lag a fast-growing amax in short runs (docs/compare.md), and its "
        "emulation costs about what fp8-delayed's does (1.17-1.20x vs 1.15-1.20x an fp32 step, "
        "docs/benchmarks.md)"
    )
    return {"recipe": recipe, "reason": why, "fp8_recipe": "fp8-current", "fp8_note": fp8_note}


def doctor_report(device: torch.device | str | None = None) -> dict:
    """The JSON of `mixprec doctor --json` (docs/schemas/README.md)."""
    caps = detect()
    if device is None:
        device = "cuda" if caps.cuda_available else "cpu"
    kernels = native_kernel_report(device)
    plan = gemm_plan(device)
    # the seam's choice replaces the backends' view (equal by tests/test_doctor.py); probe logs stay
    kernels["gemm"] = {kind: {**kernels["gemm"].get(kind, {}), **entry} for kind, entry in plan.items()}
    bf16 = bf16_gemm(caps, device)
    return {
        "schema_version": SCHEMA_VERSION,
        "capabilities": caps.to_dict(),
        "recommendation": recommend(caps, plan, bf16),
        "bf16_gemm": bf16,
        "kernels": kernels,
    }


def run(args: argparse.Namespace) -> int:
    report = doctor_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    caps, rec = detect(), report["recommendation"]
    yes = lambda flag: "[green]yes[/green]" if flag else "[red]no[/red]"  # noqa: E731
    table = Table(title="mixprec doctor", show_header=False)
    table.add_row("torch", caps.torch_version)
    table.add_row("python", caps.python_version)
    table.add_row("CPU", f"{caps.cpu_model} ({caps.machine})")
    table.add_row("CPU AVX-512-BF16 / AMX", f"{yes(caps.cpu_flags_bf16)} / {yes(caps.cpu_flags_amx)}")
    table.add_row("CUDA", caps.cuda_device or "none")
    cap = ".".join(map(str, caps.cuda_capability)) if caps.cuda_capability else "-"
    table.add_row("compute capability", cap)
    table.add_row("BF16 tensor cores (>= 8.0)", yes(caps.bf16_tensor_cores))
    table.add_row("FP8 tensor cores (>= 8.9)", yes(caps.fp8_native))
    table.add_row("MXFP8 tensor cores (>= 10.0)", yes(caps.mxfp8_native))
    table.add_row("FP4 tensor cores (>= 10.0)", yes(caps.fp4_native))
    table.add_row("torch._scaled_mm on CPU", yes(caps.scaled_mm_cpu))
    table.add_row("torch._scaled_mm on CUDA", yes(caps.scaled_mm_cuda))
    table.add_row("kernels: bf16 GEMM", f"{report['bf16_gemm']['path']} — {report['bf16_gemm']['note']}")
    for label, text in describe_report(report["kernels"]):
        table.add_row(f"kernels: {label}", text)
    table.add_row("recommended recipe", f"{rec['recipe']} — {rec['reason']}")
    table.add_row("FP8 recipe here", f"{rec['fp8_recipe']} — {rec['fp8_note']}")
    # piped or logged output has no terminal width: rich would squeeze the table into 80 columns
    (Console() if sys.stdout.isatty() else Console(width=160)).print(table)
    return 0
