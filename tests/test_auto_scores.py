"""`--scheme auto`: the sensitivity scores (against an independent autograd reference), the scores
file, the mixed-precision checkpoint (compressed-tensors' config model, load_quantized, transformers)
and the online `mixprec.quantize_model_(model, "auto", ...)`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mixprec
from mixprec.errors import MixprecError
from mixprec.inference.runtime.linear import QuantizedLinear
from mixprec.inference.schemes import InferenceScheme
from mixprec.select import fused_groups
from mixprec.sensitivity.auto_report import write_auto_report
from mixprec.sensitivity.automatic import SCORES_NAME, auto_quantize_checkpoint, read_scores
from mixprec.sensitivity.scores import KEPT, Scores, candidate_schemes, score_model

transformers = pytest.importorskip("transformers")

VOCAB = 320
TEXTS = [f"The quick brown fox number {i} jumps over the lazy dog and counts to {i * 7}." for i in range(80)]
FP8 = ["fp8-dynamic", "fp8-static", "fp8-block"]


def _tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    from mixprec.data import save_tokenizer, train_bpe_tokenizer

    d = tmp_path_factory.mktemp("auto") / "llama"
    _tiny_llama().save_pretrained(d)
    save_tokenizer(train_bpe_tokenizer(TEXTS, vocab_size=VOCAB), d)
    return d


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("auto-calib") / "calib.txt"
    p.write_text("\n\n".join(TEXTS))
    return p


def _batches(n: int = 2):
    return [torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(i)) for i in range(n)]


def test_gradient_score_equals_an_autograd_reference():
    model = _tiny_llama()
    batches = [b[:, :16] for b in _batches()]
    scores = score_model(model, batches, candidate_schemes(["fp8-dynamic", "fp8-block"]))
    name = "model.layers.1.mlp.down_proj"
    lin = model.get_submodule(name)
    want = {"fp8-dynamic": 0.0, "fp8-block": 0.0}
    quantized = {c: QuantizedLinear.from_linear(lin, InferenceScheme.from_name(c)) for c in want}
    for batch in batches:  # g = dloss/dY of this Linear, by plain autograd on a fresh forward
        seen: dict = {}

        def keep(m, a, out, seen=seen):
            seen.update(x=a[0].detach(), y=out)
            out.retain_grad()

        handle = lin.register_forward_hook(keep)
        logits = model(input_ids=batch).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        loss.backward()
        handle.remove()
        g, y = seen["y"].grad, seen["y"].detach()
        for c, q in quantized.items():
            want[c] += float(((q(seen["x"]).float() - y) * g).double().square().sum())
        model.zero_grad()
    for c, v in want.items():
        assert scores.layers[name][c] == pytest.approx(v, rel=1e-5), c
    assert all(e[KEPT] == 0.0 for e in scores.layers.values())
    assert all(e["fp8-dynamic"] > 0 for e in scores.layers.values())
    # parameters untouched, no gradients left behind
    assert all(p.requires_grad and p.grad is None for p in model.parameters())


def test_kl_score_and_group_sums():
    model = _tiny_llama()
    scores = score_model(model, _batches(1), candidate_schemes(["fp8-dynamic"]), method="kl")
    groups = scores.group_scores()
    assert set(groups) == set(fused_groups(scores.layers))
    qkv = groups["model.layers.0.self_attn.qkv_proj"]
    members = [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
    ]
    assert qkv["fp8-dynamic"] == pytest.approx(sum(scores.layers[m]["fp8-dynamic"] for m in members))
    assert qkv["fp8-dynamic"] > 0 and qkv[KEPT] == 0


def test_scores_file_round_trips_and_bad_ones_are_refused(tmp_path):
    model = _tiny_llama()
    scores = score_model(model, _batches(1), candidate_schemes(["fp8-dynamic"]))
    doc = json.loads(json.dumps(scores.to_dict()))
    back = Scores.from_dict(doc, "x")
    assert back.layers == scores.layers and back.allowed == scores.allowed and back.shapes == scores.shapes
    doc["layers"]["model.layers.0.mlp.up_proj"]["fp8-dynamic"] = -1.0
    with pytest.raises(MixprecError, match="bad scores"):
        Scores.from_dict(doc, "x")
    with pytest.raises(MixprecError, match="schema_version"):
        Scores.from_dict({"schema_version": 99}, "x")


def test_auto_checkpoint_validates_loads_and_reuses_its_scores(llama_dir, calib, tmp_path):
    ct = pytest.importorskip("compressed_tensors.quantization")
    out = tmp_path / "auto"
    kw = dict(calib_data=calib, calib_samples=4, calib_seq_len=24, candidates=FP8, progress=False)
    result = auto_quantize_checkpoint(llama_dir, out, budget="12", **kw)
    plan = result.allocation
    assert plan.bits_per_weight <= 12 and len(set(plan.layers.values())) >= 2
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = ct.QuantizationConfig.model_validate(qc)
    assert parsed.format == "float-quantized"  # compressed-tensors' rule: every group float-quantized
    targets = {t: g for g, group in qc["config_groups"].items() for t in group["targets"]}
    for members in fused_groups(plan.layers).values():  # a fused group sits in one config group
        assert len({targets.get(m, "kept") for m in members}) == 1, members
    kept = sorted(n for n, c in plan.layers.items() if c == KEPT)
    assert [n for n in qc["ignore"] if n != "lm_head"] == kept
    mine = mixprec.load_quantized(out)
    for name, scheme in plan.layers.items():
        m = mine.get_submodule(name)
        assert (m.scheme.name if isinstance(m, QuantizedLinear) else KEPT) == scheme, name
    assert (out / "model.fp8_scales.json").exists() and (out / SCORES_NAME).exists()
    # transformers (compressed-tensors) gives each Linear its own group's scheme and the same tensors
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    strategy = {"fp8-dynamic": "channel", "fp8-static": "tensor", "fp8-block": "block"}
    for name, m in mine.named_modules():
        if isinstance(m, QuantizedLinear):
            h = hf.get_submodule(name)
            assert h.quantization_scheme.weights.strategy == strategy[m.scheme.name], name
            assert torch.equal(h.weight.detach().view(torch.uint8), m.weight.view(torch.uint8)), name
            assert torch.equal(h.weight_scale.detach().float().flatten(), m.weight_scale.flatten()), name

    again = auto_quantize_checkpoint(
        llama_dir, tmp_path / "auto9", budget="9", scores=out / SCORES_NAME, **kw
    )
    assert again.scores_reused and again.allocation.bits_per_weight <= 9
    with pytest.raises(MixprecError, match="different candidates"):
        auto_quantize_checkpoint(llama_dir, tmp_path / "x", budget="9", scores=out / SCORES_NAME,
                                 **{**kw, "candidates": ["fp8-dynamic"]})  # fmt: skip
    assert read_scores(out / SCORES_NAME).fingerprint == result.scores.fingerprint

    json_path, html_path = write_auto_report(result, out)
    doc = json.loads(json_path.read_text())
    assert doc["schema_version"] == 1 and doc["chosen"]["bits_per_weight"] == plan.bits_per_weight
    assert set(doc["layers"]) == set(plan.layers) and "Per layer" in html_path.read_text()


def test_target_ppl_increase_searches_measured_checkpoints(llama_dir, calib, tmp_path):
    def measure(path: Path) -> dict:  # stands in for mixprec evaluate: +0.1 % per quantized Linear
        qc = json.loads((path / "config.json").read_text())["quantization_config"]
        quantized = sum(len(g["targets"]) for g in qc["config_groups"].values())
        return {"reference_perplexity": 10.0, "candidate_perplexity": 10.0 * (1 + 0.001 * quantized)}

    kw = dict(calib_data=calib, calib_samples=4, calib_seq_len=24, candidates=["fp8-dynamic"], progress=False)
    result = auto_quantize_checkpoint(
        llama_dir, tmp_path / "t", target_ppl_increase="0.5%", measure=measure, **kw
    )
    assert result.search and all(("meets_target" in p) for p in result.search)
    quantized = len(result.allocation.schemes())
    assert 0 < quantized <= 5  # the increase it allows
    assert result.measured["candidate_perplexity"] <= 10.0 * 1.005
    assert not any(
        p.name.startswith(".auto-search") for p in tmp_path.iterdir()
    )  # the search's checkpoints are gone


def test_online_auto_quantizes_each_group_in_its_scheme():
    model = _tiny_llama()
    report = mixprec.quantize_model_(
        model, "auto", budget="10", calib_data=_batches(1), candidates=["fp8-dynamic"]
    )
    plan = report.auto.allocation
    assert 8 < plan.bits_per_weight <= 10
    for name, scheme in plan.layers.items():
        m = model.get_submodule(name)
        assert isinstance(m, QuantizedLinear) == (scheme != KEPT), name
    assert report.scheme == "mixed-precision" and len(report.layers) == len(plan.schemes())
    with pytest.raises(MixprecError, match="needs budget"):
        mixprec.quantize_model_(_tiny_llama(), "auto", calib_data=_batches(1))


def test_cli_refuses_auto_flags_without_auto_and_auto_without_a_budget(llama_dir, calib, tmp_path, capsys):
    from mixprec.cli import main

    assert (
        main(["quantize", "--model", str(llama_dir), "--output", str(tmp_path / "o"), "--budget", "6"]) == 2
    )
    assert "--scheme auto" in capsys.readouterr().err
    args = ["quantize", "--model", str(llama_dir), "--output", str(tmp_path / "o"), "--scheme", "auto",
            "--calib-data", str(calib)]  # fmt: skip
    assert main(args) == 2
    assert "exactly one of --budget and --target-ppl-increase" in capsys.readouterr().err
    assert main([*args, "--budget", "fast"]) == 2
    assert not (tmp_path / "o").exists()


def test_a_hand_assignment_with_fp4_is_one_mixed_precision_checkpoint(llama_dir, tmp_path):
    ct = pytest.importorskip("compressed_tensors.quantization")
    attn = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assignment = {**dict.fromkeys(attn, "nvfp4a16"), "model.layers.1.mlp.down_proj": "fp8-dynamic"}
    out = tmp_path / "mixed"
    mixprec.quantize_checkpoint(llama_dir, out, assignment, progress=False)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = ct.QuantizationConfig.model_validate(qc)
    assert parsed.format == "mixed-precision"  # groups of different formats (compressed-tensors' rule)
    assert sorted(g.format for g in parsed.config_groups.values()) == [
        "float-quantized",
        "nvfp4-pack-quantized",
    ]
    assert {t for g in parsed.config_groups.values() for t in g.targets} == set(assignment)
    model = mixprec.load_quantized(out)
    for name, scheme in assignment.items():
        assert model.get_submodule(name).scheme.name == scheme
    assert not isinstance(model.get_submodule("model.layers.0.mlp.down_proj"), QuantizedLinear)
    split = {**assignment, attn[1]: "fp8-dynamic"}
    with pytest.raises(MixprecError, match=r"splits fused group model\.layers\.0\.self_attn\.qkv_proj"):
        mixprec.quantize_checkpoint(llama_dir, tmp_path / "split", split, progress=False)
    assert not (tmp_path / "split").exists()


def test_save_quantized_writes_a_mixed_model_as_quantize_checkpoint_does(llama_dir, tmp_path):
    """A model whose Linears are in several schemes (loaded from a mixed checkpoint, or made by
    quantize_model_(model, "auto")) saves as the same compressed-tensors checkpoint, bit for bit."""
    from safetensors.torch import load_file

    ct = pytest.importorskip("compressed_tensors.quantization")
    attn = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assignment = {**dict.fromkeys(attn, "nvfp4a16"), "model.layers.1.mlp.down_proj": "fp8-dynamic"}
    first = tmp_path / "mixed"
    mixprec.quantize_checkpoint(llama_dir, first, assignment, progress=False)
    model = mixprec.load_quantized(first)
    mixprec.save_quantized(model, tmp_path / "again")
    qc = json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]
    assert ct.QuantizationConfig.model_validate(qc).format == "mixed-precision"
    assert qc == json.loads((first / "config.json").read_text())["quantization_config"]
    written, original = (
        load_file(tmp_path / "again" / "model.safetensors"),
        load_file(first / "model.safetensors"),
    )
    assert written.keys() == original.keys()
    for k, t in original.items():
        assert written[k].dtype == t.dtype and torch.equal(
            written[k].view(torch.uint8), t.view(torch.uint8)
        ), k
    doc = json.loads((tmp_path / "again" / "model.fp8_scales.json").read_text())
    assert doc["scheme"] == "mixed-precision" and list(doc["layers"]) == ["model.layers.1.mlp.down_proj"]
    back = mixprec.load_quantized(tmp_path / "again")
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
    with pytest.raises(MixprecError, match="compressed-tensors layout only"):
        mixprec.save_quantized(model, tmp_path / "hf", format="hf-fp8")
    assert not (tmp_path / "hf").exists()


def test_auto_with_gptq_scores_each_candidate_with_gptqs_weights_and_writes_with_gptq(
    llama_dir, calib, tmp_path
):
    """--scheme auto --algorithm gptq: each candidate's scored weights are the uniform GPTQ checkpoint's of
    that scheme bit for bit; GPTQ's weights score lower than round to nearest's; the checkpoint is written
    with GPTQ; a scores file of round to nearest is not taken for GPTQ's."""
    from mixprec.hf import load_model, load_tokenizer
    from mixprec.inference.algorithms.spec import AlgorithmSpec
    from mixprec.inference.calibration.data import load_texts, token_batches
    from mixprec.inference.checkpoint.algorithm_file import read_algorithm_file
    from mixprec.inference.producers.quantize import quantize_checkpoint
    from mixprec.sensitivity.algorithm_candidates import rounded_candidates
    from mixprec.sensitivity.scores import scorable_linears

    kw = dict(calib_data=calib, calib_samples=4, calib_seq_len=24, progress=False)
    model = load_model(llama_dir, dtype=torch.float32).eval()
    batches = token_batches(load_texts(calib), load_tokenizer(llama_dir), 4, 24)
    names = list(scorable_linears(model))
    rounded = rounded_candidates(model, batches, names, candidate_schemes(["nvfp4a16"]), AlgorithmSpec.parse("gptq"),
                                 torch.float32)  # fmt: skip
    quantize_checkpoint(llama_dir, tmp_path / "uniform", "nvfp4a16", algorithm="gptq", **kw)
    uniform = mixprec.load_quantized(tmp_path / "uniform")
    assert len(rounded["nvfp4a16"]) == 14
    for name, q in rounded["nvfp4a16"].items():
        assert torch.equal(q.dequantize(), uniform.get_submodule(name).dequantized_weight(torch.float32)), (
            name
        )

    cands = ["fp8-dynamic", "nvfp4a16"]
    rtn = auto_quantize_checkpoint(llama_dir, tmp_path / "rtn", budget="8", candidates=cands, **kw)
    gptq = auto_quantize_checkpoint(
        llama_dir, tmp_path / "gptq", budget="8", candidates=cands, algorithm="gptq", **kw
    )
    inside = [n for n in names if n in rounded["nvfp4a16"]]
    assert sum(gptq.scores.layers[n]["nvfp4a16"] for n in inside) < sum(
        rtn.scores.layers[n]["nvfp4a16"] for n in inside
    )
    assert "algorithm" in gptq.scores.fingerprint and "algorithm" not in rtn.scores.fingerprint
    assert read_algorithm_file(tmp_path / "gptq")["names"] == ["gptq"]
    assert gptq.report.algorithm["layers"].keys() == {
        n for n, c in gptq.allocation.layers.items() if c != KEPT
    }
    with pytest.raises(MixprecError, match="different algorithm"):
        auto_quantize_checkpoint(llama_dir, tmp_path / "x", budget="8", candidates=cands, algorithm="gptq",
                                 scores=tmp_path / "rtn" / SCORES_NAME, **kw)  # fmt: skip


def test_auto_refuses_the_algorithms_it_does_not_score_with(llama_dir, calib, tmp_path):
    with pytest.raises(MixprecError, match="--scheme auto scores its candidates with --algorithm gptq; awq"):
        auto_quantize_checkpoint(
            llama_dir, tmp_path / "a", budget="8", calib_data=calib, algorithm="awq,gptq"
        )
    with pytest.raises(MixprecError, match="scheme='auto' with an algorithm writes a checkpoint"):
        mixprec.quantize_model_(_tiny_llama(), "auto", budget=8, calib_data=_batches(), algorithm="gptq")
    assert not (tmp_path / "a").exists()
