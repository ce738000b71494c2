"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights before quantizing both.

Per mapping whose previous op is a norm (norm -> q/k/v, norm -> gate/up) and up_proj -> down_proj
(folds.py), from the largest |x_j| each input channel j reached on the calibration batches and the
largest |W_ij| of column j over the following Linears:

    s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha)

then the fold divides channel j of the previous op's output by s_j and multiplies the Linears' column j
by it: the activations' channel maxima become max|X_j|^(1-alpha) max|W_:,j|^(1-alpha), far flatter. A
channel that never fired or whose weights are all zero keeps s_j = 1.

It helps only schemes that quantize activations (W8A8 / W4A4); for weight-only ones it only makes the
weights harder to round: `smoothquant_applies(scheme)` gives the reason the caller refuses it.
v_proj -> o_proj is not smoothed (as in SmoothQuant and llm-compressor's Llama mappings).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.inference.algorithms.folds import (
    NORM,
    BlockMappings,
    FoldMapping,
    block_mappings,
    check_token_batches,
    fold_scales_,
)
from mixprec.inference.schemes import InferenceScheme
from mixprec.kernels.bf16_cpu import gemms_in_fp32


def smoothquant_applies(scheme: str | InferenceScheme) -> str | None:
    """Why SmoothQuant does not apply to `scheme`, or None when it does (the scheme quantizes
    activations: fp8-dynamic, fp8-static, fp8-block, nvfp4, mxfp4, mxfp8)."""
    sch = InferenceScheme.from_name(scheme)
    if sch.input_format is None:
        return (
            f"smoothquant moves activation outliers into the weights, for schemes that quantize activations "
            f"(W8A8 / W4A4); {sch.name} quantizes weights only, where it only makes the weights harder to round"
        )
    return None


def smoothquant_model_(
    model: nn.Module, batches: Sequence[torch.Tensor], alpha: float = 0.5
) -> dict[str, Any]:
    """Smooth every norm -> Linears and up_proj -> down_proj mapping of `model` in place; returns the
    record: alpha, and per mapping the activations' max/median ratio over channels before and after
    (the max of each channel, computed from the observed maxima and s). MixprecError, before any
    change, for a model without Llama-like RMSNorm blocks, alpha outside [0, 1] or bad batches."""
    found, mappings = smoothquant_plan(model, batches, alpha)
    started = time.perf_counter()
    x_max = _activation_max(model, mappings, batches)
    modules = dict(model.named_modules())
    record: dict[str, Any] = {}
    for m in mappings:
        record[m.name] = smooth_mapping_(model, modules, m, x_max[m.linears[0]], alpha)
    return smoothquant_record(found, mappings, record, alpha, batches, time.perf_counter() - started)


def smoothquant_plan(model: nn.Module, batches: Sequence[torch.Tensor], alpha: float,
                     loaded: bool = True) -> tuple[BlockMappings, list[FoldMapping]]:  # fmt: skip
    """(every mapping, those SmoothQuant smooths) with the arguments checked (loaded=False: a skeleton on
    the meta device, block_mappings)."""
    if not 0.0 <= float(alpha) <= 1.0:
        raise MixprecError(f"SmoothQuant alpha (migration strength) must be in [0, 1], got {alpha}")
    check_token_batches(batches)
    found = block_mappings(model, loaded)
    return found, [m for m in found.mappings if m.kind == NORM or m.previous.endswith("up_proj")]


def smooth_mapping_(model: nn.Module, modules: dict[str, nn.Module], m: FoldMapping, x_max: torch.Tensor,
                    alpha: float) -> dict[str, float]:  # fmt: skip
    """Fold one mapping's smoothing scales, from its inputs' channel maxima and its weights as they stand
    (after the block's earlier mappings); its record."""
    w_max = torch.stack([modules[n].weight.detach().abs().amax(dim=0).float() for n in m.linears]).amax(dim=0)
    s = smoothing_scales(x_max, w_max, alpha)
    fold_scales_(model, m, s)
    return {"max_over_median_before": _spread(x_max), "max_over_median_after": _spread(x_max / s)}


def smoothquant_record(found: BlockMappings, mappings: list[FoldMapping], record: dict[str, Any], alpha: float,
                       batches: Sequence[torch.Tensor], seconds: float) -> dict[str, Any]:  # fmt: skip
    skipped = {**found.skipped, **{m.name: "SmoothQuant smooths norm -> Linears and up_proj -> down_proj only"
                                   for m in found.mappings if m not in mappings}}  # fmt: skip
    return {"algorithm": "smoothquant", "alpha": float(alpha), "mappings": record, "skipped": skipped,
            "tokens": sum(b.numel() for b in batches), "seconds": round(seconds, 3)}  # fmt: skip


def smoothing_scales(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = x_max^alpha / w_max^(1-alpha) per channel (fp32), 1 where either maximum is 0."""
    x, w = x_max.float(), w_max.float()
    live = (x > 0) & (w > 0)
    s = x.clamp_min(1e-30).pow(alpha) / w.clamp_min(1e-30).pow(1.0 - alpha)
    return torch.where(live, s, torch.ones_like(s))


class ChannelMaxima:
    """{first following Linear: max |x| per input channel} of mappings, from pre-hooks on those Linears."""

    def __init__(self) -> None:
        self.maxima: dict[str, torch.Tensor] = {}

    def observe(self, name: str):
        def hook(_m, args):
            x = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(dim=0).float()
            self.maxima[name] = torch.maximum(self.maxima[name], x) if name in self.maxima else x

        return hook


def _activation_max(model: nn.Module, mappings: list[FoldMapping], batches: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:  # fmt: skip
    """{first following Linear: max |x| per input channel} over every calibration batch (fp32)."""
    modules = dict(model.named_modules())
    seen = ChannelMaxima()
    handles = [modules[m.linears[0]].register_forward_pre_hook(seen.observe(m.linears[0])) for m in mappings]
    was_training = model.training
    model.eval()
    try:
        # bf16 GEMMs in fp32 on CPUs without fast bf16, as calibration runs them (same values, faster)
        with torch.no_grad(), gemms_in_fp32(model):
            for b in batches:
                model(input_ids=b, use_cache=False)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return seen.maxima


def _spread(channel_max: torch.Tensor) -> float:
    """max over channels / median over channels of the per-channel maxima."""
    med = float(channel_max.median())
    return float(channel_max.max()) / med if med > 0 else float("inf")


__all__ = [
    "ChannelMaxima",
    "smooth_mapping_",
    "smoothing_scales",
    "smoothquant_applies",
    "smoothquant_model_",
    "smoothquant_plan",
    "smoothquant_record",
]
