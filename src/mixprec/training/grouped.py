"""Fused 3-D MoE experts (transformers' MixtralExperts, Qwen2MoeExperts...) with FP8 GEMMs per expert.

transformers stores the experts of a sparse MoE block as two parameters,
    gate_up_proj [E, 2*I, H]   (gate rows first, then up rows: the "concatenated" layout)
    down_proj    [E, H, I]
and loops over the experts that received tokens. ``GroupedFp8Experts`` keeps those parameters (same
objects, same names, so checkpoints and optimizers are unaffected) and runs each expert's two GEMMs
through ``LowPrecisionLinear.linear_with`` (mixprec.training.low_precision_linear) — all three GEMMs
of each, via the one GEMM seam — with one small per-expert "shell" layer holding that expert's recipe
plan and scaling state (amax history under delayed scaling, FP4's [seed, step], so the monitor and the
scaling advance see them like any LowPrecisionLinear). A grouped kernel would batch the experts in one
launch; the numerics are the same.

Layouts this does not know (transposed weights, biases, custom gating, interleaved gate/up) raise
NotImplementedError, and convert_for_training lists the module as skipped with that reason.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.recipes import QUANTIZED_KINDS, from_name
from mixprec.training.low_precision_linear import LowPrecisionLinear
from mixprec.training.quantizer_state import recipe_buffers


def _shell(out_features: int, in_features: int, recipe: Any, name: str, like: torch.Tensor) -> nn.Module:
    """A LowPrecisionLinear without a weight of its own: the expert's slice of the 3-D parameter is
    passed in."""

    meta = nn.Linear(in_features, out_features, bias=False, device="meta", dtype=like.dtype)
    shell = LowPrecisionLinear.from_linear(meta, recipe, name=name)
    del shell.weight  # unregister the meta parameter: the expert's weight slice is passed per call
    shell.weight = torch.empty((), dtype=like.dtype, device=like.device).expand(out_features, in_features)
    # the recipe's buffers were made on the meta weight's device: made again on the experts' device
    for key, buf in recipe_buffers(shell.recipe, like.device).items():
        shell._buffers[key] = buf
    return shell


def _check_layout(module: nn.Module) -> tuple[int, int, int]:
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if (
        not isinstance(gu, nn.Parameter)
        or not isinstance(down, nn.Parameter)
        or gu.dim() != 3
        or down.dim() != 3
    ):
        raise NotImplementedError("needs gate_up_proj [E, 2I, H] and down_proj [E, H, I] parameters")
    if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False):
        raise NotImplementedError("transposed or biased expert weights are not supported")
    if not getattr(module, "is_concatenated", True) or not getattr(module, "has_gate", True):
        raise NotImplementedError("only the concatenated [gate; up] layout is supported")
    gate_fn = getattr(type(module), "_apply_gate", None)
    if gate_fn is not None and getattr(gate_fn, "__name__", "") != "_default_apply_gate":
        raise NotImplementedError(f"{type(module).__name__} has a custom gating function")
    if not callable(getattr(module, "act_fn", None)):
        raise NotImplementedError("no act_fn")
    e, two_i, h = gu.shape
    if two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
        raise NotImplementedError(
            f"unexpected shapes gate_up_proj {tuple(gu.shape)}, down_proj {tuple(down.shape)}"
        )
    return e, two_i // 2, h


class GroupedFp8Experts(nn.Module):
    """Drop-in for a transformers fused-experts module; forward(hidden_states, top_k_index, top_k_weights)."""

    def __init__(self, experts: nn.Module, recipe: Any, name: str | None = None) -> None:
        super().__init__()
        e, i, h = _check_layout(experts)
        self.num_experts, self.intermediate_dim, self.hidden_dim = e, i, h
        self.gate_up_proj = experts.gate_up_proj  # same Parameter objects: optimizers stay valid
        self.down_proj = experts.down_proj
        self.act_fn = experts.act_fn
        prefix = f"{name}." if name else ""
        like = experts.gate_up_proj
        self.fp8_gate_up = nn.ModuleList(
            _shell(2 * i, h, recipe, f"{prefix}gate_up_proj.{k}", like) for k in range(e)
        )
        self.fp8_down = nn.ModuleList(_shell(h, i, recipe, f"{prefix}down_proj.{k}", like) for k in range(e))
        self.source_type = type(experts).__name__

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, shell: nn.Module) -> torch.Tensor:
        if shell.weight.dtype != weight.dtype or shell.weight.device != weight.device:
            shell.weight = torch.empty((), dtype=weight.dtype, device=weight.device).expand(weight.shape)
        return shell.linear_with(x, weight)  # LowPrecisionLinear's public entry for a weight passed in

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            hit = torch.bincount(top_k_index.flatten(), minlength=self.num_experts + 1)[: self.num_experts]
            experts = torch.nonzero(hit).flatten().tolist()
        for k in experts:
            token_idx, k_pos = torch.where(top_k_index == k)
            x = hidden_states[token_idx]
            gate, up = self._linear(x, self.gate_up_proj[k], self.fp8_gate_up[k]).chunk(2, dim=-1)
            y = self._linear(self.act_fn(gate) * up, self.down_proj[k], self.fp8_down[k])
            y = y * top_k_weights[token_idx, k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return f"{self.source_type}: experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}"


def convert_experts(module: nn.Module, recipe: Any, name: str | None = None) -> GroupedFp8Experts:
    """The FP8 replacement of a fused-experts module; NotImplementedError/MixprecError if it cannot be."""
    if from_name(recipe).kind not in QUANTIZED_KINDS:
        raise MixprecError(f"{name or type(module).__name__}: grouped experts need an FP8 or FP4 recipe")
    return GroupedFp8Experts(module, recipe, name)
