"""The FP8 recipes: delayed, current, rowwise, blockwise (DeepSeek-V3), MXFP8, and the unscaled
negative control."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mixprec.errors import MixprecError
from mixprec.formats import E4M3, E5M2, Format
from mixprec.recipes.base import QuantizedRecipe
from mixprec.scaling import Granularity

FP8_FORMATS = ("hybrid", "e4m3")


def hybrid_format(fp8_format: str, role: str) -> Format:
    # hybrid: E4M3 (more precision) for inputs and weights, E5M2 (more range) for gradients
    return E5M2 if fp8_format == "hybrid" and role == "grad_output" else E4M3


def check_fp8_format(fp8_format: str) -> None:
    if fp8_format not in FP8_FORMATS:
        raise MixprecError(f"fp8_format must be one of {', '.join(FP8_FORMATS)}, got {fp8_format!r}")


class Fp8Recipe(QuantizedRecipe):
    """Shared behaviour of the FP8 recipes: E4M3 payloads unless a recipe gives a role E5M2."""

    kind: ClassVar[str] = "fp8"

    def role_format(self, role: str) -> Format:
        return E4M3


@dataclass(frozen=True)
class DelayedScaling(Fp8Recipe):
    """Per-tensor scales from the amax history of earlier optimizer steps (TransformerEngine's default).

    amax_history_len: steps of history kept; amax_compute_algo: "max" over the history or
    "most_recent" (the last finished step); margin: scale = amax / (fmt.max * 2**margin).
    Before the first optimizer step there is no history: the layer scales from the current amax.
    current_while_growing: a role whose amax just set a record (above every step in its history) scales
    from its own amax on the next step, until the history bounds it again — early training, where the
    amax grows step after step and the history lags (see mixprec.training.scaling_state); False is
    TransformerEngine's delayed scaling (`fp8-delayed:growing=false`).
    """

    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0
    fp8_format: str = "hybrid"
    current_while_growing: bool = True
    name: ClassVar[str] = "fp8-delayed"
    delayed: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise MixprecError(f"amax_history_len must be a positive integer, got {self.amax_history_len!r}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise MixprecError(
                f"amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}"
            )
        if not isinstance(self.margin, int) or self.margin < 0:
            raise MixprecError(f"margin must be a non-negative integer, got {self.margin!r}")
        check_fp8_format(self.fp8_format)

    def role_format(self, role: str) -> Format:
        return hybrid_format(self.fp8_format, role)

    def granularity(self, role: str, transposed: bool) -> Granularity:
        return Granularity.tensor()


@dataclass(frozen=True)
class CurrentScaling(Fp8Recipe):
    """Per-tensor scales from this step's amax of each tensor (just in time)."""

    fp8_format: str = "hybrid"
    name: ClassVar[str] = "fp8-current"

    def __post_init__(self) -> None:
        check_fp8_format(self.fp8_format)

    def role_format(self, role: str) -> Format:
        return hybrid_format(self.fp8_format, role)

    def granularity(self, role: str, transposed: bool) -> Granularity:
        return Granularity.tensor()


@dataclass(frozen=True)
class RowwiseScaling(Fp8Recipe):
    """One scale per row along K: per token for activations and gradients, per output channel for W
    forward; backward operands are re-quantized per row of their transposed view. E4M3 throughout."""

    name: ClassVar[str] = "fp8-rowwise"

    def granularity(self, role: str, transposed: bool) -> Granularity:
        return Granularity.rows()


@dataclass(frozen=True)
class BlockwiseScaling(Fp8Recipe):
    """DeepSeek-V3: 1x128 tiles (along K) for activations and gradients, 128x128 blocks for weights, E4M3.

    grad_weight takes dY and X in 128x1 tiles (1x128 tiles of their transposes); Wᵀ reuses W's
    128x128 blocks transposed. power_of_two_scales rounds every scale up to a power of two.
    """

    power_of_two_scales: bool = False
    name: ClassVar[str] = "fp8-blockwise"
    tile: ClassVar[int] = 128

    def granularity(self, role: str, transposed: bool) -> Granularity:
        if role == "weight":
            return Granularity.blocks(self.tile, self.tile)
        return Granularity.blocks(1, self.tile)

    def power_of_two(self) -> bool:
        return self.power_of_two_scales


@dataclass(frozen=True)
class MXFP8Scaling(Fp8Recipe):
    """OCP MX: blocks of 32 consecutive elements along each GEMM's K with E8M0 power-of-two scales, E4M3.

    rounding: "floor" (OCP MX v1.0: 2^(floor(log2 amax) - 8), may saturate the top of a block) or
    "rceil" (smallest power of two >= amax / 448, never saturates).
    """

    rounding: str = "floor"
    name: ClassVar[str] = "fp8-mxfp8"
    block: ClassVar[int] = 32

    def __post_init__(self) -> None:
        if self.rounding not in ("floor", "rceil"):
            raise MixprecError(f"MXFP8 rounding must be 'floor' or 'rceil', got {self.rounding!r}")

    def granularity(self, role: str, transposed: bool) -> Granularity:
        return Granularity.mx(self.block, axis=-1, rounding=self.rounding)


@dataclass(frozen=True)
class UnscaledFp8(Fp8Recipe):
    """NEGATIVE CONTROL, never for real training: E4M3 casts with scale 1 (no scaling at all).
    Gradients underflow and large activations saturate; the compare tool must flag it."""

    name: ClassVar[str] = "fp8-unscaled"
    fixed_scale: ClassVar[float] = 1.0

    def granularity(self, role: str, transposed: bool) -> Granularity:
        return Granularity.tensor()


__all__ = [
    "FP8_FORMATS",
    "BlockwiseScaling",
    "CurrentScaling",
    "DelayedScaling",
    "Fp8Recipe",
    "MXFP8Scaling",
    "RowwiseScaling",
    "UnscaledFp8",
    "check_fp8_format",
    "hybrid_format",
]
