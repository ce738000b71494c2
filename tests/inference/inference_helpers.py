"""Helpers for the FP8 inference tests: tiny models built from configs (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

CALIB_TEXTS = [
    f"The quick brown fox number {i} jumps over the lazy dog and counts to {i * 7} before it sleeps."
    for i in range(120)
]
VOCAB = 320


def tiny_llama(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        # q/k/v out_features [256, 128, 128]: multiples of 128, so vLLM takes them block-quantized
        # (schemes.serving_reasons), and still grouped-query attention
        head_dim=64,
        max_position_embeddings=128,
    )
    kw.update(overrides)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()


def save_with_tokenizer(model, directory: Path, **save_kw) -> Path:
    from mixprec.data import save_tokenizer, train_bpe_tokenizer

    model.save_pretrained(directory, **save_kw)
    save_tokenizer(train_bpe_tokenizer(CALIB_TEXTS, vocab_size=VOCAB), directory)
    return directory


def load_original(directory: Path):
    return transformers.LlamaForCausalLM.from_pretrained(directory).eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory's safetensors shards, by name."""
    from safetensors import safe_open

    out = {}
    for shard in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - safe_open has no __iter__
    return out


def quantized_state(model, layer_class: type, buffers: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Every payload and scale buffer of the `layer_class` layers of `model`, as stored (absent ones left
    out), cloned: what a cast, a device move or a state_dict round trip must leave bit for bit."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, layer_class):
            for k in buffers:
                t = getattr(m, k)
                if t is not None:
                    out[f"{name}.{k}"] = t.detach().clone()
    return out


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same names, dtypes and raw bytes (bit-identity whatever the dtype)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a
    )


# the casts a quantized model must survive: payloads and scales keep their bits, the output dtype follows
CASTS = {
    ".to(torch.bfloat16)": (lambda m: m.to(torch.bfloat16), torch.bfloat16),
    ".bfloat16()": (lambda m: m.bfloat16(), torch.bfloat16),
    ".half()": (lambda m: m.half(), torch.float16),
    ".to(dtype=torch.float16)": (lambda m: m.to(dtype=torch.float16), torch.float16),
    ".float()": (lambda m: m.bfloat16().float(), torch.float32),
}
