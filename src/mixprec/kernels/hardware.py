"""What this machine has, detected (never assumed): CPU flags, CUDA device and compute capability,
whether torch._scaled_mm works. These are facts about the chips; what mixprec runs on them is decided
by the GEMM seam (mixprec.gemm) and shown, with the recipe that fits, by `mixprec doctor`.
"""

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
FP4_TENSOR_CORES = (10, 0)  # Blackwell: NVFP4 and MXFP4 (E2M1) tensor cores


@dataclass(frozen=True)
class Capabilities:
    torch_version: str
    python_version: str
    machine: str
    cpu_model: str
    cpu_flags_bf16: bool  # AVX-512-BF16 (x86) or BF16 (Arm: "bf16" among /proc/cpuinfo's Features)
    cpu_flags_amx: bool  # AMX tiles (bf16)
    cuda_available: bool
    cuda_device: str | None
    cuda_capability: tuple[int, int] | None
    bf16_tensor_cores: bool
    fp8_native: bool  # FP8 tensor cores (SM 8.9+) with a working torch._scaled_mm
    mxfp8_native: bool  # MXFP8 tensor cores (SM 10.0+); mixprec.gemm still emulates MX GEMMs there
    scaled_mm_cpu: bool  # torch._scaled_mm runs on this CPU (tensorwise and rowwise)
    scaled_mm_cuda: bool
    # FP4 (E2M1) tensor cores (SM 10.0+) and a torch with the packed FP4 dtype; mixprec.gemm still
    # emulates FP4 GEMMs there (gemm.fp4_native_reason)
    fp4_native: bool = False

    @property
    def cpu_bf16_native(self) -> bool:
        """A bf16 matmul on this CPU is fast only with AVX-512-BF16, AMX or Arm's BF16 instructions."""
        return self.cpu_flags_bf16 or self.cpu_flags_amx

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cpu_bf16_native"] = self.cpu_bf16_native
        return d


def parse_cpuinfo(text: str) -> tuple[str | None, set[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo's text (x86: "flags" names
    avx512_bf16, amx_bf16, amx_tile when the CPU has them; Arm: "Features" names bf16)."""
    model, flags = None, None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key in ("flags", "Features") and flags is None:
            flags = set(value.split())
        if model is not None and flags is not None:
            break
    return model, flags or set()


def _cpu_info() -> tuple[str, set[str]]:
    model, flags = None, set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        model, flags = parse_cpuinfo(cpuinfo.read_text(errors="replace"))
    return model or platform.processor() or platform.machine(), flags


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
        cpu_flags_bf16="avx512_bf16" in flags
        or (platform.machine() in ("aarch64", "arm64") and "bf16" in flags),
        cpu_flags_amx="amx_bf16" in flags or "amx_tile" in flags,
        cuda_available=cuda,
        cuda_device=torch.cuda.get_device_name() if cuda else None,
        cuda_capability=capability,
        bf16_tensor_cores=bool(capability and capability >= BF16_TENSOR_CORES),
        fp8_native=bool(scaled_cuda),
        mxfp8_native=bool(scaled_cuda and capability >= MXFP8_TENSOR_CORES),
        scaled_mm_cpu=_scaled_mm_works("cpu"),
        scaled_mm_cuda=bool(scaled_cuda),
        fp4_native=bool(
            scaled_cuda and capability >= FP4_TENSOR_CORES and hasattr(torch, "float4_e2m1fn_x2")
        ),
    )


def describe_machine(caps: Capabilities | None = None) -> str:
    """One line naming the machine, for reports and benchmark tables."""
    caps = caps or detect()
    where = caps.cuda_device if caps.cuda_available else f"CPU {caps.cpu_model}"
    return f"{where}; torch {caps.torch_version}; Python {caps.python_version}"
