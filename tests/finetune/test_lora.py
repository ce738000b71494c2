"""LoRA over quantized bases with peft (issue 29): the adapters' gradients equal those of a plain fp32 model
holding the dequantized weights (fake-quantizing inputs straight-through, tests/inference's ReferenceLinear)
with the same adapters; the adapter saves in peft's format and loads with plain peft on the original model;
a merge re-quantizes, within the scheme's own rounding error."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from inference.inference_helpers import ReferenceLinear, rel_err, tiny_llama
from mixprec.errors import MixprecError
from mixprec.inference.runtime.linear import QuantizedLinear
from mixprec.inference.runtime.online import apply_scheme_
from mixprec.training.gradient_flow import check_gradient_flow

peft = pytest.importorskip("peft")
from mixprec.finetune.lora import add_lora, load_lora, lora_layer_class, merge_lora  # noqa: E402

IDS = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)


def _quantized(scheme: str) -> torch.nn.Module:
    model = tiny_llama()
    calib = [torch.randint(0, 320, (1, 16), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    apply_scheme_(model, scheme, calib_data=calib if scheme in ("fp8-static", "nvfp4") else None)
    return model


def _with_reference_bases(peft_model) -> torch.nn.Module:
    """A copy whose quantized bases are ReferenceLinears (plain fp32 GEMMs over the dequantized weights)."""
    ref = copy.deepcopy(peft_model)
    for name, m in list(ref.named_modules()):
        if isinstance(m, QuantizedLinear):
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, ReferenceLinear(m))
    return ref


def _lora_grads_and_input_grad(model, weights: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    held = {}

    def trainable(module, args, out):
        held["h"] = out.detach().requires_grad_()
        return held["h"]

    handle = model.get_input_embeddings().register_forward_hook(trainable)
    try:
        model.zero_grad(set_to_none=True)
        (model(IDS).logits.float() * weights).sum().backward()
    finally:
        handle.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}
    return grads, held["h"].grad


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "nvfp4a16", "mxfp4a16", "nvfp4", "fp8-static"])
def test_lora_gradients_equal_the_dequantized_reference(scheme):
    torch.manual_seed(0)
    peft_model = add_lora(_quantized(scheme), **LORA)
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, lora_layer_class())
    assert layer.lora_A["default"].weight.dtype == torch.float32  # the compute dtype, not the payload's
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)  # the base is frozen
    ref = _with_reference_bases(peft_model)
    weights = torch.randn(2, 16, 320, generator=torch.Generator().manual_seed(2))
    grads, h_grad = _lora_grads_and_input_grad(peft_model, weights)
    ref_grads, ref_h_grad = _lora_grads_and_input_grad(ref, weights)
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 3 * 2  # A and B, 3 targets, 2 layers
    worst = max(rel_err(grads[n], ref_grads[n]) for n in grads)
    assert all(float(g.abs().max()) > 0 for g in grads.values())
    assert worst < 1e-4, f"{scheme}: LoRA gradient relative error {worst:.2e}"
    assert float(h_grad.abs().max()) > 0
    assert rel_err(h_grad, ref_h_grad) < 1e-4
    report = check_gradient_flow(peft_model, IDS)
    assert report.ok, report.message()


def test_adapter_loads_with_plain_peft_on_the_original_and_with_load_lora_on_the_quantized(tmp_path):
    original = tiny_llama()
    quantized = copy.deepcopy(original)
    apply_scheme_(quantized, "fp8-dynamic")
    peft_model = add_lora(quantized, **LORA)
    with torch.no_grad():
        before = peft_model(IDS).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert "mixprec" not in json.dumps(saved).lower() and "custom" not in json.dumps(saved).lower()
    lora = {n: p.detach() for n, p in peft_model.named_parameters() if "lora_" in n}
    for dtype in (torch.float32, torch.bfloat16):
        plain = peft.PeftModel.from_pretrained(copy.deepcopy(original).to(dtype), str(tmp_path / "adapter"))
        loaded = {n: p.detach() for n, p in plain.named_parameters() if "lora_" in n}
        assert loaded.keys() == lora.keys()
        # peft keeps adapters in fp32 over a bf16 model (autocast_adapter_dtype): the same values either way
        assert all(torch.equal(loaded[n].float(), lora[n]) for n in lora)
    reloaded = load_lora(_fresh_fp8(original), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, before)


def _fresh_fp8(original):
    model = copy.deepcopy(original)
    apply_scheme_(model, "fp8-dynamic")
    return model


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "nvfp4a16"])
def test_merge_requantizes_within_the_schemes_rounding_error(scheme):
    """The merge rounds the merged weight once more: its output error against the unmerged model is of
    the size of the scheme's own error against the unquantized model (here ≤ 1.5x), and the merged model
    holds quantized Linears only (so save_quantized writes it)."""
    original = tiny_llama()
    quantized = copy.deepcopy(original)
    apply_scheme_(quantized, scheme)
    peft_model = add_lora(quantized, **LORA)
    with torch.no_grad():  # a trained-sized update (B·A a few % of W), not init's large random one
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.mul_(0.01)
        unmerged = peft_model(IDS).logits
        scheme_err = rel_err(quantized(IDS).logits, original(IDS).logits)
        merged_model = merge_lora(peft_model)
        merged = merged_model(IDS).logits
        assert torch.equal(peft_model(IDS).logits, unmerged)  # the input is left as it was
    assert not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in merged_model.modules())
    assert sum(isinstance(m, QuantizedLinear) for m in merged_model.modules()) == 14
    if scheme == "nvfp4a16":  # q and v merged, k not: the fused q/k/v still share one global scale
        attn = merged_model.model.layers[1].self_attn
        assert len({float(getattr(attn, p).weight_global_scale) for p in ("q_proj", "k_proj", "v_proj")}) == 1
    merge_err = rel_err(merged, unmerged)
    print(f"{scheme}: merge relative logits error {merge_err:.2e} (scheme vs original {scheme_err:.2e})")
    assert 0 < merge_err <= 1.5 * scheme_err


def test_merge_into_another_scheme_rounds_every_layer_into_it():
    original = tiny_llama()
    quantized = copy.deepcopy(original)
    apply_scheme_(quantized, "fp8-dynamic")
    peft_model = add_lora(quantized, **LORA)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.mul_(0.01)
        unmerged = peft_model(IDS).logits
        nvfp4 = copy.deepcopy(original)
        apply_scheme_(nvfp4, "nvfp4a16")
        scheme_err = rel_err(nvfp4(IDS).logits, original(IDS).logits)
        merged = merge_lora(peft_model, scheme="nvfp4a16")
        merge_err = rel_err(merged(IDS).logits, unmerged)
    layers = [m for m in merged.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 14 and {m.scheme.name for m in layers} == {"nvfp4a16"}
    attn = merged.model.layers[0].self_attn  # q/k/v share one global scale (fused in serving)
    assert len({float(getattr(attn, p).weight_global_scale) for p in ("q_proj", "k_proj", "v_proj")}) == 1
    assert 0 < merge_err <= 1.5 * scheme_err
    with pytest.raises(MixprecError, match="calibration"):
        merge_lora(peft_model, scheme="fp8-static")


def test_layer_merge_and_unmerge_restore_the_exact_base():
    peft_model = add_lora(_quantized("nvfp4a16"), **LORA)
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    before = {k: t.clone() for k, t in layer.base_layer._buffers.items() if t is not None}
    with torch.no_grad():
        unmerged = peft_model(IDS).logits
        layer.merge()
        assert not torch.equal(layer.base_layer.weight_packed, before["weight_packed"])
        assert rel_err(peft_model(IDS).logits, unmerged) < 0.2
        layer.unmerge()
        assert all(torch.equal(layer.base_layer._buffers[k], t) for k, t in before.items())
        assert torch.equal(peft_model(IDS).logits, unmerged)


def test_targets_matching_nothing_are_refused_and_plain_models_take_peft_s_path():
    with pytest.raises(MixprecError, match=r"match no Linear.*q_proj") as err:
        add_lora(_quantized("fp8-dynamic"), r=4, target_modules=["qkv_proj"])
    assert "\n" not in str(err.value)
    plain = add_lora(tiny_llama(), r=4, target_modules="all-linear")
    assert type(plain.base_model.model.model.layers[0].mlp.up_proj) is peft.tuners.lora.Linear
    config = peft.LoraConfig(r=4, target_modules="all-linear")
    add_lora(_quantized("mxfp4a16"), config)
    assert (
        config.target_modules == "all-linear" and not config._custom_modules
    )  # the caller's config untouched


def test_without_peft_the_helpers_name_the_extra(monkeypatch):
    import sys

    from mixprec.finetune import lora

    monkeypatch.setitem(sys.modules, "peft", None)
    for call in (lambda: lora.lora_config(r=4), lambda: lora.add_lora(tiny_llama(), r=4)):
        with pytest.raises(MixprecError, match=r"pip install 'mixprec\[finetune\]'"):
            call()
