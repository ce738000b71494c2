"""`mixprec doctor`: what this machine runs natively and what mixprec would choose."""

from __future__ import annotations

import argparse
import json

from mixprec.kernels.hardware import detect, recommendation

NAME = "doctor"
HELP = "report native BF16/FP8 support on this machine and the recipe and kernels mixprec would choose"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    from mixprec.kernels.native import describe_report, native_kernel_report

    caps = detect()
    rec = recommendation(caps)
    kernels = native_kernel_report()
    if args.json:
        out = {"schema_version": 1, "capabilities": caps.to_dict(), "recommendation": rec, "kernels": kernels}
        print(json.dumps(out, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

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
    table.add_row("torch._scaled_mm on CPU", yes(caps.scaled_mm_cpu))
    table.add_row("torch._scaled_mm on CUDA", yes(caps.scaled_mm_cuda))
    for kind, kernel in rec["gemm_kernels"].items():
        table.add_row(f"GEMM: {kind}", kernel)
    for label, text in describe_report(kernels):  # what mixprec.kernels would actually run (probed)
        table.add_row(f"kernels: {label}", text)
    table.add_row("recommended recipe", f"{rec['recipe']} — {rec['reason']}")
    Console().print(table)
    return 0
