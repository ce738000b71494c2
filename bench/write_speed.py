"""Sustained write speed of this machine's disk, three ways: buffered write() calls, the shard writer's
O_DIRECT path (mixprec.inference.checkpoint.direct_file.ShardFile), and a kernel-side copy
(os.copy_file_range, what shutil's copy of the files does on Linux) -- the reason for direct shard writes.

    python bench/write_speed.py [--gb 3] [--rounds 2] [--dir /tmp]

Writes a source file of --gb GB of random bytes into --dir, then per round, in rotating order, writes a
new file of the same bytes each way (os.sync() before each, not timed; the file is deleted after). Prints
GB/s per round and the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quantized_forward import machine
from mixprec.inference.checkpoint.direct_file import ShardFile

CHUNK = 16 << 20  # bytes read from the source at a time
PIECE = 1 << 20  # bytes handed to one write() (the shard writer's piece)


def _source(path: Path, nbytes: int) -> None:
    gen = torch.Generator().manual_seed(0)
    block = torch.randint(0, 256, (CHUNK,), dtype=torch.uint8, generator=gen).numpy().tobytes()
    with open(path, "wb") as f:
        for _ in range(nbytes // CHUNK):
            f.write(block)


def _through(src: Path, dst: Path, direct: bool) -> None:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    out = ShardFile(dst, direct=direct)
    with open(src, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            for start in range(0, n, PIECE):
                out.write(view[start : min(n, start + PIECE)])
    out.close()


def _kernel_copy(src: Path, dst: Path) -> None:
    size = src.stat().st_size
    fin = os.open(src, os.O_RDONLY)
    fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        done = 0
        while done < size:
            done += os.copy_file_range(fin, fout, size - done)
    finally:
        os.close(fin)
        os.close(fout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dir", type=Path, default=None)
    args = p.parse_args()
    print(machine())
    ways = {
        "buffered write()": lambda s, d: _through(s, d, direct=False),
        "O_DIRECT (ShardFile)": lambda s, d: _through(s, d, direct=True),
        "copy_file_range": _kernel_copy,
    }
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        src, dst = Path(tmp) / "src.bin", Path(tmp) / "dst.bin"
        nbytes = int(args.gb * 1e9) // CHUNK * CHUNK
        _source(src, nbytes)
        speeds: dict[str, list[float]] = {w: [] for w in ways}
        names = list(ways)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                os.sync()
                t0 = time.perf_counter()
                ways[name](src, dst)
                speeds[name].append(nbytes / (time.perf_counter() - t0) / 1e9)
                dst.unlink()
                print(f"round {r + 1}: {name}: {speeds[name][-1]:.2f} GB/s", flush=True)
    print(f"\n{nbytes / 1e9:.2f} GB each, median of {args.rounds} rounds:")
    for name, v in speeds.items():
        print(f"  {name:<22} {statistics.median(v):.2f} GB/s  ({', '.join(f'{x:.2f}' for x in v)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
