"""A scheme's weight quantization (schemes.quantize_weight: the quantize entry with statistics, E4M3 at
the scheme's weight granularity) names a bad tensor, and the name-only Linear recognition of
linear_weights.LINEAR_BY_NAME_MODEL_TYPES agrees with the model built on the meta device. (Its tiled
backend's bit-identity: tests/kernels/test_tiled.py.)"""

from __future__ import annotations

import re

import pytest
import torch

from mixprec.errors import MixprecError
from mixprec.inference import schemes
from mixprec.inference.schemes import quantize_weight
from mixprec.quantization import quantize


def _weight(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    return (torch.randn(shape, generator=g) * 0.05).to(dtype)


@pytest.mark.parametrize("name", list(schemes.SCHEMES))
def test_quantize_weight_is_the_entry_at_the_scheme_granularity(name):
    sch = schemes.SCHEMES[name]
    w = _weight((256, 384), torch.bfloat16)
    out = torch.empty(256, 384, dtype=sch.fmt.torch_dtype or torch.uint8)  # FP4: one code per byte
    q, stats = quantize_weight(w, sch, out=out)
    want = quantize(w, sch.fmt, sch.weight_granularity)
    assert q.data.data_ptr() == out.data_ptr() and q.granularity == sch.weight_granularity
    assert torch.equal(q.data.view(torch.uint8), want.data.view(torch.uint8)) and torch.equal(
        q.scale, want.scale
    )
    assert torch.equal(q.effective_scale(), want.effective_scale())
    bound = 0.2 if sch.fmt.bits == 4 else 0.1
    assert 0 < stats.relative_error < bound and stats.amax == float(w.float().abs().max())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight_names_the_tensor(bad):
    w = _weight((64, 64), torch.bfloat16)
    w[5, 7] = bad
    with pytest.raises(MixprecError, match=r"layer\.w"):
        quantize_weight(w, schemes.SCHEMES["fp8-dynamic"], name="layer.w")


def test_a_weight_must_be_2d():
    with pytest.raises(MixprecError, match=r"'layer\.w'.*2-D"):
        quantize_weight(torch.randn(4, 4, 4), schemes.SCHEMES["fp8-dynamic"], name="layer.w")


@pytest.mark.parametrize("model_type", ["llama", "bert"])
def test_linear_by_name_agrees_with_meta_model(model_type):
    transformers = pytest.importorskip("transformers")
    from torch import nn

    from mixprec.inference.checkpoint.linear_weights import _EMBEDDING, LINEAR_BY_NAME_MODEL_TYPES

    assert model_type in LINEAR_BY_NAME_MODEL_TYPES
    cfg = transformers.AutoConfig.for_model(
        model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=128,
    )  # fmt: skip
    for mapping in (transformers.MODEL_FOR_CAUSAL_LM_MAPPING, transformers.MODEL_MAPPING):
        cls = mapping.get(type(cfg), None)
        if cls is None:
            continue
        with torch.device("meta"):
            model = cls(cfg)
        linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        two_d = {
            n[: -len(".weight")]
            for n, p in model.state_dict().items()
            if n.endswith(".weight") and p.dim() == 2 and p.is_floating_point()
        }
        by_name = {n for n in two_d if not re.search(_EMBEDDING, n)}
        assert by_name == two_d & linears, cls.__name__
