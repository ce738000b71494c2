"""GPTQ's peak memory beside llm-compressor's on the synthetic sharded checkpoint of
bench_checkpoint_quantize.py (issue 28: "peak RSS compared on the 2.1 GB synthetic checkpoint").

    python bench/gptq_peak_rss.py --tokenizer /tmp/realmodels/smol-hf --calib /tmp/realmodels/calib.txt \\
        [--size-gb 2.1] [--scheme nvfp4a16] [--samples 16 --seq-len 256] [--llmc-python /work/llmc-venv/bin/python]

1. Writes the LlamaForCausalLM-shaped bf16 checkpoint (hidden 2048, intermediate 5632, weights of std 0.02,
   1 GB shards) with the embedding rows of --tokenizer's vocabulary, whose tokenizer files are copied beside
   it, into a temporary directory (deleted afterwards).
2. `mixprec quantize --scheme S --algorithm gptq` on --samples x --seq-len tokens of --calib, sequential
   GPTQ block by block, in each --mixprec-modes: "default" (mixprec's own choice: the whole model is loaded
   for calibration when it takes at most half the available memory, as here) and "layer-by-layer"
   (`--layer-by-layer`: one block's weights in memory at a time, read from the shards).
3. bench/anchor_llmcompressor.py --recipe gptq in llm-compressor's venv on the same tokens (its record's
   hash is compared with mixprec's): `AutoModelForCausalLM.from_pretrained(dtype=bfloat16)`, i.e. the whole
   model loaded into CPU memory, then `oneshot` with the sequential pipeline.
Each runs as its own process; wall time and peak RSS are the child's own (bench/child_rss.py: wait4 from a
small launcher). The runs go one after the other in this one run. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from anchor_llmcompressor import RECORD, checkpoint_stats
from bench_checkpoint_quantize import versions, write_synthetic_llama
from child_rss import run_measured

ANCHOR = Path(__file__).resolve().parent / "anchor_llmcompressor.py"


def synthetic_model(directory: Path, args: argparse.Namespace) -> dict:
    """The checkpoint with --tokenizer saved beside it and as many embedding rows as its vocabulary."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    info = write_synthetic_llama(directory, args.size_gb, args.shard_gb, vocab=len(tokenizer))
    tokenizer.save_pretrained(directory)
    return {**info, "vocab": len(tokenizer)}


MIXPREC_MODES = {"default": ([], "mixprec's choice by memory: the whole model"),
                 "layer-by-layer": (["--layer-by-layer"], "--layer-by-layer: one block at a time")}  # fmt: skip


def run_mixprec(src: Path, out: Path, args: argparse.Namespace, log: Path, mode: str) -> dict:
    flags, loading = MIXPREC_MODES[mode]
    cmd = [sys.executable, "-m", "mixprec", "quantize", "--model", str(src), "--output", str(out), "--scheme",
           args.scheme, "--algorithm", "gptq", "--calib-data", str(args.calib), "--calib-samples", str(args.samples),
           "--calib-seq-len", str(args.seq_len), "--quiet", "--json", *flags]  # fmt: skip
    seconds, code, peak = run_measured(cmd, log)
    if code != 0:
        raise SystemExit(f"mixprec quantize failed ({code}); see {log}")
    algorithm = json.loads((out / "mixprec_algorithm.json").read_text())
    return {"tool": "mixprec", "loading": loading, "seconds": seconds,
            "peak_bytes": peak, "tokens_sha256": algorithm["data_sha256"], **checkpoint_stats(out)}  # fmt: skip


def run_llmc(src: Path, out: Path, args: argparse.Namespace, log: Path) -> dict:
    record = out.parent / "llmc.json"
    cmd = [str(args.llmc_python), str(ANCHOR), "--model", str(src), "--output", str(out), "--scheme", args.scheme,
           "--recipe", "gptq", "--calib", str(args.calib), "--samples", str(args.samples), "--seq-len",
           str(args.seq_len), "--json", str(record)]  # fmt: skip
    seconds, code, peak = run_measured(cmd, log)
    if code != 0:
        raise SystemExit(f"llm-compressor failed ({code}); see {log}")
    line = json.loads((out / RECORD).read_text())
    return {"tool": "llm-compressor", "loading": "from_pretrained, the whole model in memory", "seconds": seconds,
            "peak_bytes": peak, "tokens_sha256": line["tokens_sha256"], **checkpoint_stats(out)}  # fmt: skip


def table(rows: list[dict]) -> str:
    lines = [
        "| tool | loading | wall | peak RSS | bits / weight | file size |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['tool']} | {r['loading']} | {r['seconds']:.0f} s | {r['peak_bytes'] / 2**30:.2f} GiB "
                     f"| {r['bits_per_weight']:.3f} | {r['file_bytes'] / 2**20:.0f} MiB |")  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--tokenizer", type=Path, required=True, help="a model directory whose tokenizer is copied"
    )
    p.add_argument("--calib", type=Path, required=True, help="calibration text")
    p.add_argument("--size-gb", type=float, default=2.1)
    p.add_argument("--shard-gb", type=float, default=1.0)
    p.add_argument("--scheme", default="nvfp4a16", choices=["nvfp4a16", "nvfp4", "mxfp4a16"])
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--llmc-python", type=Path, default=Path("/work/llmc-venv/bin/python"))
    p.add_argument("--mixprec-modes", nargs="+", choices=sorted(MIXPREC_MODES), default=list(MIXPREC_MODES))
    p.add_argument("--skip-llmc", action="store_true")
    p.add_argument("--tmp", default=None, help="where the temporary directory goes")
    args = p.parse_args(argv)
    if (
        not (args.tokenizer / "tokenizer.json").exists()
        and not (args.tokenizer / "tokenizer_config.json").exists()
    ):
        p.error(f"--tokenizer {args.tokenizer}: no tokenizer files there")
    if not args.skip_llmc and not args.llmc_python.exists():
        p.error(
            f"--llmc-python {args.llmc_python} not found (llm-compressor's own venv), or pass --skip-llmc"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="mixprec-gptq-rss-", dir=args.tmp))
    try:
        info = synthetic_model(root / "src", args)
        rows = []
        for mode in args.mixprec_modes:
            rows.append(run_mixprec(root / "src", root / "mixprec", args, root / f"mixprec-{mode}.log", mode))
            shutil.rmtree(root / "mixprec")
        if not args.skip_llmc:
            rows.append(run_llmc(root / "src", root / "llmc", args, root / "llmc.log"))
    finally:
        logs = {p.name: p.read_text()[-2000:] for p in root.glob("*.log")}
        shutil.rmtree(root, ignore_errors=True)
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; mixprec side: "
          f"{versions(sys.executable, ['torch', 'transformers'])}")  # fmt: skip
    print(f"checkpoint: {info['bytes'] / 1e9:.2f} GB in {info['shards']} shards (largest "
          f"{info['largest_shard'] / 2**30:.2f} GiB), {info['layers']} layers, vocabulary {info['vocab']}; "
          f"{args.scheme} GPTQ on {args.samples} x {args.seq_len} calibration tokens")  # fmt: skip
    hashes = {r["tokens_sha256"] for r in rows}
    print("identical calibration tokens (one sha256)" if len(hashes) == 1 else f"DIFFERENT tokens: {hashes}")
    print(table(rows))
    if any("Traceback" in text for text in logs.values()):
        print("\n".join(f"--- {k}\n{v}" for k, v in logs.items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
