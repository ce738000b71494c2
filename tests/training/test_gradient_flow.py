"""The gradient-flow check names the modules that stop a gradient: the forward run without autograd (the
inference layers' old `torch.no_grad()`), a backward that drops or zeroes the input gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from inference.inference_helpers import tiny_llama
from mixprec.errors import MixprecError
from mixprec.inference.runtime.online import apply_scheme_
from mixprec.training.gradient_flow import check_gradient_flow

IDS = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))


class _Drop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, zeros: bool):
        ctx.zeros = zeros
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return (torch.zeros_like(g) if ctx.zeros else None), None


def _wrap_output(module: nn.Module, zeros: bool) -> None:
    """Route the module's input through _Drop: its output keeps a graph, its input gets nothing (or 0)."""
    forward = module.forward
    module.forward = lambda x: forward(_Drop.apply(x, zeros))


@pytest.fixture
def quantized():
    model = tiny_llama()
    apply_scheme_(model, "fp8-dynamic")
    return model


def test_quantized_model_passes(quantized):
    report = check_gradient_flow(quantized, IDS)
    assert report.ok, report.message()
    names = {m.name for m in report.modules}
    assert "model.layers.0.self_attn.q_proj" in names and "lm_head" in names
    report.raise_if_broken()


def test_forward_without_autograd_is_named(quantized):
    """Today's failure: an inference layer under torch.no_grad() cuts the graph."""
    layer = quantized.model.layers[1].mlp.down_proj
    layer.forward = torch.no_grad()(layer.forward)
    report = check_gradient_flow(quantized, IDS)
    assert [(m.name, m.problem) for m in report.broken] == [("model.layers.1.mlp.down_proj", "cut")]
    with pytest.raises(MixprecError, match=r"model\.layers\.1\.mlp\.down_proj \(QuantizedLinear: cut\)"):
        report.raise_if_broken()


@pytest.mark.parametrize(("zeros", "problem"), [(False, "dropped"), (True, "zeroed")])
def test_backward_that_loses_the_input_gradient_is_named(quantized, zeros, problem):
    # k_proj shares its input with q_proj and v_proj, which still pass their gradients on
    _wrap_output(quantized.model.layers[0].self_attn.k_proj, zeros)
    report = check_gradient_flow(quantized, IDS)
    assert [(m.name, m.problem) for m in report.broken] == [("model.layers.0.self_attn.k_proj", problem)]
    assert report.to_dict()["broken"][0]["problem"] == problem


def test_parameter_gradients_and_mode_are_left_alone(quantized):
    norm = quantized.model.norm.weight
    norm.grad = torch.full_like(norm, 3.0)
    quantized.train()
    check_gradient_flow(quantized, IDS)
    assert torch.equal(norm.grad, torch.full_like(norm, 3.0))
    assert quantized.training
    assert quantized.model.embed_tokens.weight.grad is None


def test_model_without_input_embeddings_is_refused():
    with pytest.raises(MixprecError, match="get_input_embeddings"):
        check_gradient_flow(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4))


def test_a_zero_weight_zeroes_the_input_gradient_by_arithmetic():
    """LoRA's B starts at zero: its input gradient is zero and nothing is broken."""
    model = tiny_llama()
    down = model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        down.weight.zero_()
    report = check_gradient_flow(model, IDS)
    assert report.ok, report.message()
    flow = next(m for m in report.modules if m.name == "model.layers.0.mlp.down_proj")
    assert flow.weight_is_zero and not flow.input_grad_nonzero and flow.output_grad_nonzero
