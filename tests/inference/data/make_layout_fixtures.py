"""Build the checkpoints that tests/inference/test_inspect.py and test_convert_layout.py read.

Like make_fixtures.py beside it, each fixture comes from the tool that defines its layout; mixprec is
not imported. All start from tiny_llama_src/ (make_fixtures.py).

    modelopt_fp8_kv/     NVIDIA ModelOpt `mtq.quantize(model, FP8_DEFAULT_CFG + FP8_KV_CFG, loop)` then
                         `export_hf_checkpoint` (quant_algo FP8, kv_cache_quant_algo FP8).
    modelopt_nvfp4/      the same with NVFP4_DEFAULT_CFG (quant_algo NVFP4, group_size 16).
    modelopt_mixed/      NVFP4_DEFAULT_CFG with the MLP's weight and input quantizers set to FP8
                         per-tensor: ModelOpt writes quant_algo MIXED_PRECISION with quantized_layers.
    llmc_nvfp4/          llm-compressor `oneshot` with QuantizationModifier(targets="Linear",
                         scheme="NVFP4", ignore=["lm_head"]) (compressed-tensors nvfp4-pack-quantized).
    PROVENANCE_LAYOUTS.json   tool versions, the recipes, the sha256 of every file.

Calibration (ModelOpt and llm-compressor alike): 4 sequences of 32 token ids drawn with
torch.manual_seed(0) from the 256-token vocabulary (the model has no tokenizer; scales only need
activations). ModelOpt quantizes and exports on a CPU (0.47: no GPU needed for these formats).

How to run (from the repository root, about a minute on 2 cores, no network):

    python3 -m venv /tmp/mo-venv && echo /work/main/.venv/lib/python3.11/site-packages \\
        > /tmp/mo-venv/lib/python3.11/site-packages/main-venv.pth && /tmp/mo-venv/bin/pip install nvidia-modelopt==0.47.0
    (the same for /tmp/llmc-venv with llmcompressor==0.14.0.1, which brings its own transformers 5.17
     and compressed-tensors 0.19 ahead of the .pth path)
    /work/main/.venv/bin/python tests/inference/data/make_layout_fixtures.py --force
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent
SRC = DATA / "tiny_llama_src"
PROVENANCE = DATA / "PROVENANCE_LAYOUTS.json"
TOKENIZER = "/tmp/realmodels/smol-hf"  # SmolLM2's tokenizer, see make_llmc
MIXED_RECIPE = (
    "NVFP4_DEFAULT_CFG + {'*mlp*weight_quantizer', '*mlp*input_quantizer'}: num_bits (4, 3), axis None"
)


def _calibration_ids():
    import torch

    torch.manual_seed(0)
    return torch.randint(0, 256, (4, 32))


def _fresh(out: Path, force: bool) -> Path:
    if out.exists() and not force:
        raise SystemExit(f"{out} exists; pass --force to rebuild the fixtures")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def _publish(tmp: Path, out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def make_modelopt(force: bool) -> dict:
    """Runs in the ModelOpt venv (`--modelopt-step`)."""
    import modelopt
    import modelopt.torch.quantization as mtq
    import torch
    import transformers
    from modelopt.torch.export import export_hf_checkpoint

    fp8_entry = {"num_bits": (4, 3), "axis": None}
    mixed = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    mixed["quant_cfg"] += [
        {"quantizer_name": "*mlp*weight_quantizer", "cfg": fp8_entry},
        {"quantizer_name": "*mlp*input_quantizer", "cfg": fp8_entry},
    ]
    fp8_kv = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    fp8_kv["quant_cfg"] += copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    recipes = {
        "modelopt_fp8_kv": (fp8_kv, "FP8_DEFAULT_CFG + FP8_KV_CFG"),
        "modelopt_nvfp4": (mtq.NVFP4_DEFAULT_CFG, "NVFP4_DEFAULT_CFG"),
        "modelopt_mixed": (mixed, MIXED_RECIPE),
    }
    ids = _calibration_ids()
    out = {}
    for name, (cfg, described) in recipes.items():
        tmp = _fresh(DATA / name, force)
        model = transformers.LlamaForCausalLM.from_pretrained(SRC, dtype=torch.bfloat16).eval()

        def loop(m):
            with torch.no_grad():
                m(ids)

        mtq.quantize(model, cfg, loop)
        with torch.inference_mode():
            export_hf_checkpoint(model, export_dir=tmp)
        _publish(tmp, DATA / name)
        out[name] = {
            "modelopt": modelopt.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "recipe": described,
            "device": "cpu",
        }
    return out


def make_llmc(force: bool) -> dict:
    """Runs in the llm-compressor venv (`--llmc-step`)."""
    import compressed_tensors
    import llmcompressor
    import torch
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    tmp = _fresh(DATA / "llmc_nvfp4", force)
    model = transformers.AutoModelForCausalLM.from_pretrained(SRC, dtype=torch.bfloat16)
    ids = _calibration_ids()
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    recipe = QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=["lm_head"])
    # oneshot wants a processor beside a dataset although the dataset is already token ids: any
    # tokenizer serves (it tokenizes nothing here)
    processor = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    oneshot(
        model=model,
        recipe=recipe,
        dataset=data,
        processor=processor,
        num_calibration_samples=len(ids),
        max_seq_length=32,
    )
    model.save_pretrained(tmp, save_compressed=True)
    _publish(tmp, DATA / "llmc_nvfp4")
    return {
        "llmc_nvfp4": {
            "llmcompressor": llmcompressor.__version__,
            "compressed_tensors": compressed_tensors.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "recipe": 'QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=["lm_head"])',
        }
    }


def _files(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--force", action="store_true", help="rebuild fixtures that already exist")
    ap.add_argument("--modelopt-python", default="/tmp/mo-venv/bin/python")
    ap.add_argument("--llmc-python", default="/tmp/llmc-venv/bin/python")
    ap.add_argument("--modelopt-step", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--llmc-step", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.modelopt_step or args.llmc_step:
        print(json.dumps(make_modelopt(args.force) if args.modelopt_step else make_llmc(args.force)))
        return
    provenance: dict = {}
    for python, step in ((args.modelopt_python, "--modelopt-step"), (args.llmc_python, "--llmc-step")):
        cmd = [python, str(Path(__file__).resolve()), step] + (["--force"] * args.force)
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        provenance.update(json.loads(done.stdout.strip().splitlines()[-1]))
    for name, entry in provenance.items():
        entry["files"] = _files(DATA / name)
    PROVENANCE.write_text(json.dumps(provenance, indent=2) + "\n")
    total = sum(p.stat().st_size for d in provenance for p in (DATA / d).iterdir())
    print(f"fixtures written under {DATA}: {', '.join(provenance)} ({total / 1e6:.2f} MB)", file=sys.stderr)


if __name__ == "__main__":
    main()
