"""GPTQ at Llama-3.1-8B shapes: time and peak memory per block, extrapolated to the whole model (issue 28).

    python bench/gptq_8b_blocks.py [--blocks 2] [--samples 16] [--seq-len 512] [--scheme nvfp4a16] [--keep DIR]

Writes a Llama-3.1-8B-shaped bf16 checkpoint with `--blocks` full-size transformer blocks (hidden 4096,
intermediate 14336, 32 query / 8 key-value heads, vocabulary 128256, untied head) to a temporary
directory. Linear weights are drawn with std 0.02 and norm weights are 1: plain randn would blow the
activations up block after block. It adds a small BPE tokenizer (vocabulary 512: token ids index the
first rows of the embedding) and calibration text (the Python standard library, mixprec.data.load_corpus).
Then `mixprec quantize --algorithm gptq` runs in a subprocess, with its own peak RSS from wait4 (as the OS
counts it, memory-mapped pages included; bench/child_rss.py keeps this script's own pages out of it).

Per block: the walk's seconds (report `algorithm.seconds`, capture of the first block's inputs
included) divided by the blocks, and GPTQ's own solve seconds per Linear. Extrapolated to the 32
blocks of the real model: 32 x the per-block time. Peak memory does not grow with the block count
(one block at a time; the rounded Linears wait on disk for the writer); the embeddings and head are the
real model's size, and the walk reads only the embedding rows of the calibration tokens (issue 30).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_rss import run_measured

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB, HEAD_DIM = 4096, 14336, 32, 8, 128256, 128
REAL_BLOCKS = 32


def random_weight(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)


BLOCK_SHAPES = {
    "self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN), "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
    "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN), "mlp.down_proj": (HIDDEN, INTER),
}  # fmt: skip


def write_config(directory: Path, blocks: int) -> None:
    """config.json of a Llama-3.1-8B-shaped bf16 model with `blocks` blocks (the directory is made)."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=blocks,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rope_theta=500000.0,
        max_position_embeddings=8192, tie_word_embeddings=False, dtype="bfloat16", architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    directory.mkdir(parents=True)
    cfg.save_pretrained(directory)


def block_tensors(i: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Block i's tensors: its Linear weights (std 0.02) and norms (ones), in bf16."""
    p = f"model.layers.{i}."
    tensors = {f"{p}{n}.weight": random_weight(s, gen) for n, s in BLOCK_SHAPES.items()}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        tensors[f"{p}{norm}.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    return tensors


def write_checkpoint(directory: Path, blocks: int) -> None:
    """Config, shards (one per block, embeddings and head apart), index, tokenizer."""
    from mixprec.data import load_corpus, save_tokenizer, train_bpe_tokenizer

    write_config(directory, blocks)
    gen = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    shard("embed.safetensors", {"model.embed_tokens.weight": random_weight((VOCAB, HIDDEN), gen)})
    for i in range(blocks):
        shard(f"block-{i}.safetensors", block_tensors(i, gen))
    shard("head.safetensors", {"model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                               "lm_head.weight": random_weight((VOCAB, HIDDEN), gen)})  # fmt: skip
    total = sum((directory / f).stat().st_size for f in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    docs = list(load_corpus(max_chars=3_000_000).documents)
    save_tokenizer(train_bpe_tokenizer(docs[:200], vocab_size=512), directory)
    (directory.parent / "calib.txt").write_text("\n\n".join(docs))


def run_quantize(model: Path, out: Path, scheme: str, samples: int, seq_len: int) -> tuple[dict, float, int]:
    """(the report, wall seconds, peak RSS bytes) of one `mixprec quantize --algorithm gptq` subprocess."""
    cmd = [sys.executable, "-m", "mixprec", "quantize", "--model", str(model), "--output", str(out),
           "--scheme", scheme, "--algorithm", "gptq", "--calib-data", str(model.parent / "calib.txt"),
           "--calib-samples", str(samples), "--calib-seq-len", str(seq_len), "--json", "--quiet", "--force"]  # fmt: skip
    seconds, code, peak = run_measured(cmd, out.parent / "report.json", stderr_to_stdout=False)
    if code != 0:
        raise SystemExit(f"mixprec quantize failed: {' '.join(cmd)}")
    return json.loads((out.parent / "report.json").read_text()), seconds, peak


def summary(report: dict, seconds: float, rss: int, blocks: int, args: argparse.Namespace) -> str:
    alg = report["algorithm"]
    layers = alg["layers"]
    per_block = alg["seconds"] / blocks
    kinds: dict[str, list[float]] = {}
    for name, rec in layers.items():
        kinds.setdefault(name.split(".", 3)[-1], []).append(rec["seconds"])
    lines = [
        f"Llama-3.1-8B shapes, {blocks} blocks, {args.scheme} GPTQ, {args.samples} x {args.seq_len} tokens; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "",
        "| figure | value |",
        "|---|---:|",
        f"| wall time, whole run | {seconds:.0f} s |",
        f"| block walk (forward, Hessians, GPTQ, sequential re-run) | {alg['seconds']:.0f} s |",
        f"| per block | {per_block:.0f} s |",
        f"| extrapolated, {REAL_BLOCKS} blocks | {REAL_BLOCKS * per_block / 60:.0f} min |",
        f"| peak RSS | {rss / 2**30:.2f} GiB |",
        "",
        "| Linear | GPTQ solve per block (s) | output error, GPTQ / RTN (median over blocks) |",
        "|---|---:|---:|",
    ]
    for kind, secs in kinds.items():
        ratios = sorted(
            r["output_error"] / r["output_error_rtn"]
            for n, r in layers.items()
            if n.endswith(kind) and r["output_error_rtn"] > 0
        )
        lines.append(f"| {kind} | {sum(secs) / len(secs):.1f} | {ratios[len(ratios) // 2]:.3f} |")
    lines += ["", "warnings: " + ("; ".join(report.get("warnings", [])) or "none")]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--scheme", default="nvfp4a16")
    p.add_argument("--keep", type=Path, help="work here and keep the files (default: a temporary directory)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="gptq8b-") as tmp:
        root = args.keep or Path(tmp)
        model = root / "model"
        if not (model / "config.json").exists():
            write_checkpoint(model, args.blocks)
        report, seconds, rss = run_quantize(model, root / "out", args.scheme, args.samples, args.seq_len)
        print(summary(report, seconds, rss, args.blocks, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
