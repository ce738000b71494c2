"""The plan of quantizing a Llama-3.1-70B-shaped checkpoint, from header-only files (issue 30).

    python bench/plan_70b.py [--scheme fp8-dynamic nvfp4a16] [--gptq]

Writes a Llama-3.1-70B-shaped bf16 checkpoint (hidden 8192, intermediate 28672, 80 blocks, 64 query /
8 key-value heads, vocabulary 128256, untied head: 141 GB declared) to a temporary directory as
header-only safetensors files: each shard a valid header followed by a sparse body (os.truncate), so
it takes a few hundred kB of disk. Then prints `mixprec quantize --dry-run`'s plan for each scheme
(and, with --gptq, for nvfp4a16 with GPTQ on 16 x 512 calibration tokens). The plan reads config.json
and the headers only; its time probes quantize (and run GEMMs on) random tensors of the real shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import tempfile
from pathlib import Path

import torch

from mixprec.commands.quantize_dry_run import plan_lines
from mixprec.inference.checkpoint.safetensors_io import PlannedTensor, shard_header
from mixprec.inference.producers.quantize_plan import plan_quantize

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB, HEAD_DIM = 8192, 28672, 80, 64, 8, 128256, 128
BLOCKS_PER_SHARD = 3  # 28 shards of about 5.2 GB (the released checkpoint has 30)


def _header_only(path: Path, tensors: list[PlannedTensor]) -> None:
    raw = shard_header(tensors, {"format": "pt"})
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    os.truncate(path, 8 + len(raw) + sum(t.nbytes for t in tensors))


def write_checkpoint(directory: Path) -> None:
    """config.json, header-only shards and their index."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
           "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
           "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB, "rope_theta": 500000.0,
           "max_position_embeddings": 131072, "tie_word_embeddings": False, "dtype": "bfloat16"}  # fmt: skip
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    bf16 = torch.bfloat16
    shapes = {
        "self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN), "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
        "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
        "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN), "mlp.down_proj": (HIDDEN, INTER),
    }  # fmt: skip
    shards: list[list[PlannedTensor]] = [[PlannedTensor("model.embed_tokens.weight", bf16, (VOCAB, HIDDEN))]]
    for i in range(LAYERS):
        if i % BLOCKS_PER_SHARD == 0 and i:
            shards.append([])
        p = f"model.layers.{i}."
        shards[-1] += [PlannedTensor(f"{p}{n}.weight", bf16, s) for n, s in shapes.items()]
        shards[-1] += [PlannedTensor(f"{p}{n}.weight", bf16, (HIDDEN,)) for n in ("input_layernorm", "post_attention_layernorm")]  # fmt: skip
    shards.append([PlannedTensor("model.norm.weight", bf16, (HIDDEN,)),
                   PlannedTensor("lm_head.weight", bf16, (VOCAB, HIDDEN))])  # fmt: skip
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, tensors in zip(names, shards):
        _header_only(directory / name, tensors)
    weight_map = {t.name: name for name, tensors in zip(names, shards) for t in tensors}
    total = sum(t.nbytes for tensors in shards for t in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scheme", nargs="+", default=["fp8-dynamic", "nvfp4a16"])
    p.add_argument("--gptq", action="store_true", help="also plan nvfp4a16 with GPTQ (16 x 512 tokens)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="plan70b-") as tmp:
        model = Path(tmp) / "model"
        write_checkpoint(model)
        on_disk = sum(f.stat().st_blocks * 512 for f in model.iterdir())
        declared = sum(f.stat().st_size for f in model.iterdir())
        print(f"Llama-3.1-70B shapes, header-only: {declared / 1e9:.1f} GB declared, {on_disk / 1e3:.0f} kB on disk; "
              f"torch {torch.__version__}, {os.cpu_count()} CPUs\n")  # fmt: skip
        runs = [(s, {}) for s in args.scheme]
        if args.gptq:
            runs.append(("nvfp4a16", {"algorithm": "gptq", "calib_data": "calib.txt", "calib_samples": 16}))
        for scheme, extra in runs:
            plan = plan_quantize(model, Path(tmp) / "out", scheme, **extra)
            print("\n".join(line for line in plan_lines(plan) if not line.startswith("  model.layers.")))
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
