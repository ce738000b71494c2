"""FP8 and FP4 quantize in compiled C: the CPU fast path of the tiled backend (E4M3, E5M2, E2M1).

The torch code of the tiled backend makes about ten passes over each tile (fp32 copy, amax, divide,
clamp, cast or integer encode; with the statistics decode, subtract, two dot products), ~35 torch
calls per tile. For the streaming quantize of an 8B checkpoint that is most of the CPU time (fp8 with
the statistics 2.25 ns per element on the AVX-512-BF16 EPYC, 2026-12). csrc/quantize.c does it in two
reads of the input: the block amaxes, then divide, clamp, round, store (E2M1 packed two a byte where
the caller's buffer asks) and, for the reports, the decoded error, all in registers; the scale rule
between the two passes stays scaling.scale_from_amax (NVFP4's E4M3 block scales included). The
payloads are the torch backends' bit for bit (tests/kernels/test_c_quantize.py: every rounding
boundary of the three formats, granularities, packing; and the tiled backend's tests).

The C source ships with the package and is compiled once per machine with the system's C compiler
(`$CC`, else `cc`; no torch headers, so it takes well under a second) into files.cache_dir("kernels")
($MIXPREC_CACHE_DIR, default ~/.cache/mixprec), named by a hash of the source, the flags, the
compiler and the CPU, and loaded with ctypes, which releases the GIL during each call: the stream's
quantize threads run it in parallel. Without a compiler, when the build fails, or with
$MIXPREC_C_KERNELS=off, `unavailable_reason()` says why and every caller keeps the torch code.

What it takes (else `takes` is False and the caller runs the torch code): a 2-D CPU fp32 or bf16
tensor with unit column stride; E4M3, E5M2 or E2M1; fp32, E8M0 (MX) or E4M3-with-a-global-scale
(NVFP4) scales on a block grid whose blocks are at least MIN_BLOCK_COLS wide (or the whole row);
outside torch.compile. A NaN or inf found by either pass hands the
whole tensor back (quantize_compiled returns None): the torch code has their rules.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

from mixprec.files import atomic_file, cache_dir
from mixprec.formats import Format
from mixprec.scaling import Granularity, packed_payload_shape, scale_from_amax

ENV_VAR = "MIXPREC_C_KERNELS"
SOURCE = Path(__file__).with_name("csrc") / "quantize.c"
# -ffp-contract=off: no product fused into a sum (the payload is a plain division anyway);
# -fopenmp-simd: the `omp simd` reductions vectorize without the reordering licence of -ffast-math.
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=off", "-shared", "-fPIC")
_MBITS = {"e4m3": 3, "e5m2": 2, "e2m1": 1}  # the formats the C encodes, by mantissa bits
_INPUTS = (torch.float32, torch.bfloat16)
SLAB_ELEMENTS = 1 << 22  # rows quantized per C call: whole block rows of about this many elements
# The C walks each row block by block: blocks narrower than this (per column, 128 x 1, MX along the
# rows) cost it a scale lookup and a reduction per few elements, 2-3x slower than the torch code in
# the transposed operands of a rowwise / blockwise / MX training step (measured 2026-12-07): declined.
MIN_BLOCK_COLS = 16


def unavailable_reason() -> str | None:
    """Why the compiled quantize is not used in this process, or None."""
    return _load()[1]


def find_compiler() -> str | None:
    """The C compiler the build uses: $CC, else `cc`, else `gcc` on the PATH; None when there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get(ENV_VAR, "").strip().lower() in ("off", "0", "no"):
        return None, f"disabled by {ENV_VAR}={os.environ[ENV_VAR]}"
    compiler = find_compiler()
    if not compiler:
        return None, "no C compiler found (set $CC, or install gcc or clang)"
    try:
        path = _build(compiler)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building {SOURCE.name} with {compiler} failed: {str(e).strip()[:300]}"
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.mixprec_block_amax.argtypes = [ptr, ctypes.c_int, i64, i64, i64, i64, i64, i64, ptr]
    lib.mixprec_block_amax.restype = ctypes.c_int
    lib.mixprec_quantize.argtypes = [ptr, ctypes.c_int, ctypes.c_int, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, ctypes.c_int, ptr]  # fmt: skip
    lib.mixprec_quantize.restype = ctypes.c_int
    return lib, None


def _build(compiler: str) -> Path:
    """The shared library for this source, flags, compiler and CPU: built unless already cached (written
    through files.atomic_file, so concurrent processes never load a half-written file)."""
    source = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(), _cpu_id()]))
    path = cache_dir("kernels", f"quantize-{key.hexdigest()[:16]}.so")
    if path.exists():
        return path
    with atomic_file(path) as tmp:
        done = _compile(compiler, FLAGS, tmp)
        if done.returncode != 0:  # a compiler without -march=native: the baseline ISA, still exact
            done = _compile(compiler, [f for f in FLAGS if f != "-march=native"], tmp)
        if done.returncode != 0:
            raise OSError(done.stderr or f"exit status {done.returncode}")
    return path


def _compile(compiler: str, flags, target: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [compiler, *flags, str(SOURCE), "-o", str(target)], capture_output=True, text=True, timeout=120
    )


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
    """Whether quantize_compiled runs this case here (see the module docstring)."""
    return (
        x2.dim() == 2
        and fmt.name in _MBITS
        and g.scale_format in ("fp32", "e8m0", "e4m3")
        and (g.block_cols is None or g.block_cols >= MIN_BLOCK_COLS or g.block_cols >= x2.shape[1])
        and x2.device.type == "cpu"
        and x2.dtype in _INPUTS
        and (x2.stride(1) == 1 or x2.shape[1] == 1)
        and (x2.stride(0) >= x2.shape[1] or x2.shape[0] == 1)  # rows apart (not an expanded view)
        and (out is None or _out_layout(x2, fmt, out) is not None)
        and not torch.compiler.is_compiling()
        and _load()[0] is not None
    )


def _out_layout(x2: torch.Tensor, fmt: Format, out: torch.Tensor) -> str | None:
    """How the C writes into a payload buffer: "codes" (one a byte), "packed" (E2M1, two a byte), or None
    when it cannot."""
    if out.dtype != (fmt.torch_dtype or torch.uint8) or not out.is_contiguous():
        return None
    if out.shape == x2.shape:
        return "codes"
    return "packed" if tuple(out.shape) == packed_payload_shape(fmt, *x2.shape) else None


def quantize_compiled(
    x2: torch.Tensor,
    fmt: Format,
    g: Granularity,
    *,
    scale: torch.Tensor | None,
    margin: int,
    power_of_two: bool,
    out: torch.Tensor | None,
    stats: bool,
    global_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[float, float] | None] | None:
    """(payload, scale, (amax, relative error) if stats) as the tiled backend returns them, or None when
    x2 holds NaN or inf (the caller then runs the torch code, which has their rules). The caller checked
    takes(); `scale` is a given fp32 scale on the grid, or None to compute it (scaling.scale_from_amax;
    NVFP4's E4M3 block scales in the units of global_scale, which NVFP4 needs, computed or given)."""
    lib = _load()[0]
    if g.scale_format == "e4m3" and global_scale is None:
        return None  # NVFP4 without its global scale: the torch code says what is missing
    rows, cols = x2.shape
    grid = g.scale_shape(rows, cols)
    br, bc = g.block_rows or rows, g.block_cols or cols
    bf16, ld = int(x2.dtype == torch.bfloat16), x2.stride(0) if rows > 1 else cols
    amax, block_amax = 0.0, None
    if scale is None or stats:
        block_amax = torch.empty(grid, dtype=torch.float32)
        if lib.mixprec_block_amax(
            x2.data_ptr(), bf16, rows, cols, ld, br, bc, grid[1], block_amax.data_ptr()
        ):
            return None
        amax = float(block_amax.max())
    packed = out is not None and _out_layout(x2, fmt, out) == "packed"
    data = out if out is not None else torch.empty((rows, cols), dtype=fmt.torch_dtype or torch.uint8)
    rule = {"margin": margin, "power_of_two": power_of_two}
    if g.scale_format == "e4m3":
        rule = {"global_scale": global_scale.float().reshape(1, 1), "dtype": x2.dtype}
    computed = scale is None
    scale = torch.empty(grid, dtype=torch.float32) if computed else scale.float().contiguous()
    sums = [0.0, 0.0]
    part = (ctypes.c_double * 2)() if stats else None
    for r0, r1, g0, g1 in _slabs(rows, cols, br):
        if computed:  # the scale rule is elementwise over the blocks: a slab's scales are its own
            scale[g0:g1] = scale_from_amax(block_amax[g0:g1], fmt, g, **rule)
        divisor = scale[g0:g1] / rule["global_scale"] if "global_scale" in rule else scale[g0:g1]
        divisor = divisor.contiguous()  # NVFP4 divides by block / global, in fp32
        if lib.mixprec_quantize(
            x2.data_ptr() + r0 * ld * x2.element_size(), bf16, _MBITS[fmt.name], r1 - r0, cols, ld,
            divisor.data_ptr(), br, bc, grid[1], data[r0].data_ptr(), data.shape[1], int(packed), part,
        ):  # fmt: skip
            return None
        if stats:
            sums = [sums[0] + part[0], sums[1] + part[1]]
    if not stats:
        return data, scale, None
    return data, scale, (amax, (sums[1] / sums[0]) ** 0.5 if sums[0] > 0 else 0.0)


def _slabs(rows: int, cols: int, br: int):
    """(first row, end row, first scale row, end scale row) of slabs of about SLAB_ELEMENTS elements,
    whole block rows each: the scale rule's temporaries stay slab-sized (NVFP4's grid of a 14336 x 4096
    weight is 3.7M blocks, and its rule makes several temporaries of that size). Blocks that span all
    rows: one slab."""
    height = rows if br >= rows else max(br, SLAB_ELEMENTS // max(cols, 1) // br * br)
    for r0 in range(0, rows, height):
        r1 = min(rows, r0 + height)
        yield r0, r1, r0 // br, -(-r1 // br)


__all__ = ["quantize_compiled", "takes", "unavailable_reason"]
