"""Checkpoints whose Linear weights are not simply `<module>.weight` of an nn.Linear: a tied output head
(not stored; readers still see the module) and MoE experts (stored per expert, fused 3-D in the
transformers 5 model). Each scheme's output loads in transformers and in mixprec with logits close
to the original (the 12% / cosine 0.99 bound of test_quantize_checkpoint.py); nothing stays in high
precision without the report saying why.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from inference_helpers import (
    VOCAB,
    assert_same_quantized,
    read_tensors,
    rel_err,
    save_with_tokenizer,
    tiny_llama,
)
from safetensors.torch import save_file

import mixprec
from mixprec.errors import MixprecError
from mixprec.inference import quantize_checkpoint
from mixprec.inference.algorithms import gptq_experts
from mixprec.inference.calibration import outside
from mixprec.inference.calibration.run import StopRule
from mixprec.inference.checkpoint.scales_file import read_scales_file
from mixprec.inference.runtime.linear import QuantizedLinear
from mixprec.inference.schemes import PARTLY_QUANTIZED_RULE

transformers = pytest.importorskip("transformers")

LOGIT_REL_BOUND = 0.12
SCHEMES = ("fp8-dynamic", "fp8-static", "fp8-block")
CALIB = dict(calib_samples=8, calib_seq_len=32)


def _quantize(src: Path, out: Path, scheme: str, calib: Path, **kw):
    if scheme == "fp8-static":
        kw = {"calib_data": calib, **CALIB, **kw}
    return quantize_checkpoint(src, out, scheme, progress=False, **kw)


def _assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(got).all()
    assert rel_err(got, ref) < LOGIT_REL_BOUND, rel_err(got, ref)
    assert torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0) > 0.99


# ---- tied output head ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory) -> Path:
    d = save_with_tokenizer(tiny_llama(tie_word_embeddings=True), tmp_path_factory.mktemp("tied") / "model")
    assert "lm_head.weight" not in read_tensors(d)  # what makes the case: the head's weight is not stored
    return d


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize("scheme", SCHEMES)
def test_tied_head_is_ignored_and_loads_in_transformers(tied_dir, calib_file, input_ids, tmp_path, scheme):
    pytest.importorskip("compressed_tensors")
    report = _quantize(tied_dir, tmp_path / "q", scheme, calib_file)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head"]
    assert "lm_head" in report.skipped and len(report.converted) == 14
    ref = transformers.LlamaForCausalLM.from_pretrained(tied_dir).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
    mine = mixprec.load_quantized(tmp_path / "q")
    assert not isinstance(mine.lm_head, QuantizedLinear)
    with torch.no_grad():
        expected = ref(input_ids).logits
        _assert_close(hf(input_ids).logits, expected)
        _assert_close(mine(input_ids).logits, expected)


def test_tied_head_hf_fp8_not_converted(tied_dir, input_ids, tmp_path):
    quantize_checkpoint(tied_dir, tmp_path / "q", "fp8-block", format="hf-fp8", progress=False)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["modules_to_not_convert"] == ["lm_head"]
    ref = transformers.LlamaForCausalLM.from_pretrained(tied_dir).eval()
    with torch.no_grad():
        expected = ref(input_ids).logits
        _assert_close(mixprec.load_quantized(tmp_path / "q")(input_ids).logits, expected)
        pytest.importorskip("accelerate")  # transformers' fp8 loader needs it
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
        _assert_close(hf(input_ids).logits, expected)


def test_tied_head_without_default_ignore_is_kept_and_said(tied_dir, tmp_path):
    with pytest.warns(UserWarning, match="lm_head: weight tied to model.embed_tokens.weight"):
        report = quantize_checkpoint(tied_dir, tmp_path / "q", default_ignore=False, progress=False)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert "lm_head" in qc["ignore"]
    assert report["lm_head"].precision.startswith("skipped: weight tied")


# ---- MoE experts -----------------------------------------------------------------------------------


def tiny_mixtral(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=128)  # fmt: skip
    return transformers.MixtralForCausalLM(cfg).eval()


EXPERT = "model.layers.{}.block_sparse_moe.experts.{}.w{}"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    d = save_with_tokenizer(tiny_mixtral(), tmp_path_factory.mktemp("moe") / "model")
    # what transformers 5 writes: one 2-D weight per expert, while its model holds them fused in 3-D
    assert f"{EXPERT.format(0, 0, 1)}.weight" in read_tensors(d)
    return d


@pytest.mark.parametrize("scheme", SCHEMES)
def test_moe_experts_quantized_and_loaded(moe_dir, calib_file, input_ids, tmp_path, scheme):
    report = _quantize(moe_dir, tmp_path / "q", scheme, calib_file)
    experts = [EXPERT.format(i, e, w) for i in range(2) for e in range(4) for w in (1, 2, 3)]
    assert set(experts) <= set(report.converted) and len(report.converted) == 24 + 8  # + q, k, v, o
    tensors = read_tensors(tmp_path / "q")
    for name in experts:
        assert tensors[f"{name}.weight"].dtype == torch.float8_e4m3fn, name
        assert f"{name}.weight_scale" in tensors
        assert (f"{name}.input_scale" in tensors) == (scheme == "fp8-static")
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    routers = [f"model.layers.{i}.block_sparse_moe.gate" for i in range(2)]
    assert qc["ignore"] == ["lm_head", *routers]  # the routers stay in high precision, as by default
    assert all(tensors[f"{r}.weight"].dtype == torch.float32 for r in routers)
    assert not [w for w in report.warnings if "high precision" in w]

    model = mixprec.load_quantized(tmp_path / "q")
    fp8 = [n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    assert len(fp8) == 32
    with torch.no_grad():
        _assert_close(model(input_ids).logits, tiny_mixtral()(input_ids).logits)


def test_moe_kv_cache(moe_dir, calib_file, tmp_path):
    """KV-cache scales calibrate on the whole MoE model."""
    quantize_checkpoint(moe_dir, tmp_path / "kv", "fp8-dynamic", kv_cache="fp8", calib_data=calib_file,
                        progress=False, **CALIB)  # fmt: skip
    assert "model.layers.1.self_attn.k_scale" in read_tensors(tmp_path / "kv")


def test_moe_layer_by_layer_matches_whole_model(moe_dir, calib_file, tmp_path):
    """Layer by layer, the skeleton's experts are unfused as the loader unfuses them (one Linear per
    checkpoint expert weight, the router renamed as transformers renames it): the static input scales
    of every expert and the KV-cache scales are those of the whole model run on every batch."""
    kw = dict(calib_data=calib_file, kv_cache="fp8", calib_stop=StopRule(0.0), progress=False, **CALIB)
    quantize_checkpoint(moe_dir, tmp_path / "lbl", "fp8-static", layer_by_layer=True, **kw)
    quantize_checkpoint(moe_dir, tmp_path / "whole", "fp8-static", layer_by_layer=False, **kw)
    a = read_scales_file(tmp_path / "whole" / "model.fp8_scales.json")
    b = read_scales_file(tmp_path / "lbl" / "model.fp8_scales.json")
    assert b["calibration"]["layer_by_layer"] and not a["calibration"]["layer_by_layer"]
    assert {EXPERT.format(1, 3, 2), EXPERT.format(0, 0, 1)} <= set(a["layers"]) and a["layers"].keys() == b[
        "layers"
    ].keys()
    for name, entry in a["layers"].items():
        assert b["layers"][name]["input"]["scale"] == pytest.approx(entry["input"]["scale"], rel=1e-6), name
    for name, entry in a["kv_cache"].items():
        assert b["kv_cache"][name]["k_scale"] == pytest.approx(entry["k_scale"], rel=1e-6)


def test_moe_layer_by_layer_refuses_tensors_it_cannot_place(moe_dir, calib_file, tmp_path, monkeypatch):
    """Without transformers' conversion mapping the per-expert tensors are not known as expert weights:
    layer-by-layer calibration, which fills blocks by name, refuses them with a clear error."""
    from mixprec.inference.checkpoint import linear_weights

    monkeypatch.setattr(linear_weights, "conversion_transforms", lambda model: ([], []))
    with (
        warnings.catch_warnings(),
        pytest.raises(MixprecError, match=r"names 26 of them differently .*; pass --no-la"),
    ):
        warnings.simplefilter("ignore")  # the experts stay in high precision, said elsewhere
        _quantize(moe_dir, tmp_path / "lbl", "fp8-static", calib_file, layer_by_layer=True)
    assert list(tmp_path.iterdir()) == []


def test_whole_model_advice_under_torchrun(monkeypatch):
    """A split calibration always runs layer by layer: the advice there is to leave torchrun, since
    --no-layer-by-layer alone would change nothing."""
    assert outside.whole_model_advice() == "pass --no-layer-by-layer"
    monkeypatch.setattr(outside, "world_size", lambda: 2)
    advice = outside.whole_model_advice()
    assert "not under torchrun" in advice and advice.endswith("with --no-layer-by-layer")


def test_moe_ignored_experts_load_in_high_precision(moe_dir, input_ids, tmp_path):
    report = quantize_checkpoint(moe_dir, tmp_path / "q", ignore=[r"re:.*experts\.0\."], progress=False)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    # the experts of one MoE block share one decision (vLLM runs them as one fused layer): ignoring
    # expert 0 keeps every expert of both blocks in high precision, each named with the reason
    assert EXPERT.format(1, 0, 3) in qc["ignore"] and len(report.converted) == 32 - 24
    assert report[EXPERT.format(1, 2, 2)].reason.startswith(PARTLY_QUANTIZED_RULE)
    model = mixprec.load_quantized(tmp_path / "q")
    kept = model.model.layers[1].mlp.experts.projections.gate_up_proj[0][1]
    assert type(kept) is torch.nn.Linear and kept.weight.dtype == torch.float32
    with torch.no_grad():
        _assert_close(model(input_ids).logits, tiny_mixtral()(input_ids).logits)


def _never_expert_3(monkeypatch) -> None:
    from transformers.models.mixtral import modeling_mixtral

    route = modeling_mixtral.MixtralTopKRouter.forward

    def never_expert_3(self, hidden_states):
        logits, scores, indices = route(self, hidden_states)
        return logits, scores, torch.where(indices == 3, (indices + 1) % 3, indices)

    monkeypatch.setattr(modeling_mixtral.MixtralTopKRouter, "forward", never_expert_3)


@pytest.mark.parametrize("layer_by_layer", [False, True])
def test_moe_expert_without_calibration_tokens_takes_its_layers_largest_scale(
    moe_dir, calib_file, tmp_path, monkeypatch, layer_by_layer
):
    """fp8-static with an expert the router never picks: its input scale is the largest of its layer's
    other experts for the same fused parameter (w1/w3: gate_up, w2: down), as vLLM serves the layer; one
    warning names the six weights; the others keep their own scales."""
    _never_expert_3(monkeypatch)
    with pytest.warns(UserWarning, match=r"routed no token to 6 MoE expert weight\(s\) \('.*experts\.3\.w1'"):
        report = _quantize(moe_dir, tmp_path / "q", "fp8-static", calib_file, layer_by_layer=layer_by_layer)
    assert len([w for w in report.warnings if "routed no token" in w]) == 1
    tensors = read_tensors(tmp_path / "q")
    scale = {n[: -len(".input_scale")]: float(v) for n, v in tensors.items() if n.endswith(".input_scale")}
    for i in range(2):
        for ws in ((1, 3), (2,)):
            seen = [scale[EXPERT.format(i, e, w)] for e in range(3) for w in ws]
            assert all(s > 0 for s in seen) and len(set(seen)) > 1  # their own scales, not one shared
            for w in ws:
                assert scale[EXPERT.format(i, 3, w)] == max(seen)


def test_unreached_experts_of_a_whole_parameter_are_an_error():
    from mixprec.inference.calibration.run import unseen_take_group_max

    group_of = {"e0.w2": "down", "e1.w2": "down", "e0.w1": "gate_up", "e1.w1": "gate_up"}
    amax = {"e0.w2": 0.0, "e1.w2": 0.0, "e0.w1": 2.0, "e1.w1": 0.0, "q_proj": 0.5}
    with pytest.raises(MixprecError, match=r"no token to any expert of 'down'"):
        unseen_take_group_max(amax, group_of)
    amax["e0.w2"] = 3.0
    got, unseen = unseen_take_group_max(amax, group_of)
    assert got == {"e0.w2": 3.0, "e1.w2": 3.0, "e0.w1": 2.0, "e1.w1": 2.0, "q_proj": 0.5}
    assert unseen == ["e1.w2", "e1.w1"] and amax["e1.w2"] == 0.0  # the input is not modified


def test_unrecognised_expert_weights_are_reported_and_warned(moe_dir, tmp_path, monkeypatch):
    """Without the conversion mapping nothing says the per-expert tensors are Linear weights: they stay in
    high precision, but never silently."""
    from mixprec.inference.checkpoint import linear_weights

    monkeypatch.setattr(linear_weights, "conversion_transforms", lambda model: ([], []))
    with pytest.warns(UserWarning, match=r"24 weight tensor\(s\) stay in high precision"):
        report = quantize_checkpoint(moe_dir, tmp_path / "q", progress=False)
    name = EXPERT.format(1, 3, 2)
    assert name in report.skipped and "no module of the model has this name" in report[name].reason
    assert len(report.converted) == 8


def test_fused_expert_tensors_are_reported(tmp_path):
    """A checkpoint stored in the fused layout (3-D gate_up_proj / down_proj) keeps them in high
    precision, with a warning and a report entry for each."""
    model = tiny_mixtral()
    d = tmp_path / "fused"
    model.config.architectures = ["MixtralForCausalLM"]
    model.config.save_pretrained(d)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, d / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    with pytest.warns(UserWarning, match="fused 3-D expert weights"):
        report = quantize_checkpoint(d, tmp_path / "q", progress=False)
    fused = [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")]
    assert set(fused) <= set(report.skipped)
    assert len(report.converted) == 8
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _assert_close(mixprec.load_quantized(tmp_path / "q")(ids).logits, model(ids).logits)


# ---- GPTQ over the experts --------------------------------------------------------------------------

GPTQ_CALIB = dict(calib_samples=32, calib_seq_len=64)  # 2048 tokens, ~1000 routed to an expert on average
EXPERT_INPUTS = {1: 128, 3: 128, 2: 256}  # w1 and w3 read the hidden state, w2 the intermediate


def _gptq(src: Path, out: Path, scheme: str, calib: Path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = quantize_checkpoint(src, out, scheme, calib_data=calib, algorithm="gptq", progress=False,
                                     **GPTQ_CALIB)  # fmt: skip
    return report, [str(w.message) for w in caught]


@pytest.mark.parametrize("scheme", ["nvfp4a16", "fp8-dynamic"])
def test_gptq_rounds_each_expert_on_its_routed_tokens(moe_dir, calib_file, input_ids, tmp_path, scheme):
    """Each expert weight gets the Hessian of the tokens routed to its expert: the records' token counts
    add up, per MoE layer, to the calibration tokens times top-k; a solved expert's calibration output
    error is at most round to nearest's; one that saw fewer tokens than inputs fell back (and was said)."""
    report, said = _gptq(moe_dir, tmp_path / "q", scheme, calib_file)
    record = report.algorithm
    layers = record["layers"]
    experts = [EXPERT.format(i, e, w) for i in range(2) for e in range(4) for w in (1, 2, 3)]
    assert set(experts) <= set(layers) and len(layers) == 24 + 8
    for i in range(2):
        routed = [layers[EXPERT.format(i, e, 1)]["tokens"] for e in range(4)]
        assert sum(routed) == record["tokens"] * 2  # top-2
        for e in range(4):  # w3 shares w1's Hessian; w2 reads the same tokens' intermediates
            assert (
                layers[EXPERT.format(i, e, 3)]["tokens"]
                == layers[EXPERT.format(i, e, 2)]["tokens"]
                == routed[e]
            )
    fallen = []
    for name in experts:
        rec = layers[name]
        assert (rec.get("fallback") == "rtn") == (rec["tokens"] < EXPERT_INPUTS[int(name[-1])]), name
        if "fallback" in rec:
            fallen.append(name)
            assert rec["output_error"] == rec["output_error_rtn"] > 0
        else:
            assert rec["output_error"] <= rec["output_error_rtn"], name
            assert rec["damp"] > 0
    assert len(fallen) < len(experts) // 2  # most experts saw enough tokens to be solved
    warned = [w for w in said if "MoE expert weight(s)" in w]
    assert len(warned) == (1 if fallen else 0) and warned == [w for w in report.warnings if "MoE expert" in w]
    if fallen:
        assert warned[0].startswith(f"GPTQ: {len(fallen)} of 24 MoE expert weight(s)")

    model = mixprec.load_quantized(tmp_path / "q")
    assert {EXPERT.format(1, 3, 2), EXPERT.format(0, 0, 1)} <= set(model.mixprec_report.layers)
    assert len(model.mixprec_report.layers) == 32
    with torch.no_grad():
        got, ref = model(input_ids).logits, tiny_mixtral()(input_ids).logits
    assert torch.isfinite(got).all()
    assert torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0) > 0.95


def test_gptq_expert_without_tokens_is_rounded_to_nearest(moe_dir, calib_file, tmp_path, monkeypatch):
    """An expert the router never picks has no Hessian: its weights are the round-to-nearest
    checkpoint's, bit for bit, its record says so, and one warning names it."""
    rtn = tmp_path / "rtn"
    quantize_checkpoint(moe_dir, rtn, "nvfp4a16", progress=False)
    _never_expert_3(monkeypatch)
    report, said = _gptq(moe_dir, tmp_path / "q", "nvfp4a16", calib_file)
    warned = [w for w in said if "MoE expert weight(s)" in w]
    assert len(warned) == 1 and re.search(
        r"rounded to nearest \(e\.g\. .*experts\.3\.w\d: 0 tokens", warned[0]
    )
    a, b = read_tensors(tmp_path / "q"), read_tensors(rtn)
    for i in range(2):
        for w in (1, 2, 3):
            name = EXPERT.format(i, 3, w)
            assert report.algorithm["layers"][name] == {
                "output_error_rtn": 0.0, "output_error": 0.0, "tokens": 0, "fallback": "rtn",
                "seconds": report.algorithm["layers"][name]["seconds"],
            }  # fmt: skip
            for k in [k for k in b if k.startswith(name + ".")]:
                assert torch.equal(a[k], b[k]), k
    solved = EXPERT.format(0, 0, 1)
    assert "fallback" not in report.algorithm["layers"][solved]
    assert not torch.equal(a[f"{solved}.weight_packed"], b[f"{solved}.weight_packed"])


def test_gptq_expert_below_the_threshold_is_rounded_to_nearest(moe_dir, calib_file, tmp_path, monkeypatch):
    """The threshold (gptq_experts.MIN_TOKENS_PER_INPUT) raised past every expert's count: every expert
    weight is the round-to-nearest checkpoint's, bit for bit, its output errors (from its Hessian) equal;
    the attention Linears are still GPTQ-rounded."""
    rtn = tmp_path / "rtn"
    quantize_checkpoint(moe_dir, rtn, "fp8-dynamic", progress=False)
    monkeypatch.setattr(gptq_experts, "MIN_TOKENS_PER_INPUT", 1e9)
    report, said = _gptq(moe_dir, tmp_path / "q", "fp8-dynamic", calib_file)
    assert next(w for w in said if "MoE expert weight(s)" in w).startswith(
        "GPTQ: 24 of 24 MoE expert weight(s)"
    )
    a, b = read_tensors(tmp_path / "q"), read_tensors(rtn)
    for name, rec in report.algorithm["layers"].items():
        if ".experts." in name:
            assert rec["fallback"] == "rtn" and rec["output_error"] == rec["output_error_rtn"] > 0, name
            assert rec["tokens"] > 0
            assert torch.equal(a[f"{name}.weight"], b[f"{name}.weight"]), name
            assert torch.equal(a[f"{name}.weight_scale"], b[f"{name}.weight_scale"]), name
        else:
            assert "fallback" not in rec and rec["output_error"] < rec["output_error_rtn"], name
            assert not torch.equal(a[f"{name}.weight"], b[f"{name}.weight"]), name


def test_gptq_w4a4_with_an_unreached_expert_completes(moe_dir, calib_file, tmp_path, monkeypatch):
    """nvfp4 (static activation global scales) under GPTQ with an expert the router never picks: the
    expert is rounded to nearest and its input global scale is its layer's (the smallest global scale,
    i.e. the largest amax, of the same fused parameter); nothing fails after the walk."""
    _never_expert_3(monkeypatch)
    report, said = _gptq(moe_dir, tmp_path / "q", "nvfp4", calib_file)
    assert any("routed no token to 6 MoE expert weight(s)" in w for w in said)
    assert report.algorithm["layers"][EXPERT.format(0, 3, 1)]["fallback"] == "rtn"
    tensors = read_tensors(tmp_path / "q")
    for w in (1, 2):
        scales = [float(tensors[f"{EXPERT.format(1, e, w)}.input_global_scale"]) for e in range(4)]
        assert scales[3] == min(scales[:3])


def test_gptq_plan_counts_every_experts_hessian(moe_dir):
    """The plan's GPTQ term holds one block's Hessians as the walk does: per expert one for w1/w3 (their
    shared input, hidden^2) and one for w2 (intermediate^2), beside attention's q/k/v and o (fp32)."""
    from mixprec.inference.producers.quantize_plan import plan_quantize

    # enough calibration tokens that the block-by-block stage is the peak and its terms are the plan's
    plan = plan_quantize(moe_dir, moe_dir.parent / "unused", "nvfp4a16", algorithm="gptq", calib_data="x.txt",
                         calib_samples=1024, calib_seq_len=2048)  # fmt: skip
    hidden, inter, experts = 128, 256, 4
    expected = 4 * (experts * (hidden**2 + inter**2) + hidden**2 + 256**2)  # o_proj reads 4 heads x 64
    assert plan.memory.terms["GPTQ: the Hessians of one block (in^2 fp32 per input group)"] == expected


def test_unfusing_live_experts_keeps_the_forward(input_ids):
    from mixprec.inference.runtime.experts import UnfusedExperts, unfuse_live

    model, original = tiny_mixtral(), tiny_mixtral()
    paths, left = unfuse_live(model)
    assert left == {} and len(paths) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    assert paths["model.layers.1.mlp.experts.projections.gate_up_proj.3.1"] == (
        "model.layers.1.mlp.experts.gate_up_proj"
    )
    assert isinstance(model.model.layers[0].mlp.experts, UnfusedExperts)
    assert not [n for n, p in model.named_parameters() if p.dim() == 3]  # the fused parameters left the model
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, original(input_ids).logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "nvfp4a16", "fp8-static"])
def test_live_moe_experts_are_quantized_as_the_checkpoint(moe_dir, calib_file, input_ids, tmp_path, scheme):
    """mixprec.quantize_model_ on a live MoE model quantizes every expert weight (transformers holds them
    fused in 3-D) exactly as quantize_checkpoint writes them: the same payloads, weight and input scales,
    gate and up of one expert sharing their NVFP4 global scale."""
    from mixprec.hf import load_tokenizer

    _quantize(moe_dir, tmp_path / "q", scheme, calib_file)
    offline = mixprec.load_quantized(tmp_path / "q")
    live = tiny_mixtral()
    report = mixprec.quantize_model_(live, scheme, calib_data=calib_file, tokenizer=load_tokenizer(moe_dir),
                                     calib_samples=8, calib_seq_len=32)  # fmt: skip
    assert len(report.converted) == 32 and not report.warnings
    assert assert_same_quantized(live, offline) == 32
    with torch.no_grad():  # and they compute what the loaded checkpoint computes
        torch.testing.assert_close(live(input_ids).logits, offline(input_ids).logits, rtol=1e-5, atol=1e-5)


def test_live_moe_gptq_with_an_unreached_expert(moe_dir, calib_file, tmp_path, monkeypatch):
    """GPTQ on a live MoE model under a static scheme, expert 3 never routed: it walks the unfused experts
    as the checkpoint's walk does (same records, same payloads and scales), rounds expert 3 to nearest
    and gives it its layer's largest input scale, with both warnings."""
    from mixprec.hf import load_tokenizer

    _never_expert_3(monkeypatch)
    report, _ = _gptq(moe_dir, tmp_path / "q", "fp8-static", calib_file)
    offline = mixprec.load_quantized(tmp_path / "q")
    live = tiny_mixtral()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mine = mixprec.quantize_model_(live, "fp8-static", calib_data=calib_file, algorithm="gptq",
                                       tokenizer=load_tokenizer(moe_dir), **GPTQ_CALIB)  # fmt: skip
    said = [str(w.message) for w in caught]
    assert any("routed no token to 6 MoE expert weight(s)" in w for w in said)
    assert any(w.startswith("GPTQ: ") and " of 24 MoE expert weight(s)" in w for w in said), said
    fallen = [n for n, r in mine.algorithm["layers"].items() if r.get("fallback") == "rtn"]
    theirs_fallen = [n for n, r in report.algorithm["layers"].items() if r.get("fallback") == "rtn"]
    assert len(fallen) == len(theirs_fallen) >= 6
    assert len([n for n in fallen if ".gate_up_proj.3." in n or ".down_proj.3." in n]) == 6
    assert len(mine.algorithm["layers"]) == len(report.algorithm["layers"]) == 32
    assert assert_same_quantized(live, offline) == 32


def test_live_experts_outside_the_standard_layout_are_reported(input_ids, monkeypatch):
    """An experts module UnfusedExperts cannot run (here: block 0's, refused by the layout check) stays
    fused and in high precision, with a warning and a `skipped` entry; the other block's are quantized."""
    from mixprec.inference.runtime import experts

    supported = experts.check_supported

    def refuse_block_0(module, name):
        if name.startswith("model.layers.0."):
            raise MixprecError(f"{name}: not the standard layout (test)")
        supported(module, name)

    monkeypatch.setattr(experts, "check_supported", refuse_block_0)
    model = tiny_mixtral()
    with pytest.warns(
        UserWarning, match=r"the MoE experts 'model\.layers\.0\.mlp\.experts' stay in high precision"
    ):
        report = mixprec.quantize_model_(model, "fp8-dynamic")
    assert "model.layers.0.mlp.experts" in report.skipped
    assert len(report.converted) == 8 + 12  # attention, and block 1's 4 experts x (gate, up, down)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids).logits).all()
