"""torch.compile with Inductor on quantized inference layers: bit-identical to eager where the rounding
points are the same, and within a stated bound where eager uses a fused BLAS epilogue.

Why results once differed (docs/serving.md, "torch.compile"):
- the bias: eager added it with addcmul (one rounding, an FMA) where Inductor's mul + add rounds twice;
  the emulated GEMM now adds it after the product is rounded, in eager as compiled;
- between layers of a bf16 model, Inductor by default keeps a fused producer's fp32 value instead of
  rounding it to bf16 (torch._inductor.config.emulate_precision_casts = False): the next layer's
  per-token FP8 quantization then sees unrounded inputs and some payloads round the other way. With
  emulate_precision_casts = True the compiled model is bit-identical to eager;
- per-tensor scales (fp8-static): eager scales the sums with BLAS alpha and adds the bias as beta
  (rounded together), compiled multiplies the product by the scale tensor and then adds: at most one
  rounding order of the fp32 sums apart: both within the fp32 GEMM error bound (tested below).

Inductor compiles C++ for each graph: about a minute on the project's 2-CPU machine (the first compile
in a process; 5-20 s for each FP4 / MX model after it), so these tests are marked slow.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec.inference import SCHEMES

pytestmark = pytest.mark.slow


def _model(scheme: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    # static scales (fp8-static) or the input's global scale (nvfp4) from the inputs
    calib = [_inputs(torch.float32)] if SCHEMES[scheme].needs_calibration else None
    mixprec.quantize_model_(model, scheme, calib_data=calib, default_ignore=False)
    return model.to(dtype).eval()


def _inputs(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(37, 64, generator=g) * 3).to(dtype)


@pytest.fixture
def precise_casts():
    from torch._inductor import config

    before = config.emulate_precision_casts
    config.emulate_precision_casts = True
    yield
    config.emulate_precision_casts = before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_dynamic_model_compiled_by_inductor_is_bit_identical(precise_casts, dtype):
    model, x = _model("fp8-dynamic", dtype), _inputs(dtype)
    torch._dynamo.reset()
    out = torch.compile(model, backend="inductor", fullgraph=True)(x)
    assert out.dtype == dtype and torch.equal(out, model(x))


@pytest.mark.parametrize("scheme", ["nvfp4", "nvfp4a16", "mxfp4", "mxfp4a16"])
def test_fp4_model_compiled_by_inductor_is_bit_identical(precise_casts, scheme):
    """FP4 / MX layers of a bf16 model, whole graph (the E2M1 NaN check and nvfp4's global-scale check
    are in-graph assertions): W4A4 quantizes its input per call (nvfp4's E4M3 block scales in the
    units of its calibrated global scale, mxfp4's E8M0 ones) and runs the emulated GEMM, a16 multiplies
    by the dequantized weight in fp32; compiled, both give eager's bits."""
    model, x = _model(scheme, torch.bfloat16), _inputs(torch.bfloat16)
    torch._dynamo.reset()
    out = torch.compile(model, backend="inductor", fullgraph=True)(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, model(x))


def test_fp8_static_layer_compiled_by_inductor_within_the_fp32_gemm_bound():
    """Per-tensor scales: eager (BLAS alpha/beta, addmm) and compiled (mm, then scale, then bias) sum and
    round in different orders; each is within the fp32 GEMM error bound (K + 2) 2^-24 sum|terms| of
    the exact result (fp64 of the same FP8 operands), so they are at most twice that apart."""
    from mixprec.formats import E4M3
    from mixprec.quantization import quantize

    model, x = _model("fp8-static", torch.float32), _inputs(torch.float32)
    layer = model[0]
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)(x)
    eager = layer(x)
    xq = quantize(x, E4M3, layer.input_granularity, scale=layer.input_scale)
    xd, wd, b = xq.dequantize(torch.float64), layer.dequantized_weight(torch.float64), layer.bias.double()
    exact = xd @ wd.T + b
    bound = (layer.in_features + 2) * 2.0**-24 * (xd.abs() @ wd.abs().T + b.abs())
    for out in (compiled, eager):
        assert ((out.double() - exact).abs() <= bound).all()
