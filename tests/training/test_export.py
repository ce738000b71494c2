"""export_for_inference: a converted, trained model back as a plain checkpoint that transformers loads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import IDS, tiny_llama
from torch import nn

import mixprec
from mixprec.errors import MixprecError
from mixprec.training.optim import AdamW

transformers = pytest.importorskip("transformers")


def _train(model, steps=2):
    opt = AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        model(input_ids=IDS, labels=IDS).loss.backward()
        opt.step()
        mixprec.training.advance_scaling_state(model)


@pytest.mark.parametrize("recipe,tie", [("bf16", True), ("bf16-amp", False), ("fp8-delayed", False)])
def test_hf_round_trip(tmp_path, recipe, tie):
    m = tiny_llama(tie)
    mixprec.convert_for_training(m, recipe)
    _train(m)
    out_dir = mixprec.export_for_inference(m, tmp_path / "ckpt", dtype="bf16")
    assert (out_dir / "config.json").exists() and (out_dir / "model.safetensors").exists()
    tensors = load_file(str(out_dir / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    record = json.loads((out_dir / "mixprec_export.json").read_text())
    assert record["schema_version"] == 1 and record["dtype"] == "bf16"
    if recipe.startswith("fp8"):  # the scaling state is not part of the checkpoint
        assert any(k.endswith("amax_history") for k in record["dropped_keys"])
        assert not any("amax" in k or "fp8_scale" in k for k in tensors)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.bfloat16)
    sd = m.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, sd[k].to(torch.bfloat16)), k
    assert not list(tmp_path.glob(".ckpt.tmp-*"))  # the temporary directory was renamed away


def test_fp32_export_refuses_existing_unless_forced(tmp_path):
    m = tiny_llama()
    mixprec.convert_for_training(m, "bf16")
    target = tmp_path / "out"
    mixprec.export_for_inference(m, target, dtype="fp32")
    with pytest.raises(MixprecError, match="exists"):
        mixprec.export_for_inference(m, target)
    mixprec.export_for_inference(m, target, dtype="fp32", force=True)
    tensors = load_file(str(target / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in tensors.values())
    with pytest.raises(MixprecError, match="dtype"):
        mixprec.export_for_inference(m, tmp_path / "x", dtype="fp8")


def test_plain_module_with_tied_weights(tmp_path):
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(64, 32)
            self.fc = nn.Linear(32, 32)
            self.head = nn.Linear(32, 64, bias=False)
            self.head.weight = self.emb.weight

    m = Tiny()
    mixprec.convert_for_training(m, "bf16")
    out = mixprec.export_for_inference(m, tmp_path / "plain")
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(m.state_dict())
    fresh = Tiny()
    fresh.load_state_dict({k: v.float() for k, v in tensors.items()})


def test_moe_with_grouped_fp8_experts(tmp_path):
    cfg = transformers.MixtralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    m = transformers.MixtralForCausalLM(cfg)
    mixprec.convert_for_training(m, "fp8-delayed")
    _train(m, steps=1)
    out = mixprec.export_for_inference(m, tmp_path / "moe")
    tensors = load_file(str(out / "model.safetensors"))
    assert not any("fp8_" in k or "amax" in k for k in tensors)  # per-expert scaling state dropped
    # transformers writes Mixtral in its original per-expert layout and fuses it again on load
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    sd = m.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, sd[k]), k


def test_fp32_export_writes_the_optimizers_master_weights(tmp_path):
    """bf16 parameters trained with mixprec AdamW: the true weights are the fp32 masters (the parameter
    is their bf16 rounding). An fp32 export with optimizer= writes the masters; without it, the bf16
    values widened; a bf16 export gives the parameter's bits either way."""
    m = tiny_llama()
    mixprec.convert_for_training(m, "bf16")
    opt = AdamW(m.parameters(), lr=1e-3)
    ids = torch.randint(0, m.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    name, p = "model.layers.0.mlp.up_proj.weight", m.get_submodule("model.layers.0.mlp.up_proj").weight
    master = opt.state[p]["master"]
    assert master.dtype == torch.float32 and not torch.equal(master, p.float())  # masters carry more bits
    mixprec.export_for_inference(m, tmp_path / "m32", dtype="fp32", optimizer=opt)
    mixprec.export_for_inference(m, tmp_path / "p32", dtype="fp32")
    mixprec.export_for_inference(m, tmp_path / "m16", dtype="bf16", optimizer=opt)
    from_master, from_param = (
        load_file(str(tmp_path / "m32/model.safetensors")),
        load_file(str(tmp_path / "p32/model.safetensors")),
    )
    assert torch.equal(from_master[name], master) and torch.equal(from_param[name], p.float())
    assert torch.equal(load_file(str(tmp_path / "m16/model.safetensors"))[name], p.detach())
    record = json.loads((tmp_path / "m32/mixprec_export.json").read_text())
    assert name in record["from_master_weights"]
    with pytest.raises(MixprecError, match="Optimizer"):
        mixprec.export_for_inference(m, tmp_path / "bad", dtype="fp32", optimizer="adam")
