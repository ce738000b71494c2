"""Compile the Triton kernels for sm_90 (H100/H200) on a machine without a GPU; print one line per kernel.

Run as a script (TRITON_INTERPRET must be unset: the interpreter replaces the kernels). Used by
test_triton_compile.py; `python tests/kernels/_aot_compile.py` shows registers and spills by hand.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mixprec.formats import E4M3
from mixprec.kernels import triton_blockwise_gemm as tg
from mixprec.kernels import triton_quant as tq

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(cubin: bytes) -> str:
    if not os.path.exists(CUOBJDUMP):
        return "REG:? STACK:?"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    out = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    line = next((ln.strip() for ln in out.splitlines() if "REG:" in ln), "REG:? STACK:?")
    return " ".join(line.split()[:2])


def quant(name: str, rows: int, cols: int, br, bc) -> None:
    plan = tq._plan(rows, cols, br, bc)
    f = E4M3
    for mode in (0, 1) if plan.fused else (2, 1):
        sig = {n: "i32" for n in ("R", "C", "sxr", "sxc", "sqr", "sqc", "ssr", "ssc")}
        sig = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", **sig}
        consts = dict(
            MODE=mode, PER_ROW=plan.per_row, TR=plan.tr, BC=plan.bc, SUB_R=plan.sub_r, SUB_C=plan.sub_c,
            TPB_R=plan.tpb_r, TPB_C=plan.tpb_c, QMAX=float(f.max), MANT=f.mantissa_bits, BIAS=f.bias,
            MIN_NORMAL=float(f.min_normal), DENOM=float(f.max), EMAX=f.emax, KIND=0,
        )  # fmt: skip
        sig.update(dict.fromkeys(consts, "constexpr"))
        warps = 4 if plan.sub_r * plan.sub_c <= 1024 else 8
        k = triton.compile(
            ASTSource(tq._quant_kernel, sig, constexprs=consts), target=TARGET, options={"num_warps": warps}
        )
        ptx = k.asm["ptx"]
        print(
            f"quant {name} mode={mode} {resources(k.asm['cubin'])} div_rn={'div.rn.f32' in ptx} div_full={'div.full' in ptx}"
        )


def gemm(a_type: str, b_type: str, b_rows: int) -> None:
    names = ("M", "N", "K", "sam", "sak", "sbn", "sbk", "ssam", "ssak", "ssbn", "ssbk", "scm", "scn")
    sig = {
        "a_ptr": a_type,
        "b_ptr": b_type,
        "sa_ptr": "*fp32",
        "sb_ptr": "*fp32",
        "bias_ptr": "*fp32",
        "c_ptr": "*bf16",
    }
    sig.update(dict.fromkeys(names, "i32"))
    consts = dict(A_TILE_ROWS=1, B_TILE_ROWS=b_rows, HAS_BIAS=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128)
    sig.update(dict.fromkeys(consts, "constexpr"))
    k = triton.compile(
        ASTSource(tg._blockwise_mm_kernel, sig, constexprs=consts),
        target=TARGET,
        options={"num_warps": 8, "num_stages": 3},
    )
    print(
        f"gemm {a_type}x{b_type} b_rows={b_rows} {resources(k.asm['cubin'])} wgmma={'wgmma' in k.asm['ptx']}"
    )


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET to compile", file=sys.stderr)
        return 2
    quant("rows-14336", 4096, 14336, 1, None)
    quant("1x128", 4096, 4096, 1, 128)
    quant("128x128", 4096, 4096, 128, 128)
    quant("tensor", 4096, 4096, None, None)
    gemm("*fp8e4nv", "*fp8e4nv", 128)
    gemm("*fp8e5", "*fp8e4nv", 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
