"""Benchmark: `mixprec quantize --scheme nvfp4a16` of a DeepSeek-style FP8-block MoE checkpoint.

A synthetic DeepseekV3ForCausalLM checkpoint as DeepSeek-V3/R1 ship it (`quant_method: "fp8"`, every
Linear weight float8_e4m3fn with 128x128 `weight_scale_inv`; embeddings, norms, routers and the head in
bf16), at DeepSeek-V2-Lite-like shapes: hidden 2048, 64 routed experts of 2048 x 1408 (gate, up, down)
and 2 shared ones per MoE layer, MLA attention. Random FP8 codes (never NaN) and scales; the tensor
names and shapes come from transformers' own model built on the meta device, the fused 3-D experts
split per expert as the released checkpoints store them. Written into a temporary directory that is
deleted afterwards. The quantize runs in a child process (bench/child_rss.py: its own peak RSS); then,
as the baseline, the same quantize of the checkpoint's bf16 twin (dequantized here with plain torch).

Target: peak RSS <= 2 x one expert's bf16 weights (gate + up + down) + 512 MiB.

    python bench/moe_fp8_input.py [--moe-layers 2] [--experts 64] [--tmp DIR] [--no-baseline]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from bench_quantized_forward import machine
from child_rss import run_measured

BLOCK = 128
NOT_FP8 = ("embed_tokens", "norm", "lm_head", "mlp.gate.", "layernorm")  # bf16 in DeepSeek-V3 as well


def deepseek_config(moe_layers: int, experts: int) -> dict:
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=16384, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=moe_layers, first_k_dense_replace=0, n_routed_experts=experts, num_experts_per_tok=6,
        n_shared_experts=2, n_group=1, topk_group=1, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    d = cfg.to_dict()
    d["architectures"] = ["DeepseekV3ForCausalLM"]
    d["dtype"] = "bfloat16"
    return d


def checkpoint_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, per-expert as released checkpoints store them."""
    import transformers

    cfg = transformers.DeepseekV3Config(**{k: v for k, v in config.items() if k != "quantization_config"})
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(cfg)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, t in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, H] -> gate_proj, up_proj [I, H] per expert
            e, two_i, h = t.shape
            for i in range(e):
                shapes[name.replace("gate_up_proj", f"{i}.gate_proj.weight")] = (two_i // 2, h)
                shapes[name.replace("gate_up_proj", f"{i}.up_proj.weight")] = (two_i // 2, h)
        elif name.endswith("experts.down_proj"):
            e, h, i_ = t.shape
            for i in range(e):
                shapes[name.replace("down_proj", f"{i}.down_proj.weight")] = (h, i_)
        else:
            shapes[name] = tuple(t.shape)
    return shapes


def _fp8_weight(shape: tuple[int, int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 codes without NaN (0x7F / 0xFF), and block scales around 1e-4 (|w| ~ 0.04 at most)."""
    codes = torch.randint(0, 0x7F, shape, dtype=torch.uint8, generator=gen)
    codes |= torch.randint(0, 2, shape, dtype=torch.uint8, generator=gen) << 7
    grid = (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
    scale = torch.rand(grid, generator=gen) * 1e-4 + 5e-5
    return codes.view(torch.float8_e4m3fn), scale


def write_checkpoint(root: Path, moe_layers: int, experts: int) -> dict:
    """The synthetic FP8-block checkpoint: one shard per decoder layer (+ one for the rest)."""
    root.mkdir(parents=True)
    config = deepseek_config(moe_layers, experts)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}  # fmt: skip
    shapes = checkpoint_shapes(config)
    gen = torch.Generator().manual_seed(0)
    groups: dict[str, list[str]] = {}
    for name in shapes:
        key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else "rest"
        groups.setdefault(key, []).append(name)
    weight_map, fp8_params = {}, 0
    for i, names in enumerate(groups.values()):
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            shape = shapes[name]
            if len(shape) == 2 and name.endswith(".weight") and not any(s in name for s in NOT_FP8):
                tensors[name], tensors[name.replace(".weight", ".weight_scale_inv")] = _fp8_weight(shape, gen)
                fp8_params += shape[0] * shape[1]
            elif name.endswith("e_score_correction_bias"):
                tensors[name] = torch.zeros(shape)
            else:
                tensors[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        save_file(tensors, str(root / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        del tensors
    total = sum(p.stat().st_size for p in root.glob("*.safetensors"))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (root / "config.json").write_text(json.dumps(config, indent=2))
    return {"bytes": total, "fp8_params": fp8_params, "tensors": len(weight_map), "shards": len(groups)}


def write_bf16_twin(src: Path, dst: Path) -> None:
    """The bf16 checkpoint the FP8 one stands for (each weight dequantized with plain torch, shard by
    shard): the same quantize on it is the baseline the FP8 input's figures are set beside."""
    dst.mkdir()
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
        out = {}
        for name, t in tensors.items():
            if name.endswith("weight_scale_inv"):
                continue
            if t.dtype == torch.float8_e4m3fn:
                s = tensors[name.replace(".weight", ".weight_scale_inv")]
                full = s.repeat_interleave(BLOCK, 0)[: t.shape[0]].repeat_interleave(BLOCK, 1)[
                    :, : t.shape[1]
                ]
                t = (t.float() * full).to(torch.bfloat16)
            out[name] = t
        save_file(out, str(dst / shard.name), metadata={"format": "pt"})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if not n.endswith("weight_scale_inv")}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def quantize_measured(root: Path, src: str, scheme: str) -> tuple[float, int, int, list[str]]:
    """(wall s, peak RSS bytes, output bytes, output tensor names) of `mixprec quantize` in a child."""
    log, out = root / f"{src}.log", root / f"q-{src}"
    cmd = ["-m", "mixprec.cli", "quantize", "--model", str(root / src), "--output", str(out), "--scheme", scheme,
           "--quiet"]  # fmt: skip
    seconds, code, peak = run_measured([sys.executable, *cmd], log)
    if code != 0:
        raise SystemExit(log.read_text())
    names = [n for p in out.glob("*.safetensors") for n in safe_open(str(p), "pt").keys()]  # noqa: SIM118
    out_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    shutil.rmtree(out)
    return seconds, peak, out_bytes, names


# What every run holds before its first tensor: the interpreter, torch, transformers' DeepSeek-V3
# modelling code and the model built on the meta device (mixprec's Linear recognition builds it).
STARTUP = """import json, sys
from pathlib import Path
from mixprec.inference.checkpoint.linear_weights import build_meta_model
build_meta_model(Path(sys.argv[1]), json.loads((Path(sys.argv[1]) / "config.json").read_text()))
"""


def startup_measured(root: Path) -> tuple[float, int, int, list[str]]:
    seconds, code, peak = run_measured(
        [sys.executable, "-c", STARTUP, str(root / "src")], root / "startup.log"
    )
    if code != 0:
        raise SystemExit((root / "startup.log").read_text())
    return seconds, peak, 0, []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moe-layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--scheme", default="nvfp4a16")
    ap.add_argument("--tmp", default=None, help="where the checkpoints go (deleted afterwards)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the bf16 twin's run")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mixprec-moe-fp8-", dir=args.tmp))
    try:
        t0 = time.perf_counter()
        info = write_checkpoint(root / "src", args.moe_layers, args.experts)
        written_s = time.perf_counter() - t0
        expert_bf16 = 3 * 2048 * 1408 * 2  # gate + up + down of one routed expert, in bf16
        target = 2 * expert_bf16 + (512 << 20)
        runs = {"FP8-block input": quantize_measured(root, "src", args.scheme)}
        runs["start-up only (imports + meta model, no tensor)"] = startup_measured(root)
        if not args.no_baseline:
            write_bf16_twin(root / "src", root / "bf16")
            runs["its bf16 twin (baseline)"] = quantize_measured(root, "bf16", args.scheme)
        names = runs["FP8-block input"][3]
        packed = sum(1 for n in names if ".experts." in n and n.endswith(".weight_packed"))
        assert not [n for n in names if n.endswith("weight_scale_inv")], "block scales written"
        print(
            f"machine: {machine()}; torch {torch.__version__}; load average {os.getloadavg()[0]:.1f} at the end"
        )
        print(f"input: synthetic DeepSeek-style FP8-block MoE, {args.moe_layers} MoE layers x {args.experts} "
              f"experts (2048 x 1408) + 2 shared, {info['fp8_params'] / 1e9:.2f} G FP8 weights, "
              f"{info['bytes'] / 1e9:.2f} GB in {info['shards']} shards (written in {written_s:.0f} s)")  # fmt: skip
        print(f"one expert's bf16 weights: {expert_bf16 / 2**20:.1f} MiB; target peak RSS <= "
              f"{target / 2**20:.0f} MiB; routed expert weights quantized: {packed} of "
              f"{3 * args.experts * args.moe_layers}")  # fmt: skip
        print(f"| mixprec quantize --scheme {args.scheme} | wall s | peak RSS MiB | target MiB | output GB |")
        print("|---|---:|---:|---:|---:|")
        for what, (seconds, peak, out_bytes, _) in runs.items():
            print(
                f"| {what} | {seconds:.1f} | {peak / 2**20:.0f} | {target / 2**20:.0f} | {out_bytes / 1e9:.2f} |"
            )
        peak = runs["FP8-block input"][1]
        print(f"target {'met' if peak <= target else 'NOT met'} for the FP8 input")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
