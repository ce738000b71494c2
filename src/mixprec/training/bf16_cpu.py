"""Training's name for the CPU bf16 path: bf16/fp16 GEMMs computed in fp32 and rounded once on CPUs
without AVX-512-BF16 / AMX. The code and the decision live in mixprec.kernels.bf16_cpu (the kernels
layer), so that inference calibration uses the same path; see that module for what it computes and
why. `convert_for_training(..., cpu_bf16_gemm=...)` installs it through `should_install` / `install`.
"""

from __future__ import annotations

from mixprec.kernels.bf16_cpu import (
    GEMM_FUNCTIONS,
    Fp32ComputeMode,
    Installed,
    cpu_has_fast_bf16,
    fp32_compute,
    gemms_in_fp32,
    install,
    should_install,
)

__all__ = [
    "GEMM_FUNCTIONS",
    "Fp32ComputeMode",
    "Installed",
    "cpu_has_fast_bf16",
    "fp32_compute",
    "gemms_in_fp32",
    "install",
    "should_install",
]
