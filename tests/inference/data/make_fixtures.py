"""Build the FP8 checkpoints that tests/inference/test_independent_checkpoints.py loads.

The point of these fixtures is that mixprec did NOT write them: each one comes from the tool that
defines its layout, so the loader is tested against what the field ships, not against itself.

    tiny_llama_src/     LlamaForCausalLM from a LlamaConfig (hidden 128, intermediate 256, 2 layers,
                        4 heads, 4 KV heads, vocab 256, untied lm_head), seed 0, bf16, save_pretrained.
                        Dims are multiples of 128 so that the same source also suits 128x128 blocks.
    llmc_fp8_dynamic/   llm-compressor `oneshot` with
                        QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]),
                        saved with save_compressed=True (compressed-tensors, float-quantized).
    hf_fp8_block/       transformers `from_pretrained(src, quantization_config=FineGrainedFP8Config(
                        weight_block_size=[128, 128]))` then save_pretrained (`quant_method: "fp8"`).
    PROVENANCE.json     tool versions and the sha256 of every file written.

How to run (from the repository root; about 20 s on a CPU, no network, no tokenizer needed):

    /work/main/.venv/bin/python tests/inference/data/make_fixtures.py --force

It runs in mixprec's venv (built with transformers 5.24, torch 2.13 CPU) for the source and the
Hugging Face checkpoint, and re-runs itself in a separate llm-compressor venv (`--llmc-python`,
default /work/venv-llmc/bin/python: llmcompressor 0.14.0.1, compressed-tensors 0.19, transformers
5.17, torch 2.13 CPU) for the llm-compressor checkpoint, because llm-compressor pins its own
transformers. mixprec itself is not imported.

transformers on CPU: FineGrainedFP8HfQuantizer.validate_environment refuses to quantize
("RuntimeError: No GPU or XPU found. A GPU or XPU is needed for FP8 quantization."), although the
quantization it then runs (integrations/finegrained_fp8.py, Fp8Quantize: per-128x128-block amax,
weight_scale_inv = 1 / (448 / amax), clamp, cast) is plain torch and works on a CPU. With
`--hf-cpu-bypass` (the default) only that environment check is replaced by a no-op, for the duration
of the one from_pretrained call; the payloads, scales, names and config are transformers' own.
`--no-hf-cpu-bypass` keeps the check: on a CPU-only machine hf_fp8_block/ is then not produced.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent
SRC = DATA / "tiny_llama_src"
LLMC = DATA / "llmc_fp8_dynamic"
HF_FP8 = DATA / "hf_fp8_block"
PROVENANCE = DATA / "PROVENANCE.json"

CONFIG = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,  # k/v_proj 128x128: whole 128-blocks (transformers skips Linears that are not)
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
SEED = 0


def _prepare(out: Path, force: bool) -> Path:
    """A fresh temporary directory beside `out`; it is renamed onto `out` when complete."""
    if out.exists() and not force:
        raise SystemExit(f"{out} exists; pass --force to rebuild the fixtures")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def _publish(tmp: Path, out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def make_source(force: bool) -> dict:
    import torch
    import transformers

    tmp = _prepare(SRC, force)
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(torch.bfloat16).eval()
    model.save_pretrained(tmp)  # safetensors
    _publish(tmp, SRC)
    return {"transformers": transformers.__version__, "torch": torch.__version__, "config": CONFIG}


@contextlib.contextmanager
def _fp8_check_bypassed(enabled: bool):
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    original = FineGrainedFP8HfQuantizer.validate_environment
    if enabled:
        FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None
    try:
        yield
    finally:
        FineGrainedFP8HfQuantizer.validate_environment = original


def make_hf_fp8(force: bool, bypass: bool) -> dict | None:
    import torch
    import transformers

    tmp = _prepare(HF_FP8, force)
    qcfg = transformers.FineGrainedFP8Config(weight_block_size=[128, 128])
    try:
        with _fp8_check_bypassed(bypass and not torch.cuda.is_available()):
            model = transformers.LlamaForCausalLM.from_pretrained(
                SRC, quantization_config=qcfg, dtype=torch.bfloat16
            )
    except RuntimeError as e:  # transformers refuses FP8 quantization without a GPU
        print(f"hf_fp8_block skipped: transformers refused ({e})", file=sys.stderr)
        return None
    model.save_pretrained(tmp)
    _publish(tmp, HF_FP8)
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "quantization_config": "FineGrainedFP8Config(weight_block_size=[128, 128])",
        "cpu_environment_check_bypassed": bool(bypass and not torch.cuda.is_available()),
    }


def make_llmc(force: bool) -> dict:
    """Runs inside the llm-compressor venv (invoked as `make_fixtures.py --llmc-step`)."""
    import compressed_tensors
    import llmcompressor
    import torch
    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    tmp = _prepare(LLMC, force)
    model = transformers.AutoModelForCausalLM.from_pretrained(SRC, dtype=torch.bfloat16)
    recipe = QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])
    oneshot(model=model, recipe=recipe)  # FP8_DYNAMIC is data-free: no dataset, no tokenizer
    model.save_pretrained(tmp, save_compressed=True)
    _publish(tmp, LLMC)
    return {
        "llmcompressor": llmcompressor.__version__,
        "compressed_tensors": compressed_tensors.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "recipe": 'QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])',
    }


def _files(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--force", action="store_true", help="rebuild fixtures that already exist")
    ap.add_argument("--llmc-python", default="/work/venv-llmc/bin/python", help="python of the llmc venv")
    ap.add_argument("--no-hf-cpu-bypass", dest="hf_cpu_bypass", action="store_false")
    ap.add_argument("--llmc-step", action="store_true", help=argparse.SUPPRESS)  # the llmc venv's part
    args = ap.parse_args()
    if args.llmc_step:
        print(json.dumps(make_llmc(args.force)))
        return

    provenance = {"tiny_llama_src": make_source(args.force)}
    cmd = [args.llmc_python, str(Path(__file__).resolve()), "--llmc-step"] + (["--force"] * args.force)
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    provenance["llmc_fp8_dynamic"] = json.loads(done.stdout.strip().splitlines()[-1])
    hf = make_hf_fp8(args.force, args.hf_cpu_bypass)
    if hf is not None:
        provenance["hf_fp8_block"] = hf
    for name, entry in provenance.items():
        entry["files"] = _files(DATA / name)
    PROVENANCE.write_text(json.dumps(provenance, indent=2) + "\n")
    total = sum(p.stat().st_size for d in provenance for p in (DATA / d).iterdir())
    print(f"fixtures written under {DATA}: {', '.join(provenance)} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
