"""--algorithm scale-search: per FP4 / MX block, the candidate scale of least squared error; alone (data-free),
under GPTQ, online and offline."""

from __future__ import annotations

import warnings

import pytest
import torch
from inference_helpers import read_tensors

import mixprec
from mixprec.errors import MixprecError
from mixprec.formats import E4M3
from mixprec.inference.algorithms.scale_search import NVFP4_SEARCH_HEADROOM, search_scales
from mixprec.inference.checkpoint.algorithm_file import read_algorithm_file
from mixprec.inference.producers.quantize import quantize_checkpoint
from mixprec.inference.runtime.linear import QuantizedLinear
from mixprec.inference.schemes import InferenceScheme
from mixprec.quantization import quantize

transformers = pytest.importorskip("transformers")


def _block_sq_errors(w, q, width):
    return (q.dequantize() - w.float()).square().view(w.shape[0], -1, width).sum(-1)


@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16", "mxfp8"])
def test_no_block_is_worse_than_round_to_nearest(scheme):
    torch.manual_seed(0)
    w = (torch.randn(256, 512) * 0.02).to(torch.bfloat16)
    w[3, 17] = 0.4  # an outlier block
    sch = InferenceScheme.from_name(scheme)
    g = sch.weight_granularity
    rtn = quantize(w, sch.fmt, g)
    if g.scale_format == "e4m3":  # the same block scales as round to nearest, in the search's units
        rtn = quantize(w, sch.fmt, g, global_scale=rtn.global_scale * NVFP4_SEARCH_HEADROOM)
    q = search_scales(w, sch.fmt, g)
    width = g.block_cols
    assert (_block_sq_errors(w, q, width) <= _block_sq_errors(w, rtn, width)).all()
    assert _block_sq_errors(w, q, width).sum() < _block_sq_errors(w, rtn, width).sum()
    ratio = q.scale / rtn.scale
    if g.scale_format == "e8m0":
        assert set(ratio.unique().tolist()) <= {0.5, 1.0, 2.0}
    else:
        assert torch.equal(q.scale, q.scale.to(E4M3.torch_dtype).float())  # E4M3 values
        assert float(q.scale.max()) <= E4M3.max
        assert ((ratio > 1.4) & (ratio < 1.6)).any()  # "4 over 6" chosen somewhere


def test_nvfp4_global_scale_has_the_headroom_for_four_over_six():
    w = torch.randn(64, 64)
    sch = InferenceScheme.from_name("nvfp4a16")
    rtn = quantize(w, sch.fmt, sch.weight_granularity)
    q = search_scales(w, sch.fmt, sch.weight_granularity)
    assert float(q.global_scale) == pytest.approx(float(rtn.global_scale) * 256 / 448, rel=1e-6)


def test_scale_search_refuses_fp8_schemes(llama_dir, tmp_path):
    with pytest.raises(MixprecError, match="scale-search chooses FP4 / MX block scales; scheme fp8-dynamic"):
        quantize_checkpoint(llama_dir, tmp_path / "q", "fp8-dynamic", algorithm="scale-search")
    assert not (tmp_path / "q").exists()


def _quiet_quantize(*args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_checkpoint(*args, progress=False, **kw)


@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16"])
def test_checkpoint_is_data_free_lower_error_and_matches_online(llama_dir, tmp_path, scheme):
    rtn = _quiet_quantize(llama_dir, tmp_path / "rtn", scheme)
    searched = _quiet_quantize(llama_dir, tmp_path / "s", scheme, algorithm="scale-search")
    assert (
        searched.algorithm["names"] == ["scale-search"]
        and "nvfp4_factors" in searched.algorithm["scale_search"]
    )
    assert read_algorithm_file(tmp_path / "s")["names"] == ["scale-search"] and rtn.algorithm is None
    for name, entry in searched.layers.items():
        assert entry["weight"]["relative_error"] <= rtn.layers[name]["weight"]["relative_error"], name
    model = transformers.LlamaForCausalLM.from_pretrained(llama_dir).eval()
    mixprec.quantize_model_(model, scheme, algorithm="scale-search")
    offline = mixprec.load_quantized(tmp_path / "s")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "s", quantization_config=transformers.CompressedTensorsConfig(dequantize=True)
    )
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            mine = offline.get_submodule(name).dequantized_weight(torch.bfloat16)
            assert torch.equal(m.dequantized_weight(torch.bfloat16), mine), name
            assert torch.equal(hf.get_submodule(name).weight.detach().to(torch.bfloat16), mine), name


def test_scale_search_under_gptq(llama_dir, calib_file, tmp_path):
    report = _quiet_quantize(llama_dir, tmp_path / "q", "nvfp4a16", algorithm="gptq,scale-search",
                             calib_data=calib_file, calib_samples=8, calib_seq_len=32)  # fmt: skip
    rec = report.algorithm
    assert rec["names"] == ["scale-search", "gptq"]
    assert all(r["output_error"] < r["output_error_rtn"] for r in rec["layers"].values())
    t = read_tensors(tmp_path / "q")
    plain = _quiet_quantize(llama_dir, tmp_path / "p", "nvfp4a16")
    g = "model.layers.0.self_attn.q_proj.weight_global_scale"
    assert float(t[g]) == pytest.approx(float(read_tensors(tmp_path / "p")[g]) * 256 / 448, rel=1e-6)
    assert plain.algorithm is None
