"""FP8 inference schemes, the default ignore list, and a scheme's weight quantization.

`quantize_weight` turns a high-precision Linear weight into FP8 + scales for a scheme, through the one
quantize entry (mixprec.quantization.quantize_with_stats: on the CPU its tiled backend, bounded memory
and the error statistics from the same pass). The offline (streaming) path, the online path
(`quantize_model_`) and the loader all call it, so the same weight gives bit-identical payloads and
scales whichever way it was quantized.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mixprec.errors import MixprecError
from mixprec.formats import E4M3, check_float_tensor
from mixprec.quantization import QuantizationStats, quantize_with_stats
from mixprec.scaling import Granularity, QuantizedTensor
from mixprec.select import check_pattern, fp8_dims_reason, selects_any


@dataclass(frozen=True)
class InferenceScheme:
    """How weights and activations of a Linear are quantized to FP8 E4M3 for inference."""

    name: str
    weight_granularity: Granularity
    input_granularity: Granularity
    input_dynamic: bool  # False: one static per-tensor input scale from calibration
    description: str = ""

    @property
    def needs_calibration(self) -> bool:
        return not self.input_dynamic

    @property
    def fmt(self):
        return E4M3

    @classmethod
    def from_name(cls, name: str | InferenceScheme) -> InferenceScheme:
        if isinstance(name, InferenceScheme):
            return name
        if not isinstance(name, str):
            raise MixprecError(f"a scheme must be a name, got {type(name).__name__}")
        key = name.strip().lower().replace("_", "-")
        key = _ALIASES.get(key, key)
        if key not in SCHEMES:
            raise MixprecError(f"unknown inference scheme {name!r}; known: {', '.join(SCHEMES)}")
        return SCHEMES[key]

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        """Shape of the weight scale as stored in a compressed-tensors checkpoint."""
        grid = self.weight_granularity.scale_shape(out_features, in_features)
        return (1,) if grid == (1, 1) and self.weight_granularity.name == "tensor" else grid


SCHEMES: dict[str, InferenceScheme] = {
    s.name: s
    for s in (
        InferenceScheme(
            "fp8-dynamic",
            Granularity.rows(),
            Granularity.rows(),
            True,
            "per-output-channel weight scales, per-token dynamic activation scales",
        ),
        InferenceScheme(
            "fp8-static",
            Granularity.tensor(),
            Granularity.tensor(),
            False,
            "per-tensor weight scales, per-tensor static activation scales from calibration",
        ),
        InferenceScheme(
            "fp8-block",
            Granularity.blocks(128, 128),
            Granularity.blocks(1, 128),
            True,
            "128x128 weight blocks, dynamic 1x128 activation groups (DeepSeek-V3)",
        ),
    )
}
_ALIASES = {"fp8": "fp8-static", "fp8-dynamic-per-token": "fp8-dynamic", "fp8-blockwise": "fp8-block"}


# ---------------------------------------------------------------------------------------------------
# Which modules stay in high precision

# Defaults as in training: output head, embeddings, norms, MoE routers/gates. Module-name patterns of
# mixprec.select: each selects the modules it names and everything below them ("re:" matches from the
# start of a name, as compressed-tensors and vLLM do, hence the leading ".*").
DEFAULT_IGNORE: tuple[str, ...] = (
    "lm_head",
    "re:(.*\\.)?(embed_tokens|embed_in|embed_out|wte|wpe|word_embeddings|position_embeddings|token_type_embeddings|embeddings)$",
    "re:(.*\\.)?[^.]*norm[^.]*$",
    "re:(.*\\.)?(gate|router|shared_expert_gate)$",
)


def resolve_ignore(ignore: Sequence[str] | None, *, defaults: bool = True) -> tuple[str, ...]:
    """User patterns (checked) added to the defaults (pass defaults=False to replace them)."""
    if isinstance(ignore, str):
        ignore = [ignore]
    user = tuple(check_pattern(p, "--ignore pattern") for p in ignore or ())
    return (*DEFAULT_IGNORE, *user) if defaults else user


def skip_reason(name: str, out_features: int, in_features: int, ignore: Sequence[str]) -> str | None:
    """Why this Linear stays in high precision, or None when it is quantized."""
    if selects_any(name, ignore):
        return "ignored by pattern"
    return fp8_dims_reason(out_features, in_features)


# ---------------------------------------------------------------------------------------------------
# Weight quantization


def check_finite(w: torch.Tensor, name: str) -> None:
    """MixprecError naming the tensor if it holds NaN or inf (one pass, no tensor-sized temporaries)."""
    if w.numel() == 0 or not w.is_floating_point():
        return
    lo, hi = torch.aminmax(w)  # NaN propagates; an inf shows in lo or hi
    if math.isfinite(float(lo)) and math.isfinite(float(hi)):
        return
    if not bool(torch.isfinite(w).all()):
        bad = int((~torch.isfinite(w)).sum())
        raise MixprecError(f"tensor {name!r} has {bad} NaN/inf values; refusing to quantize it")


def quantize_weight(
    w: torch.Tensor,
    scheme: InferenceScheme,
    name: str = "weight",
    scale: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> tuple[QuantizedTensor, QuantizationStats]:
    """FP8 E4M3 weight + scales for `scheme` (its weight granularity), with statistics:
    quantize_with_stats(w, E4M3, scheme.weight_granularity, scale=scale, out=out). `out`: a contiguous
    E4M3 tensor of w's shape to hold the payload (a buffer the caller reuses). MixprecError naming the
    tensor if it is not a 2-D floating-point weight or holds NaN/inf."""
    if w.dim() != 2:
        raise MixprecError(f"{name!r}: a Linear weight must be 2-D, got shape {tuple(w.shape)}")
    check_float_tensor(w, name)
    q, stats = quantize_with_stats(w, E4M3, scheme.weight_granularity, scale=scale, out=out)
    if not math.isfinite(stats.relative_error):
        check_finite(w, name)  # NaN/inf raise here, naming the tensor
    return q, stats
