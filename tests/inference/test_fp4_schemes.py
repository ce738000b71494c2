"""The block-format inference schemes (nvfp4a16, nvfp4, mxfp4a16, mxfp4, mxfp8): offline streaming,
online apply_scheme_, load_quantized, the emulated forward; compressed-tensors as the oracle."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from mixprec.formats import unpack_nibbles
from mixprec.hf import load_model
from mixprec.inference.checkpoint.configs import ct_quantization_config
from mixprec.inference.producers.quantize import quantize_checkpoint
from mixprec.inference.producers.save import save_quantized
from mixprec.inference.readers.load import load_quantized
from mixprec.inference.runtime.online import apply_scheme_
from mixprec.inference.schemes import BLOCK_DIMS_RULE, SCHEMES
from mixprec.quantization import quantize

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

DATA = Path(__file__).parent / "data"
SRC = DATA / "tiny_llama_src"
BLOCK_SCHEMES = ("nvfp4a16", "nvfp4", "mxfp4a16", "mxfp4", "mxfp8")


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("nvfp4a16", "mxfp4a16", "mxfp8"):
            out[name] = tmp_path_factory.mktemp(name) / "q"
            quantize_checkpoint(SRC, out[name], name, progress=False)
    return out


def test_nvfp4a16_checkpoint_is_llm_compressors_bit_for_bit(written):
    """llm-compressor's NVFP4 fixture was made from the same weights: every weight tensor (packed
    payload, E4M3 block scales, fused global scales) and every unquantized tensor is identical."""
    ours = load_file(written["nvfp4a16"] / "model.safetensors")
    theirs = load_file(DATA / "llmc_nvfp4" / "model.safetensors")
    common = [k for k in theirs if k in ours]
    assert len(common) == len(ours) and any(k.endswith("weight_packed") for k in common)
    assert [k for k in common if not torch.equal(_u8(ours[k]), _u8(theirs[k]))] == []
    assert set(theirs) - set(ours) == {k for k in theirs if k.endswith("input_global_scale")}  # W4A4's


def test_mxfp4a16_checkpoint_matches_compressed_tensors(written):
    ours = load_file(written["mxfp4a16"] / "model.safetensors")
    src = load_file(SRC / "model.safetensors")
    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    name = "model.layers.1.mlp.down_proj"
    w = src[f"{name}.weight"]
    blocks = w.unflatten(-1, (w.shape[-1] // 32, 32))
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights)
    ref = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    assert torch.equal(ours[f"{name}.weight_packed"], ref["weight_packed"])
    assert torch.equal(ours[f"{name}.weight_scale"], ref["weight_scale"])


@pytest.mark.parametrize("name", BLOCK_SCHEMES)
def test_config_validates_with_compressed_tensors(name):
    qc = ct_quantization_config(SCHEMES[name], ["lm_head"], False)
    QuantizationConfig.model_validate(qc)
    fmt = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized", "mxfp8": "mxfp8-quantized"}
    assert qc["format"] == fmt[name.replace("a16", "")]


def test_written_configs_validate_and_fused_shards_share_global_scales(written):
    for path in written.values():
        QuantizationConfig.model_validate(
            json.loads((path / "config.json").read_text())["quantization_config"]
        )
    t = load_file(written["nvfp4a16"] / "model.safetensors")
    g = {
        k.rsplit(".", 2)[1]: float(v) for k, v in t.items() if "layers.0" in k and k.endswith("global_scale")
    }
    assert g["q_proj"] == g["k_proj"] == g["v_proj"] and g["gate_proj"] == g["up_proj"]
    assert g["o_proj"] != g["q_proj"]


def test_llmc_nvfp4_loads_as_compressed_tensors_decompresses_it():
    model = load_quantized(DATA / "llmc_nvfp4")
    t = load_file(DATA / "llmc_nvfp4" / "model.safetensors")
    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        ref = NVFP4PackedCompressor.decompress(
            {k.rsplit(".", 1)[1]: v for k, v in t.items() if k.startswith(name + ".")}, scheme
        )
        ours = model.get_submodule(name).dequantized_weight(torch.bfloat16)
        assert torch.equal(ours, ref["weight"])
        assert float(model.get_submodule(name).input_global_scale) == float(t[f"{name}.input_global_scale"])


def test_modelopt_nvfp4_loads_by_compressed_tensors_conversion_rule():
    """ModelOpt stores weight_scale_2 = 1 / global scale; compressed-tensors' converter takes 1 / it."""
    model = load_quantized(DATA / "modelopt_nvfp4")
    t = load_file(DATA / "modelopt_nvfp4" / "model.safetensors")
    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    name = "model.layers.0.mlp.gate_proj"
    converted = {
        "weight_packed": t[f"{name}.weight"], "weight_scale": t[f"{name}.weight_scale"],
        # reshaped to [1]: a 0-dim global scale would make compressed-tensors' decompression divide
        # in bf16 (a 0-dim tensor does not promote a bf16 one); vLLM and mixprec divide in fp32
        "weight_global_scale": (1 / t[f"{name}.weight_scale_2"]).reshape(1),
    }  # fmt: skip
    ref = NVFP4PackedCompressor.decompress(converted, scheme)["weight"]
    assert torch.equal(model.get_submodule(name).dequantized_weight(torch.bfloat16), ref)


@pytest.mark.parametrize("name", ["nvfp4a16", "mxfp4a16", "mxfp8"])
def test_online_equals_offline(written, name):
    offline = load_quantized(written[name])
    online = load_model(SRC, dtype="auto").eval()
    apply_scheme_(online, name)
    a, b = offline.state_dict(), online.state_dict()
    assert set(a) == set(b) and all(torch.equal(_u8(a[k]), _u8(b[k])) for k in a)
    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(offline(ids).logits, online(ids).logits)


def test_nvfp4_w4a4_online_calibrates_input_global_scale_and_emulates_exactly():
    model = load_model(SRC, dtype="auto").eval()
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    apply_scheme_(model, "nvfp4", calib_data=[ids])
    lin = model.model.layers[0].self_attn.q_proj
    k = model.model.layers[0].self_attn.k_proj
    assert torch.equal(lin.input_global_scale, k.input_global_scale)  # the same input
    x = torch.randn(3, lin.in_features, generator=torch.Generator().manual_seed(2)).bfloat16()
    xq = quantize(x, "e2m1", SCHEMES["nvfp4"].input_granularity, global_scale=lin.input_global_scale)
    ref = (xq.dequantize() @ lin.dequantized_weight().t()).bfloat16()
    torch.testing.assert_close(lin(x), ref, rtol=1e-2, atol=1e-6)  # fp32 sums, one bf16 rounding


def test_block_dims_stay_in_high_precision_with_the_reason():
    model = nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 48))
    report = apply_scheme_(model, "nvfp4a16")
    assert isinstance(model[0], nn.Linear) and type(model[2]).__name__ == "BlockQuantizedLinear"
    assert BLOCK_DIMS_RULE in report["0"].reason
    report = apply_scheme_(nn.Sequential(nn.Linear(48, 32)), "mxfp4a16")
    assert "32-element blocks" in report["0"].reason


@pytest.mark.parametrize(("name", "bits"), [("nvfp4a16", 4.5), ("mxfp4a16", 4.25), ("mxfp8", 8.25)])
def test_stored_bits_per_weight(written, name, bits):
    t = load_file(written[name] / "model.safetensors")
    mod = "model.layers.0.mlp.up_proj"
    nbytes = sum(v.numel() * v.element_size() for k, v in t.items() if k.startswith(mod + "."))
    weights = 256 * 128
    assert nbytes * 8 / weights == pytest.approx(bits + (32 / weights if name.startswith("nv") else 0))
    assert SCHEMES[name].stored_bits(256, 128) == nbytes * 8


def test_packed_payload_low_nibble_first(written):
    t = load_file(written["nvfp4a16"] / "model.safetensors")
    model = load_quantized(written["nvfp4a16"])
    lin = model.model.layers[0].self_attn.v_proj
    codes = unpack_nibbles(t["model.layers.0.self_attn.v_proj.weight_packed"])
    assert torch.equal(codes[:, 0::2], t["model.layers.0.self_attn.v_proj.weight_packed"] & 0x0F)
    assert torch.equal(lin.quantized_weight().data, codes)


def test_save_quantized_round_trips_block_schemes(tmp_path):
    model = load_model(SRC, dtype="auto").eval()
    apply_scheme_(model, "nvfp4a16")
    save_quantized(model, tmp_path / "saved")
    qc = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qc)
    back = load_quantized(tmp_path / "saved")
    ids = torch.randint(0, 200, (1, 8), generator=torch.Generator().manual_seed(3))
    assert torch.equal(model(ids).logits, back(ids).logits)


def test_inspect_names_the_engines_that_read_each_block_scheme(written):
    """vLLM reads every FP4/MX compressed-tensors scheme (its CPU build then finds no kernel:
    docs/serving.md); load_quantized reads every scheme mixprec writes."""
    from mixprec.inference.readers.inspection import inspect_checkpoint

    for name, directory in written.items():
        engines = inspect_checkpoint(directory)["engines"]
        assert engines["vllm"]["loads"], (name, engines["vllm"])
        assert engines["mixprec"]["loads"], (name, engines["mixprec"])


def test_streaming_reads_each_nvfp4_weight_once(tmp_path, monkeypatch, written):
    """The fused shards' shared global scale comes from the same read that quantizes them (one task per
    fused GEMM): every target weight is read exactly once, and the checkpoint is the one written before."""
    from mixprec.inference.checkpoint import safetensors_io

    reads: dict[str, int] = {}
    plain_get = safetensors_io.ShardReader.get

    def counting_get(self, info, out=None):
        reads[info.name] = reads.get(info.name, 0) + 1
        return plain_get(self, info, out)

    monkeypatch.setattr(safetensors_io.ShardReader, "get", counting_get)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_checkpoint(SRC, tmp_path / "q", "nvfp4a16", progress=False)
    quantized = [n for n in reads if n.endswith("_proj.weight")]
    assert quantized and all(reads[n] == 1 for n in quantized), reads
    ours, before = (
        load_file(tmp_path / "q" / "model.safetensors"),
        load_file(written["nvfp4a16"] / "model.safetensors"),
    )
    assert ours.keys() == before.keys() and all(torch.equal(_u8(ours[k]), _u8(before[k])) for k in ours)
