"""Rotation (mixprec.inference.algorithms.rotation): the matrices are orthogonal and deterministic, a
rotated fp32 model computes the same logits (tied, non-power-of-two, grouped-query, biased and q/k-normed
variants), an outlier channel is spread over q_proj's NVFP4 blocks, models without the invariance are
refused untouched, and a rotated model survives save_pretrained / from_pretrained."""

from __future__ import annotations

import json

import pytest
import torch
from inference_helpers import VOCAB, rel_err, tiny_llama
from torch import nn

from mixprec.errors import MixprecError
from mixprec.inference.algorithms.rotation import orthogonal_matrix, rotate_model_

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("single_thread")

VARIANTS = {
    "untied": {},
    "tied": {"tie_word_embeddings": True},
    # hidden 96 = 32 * 3 and head_dim 24 = 8 * 3: Kronecker matrices for R1 and R2
    "hidden 96": {"hidden_size": 96, "head_dim": 24, "intermediate_size": 160},
    "gqa 4:1": {"num_key_value_heads": 1},
    "mha": {"num_key_value_heads": 4},
    # biases on q/k/v/o and gate/up/down: o's and down's are rotated by R1, v's by R2
    "biases": {"attention_bias": True, "mlp_bias": True},
}


def _with_norm_weights(model, seed: int = 1):
    """Non-trivial RMSNorm weights and biases (a fresh model has norms of ones and zero biases: folding
    or rotating them would be invisible)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _ids(seed: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(model, ids) -> torch.Tensor:
    return model(ids).logits.detach()


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _sylvester_reference(n: int) -> torch.Tensor:
    """H[i, j] = (-1)^popcount(i & j) / sqrt(n): the closed form of Sylvester's construction."""
    i = torch.arange(n)
    parity = torch.tensor([[bin(int(a) & int(b)).count("1") % 2 for b in i] for a in i], dtype=torch.float64)
    return (1 - 2 * parity) / n**0.5


@pytest.mark.parametrize("n", [1, 2, 8, 64, 128, 9, 24, 96, 576])
def test_orthogonal_to_fp64_rounding(n):
    q = orthogonal_matrix(n, seed=3)
    assert q.dtype == torch.float64 and q.shape == (n, n)
    eye = torch.eye(n, dtype=torch.float64)
    assert float((q @ q.T - eye).abs().max()) < 1e-13
    assert float((q.T @ q - eye).abs().max()) < 1e-13


@pytest.mark.parametrize("n", [2, 16, 64])
def test_power_of_two_is_signed_sylvester_hadamard(n):
    q = orthogonal_matrix(n, seed=5)
    h = _sylvester_reference(n)
    signs = (q[:, 0] / h[:, 0]).round()  # diag(signs) @ H: row i is H's row i times its sign
    assert set(signs.tolist()) <= {-1.0, 1.0}
    assert torch.equal(q, signs[:, None] * h)


def test_matrices_deterministic_from_seed():
    for n in (64, 576):
        assert torch.equal(orthogonal_matrix(n, seed=11), orthogonal_matrix(n, seed=11))
        assert not torch.equal(orthogonal_matrix(n, seed=11), orthogonal_matrix(n, seed=12))


def test_bad_size_refused():
    for n in (0, -4):
        with pytest.raises(MixprecError, match="positive size"):
            orthogonal_matrix(n)


@pytest.mark.parametrize("r2", [True, False], ids=["r1+r2", "r1"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fp32_logits_unchanged(variant, r2):
    model = _with_norm_weights(tiny_llama(**VARIANTS[variant]))
    ids = _ids()
    before = _logits(model, ids)
    weights_before = _state(model)
    record = rotate_model_(model, seed=0, r2=r2)
    assert rel_err(_logits(model, ids), before) < 1e-5
    # the rotation did happen: every weight the stream touches changed, the norms are 1
    after = _state(model)
    assert not torch.allclose(after["model.embed_tokens.weight"], weights_before["model.embed_tokens.weight"])
    assert not torch.allclose(after["lm_head.weight"], weights_before["lm_head.weight"])
    assert all(torch.equal(v, torch.ones_like(v)) for k, v in after.items() if "norm" in k)
    tied = variant == "tied"
    assert record["untied_lm_head"] is tied
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.config.tie_word_embeddings is False
    assert record["r1_size"] == model.config.hidden_size
    assert (record["r2_size"] is None) is (not r2) and (record["matrices"]["r2"] is None) is (not r2)


def test_r2_rotates_value_heads():
    """R2 changes v_proj and o_proj beyond R1 (and R1 alone leaves q_proj the same either way)."""
    a, b = tiny_llama(), tiny_llama()
    rotate_model_(a, r2=True)
    rotate_model_(b, r2=False)
    attn_a, attn_b = a.model.layers[0].self_attn, b.model.layers[0].self_attn
    assert torch.equal(attn_a.q_proj.weight, attn_b.q_proj.weight)
    assert not torch.allclose(attn_a.v_proj.weight, attn_b.v_proj.weight)
    assert not torch.allclose(attn_a.o_proj.weight, attn_b.o_proj.weight)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_other_rmsnorm_families_logits_unchanged(family):
    """Qwen2: biases on q/k/v (v's is rotated by R2); Qwen3: q_norm / k_norm on each head of q and k."""
    cls, cfg = {
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
        "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
    }[family]
    torch.manual_seed(0)
    model = cls(cfg(vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=64)).eval()  # fmt: skip
    _with_norm_weights(model)
    ids = _ids()
    before = _logits(model, ids)
    rotate_model_(model)
    assert rel_err(_logits(model, ids), before) < 1e-5


def test_rotation_deterministic_from_seed():
    a, b, c = tiny_llama(), tiny_llama(), tiny_llama()
    rotate_model_(a, seed=4)
    rotate_model_(b, seed=4)
    rotate_model_(c, seed=5)
    sa, sb, sc = _state(a), _state(b), _state(c)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])


def _worst_block_ratio_per_row(weight: torch.Tensor) -> torch.Tensor:
    """Per row, the largest max|w| / rms(w) over its 16-element NVFP4 blocks (4 when one value holds
    all of a block's energy, about 2 for Gaussian values)."""
    blocks = weight.detach().double().reshape(weight.shape[0], -1, 16)
    return (blocks.abs().amax(-1) / blocks.pow(2).mean(-1).sqrt()).amax(-1)


def test_outlier_channel_spread_over_nvfp4_blocks():
    model = tiny_llama()
    with torch.no_grad():  # one input channel 50x larger, as the norm weights of real models have
        model.model.layers[0].input_layernorm.weight[5] = 50.0
    layer = model.model.layers[0]
    before = _worst_block_ratio_per_row(layer.self_attn.q_proj.weight * layer.input_layernorm.weight)
    rotate_model_(model)
    after = _worst_block_ratio_per_row(layer.self_attn.q_proj.weight)
    assert float(before.median()) > 3.8  # the outlier's block in every row
    assert float(after.median()) < 2.0


def test_bf16_model_rotates_within_bf16_rounding():
    model = _with_norm_weights(tiny_llama())
    ids = _ids()
    reference = _logits(model, ids)
    model.bfloat16()
    plain = rel_err(_logits(model, ids), reference)
    rotate_model_(model)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    # one more bf16 rounding of each weight: the same order as the bf16 cast's own error
    assert rel_err(_logits(model, ids), reference) < 4 * plain + 1e-3


class _OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + w); rotation would need w folded as 1 + w."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)


def _replace_norm_with_layernorm(model):
    model.model.layers[1].post_attention_layernorm = nn.LayerNorm(model.config.hidden_size)


def _replace_final_norm_with_offset(model):
    model.model.norm = _OffsetRMSNorm(model.config.hidden_size)


def _add_bias_to_norm(model):
    norm = model.model.layers[0].input_layernorm
    norm.bias = nn.Parameter(torch.zeros(model.config.hidden_size))


def _extra_layer_norm(model):
    model.model.layers[1].pre_feedforward_layernorm = type(model.model.norm)(model.config.hidden_size)


def _drop_o_proj(model):
    del model.model.layers[1].self_attn.o_proj


REFUSALS = {
    "layernorm": (_replace_norm_with_layernorm, "LayerNorm"),
    "norm with weight offset": (_replace_final_norm_with_offset, "does not compute weight"),
    "norm with a bias": (_add_bias_to_norm, "has a bias"),
    "extra norm in a layer": (_extra_layer_norm, "pre_feedforward_layernorm"),
    "no o_proj": (_drop_o_proj, "o_proj is missing"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refused_without_change(case):
    break_model, message = REFUSALS[case]
    model = tiny_llama(tie_word_embeddings=True)
    break_model(model)
    before = _state(model)
    with pytest.raises(MixprecError, match=message):
        rotate_model_(model)
    after = _state(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.config.tie_word_embeddings


def test_gpt2_refused_without_change():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)).eval()  # fmt: skip
    before = _state(model)
    with pytest.raises(MixprecError, match="block structure not recognised"):
        rotate_model_(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_save_and_reload_keeps_logits(tmp_path):
    model = _with_norm_weights(tiny_llama(tie_word_embeddings=True))
    ids = _ids()
    reference = _logits(model, ids)
    rotate_model_(model)
    rotated = _logits(model, ids)
    model.save_pretrained(tmp_path)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.tie_word_embeddings is False
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
    assert reloaded.lm_head.weight is not reloaded.model.embed_tokens.weight
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)  # the untied head was saved
    assert torch.equal(_logits(reloaded, ids), rotated)
    assert rel_err(rotated, reference) < 1e-5


def test_config_saying_tied_is_cleared_even_when_tensors_are_separate(tmp_path):
    """A head with its own tensor under a config that says tied: an engine that follows the config (vLLM
    takes the embedding as the head when tie_word_embeddings is true) would serve the rotated embedding
    as the head, unless the saved config says untied."""
    model = _with_norm_weights(tiny_llama(tie_word_embeddings=True))
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    ids = _ids()
    reference = _logits(model, ids)
    record = rotate_model_(model)
    assert record["untied_lm_head"] is False and model.config.tie_word_embeddings is False
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert rel_err(_logits(reloaded, ids), reference) < 1e-5
