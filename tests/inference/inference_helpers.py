"""Helpers for the FP8 inference tests: tiny models built from configs (no downloads)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from mixprec.inference.runtime.linear import QuantizedLinear  # noqa: E402
from mixprec.quantization import quantize  # noqa: E402

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


# Written out, not taken from mixprec: max + half the spacing of the top binade (E4M3 448 + 16, E2M1 6 + 1).
OVERFLOW = {"e4m3": 464.0, "e2m1": 7.0}


class ReferenceLinear(nn.Module):
    """F.linear(ste(fake_quant(x)), W) in fp32 with W the layer's dequantized weight: the obvious model."""

    def __init__(self, layer: QuantizedLinear):
        super().__init__()
        self.register_buffer("weight", layer.dequantized_weight(torch.float32))
        self.bias = None if layer.bias is None else layer.bias.detach().float()
        self.layer = layer  # only its input quantizer's settings are read
        self.out_dtype = layer.out_dtype

    def fake_quant(self, x2: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        if layer.scheme.weights_only:
            return x2.float()
        fmt = layer.scheme.input_format
        xq = quantize(x2.detach(), fmt, layer.input_granularity, scale=layer.input_scale,
                      global_scale=getattr(layer, "input_global_scale", None))  # fmt: skip
        scale = xq.effective_scale()
        br, bc = xq.granularity.block_shape(*x2.shape)
        scale = scale.repeat_interleave(br, 0)[: x2.shape[0]] if scale.shape[0] > 1 else scale
        scale = scale.repeat_interleave(bc, 1)[:, : x2.shape[1]] if scale.shape[1] > 1 else scale
        kept = (x2.detach().float().abs() / scale) <= OVERFLOW[fmt]
        passthrough = x2.float() * kept  # the gradient flows where the quantizer did not saturate
        return passthrough + (xq.dequantize() - passthrough).detach()

    def obvious(self, x2: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(self.fake_quant(x2), self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The served layer's values, the obvious model's gradient: GEMM-order differences in the values
        would flip later layers' input roundings and leave nothing comparable (a layer's own values are
        compared with the obvious model in test_forward_matches_the_obvious_model)."""
        x2 = x.reshape(-1, x.shape[-1])
        obvious = self.obvious(x2)
        with torch.no_grad():
            served, _ = self.layer.forward_2d(x2)
        out = obvious + (served.float() - obvious).detach()
        return out.to(self.out_dtype).reshape(*x.shape[:-1], -1)


def reference_of(model: nn.Module) -> nn.Module:
    """A copy of `model` with every quantized Linear replaced by its ReferenceLinear."""
    ref = copy.deepcopy(model)
    for name, m in list(ref.named_modules()):
        if isinstance(m, QuantizedLinear):
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, ReferenceLinear(m))
    return ref


class SimulatedKill(BaseException):
    """Raised where a kill would land; not an Exception, as a signal is not."""


def directory_files(directory: Path) -> dict[str, bytes]:
    """Every file of a directory by name: two outputs compared byte for byte."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def assert_same_quantized(model: nn.Module, offline: nn.Module) -> int:
    """Every QuantizedLinear of `model` (quantized in memory) equals the one at the same path of `offline`
    (a checkpoint loaded by load_quantized) bit for bit: its decoded weight and its input and weight
    global scales where the checkpoint has them. Returns how many were compared."""
    compared = 0
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            theirs = offline.get_submodule(name)
            assert torch.equal(
                m.dequantized_weight(torch.float32), theirs.dequantized_weight(torch.float32)
            ), name
            for attr in ("input_scale", "weight_global_scale"):
                if getattr(theirs, attr, None) is not None:
                    assert torch.equal(getattr(m, attr), getattr(theirs, attr)), (name, attr)
            compared += 1
    return compared
