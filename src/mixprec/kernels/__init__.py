"""Backends only: quantize kernels, GEMM kernels, and capability detection.

- quantize backends, chosen by mixprec.quantization.quantize (bit-identical results):
  `traceable` (graph-break-free torch, what torch.compile traces), `compiled` (that code compiled
  by Inductor for the CPU; also graph-break checks), `tiled` (CPU tiles in reused buffers, bounded
  memory, optional error statistics; NVFP4 and MX included; its CPU fast path `c_quantize`, C compiled
  on the machine from csrc/quantize.c), `triton_quant` (fused Triton kernels for CUDA);
- `codes`: the integer encode of the sub-byte formats (FP4, FP6) that the CPU backends use;
- GEMM kernels, chosen by mixprec.gemm.scaled_mm: `native` (probed torch._scaled_mm / F.scaled_mm
  scale layouts, the blockwise plan, the kernel report for `mixprec doctor`) and
  `triton_blockwise_gemm`;
- `hardware`: what this machine can run, detected, never assumed.
- `bf16_cpu`: bf16/fp16 GEMMs computed in fp32 and rounded once on CPUs without AVX-512-BF16 / AMX
  (decided from `hardware`), for training (convert_for_training) and inference calibration alike.

Everything here imports on a CPU-only machine without triton. The Triton modules
(`triton_quant`, `triton_blockwise_gemm`) import triton themselves: they are reached through imports
inside functions where triton is known to be installed (tests use TRITON_INTERPRET=1 on CPU).
Kernels import only the numerics (formats, scaling) and each other.
"""

from __future__ import annotations

from mixprec.kernels.native import (
    blockwise_backend,
    native_gemm,
    native_kernel_report,
    triton_version,
)

__all__ = [
    "blockwise_backend",
    "native_gemm",
    "native_kernel_report",
    "triton_version",
]
