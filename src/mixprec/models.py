"""The built-in small reference model, and the language-model loss `mixprec compare` trains with.

The reference model is a Llama-style decoder (RMSNorm, rotary attention, SwiGLU MLP) built from a
transformers LlamaConfig with tiny dimensions: every Linear has in/out features that are multiples of
16 (and of 128 for the hidden size) so every FP8 recipe, blockwise included, converts it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from mixprec.hf import transformers_module


@dataclass(frozen=True)
class ReferenceModelConfig:
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 512

    def to_dict(self) -> dict:
        return asdict(self)


def build_reference_model(
    vocab_size: int, seed: int = 0, config: ReferenceModelConfig | None = None
) -> torch.nn.Module:
    """A freshly initialized fp32 LlamaForCausalLM; the same (vocab_size, seed, config) gives the same weights."""
    tf = transformers_module("the reference model")
    cfg = config or ReferenceModelConfig()
    llama_cfg = tf.LlamaConfig(
        vocab_size=int(vocab_size),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        use_cache=False,
    )
    llama_cfg._attn_implementation = "sdpa"
    # fork_rng: building the model must not move the caller's global RNG
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.LlamaForCausalLM(llama_cfg)
    return model.float()


def lm_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a causal LM on a batch of blocks, in fp32."""
    logits = model(input_ids=input_ids).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1)
    )


__all__ = ["ReferenceModelConfig", "build_reference_model", "lm_loss"]
