"""An FP8 inference model answers an ordinary forward call (no torch.no_grad needed)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import mixprec


def test_quantized_model_forward_without_no_grad():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    mixprec.quantize_model_(model, "fp8-dynamic")
    logits = model(input_ids=ids).logits  # grad mode on, embedding still requires grad
    with torch.no_grad():
        assert torch.equal(logits, model(input_ids=ids).logits)
    rel = (logits - reference).norm() / reference.norm()
    assert 0 < rel < 0.12
