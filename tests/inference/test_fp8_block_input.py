"""FP8-block input checkpoints (DeepSeek-V3 / Qwen3-FP8 style: `quant_method: "fp8"`, float8_e4m3fn
weights with 128x128 `weight_scale_inv`) re-quantized by `mixprec quantize`.

The reference is independent of mixprec's reader: each test builds a tiny model in bf16, makes its FP8
twin here with plain torch (per 128x128 block: scale = amax / 448, e4m3 = round(w / scale)), and
dequantizes the twin here too (e4m3 * scale per block, cast to bf16) into a bf16 checkpoint.
Quantizing the FP8 twin must write the same bytes as quantizing that bf16 checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from inference_helpers import VOCAB, read_tensors, save_with_tokenizer, tiny_llama
from safetensors.torch import save_file

import mixprec
from mixprec.errors import MixprecError
from mixprec.inference import quantize_checkpoint
from mixprec.inference.producers.quantize_plan import plan_quantize
from mixprec.sensitivity.automatic import auto_quantize_checkpoint

transformers = pytest.importorskip("transformers")

BLOCK = 128
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}  # fmt: skip
NOT_FP8 = ("embed_tokens", "norm", "lm_head", "mlp.gate.", "layernorm")  # stay bf16, as in DeepSeek-V3


def _to_fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale_inv [ceil(N/128), ceil(K/128)]): amax / 448 per block, zero-padded."""
    n, k = w.shape
    rows, cols = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.zeros(rows * BLOCK, cols * BLOCK)
    padded[:n, :k] = w.float()
    blocks = padded.view(rows, BLOCK, cols, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).view(rows * BLOCK, cols * BLOCK)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    full = scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return (q.float() * full).to(torch.bfloat16)


def make_twins(bf16_dir: Path, fp8_dir: Path, ref_dir: Path) -> None:
    """From a saved bf16 model: its FP8-block twin (fp8_dir) and a bf16 checkpoint of the twin's
    dequantized weights (ref_dir), both with bf16_dir's side files."""
    tensors = read_tensors(bf16_dir)
    fp8, ref = {}, {}
    for name, t in tensors.items():
        if t.dim() == 2 and name.endswith(".weight") and not any(s in name for s in NOT_FP8):
            q, scale = _to_fp8_blocks(t)
            fp8[name], fp8[name.replace(".weight", ".weight_scale_inv")] = q, scale
            ref[name] = _dequantize(q, scale)
        else:
            fp8[name] = ref[name] = t
    config = json.loads((bf16_dir / "config.json").read_text())
    for d, ts, cfg in ((fp8_dir, fp8, {**config, "quantization_config": FP8_CONFIG}), (ref_dir, ref, config)):
        d.mkdir(parents=True)
        for p in bf16_dir.iterdir():
            if p.suffix != ".safetensors" and p.name != "config.json":
                shutil.copy(p, d / p.name)
        save_file(ts, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(cfg, indent=2))


def _twins(tmp_path_factory, model, name: str) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(name)
    bf16 = save_with_tokenizer(model.to(torch.bfloat16), root / "bf16")
    make_twins(bf16, root / "fp8", root / "ref")
    return root / "fp8", root / "ref"


@pytest.fixture(scope="module")
def llama_twins(tmp_path_factory) -> tuple[Path, Path]:
    # intermediate 320: gate/up [320, 128] and down [128, 320] end in partial 128x128 blocks
    return _twins(tmp_path_factory, tiny_llama(intermediate_size=320), "llama")


def tiny_deepseek(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=320, moe_intermediate_size=192, num_hidden_layers=2,
        first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
        topk_group=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64,
        qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=128,
    )  # fmt: skip
    return transformers.DeepseekV3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def deepseek_twins(tmp_path_factory) -> tuple[Path, Path]:
    return _twins(tmp_path_factory, tiny_deepseek(), "deepseek")


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.suffix != ".safetensors"}


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _assert_same_output(got: Path, want: Path) -> None:
    """Every tensor byte for byte (the shards list them in the input files' order, which differs), every
    other file byte for byte (config.json: the input's quantization_config replaced by the output's)."""
    a, b = read_tensors(got), read_tensors(want)
    assert sorted(a) == sorted(b)
    assert [n for n in a if (a[n].dtype, a[n].shape) != (b[n].dtype, b[n].shape) or not torch.equal(_raw(a[n]), _raw(b[n]))] == []  # fmt: skip
    assert _files(got) == _files(want)


@pytest.mark.parametrize(
    ("scheme", "ignore"), [("nvfp4a16", None), ("fp8-dynamic", [r"re:.*layers\.0\.mlp\.down_proj$"])]
)
def test_fp8_input_equals_its_dequantized_bf16(llama_twins, tmp_path, input_ids, scheme, ignore):
    fp8_dir, ref_dir = llama_twins
    report = quantize_checkpoint(fp8_dir, tmp_path / "q", scheme, ignore=ignore, progress=False)
    ref_report = quantize_checkpoint(ref_dir, tmp_path / "r", scheme, ignore=ignore, progress=False)
    _assert_same_output(tmp_path / "q", tmp_path / "r")
    assert report.converted == ref_report.converted and len(report.converted) == 14 - bool(ignore)
    tensors = read_tensors(tmp_path / "q")
    assert not [n for n in tensors if n.endswith("weight_scale_inv")]
    fp8 = [n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn and n.endswith(".weight")]
    assert all(f"{n}_scale" in tensors for n in fp8)  # no FP8 weight without its scales
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    note = next(n for n in report.notes if n.startswith("input: FP8"))
    assert f"14 weights dequantized to bf16 one at a time ({14 - bool(ignore)} quantized" in note
    if ignore:  # the ignored FP8 weight: written dequantized to bf16, the report says so
        kept = tensors["model.layers.0.mlp.down_proj.weight"]
        assert kept.dtype == torch.bfloat16 and kept.shape == (128, 320)
        assert "written dequantized to bf16" in report["model.layers.0.mlp.down_proj"].precision
    model = mixprec.load_quantized(tmp_path / "q")
    with torch.no_grad():
        assert torch.isfinite(model(input_ids).logits).all()


def test_scale_search_runs_on_the_fp8_input(llama_twins, tmp_path):
    """The scale search is data-free and runs in the stream: same bytes as on the bf16 checkpoint."""
    fp8_dir, ref_dir = llama_twins
    quantize_checkpoint(fp8_dir, tmp_path / "q", "nvfp4a16", algorithm="scale-search", progress=False)
    quantize_checkpoint(ref_dir, tmp_path / "r", "nvfp4a16", algorithm="scale-search", progress=False)
    _assert_same_output(tmp_path / "q", tmp_path / "r")


def test_dry_run_plans_the_fp8_input(llama_twins, tmp_path):
    fp8_dir, ref_dir = llama_twins
    plan = plan_quantize(fp8_dir, tmp_path / "q", "nvfp4a16", probe=False)
    ref = plan_quantize(ref_dir, tmp_path / "r", "nvfp4a16", probe=False)
    assert not list(tmp_path.iterdir())  # the plan wrote nothing
    assert plan.layers == ref.layers and plan.kept == ref.kept and plan.shard_bytes == ref.shard_bytes
    assert plan.memory.total == pytest.approx(ref.memory.total, rel=0.05)
    assert plan.input_bytes < ref.input_bytes  # the files' own bytes: FP8 weights
    assert any("the input is FP8 (128x128 blocks)" in w for w in plan.warnings)
    quantize_checkpoint(fp8_dir, tmp_path / "q", "nvfp4a16", progress=False)
    assert plan.shard_bytes == [(tmp_path / "q" / "model.safetensors").stat().st_size]


@pytest.mark.parametrize("scheme", ["nvfp4a16", "fp8-dynamic"])
def test_moe_fp8_input_experts_quantized(deepseek_twins, tmp_path, input_ids, scheme):
    fp8_dir, ref_dir = deepseek_twins
    report = quantize_checkpoint(fp8_dir, tmp_path / "q", scheme, progress=False)
    quantize_checkpoint(ref_dir, tmp_path / "r", scheme, progress=False)
    _assert_same_output(tmp_path / "q", tmp_path / "r")
    experts = [
        f"model.layers.1.mlp.experts.{e}.{p}" for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")
    ]
    assert set(experts) <= set(report.converted)
    tensors = read_tensors(tmp_path / "q")
    payload = "weight_packed" if scheme == "nvfp4a16" else "weight"
    for name in experts:
        assert tensors[f"{name}.{payload}"].dtype in (torch.uint8, torch.float8_e4m3fn)
        assert f"{name}.weight_scale" in tensors and f"{name}.weight_scale_inv" not in tensors
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16  # the router, bf16 in the input
    model = mixprec.load_quantized(tmp_path / "q")  # mixprec's loader runs per-expert FP8 and FP4 weights
    with torch.no_grad():
        assert torch.isfinite(model(input_ids).logits).all()


# ---- refusals: a clear error, nothing written --------------------------------------------------------


def _copy(src: Path, dst: Path, *, config=None, tensors=None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config(json.loads((src / "config.json").read_text()))))
    if tensors is not None:
        save_file(tensors(read_tensors(src)), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _refused(src: Path, out_root: Path, match: str, scheme: str = "nvfp4a16", **kw) -> None:
    out_root.mkdir()
    with pytest.raises(MixprecError, match=match):
        quantize_checkpoint(src, out_root / "q", scheme, progress=False, **kw)
    assert not list(out_root.iterdir())


def _drop_scale(ts):
    del ts["model.layers.1.mlp.up_proj.weight_scale_inv"]
    return ts


def _misshape_scale(ts):  # 64x64 blocks under a config that says 128x128
    q = ts["model.layers.0.mlp.down_proj.weight"]
    ts["model.layers.0.mlp.down_proj.weight_scale_inv"] = torch.ones(
        -(-q.shape[0] // 64), -(-q.shape[1] // 64)
    )
    return ts


def _other_method(cfg):
    return {**cfg, "quantization_config": {"quant_method": "awq", "bits": 4}}


def _no_blocks(cfg):
    return {**cfg, "quantization_config": {k: v for k, v in FP8_CONFIG.items() if k != "weight_block_size"}}


@pytest.mark.parametrize(
    ("config", "tensors", "match"),
    [
        (_other_method, None, r"already has a quantization_config \(awq\): the checkpoint is already quantized"),
        (_no_blocks, None, "weight_block_size is None; mixprec reads FP8 inputs with block scales only"),
        (None, _drop_scale, r"FP8 weight model\.layers\.1\.mlp\.up_proj\.weight has no .*weight_scale_inv"),
        (None, _misshape_scale, r"model\.layers\.0\.mlp\.down_proj\.weight_scale_inv has shape \[2, 5\]; FP8 "
                                r"weight model\.layers\.0\.mlp\.down_proj\.weight \[128, 320\] in 128x128 blocks "
                                r"\(config weight_block_size\) has \[1, 3\] scales"),
    ],
)  # fmt: skip
def test_malformed_or_other_input_refused(llama_twins, tmp_path, config, tensors, match):
    src = _copy(llama_twins[0], tmp_path / "in", config=config, tensors=tensors)
    _refused(src, tmp_path / "out", match)


@pytest.mark.parametrize(
    ("scheme", "kw", "what"),
    [
        ("fp8-static", {}, "scheme fp8-static"),
        ("nvfp4", {}, "scheme nvfp4"),
        ("fp8-dynamic", {"kv_cache": "fp8"}, "--kv-cache fp8"),
        ("nvfp4a16", {"algorithm": "gptq"}, "--algorithm gptq"),
    ],
)
def test_calibrated_runs_refused_on_fp8_input(llama_twins, calib_file, tmp_path, scheme, kw, what):
    match = f"FP8 block checkpoint: {what} needs a forward of the model .* The data-free schemes work"
    _refused(llama_twins[0], tmp_path / "out", match, scheme, calib_data=calib_file, **kw)
    with pytest.raises(MixprecError, match=match):  # --dry-run refuses it the same way
        plan_quantize(
            llama_twins[0], tmp_path / "out" / "q", scheme, calib_data=calib_file, probe=False, **kw
        )


def test_auto_scheme_refused_on_fp8_input(llama_twins, calib_file, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(MixprecError, match=r"quantization_config \(fp8\): --scheme auto scores the layers"):
        auto_quantize_checkpoint(llama_twins[0], tmp_path / "out" / "q", budget="9", calib_data=calib_file)
    assert not list((tmp_path / "out").iterdir())
