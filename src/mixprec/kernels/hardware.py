"""What this machine runs natively, detected (never assumed), and what mixprec would pick on it."""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import torch

# Compute capabilities at which NVIDIA tensor cores gain each format.
BF16_TENSOR_CORES = (8, 0)  # Ampere
FP8_TENSOR_CORES = (8, 9)  # Ada / Hopper
MXFP8_TENSOR_CORES = (10, 0)  # Blackwell


@dataclass(frozen=True)
class Capabilities:
    torch_version: str
    python_version: str
    machine: str
    cpu_model: str
    cpu_flags_bf16: bool  # AVX-512-BF16
    cpu_flags_amx: bool  # AMX tiles (bf16)
    cuda_available: bool
    cuda_device: str | None
    cuda_capability: tuple[int, int] | None
    bf16_tensor_cores: bool
    fp8_native: bool  # FP8 tensor cores (SM 8.9+) with a working torch._scaled_mm
    mxfp8_native: bool  # SM 10.0+
    scaled_mm_cpu: bool  # torch._scaled_mm runs on this CPU (tensorwise and rowwise)
    scaled_mm_cuda: bool

    @property
    def cpu_bf16_native(self) -> bool:
        """A bf16 matmul on this CPU is fast only with AVX-512-BF16 or AMX."""
        return self.cpu_flags_bf16 or self.cpu_flags_amx

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cpu_bf16_native"] = self.cpu_bf16_native
        return d


def _cpu_info() -> tuple[str, set[str]]:
    model, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name":
                model = value.strip()
            elif key == "flags":
                flags = set(value.split())
            if model and flags:
                break
    return model, flags


def _scaled_mm_works(device: str) -> bool:
    """Run a tiny tensorwise and rowwise torch._scaled_mm; any failure means "no"."""
    try:
        a = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
        b = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        out = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        rows = torch._scaled_mm(
            a, b.t(), scale_a=torch.ones(16, 1, device=device), scale_b=torch.ones(1, 16, device=device),
            out_dtype=torch.bfloat16,
        )  # fmt: skip
        return bool((out == 32).all() and (rows.float() == 32).all())
    except (RuntimeError, TypeError, AttributeError, NotImplementedError):
        return False


@cache
def detect() -> Capabilities:
    """Probe the machine once per process."""
    model, flags = _cpu_info()
    cuda = torch.cuda.is_available()
    capability = torch.cuda.get_device_capability() if cuda else None
    scaled_cuda = (
        cuda and capability is not None and capability >= FP8_TENSOR_CORES and _scaled_mm_works("cuda")
    )
    return Capabilities(
        torch_version=torch.__version__,
        python_version=platform.python_version(),
        machine=platform.machine(),
        cpu_model=model,
        cpu_flags_bf16="avx512_bf16" in flags,
        cpu_flags_amx="amx_bf16" in flags or "amx_tile" in flags,
        cuda_available=cuda,
        cuda_device=torch.cuda.get_device_name() if cuda else None,
        cuda_capability=capability,
        bf16_tensor_cores=bool(capability and capability >= BF16_TENSOR_CORES),
        fp8_native=bool(scaled_cuda),
        mxfp8_native=bool(scaled_cuda and capability >= MXFP8_TENSOR_CORES),
        scaled_mm_cpu=_scaled_mm_works("cpu"),
        scaled_mm_cuda=bool(scaled_cuda),
    )


def describe_machine(caps: Capabilities | None = None) -> str:
    """One line naming the machine, for reports and benchmark tables."""
    caps = caps or detect()
    where = caps.cuda_device if caps.cuda_available else f"CPU {caps.cpu_model}"
    return f"{where}; torch {caps.torch_version}; Python {caps.python_version}"


def recommendation(caps: Capabilities | None = None) -> dict:
    """Which recipe and GEMM kernels mixprec would choose on this machine, and why."""
    caps = caps or detect()
    if caps.mxfp8_native:
        recipe, why = "fp8-mxfp8", "SM 10.0+: MXFP8 tensor cores with E8M0 block scales"
    elif caps.fp8_native:
        recipe, why = (
            "fp8-delayed",
            "SM 8.9+: FP8 tensor cores via torch._scaled_mm (per-tensor scales fastest)",
        )
    elif caps.bf16_tensor_cores:
        recipe, why = "bf16", "BF16 tensor cores but no FP8: train in bf16"
    else:
        recipe, why = (
            "fp8-delayed",
            "no FP8 hardware: FP8 runs emulated (same numerics), for validation, not speed",
        )
    kernels = {
        "tensorwise": "native torch._scaled_mm" if caps.fp8_native else "emulated (dequantize + fp32 matmul)",
        "rowwise": "native torch._scaled_mm" if caps.fp8_native else "emulated (dequantize + fp32 matmul)",
        "blockwise": "native (F.scaled_mm / Triton) where supported" if caps.fp8_native else "emulated",
        "mxfp8": "native" if caps.mxfp8_native else "emulated (no MXFP8 tensor cores)",
        "bf16_matmul": (
            "native bf16 tensor cores" if caps.bf16_tensor_cores
            else "native bf16 CPU kernels" if caps.cpu_bf16_native
            else "fp32 matmul rounded to bf16 (native bf16 is slow on this CPU)"
        ),
    }  # fmt: skip
    return {"recipe": recipe, "reason": why, "gemm_kernels": kernels}
