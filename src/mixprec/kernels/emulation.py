"""Which arithmetic the emulated FP8 / FP4 GEMMs run on: fp32, or the CPU's native bf16 units.

The emulation (mixprec.gemm) multiplies decoded payloads. Every E4M3, E5M2 and E2M1 value, and every
such value times a power of two or an E4M3 block scale, is exact in bf16; a bf16 x bf16 product is
exact in fp32; oneDNN's bf16 GEMM accumulates in fp32. So a GEMM of such operands on the bf16 units
forms the same exact products as the fp32 GEMM and differs only in the order of its fp32 sums — at a
fraction of the cost where the CPU has AVX-512-BF16, AMX-BF16 or Arm BF16 (a 1024^3 matmul: 39 ms in
bf16 against 213 ms in fp32 on an AVX-512-BF16 EPYC, issue 27).

The bf16 GEMM runs through torch's oneDNN "fpmath" mode (torch.backends.mkldnn.matmul.fp32_precision =
"bf16"): fp32 tensors in and out, each input rounded to bf16 inside oneDNN — exact for the operands
mixprec.gemm hands it, which it builds bf16-exact (tests check every operand) — and fp32 partial sums
out, so the scales that vary along K can be applied to fp32 partials the way a blockwise kernel does.
torch routes an fp32 matmul to that mode only on CPUs with native bf16 (elsewhere the same call is an
fp32 GEMM with the same exact products): whether it engages is probed once, not assumed.

Backends: "auto" (bf16 where the CPU has native bf16 and the probe sees the mode engage, else fp32),
"fp32" (today's emulation, bit-identical to earlier releases: use it to reproduce numbers across
machines) and "bf16" (forced; on a CPU without native bf16 it runs the same code path with fp32
arithmetic, which is how CI checks its operands and scale handling on every machine kind). The choice
comes from set_backend() / forced(), else the environment variable MIXPREC_GEMM_EMULATION, else "auto";
`mixprec --gemm-emulation fp32 ...` sets it for one command. CUDA tensors always emulate in fp32. Under
torch.compile the mode switch cannot be traced (dynamo skips it), so compiled graphs emulate in fp32.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from mixprec.errors import MixprecError
from mixprec.kernels.hardware import detect

BACKENDS = ("auto", "fp32", "bf16")
ENV_VAR = "MIXPREC_GEMM_EMULATION"

_forced: list[str] = []  # set_backend / forced(): the innermost choice last
_engages: list[bool] = []  # the probe's answer once known (a list read traces as a constant under compile)


def _check(backend: str, where: str) -> str:
    if backend not in BACKENDS:
        raise MixprecError(
            f"{where}: unknown GEMM emulation backend {backend!r}; valid: {', '.join(BACKENDS)}"
        )
    return backend


def requested() -> str:
    """The backend asked for: set_backend() / forced(), else $MIXPREC_GEMM_EMULATION, else "auto"."""
    if _forced:
        return _forced[-1]
    value = os.environ.get(ENV_VAR, "").strip().lower()
    return _check(value, f"environment variable {ENV_VAR}") if value else "auto"


def set_backend(backend: str | None) -> None:
    """Choose the backend for this process ("auto", "fp32", "bf16"); None goes back to the environment."""
    _forced.clear()
    if backend is not None:
        _forced.append(_check(backend, "set_backend"))


@contextlib.contextmanager
def forced(backend: str) -> Iterator[None]:
    """Run a block with this backend, then restore the previous choice."""
    _forced.append(_check(backend, "forced"))
    try:
        yield
    finally:
        _forced.pop()


def native_bf16() -> bool:
    """The CPU has native bf16 GEMMs (AVX-512-BF16, AMX-BF16, Arm BF16) and torch's fp32 matmul takes
    the bf16 mode on it (probed once: an fp32 matmul of non-bf16-exact values changes under the mode)."""
    if not _engages:
        _engages.append(detect().cpu_bf16_native and _mode_engages())
    return _engages[0]


def _mode_engages() -> bool:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 256, generator=gen)
    b = torch.randn(256, 64, generator=gen)
    try:
        with _bf16_mode():
            fast = torch.mm(a, b.t().contiguous().t())  # the transposed view mixprec.gemm passes
    except (RuntimeError, AttributeError):
        return False
    return not torch.equal(fast, torch.mm(a, b.t().contiguous().t()))


def backend_for(device: torch.device) -> str:
    """The arithmetic an emulated GEMM on `device` runs: "fp32" or "bf16"."""
    if device.type != "cpu" or torch.compiler.is_compiling():
        return "fp32"
    choice = requested()
    if choice == "auto":
        return "bf16" if native_bf16() else "fp32"
    return choice


def describe(device: torch.device | str = "cpu") -> str:
    """One phrase for reports: which arithmetic the emulated GEMMs ran on, and why."""
    device = torch.device(device)
    used, choice = backend_for(device), requested()
    if device.type != "cpu":
        return f"FP8/FP4 emulation in fp32 ({device.type})"
    if used == "fp32":
        why = "forced" if choice == "fp32" else "no native bf16 GEMM on this CPU"
        return f"FP8/FP4 emulation in fp32 ({why})"
    if native_bf16():
        return "FP8/FP4 emulation on native bf16 GEMMs" + (" (forced)" if choice == "bf16" else "")
    return "FP8/FP4 emulation on the bf16 path (forced; this CPU runs it in fp32 arithmetic)"


@contextlib.contextmanager
def _bf16_mode() -> Iterator[None]:
    settings = torch.backends.mkldnn.matmul
    old = settings.fp32_precision
    settings.fp32_precision = "bf16"
    try:
        yield
    finally:
        settings.fp32_precision = old


def on_bf16_units(backend: str) -> bool:
    """Whether `backend`'s GEMMs run on the bf16 units here: "bf16" on a CPU whose torch takes the mode
    (forced "bf16" elsewhere is the same code in fp32 arithmetic)."""
    return backend == "bf16" and native_bf16()


def gemm_context(backend: str) -> contextlib.AbstractContextManager:
    """Around the emulation's matmuls: the bf16 mode where on_bf16_units(backend), else nothing. The
    operands inside must be bf16-exact: mixprec.gemm builds them so."""
    if on_bf16_units(backend):
        return _bf16_mode()
    return contextlib.nullcontext()


def is_bf16_exact(x: torch.Tensor) -> bool:
    """Every value of the fp32 tensor x survives a round trip through bf16 (for tests and checks)."""
    return bool(torch.equal(x.to(torch.bfloat16).float(), x))


__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "backend_for",
    "describe",
    "forced",
    "gemm_context",
    "is_bf16_exact",
    "native_bf16",
    "on_bf16_units",
    "requested",
    "set_backend",
]
