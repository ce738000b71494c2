"""Scale folds (algorithms/folds.py), SmoothQuant and AWQ on tiny Llamas: the folds preserve the
function, AWQ lowers the quantized parents' output error, SmoothQuant flattens the activations, and
nothing changes where nothing should."""

from __future__ import annotations

import copy

import pytest
import torch
from inference_helpers import VOCAB, rel_err, tiny_llama
from torch import nn

from mixprec.errors import MixprecError
from mixprec.inference.algorithms.awq import awq_model_, awq_scales, weight_means
from mixprec.inference.algorithms.folds import LINEAR, block_mappings, fold_scales_
from mixprec.inference.algorithms.smoothquant import smoothquant_applies, smoothquant_model_
from mixprec.inference.schemes import SCHEMES, InferenceScheme, quantize_weight

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

OUTLIERS = [3, 17, 90]


def _mha_llama(**kw):
    return tiny_llama(num_key_value_heads=4, **kw)  # v_proj's 256 outputs are o_proj's 256 inputs


def _outlier_llama(**kw):
    """A tiny Llama whose residual stream has a few channels 50x larger (as trained models have)."""
    model = tiny_llama(**kw)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, OUTLIERS] *= 50
    return model


def _batches(n=2, rows=4, seq=64):
    return [
        torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(10 + i))
        for i in range(n)
    ]


def _quantized_linears(model, scheme):
    return {n: scheme for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _bits_equal(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _width(model, mapping):
    prev = dict(model.named_modules())[mapping.previous]
    return prev.out_features if isinstance(prev, nn.Linear) else prev.weight.numel()


# ---------------------------------------------------------------------------------------------------
# Folds


def test_mappings_of_a_llama_block_and_the_gqa_skip():
    mha = block_mappings(_mha_llama())
    assert [m.name for m in mha.inside("model.layers.1.")] == [
        "model.layers.1.input_layernorm -> q_proj,k_proj,v_proj",
        "model.layers.1.self_attn.v_proj -> o_proj",
        "model.layers.1.post_attention_layernorm -> gate_proj,up_proj",
        "model.layers.1.mlp.up_proj -> down_proj",
    ]
    assert [m.parent for m in mha.inside("model.layers.1.")] == [
        "model.layers.1.self_attn", "model.layers.1.self_attn.o_proj", "model.layers.1.mlp",
        "model.layers.1.mlp.down_proj",
    ]  # fmt: skip
    assert not mha.skipped
    gqa = block_mappings(tiny_llama())  # 2 key/value heads for 4 query heads
    assert len(gqa.mappings) == 6
    assert set(gqa.skipped) == {f"model.layers.{i}.self_attn.v_proj -> o_proj" for i in (0, 1)}
    assert all("128" in why and "256" in why and "grouped-query" in why for why in gqa.skipped.values())


def _qwen2():
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # q/k/v biases, nonzero so that the fold of v's rows must carry its bias
        for layer in model.model.layers:
            layer.self_attn.v_proj.bias.normal_(0, 0.5)
    return model


@pytest.mark.parametrize(
    "build", [_mha_llama, tiny_llama, _qwen2], ids=["llama-mha", "llama-gqa", "qwen2-bias"]
)
def test_each_fold_leaves_the_logits_unchanged(build, input_ids):
    model = build()
    with torch.no_grad():
        reference = model(input_ids).logits
    gen = torch.Generator().manual_seed(5)
    mappings = block_mappings(model).mappings
    kinds = {m.name.split(".", 3)[-1] for m in mappings}
    assert len(kinds) == (3 if build is tiny_llama else 4)
    for m in mappings:
        # scales over two decades each way: a fold that forgot the bias or a Linear moves the logits far
        s = torch.exp(torch.randn(_width(model, m), generator=gen) * 1.5)
        before = _state(model)
        fold_scales_(model, m, s)
        changed = [k for k in before if not _bits_equal(before[k], model.state_dict()[k])]
        assert changed, m.name
        with torch.no_grad():
            assert rel_err(model(input_ids).logits, reference) < 1e-5, m.name


def test_fold_scales_is_the_documented_division_and_multiplication():
    model = _mha_llama()
    m = next(x for x in block_mappings(model).mappings if x.kind == LINEAR and x.previous.endswith("v_proj"))
    attn = model.model.layers[0].self_attn
    v, o = attn.v_proj.weight.detach().clone(), attn.o_proj.weight.detach().clone()
    s = torch.linspace(0.5, 4.0, 256)
    fold_scales_(model, m, s)
    assert torch.equal(attn.v_proj.weight, (v.double() / s.double()[:, None]).float())
    assert torch.equal(attn.o_proj.weight, (o.double() * s.double()[None, :]).float())


@pytest.mark.parametrize("bad", ["zero", "negative", "nan", "short"])
def test_fold_refuses_bad_scales_before_any_change(bad):
    model = tiny_llama()
    m = block_mappings(model).mappings[0]
    s = torch.ones(128)
    if bad == "zero":
        s[5] = 0
    elif bad == "negative":
        s[5] = -1
    elif bad == "nan":
        s[5] = float("nan")
    else:
        s = s[:100]
    before = _state(model)
    with pytest.raises(MixprecError, match="scales"):
        fold_scales_(model, m, s)
    assert all(_bits_equal(before[k], v) for k, v in model.state_dict().items())


# ---------------------------------------------------------------------------------------------------
# AWQ


def _parent_errors(original, candidate, scheme, batches):
    """{parent: relative output error} of `candidate` with each mapping's Linears rounded to nearest by
    `scheme`, against `original` unquantized, each parent run on the inputs its own model gives it."""
    errors = {}
    for m in block_mappings(original).mappings:
        reference = _parent_io(original, m.parent, batches)
        inputs = _parent_io(candidate, m.parent, batches)
        mods = dict(candidate.named_modules())
        saved = {n: mods[n].weight.data for n in m.linears}
        try:
            # the Linears of a mapping as one fused GEMM (q/k/v, gate/up: as vLLM stacks them, one NVFP4
            # global scale for all)
            fused, _ = quantize_weight(torch.cat([saved[n] for n in m.linears]), scheme)
            rows = [saved[n].shape[0] for n in m.linears]
            for n, w in zip(m.linears, fused.dequantize().split(rows), strict=True):
                mods[n].weight.data = w.to(saved[n].dtype)
            with torch.no_grad():
                num = sum(float((_call(mods[m.parent], a, k) - out).square().sum())
                          for (a, k, _), (_, _, out) in zip(inputs, reference, strict=True))  # fmt: skip
        finally:
            for n, w in saved.items():
                mods[n].weight.data = w
        errors[m.parent] = num / sum(float(out.square().sum()) for _, _, out in reference)
    return errors


def _call(module, args, kwargs):
    out = module(*args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _parent_io(model, parent, batches):
    """[(args, kwargs, output)] of module `parent` over the batches of an unquantized forward."""
    seen = []

    def hook(_m, args, kwargs, out):
        seen.append((args, kwargs, out[0] if isinstance(out, tuple) else out))

    h = dict(model.named_modules())[parent].register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            for b in batches:
                model(input_ids=b, use_cache=False)  # a cache in the kwargs would grow at every rerun
    finally:
        h.remove()
    return seen


@pytest.mark.parametrize("scales", ["duo", "activation", "both"])
@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16"])
def test_awq_lowers_the_parents_output_error_against_rtn(scheme, scales):
    original = _outlier_llama(num_key_value_heads=4)
    batches = _batches()
    model = copy.deepcopy(original)
    sch = SCHEMES[scheme]
    record = awq_model_(model, batches, _quantized_linears(model, sch), scales=scales)
    assert record["folded"] >= 1 and record["scales"] == scales
    # the record's final error of each mapping is what the folded model gives, measured independently
    # (each mapping was searched on the weights the model ends with)
    awq = _parent_errors(original, model, sch, batches)
    for m in block_mappings(model).mappings:
        r = record["mappings"][m.name]
        assert r["error_after"] <= r["error_before"], m.name
        assert r["folded"] == (r["alpha"] is not None) == (r["scales"] is not None), m.name
        assert (
            r["scales"] in (None, scales) if scales != "both" else r["scales"] in (None, "duo", "activation")
        )
        assert awq[m.parent] == pytest.approx(r["error_after"], rel=1e-3), m.name
    # against round to nearest without scaling: lower in all, on the calibration tokens and on others
    # (a Linear -> Linear fold may cost its previous Linear a little: not each parent is lower)
    rtn = _parent_errors(original, original, sch, batches)
    assert sum(awq.values()) < 0.9 * sum(rtn.values()), (awq, rtn)
    held_out = _batches(n=1, rows=2, seq=48)
    rtn, awq = (
        _parent_errors(original, original, sch, held_out),
        _parent_errors(original, model, sch, held_out),
    )
    assert sum(awq.values()) < 0.9 * sum(rtn.values()), (awq, rtn)
    with torch.no_grad():  # and the folded model is the same function
        assert rel_err(model(held_out[0]).logits, original(held_out[0]).logits) < 1e-5


def test_awq_whose_only_candidate_is_one_leaves_every_weight_bit_identical():
    model = _outlier_llama().to(torch.bfloat16)
    before = _state(model)
    schemes = _quantized_linears(model, SCHEMES["nvfp4a16"])
    record = awq_model_(model, _batches(n=1), schemes, n_grid=1, scales="activation")  # its alpha 0: s = 1
    assert record["folded"] == 0 and all(
        r["alpha"] is None and not r["folded"] for r in record["mappings"].values()
    )
    assert all(r["error_before"] == r["error_after"] > 0 for r in record["mappings"].values())
    assert all(_bits_equal(before[k], v) for k, v in model.state_dict().items())


def test_duo_scales_follow_the_formula_and_the_weight_means_their_blocks():
    g = torch.Generator().manual_seed(3)
    w1, w2 = torch.randn(8, 64, generator=g), torch.randn(4, 64, generator=g) * 3
    w1[2, 5] = 40.0  # one large weight: the other 15 of its NVFP4 block (and its MXFP4 block of 32) shrink
    schemes = {"a": SCHEMES["nvfp4a16"], "b": SCHEMES["mxfp4a16"]}
    reference = torch.zeros(64, dtype=torch.float64)
    for w, block in ((w1, 16), (w2, 32)):  # element by element: |w| over its block's max |w|
        for r in range(w.shape[0]):
            for c in range(64):
                lo = c // block * block
                reference[c] += abs(float(w[r, c])) / (float(w[r, lo : lo + block].abs().max()) + 1e-6)
    reference /= 12
    w_mean = weight_means({"a": w1, "b": w2}, schemes)
    torch.testing.assert_close(w_mean.double(), reference, rtol=1e-6, atol=0)
    x_mean = torch.rand(64, generator=g) * 10
    for alpha in (0.0, 0.35, 0.9):
        s = [x_mean[c].item() ** alpha / (reference[c].item() ** (1 - alpha) + 1e-4) for c in range(64)]
        s = torch.tensor(s, dtype=torch.float64).clamp_min(1e-4)
        s /= (s.max() * s.min()).sqrt()
        torch.testing.assert_close(awq_scales(x_mean, alpha, w_mean).double(), s, rtol=1e-5, atol=0)
    assert torch.equal(awq_scales(x_mean, 0.0), torch.ones(64))  # without duo, alpha 0 is s = 1


def test_awq_only_touches_mappings_with_quantized_linears():
    model = _outlier_llama()
    before = _state(model)
    batches = _batches(n=1)
    mlp_only = {n: "nvfp4a16" for n in _quantized_linears(model, None) if ".mlp." in n}
    record = awq_model_(model, batches, mlp_only)
    assert all(".mlp" in name or "post_attention" in name for name in record["mappings"])
    assert (
        record["skipped"]["model.layers.0.input_layernorm -> q_proj,k_proj,v_proj"]
        == "none of its Linears is quantized"
    )
    after = model.state_dict()
    untouched = [
        k for k in before if "self_attn" in k or "input_layernorm" in k or "embed" in k or "lm_head" in k
    ]
    assert untouched and all(_bits_equal(before[k], after[k]) for k in untouched)


# ---------------------------------------------------------------------------------------------------
# SmoothQuant


def _channel_max(model, linears, batches):
    """{Linear: max |x| per input channel} over the batches (an independent observation)."""
    mods = dict(model.named_modules())
    out = {}

    def observe(name):
        def hook(_m, args):
            x = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0)
            out[name] = torch.maximum(out[name], x) if name in out else x

        return hook

    handles = [mods[n].register_forward_pre_hook(observe(n)) for n in linears]
    with torch.no_grad():
        for b in batches:
            model(input_ids=b)
    for h in handles:
        h.remove()
    return out


def test_smoothquant_flattens_the_activations_and_keeps_the_function():
    original = _outlier_llama(num_key_value_heads=4)
    model = copy.deepcopy(original)
    batches = _batches()
    firsts = [m.linears[0] for m in block_mappings(model).mappings if not m.previous.endswith("v_proj")]
    before = _channel_max(original, firsts, batches)
    record = smoothquant_model_(model, batches, alpha=0.5)
    after = _channel_max(model, firsts, batches)
    assert len(record["mappings"]) == len(firsts) == 6
    assert set(record["skipped"]) == {f"model.layers.{i}.self_attn.v_proj -> o_proj" for i in (0, 1)}
    for n in firsts:
        spread_before = float(before[n].max() / before[n].median())
        spread_after = float(after[n].max() / after[n].median())
        assert spread_after < 0.6 * spread_before, n
    with torch.no_grad():
        assert rel_err(model(batches[0]).logits, original(batches[0]).logits) < 1e-5
    # the scale of the first norm, from the SmoothQuant formula with independently observed maxima
    layer0, ref0 = model.model.layers[0], original.model.layers[0]
    attn = ref0.self_attn
    w_max = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).abs().amax(0)
    s = before["model.layers.0.self_attn.q_proj"].sqrt() / w_max.sqrt()
    torch.testing.assert_close(
        layer0.input_layernorm.weight, ref0.input_layernorm.weight / s, rtol=1e-5, atol=0
    )


def test_smoothquant_applies_only_where_activations_are_quantized():
    for name, sch in SCHEMES.items():
        why = smoothquant_applies(name)
        if sch.input_format is None:
            assert why is not None and name in why and "weights only" in why
        else:
            assert why is None, name
    assert smoothquant_applies("nvfp4a16") and smoothquant_applies("mxfp4a16")
    assert (
        smoothquant_applies("fp8-block") is None
    )  # dynamic 1x128 activation groups: it quantizes activations
    assert smoothquant_applies(InferenceScheme.from_name("nvfp4")) is None


# ---------------------------------------------------------------------------------------------------
# Inputs and bad input


def test_inputs_are_not_modified_beyond_the_folds():
    original = _outlier_llama()
    batches = _batches(n=1)
    kept = [b.clone() for b in batches]
    for run in (lambda m: awq_model_(m, batches, _quantized_linears(m, "nvfp4a16")),
                lambda m: smoothquant_model_(m, batches)):  # fmt: skip
        model = copy.deepcopy(original)
        run(model)
        assert all(torch.equal(a, b) for a, b in zip(batches, kept, strict=True))
        folded = set()
        for m in block_mappings(model).mappings:
            folded |= {f"{m.previous}.weight", f"{m.previous}.bias", *(f"{n}.weight" for n in m.linears)}
        ref = original.state_dict()
        rest = [k for k in ref if k not in folded]
        assert "model.norm.weight" in rest and "model.layers.0.self_attn.o_proj.weight" in rest
        assert all(_bits_equal(ref[k], model.state_dict()[k]) for k in rest)
        assert not model.training


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _gemma():
    cfg = transformers.GemmaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, head_dim=16)  # fmt: skip
    model = transformers.GemmaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight.normal_()  # its output is (1 + weight) * normalized: no fold
    return model


@pytest.mark.parametrize(
    "case, match",
    [
        ("gpt2", "Llama-like decoder blocks"),
        ("gemma", "does not scale with its weight"),
        ("n_grid", "n_grid"),
        ("scales", "AWQ scales must be one of duo, activation, both"),
        ("not a linear", "not a Linear"),
        ("no batches", "non-empty"),
        ("float batch", "token ids"),
        ("attention only unquantized", "none of them"),
        ("alpha", "alpha"),
        ("nan weight", "NaN"),
    ],
)
def test_bad_input_is_refused_before_any_change(case, match):
    model = {"gpt2": _gpt2, "gemma": _gemma}.get(case, tiny_llama)()
    if case == "nan weight":
        with torch.no_grad():  # in the last block: the first would be folded before it is met
            model.model.layers[1].mlp.down_proj.weight[3, 7] = float("nan")
    linears = _quantized_linears(model, "nvfp4a16")
    batches = _batches(n=1)
    runs = {
        "n_grid": lambda: awq_model_(model, batches, linears, n_grid=0),
        "scales": lambda: awq_model_(model, batches, linears, scales="weights"),
        "not a linear": lambda: awq_model_(model, batches, {"model.layers.0.input_layernorm": "nvfp4a16"}),
        "no batches": lambda: awq_model_(model, [], linears),
        "float batch": lambda: smoothquant_model_(model, [torch.zeros(2, 8)]),
        "attention only unquantized": lambda: awq_model_(model, batches, {"lm_head": "nvfp4a16"}),
        "alpha": lambda: smoothquant_model_(model, batches, alpha=1.5),
    }
    before = _state(model)
    for run in [runs[case]] if case in runs else [lambda: awq_model_(model, batches, linears),
                                                  lambda: smoothquant_model_(model, batches)]:  # fmt: skip
        with pytest.raises(MixprecError, match=match):
            run()
    assert all(_bits_equal(before[k], v) for k, v in model.state_dict().items())
