"""The built-in small reference model, and loading a local Hugging Face causal LM.

The reference model is a Llama-style decoder (RMSNorm, rotary attention, SwiGLU MLP) built from a
transformers LlamaConfig with tiny dimensions: every Linear has in/out features that are multiples of
16 (and of 128 for the hidden size) so every FP8 recipe, blockwise included, converts it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mixprec.errors import MixprecError


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


def _transformers():
    try:
        import transformers
    except ImportError:
        raise MixprecError(
            "the reference model and --model need the 'hf' extra: pip install 'mixprec[hf]'"
        ) from None
    return transformers


def build_reference_model(
    vocab_size: int, seed: int = 0, config: ReferenceModelConfig | None = None
) -> torch.nn.Module:
    """A freshly initialized fp32 LlamaForCausalLM; the same (vocab_size, seed, config) gives the same weights."""
    tf = _transformers()
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


def check_model_dir(directory: str | os.PathLike) -> Path:
    """Raise MixprecError unless `directory` holds a config.json and safetensors weights."""
    d = Path(directory)
    if not d.is_dir():
        raise MixprecError(f"model directory {d} does not exist")
    if not (d / "config.json").is_file():
        raise MixprecError(f"model directory {d} has no config.json")
    if not any(d.glob("*.safetensors")):
        found = sorted(p.name for p in d.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        extra = f" (found {', '.join(found)}: pickled weights are not read)" if found else ""
        raise MixprecError(f"model directory {d} has no .safetensors weights{extra}")
    return d


def load_model_dir(directory: str | os.PathLike) -> torch.nn.Module:
    """A local Hugging Face causal LM, weights read with safetensors only, in fp32."""
    d = check_model_dir(directory)
    tf = _transformers()
    try:
        model = tf.AutoModelForCausalLM.from_pretrained(
            str(d), use_safetensors=True, local_files_only=True, dtype=torch.float32
        )
    except (OSError, ValueError, KeyError) as exc:
        raise MixprecError(f"cannot load a causal LM from {d}: {exc}") from None
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    return model.float()


def model_vocab_size(model: torch.nn.Module) -> int:
    return int(model.get_input_embeddings().weight.shape[0])


def lm_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a causal LM on a batch of blocks, in fp32."""
    logits = model(input_ids=input_ids).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1)
    )


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "ReferenceModelConfig",
    "build_reference_model",
    "check_model_dir",
    "lm_loss",
    "load_model_dir",
    "model_vocab_size",
    "parameter_count",
]
