"""The three GEMMs of a Linear in low precision, in one autograd.Function given a quantizer state.

    output      = input · weightᵀ        scaled_mm(q(X),   q(W))
    grad_input  = grad_output · weight   scaled_mm(q(dY),  q(Wᵀ))
    grad_weight = grad_outputᵀ · input   scaled_mm(q(dYᵀ), q(Xᵀ))

Each operand is quantized as the recipe's plan says (mixprec.training.quantizer_state.RecipePlan), with
scales constant along that GEMM's K. A transposed operand is either the role's first quantization
transposed (per-tensor and square-block scales: the same payload and scales) or a re-quantization
along its new K from the high-precision tensor (rows, tiles, MX and NVFP4 blocks), made on the
tensor's own layout; `transposed` below turns either into the operand, the one place anything is
transposed. Accumulation is fp32 (mixprec.gemm); the output has the input's dtype, grad_weight the
weight's dtype, grad_bias is summed in fp32.

Saved for backward: the payloads the backward GEMMs need, not the high-precision input: X's payload
on X's own layout (its forward payload, or Xᵀ's re-quantization left untransposed: a saved transposed
view of an intermediate breaks torch.compile's autograd.Function tracing), and W's forward payload
when Wᵀ is that payload transposed, else the weight (re-quantized in backward).

FP4 recipes add the random Hadamard transform on the wgrad operands and stochastic rounding of the
gradient: both live in the quantizer state (RoundingKeys).
"""

from __future__ import annotations

import torch

from mixprec.gemm import scaled_mm, transposable, transpose_quantized, will_emulate, with_decoded
from mixprec.recipes import OperandLayout
from mixprec.scaling import QuantizedTensor, as_transposed
from mixprec.training.quantizer_state import QuantizerState


def transposed(q: QuantizedTensor, op: OperandLayout) -> QuantizedTensor:
    """The transposed operand `op` (Wᵀ, dYᵀ, Xᵀ) from q, the tensor quantized on its own layout: the
    payload viewed transposed, the scales transposed (no re-quantization). A first quantization reused
    as is (per tensor, square blocks) keeps its decoded copy for the emulated GEMM."""
    if transposable(op.granularity):
        return transpose_quantized(q)
    return as_transposed(q, op.granularity)


class LinearGemms(torch.autograd.Function):
    """All three GEMMs of a Linear, quantized per the recipe. Methods are named after the GEMMs."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        state: QuantizerState,
        training: bool,
        cache_weight: bool,
    ) -> torch.Tensor:
        """training: keep what backward needs and record amax (False under no_grad: evaluation, a
        reentrant checkpoint's first pass). cache_weight: the weight is the layer's own parameter and
        its casts may be reused (mixprec.training.weight_cache)."""
        plan = state.plan
        x2 = x.reshape(-1, x.shape[-1])
        need_dx, need_dw = training and ctx.needs_input_grad[0], training and ctx.needs_input_grad[1]
        qx = state.quantize("input", x2, plan.output.a, recording=training)
        qw = state.quantize_weight(weight, plan.output.b, recording=training, cached=cache_weight)
        out = LinearGemms.output(qx, qw, bias, x.dtype, state.backend)

        saved_x = None
        if need_dw:
            reuse = plan.transposes_forward_payload("input")
            saved_x = qx if reuse else state.quantize_for_transposed(x2, plan.grad_weight.b)
        keep_qw = need_dx and plan.transposes_forward_payload("weight")
        x_tensors, x_meta = _unpack(saved_x)
        w_tensors, w_meta = _unpack(qw if keep_qw else None)
        ctx.save_for_backward(*x_tensors, *w_tensors, weight if need_dx and not keep_qw else None)
        ctx.meta = (x_meta, w_meta, cache_weight)
        ctx.state = state
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.w_dtype, ctx.b_dtype = weight.dtype, None if bias is None else bias.dtype
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def output(qx, qw, bias, out_dtype, backend) -> torch.Tensor:
        """output = X · Wᵀ"""
        return scaled_mm(qx, qw, out_dtype=out_dtype, bias=bias, backend=backend)

    @staticmethod
    def grad_input(qdy, qwt, out_dtype, backend) -> torch.Tensor:
        """grad_input = dY · W = scaled_mm(q(dY), q(Wᵀ))"""
        return scaled_mm(qdy, qwt, out_dtype=out_dtype, backend=backend)

    @staticmethod
    def grad_weight(qdyt, qxt, out_dtype, backend) -> torch.Tensor:
        """grad_weight = dYᵀ · X = scaled_mm(q(dYᵀ), q(Xᵀ))"""
        return scaled_mm(qdyt, qxt, out_dtype=out_dtype, backend=backend)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        state: QuantizerState = ctx.state
        plan, backend = state.plan, state.backend
        x_meta, w_meta, cache_weight = ctx.meta
        saved = list(ctx.saved_tensors)
        qx = _repack(saved[:3], x_meta)
        qw = _repack(saved[3:6], w_meta)
        weight = saved[6]
        dy2 = grad_out.reshape(-1, grad_out.shape[-1])
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        state.begin_backward()

        # per-tensor recipes: one dY payload serves both GEMMs (transposed for grad_weight)
        dy_shared = plan.transposes_forward_payload("grad_output")
        qdy = None
        if need_dx or (need_dw and dy_shared):
            qdy = state.quantize("grad_output", dy2, plan.grad_input.a, recording=True)
        elif need_dw:  # dY's first quantization is skipped: still record its amax / tell the observer
            state.record_only("grad_output", dy2, plan.grad_input.a)
        if need_dx:
            wt = plan.grad_input.b
            if qw is None:
                qw = state.quantize_weight(
                    weight, wt, recording=True, cached=cache_weight, for_transposed=True
                )
            qwt = transposed(qw, wt)
            if need_dw and dy_shared and will_emulate(qdy, qwt, backend, ctx.x_dtype):
                qdy = with_decoded(qdy)  # decoded once, read by both emulated GEMMs
            grad_x = LinearGemms.grad_input(qdy, qwt, ctx.x_dtype, backend).reshape(ctx.x_shape)
        if need_dw:
            dyt = plan.grad_weight.a
            if not dy_shared:  # re-quantized along the tokens (dY's new K) from the high-precision gradient
                qdy = state.quantize_for_transposed(dy2, dyt)
            qxt = transposed(qx, plan.grad_weight.b)
            grad_w = LinearGemms.grad_weight(transposed(qdy, dyt), qxt, ctx.w_dtype, backend)
        if need_db and ctx.b_dtype is not None:
            grad_b = dy2.sum(dim=0, dtype=torch.float32).to(ctx.b_dtype)
        return grad_x, grad_w, grad_b, None, None, None


def _unpack(q: QuantizedTensor | None):
    """(tensors to save, meta) of a payload saved for backward."""
    if q is None:
        return (None, None, None), None
    return (q.data, q.scale, q.global_scale), (q.fmt, q.granularity, q.shape)


def _repack(tensors, meta) -> QuantizedTensor | None:
    if meta is None:
        return None
    fmt, granularity, shape = meta
    return QuantizedTensor(tensors[0], tensors[1], fmt, granularity, shape, tensors[2])


__all__ = ["LinearGemms", "transposed"]
