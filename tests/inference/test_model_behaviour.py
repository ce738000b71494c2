"""A quantized model behaves like a model: casts change the compute and output dtype only (the FP8
payloads and scales keep their bits), device moves move them, state_dict round-trips, torch.compile
and generate() work, and save_quantized writes what `mixprec quantize` writes."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from inference_helpers import CASTS, quantized_state, read_tensors, same_bits, tiny_llama
from torch import nn

import mixprec
from mixprec.errors import MixprecError
from mixprec.inference import QuantizedLinear, quantize_checkpoint


@pytest.fixture(scope="module")
def static_dir(llama_dir, calib_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("behaviour") / "static"
    quantize_checkpoint(llama_dir, out, "fp8-static", calib_data=calib_file, calib_samples=4, calib_seq_len=32,
                        progress=False)  # fmt: skip
    return out


@pytest.fixture(params=["load_quantized", "quantize_model_"])
def quantized(request, static_dir):
    if request.param == "load_quantized":
        return mixprec.load_quantized(static_dir)
    model = tiny_llama()
    mixprec.quantize_model_(model, "fp8-dynamic")
    return model


def _quantized_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every FP8 payload and scale, as raw bytes (bit-identity, whatever the dtype)."""
    return quantized_state(model, QuantizedLinear, ("weight", "weight_scale", "input_scale"))


@pytest.mark.parametrize("cast", list(CASTS))
def test_casts_keep_payloads_and_change_the_output_dtype(quantized, cast, input_ids):
    fn, dtype = CASTS[cast]
    before = _quantized_state(quantized)
    assert fn(quantized) is quantized
    assert same_bits(_quantized_state(quantized), before)
    assert all(t.dtype == torch.float8_e4m3fn for k, t in before.items() if k.endswith(".weight"))
    logits = quantized(input_ids).logits  # the forward that broke: size mismatch after an upcast payload
    assert logits.dtype == dtype and torch.isfinite(logits).all()
    assert {m.out_dtype for m in quantized.modules() if isinstance(m, QuantizedLinear)} == {dtype}


def test_cast_layer_equals_the_fp32_layer_rounded():
    """The independent reference: the same layer in fp32 on the same (bf16-representable) inputs,
    rounded once to bf16 — what an FP8 GEMM with fp32 accumulation and a bf16 output gives. The bf16
    GEMM path rounds the sums to bf16 before the scales (test_bf16_forward.py bounds it): pinned off."""
    torch.manual_seed(0)
    layer = QuantizedLinear.from_linear(
        nn.Linear(128, 48, bias=False), mixprec.inference.SCHEMES["fp8-dynamic"]
    )
    layer.bf16_gemm = "never"
    x = torch.randn(5, 128).to(torch.bfloat16)
    expected = layer(x.float()).to(torch.bfloat16)
    assert torch.equal(copy.deepcopy(layer).bfloat16()(x), expected)
    assert torch.equal(copy.deepcopy(layer).half().float()(x.float()), layer(x.float()))


def test_device_moves_move_payloads_with_their_dtypes(quantized):
    meta = copy.deepcopy(quantized).to("meta")
    for m in (m for m in meta.modules() if isinstance(m, QuantizedLinear)):
        assert m.weight.device.type == "meta" and m.weight.dtype == torch.float8_e4m3fn
        assert m.weight_scale.dtype == torch.float32
    before = _quantized_state(quantized)
    quantized.to("cpu")
    assert same_bits(_quantized_state(quantized), before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_to_cuda_and_back(quantized, input_ids):
    before = _quantized_state(quantized)
    ref = quantized(input_ids).logits
    quantized.to("cuda")
    assert all(t.device.type == "cuda" for t in _quantized_state(quantized).values())
    got = quantized(input_ids.cuda()).logits.cpu()
    assert (got - ref).norm() / ref.norm() < 1e-2
    assert same_bits(_quantized_state(quantized.cpu()), before)


def test_state_dict_round_trip(quantized, static_dir, input_ids):
    quantized.bfloat16()
    sd = quantized.state_dict()
    assert sd[next(k for k in sd if k.endswith("q_proj.weight"))].dtype == torch.float8_e4m3fn
    other = copy.deepcopy(quantized)
    for m in other.modules():
        if isinstance(m, QuantizedLinear):
            m.weight.zero_()
            m.weight_scale.fill_(1.0)
    assert other.load_state_dict(sd, strict=True)
    assert same_bits(_quantized_state(other), _quantized_state(quantized))
    assert torch.equal(other(input_ids).logits, quantized(input_ids).logits)


def test_torch_compile_full_graph():
    """Quantized layers of a cast model trace without graph breaks (aot_eager: the graph as compiled,
    run eagerly; fast enough for a test) and give the eager result."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    mixprec.quantize_model_(model, "fp8-dynamic", default_ignore=False)
    x = torch.randn(4, 64)
    model.bfloat16()
    torch._dynamo.reset()
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(x.bfloat16())
    assert out.dtype == torch.bfloat16 and torch.equal(out, model(x.bfloat16()))


def _greedy(model, ids, steps):
    """Greedy decoding by hand: full forward each step, no cache (the reference for generate())."""
    for _ in range(steps):
        nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate(quantized, input_ids, dtype):
    quantized.to(dtype)
    ids = input_ids[:1, :8]
    out = quantized.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                             do_sample=False, pad_token_id=0)  # fmt: skip
    assert out.shape == (1, 13)
    if dtype == torch.float32:  # bf16 logits tie more often, and cached/uncached sums may order differently
        assert torch.equal(out, _greedy(quantized, ids, 5))


# ---- save_quantized ------------------------------------------------------------------------------


def test_save_quantized_writes_what_quantize_wrote(static_dir, tmp_path):
    mixprec.save_quantized(mixprec.load_quantized(static_dir), tmp_path / "again")
    written, original = read_tensors(tmp_path / "again"), read_tensors(static_dir)
    assert written.keys() == original.keys()
    for k, t in original.items():
        assert written[k].dtype == t.dtype and torch.equal(
            written[k].view(torch.uint8), t.view(torch.uint8)
        ), k
    cfg = json.loads((tmp_path / "again" / "config.json").read_text())
    assert (
        cfg["quantization_config"]
        == json.loads((static_dir / "config.json").read_text())["quantization_config"]
    )
    doc = json.loads((tmp_path / "again" / "model.fp8_scales.json").read_text())
    before = json.loads((static_dir / "model.fp8_scales.json").read_text())
    assert doc["schema_version"] == 3 and doc["layers"].keys() == before["layers"].keys()
    for name, e in before["layers"].items():
        assert doc["layers"][name]["weight"]["scale"] == e["weight"]["scale"]
        assert doc["layers"][name]["input"]["scale"] == e["input"]["scale"]


def test_save_after_a_cast_keeps_payloads_and_records_the_dtype(static_dir, tmp_path, input_ids):
    model = mixprec.load_quantized(static_dir).bfloat16()
    mixprec.save_quantized(model, tmp_path / "bf16")
    written, original = read_tensors(tmp_path / "bf16"), read_tensors(static_dir)
    for k, t in original.items():
        if t.dtype in (torch.float8_e4m3fn,) or k.endswith("_scale"):
            assert written[k].dtype == t.dtype and torch.equal(
                written[k].view(torch.uint8), t.view(torch.uint8)
            )
        else:
            assert written[k].dtype == torch.bfloat16 and torch.equal(written[k], t.to(torch.bfloat16))
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    again = mixprec.load_quantized(tmp_path / "bf16")
    assert same_bits(_quantized_state(again), _quantized_state(model))
    assert again(input_ids).logits.dtype == torch.bfloat16


def test_save_an_online_quantized_model_and_load_it(tmp_path, input_ids):
    model = tiny_llama()
    report = mixprec.quantize_model_(model, "fp8-block")
    mixprec.save_quantized(model, tmp_path / "q")
    loaded = mixprec.load_quantized(tmp_path / "q")
    with torch.no_grad():
        assert torch.equal(loaded(input_ids).logits, model(input_ids).logits)
    doc = json.loads((tmp_path / "q" / "model.fp8_scales.json").read_text())
    name = report.converted[0]
    assert doc["layers"][name]["weight"]["relative_error"] == report.layers[name]["weight"]["relative_error"]
    with pytest.raises(MixprecError, match="exists"):
        mixprec.save_quantized(model, tmp_path / "q")
    with pytest.raises(MixprecError, match="no quantized Linear layers"):
        mixprec.save_quantized(tiny_llama(), tmp_path / "plain")
    assert not (tmp_path / "plain").exists()
