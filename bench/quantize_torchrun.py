"""Benchmark: `mixprec quantize` in one process against `torchrun --nproc-per-node 2` (issue 30).

Rows, each run alternately in one process and split across two gloo ranks (`--repeats` rounds, medians):
  - streaming fp8-dynamic and nvfp4a16 of a synthetic Llama-shaped bf16 checkpoint (`--size-gb`, shards of
    `--shard-gb`; made in a temporary directory and deleted afterwards);
  - fp8-static with an FP8 KV cache, calibrated layer by layer on `--calib` (`--calib-samples` x
    `--calib-seq-len`), of a real model directory (`--model`, e.g. SmolLM2-135M from bench/make_smollm2.py).
Every split output is checked byte for byte (sha256 of every file) against the one-process output. Peak RSS
is the largest single process's (wait4 of the launcher: one rank's, not the ranks' sum). torchrun gives each
rank one intra-op thread (OMP_NUM_THREADS=1); the one process uses torch's default. Prints a markdown table.

    python bench/quantize_torchrun.py --model /tmp/realmodels/smol-hf --calib /tmp/realmodels/calib.txt
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from bench_checkpoint_quantize import write_synthetic_llama
from bench_quantized_forward import machine
from child_rss import run_measured

BIN = Path(sys.executable).parent


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def quantize_cmd(world: int, model: Path, out: Path, scheme: str, extra: list[str]) -> list[str]:
    args = ["quantize", "--model", str(model), "--output", str(out), "--scheme", scheme, "--quiet", *extra]
    if world == 1:
        return [sys.executable, "-m", "mixprec", *args]
    return [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={world}", "-m", "mixprec", *args]


def measure_row(name: str, model: Path, scheme: str, extra: list[str], root: Path, repeats: int) -> dict:
    """Alternating one-process and two-rank runs; the outputs compared byte for byte (each round's)."""
    times: dict[int, list[float]] = {1: [], 2: []}
    rss: dict[int, list[int]] = {1: [], 2: []}
    identical = True
    for r in range(repeats):
        digests = {}
        for world in (1, 2):
            out = root / f"{name}-{world}"
            shutil.rmtree(out, ignore_errors=True)
            seconds, code, peak = run_measured(
                quantize_cmd(world, model, out, scheme, extra), root / "log.txt"
            )
            if code != 0:
                raise SystemExit(
                    f"{name}, {world} process(es) failed:\n{(root / 'log.txt').read_text()[-3000:]}"
                )
            times[world].append(seconds)
            rss[world].append(peak)
            digests[world] = digest(out)
            shutil.rmtree(out)  # disk is limited
        identical &= digests[1] == digests[2]
        print(f"  {name} round {r + 1}: one {times[1][-1]:.1f} s, two ranks {times[2][-1]:.1f} s", flush=True)
    one, two = statistics.median(times[1]), statistics.median(times[2])
    return {"name": name, "one": one, "two": two, "ratio": two / one, "rss_one": max(rss[1]),
            "rss_two": max(rss[2]), "identical": identical}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--shard-gb", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model", type=Path, help="a real model directory for the calibrated row")
    p.add_argument("--calib", type=Path, help="calibration text for the calibrated row")
    p.add_argument("--calib-samples", type=int, default=16)
    p.add_argument("--calib-seq-len", type=int, default=256)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(
        prefix="mixprec-torchrun-bench-", dir=os.environ.get("BENCH_DIR")
    ) as tmp:
        root = Path(tmp)
        synth = root / "synthetic"
        info = write_synthetic_llama(synth, args.size_gb, args.shard_gb)
        print(f"synthetic checkpoint: {info['bytes'] / 1e9:.2f} GB, {info['shards']} shards", flush=True)
        shard = ["--max-shard-size", f"{int(args.shard_gb * 1024)}MB"]
        for scheme in ("fp8-dynamic", "nvfp4a16"):
            rows.append(measure_row(scheme, synth, scheme, shard, root, args.repeats))
        shutil.rmtree(synth)
        if args.model is not None and args.calib is not None:
            calib = ["--calib-data", str(args.calib), "--calib-samples", str(args.calib_samples),
                     "--calib-seq-len", str(args.calib_seq_len), "--kv-cache", "fp8", "--layer-by-layer",
                     "--max-shard-size", "100MB"]  # fmt: skip
            rows.append(
                measure_row("fp8-static (calibrated)", args.model, "fp8-static", calib, root, args.repeats)
            )
    print(f"\nmachine: {machine()}; torch {torch.__version__}; {args.repeats} alternating rounds, medians\n")
    print("| job | one process | torchrun, 2 ranks | ratio | peak RSS one / per rank | bytes identical |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['one']:.1f} s | {r['two']:.1f} s | {r['ratio']:.2f}x | "
              f"{r['rss_one'] / 2**30:.2f} / {r['rss_two'] / 2**30:.2f} GiB | {'yes' if r['identical'] else 'NO'} |")  # fmt: skip
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
