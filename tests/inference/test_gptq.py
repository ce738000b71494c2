"""GPTQ (mixprec.inference.algorithms.gptq) against RTN and a plain column-by-column reference."""

from __future__ import annotations

import pytest
import torch

from mixprec.errors import MixprecError
from mixprec.inference.algorithms.gptq import HessianAccumulator, gptq_quantize
from mixprec.quantization import quantize
from mixprec.scaling import Granularity

pytestmark = pytest.mark.usefixtures("single_thread")

SCHEMES = {  # the weight granularities of mixprec's schemes
    "fp8 per-channel": ("e4m3", Granularity.rows()),
    "fp8 per-tensor": ("e4m3", Granularity.tensor()),
    "fp8 128x128": ("e4m3", Granularity.blocks(128, 128)),
    "nvfp4": ("e2m1", Granularity.nvfp4()),
    "mxfp4": ("e2m1", Granularity.mx()),
    "mxfp8": ("e4m3", Granularity.mx()),
}


def _layer(gen, n=48, k=256, tokens=512):
    w = torch.randn(n, k, generator=gen) / 16
    # correlated inputs with a few large channels, as transformer activations have
    x = torch.randn(tokens, k, generator=gen) @ (
        torch.eye(k) + 0.3 * torch.randn(k, k, generator=gen) / k**0.5
    )
    x[:, :4] *= 8
    h = HessianAccumulator(k)
    h.add(x[: tokens // 2])
    h.add(x[tokens // 2 :])
    return w, x, h.finish()


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_identity_hessian_is_rtn_bit_for_bit(scheme, gen):
    fmt, g = SCHEMES[scheme]
    w = torch.randn(256, 256, generator=gen) / 16
    result = gptq_quantize(w, torch.eye(256), fmt, g)
    rtn = quantize(w, fmt, g)
    assert torch.equal(result.quantized.data, rtn.data)
    assert torch.equal(result.quantized.scale, rtn.scale)
    if rtn.global_scale is not None:
        assert torch.equal(result.quantized.global_scale, rtn.global_scale)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("act_order", [False, True])
def test_output_error_is_below_rtn(scheme, act_order, gen):
    fmt, g = SCHEMES[scheme]
    w, x, h = _layer(gen)
    result = gptq_quantize(w, h, fmt, g, act_order=act_order)
    ref = x @ w.t()
    gptq_err = (x @ result.quantized.dequantize().t() - ref).square().mean()
    rtn_err = (x @ quantize(w, fmt, g).dequantize().t() - ref).square().mean()
    assert gptq_err < rtn_err


def _reference_gptq(w, h, fmt, g, damp=0.01):
    """Column by column, no lazy blocks, scales from the current weight at each group's first column."""
    w = w.clone()
    k = w.shape[1]
    h = h.clone()
    torch.diagonal(h).add_(damp * float(torch.diagonal(h).mean()))
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    width = k if g.block_cols is None else g.block_cols
    out = torch.empty_like(w)
    gs = quantize(w, fmt, g).global_scale
    scale = None
    for i in range(k):
        if i % width == 0:
            scale = quantize(w[:, i : i + width], fmt, g, global_scale=gs).scale
        q = quantize(w[:, i : i + 1], fmt, g, scale=scale, global_scale=gs).dequantize()[:, 0]
        out[:, i] = q
        w[:, i:] -= ((w[:, i] - q) / hinv[i, i])[:, None] * hinv[i, i:][None, :]
    return out


@pytest.mark.parametrize("scheme", ["nvfp4", "fp8 per-channel", "mxfp4"])
def test_lazy_blocks_match_the_column_by_column_reference(scheme, gen):
    fmt, g = SCHEMES[scheme]
    w, _, h = _layer(gen, n=16, k=96)
    got = gptq_quantize(w.double().float(), h, fmt, g, block=32).quantized.dequantize()
    ref = _reference_gptq(w, h, fmt, g)
    # the same roundings; fp32 update order differs, so an element may land on the neighbouring point
    assert (got != ref).float().mean() < 0.02


def test_dead_columns_and_given_scales(gen):
    w, _, h = _layer(gen, k=64)
    h[:, 5] = 0
    h[5, :] = 0
    fits = gptq_quantize(w, h, "e4m3", Granularity.tensor(), scale=torch.tensor(0.01))  # range 4.48
    assert fits.dead_columns == 1 and fits.clipped == 0
    assert float(fits.quantized.scale) == pytest.approx(0.01)
    assert bool((fits.quantized.dequantize()[:, 5] == 0).all())
    tight = gptq_quantize(w, h, "e4m3", Granularity.tensor(), scale=torch.tensor(1e-4))  # range 0.0448
    expected = int((w.abs() > 0.0448).sum())  # at least the values beyond it before any update
    assert tight.clipped >= expected > 0
    w_before = w.clone()
    gptq_quantize(w, h, "e2m1", Granularity.nvfp4())
    assert torch.equal(w, w_before)  # inputs are not modified


def test_bad_inputs_are_named(gen):
    w = torch.randn(8, 32, generator=gen)
    with pytest.raises(MixprecError, match="q_proj: Hessian of shape"):
        gptq_quantize(w, torch.eye(16), "e4m3", Granularity.rows(), name="q_proj")
    bad = torch.eye(32)
    bad[0, 0] = float("nan")
    with pytest.raises(MixprecError, match="inf or NaN"):
        gptq_quantize(w, bad, "e4m3", Granularity.rows())
    with pytest.raises(MixprecError, match="not positive definite"):
        gptq_quantize(w, -torch.eye(32), "e4m3", Granularity.rows(), damp=0.0)
    with pytest.raises(MixprecError, match="no calibration rows"):
        HessianAccumulator(4).finish()
