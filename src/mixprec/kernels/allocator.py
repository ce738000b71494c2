"""Keep freed memory in the process for the compute workflows (training, comparison, profile, evaluate).

glibc hands a freed block of 128 KiB or more back to the kernel (its mmap threshold, which adapts up to
32 MiB, and heap trimming above the trim threshold), so the next tensor of that size is fresh pages:
one page fault per 4 KiB on its first write. An emulated FP8 GEMM allocates and frees about a dozen
[tokens, hidden] buffers per call (decoded operands, scaled copies, the fp32 result). On the AMX
Xeon (2026-12-06, glibc's thresholds set to these values through GLIBC_TUNABLES, one probe each) a
2048 x 1024 x 1024 MX scaled_mm took 8.0 ms with glibc's defaults against 4.1 ms, and a fp8-current
training step 139 ms against 113 ms in two separate bench runs (issue 27).
PyTorch's and Intel's CPU tuning guides preload jemalloc or tcmalloc for the same reason; a running
process cannot preload an allocator, so this sets glibc's two thresholds with mallopt: blocks up to
32 MiB (glibc's largest mmap threshold) come from the heap, and the heap's top is trimmed only when
more than 2 GiB of it is free.

The cost: the resident size stays near its peak instead of shrinking after a phase, and heap
fragmentation can raise the peak a little. The streaming quantize, whose peak memory is a promise
(issue 30), does not call it: it hands blocks of 4 MiB or more back at once instead
(large_blocks_returned). Commands that keep freed memory say so with KEEPS_FREED_MEMORY = True. No-op off glibc
(musl, macOS, Windows) and when $MIXPREC_MALLOC is "default".
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
from collections.abc import Iterator

from mixprec.errors import MixprecError

ENV_VAR = "MIXPREC_MALLOC"
CHOICES = ("keep", "default")
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: larger values are refused
_TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: the heap's top is trimmed only above 2 GiB free

_state: list[str] = []  # what keep_freed_memory() did, once
_KEPT = "freed memory kept (glibc: mmap threshold 32 MiB, trim threshold 2 GiB)"


def requested() -> str:
    value = os.environ.get(ENV_VAR, "").strip().lower() or "keep"
    if value not in CHOICES:
        raise MixprecError(f"environment variable {ENV_VAR}={value!r}: valid values are {', '.join(CHOICES)}")
    return value


def keep_freed_memory() -> str:
    """Set glibc's thresholds (once per process); returns what this process's allocator does now."""
    if _state:
        return _state[0]
    _state.append(_apply())
    return _state[0]


def _apply() -> str:
    if requested() == "default":
        return f"the C library's defaults (${ENV_VAR}=default)"
    libc = _glibc()
    if libc is None:
        return "the C library's defaults (not glibc)"
    ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    if not ok:
        return "the C library's defaults (glibc refused mallopt)"
    return _KEPT


@functools.cache  # find_library runs ldconfig: ~6 ms, once per GPTQ group before (1 % of a SmolLM2 run)
def _glibc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 (present on glibc only)
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def release_free_memory() -> None:
    """Hand the heap's free pages back to the kernel (glibc's malloc_trim; a no-op elsewhere, and in a
    process that keeps freed memory). For a walk over blocks whose peak memory is a promise (the
    layer-by-layer calibration and GPTQ): a block's transient buffers of a few to 32 MiB are freed into
    the heap, where they fragment and the next block's peak adds to them. Measured on a 6-block
    synthetic checkpoint (hidden 2048, nvfp4a16 GPTQ --layer-by-layer, AVX-512 EPYC): peak RSS
    1.80 GB with glibc's defaults; trimmed after each block, see docs/benchmarks.md."""
    if _state and _state[0] == _KEPT:
        return
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


# Blocks of this size or more are mapped and unmapped one by one inside large_blocks_returned().
_RETURN_THRESHOLD = 4 << 20


@contextlib.contextmanager
def large_blocks_returned() -> Iterator[None]:
    """Within: glibc's mmap threshold fixed at 4 MiB, so that a freed block of 4 MiB or more goes back to
    the kernel at once; after: 32 MiB, the largest value glibc adapts it to. For the streaming quantize,
    whose peak memory is a promise: glibc's adaptive threshold grows with the first large blocks freed, and
    later ones of up to 32 MiB (a weight's block scales) stay in the heap, where the next
    weights' peak adds to them. Measured on 4 full-size Llama-3.1-8B blocks to nvfp4a16 (AVX-512 EPYC,
    2 runs each): peak RSS 873 and 874 MiB against 913 and 974 MiB, the wall time within the runs'
    scatter. A no-op off glibc and where keep_freed_memory() is in effect."""
    libc = _glibc()
    if libc is None or (_state and _state[0] == _KEPT):
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _RETURN_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)


def describe() -> str:
    """One phrase for reports: what the allocator does in this process."""
    return _state[0] if _state else "the C library's defaults"


__all__ = [
    "CHOICES",
    "ENV_VAR",
    "describe",
    "keep_freed_memory",
    "large_blocks_returned",
    "release_free_memory",
    "requested",
]
