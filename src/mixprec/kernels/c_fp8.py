"""FP8 quantize in one pass of compiled C: the CPU fast path of the tiled backend for E4M3 / E5M2.

The torch code of the tiled backend makes about ten passes over each tile (fp32 copy, amax, divide,
clamp, cast; with the statistics decode, subtract, two dot products), ~35 torch calls per tile. For
the streaming quantize of an 8B checkpoint that is most of the CPU time (2.25 ns per element with the
statistics on the AVX-512-BF16 EPYC, 2026-12). csrc/fp8_quantize.c does it in two reads of the input:
the block amaxes, then divide, clamp, round, store and, for the reports, the decoded error, all in
registers; the scale rule between the two passes stays scaling.scale_from_amax. The payloads are the
torch backends' bit for bit (tests/kernels/test_c_fp8.py: every E4M3 and E5M2 rounding boundary, and
the tiled backend's tests in tests/kernels/test_tiled.py).

The C source ships with the package and is compiled once per machine with the system's C compiler
(`$CC`, else `cc`; no torch headers, so it takes well under a second) into
$MIXPREC_CACHE_DIR (default ~/.cache/mixprec)/kernels, named by a hash of the source, the flags, the
compiler and the CPU, and loaded with ctypes, which releases the GIL during each call: the stream's
quantize threads run it in parallel. Without a compiler, when the build fails, or with
$MIXPREC_C_KERNELS=off, `unavailable_reason()` says why and every caller keeps the torch path.

What it takes (else `quantize_fp8` returns None and the caller runs the torch code): a 2-D CPU fp32 or
bf16 tensor with unit column stride, an FP8 format torch has a dtype for, fp32 or E8M0 scales on any
block grid (per tensor, rows, columns, blocks, MX), finite values (a NaN or inf found by a pass hands
the whole tensor back), outside torch.compile.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from mixprec.formats import Format
from mixprec.scaling import Granularity, scale_from_amax

ENV_VAR = "MIXPREC_C_KERNELS"
CACHE_ENV_VAR = "MIXPREC_CACHE_DIR"
SOURCE = Path(__file__).with_name("csrc") / "fp8_quantize.c"
# -ffp-contract=off: no product fused into a sum (the payload is a plain division anyway);
# -fopenmp-simd: the `omp simd` reductions vectorize without the reordering licence of -ffast-math.
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=off", "-shared", "-fPIC")
_MBITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
_INPUTS = (torch.float32, torch.bfloat16)


def unavailable_reason() -> str | None:
    """Why the compiled FP8 quantize is not used in this process, or None."""
    return _load()[1]


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get(ENV_VAR, "").strip().lower() in ("off", "0", "no"):
        return None, f"disabled by {ENV_VAR}={os.environ[ENV_VAR]}"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None, "no C compiler found (set $CC, or install gcc or clang)"
    try:
        path = _build(compiler)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building {SOURCE.name} with {compiler} failed: {str(e).strip()[:300]}"
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.mixprec_fp8_amax.argtypes = [ptr, ctypes.c_int, i64, i64, i64, i64, i64, i64, ptr]
    lib.mixprec_fp8_amax.restype = ctypes.c_int
    lib.mixprec_fp8_quantize.argtypes = [ptr, ctypes.c_int, ctypes.c_int, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, ptr]  # fmt: skip
    lib.mixprec_fp8_quantize.restype = ctypes.c_int
    return lib, None


def _build(compiler: str) -> Path:
    """The shared library for this source, flags, compiler and CPU: built unless already cached (written
    to a temporary name and renamed, so concurrent processes never load a half-written file)."""
    source = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(), _cpu_id()]))
    cache = Path(os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "mixprec") / "kernels"
    path = cache / f"fp8_quantize-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise OSError(done.stderr or f"exit status {done.returncode}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _cpu_id() -> bytes:
    """What -march=native compiles for: the CPU's model and flags (Linux), else the platform."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(
            sorted({x for x in lines if x.startswith(("model name", "flags", "Features"))})
        ).encode()
    except OSError:
        return f"{platform.machine()} {platform.processor()}".encode()


def takes(x2: torch.Tensor, fmt: Format, g: Granularity, out: torch.Tensor | None) -> bool:
    """Whether quantize_fp8 runs this case here (see the module docstring)."""
    return (
        fmt.bits == 8
        and fmt.torch_dtype in _MBITS
        and g.scale_format in ("fp32", "e8m0")
        and x2.device.type == "cpu"
        and x2.dtype in _INPUTS
        and x2.dim() == 2
        and (x2.stride(1) == 1 or x2.shape[1] == 1)
        and (x2.stride(0) >= x2.shape[1] or x2.shape[0] == 1)  # rows apart (not an expanded view)
        and (out is None or (out.dtype == fmt.torch_dtype and out.is_contiguous() and out.shape == x2.shape))
        and not torch.compiler.is_compiling()
        and _load()[0] is not None
    )


def quantize_fp8(
    x2: torch.Tensor,
    fmt: Format,
    g: Granularity,
    *,
    scale: torch.Tensor | None,
    margin: int,
    power_of_two: bool,
    out: torch.Tensor | None,
    stats: bool,
) -> tuple[torch.Tensor, torch.Tensor, tuple[float, float] | None] | None:
    """(payload, scale, (amax, relative error) if stats) as the tiled backend returns them, or None when
    x2 holds NaN or inf (the caller then runs the torch code, which has their rules). The caller checked
    takes(); `scale` is a given fp32 scale on the grid, or None to compute it."""
    lib = _load()[0]
    rows, cols = x2.shape
    grid = g.scale_shape(rows, cols)
    br, bc = g.block_rows or rows, g.block_cols or cols
    bf16, ld = int(x2.dtype == torch.bfloat16), x2.stride(0) if rows > 1 else cols
    amax = 0.0
    if scale is None or stats:
        block_amax = torch.empty(grid, dtype=torch.float32)
        if lib.mixprec_fp8_amax(x2.data_ptr(), bf16, rows, cols, ld, br, bc, grid[1], block_amax.data_ptr()):
            return None
        amax = float(block_amax.max())
        if scale is None:
            scale = scale_from_amax(block_amax, fmt, g, margin, power_of_two)
    scale = scale.float().contiguous()
    data = out if out is not None else torch.empty((rows, cols), dtype=fmt.torch_dtype)
    sums = (ctypes.c_double * 2)() if stats else None
    nan = lib.mixprec_fp8_quantize(
        x2.data_ptr(), bf16, _MBITS[fmt.torch_dtype], rows, cols, ld, scale.data_ptr(),
        br, bc, grid[1], data.data_ptr(), cols, sums,
    )  # fmt: skip
    if nan:
        return None
    if not stats:
        return data, scale, None
    ref2, err2 = sums[0], sums[1]
    return data, scale, (amax, (err2 / ref2) ** 0.5 if ref2 > 0 else 0.0)


__all__ = ["quantize_fp8", "takes", "unavailable_reason"]
