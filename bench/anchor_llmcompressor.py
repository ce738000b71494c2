"""The llm-compressor anchor for issue 28: quantize a Hugging Face model with llm-compressor's `oneshot` on the
same calibration tokens mixprec uses, save the compressed-tensors checkpoint, print one JSON line.

Run it with llm-compressor's own venv (never mixprec's: llm-compressor pins its torch and transformers):

    python3 -m venv /work/llmc-venv && /work/llmc-venv/bin/pip install torch==2.13.0 llmcompressor
    /work/llmc-venv/bin/python bench/anchor_llmcompressor.py --model /tmp/realmodels/smol-hf \\
        --output /tmp/llmc/nvfp4a16-gptq --scheme nvfp4a16 --recipe gptq --calib /tmp/realmodels/calib.txt \\
        --samples 64 --seq-len 512 [--ignore lm_head ...] [--json FILE]

Recipes (llm-compressor 0.14 modifiers, targets="Linear", the --ignore list):
  rtn       QuantizationModifier (round to nearest; data-free for the A16 schemes, so no calibration run)
  gptq      GPTQModifier(actorder="static", dampening_frac=0.01, block_size=128): mixprec's --algorithm gptq
            defaults (act order, 1 % dampening, 128-column lazy blocks)
  awq       AWQModifier then QuantizationModifier
  awq+gptq  AWQModifier then GPTQModifier
Calibration runs llm-compressor's sequential pipeline (each decoder layer calibrated on the outputs of the
layers before it, quantized), as mixprec's sequential GPTQ does.

Tokens: mixprec's own `load_texts` and `token_batches` (src/mixprec/inference/calibration/data.py, imported
from this checkout's src/: it needs only torch) cut the windows, so both tools see the same token ids given
the same tokenizer files; `tokens_sha256` in the JSON line is the hash of those ids (int64, row-major), for
the caller to compare with mixprec's. llm-compressor gets them as a pre-tokenized dataset, in order (no
shuffle), batch size 1 (the Hessian sums over tokens, so batching does not change it).

The JSON line: wall seconds (load + oneshot + save), peak RSS (getrusage maxrss), versions, the tokens used,
bits per weight over the quantized Linears and the checkpoint's file size (`checkpoint_stats`, which the
side-by-side script also applies to mixprec's checkpoints, so the columns are computed one way). The line is
also written to OUTPUT/anchor_llmcompressor.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# mixprec's scheme names -> llm-compressor's preset names
SCHEMES = {"nvfp4a16": "NVFP4A16", "nvfp4": "NVFP4", "mxfp4a16": "MXFP4A16"}
RECIPES = ("rtn", "gptq", "awq", "awq+gptq")
# checkpoint tensors that hold a quantized weight (compressed-tensors' names)
RECORD = "anchor_llmcompressor.json"  # the JSON line, also written into the checkpoint directory
WEIGHT_PARTS = ("weight_packed", "weight_scale", "weight_global_scale", "weight_zero_point", "weight_g_idx")


def checkpoint_stats(directory: str | Path) -> dict:
    """File size of a checkpoint's *.safetensors and bits per weight over its quantized Linears: every byte of
    their packed weights, scales and global scales, over the number of weights (a packed byte holds
    8 / num_bits weights). Reads headers only; the same for mixprec's and llm-compressor's checkpoints."""
    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    config = json.loads((directory / "config.json").read_text()).get("quantization_config") or {}
    groups = list((config.get("config_groups") or {}).values())
    num_bits = groups[0]["weights"]["num_bits"] if groups and groups[0].get("weights") else 4
    part_bytes, weights = 0, 0
    for f in files:
        header = _safetensors_header(f)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            _, _, part = name.rpartition(".")
            if part not in WEIGHT_PARTS:
                continue
            start, end = info["data_offsets"]
            part_bytes += end - start
            if part == "weight_packed":
                rows, cols = info["shape"]
                weights += rows * cols * (8 // num_bits)
    return {
        "file_bytes": sum(f.stat().st_size for f in files),
        "quantized_weights": weights,
        "bits_per_weight": round(8 * part_bytes / weights, 4) if weights else None,
    }


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        return json.loads(fh.read(size))


def calibration_ids(calib: str, tokenizer, samples: int, seq_len: int):
    """mixprec's calibration windows (its own functions), one tensor of shape (n, seq_len)."""
    sys.path.insert(0, str(SRC))
    import torch

    from mixprec.inference.calibration.data import load_texts, token_batches

    return torch.cat(token_batches(load_texts(calib), tokenizer, samples, seq_len))


def ids_sha256(ids) -> str:
    return hashlib.sha256(ids.to(dtype=__import__("torch").int64).contiguous().numpy().tobytes()).hexdigest()


def build_recipe(recipe: str, scheme: str, ignore: list[str]) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier

    preset = SCHEMES[scheme]
    quant = {"targets": "Linear", "scheme": preset, "ignore": ignore}
    gptq = {"actorder": "static", "dampening_frac": 0.01, "block_size": 128}
    if recipe == "rtn":
        return [QuantizationModifier(**quant)]
    if recipe == "gptq":
        return [GPTQModifier(**quant, **gptq)]
    if recipe == "awq":
        return [AWQModifier(), QuantizationModifier(**quant)]
    return [AWQModifier(), GPTQModifier(**quant, **gptq)]


def needs_data(recipe: str, scheme: str) -> bool:
    """RTN of a weight-only scheme needs no calibration run; NVFP4's activation global scale does."""
    return recipe != "rtn" or not scheme.endswith("a16")


def cpu_without_pinned_memory() -> None:
    """llm-compressor 0.14's AWQ pins its cached activations (IntermediatesCache.pin_memory) for faster
    copies to a GPU; without an accelerator torch refuses to pin ("Cannot access accelerator device when
    none is available") and the run fails after the first block. Pinning changes no value, so on a CPU
    the cache is left unpinned."""
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None


def run(args: argparse.Namespace) -> dict:
    import compressed_tensors
    import llmcompressor
    import torch
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    tokens: dict = {"samples": 0, "seq_len": 0, "tokens": 0, "tokens_sha256": None}
    kwargs: dict = {}
    if needs_data(args.recipe, args.scheme):
        ids = calibration_ids(args.calib, tokenizer, args.samples, args.seq_len)
        n, length = ids.shape
        tokens = {"samples": n, "seq_len": length, "tokens": n * length, "tokens_sha256": ids_sha256(ids)}
        rows = ids.tolist()
        dataset = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * length for _ in rows]})
        kwargs = {
            "dataset": dataset, "num_calibration_samples": n, "max_seq_length": length,
            "shuffle_calibration_samples": False, "batch_size": 1, "pipeline": "sequential",
        }  # fmt: skip
    if not torch.cuda.is_available():
        cpu_without_pinned_memory()
    oneshot(model=model, recipe=build_recipe(args.recipe, args.scheme, args.ignore), **kwargs)
    quantized_seconds = time.perf_counter() - start
    model.save_pretrained(args.output, save_compressed=True)
    tokenizer.save_pretrained(args.output)
    seconds = time.perf_counter() - start
    return {
        "tool": "llm-compressor", "recipe": args.recipe, "scheme": args.scheme, "output": str(args.output),
        "ignore": args.ignore, **tokens,
        "wall_seconds": round(seconds, 2), "quantize_seconds": round(quantized_seconds, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "threads": torch.get_num_threads(),
        "versions": {
            "llmcompressor": llmcompressor.__version__, "compressed_tensors": compressed_tensors.__version__,
            "torch": torch.__version__, "transformers": transformers.__version__,
        },
        **checkpoint_stats(args.output),
    }  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--output", required=True, help="where the compressed checkpoint goes")
    p.add_argument("--scheme", choices=sorted(SCHEMES), default="nvfp4a16")
    p.add_argument("--recipe", choices=RECIPES, default="gptq")
    p.add_argument("--calib", help="calibration text (.txt / .jsonl / folder), read as mixprec reads it")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--ignore", nargs="+", default=["lm_head"], help="modules kept in high precision")
    p.add_argument("--json", type=Path, help="also write the JSON line to this file")
    args = p.parse_args(argv)
    if needs_data(args.recipe, args.scheme) and not args.calib:
        p.error(f"--recipe {args.recipe} with --scheme {args.scheme} needs --calib")
    if not Path(args.model, "config.json").exists():
        p.error(f"--model {args.model}: no config.json there")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    line = json.dumps(run(args))
    (Path(args.output) / RECORD).write_text(line + "\n")  # the record travels with the checkpoint
    if args.json:
        args.json.write_text(line + "\n")
    print(line, flush=True)


if __name__ == "__main__":
    main()
