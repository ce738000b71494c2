"""The bf16 forward of quantized inference Linears (runtime/bf16_forward.py), forced on any CPU
(`bf16_gemm = "always"`; slow where bf16 is emulated, so the shapes are small): its numerics against the
fp32 emulation (bit-identical where the GEMM's sums are bf16 values, within the stated bound elsewhere,
both against fp64), the decoded-weight cache (counted in the model's weight memory, switchable off, dropped
when the payload moves or is reloaded) and torch.compile without graph breaks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mixprec
from mixprec.errors import MixprecError
from mixprec.evaluation.memory import tensor_bytes_by_dtype, weight_bytes_in_memory
from mixprec.formats import E4M3
from mixprec.inference import SCHEMES, QuantizedLinear
from mixprec.inference.runtime.linear import decoded_cache_bytes, set_decoded_cache
from mixprec.quantization import quantize

FAST_SCHEMES = ("fp8-dynamic", "fp8-static", "nvfp4a16")


def _layer(scheme: str, bias: bool = True, seed: int = 0) -> QuantizedLinear:
    torch.manual_seed(seed)
    linear = nn.Linear(96, 40, bias=bias)
    static = torch.tensor(4.0 / 448) if scheme == "fp8-static" else None  # a static input scale
    layer = QuantizedLinear.from_linear(linear, SCHEMES[scheme], input_scale=static).bfloat16()
    layer.bf16_gemm = "always"
    return layer


def _fp32_path(layer: QuantizedLinear) -> QuantizedLinear:
    ref = copy.deepcopy(layer)
    ref.bf16_gemm = "never"
    return ref


def _inputs(rows: int = 23, seed: int = 1) -> torch.Tensor:
    return (torch.randn(rows, 96, generator=torch.Generator().manual_seed(seed)) * 2).bfloat16()


def _operands_fp64(layer: QuantizedLinear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the layer's GEMM operands in fp64): W8A8 the input quantized as the layer does, A16 the input."""
    if layer.scheme.weights_only:
        return x.double(), layer.dequantized_weight(torch.float64)
    xq = quantize(x, E4M3, layer.input_granularity, scale=layer.input_scale)
    return xq.dequantize(torch.float64), layer.dequantized_weight(torch.float64)


@pytest.mark.parametrize("scheme", FAST_SCHEMES)
def test_bf16_forward_within_the_bound_of_the_exact_result(scheme):
    """|out - exact| <= (2^-8 + (K + 8) 2^-24) T with T = |x| |W|ᵀ + |b| (fp64 of the same operands):
    2^-9 T for rounding the sums to bf16 before the scales, 2^-9 |out| for the output rounding, the fp32
    accumulation and epilogue for the rest. The fp32 path meets it too; most outputs are bit-identical."""
    layer = _layer(scheme)
    x = _inputs()
    out, ref = layer(x), _fp32_path(layer)(x)
    xd, wd = _operands_fp64(layer, x)
    b = layer.bias.double()
    exact = xd @ wd.T + b
    terms = xd.abs() @ wd.abs().T + b.abs()
    bound = (2.0**-8 + (layer.in_features + 8) * 2.0**-24) * terms
    assert out.dtype == torch.bfloat16
    assert ((out.double() - exact).abs() <= bound).all()
    assert ((ref.double() - exact).abs() <= bound).all()
    assert (out == ref).float().mean() > 0.5  # one rounding apart: ~3/4 of the outputs agree


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "fp8-static"])
def test_bf16_forward_bit_identical_when_the_sums_are_bf16_values(scheme):
    """One nonzero input per row: each sum is one product of two E4M3 values (at most 8 significant
    bits), a bf16 value, so rounding it early changes nothing: the outputs equal the fp32 path's, bit for
    bit (the same fp32 epilogue: row scale, column scale, bias)."""
    layer = _layer(
        scheme, bias=scheme == "fp8-dynamic"
    )  # fp8-static's eager fp32 path adds a bias as BLAS beta
    x = torch.zeros(12, 96)
    x[torch.arange(12), torch.arange(12) * 7] = torch.linspace(-3, 3, 12)
    x = x.bfloat16()
    assert torch.equal(layer(x), _fp32_path(layer)(x))


def test_nvfp4a16_bit_identical_when_the_global_scale_is_a_power_of_two():
    """NVFP4 A16 with a power-of-two global scale and power-of-two inputs (one per row): the bf16 path's
    division by the global scale and the fp32 path's per-weight block scale / global are both exact."""
    layer = _layer("nvfp4a16")
    layer.weight_global_scale.fill_(1024.0)
    layer.decoded_weight = None
    x = torch.zeros(8, 96)
    x[torch.arange(8), torch.arange(8) * 11] = torch.tensor([1.0, -2.0, 0.5, 4.0, -0.25, 8.0, 1.0, -1.0])
    x = x.bfloat16()
    assert torch.equal(layer(x), _fp32_path(layer)(x))


def test_fp32_models_and_fp32_inputs_to_a16_keep_the_fp32_path():
    """An fp32 output keeps the fp32 emulation (no cache made); A16 takes only bf16 inputs (an fp32
    input would be rounded)."""
    layer = _layer("fp8-dynamic").float()
    layer(_inputs().float())
    assert layer.decoded_weight is None
    a16 = _layer("nvfp4a16")
    out = a16(_inputs().float())
    assert a16.decoded_weight is None and torch.equal(out, _fp32_path(a16)(_inputs().float()))


def test_bad_mode_refused():
    layer = _layer("fp8-dynamic")
    layer.bf16_gemm = "sometimes"
    with pytest.raises(MixprecError, match="bf16_gemm must be one of auto, always, never"):
        layer(_inputs())


# ---- the decoded-weight cache ------------------------------------------------------------------------


def _model(scheme: str = "fp8-dynamic") -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 64), nn.ReLU(), nn.Linear(64, 32))
    calib = [torch.randn(8, 96)] if SCHEMES[scheme].needs_calibration else None
    mixprec.quantize_model_(model, scheme, calib_data=calib, default_ignore=False)
    model = model.bfloat16().eval()
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            m.bf16_gemm = "always"
    return model


@pytest.mark.parametrize("scheme", FAST_SCHEMES)
def test_cache_counts_in_the_weight_memory(scheme):
    """The decoded weights are model memory: after the first forward the weight figure evaluate reports
    grows by exactly the cache's bytes (bf16: 2 per weight), and so does the bf16 line of the per-dtype one."""
    model = _model(scheme)
    before, by_dtype = weight_bytes_in_memory(model), tensor_bytes_by_dtype(model)
    assert decoded_cache_bytes(model) == 0
    model(_inputs())
    cache = decoded_cache_bytes(model)
    assert cache == 2 * (96 * 64 + 64 * 32)
    assert weight_bytes_in_memory(model) == before + cache
    assert tensor_bytes_by_dtype(model)["bfloat16"] == by_dtype.get("bfloat16", 0) + cache


@pytest.mark.parametrize("scheme", FAST_SCHEMES)
def test_cache_off_decodes_per_call_with_the_same_bits(scheme):
    model, x = _model(scheme), _inputs()
    cached = model(x)
    assert set_decoded_cache(model, False) == 2
    assert decoded_cache_bytes(model) == 0  # turning it off drops what was held
    assert torch.equal(model(x), cached)
    assert decoded_cache_bytes(model) == 0
    set_decoded_cache(model, True)
    model(x)
    assert decoded_cache_bytes(model) > 0


def test_cache_dropped_when_the_payload_moves_or_is_reloaded():
    model, x = _model(), _inputs()
    expected = model(x)
    model.to("cpu")
    assert decoded_cache_bytes(model) == 0
    model(x)
    other = _model()
    other[0].weight.zero_()  # a different payload, its decoded copy made
    other(x)
    other.load_state_dict(model.state_dict())
    assert decoded_cache_bytes(other) == 0 and torch.equal(other(x), expected)


def test_load_quantized_cache_switch(llama_dir, tmp_path):
    mixprec.inference.quantize_checkpoint(llama_dir, tmp_path / "ckpt", "fp8-dynamic", progress=False)
    for flag in (True, False):
        loaded = mixprec.load_quantized(tmp_path / "ckpt", decoded_cache=flag)
        assert {m.decoded_cache for m in loaded.modules() if isinstance(m, QuantizedLinear)} == {flag}


# ---- torch.compile -------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", FAST_SCHEMES)
@pytest.mark.parametrize("cache", [True, False])
def test_compile_full_graph_gives_the_eager_bits(scheme, cache):
    """No graph break (the cache is read, never written, inside a trace; detect() ran eagerly) and the
    eager result (aot_eager: the graph as traced, run eagerly)."""
    model, x = _model(scheme), _inputs()
    set_decoded_cache(model, cache)
    eager = model(x)
    torch._dynamo.reset()
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(out, eager)
