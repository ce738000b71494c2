"""The default precision policy and its rules, on a small Llama, small MoE models and plain modules."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_llama, tiny_mixtral, tiny_qwen_moe
from torch import nn

from mixprec.errors import MixprecError
from mixprec.training.policy import Policy, Rule, decide, find_heads, find_routers, is_norm


def by_name(model, policy=None):
    return {d.name: d for d in decide(model, policy or Policy())}


@pytest.mark.parametrize("tie", [False, True])
def test_llama_default_policy(tie):
    d = by_name(tiny_llama(tie))
    assert d["model.embed_tokens"].action == "keep" and d["model.embed_tokens"].role == "embedding"
    assert d["model.norm"].role == "norm" and d["model.norm"].action == "keep"
    assert d["model.layers.0.input_layernorm"].action == "keep"
    assert d["lm_head"].role == "head" and d["lm_head"].action == "keep"
    if tie:
        assert "tied" in d["lm_head"].reason
    for proj in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        assert d[f"model.layers.1.{proj}"].action == "convert"
    # every module is listed
    assert len(d) == len(list(tiny_llama(tie).named_modules()))


def test_mixtral_router_by_role_and_fused_experts():
    m = tiny_mixtral()
    d = by_name(m)
    gate = d["model.layers.0.mlp.gate"]
    assert gate.role == "router" and gate.action == "keep" and "4 experts" in gate.reason
    experts = d["model.layers.0.mlp.experts"]
    assert experts.role == "experts" and experts.action == "convert"
    assert experts.extra["fused"]["gate_up_proj"] == (4, 128, 64)


def test_qwen_moe_router_shared_expert_and_dims():
    d = by_name(tiny_qwen_moe())
    assert d["model.layers.0.mlp.gate"].role == "router"
    # the shared expert's gate_proj is a dense MLP projection, not a router
    assert d["model.layers.0.mlp.shared_expert.gate_proj"].action == "convert"
    sg = d["model.layers.0.mlp.shared_expert_gate"]
    assert sg.action == "keep" and "not multiples of 16" in sg.reason


class PlainMoE(nn.Module):
    """Old-style MoE: a ModuleList of expert MLPs and a Linear router named `gate`."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(32, 8, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(8)
        )


class PlainLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(96, 32)
        self.mlp = nn.ModuleDict({"gate_proj": nn.Linear(32, 64), "down_proj": nn.Linear(64, 32)})
        self.moe = PlainMoE()
        self.ln = nn.LayerNorm(32)
        self.odd = nn.Linear(32, 24)
        self.head = nn.Linear(32, 96)
        self.sm = nn.Softmax(-1)


def test_plain_module_roles():
    d = by_name(PlainLM())
    assert d["moe.gate"].role == "router"
    assert d["mlp.gate_proj"].action == "convert"  # not a router: its parent holds no experts
    assert d["moe.experts.3.0"].action == "convert"
    assert d["head"].role == "head"  # projects to the vocabulary of `tok`
    assert d["ln"].role == "norm" and d["sm"].role == "softmax"
    assert d["odd"].action == "keep" and "24" in d["odd"].reason
    assert d[""].role == "container"


def test_head_tied_by_identity():
    m = PlainLM()
    m.out = nn.Linear(32, 96)
    m.out.weight = m.tok.weight
    assert "tied" in find_heads(m)["out"]


def test_norm_lookalike_by_structure():
    class ScaleOnly(nn.Module):  # no "Norm" in the name: found by 1-D params + epsilon
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(8))
            self.variance_epsilon = 1e-6

    assert is_norm(ScaleOnly())
    assert not is_norm(nn.Linear(8, 8))


def test_rules_override_first_match_wins():
    policy = Policy(
        rules=(
            Rule("keep", name="model.layers.0.*"),
            Rule("convert", name="lm_head"),
            Rule("fp32", module_type="LlamaRMSNorm"),
            Rule("keep", name="re:.*layers\\.1\\.mlp\\.(up|down)_proj"),
            Rule("convert", name="model.norm"),  # never reached: the type rule above matched first
        )
    )
    d = by_name(tiny_llama(), policy)
    assert d["model.layers.0.mlp.up_proj"].action == "keep"
    assert "model.layers.0.*" in d["model.layers.0.mlp.up_proj"].reason
    assert d["lm_head"].action == "convert"
    assert d["model.norm"].action == "fp32"
    assert d["model.layers.1.mlp.up_proj"].action == "keep"
    assert d["model.layers.1.mlp.gate_proj"].action == "convert"


def test_rule_cannot_force_fp8_on_norm_or_bad_dims():
    m = PlainLM()
    d = by_name(m, Policy(rules=(Rule("convert", module_type=nn.LayerNorm), Rule("convert", name="odd"))))
    assert d["ln"].action == "keep" and "no FP8 path" in d["ln"].reason
    assert d["odd"].action == "keep" and "ignored" in d["odd"].reason


def test_from_rules_and_routers_helper():
    p = Policy.from_rules({"*.q_proj": "keep"})
    assert p.rules[0].name == "*.q_proj"
    assert "model.layers.0.mlp.gate" in find_routers(tiny_mixtral())


def test_bad_rules():
    with pytest.raises(MixprecError):
        Rule("fp8", name="x")
    with pytest.raises(MixprecError):
        Rule("keep")
    with pytest.raises(MixprecError):
        Rule("keep", name="re:(")
    with pytest.raises(MixprecError):
        Policy(rules=("x",))


def test_rules_apply_to_the_subtree_of_a_matched_module():
    d = by_name(
        tiny_llama(),
        Policy(rules=(Rule("keep", name="model.layers.0"), Rule("fp32", module_type="LlamaAttention"))),
    )
    assert (
        d["model.layers.0.mlp.up_proj"].action == "keep"
        and "matched model.layers.0" in d["model.layers.0.mlp.up_proj"].reason
    )
    assert d["model.layers.0.self_attn.q_proj"].action == "keep"  # the first rule wins
    assert d["model.layers.1.self_attn"].action == "fp32"  # the container becomes an fp32 island
    assert d["model.layers.1.self_attn.q_proj"].action == "fp32"
    assert d["model.layers.1.mlp.up_proj"].action == "convert"
