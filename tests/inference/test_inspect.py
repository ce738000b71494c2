"""`mixprec inspect` on checkpoints written by the tools that define each layout.

Fixtures (data/PROVENANCE*.json, data/make_fixtures.py, data/make_layout_fixtures.py): llm-compressor
FP8_DYNAMIC and NVFP4 (compressed-tensors), transformers FineGrainedFP8 128x128 (`quant_method: fp8`),
NVIDIA ModelOpt 0.47 FP8 + FP8 KV cache, NVFP4 and a MIXED_PRECISION export (FP8 MLP, NVFP4
attention), all from one tiny bf16 Llama. Faults are made by editing copies of them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mixprec.cli import main
from mixprec.inference.checkpoint.safetensors_io import ShardReader
from mixprec.inference.readers import inspection
from mixprec.inference.readers.inspection import inspect_checkpoint

DATA = Path(__file__).parent / "data"
FIXTURES = {
    "llmc_fp8_dynamic": ("compressed-tensors", "fp8-dynamic"),
    "hf_fp8_block": ("hf-fp8", "fp8-block"),
    "modelopt_fp8_kv": ("modelopt", "fp8-static"),
    "modelopt_nvfp4": ("modelopt", "nvfp4"),
    "llmc_nvfp4": ("compressed-tensors", "nvfp4"),
}


def _check(doc: dict, name: str) -> dict:
    return next(c for c in doc["checks"] if c["name"] == name)


def _copy(name: str, tmp_path: Path) -> Path:
    out = tmp_path / name
    shutil.copytree(DATA / name, out)
    return out


def _edit(directory: Path, change) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_each_producers_checkpoint_is_read_layer_by_layer(name):
    layout, scheme = FIXTURES[name]
    doc = inspect_checkpoint(DATA / name)
    assert doc["schema_version"] == inspection.SCHEMA_VERSION
    assert doc["layout"] == layout
    assert len(doc["layers"]) == 14  # 2 blocks x (q, k, v, o, gate, up, down); lm_head stays bf16
    assert {r["scheme"] for r in doc["layers"]} == {scheme}
    q = next(r for r in doc["layers"] if r["name"] == "model.layers.0.self_attn.q_proj")
    assert q["shape"] == [128, 128]
    assert q["payload_dtype"] == ("uint8" if "nvfp4" in scheme else "float8_e4m3fn")
    for check in ("scales finite and positive", "shapes as the config says", "KV-cache scales"):
        assert _check(doc, check)["verdict"] == "pass", (check, _check(doc, check))
    assert doc["engines"]["vllm"]["loads"], doc["engines"]["vllm"]
    assert doc["totals"]["total_bytes"] == doc["totals"]["quantized_bytes"] + doc["totals"]["other_bytes"]
    json.dumps(doc)  # plain JSON


def test_scale_shapes_and_bytes_are_the_stored_ones():
    doc = inspect_checkpoint(DATA / "modelopt_nvfp4")
    down = next(r for r in doc["layers"] if r["name"] == "model.layers.0.mlp.down_proj")
    assert down["scales"] == {
        "input_scale": {"shape": [], "dtype": "float32"},
        "weight_scale_2": {"shape": [], "dtype": "float32"},
        "weight_scale": {"shape": [128, 16], "dtype": "float8_e4m3fn"},
    }
    assert down["bytes"] == 128 * 128 + 128 * 16 + 4 + 4  # packed payload, block scales, two scalars
    hf = inspect_checkpoint(DATA / "hf_fp8_block")
    down = next(r for r in hf["layers"] if r["name"] == "model.layers.0.mlp.down_proj")
    assert down["scales"] == {"weight_scale_inv": {"shape": [1, 2], "dtype": "float32"}}


def test_modelopt_fp8_fused_scales_differ_and_the_cost_is_stated():
    """ModelOpt 0.47's FP8 export on this model left q/k/v and gate/up with different per-tensor weight
    scales; vLLM requantizes them to the largest: inspect says so, with the bits it costs."""
    doc = inspect_checkpoint(DATA / "modelopt_fp8_kv")
    fused = _check(doc, "fused q/k/v and gate/up")
    assert fused["verdict"] == "warn"
    qkv = next(i for i in fused["items"] if i.startswith("model.layers.0.self_attn.qkv_proj"))
    assert "per-tensor weight scales differ" in qkv and "bits of resolution" in qkv
    scales = load_file(DATA / "modelopt_fp8_kv" / "model.safetensors")
    shards = [scales[f"model.layers.0.self_attn.{p}_proj.weight_scale"].item() for p in "qkv"]
    assert f"max/min {max(shards) / min(shards):.4g}" in qkv
    kv = _check(doc, "KV-cache scales")
    assert kv["verdict"] == "pass" and "k_proj.k_scale" in kv["detail"]
    assert doc["quantization"]["kv_cache"]
    assert not doc["engines"]["transformers"]["loads"]
    assert "ModelOpt" in doc["engines"]["transformers"]["reasons"][0]
    assert doc["engines"]["mixprec"]["loads"]


def test_modelopt_mixed_precision_is_named():
    doc = inspect_checkpoint(DATA / "modelopt_mixed")
    assert doc["quantization"]["mixed_precision"]
    mixed = _check(doc, "mixed precision")
    assert "MIXED_PRECISION" in mixed["detail"]
    assert sorted(mixed["items"]) == ["fp8-static: 6 layers", "nvfp4: 8 layers"]
    schemes = {r["name"].rsplit(".", 1)[1]: r["scheme"] for r in doc["layers"] if ".layers.0." in r["name"]}
    assert schemes["q_proj"] == "nvfp4" and schemes["up_proj"] == "fp8-static"
    assert doc["engines"]["mixprec"]["loads"]  # FP8 and NVFP4 layers alike


def test_nan_and_zero_scales(tmp_path):
    ckpt = _copy("llmc_fp8_dynamic", tmp_path)

    def spoil(t):
        t["model.layers.0.mlp.up_proj.weight_scale"][3, 0] = float("nan")
        t["model.layers.1.mlp.up_proj.weight_scale"][5, 0] = 0.0

    _edit(ckpt, spoil)
    check = _check(inspect_checkpoint(ckpt), "scales finite and positive")
    assert check["verdict"] == "fail"
    assert any(i.startswith("model.layers.0.mlp.up_proj.weight_scale: 1 NaN") for i in check["items"])
    assert any(i.startswith("model.layers.1.mlp.up_proj.weight_scale: 1 zero") for i in check["items"])


def test_a_scale_shape_the_config_does_not_give(tmp_path):
    ckpt = _copy("llmc_fp8_dynamic", tmp_path)

    def per_tensor(t):
        t["model.layers.0.self_attn.o_proj.weight_scale"] = t["model.layers.0.self_attn.o_proj.weight_scale"][
            :1
        ]

    _edit(ckpt, per_tensor)
    doc = inspect_checkpoint(ckpt)
    check = _check(doc, "shapes as the config says")
    assert check["verdict"] == "fail"
    assert check["items"] == [
        "model.layers.0.self_attn.o_proj: weight_scale has shape [1, 1], fp8-dynamic needs [128, 1]"
    ]
    assert not doc["engines"]["vllm"]["loads"]
    assert main(["inspect", str(ckpt)]) == 1


def test_a_partly_quantized_fused_group_is_refused_by_vllm(tmp_path):
    ckpt = _copy("llmc_fp8_dynamic", tmp_path)

    def dequantize_k(t):
        k = "model.layers.1.self_attn.k_proj"
        w = t.pop(f"{k}.weight").float() * t.pop(f"{k}.weight_scale").float()
        t[f"{k}.weight"] = w.to(torch.bfloat16)

    _edit(ckpt, dequantize_k)
    doc = inspect_checkpoint(ckpt)
    fused = _check(doc, "fused q/k/v and gate/up")
    assert fused["verdict"] == "fail"
    assert fused["items"][0].startswith(
        "model.layers.1.self_attn.qkv_proj: model.layers.1.self_attn.k_proj in high precision"
    )
    assert not doc["engines"]["vllm"]["loads"]


def test_nvfp4_global_scales_that_differ_give_wrong_weights(tmp_path):
    ckpt = _copy("llmc_nvfp4", tmp_path)

    def unshare(t):
        t["model.layers.0.mlp.up_proj.weight_global_scale"] *= 2

    _edit(ckpt, unshare)
    fused = _check(inspect_checkpoint(ckpt), "fused q/k/v and gate/up")
    assert fused["verdict"] == "fail"
    (item,) = fused["items"]
    assert item.startswith("model.layers.0.mlp.gate_up_proj: NVFP4 global weight scales differ (max/min 2)")
    assert "0.5x (wrong weights)" in item


def test_kv_cache_asked_but_missing(tmp_path):
    ckpt = _copy("modelopt_fp8_kv", tmp_path)
    _edit(ckpt, lambda t: t.pop("model.layers.1.self_attn.v_proj.v_scale"))
    check = _check(inspect_checkpoint(ckpt), "KV-cache scales")
    assert check["verdict"] == "warn" and check["items"] == ["model.layers.1.self_attn"]
    assert "1 of 2 attention modules" in check["detail"]


def test_only_scales_are_read_never_payloads(monkeypatch):
    read = []
    original = ShardReader.get

    def spy(self, info, out=None):
        read.append(info.name)
        return original(self, info, out)

    monkeypatch.setattr(ShardReader, "get", spy)
    inspect_checkpoint(DATA / "modelopt_nvfp4")
    assert read and not [n for n in read if n.endswith((".weight", ".weight_packed"))]


def test_cli_json_and_table(capsys):
    assert main(["inspect", str(DATA / "modelopt_mixed"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["layout"] == "modelopt" and doc["verdict"] == "warn"
    assert main(["inspect", str(DATA / "hf_fp8_block"), "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "14 quantized layers" in out and "fp8-block" in out and "vllm: loads it" in out


def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert main(["inspect", str(DATA / "tiny_llama_src")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "does not exist" in err[0] and "is not a quantized checkpoint" in err[1]


def test_a_scheme_outside_the_table_is_named_not_guessed(tmp_path):
    ckpt = _copy("llmc_fp8_dynamic", tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(
        num_bits=4, type="int", strategy="group"
    )
    (ckpt / "config.json").write_text(json.dumps(cfg))
    doc = inspect_checkpoint(ckpt)
    known = _check(doc, "config schemes known")
    assert known["verdict"] == "warn"
    assert known["items"] == ["config group 'group_0': 4-bit int weights, strategy group"]
    assert _check(doc, "shapes as the config says")["verdict"] == "pass"
    assert main(["convert", str(ckpt), str(tmp_path / "out"), "--to", "modelopt"]) == 2
