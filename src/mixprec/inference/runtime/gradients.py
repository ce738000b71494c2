"""Gradients through the quantized inference Linears: what lets adapters (LoRA) and the layers before a
quantized one train on a quantized base.

The payloads are frozen: a quantized Linear has no weight gradient. The input gets

    grad_x = (grad_y · W) ⊙ mask

with W the exactly dequantized weight (payload × scales, fp32) and, for the schemes that quantize their
inputs (fp8-*, nvfp4, mxfp4, mxfp8), the straight-through estimator of the input quantizer with the usual
clipping mask: the gradient passes where the quantizer rounded to a representable value and is zero where
it saturated (|x| / scale beyond the format's overflow threshold, max + half an ulp: a value that rounding
alone would not have moved to max). Dynamic per-token FP8 never saturates; a static scale, NVFP4 blocks under
a calibrated global scale and MX blocks (whose power-of-two scale leaves values up to 8 > 6) do.

The forward is the layer's own (`forward_2d`), so the outputs are bit-identical to inference.

FakeQuantLinearFunction is the same forward and input gradient for quantization-aware training
(finetune/qat.py), where the weight is trainable: it adds the straight-through weight gradient (with the
weight quantizer's clipping mask) and the bias gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.scaling import QuantizedTensor, expand_scale


def clip_mask(x2: torch.Tensor, xq: QuantizedTensor) -> torch.Tensor:
    """True where the input quantizer did not saturate x2 ([M, K]): |x| / scale ≤ max + ½ ulp."""
    scale = expand_scale(xq.effective_scale(), xq.granularity, *x2.shape)
    return (x2.float().abs() / scale) <= xq.fmt.overflow_threshold


class QuantizedLinearFunction(torch.autograd.Function):
    """y = layer.forward_2d(x2) (the inference forward, unchanged); grad_x through the dequantized weight
    and the clipping mask. `layer` is a QuantizedLinear (any scheme); its bias is frozen like its payload."""

    @staticmethod
    def forward(ctx: Any, x2: torch.Tensor, layer: Any) -> torch.Tensor:
        out, xq = layer.forward_2d(x2.detach())
        mask = clip_mask(x2, xq) if xq is not None else None
        ctx.layer, ctx.x_dtype = layer, x2.dtype
        ctx.save_for_backward(mask)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        (mask,) = ctx.saved_tensors
        weight = ctx.layer.dequantized_weight(torch.float32)  # exact; decoded per backward, not kept
        grad_x = grad_out.float() @ weight
        if mask is not None:
            grad_x = grad_x * mask
        return grad_x.to(ctx.x_dtype), None


class FakeQuantLinearFunction(torch.autograd.Function):
    """Quantization-aware training (finetune/qat.py): y = layer.forward_2d(x2) with `layer` the inference
    Linear built from the current high-precision weight (so the forward is the served one, bit for bit),
    and a straight-through backward for both quantizers:

        grad_x = (grad_y · Ŵ) ⊙ input mask            (as QuantizedLinearFunction)
        grad_W = (grad_yᵀ · x̂) ⊙ weight mask           (x̂: the quantized input dequantized, or x for A16)
        grad_b = Σ_rows grad_y

    The weight mask is the clipping mask of the weight quantizer (clip_mask on the quantized weight): zero
    where |w| / scale exceeded the format's overflow threshold (MX's power-of-two scales saturate, and an
    NVFP4 block scale rounded down to E4M3). `weight` and `bias` are the trainable master tensors the
    layer was quantized from; they are inputs here only so autograd routes their gradients."""

    @staticmethod
    def forward(
        ctx: Any, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: Any,
        weight_q: QuantizedTensor,
    ) -> torch.Tensor:  # fmt: skip
        out, xq = layer.forward_2d(x2.detach())
        input_mask = clip_mask(x2, xq) if xq is not None else None
        weight_mask = clip_mask(weight.detach(), weight_q)
        ctx.layer, ctx.xq, ctx.x_dtype = layer, xq, x2.dtype
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(x2.detach() if xq is None else None, input_mask, weight_mask)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_plain, input_mask, weight_mask = ctx.saved_tensors
        g = grad_out.float()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = g @ ctx.layer.dequantized_weight(torch.float32)
            if input_mask is not None:
                grad_x = grad_x * input_mask
            grad_x = grad_x.to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            x_hat = x_plain.float() if ctx.xq is None else ctx.xq.dequantize(torch.float32)
            grad_w = ((g.t() @ x_hat) * weight_mask).to(ctx.weight_dtype)
        if ctx.needs_input_grad[2]:
            grad_b = g.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None
