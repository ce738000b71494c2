"""Offline quantization of a tiny Llama checkpoint with each scheme: load back, logits, transformers
and compressed-tensors compatibility, scales file, online == offline, sharding, ignored tensors.

Logit bound (stated): for every scheme, the FP8 model's logits are within 12% relative Frobenius
error of the fp32 model's and have cosine similarity > 0.99 (measured on this model: 5-7%).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from inference_helpers import load_original, read_tensors, rel_err, tiny_llama

import mixprec
from mixprec.inference import quantize_checkpoint
from mixprec.inference.checkpoint.scales_file import read_scales_file
from mixprec.inference.runtime.linear import QuantizedLinear

transformers = pytest.importorskip("transformers")

LOGIT_REL_BOUND = 0.12
SCHEMES = ("fp8-dynamic", "fp8-static", "fp8-block")


def _quantize(src: Path, out: Path, scheme: str, calib: Path, **kw):
    if scheme == "fp8-static":
        kw.setdefault("calib_data", calib)
        kw.setdefault("calib_samples", 8)
        kw.setdefault("calib_seq_len", 32)
    return quantize_checkpoint(src, out, scheme, progress=False, **kw)


@pytest.fixture(scope="module")
def quantized(llama_dir, calib_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    return {s: (_quantize(llama_dir, root / s, s, calib_file), root / s) for s in SCHEMES}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_load_quantized_logits_close(quantized, llama_dir, input_ids, scheme):
    report, out = quantized[scheme]
    model = mixprec.load_quantized(out)
    assert not model.training
    fp8 = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(fp8) == 14 == len(report.converted)  # 7 Linears x 2 layers; lm_head kept
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, QuantizedLinear)
    with torch.no_grad():
        got = model(input_ids).logits
        ref = load_original(llama_dir)(input_ids).logits
    err = rel_err(got, ref)
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0)
    assert err < LOGIT_REL_BOUND, err
    assert cos > 0.99
    assert report.weight_bytes_after < report.weight_bytes_before


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize("scheme", SCHEMES)
def test_compressed_tensors_config_parses_and_transformers_loads(quantized, scheme):
    ct = pytest.importorskip("compressed_tensors.quantization")
    _, out = quantized[scheme]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = ct.QuantizationConfig.model_validate(qc)
    assert parsed.format == "float-quantized" and parsed.ignore == ["lm_head"]
    mine = mixprec.load_quantized(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, quantization_config=transformers.CompressedTensorsConfig(dequantize=True)
    )
    for name, m in mine.named_modules():
        if isinstance(m, QuantizedLinear):
            w = hf.get_submodule(name).weight.detach().float()
            assert torch.equal(w, m.dequantized_weight()), name


def test_scales_file_matches_tensors(quantized):
    for scheme in SCHEMES:
        _, out = quantized[scheme]
        doc = read_scales_file(out / "model.fp8_scales.json")
        assert doc["schema_version"] == 3 and doc["scheme"] == scheme
        tensors = read_tensors(out)
        assert len(doc["layers"]) == 14
        for name, entry in doc["layers"].items():
            stored = tensors[f"{name}.weight_scale"].float().flatten()
            assert torch.equal(torch.tensor(entry["weight"]["scale"]), stored), name
            assert tensors[f"{name}.weight"].dtype == torch.float8_e4m3fn
            assert 0 < entry["weight"]["relative_error"] < 0.1
            if scheme == "fp8-static":
                assert entry["input"]["scale"] == float(tensors[f"{name}.input_scale"])
                assert entry["input"]["scale"] == pytest.approx(entry["input"]["amax"] / 448, rel=1e-6)
            else:
                assert f"{name}.input_scale" not in tensors
        assert doc["not_quantized"] == {"lm_head": "ignored by pattern"}


def test_ignored_tensors_unchanged_and_side_files_copied(quantized, llama_dir):
    _, out = quantized["fp8-dynamic"]
    src, dst = read_tensors(llama_dir), read_tensors(out)
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
    ):
        if name in src:
            assert torch.equal(src[name], dst[name]) and src[name].dtype == dst[name].dtype
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).read_bytes() == (llama_dir / f).read_bytes()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left


@pytest.mark.parametrize("scheme", SCHEMES)
def test_online_equals_offline(quantized, llama_dir, calib_file, input_ids, scheme):
    from mixprec.inference.calibration.data import load_texts, token_batches

    _, out = quantized[scheme]
    offline = mixprec.load_quantized(out)
    online = load_original(llama_dir)
    calib = None
    if scheme == "fp8-static":  # the same token windows the offline path used
        tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
        calib = token_batches(load_texts(calib_file), tok, 8, 32)
    before = sum(p.numel() * p.element_size() for p in online.parameters())
    report = mixprec.quantize_model_(online, scheme=scheme, calib_data=calib)
    assert report.weight_bytes_after < before and len(report.converted) == 14
    for name, m in offline.named_modules():
        if isinstance(m, QuantizedLinear):
            o = online.get_submodule(name)
            assert isinstance(o, QuantizedLinear)
            assert torch.equal(o.weight.view(torch.uint8), m.weight.view(torch.uint8)), name
            assert torch.equal(o.weight_scale, m.weight_scale), name
            if scheme == "fp8-static":
                assert torch.equal(o.input_scale, m.input_scale), name
    with torch.no_grad():
        assert torch.allclose(online(input_ids).logits, offline(input_ids).logits, atol=1e-5, rtol=1e-5)


def test_online_memory_really_drops():
    model = tiny_llama(hidden_size=256, intermediate_size=512)
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    hp = sum(m.weight.numel() * 4 for m in linears)
    report = mixprec.quantize_model_(model, scheme="fp8-dynamic")
    saved = report.weight_bytes_before - report.weight_bytes_after
    assert saved >= 0.74 * hp  # fp32 -> fp8 frees 3/4 of every quantized weight (scales are tiny)
    assert not any(type(m) is torch.nn.Linear for n, m in model.named_modules() if n != "lm_head")


def test_sharded_input_and_output(llama_dir, tmp_path, input_ids):
    model = load_original(llama_dir)
    src = tmp_path / "sharded"
    model.save_pretrained(src, max_shard_size="150KB")
    assert (src / "model.safetensors.index.json").exists()
    report = quantize_checkpoint(src, tmp_path / "out", "fp8-dynamic", max_shard_size="100KB", progress=False)
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {p.name for p in shards}
    assert set(index["weight_map"]) == set(read_tensors(out))
    q = mixprec.load_quantized(out)
    with torch.no_grad():
        assert rel_err(q(input_ids).logits, model(input_ids).logits) < LOGIT_REL_BOUND
    assert len(report.converted) == 14


def test_input_directory_never_modified(llama_dir, tmp_path):
    def digest(d: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}

    before = digest(llama_dir)
    quantize_checkpoint(llama_dir, tmp_path / "o", "fp8-block", progress=False)
    assert digest(llama_dir) == before


def test_hf_fp8_format(llama_dir, tmp_path, input_ids):
    out = tmp_path / "hf"
    quantize_checkpoint(llama_dir, out, "fp8-block", format="hf-fp8", progress=False)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head"],
    }
    tensors = read_tensors(out)
    assert tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 2)
    mine = mixprec.load_quantized(out)
    with torch.no_grad():
        assert rel_err(mine(input_ids).logits, load_original(llama_dir)(input_ids).logits) < LOGIT_REL_BOUND
    pytest.importorskip("accelerate")  # transformers' fp8 loader needs it; on CPU it dequantizes
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    for name, m in mine.named_modules():
        if isinstance(m, QuantizedLinear):
            assert torch.equal(hf.get_submodule(name).weight.detach().float(), m.dequantized_weight()), name


def test_kv_cache_scales(llama_dir, calib_file, tmp_path):
    out = tmp_path / "kv"
    quantize_checkpoint(llama_dir, out, "fp8-dynamic", kv_cache="fp8", calib_data=calib_file, calib_samples=4,
                        calib_seq_len=32, progress=False)  # fmt: skip
    tensors = read_tensors(out)
    doc = read_scales_file(out / "model.fp8_scales.json")
    for i in range(2):
        attn = f"model.layers.{i}.self_attn"
        k, v = float(tensors[f"{attn}.k_scale"]), float(tensors[f"{attn}.v_scale"])
        assert k == doc["kv_cache"][attn]["k_scale"] and v == doc["kv_cache"][attn]["v_scale"]
        assert k == pytest.approx(doc["kv_cache"][attn]["k_amax"] / 448, rel=1e-6)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["strategy"] == "tensor" and qc["kv_cache_scheme"]["type"] == "float"
    ct = pytest.importorskip("compressed_tensors.quantization")
    assert ct.QuantizationConfig.model_validate(qc).kv_cache_scheme.num_bits == 8
    model = mixprec.load_quantized(out)
    assert float(model.model.layers[0].self_attn.k_scale) == float(
        tensors["model.layers.0.self_attn.k_scale"]
    )


@pytest.mark.parametrize("observer", ["percentile", "mse"])
def test_observers_clip_at_or_below_max(quantized, llama_dir, calib_file, tmp_path, observer):
    kw = dict(calib_data=calib_file, calib_samples=8, calib_seq_len=32, progress=False)  # as the fixture's
    quantize_checkpoint(llama_dir, tmp_path / observer, "fp8-static", observer=observer, **kw)
    a = read_scales_file(quantized["fp8-static"][1] / "model.fp8_scales.json")["layers"]
    b = read_scales_file(tmp_path / observer / "model.fp8_scales.json")["layers"]
    for name in a:
        assert 0 < b[name]["input"]["amax"] <= a[name]["input"]["amax"] * (1 + 1e-6)


def test_bert_encoder_quantizes(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64)  # fmt: skip
    bert = transformers.BertModel(cfg).eval()
    bert.save_pretrained(tmp_path / "bert")
    report = quantize_checkpoint(tmp_path / "bert", tmp_path / "q", "fp8-dynamic", progress=False)
    # 6 Linears per layer (q, k, v, attn out, intermediate, output) + the pooler
    assert len(report.converted) == 13
    model = mixprec.load_quantized(tmp_path / "q")
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, ref = model(input_ids=ids).last_hidden_state, bert(input_ids=ids).last_hidden_state
    assert rel_err(got, ref) < 0.05
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert cos.min() > 0.99


def test_loads_checkpoint_written_by_compressed_tensors(quantized, tmp_path, input_ids):
    """transformers + compressed-tensors re-save the checkpoint with their own writer; mixprec loads it."""
    pytest.importorskip("compressed_tensors")
    _, out = quantized["fp8-dynamic"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    hf.save_pretrained(tmp_path / "resaved")
    a, b = mixprec.load_quantized(out), mixprec.load_quantized(tmp_path / "resaved")
    with torch.no_grad():
        assert torch.equal(a(input_ids).logits, b(input_ids).logits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", SCHEMES)
def test_loaded_model_runs_on_gpu(quantized, input_ids, scheme):
    """On a GPU the same checkpoint runs through the native path where the device has it; outputs agree
    with the CPU emulation up to fp32 accumulation order."""
    _, out = quantized[scheme]
    cpu, gpu = mixprec.load_quantized(out), mixprec.load_quantized(out, device="cuda")
    with torch.no_grad():
        a, b = cpu(input_ids).logits, gpu(input_ids.cuda()).logits.cpu()
    assert rel_err(b, a) < 1e-3


def test_layer_by_layer_calibration_matches_whole_model(quantized, llama_dir, calib_file, tmp_path):
    """Calibrating one block at a time (for models larger than RAM) gives the same static input scales
    and KV-cache scales as running the whole model."""
    kw = dict(calib_data=calib_file, calib_samples=8, calib_seq_len=32, progress=False)  # as the fixture's
    quantize_checkpoint(llama_dir, tmp_path / "lbl", "fp8-static", layer_by_layer=True, kv_cache="fp8", **kw)
    quantize_checkpoint(
        llama_dir, tmp_path / "whole", "fp8-static", layer_by_layer=False, kv_cache="fp8", **kw
    )
    a = read_scales_file(tmp_path / "whole" / "model.fp8_scales.json")
    b = read_scales_file(tmp_path / "lbl" / "model.fp8_scales.json")
    assert b["calibration"]["layer_by_layer"] and not a["calibration"]["layer_by_layer"]
    for name, entry in a["layers"].items():
        assert b["layers"][name]["input"]["scale"] == pytest.approx(entry["input"]["scale"], rel=1e-6), name
    for name, entry in a["kv_cache"].items():
        assert b["kv_cache"][name]["k_scale"] == pytest.approx(entry["k_scale"], rel=1e-6)
        assert b["kv_cache"][name]["v_scale"] == pytest.approx(entry["v_scale"], rel=1e-6)
