"""Gradients through the quantized inference Linears (issue 29): the input gradient of every scheme equals
that of a plain fp32 reference holding the dequantized weights and fake-quantizing the inputs the same way
with a straight-through estimator; the forward stays bit-identical to inference."""

from __future__ import annotations

import pytest
import torch
from inference_helpers import ReferenceLinear, reference_of, tiny_llama
from torch import nn

from mixprec.inference.runtime.gradients import clip_mask
from mixprec.inference.runtime.linear import QuantizedLinear
from mixprec.inference.runtime.online import apply_scheme_
from mixprec.inference.schemes import SCHEMES, InferenceScheme
from mixprec.quantization import quantize


def _grad_at_layer0(
    model: nn.Module, ids: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, d loss / d hidden states entering layer 0) with loss = Σ logits · weights."""
    held = {}

    def trainable(module, args, out):
        held["h"] = out.detach().requires_grad_()
        return held["h"]

    handle = model.get_input_embeddings().register_forward_hook(trainable)
    try:
        logits = model(ids).logits
        (logits.float() * weights).sum().backward()
    finally:
        handle.remove()
    return logits.detach(), held["h"].grad


def _calib(ids: torch.Tensor) -> list[torch.Tensor]:
    return [ids[i : i + 1] for i in range(ids.shape[0])]


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_input_gradient_equals_the_straight_through_reference(scheme):
    torch.manual_seed(0)
    model = tiny_llama()
    ids = torch.randint(0, 320, (2, 24))
    calib = _calib(torch.randint(0, 320, (4, 24))) if SCHEMES[scheme].needs_calibration else None
    apply_scheme_(model, scheme, calib_data=calib)
    ref = reference_of(model)
    weights = torch.randn(2, 24, 320)
    logits, grad = _grad_at_layer0(model, ids, weights)
    ref_logits, ref_grad = _grad_at_layer0(ref, ids, weights)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)  # the forward is the inference forward, bit for bit
    assert torch.equal(logits, ref_logits)
    for layer in (
        m for m in model.modules() if isinstance(m, QuantizedLinear)
    ):  # the values: the obvious model's
        x2 = torch.randn(6, layer.in_features) * 2
        with torch.no_grad():
            served, obvious = layer.forward_2d(x2)[0], ReferenceLinear(layer).obvious(x2)
        assert float((served - obvious).abs().max()) <= 1e-5 * float(obvious.abs().max())
    assert float(grad.abs().max()) > 0
    err = float((grad - ref_grad).norm() / ref_grad.norm())
    assert err < 1e-4, f"{scheme}: relative error {err:.2e}"


def test_payloads_and_bias_get_no_gradient_and_stay_frozen():
    model = tiny_llama()
    apply_scheme_(model, "fp8-dynamic")
    layer = model.model.layers[0].mlp.down_proj
    before = layer.weight.clone()
    _grad_at_layer0(model, torch.randint(0, 320, (1, 8)), torch.randn(1, 8, 320))
    assert not any(t.requires_grad for t in layer.buffers())
    assert torch.equal(layer.weight.view(torch.uint8), before.view(torch.uint8))


def test_no_graph_is_recorded_when_the_input_needs_no_gradient():
    model = tiny_llama()
    apply_scheme_(model, "nvfp4a16")
    for p in model.parameters():
        p.requires_grad_(False)
    assert not model(torch.randint(0, 320, (1, 8))).logits.requires_grad


def test_clip_mask_marks_saturated_inputs_only():
    sch = InferenceScheme.from_name("fp8-static")
    scale = torch.tensor([[0.5]])
    x = torch.tensor([[100.0, 448 * 0.5, 460 * 0.5, 470 * 0.5, -1000.0]])
    xq = quantize(x, sch.input_format, sch.input_granularity, scale=scale)
    assert clip_mask(x, xq).tolist() == [[True, True, True, False, False]]
    # NVFP4 under a calibrated input global scale (amax 1): a block of amax 3 needs a block scale beyond
    # E4M3's 448, which saturates, and the block's values beyond 7 x its scale (1/6) clip
    nv = SCHEMES["nvfp4"]
    block = torch.full((1, 16), 0.1)
    block[0, :3] = torch.tensor([3.0, 1.1, 1.2])
    bq = quantize(block, nv.input_format, nv.input_granularity, global_scale=torch.tensor([448 * 6 / 1.0]))
    assert float(bq.effective_scale()) == pytest.approx(1 / 6)
    assert clip_mask(block, bq)[0, :4].tolist() == [False, True, False, True]
    assert bool(clip_mask(block, bq)[0, 3:].all())
