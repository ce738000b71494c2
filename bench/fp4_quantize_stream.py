"""Benchmark: `mixprec quantize --scheme nvfp4a16` (streaming) against a plain copy of the same files.

The synthetic LlamaForCausalLM-shaped bf16 checkpoint of bench_checkpoint_quantize.py (random weights,
sharded, in a temporary directory deleted afterwards). Copy and quantize alternate --repeats times, each
in its own subprocess (the machine is shared: each round's ratio compares runs made seconds apart);
the medians and the per-round ratios are printed, with peak RSS (VmHWM). nvfp4a16 reads every NVFP4
weight once (a fused group's shards together: their amax gives the shared global scale).

    python bench/fp4_quantize_stream.py [--size-gb 0.5] [--shard-gb 0.25] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_checkpoint_quantize import COPY, measure, versions, write_synthetic_llama


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=0.5)
    ap.add_argument("--shard-gb", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scheme", default="nvfp4a16")
    ap.add_argument("--tmp", default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mixprec-fp4-bench-", dir=args.tmp))
    try:
        t0 = time.perf_counter()
        info = write_synthetic_llama(root / "src", args.size_gb, args.shard_gb)
        gen_s = time.perf_counter() - t0
        copies, quants, ratios = [], [], []
        for _ in range(args.repeats):
            shutil.rmtree(root / "q", ignore_errors=True)
            copies.append(measure(sys.executable, "code", COPY, str(root / "src"), str(root / "copy")))
            shutil.rmtree(root / "copy", ignore_errors=True)
            quants.append(measure(sys.executable, "module", "mixprec.cli", "quantize", "--model", str(root / "src"),
                                  "--output", str(root / "q"), "--scheme", args.scheme, "--quiet"))  # fmt: skip
            if quants[-1]["rc"] != 0:
                print(quants[-1]["output"], file=sys.stderr)
                return 1
            ratios.append(quants[-1]["seconds"] / copies[-1]["seconds"])
        out_bytes = sum(f.stat().st_size for f in (root / "q").glob("*.safetensors"))
        med = {
            k: statistics.median(m["seconds"] for m in runs) for k, runs in (("copy", copies), ("q", quants))
        }
        print(f"\nMachine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
              f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM; "
              f"python {platform.python_version()}; load average {os.getloadavg()[0]:.1f} at the end")  # fmt: skip
        print(f"env: {versions(sys.executable, ['torch', 'transformers', 'safetensors', 'mixprec'])}")
        print(f"Checkpoint: synthetic Llama bf16, {info['layers']} layers, {info['bytes'] / 1e9:.2f} GB in "
              f"{info['shards']} shards (generated in {gen_s:.0f} s); {args.scheme} output {out_bytes / 1e9:.3f} GB\n")  # fmt: skip
        print("| run | median wall s | peak RSS GiB (max) |")
        print("|---|---:|---:|")
        print(f"| plain copy | {med['copy']:.1f} | {max(m['peak_rss'] for m in copies) / 2**30:.2f} |")
        print(
            f"| mixprec quantize {args.scheme} | {med['q']:.1f} | {max(m['peak_rss'] for m in quants) / 2**30:.2f} |"
        )
        print(f"\n{args.repeats} alternating rounds; quantize / copy per round: "
              f"{', '.join(f'{x:.2f}' for x in ratios)}; median {statistics.median(ratios):.2f}x")  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
