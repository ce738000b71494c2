"""`mixprec convert` between compressed-tensors, Hugging Face fp8 and ModelOpt layouts.

Inputs are checkpoints written by the tools that define each layout (see test_inspect.py and
data/PROVENANCE*.json). References are independent of the converter: the stored tensors read back
with safetensors, numpy's float32 division for reciprocals, compressed-tensors' own config model,
transformers' own loaders.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mixprec.cli import main
from mixprec.inference.checkpoint.layout import reciprocal_f32
from mixprec.inference.checkpoint.safetensors_io import ShardReader
from mixprec.inference.producers.convert import convert_checkpoint
from mixprec.inference.readers.inspection import inspect_checkpoint
from mixprec.inference.readers.load import load_quantized

DATA = Path(__file__).parent / "data"
IDS = torch.arange(2, 34).reshape(2, 16)
RECIPROCAL = {  # compressed-tensors divisor <-> ModelOpt multiplier
    "weight_global_scale": "weight_scale_2",
    "input_global_scale": "input_scale",
}


def _convert(name: str, to: str, out: Path) -> Path:
    convert_checkpoint(DATA / name if isinstance(name, str) else name, out, to, progress=False)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.float()


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in float32 units in the last place (same-sign finite values)."""
    return (a.float().view(torch.int32).long() - b.float().view(torch.int32).long()).abs()


@pytest.mark.parametrize(
    "name, to",
    [
        ("llmc_nvfp4", "modelopt"),
        ("modelopt_nvfp4", "compressed-tensors"),
        ("modelopt_fp8_kv", "compressed-tensors"),
        ("modelopt_mixed", "compressed-tensors"),
        ("llmc_fp8_dynamic", "modelopt"),
        ("hf_fp8_block", "compressed-tensors"),
        ("hf_fp8_block", "modelopt"),
    ],
)
def test_payloads_and_scales_keep_their_values(name, to, tmp_path):
    """Every tensor of the output, traced back to its input tensor: payloads and FP4 block scales
    bit-identical, multipliers equal in value, divisors <-> multipliers numpy's float32 1/x."""
    out = _convert(name, to, tmp_path / "out")
    src, dst = load_file(DATA / name / "model.safetensors"), load_file(out / "model.safetensors")
    assert len(src) == len(dst)
    renames = {
        "weight_packed": "weight",
        "weight_scale_inv": "weight_scale",
        "self_attn.k_scale": "self_attn.k_proj.k_scale",
        "self_attn.v_scale": "self_attn.v_proj.v_scale",
    }
    if to != "modelopt":
        renames = {"weight_scale_inv": "weight_scale", "weight_scale_2": "weight_global_scale",
                   "input_scale": "input_global_scale", "k_proj.k_scale": "k_scale", "v_proj.v_scale": "v_scale"}  # fmt: skip
    else:
        renames.update({"weight_global_scale": "weight_scale_2", "input_global_scale": "input_scale"})
    fp4 = {n.rpartition(".")[0] for n, t in src.items() if t.dtype == torch.uint8}
    matched = 0
    for n, t in src.items():
        module, _, leaf = n.rpartition(".")
        target = n
        if module in fp4 and leaf == "weight" and to == "compressed-tensors":
            target = f"{module}.weight_packed"
        for old, new in renames.items():
            if n.endswith("." + old) and not (old == "input_scale" and module not in fp4):
                target = n[: -len(old)] + new
                break
        u = dst[target]
        reciprocal = {leaf, target.rpartition(".")[2]} <= {
            *RECIPROCAL,
            *RECIPROCAL.values(),
        } and module in fp4
        if reciprocal:
            want = np.float32(1) / t.float().numpy().reshape(-1)
            assert np.array_equal(u.numpy().reshape(-1), want), target
        elif t.dtype in (torch.float8_e4m3fn, torch.uint8) or t.dtype == u.dtype:
            assert u.dtype == t.dtype and torch.equal(_bits(u), _bits(t)), target
        else:  # a multiplier widened to float32: the same value
            assert u.dtype == torch.float32 and torch.equal(u.reshape(-1), t.float().reshape(-1)), target
        matched += 1
    assert matched == len(dst)


def test_reciprocal_round_trip_is_within_one_ulp():
    """RN(1/RN(1/x)) is x or a float32 neighbour: what a divisor -> multiplier -> divisor round trip
    does to an NVFP4 global scale. Both directions agree with numpy's correctly rounded float32 division."""
    rng = np.random.default_rng(0)
    x = (10.0 ** rng.uniform(-6, 6, 5_000)).astype(np.float32)
    once = np.array([reciprocal_f32(float(v)) for v in x], dtype=np.float32)
    assert np.array_equal(once, np.float32(1) / x)
    twice = np.array([reciprocal_f32(float(v)) for v in once], dtype=np.float32)
    ulps = np.abs(twice.view(np.int32).astype(np.int64) - x.view(np.int32).astype(np.int64))
    assert ulps.max() == 1  # never more than one ulp, and one ulp does happen
    assert 0.5 < (ulps == 0).mean() < 1.0


def test_nvfp4_round_trip_changes_global_scales_by_at_most_one_ulp(tmp_path):
    mo = _convert("llmc_nvfp4", "modelopt", tmp_path / "mo")
    back = _convert(mo, "compressed-tensors", tmp_path / "back")
    src, dst = load_file(DATA / "llmc_nvfp4" / "model.safetensors"), load_file(back / "model.safetensors")
    assert src.keys() == dst.keys()
    for n, t in src.items():
        if n.endswith(tuple(RECIPROCAL)):
            assert _ulps(dst[n], t).max() <= 1, n
        else:
            assert torch.equal(_bits(dst[n]), _bits(t)), n


@pytest.mark.parametrize("name, via", [("modelopt_fp8_kv", "compressed-tensors"), ("hf_fp8_block", "compressed-tensors"),
                                       ("modelopt_mixed", "compressed-tensors")])  # fmt: skip
def test_round_trips_without_reciprocals_are_bit_identical(name, via, tmp_path):
    layout = inspect_checkpoint(DATA / name)["layout"]
    there = _convert(name, via, tmp_path / "there")
    back = _convert(there, layout, tmp_path / "back")
    src, dst = load_file(DATA / name / "model.safetensors"), load_file(back / "model.safetensors")
    assert src.keys() == dst.keys()
    for n, t in src.items():
        if (
            name == "modelopt_mixed"
            and n.endswith(tuple(RECIPROCAL.values()))
            and dst[n].dtype == torch.float32
        ):
            assert _ulps(dst[n], t).max() <= 1, n  # NVFP4 globals went through compressed-tensors' divisors
        else:
            assert dst[n].shape == t.shape and torch.equal(_bits(dst[n]), _bits(t)), n
    a, b = inspect_checkpoint(DATA / name), inspect_checkpoint(back)
    assert [r["scheme"] for r in a["layers"]] == [r["scheme"] for r in b["layers"]]
    assert a["quantization"]["kv_cache"] == b["quantization"]["kv_cache"]


def test_compressed_tensors_output_validates_with_its_config_model(tmp_path):
    ct = pytest.importorskip("compressed_tensors.quantization")
    for name in ("modelopt_fp8_kv", "modelopt_nvfp4", "modelopt_mixed", "hf_fp8_block"):
        out = _convert(name, "compressed-tensors", tmp_path / name)
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        config = ct.QuantizationConfig.model_validate(qc)
        assert config.quantization_status == "compressed"
    mixed = json.loads((tmp_path / "modelopt_mixed" / "config.json").read_text())["quantization_config"]
    assert mixed["format"] == "mixed-precision" and len(mixed["config_groups"]) == 2


def _hf_model(directory: Path, **kw):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, **kw)


def test_transformers_loads_the_output_with_the_inputs_logits(tmp_path):
    """compressed-tensors -> ModelOpt -> compressed-tensors: transformers (which reads no ModelOpt layout)
    gives the logits it gives for llm-compressor's own checkpoint. FP8: bit for bit. NVFP4: the global
    scales come back within one ulp; with the weights dequantized (bf16) the logits are equal here."""
    transformers = pytest.importorskip("transformers")
    dense = {"quantization_config": transformers.CompressedTensorsConfig(dequantize=True)}
    for name, kw in (("llmc_fp8_dynamic", {}), ("llmc_nvfp4", dense)):
        back = _convert(
            _convert(name, "modelopt", tmp_path / f"{name}-mo"), "compressed-tensors", tmp_path / name
        )
        assert torch.equal(_logits(_hf_model(back, **kw)), _logits(_hf_model(DATA / name, **kw))), name
    # transformers' own fp8 layout, through ModelOpt's FP8_PB_WO and back
    hf = _convert(
        _convert("hf_fp8_block", "modelopt", tmp_path / "block-mo"), "hf-fp8", tmp_path / "block-hf"
    )
    assert torch.equal(_logits(_hf_model(hf)), _logits(_hf_model(DATA / "hf_fp8_block")))


def test_transformers_reads_modelopt_nvfp4_weights_after_conversion(tmp_path):
    """ModelOpt's NVFP4 weights dequantized by hand from its own tensors (E2M1 codes, low nibble first,
    x block scale x weight_scale_2) equal what transformers + compressed-tensors decompress from the
    converted checkpoint (bf16: to its rounding)."""
    transformers = pytest.importorskip("transformers")
    out = _convert("modelopt_nvfp4", "compressed-tensors", tmp_path / "ct")
    t = load_file(DATA / "modelopt_nvfp4" / "model.safetensors")
    m = "model.layers.0.self_attn.q_proj"
    codes = t[f"{m}.weight"]
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    values = torch.stack([e2m1[(codes & 0xF).long()], e2m1[(codes >> 4).long()]], dim=-1).reshape(
        codes.shape[0], -1
    )
    ref = (
        values
        * t[f"{m}.weight_scale"].float().repeat_interleave(16, dim=1)
        * t[f"{m}.weight_scale_2"].float()
    )
    model = _hf_model(out, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    got = model.get_submodule(m).weight.detach().float()
    assert torch.allclose(got, ref, rtol=2**-7, atol=0)


def test_mixprec_loads_modelopt_fp8_and_every_conversion_alike(tmp_path):
    """load_quantized reads ModelOpt's FP8 (layouts.py), also from hf_quant_config.json alone (older
    exports); converted checkpoints give bit-identical logits."""
    ref = _logits(load_quantized(DATA / "modelopt_fp8_kv"))
    assert torch.equal(
        _logits(load_quantized(_convert("modelopt_fp8_kv", "compressed-tensors", tmp_path / "ct"))), ref
    )
    legacy = tmp_path / "legacy"
    shutil.copytree(DATA / "modelopt_fp8_kv", legacy)
    cfg = json.loads((legacy / "config.json").read_text())
    del cfg["quantization_config"]
    (legacy / "config.json").write_text(json.dumps(cfg))
    assert torch.equal(_logits(load_quantized(legacy)), ref)
    assert inspect_checkpoint(legacy)["config_file"] == "hf_quant_config.json"
    block = _logits(load_quantized(DATA / "hf_fp8_block"))
    for to in ("compressed-tensors", "modelopt"):
        assert torch.equal(
            _logits(load_quantized(_convert("hf_fp8_block", to, tmp_path / f"block-{to}"))), block
        )


def test_modelopt_output_config_is_modelopts(tmp_path):
    out = _convert("llmc_nvfp4", "modelopt", tmp_path / "mo")
    hq = json.loads((out / "hf_quant_config.json").read_text())
    assert hq["quantization"] == {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                  "exclude_modules": ["lm_head"]}  # fmt: skip
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4" and qc["ignore"] == ["lm_head"]
    assert (out / "recipe.yaml").exists() and (out / "generation_config.json").exists()
    mixed = _convert("modelopt_mixed", "modelopt", tmp_path / "mixed")
    layers = json.loads((mixed / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    assert layers["model.layers.0.mlp.up_proj"] == {"quant_algo": "FP8"}
    assert layers["model.layers.0.self_attn.q_proj"] == {"quant_algo": "NVFP4", "group_size": 16}


def test_payloads_stream_and_are_never_read_whole(tmp_path, monkeypatch):
    whole = []
    original = ShardReader.get
    monkeypatch.setattr(
        ShardReader, "get", lambda self, info, out=None: whole.append(info.name) or original(self, info, out)
    )
    _convert("modelopt_nvfp4", "compressed-tensors", tmp_path / "out")
    assert whole and all(n.endswith(("_scale_2", "input_scale")) for n in whole), whole


def _partial_block_checkpoint(tmp_path: Path) -> Path:
    """mixprec's fp8-block of a tiny Llama whose down_proj [128, 192] has partial 128x128 blocks."""
    transformers = pytest.importorskip("transformers")
    from mixprec.inference.producers.quantize import quantize_checkpoint

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=192, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    src = tmp_path / "src"
    transformers.LlamaForCausalLM(cfg).save_pretrained(src)
    quantize_checkpoint(src, tmp_path / "block", "fp8-block", progress=False)
    return tmp_path / "block"


def test_a_layout_that_cannot_hold_the_scheme_is_one_line_exit_2_and_nothing_written(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", str(DATA / "llmc_fp8_dynamic"), str(out), "--to", "hf-fp8"]) == 2
    block = _partial_block_checkpoint(tmp_path)
    assert main(["convert", str(block), str(out), "--to", "modelopt"]) == 2
    assert main(["convert", str(DATA / "llmc_nvfp4"), str(out), "--to", "hf-fp8"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mixprec convert:")]
    assert len(err) == 3
    assert "model.layers.0.mlp.down_proj (fp8-dynamic) cannot be written as hf-fp8" in err[0]
    assert "mlp.down_proj (fp8-block) cannot be written as modelopt" in err[1] and "partial blocks" in err[1]
    assert "nvfp4" in err[2]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["block", "src"]


def test_existing_output_and_the_input_itself_are_refused(tmp_path, capsys):
    out = _convert("hf_fp8_block", "compressed-tensors", tmp_path / "out")
    before = sorted(p.name for p in out.iterdir())
    assert main(["convert", str(DATA / "hf_fp8_block"), str(out), "--to", "modelopt"]) == 2
    assert sorted(p.name for p in out.iterdir()) == before
    assert (
        main(["convert", str(DATA / "hf_fp8_block"), str(out), "--to", "modelopt", "--force", "--quiet"]) == 0
    )
    assert (out / "hf_quant_config.json").exists()
    assert main(["convert", str(out), str(out), "--to", "compressed-tensors"]) == 2
    assert main(["convert", str(DATA / "tiny_llama_src"), str(tmp_path / "x"), "--to", "modelopt"]) == 2
    err = capsys.readouterr().err
    assert (
        "already exists" in err and "never modifies its input" in err and "not a quantized checkpoint" in err
    )


def test_mixprecs_static_checkpoint_with_kv_scales_to_modelopt_and_back(llama_dir, calib_file, tmp_path):
    """mixprec's own fp8-static + FP8 KV cache (compressed-tensors) -> ModelOpt FP8: the KV scales move
    to k_proj/v_proj as ModelOpt names them, inspect passes both, mixprec's loader gives equal logits."""
    from mixprec.inference.producers.quantize import quantize_checkpoint

    ct = tmp_path / "ct"
    quantize_checkpoint(llama_dir, ct, "fp8-static", calib_data=calib_file, calib_samples=4, calib_seq_len=32,
                        kv_cache="fp8", progress=False)  # fmt: skip
    mo = _convert(ct, "modelopt", tmp_path / "mo")
    tensors = load_file(mo / "model.safetensors")
    assert tensors["model.layers.0.self_attn.k_proj.k_scale"].shape == ()
    assert torch.equal(tensors["model.layers.0.self_attn.k_proj.k_scale"].reshape(1),
                       load_file(ct / "model.safetensors")["model.layers.0.self_attn.k_scale"])  # fmt: skip
    for directory in (ct, mo):
        doc = inspect_checkpoint(directory)
        assert {c["name"]: c["verdict"] for c in doc["checks"]}["KV-cache scales"] == "pass"
        checks = {c["name"]: c for c in doc["checks"]}
        # mixprec's fp8-static gives q/k/v (and gate/up) their own weight scales: vLLM requantizes them to
        # the largest, at the cost inspect states; their static input scales agree (the same input)
        fused = checks["fused q/k/v and gate/up"]
        assert fused["verdict"] == "warn" and all(
            "per-tensor weight scales differ" in i for i in fused["items"]
        )
        assert doc["verdict"] == "warn" and doc["engines"]["vllm"]["loads"]
    ids = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        assert torch.equal(load_quantized(mo)(ids).logits, load_quantized(ct)(ids).logits)
    # the KV scales land on the attention module whichever layout names them (save_quantized reads them there)
    attn = load_quantized(mo).model.layers[0].self_attn
    assert float(attn.k_scale) == float(tensors["model.layers.0.self_attn.k_proj.k_scale"])
    assert not hasattr(attn.k_proj, "k_scale")


def test_mixprec_loads_modelopt_nvfp4_layers():
    # NVFP4 layers load as BlockQuantizedLinear (issue 15; numerics in tests/inference/test_fp4_schemes.py)
    mixed = load_quantized(DATA / "modelopt_mixed")
    assert type(mixed.model.layers[0].self_attn.q_proj).__name__ == "BlockQuantizedLinear"
    assert type(mixed.model.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"
    assert load_quantized(DATA / "modelopt_nvfp4").model.layers[0].mlp.down_proj.scheme.name == "nvfp4"
