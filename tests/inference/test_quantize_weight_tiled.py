"""The tiled weight quantizer (schemes.quantize_weight) gives scaling.quantize's payloads and scales bit
for bit, a relative error within 1e-5 (relative) of the float64 reference, and the name-only Linear
recognition of linear_weights.LINEAR_BY_NAME_MODEL_TYPES agrees with the model built on the meta device."""

from __future__ import annotations

import re

import pytest
import torch

from mixprec.errors import MixprecError
from mixprec.formats import E4M3, decode_e4m3_unscaled_into
from mixprec.inference import schemes
from mixprec.inference.schemes import InferenceScheme, quantize_weight
from mixprec.scaling import Granularity, quantize

GRANULARITIES = [
    Granularity.rows(),
    Granularity.tensor(),
    Granularity.blocks(128, 128),
    Granularity.blocks(16, 32),
]


def _weight(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    w = torch.randn(shape, generator=g, dtype=torch.float64) * torch.rand(
        shape[0], 1, generator=g, dtype=torch.float64
    )
    w[-1] = 0  # an all-zero row: scale 1
    w[0, :3] *= 1e-6  # subnormal E4M3 codes
    return (w * 0.05).to(dtype)


@pytest.mark.parametrize("tile", [1 << 18, 300])  # 300 elements: many tiles, column tiles for blocks
@pytest.mark.parametrize("g", GRANULARITIES, ids=lambda g: g.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bit_identical_to_scaling_quantize(monkeypatch, tile, g, dtype):
    monkeypatch.setattr(schemes, "_TILE_ELEMENTS", tile)
    sch = InferenceScheme("t", g, g, True)
    for shape in [(16, 48), (130, 300), (257, 129)]:
        w = _weight(shape, dtype)
        for given in (False, True):
            ref = quantize(w, E4M3, g)
            scale = ref.scale * 1.25 if given else None
            if given:
                ref = quantize(w, E4M3, g, scale=scale)
            out = torch.empty(shape, dtype=torch.float8_e4m3fn)
            q, stats = quantize_weight(w, sch, scale=scale, out=out)
            assert q.data.data_ptr() == out.data_ptr()
            assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)), (shape, given)
            assert torch.equal(q.scale, ref.scale), (shape, given)
            x = w.double()
            want = float((ref.dequantize().double() - x).norm() / x.norm())
            assert stats.relative_error == pytest.approx(want, rel=1e-5)
            assert stats.amax == float(w.float().abs().max())


def test_payload_decode_is_exact_for_every_code():
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    out = torch.empty(256)
    decode_e4m3_unscaled_into(q, torch.empty(256, dtype=torch.int16), out)
    want = q.float()
    finite = ~want.isnan()
    assert torch.equal((out * 256)[finite].view(torch.int32), want[finite].view(torch.int32))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight_names_the_tensor(bad):
    w = _weight((64, 64), torch.bfloat16)
    w[5, 7] = bad
    with pytest.raises(MixprecError, match=r"layer\.w"):
        quantize_weight(w, schemes.SCHEMES["fp8-dynamic"], name="layer.w")


@pytest.mark.parametrize("model_type", ["llama", "bert"])
def test_linear_by_name_agrees_with_meta_model(model_type):
    transformers = pytest.importorskip("transformers")
    from torch import nn

    from mixprec.inference.linear_weights import _EMBEDDING, LINEAR_BY_NAME_MODEL_TYPES

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
