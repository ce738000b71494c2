"""The high-precision recipes: defined here, applied by mixprec.training (convert / policy / optim)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mixprec.errors import MixprecError
from mixprec.recipes.base import HighPrecisionRecipe


@dataclass(frozen=True)
class Fp32Recipe(HighPrecisionRecipe):
    """True fp32 training: the baseline (no TF32, no autocast)."""

    name: ClassVar[str] = "fp32"
    kind: ClassVar[str] = "fp32"


@dataclass(frozen=True)
class Bf16Recipe(HighPrecisionRecipe):
    """bf16 parameters and compute, fp32 master weights and fp32 gradient accumulation, bf16 Adam moments."""

    master_weights: bool = True
    moments_dtype: str = "bf16"
    name: ClassVar[str] = "bf16"
    kind: ClassVar[str] = "bf16"

    def __post_init__(self) -> None:
        if self.moments_dtype not in ("bf16", "fp32"):
            raise MixprecError(f"moments_dtype must be 'bf16' or 'fp32', got {self.moments_dtype!r}")


@dataclass(frozen=True)
class Bf16AmpRecipe(HighPrecisionRecipe):
    """torch.autocast(dtype=bfloat16) around the forward; fp32 parameters and optimizer."""

    name: ClassVar[str] = "bf16-amp"
    kind: ClassVar[str] = "bf16-amp"


@dataclass(frozen=True)
class Fp16AmpRecipe(HighPrecisionRecipe):
    """torch.autocast(dtype=float16) with dynamic loss scaling (GradScaler); fp32 parameters."""

    init_scale: float = 2.0**14
    growth_interval: int = 1000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    name: ClassVar[str] = "fp16-amp"
    kind: ClassVar[str] = "fp16-amp"

    def __post_init__(self) -> None:
        if not (self.init_scale > 0):
            raise MixprecError(f"init_scale must be positive, got {self.init_scale!r}")
        if not isinstance(self.growth_interval, int) or self.growth_interval < 1:
            raise MixprecError(f"growth_interval must be a positive integer, got {self.growth_interval!r}")


__all__ = ["Bf16AmpRecipe", "Bf16Recipe", "Fp16AmpRecipe", "Fp32Recipe"]
