"""load_quantized on FP8 checkpoints that mixprec did not write.

The fixtures under data/ were produced by the real tools from one tiny bf16 Llama (see
data/make_fixtures.py and data/PROVENANCE.json): llm-compressor 0.14 `oneshot` FP8_DYNAMIC
(compressed-tensors) and transformers 5.24 FineGrainedFP8Config 128x128 (`quant_method: "fp8"`).
Each is loaded, checked to run FP8 Linears on the stored payloads, compared in logits with the
source model, and compared tensor by tensor with what mixprec.quantize_checkpoint writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

import mixprec  # noqa: E402
from mixprec.inference.runtime.linear import QuantizedLinear  # noqa: E402
from mixprec.scaling import Granularity  # noqa: E402

DATA = Path(__file__).parent / "data"
SRC = DATA / "tiny_llama_src"
LLMC = DATA / "llmc_fp8_dynamic"
HF_FP8 = DATA / "hf_fp8_block"
LINEARS = [
    f"model.layers.{i}.{m}"
    for i in range(2)
    for m in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
]
needs_hf_fp8 = pytest.mark.skipif(not HF_FP8.exists(), reason="hf_fp8_block fixture not produced")


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def _codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).int()


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def source_logits(ids) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(SRC).eval()
    assert model.dtype == torch.bfloat16
    return _logits(model, ids)


@pytest.fixture(scope="module")
def mixprec_dynamic(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mp") / "fp8_dynamic"
    mixprec.quantize_checkpoint(SRC, out, "fp8-dynamic", progress=False)
    return out


@pytest.fixture(scope="module")
def mixprec_block(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mp") / "fp8_block_hf"
    mixprec.quantize_checkpoint(SRC, out, "fp8-block", format="hf-fp8", progress=False)
    return out


def _check_fp8_linears(model: nn.Module, stored: dict, scale_name: str, granularity: Granularity) -> None:
    """Every quantized Linear runs FP8 on exactly the stored payload and scales; lm_head stays bf16."""
    for name in LINEARS:
        layer = model.get_submodule(name)
        assert isinstance(layer, QuantizedLinear), name
        assert layer.weight.dtype == torch.float8_e4m3fn
        assert layer.weight_granularity == granularity
        assert torch.equal(_codes(layer.weight), _codes(stored[f"{name}.weight"])), name
        stored_scale = stored[f"{name}.{scale_name}"].float()
        assert torch.equal(layer.weight_scale.reshape(stored_scale.shape), stored_scale), name
    head = model.get_submodule("lm_head")
    assert type(head) is nn.Linear and head.weight.dtype == torch.bfloat16
    assert torch.equal(head.weight, stored["lm_head.weight"])
    assert model.mixprec_report.warnings == []


# ---- llm-compressor, compressed-tensors FP8_DYNAMIC ------------------------------------------------


def test_llmc_fixture_is_what_llm_compressor_writes():
    qc = json.loads((LLMC / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "channel" and group["input_activations"]["strategy"] == "token"
    assert qc["ignore"] == ["lm_head"]


def test_llmc_checkpoint_loads_as_fp8_and_tracks_source(ids, source_logits):
    model = mixprec.load_quantized(LLMC)
    _check_fp8_linears(model, _tensors(LLMC), "weight_scale", Granularity.rows())
    out = _logits(model, ids)
    # measured: relative L2 0.054, cosine 0.99855 (FP8 E4M3 weights and per-token inputs in all 14 Linears)
    assert _rel(out, source_logits) < 0.08
    assert _cos(out, source_logits) > 0.996


def test_llmc_logits_match_mixprec_own_checkpoint(ids, source_logits, mixprec_dynamic):
    theirs = _logits(mixprec.load_quantized(LLMC), ids)
    ours = _logits(mixprec.load_quantized(mixprec_dynamic), ids)
    # the checkpoints differ by one FP8 code on ~3% of the weights and by bf16-rounded scales (payload
    # test below); through 14 FP8 GEMMs with per-token FP8 inputs that puts the two runs about as far
    # apart as each is from the source. Measured relative L2: theirs-ours 0.045, theirs-source 0.054,
    # ours-source 0.056.
    assert _rel(theirs, ours) < 0.07
    assert abs(_rel(theirs, source_logits) - _rel(ours, source_logits)) < 0.01


def test_llmc_payloads_and_scales_vs_mixprec(mixprec_dynamic):
    src, theirs, ours = _tensors(SRC), _tensors(LLMC), _tensors(mixprec_dynamic)
    assert set(theirs) == set(ours)
    same = total = 0
    worst_scale = 0.0
    for name in LINEARS:
        w, s = theirs[f"{name}.weight"], theirs[f"{name}.weight_scale"]
        ws, ss = ours[f"{name}.weight"], ours[f"{name}.weight_scale"]
        assert w.dtype == ws.dtype == torch.float8_e4m3fn and w.shape == ws.shape
        # llm-compressor stores the per-channel scales in the weight dtype (bf16), mixprec in fp32:
        # both are amax/448, so they differ by the bf16 rounding alone, at most 2^-8 relative
        assert s.dtype == torch.bfloat16 and ss.dtype == torch.float32 and s.shape == ss.shape
        worst_scale = max(worst_scale, float(((s.float() - ss) / ss).abs().max()))
        assert torch.equal(ss.bfloat16(), s), name  # measured: exactly mixprec's scale rounded to bf16
        # llm-compressor divides in bf16 (w / scale rounded to bf16, then to FP8: a double rounding);
        # this reproduces its payload bit for bit, so the payload differences below come from that
        x = src[f"{name}.weight"]
        redo = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(_codes(redo), _codes(w)), name
        # mixprec divides in fp32 (one rounding): where the two differ it is by one FP8 code
        diff = (_codes(w) - _codes(ws)).abs()
        assert int(diff.max()) <= 1, name
        same += int((diff == 0).sum())
        total += diff.numel()
    # measured: 96.97% of payload bytes identical, scales within 0.33% (bf16 rounding, bound 2^-8)
    assert same / total > 0.95
    assert worst_scale <= 2.0**-8
    for name in theirs:  # unquantized tensors (norms, embeddings, lm_head) are the source's, untouched
        if not name.startswith(tuple(LINEARS)):
            assert torch.equal(theirs[name], ours[name]) and torch.equal(theirs[name], src[name]), name


# ---- Hugging Face quant_method "fp8", 128x128 blocks ------------------------------------------------


@needs_hf_fp8
def test_hf_fp8_fixture_is_what_transformers_writes():
    qc = json.loads((HF_FP8 / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    assert qc["activation_scheme"] == "dynamic"
    # transformers then keeps its default skips (the output embeddings) in high precision
    assert qc["modules_to_not_convert"] is None
    assert _tensors(HF_FP8)["lm_head.weight"].dtype == torch.bfloat16


@needs_hf_fp8
def test_hf_fp8_checkpoint_loads_as_fp8_and_tracks_source(ids, source_logits):
    model = mixprec.load_quantized(HF_FP8)
    _check_fp8_linears(model, _tensors(HF_FP8), "weight_scale_inv", Granularity.blocks(128, 128))
    out = _logits(model, ids)
    # measured: relative L2 0.054, cosine 0.99852 (lm_head kept in bf16, as transformers and vLLM run it)
    assert _rel(out, source_logits) < 0.08
    assert _cos(out, source_logits) > 0.996


@needs_hf_fp8
def test_hf_fp8_payloads_and_scales_vs_mixprec(ids, mixprec_block):
    src, theirs, ours = _tensors(SRC), _tensors(HF_FP8), _tensors(mixprec_block)
    assert set(theirs) == set(ours)
    worst_scale = 0.0
    for name in LINEARS:
        w, s = theirs[f"{name}.weight"], theirs[f"{name}.weight_scale_inv"]
        ws, ss = ours[f"{name}.weight"], ours[f"{name}.weight_scale_inv"]
        assert s.dtype == ss.dtype == torch.float32 and s.shape == ss.shape
        # measured: every payload byte identical
        assert torch.equal(_codes(w), _codes(ws)), name
        worst_scale = max(worst_scale, float(((s - ss) / ss).abs().max()))
    # transformers stores 1 / (448 / amax), mixprec amax / 448: a couple of fp32 ulps apart
    # (measured 9.1e-8 relative)
    assert worst_scale < 1e-6
    for name in theirs:
        if not name.startswith(tuple(LINEARS)):
            assert torch.equal(theirs[name], ours[name]) and torch.equal(theirs[name], src[name]), name
    a = _logits(mixprec.load_quantized(HF_FP8), ids)
    b = _logits(mixprec.load_quantized(mixprec_block), ids)
    assert _rel(a, b) < 1e-3  # same payloads, scales an ulp apart: measured 0 (identical bf16 logits)
