"""`--scheme auto` scored block by block and on the whole model: peak memory and time, beside layer-by-layer
calibration of the same checkpoint (issue 30: "bounded like calibration").

    python bench/auto_8b_blocks.py [--blocks 2] [--samples 4] [--seq-len 512] [--budget 6] [--whole] [--keep DIR]
    python bench/auto_8b_blocks.py --model smol-hf --calib calib.txt --samples 32 --seq-len 256 --whole \
        --rounds 2 --no-calibration

Without --model the checkpoint is bench/gptq_8b_blocks.py's: `--blocks` full-size Llama-3.1-8B blocks
(hidden 4096, intermediate 14336, 32 / 8 heads), the real model's embeddings and untied head
(vocabulary 128256), a small tokenizer and calibration text. Each run is a `mixprec quantize` child
process with its own peak RSS from wait4 (bench/child_rss.py), one after the other, `--rounds` times:

- `--scheme fp8-static --layer-by-layer`: the calibration walk, the bound the issue compares with
  (skipped with --no-calibration);
- `--scheme auto --candidates fp8-dynamic nvfp4a16 --budget B --layer-by-layer`: scored block by block
  (the default does so only when the model in fp32 exceeds half the free memory);
- with `--whole`, the same auto run with `--no-layer-by-layer` (the whole model in fp32 and its backward);
  the two auto runs' model.safetensors are compared byte for byte.

The auto runs' JSON gives the scoring and write seconds. Outputs are deleted after each run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_rss import run_measured
from gptq_8b_blocks import write_checkpoint


def run(model: Path, calib: Path, out: Path, extra: list[str], args) -> tuple[dict | None, float, int, str]:
    """(the command's JSON output or None, wall seconds, peak RSS bytes, model.safetensors' sha256) of
    one `mixprec quantize`."""
    cmd = [sys.executable, "-m", "mixprec", "quantize", "--model", str(model), "--output", str(out),
           "--calib-data", str(calib), "--calib-samples", str(args.samples),
           "--calib-seq-len", str(args.seq_len), "--quiet", "--force", *extra]  # fmt: skip
    log = out.parent / "run.json"
    seconds, code, peak = run_measured(cmd, log, stderr_to_stdout=False)
    if code != 0:
        raise SystemExit(f"mixprec quantize failed ({code}): {' '.join(cmd)}\n{log.read_text()[-2000:]}")
    text = log.read_text()
    doc = json.loads(text[text.index("{") :]) if "--json" in extra else None
    digest = hashlib.sha256()
    for f in sorted(out.glob("*.safetensors")):
        digest.update(f.read_bytes())
    shutil.rmtree(out, ignore_errors=True)
    return doc, seconds, peak, digest.hexdigest()


def row(label: str, doc: dict | None, seconds: float, peak: int) -> str:
    if doc is None:
        return f"| {label} | {seconds:.0f} | | | {peak / 2**30:.2f} | | |"
    chosen, secs = doc["chosen"], doc["seconds"]
    schemes = ", ".join(f"{k} {v}" for k, v in chosen["schemes"].items())
    return (f"| {label} | {seconds:.0f} | {secs.get('scoring', 0):.0f} | {secs.get('write', 0):.0f} | "
            f"{peak / 2**30:.2f} | {chosen['bits_per_weight']:.2f} | {schemes} |")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="a checkpoint directory (default: write the 8B-shaped blocks)")
    p.add_argument("--calib", type=Path, help="calibration text for --model")
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--budget", default="6")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--whole", action="store_true", help="also score the whole model (--no-layer-by-layer)")
    p.add_argument("--no-calibration", action="store_true", help="skip the fp8-static calibration run")
    p.add_argument(
        "--keep", type=Path, help="work here and keep the checkpoint (default: a temporary directory)"
    )
    args = p.parse_args()
    if (args.model is None) != (args.calib is None):
        p.error("--model and --calib go together")
    auto = ["--scheme", "auto", "--budget", args.budget, "--candidates", "fp8-dynamic", "nvfp4a16", "--json"]
    runs = (
        {}
        if args.no_calibration
        else {"fp8-static, calibrated layer by layer": ["--scheme", "fp8-static", "--layer-by-layer"]}
    )
    runs["auto, scored block by block"] = [*auto, "--layer-by-layer"]
    if args.whole:
        runs["auto, scored on the whole model"] = [*auto, "--no-layer-by-layer"]
    with tempfile.TemporaryDirectory(prefix="auto8b-") as tmp:
        root = args.keep or Path(tmp)
        model, calib = args.model, args.calib
        if model is None:
            model, calib = root / "model", root / "calib.txt"
            if not (model / "config.json").exists():
                write_checkpoint(model, args.blocks)
        gb = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 1e9
        print(f"{model} ({gb:.2f} GB), {args.samples} x {args.seq_len} tokens; "
              f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}\n")  # fmt: skip
        print("| run | wall s | scoring s | write s | peak RSS GiB | bits / weight | schemes |")
        print("|---|---:|---:|---:|---:|---:|---|", flush=True)
        digests = {}
        for _ in range(args.rounds):
            for label, extra in runs.items():
                doc, seconds, peak, digest = run(model, calib, root / "out", extra, args)
                digests.setdefault(label, set()).add(digest)
                print(row(label, doc, seconds, peak), flush=True)
        autos = [d for label, d in digests.items() if label.startswith("auto")]
        print(f"\nauto checkpoints byte-identical across runs: {len(set().union(*autos)) == 1}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
