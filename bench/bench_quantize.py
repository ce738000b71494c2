"""Cast and quantize throughput against torch's plain x.to(torch.float8_e4m3fn), on the same data in the same run.

    python bench/bench_quantize.py                    # 4096x4096 fp32, 2 threads, 9 interleaved repeats
    python bench/bench_quantize.py --no-compile       # eager only
    python bench/bench_quantize.py --size 1024 --repeats 5

Every case runs once per round, rounds interleave the cases, and each case's ratio is the median over
rounds of (case time / baseline time in the same round): the machine may be shared, and neighbouring
measurements see the same load. Prints a markdown table (docs/benchmarks.md keeps one).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from mixprec.formats import cast_to_format
from mixprec.kernels import compiled as compiled_kernels
from mixprec.quantization import choose_backend, quantize
from mixprec.scaling import Granularity

# (label, kind, format, granularity, target ratio or None)
QUANTIZE_CASES = [
    ("quantize e4m3 per tensor", "e4m3", Granularity.tensor(), 2.0),
    ("quantize e4m3 per row", "e4m3", Granularity.rows(), 2.5),
    ("quantize e4m3 per column", "e4m3", Granularity.columns(), 2.5),
    ("quantize e4m3 1x128", "e4m3", Granularity.blocks(1, 128), 2.5),
    ("quantize e4m3 128x128", "e4m3", Granularity.blocks(128, 128), 2.5),
    ("quantize e4m3 mx32", "e4m3", Granularity.mx(32), 3.0),
    ("quantize e2m1 mx32", "e2m1", Granularity.mx(32), 3.0),
    ("quantize e3m2 mx32", "e3m2", Granularity.mx(32), 3.0),
]
CAST_FORMATS = [  # (format, target): the emulated sub-byte formats have one
    ("e4m3", None),
    ("e5m2", None),
    ("bf16", None),
    ("fp16", None),
    ("tf32", None),
    ("e8m0", None),
    ("e3m2", 3.0),
    ("e2m3", 3.0),
    ("e2m1", 3.0),
]


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def build_cases(x: torch.Tensor, compiled: bool) -> list[tuple[str, str, Callable[[], object], float | None]]:
    """(label, mode, function, target) for every measured case; the baseline first."""
    cases = [("x.to(torch.float8_e4m3fn)", "torch", lambda: x.to(torch.float8_e4m3fn), None)]
    for name, target in CAST_FORMATS:
        cases.append((f"cast_to_format {name}", "eager", lambda n=name: cast_to_format(x, n), target))
        if compiled and name not in ("e8m0", "bf16", "fp16", "e4m3", "e5m2"):
            cases.append(
                (
                    f"cast_to_format {name}",
                    "compiled",
                    lambda n=name: compiled_kernels.cast_to_format(x, n),
                    target,
                )
            )
    for label, fmt, g, target in QUANTIZE_CASES:
        # what quantize's "auto" runs for this tensor (the eager backend at these sizes), by its name
        mode = choose_backend(x, fmt, g)
        cases.append((label, mode, lambda f=fmt, gg=g: quantize(x, f, gg), target))
        if compiled:
            cases.append(
                (label, "compiled", lambda f=fmt, gg=g: quantize(x, f, gg, backend="compiled"), target)
            )
    return cases


def check_same(x: torch.Tensor) -> None:
    """The compiled results are the eager ones, bit for bit (on the benchmark data)."""
    for _, fmt, g, _ in QUANTIZE_CASES:
        a, b = quantize(x, fmt, g, backend="eager"), quantize(x, fmt, g, backend="compiled")
        same = torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(
            a.scale, b.scale
        )
        if not same:
            raise SystemExit(f"compiled quantize differs from eager for {fmt} {g.name}")
    for name, _ in CAST_FORMATS:
        a, b = cast_to_format(x, name), compiled_kernels.cast_to_format(x, name)
        if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
            raise SystemExit(f"compiled cast_to_format differs from eager for {name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="the tensor is size x size fp32")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds (median taken)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.size, args.size, generator=gen)
    x.view(-1)[::997] *= 50.0  # a few outliers, as activations have
    compiled = not args.no_compile and compiled_kernels.available()
    cases = build_cases(x, compiled)

    for _, _, fn, _ in cases:  # warm up: compile, first-touch allocations
        fn()
    if compiled:
        check_same(x)
    times: list[list[float]] = [[] for _ in cases]
    for _ in range(args.repeats):
        for i, (_, _, fn, _) in enumerate(cases):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    base = times[0]

    print(
        f"Machine: {cpu_model()}, {args.threads} threads; torch {torch.__version__}; Python {platform.python_version()}"
    )
    print(
        f"Data: {args.size}x{args.size} fp32 randn (every 997th element x50); {args.repeats} interleaved rounds"
    )
    print(
        f"Command: python bench/bench_quantize.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip()
    )
    print()
    print("| case | mode | median ms | ratio to x.to(e4m3) | target | met |")
    print("|---|---|---:|---:|---:|:---:|")
    for (label, mode, _, target), t in zip(cases, times):
        ratio = statistics.median(ti / bi for ti, bi in zip(t, base))
        met = "" if target is None else ("yes" if ratio <= target else "no")
        tgt = "" if target is None else f"<= {target:g}x"
        print(f"| {label} | {mode} | {statistics.median(t) * 1e3:.1f} | {ratio:.2f}x | {tgt} | {met} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
