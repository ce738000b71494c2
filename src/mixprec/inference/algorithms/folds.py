"""Per-input-channel scale folds of a Llama-like decoder block, the ground AWQ and SmoothQuant stand on.

A mapping is a previous op and the Linears that read its output. Dividing the previous op's output
channel j by s_j and multiplying the following Linears' input column j by s_j leaves the model's
function unchanged (exactly, in exact arithmetic); quantization then sees weights and activations with
their outliers moved. The folded model is an ordinary one: the checkpoint written from it is served
unchanged.

The mappings of an RMSNorm decoder block (Llama, Qwen2/3, Mistral, SmolLM2), as AutoAWQ and
llm-compressor define them:

    input_layernorm          -> self_attn.q_proj, k_proj, v_proj   (parent: self_attn)
    self_attn.v_proj         -> self_attn.o_proj                   (parent: o_proj; only when v's
                                 output width equals o's input width: not under grouped-query attention)
    post_attention_layernorm -> mlp.gate_proj, up_proj             (parent: mlp)
    mlp.up_proj              -> mlp.down_proj                      (parent: down_proj)

The parent is the module whose output AWQ compares (it holds the following Linears). A norm qualifies
when its output is its weight times something that does not depend on the weight (an RMSNorm without
bias; Gemma's (1 + weight) norm does not): checked on the norm itself before anything changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from mixprec.errors import MixprecError
from mixprec.inference.schemes import check_finite

NORM = "norm"
LINEAR = "linear"

# (previous op, following Linears, parent) of each mapping, relative to a decoder block
_ATTN_IN = ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn")
_ATTN_OUT = ("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj")
_MLP_IN = ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp")
_MLP_OUT = ("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj")
_BLOCK_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


@dataclass(frozen=True)
class FoldMapping:
    """previous: the module whose output channels are divided by s (a norm or a Linear, full name);
    linears: the Linears whose input columns are multiplied by s; parent: the module whose output
    AWQ compares; kind: NORM or LINEAR (what `previous` is)."""

    previous: str
    linears: tuple[str, ...]
    parent: str
    kind: str

    @property
    def name(self) -> str:
        """How records name it: 'model.layers.0.input_layernorm -> q_proj,k_proj,v_proj'."""
        return f"{self.previous} -> {','.join(n.rsplit('.', 1)[-1] for n in self.linears)}"


@dataclass(frozen=True)
class BlockMappings:
    """The mappings of a model's decoder blocks, in model order, and those left out with the reason
    ({mapping name: why})."""

    mappings: tuple[FoldMapping, ...]
    skipped: dict[str, str]

    def inside(self, prefix: str) -> list[FoldMapping]:
        """The mappings of the block whose module names start with `prefix` ('model.layers.3.')."""
        return [m for m in self.mappings if m.previous.startswith(prefix)]


def block_mappings(model: nn.Module, loaded: bool = True) -> BlockMappings:
    """Every decoder block's mappings; MixprecError (nothing changed) when the model has no Llama-like
    RMSNorm blocks, a block's norm is not a plain scaling by its weight, or a weight to fold holds
    NaN or inf. loaded=False: a skeleton whose weights are on the meta device (fold_checkpoint.py):
    the structure is checked here, each block's norms and weights by check_block once it is read."""
    modules = dict(model.named_modules())
    blocks = [name for name in modules if _is_llama_block(modules, name)]
    if not blocks:
        raise MixprecError(
            f"AWQ / SmoothQuant fold scales into Llama-like decoder blocks (input_layernorm -> "
            f"self_attn.q/k/v_proj, post_attention_layernorm -> mlp.gate/up_proj, mlp.down_proj); "
            f"{type(model).__name__} has none"
        )
    mappings: list[FoldMapping] = []
    skipped: dict[str, str] = {}
    for block in blocks:
        for norm in ("input_layernorm", "post_attention_layernorm"):
            why = _norm_reason(modules[f"{block}.{norm}"], probe=loaded)
            if why:
                raise MixprecError(f"cannot fold scales into {block}.{norm}: {why}")
        for previous, linears, parent in (_ATTN_IN, _ATTN_OUT, _MLP_IN, _MLP_OUT):
            kind = LINEAR if previous.endswith("_proj") else NORM
            m = FoldMapping(
                f"{block}.{previous}", tuple(f"{block}.{n}" for n in linears), f"{block}.{parent}", kind
            )
            why = _width_reason(modules, m)
            if why:
                skipped[m.name] = why
            else:
                mappings.append(m)
    found = BlockMappings(tuple(mappings), skipped)
    if loaded:  # a NaN met halfway would leave the earlier blocks folded
        _check_weights(modules, found.mappings)
    return found


def check_block(modules: dict[str, nn.Module], found: BlockMappings, prefix: str) -> None:
    """The checks block_mappings(loaded=False) left for when the block `prefix` ('model.layers.3.') is
    read: its norms scale with their weights, its weights to fold are finite."""
    for norm in ("input_layernorm", "post_attention_layernorm"):
        why = _norm_reason(modules[f"{prefix}{norm}"])
        if why:
            raise MixprecError(f"cannot fold scales into {prefix}{norm}: {why}")
    _check_weights(modules, found.inside(prefix))


def _check_weights(modules: dict[str, nn.Module], mappings) -> None:
    for m in mappings:
        for name in (m.previous, *m.linears):
            check_finite(modules[name].weight.detach(), f"{name}.weight")


def _is_llama_block(modules: dict[str, nn.Module], name: str) -> bool:
    prefix = f"{name}." if name else ""
    if any(f"{prefix}{p}" not in modules for p in _BLOCK_PARTS):
        return False
    # Gemma-2/3 and OLMo-2 blocks carry extra norms around the sublayers: the mappings above do not hold
    return (
        all(isinstance(modules[f"{prefix}{p}"], nn.Linear) for p in _BLOCK_PARTS if p.endswith("_proj"))
        and f"{prefix}pre_feedforward_layernorm" not in modules
    )


def _norm_reason(norm: nn.Module, probe: bool = True) -> str | None:
    """Why dividing this norm's weight by s does not divide its output by s, or None (probe=False: the
    weight is not read yet; everything but the probe)."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return f"{type(norm).__name__} has no 1-D weight"
    if getattr(norm, "bias", None) is not None:
        return f"{type(norm).__name__} has a bias (an RMSNorm has none)"
    if not probe:
        return None
    # the output must scale with the weight: norm(x; 2w) == 2 norm(x; w) (not so for Gemma's 1 + w)
    probe = torch.randn(2, weight.numel(), generator=torch.Generator().manual_seed(0)).to(weight)
    with torch.no_grad():
        out = norm(probe)
        doubled = functional_call(norm, {"weight": weight * 2}, (probe,))
    if not torch.allclose(doubled.float(), 2 * out.float(), rtol=1e-2, atol=1e-6):
        return (
            f"{type(norm).__name__}'s output does not scale with its weight (not weight * normalized input)"
        )
    return None


def _width_reason(modules: dict[str, nn.Module], m: FoldMapping) -> str | None:
    width = _out_width(modules[m.previous])
    for name in m.linears:
        k = modules[name].in_features
        if k != width:
            grouped = " (grouped-query attention)" if m.previous.endswith("v_proj") else ""
            return (
                f"{m.previous.rsplit('.', 1)[-1]} gives {width} channels and {name.rsplit('.', 1)[-1]} reads "
                f"{k}{grouped}: no channel-wise scale folds between them"
            )
    return None


def _out_width(module: nn.Module) -> int:
    return module.out_features if isinstance(module, nn.Linear) else module.weight.numel()


def check_scales(s: torch.Tensor, width: int, what: str) -> None:
    """MixprecError unless s is a finite, positive vector of `width` scales."""
    if s.dim() != 1 or s.numel() != width:
        raise MixprecError(f"{what}: expected {width} per-channel scales, got shape {tuple(s.shape)}")
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise MixprecError(f"{what}: fold scales must be finite and positive")


def check_token_batches(batches: Sequence[torch.Tensor]) -> None:
    """MixprecError unless `batches` is a non-empty list of [B, S] token-id tensors."""
    if isinstance(batches, torch.Tensor) or len(batches) == 0:
        raise MixprecError("calibration batches must be a non-empty list of [batch, seq] token-id tensors")
    for b in batches:
        if not isinstance(b, torch.Tensor) or b.dim() != 2 or b.is_floating_point() or b.numel() == 0:
            what = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
            raise MixprecError(
                f"a calibration batch must be a non-empty [batch, seq] tensor of token ids, got {what}"
            )


def fold_scales_(model: nn.Module, mapping: FoldMapping, s: torch.Tensor) -> None:
    """Divide the previous op's output channels by s and multiply the following Linears' input columns
    by s, in place, computed in fp64 and cast back to each tensor's dtype. MixprecError (nothing
    changed) when s is not `width` finite positive scales."""
    modules = dict(model.named_modules())
    previous = modules[mapping.previous]
    check_scales(s, _out_width(previous), mapping.name)
    s64 = s.detach().to(torch.float64)
    with torch.no_grad():
        # a norm's weight is its output channels; a Linear's are its weight rows and its bias
        _scale_rows_(previous.weight, 1.0 / s64)
        bias = getattr(previous, "bias", None)
        if mapping.kind == LINEAR and bias is not None:
            _scale_rows_(bias, 1.0 / s64)
        for name in mapping.linears:
            w = modules[name].weight
            w.copy_((w.double() * s64.to(w.device)[None, :]).to(w.dtype))


def _scale_rows_(t: torch.Tensor, factor: torch.Tensor) -> None:
    shape = (-1,) + (1,) * (t.dim() - 1)
    t.copy_((t.double() * factor.to(t.device).reshape(shape)).to(t.dtype))


__all__ = [
    "LINEAR",
    "NORM",
    "BlockMappings",
    "FoldMapping",
    "block_mappings",
    "check_block",
    "check_scales",
    "check_token_batches",
    "fold_scales_",
]
