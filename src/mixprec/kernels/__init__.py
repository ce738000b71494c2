"""Fast paths for FP8 on GPUs: fused quantization, native/Triton GEMMs, torch.compile, capability detection.

Everything here imports on a CPU-only machine without triton. The Triton modules
(`triton_quant`, `triton_blockwise_gemm`) import triton themselves: reach them through
`mixprec.kernels.native` (which loads them only when triton and a CUDA device are there), or import
them directly in code that already knows triton is installed (tests use TRITON_INTERPRET=1 on CPU).
"""

from __future__ import annotations

from mixprec.kernels.native import (
    blockwise_backend,
    native_gemm,
    native_kernel_report,
    quantize_fast,
    triton_version,
)

__all__ = [
    "blockwise_backend",
    "native_gemm",
    "native_kernel_report",
    "quantize_fast",
    "triton_version",
]
