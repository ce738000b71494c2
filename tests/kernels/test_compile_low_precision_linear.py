"""torch.compile on converted layers: no graph breaks in the FP8 Linear hot path (CPU, tracing backends).

mixprec.quantization.quantize picks its traceable backend under torch.compile, and the emulated GEMM
has no data-dependent Python there (no float(scale), no data_ptr()), so forward and backward compile
with fullgraph=True for every FP8 recipe and give the eager results (bit for bit where the compiled
graph runs the same ops; per-tensor scaling multiplies by the scale tensor instead of BLAS alpha).
"""

from __future__ import annotations

import pytest
import torch

from mixprec.kernels.compiled import graph_break_report
from mixprec.training.low_precision_linear import LowPrecisionLinear


@pytest.mark.parametrize("recipe", ["fp8-delayed", "fp8-mxfp8"])  # the others: fullgraph below
def test_forward_has_no_graph_breaks(recipe):
    layer = LowPrecisionLinear(256, 128, recipe=recipe)
    report = graph_break_report(layer, torch.randn(4, 256, requires_grad=True))
    assert report["graph_breaks"] == 0, report["reasons"]
    assert report["graphs"] == 1


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-rowwise", "fp8-blockwise"])
def test_forward_and_backward_compile_fullgraph(recipe):
    torch.manual_seed(0)
    layer = LowPrecisionLinear(256, 128, recipe=recipe)
    x = torch.randn(4, 256, requires_grad=True)
    torch._dynamo.reset()
    ref = layer(x)
    ref.sum().backward()
    gx, gw = x.grad.clone(), layer.weight.grad.clone()
    x.grad, layer.weight.grad = None, None
    out = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)
    out.sum().backward()
    got = (out, x.grad, layer.weight.grad)
    if recipe == "fp8-current":  # scale tensor product instead of BLAS alpha: fp32 rounding only
        for a, b in zip(got, (ref, gx, gw)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    else:
        assert all(torch.equal(a, b) for a, b in zip(got, (ref, gx, gw)))
    torch._dynamo.reset()


def test_delayed_scaling_after_an_advance_compiles_forward_and_backward():
    """After an advance every role quantizes with a scale from the history, passed into the quantizer
    (not computed there): torch.compile must be able to save it for backward (it once aliased the
    caller's tensor, and the backward graph failed to build). Same results as eager."""
    layers = []
    for _ in range(2):
        torch.manual_seed(0)
        # growing=false: after this first advance the default would scale step 2 from its own amax (a
        # record step, see mixprec.training.scaling_state); the test needs the history's scale
        layer = LowPrecisionLinear(256, 128, recipe="fp8-delayed:growing=false")
        layer(torch.randn(4, 256)).sum().backward()  # step 1: records the amax history
        layer.advance_scaling()
        layer.weight.grad = None
        layers.append(layer)
    eager, compiled = layers
    assert (eager.fp8_scale > 0).all()
    x = torch.randn(4, 256) * 3  # larger than step 1's: the history scale saturates, as delayed scaling does
    results = []
    torch._dynamo.reset()
    for layer, fn in (
        (eager, eager),
        (compiled, torch.compile(compiled, backend="aot_eager", fullgraph=True)),
    ):
        xi = x.clone().requires_grad_(True)
        out = fn(xi)
        out.sum().backward()
        results.append((out, xi.grad, layer.weight.grad))
    for a, b in zip(*results):  # scale tensor product instead of BLAS alpha: fp32 rounding only
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()
