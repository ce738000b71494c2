"""The module-selection vocabulary (mixprec.select): one meaning of a pattern for training and inference,
the FP8 kernels' multiple-of-16 rule, and the fused groups of sibling modules."""

from __future__ import annotations

import re

import pytest
from torch import nn

from mixprec.errors import MixprecError
from mixprec.gemm import FP8_DIM_MULTIPLE, fp8_gemm_dims_ok
from mixprec.inference.runtime.online import linear_targets
from mixprec.inference.schemes import DEFAULT_IGNORE, InferenceScheme, resolve_ignore, skip_reason
from mixprec.select import (
    check_pattern,
    fp8_dims_reason,
    fused_group_of,
    fused_groups,
    fused_shard_group,
    fused_shards,
    lineage,
    matches,
    selects,
    selects_any,
)
from mixprec.training.policy import Policy, Rule, decide

# (name, pattern, matches?) for patterns whose answer differs between re.match, re.search and
# re.fullmatch: "re:" is re.match (anchored at the start, open at the end), as in compressed-tensors.
REGEX_CASES = [
    ("model.layers.0.mlp.up_proj", r"re:layers\.0", False),  # search: True
    ("model.layers.0.mlp.up_proj", r"re:model\.layers\.0", True),  # fullmatch: False
    ("model.layers.0.mlp.gate_proj", r"re:.*\.gate", True),  # the trap: a prefix match
    ("model.layers.0.mlp.gate_proj", r"re:.*\.gate$", False),
    ("model.layers.0.mlp.gate", r"re:.*\.gate$", True),
    ("model.layers.1.mlp.down_proj", r"re:.*layers\.1\.mlp\.(up|down)_proj", True),
    ("model.layers.10.mlp.down_proj", r"re:.*layers\.1\.", False),
    ("lm_head", "re:lm_head", True),
    ("model.lm_head", "re:lm_head", False),  # search: True
]


@pytest.mark.parametrize("name,pattern,expected", REGEX_CASES)
def test_regex_patterns_match_from_the_start_of_the_name(name, pattern, expected):
    assert matches(name, pattern) is expected
    assert (re.match(pattern[3:], name) is not None) is expected


def test_regex_meaning_is_compressed_tensors_meaning():
    """Pinned against the reader of the checkpoints: compressed-tensors' match_name (vLLM does the same)."""
    match = pytest.importorskip("compressed_tensors.utils.match")
    differs = [(n, p) for n, p, _ in REGEX_CASES if match.match_name(n, p) != matches(n, p)]
    assert differs == []
    # exact names are a case of dotted name parts
    assert match.match_name("lm_head", "lm_head") and matches("lm_head", "lm_head")


def test_globs_and_dotted_name_parts():
    assert matches("model.layers.0.self_attn.q_proj", "*.q_proj")
    assert matches("model.layers.0.self_attn.q_proj", "model.layers.0.*")  # "*" crosses dots
    assert not matches("model.layers.0.self_attn.q_proj.lora", "*.q_proj")  # over the whole name
    assert not matches("model.layers.0.self_attn.Q_PROJ", "*.q_proj")  # case-sensitive
    assert matches("model.layers.0.mlp.down_proj", "down_proj")  # the name ends with the parts
    assert matches("model.layers.0.mlp.down_proj", "mlp.down_proj")
    assert matches("lm_head", "lm_head") and matches("model.lm_head", "lm_head")
    assert not matches("model.layers.0.mlp.down_proj", "down")  # whole parts only
    assert not matches("model.layers.0.mlp", "layers.0")  # an ancestor's name: matches, no
    assert not matches("x", "a.b.x")


def test_a_pattern_selects_a_module_and_everything_below_it():
    assert lineage("a.b.c") == ["a.b.c", "a.b", "a", ""] and lineage("") == [""]
    assert selects("model.layers.0.mlp.down_proj", "layers.0")
    assert selects("model.layers.0.mlp.down_proj", "model.layers.0")
    assert not selects("model.layers.10.mlp.down_proj", "layers.1")
    assert selects("model.layers.0.mlp.down_proj", "re:.*mlp$")  # via the ancestor model.layers.0.mlp
    assert not matches("model.layers.0.mlp.down_proj", "re:.*mlp$")
    assert selects("model.layers.3.mlp.down_proj", "*.layers.3")
    assert selects_any("model.norm", ["lm_head", "norm"]) and not selects_any("model.norm", [])


def test_bad_patterns_are_refused_with_what_they_are():
    assert check_pattern("re:.*q_proj") == "re:.*q_proj"
    for bad in ("", "  ", "re:(", None):
        with pytest.raises(MixprecError):
            check_pattern(bad)  # type: ignore[arg-type]
    with pytest.raises(MixprecError, match="--ignore pattern 're:\\(' is not a valid regular expression"):
        resolve_ignore(["re:("])
    with pytest.raises(MixprecError, match="policy rule name"):
        Rule("keep", name="re:[")
    with pytest.raises(MixprecError, match="policy rule name"):
        Rule("keep", name="")


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = nn.ModuleDict(
            {p: nn.Linear(32, 32) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
        )
        self.mlp = nn.ModuleDict({p: nn.Linear(32, 32) for p in ("gate_proj", "up_proj", "down_proj")})


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(_Layer() for _ in range(11))


PATTERNS = [
    "layers.1",
    "model.layers.0",
    "*.q_proj",
    "mlp.down_proj",
    r"re:.*layers\.1\.",
    r"re:model\.layers\.(2|3)\.self_attn",
    r"re:.*\.(q|k)_proj$",
    r"re:.*mlp$",
    "re:layers",  # from the start of the name: nothing
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_training_rules_and_inference_ignore_lists_select_the_same_modules(pattern):
    model = _Stack()
    kept = {d.name for d in decide(model, Policy(rules=(Rule("keep", name=pattern),))) if d.role == "linear" and d.action == "keep"}  # fmt: skip
    _, skipped = linear_targets(
        model, InferenceScheme.from_name("fp8-dynamic"), resolve_ignore([pattern], defaults=False)
    )
    assert kept == set(skipped)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert kept == {n for n in linears if selects(n, pattern)}
    assert (len(kept) == 0) is (pattern == "re:layers")


def test_default_ignore_list_keeps_its_meaning():
    """The defaults were written for re.search on the name alone; rewritten for re.match, they select
    the same modules, and now also the Linears inside a router module (Granite's router.layer)."""
    searched = (
        "lm_head",
        "re:(^|\\.)(embed_tokens|embed_in|embed_out|wte|wpe|word_embeddings|position_embeddings|token_type_embeddings|embeddings)(\\.|$)",
        "re:(^|\\.)[^.]*norm[^.]*(\\.|$)",
        "re:(^|\\.)(gate|router|shared_expert_gate)$",
    )

    def old(name: str) -> bool:
        for p in searched:
            if p.startswith("re:"):
                if re.search(p[3:], name):
                    return True
            elif p in name.split("."):
                return True
        return False

    names = [
        "lm_head", "model.lm_head", "model.embed_tokens", "transformer.wte", "transformer.wpe",
        "bert.embeddings.word_embeddings", "bert.embeddings.LayerNorm", "gpt_neox.embed_in", "embed_out",
        "model.norm", "model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
        "model.layers.0.self_attn.q_norm", "model.layers.0.mlp.gate", "model.layers.0.mlp.gate_proj",
        "model.layers.0.block_sparse_moe.gate", "model.layers.0.mlp.router", "model.layers.0.mlp.router.proj",
        "model.layers.0.mlp.shared_expert_gate", "model.layers.0.mlp.shared_expert.gate_proj",
        "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.experts.3.w1", "model.enormous.proj",
        "classifier", "model.layers.0.mlp.down_proj", "gatekeeper", "model.gate.x",
    ]  # fmt: skip
    differ = {n for n in names if selects_any(n, DEFAULT_IGNORE) != old(n)}
    assert differ == {"model.layers.0.mlp.router.proj", "model.gate.x"}
    assert all(selects_any(n, DEFAULT_IGNORE) for n in differ)
    assert not selects_any("model.layers.0.mlp.gate_proj", DEFAULT_IGNORE)


def test_the_multiple_of_16_rule_is_the_gemm_seams():
    assert FP8_DIM_MULTIPLE == 16
    assert fp8_gemm_dims_ok(32, 48) and not fp8_gemm_dims_ok(32, 24) and not fp8_gemm_dims_ok(24, 32)
    assert fp8_dims_reason(32, 64) is None
    why = fp8_dims_reason(24, 32)
    assert "not multiples of 16" in why and "(32, 24)" in why
    assert fp8_dims_reason(48, 32, multiple=32) is not None
    # the training policy and the inference selection give the same reason for the same Linear
    m = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 24))
    policy_reason = {d.name: d.reason for d in decide(m, Policy())}["1"]
    assert policy_reason == why.replace("(32, 24)", "(64, 24)") == skip_reason("1", 24, 64, ())
    assert skip_reason("0", 64, 32, ()) is None and skip_reason("0", 64, 32, ["0"]) == "ignored by pattern"


def test_fused_groups():
    attn = "model.layers.0.self_attn"
    assert {fused_group_of(f"{attn}.{p}") for p in ("q_proj", "k_proj", "v_proj")} == {f"{attn}.qkv_proj"}
    assert fused_group_of(f"{attn}.o_proj") == f"{attn}.o_proj"  # a group of its own
    assert fused_group_of("model.layers.1.self_attn.q_proj") != fused_group_of(f"{attn}.q_proj")
    mlp = "model.layers.0.mlp"
    assert fused_group_of(f"{mlp}.gate_proj") == fused_group_of(f"{mlp}.up_proj") == f"{mlp}.gate_up_proj"
    assert fused_group_of(f"{mlp}.down_proj") == f"{mlp}.down_proj"
    bert = "bert.encoder.layer.0.attention.self"
    assert {fused_group_of(f"{bert}.{p}") for p in ("query", "key", "value")} == {f"{bert}.qkv_proj"}
    # every projection of every expert of one MoE block: one group (one fused-experts layer)
    moe = "model.layers.1.block_sparse_moe.experts"
    experts = [f"{moe}.{e}.{w}" for e in range(4) for w in ("w1", "w2", "w3")]
    assert {fused_group_of(n) for n in experts} == {moe}
    assert fused_group_of("model.layers.0.mlp.experts.0.gate_proj") == "model.layers.0.mlp.experts"
    # a live model's unfused experts (runtime/experts.py): one group per block; gate and up of one expert fuse
    live = "model.layers.0.mlp.experts.projections"
    parts = [f"{live}.gate_up_proj.{e}.{p}" for e in range(4) for p in (0, 1)] + [f"{live}.down_proj.3.0"]
    assert {fused_group_of(n) for n in parts} == {"model.layers.0.mlp.experts"}
    assert fused_shards(reversed(parts[:4])) == {
        f"{live}.gate_up_proj.0": parts[:2],
        f"{live}.gate_up_proj.1": parts[2:4],
    }
    assert fused_shard_group(f"{live}.down_proj.3.0") is None
    assert fused_group_of("model.layers.0.mlp.experts") == "model.layers.0.mlp.experts"  # fused 3-D
    assert fused_group_of("model.layers.0.mlp.shared_experts.0.up_proj") == "model.layers.0.mlp.shared_experts.0.gate_up_proj"  # fmt: skip
    # inside a fused group, the shards of one GEMM share a global scale
    assert fused_shard_group(f"{moe}.2.w1") == fused_shard_group(f"{moe}.2.w3") == f"{moe}.2.w13"
    assert fused_shard_group(f"{moe}.2.w2") is None and fused_shard_group("q_proj") == "qkv_proj"
    names = [f"{attn}.q_proj", f"{attn}.o_proj", f"{attn}.k_proj", *experts[:2]]
    assert fused_groups(names) == {
        f"{attn}.qkv_proj": [f"{attn}.q_proj", f"{attn}.k_proj"],
        f"{attn}.o_proj": [f"{attn}.o_proj"],
        moe: experts[:2],
    }
