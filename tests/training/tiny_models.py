"""Tiny transformers models built from configs (no download), shared by the training tests."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


def tiny_llama(tie: bool = False, layers: int = 2):
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def tiny_mixtral():
    cfg = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg)


def tiny_qwen_moe():
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2MoeForCausalLM(cfg)


# token ids shared by the forward checks
IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
