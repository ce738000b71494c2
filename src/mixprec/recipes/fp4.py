"""The FP4 training recipes: NVFP4 (after TransformerEngine's NVFP4BlockScaling) and MXFP4."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mixprec.errors import MixprecError
from mixprec.formats import E2M1, Format
from mixprec.recipes.base import QuantizedRecipe
from mixprec.scaling import Granularity


class Fp4Recipe(QuantizedRecipe):
    """Shared behaviour of the FP4 recipes: E2M1 payloads everywhere, current (just-in-time) scales,
    the random Hadamard transform on the two wgrad operands, stochastic rounding of gradients.

    Fields every FP4 recipe has: rht, stochastic_rounding, two_d, keep_last (the last N blocks of
    the model stay in bf16, mixprec.training.policy.last_blocks), seed (of the RHT signs and the
    rounding noise; the same on every rank, recorded in the spec and in each layer's state)."""

    kind: ClassVar[str] = "fp4"
    rht: bool
    stochastic_rounding: bool
    keep_last: int
    seed: int

    def role_format(self, role: str) -> Format:
        return E2M1

    def hadamard(self, role: str, transposed: bool) -> bool:
        # only the wgrad GEMM's operands (dYᵀ and Xᵀ: the transposed input and gradient), both of them
        return self.rht and transposed and role in ("input", "grad_output")

    def stochastic(self, role: str) -> bool:
        return self.stochastic_rounding and role == "grad_output"

    def _check_common(self) -> None:
        for key in ("rht", "stochastic_rounding", "two_d"):
            if not isinstance(getattr(self, key), bool):
                raise MixprecError(f"{self.name}: {key} must be true or false, got {getattr(self, key)!r}")
        if not isinstance(self.keep_last, int) or self.keep_last < 0:
            raise MixprecError(
                f"{self.name}: keep_last must be a non-negative integer, got {self.keep_last!r}"
            )
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise MixprecError(f"{self.name}: seed must be an integer in [0, 2^32), got {self.seed!r}")


@dataclass(frozen=True)
class NVFP4Training(Fp4Recipe):
    """NVFP4 training after TransformerEngine's NVFP4BlockScaling (arXiv 2509.25149).

    E2M1 payloads with E4M3 block scales times one fp32 global scale per tensor (current scaling):
    1x16 blocks along K for activations and gradients; 16x16 two-dimensional blocks for the weight
    (two_d), so the forward GEMM and grad_input (Wᵀ: the same payload and scales, transposed) see the
    same quantized weight; stochastic rounding of grad_output in both backward GEMMs; the 16x16 random
    Hadamard transform on dYᵀ and Xᵀ, the operands of grad_weight (along the tokens). Options turn
    each off: ``fp4-nvfp4:rht=false``, ``sr=false``, ``2d=false``; ``keep_last=N`` keeps the model's
    last N blocks in bf16; ``seed=S``.
    """

    rht: bool = True
    stochastic_rounding: bool = True
    two_d: bool = True
    keep_last: int = 0
    seed: int = 0
    name: ClassVar[str] = "fp4-nvfp4"
    block: ClassVar[int] = 16

    def __post_init__(self) -> None:
        self._check_common()

    def granularity(self, role: str, transposed: bool) -> Granularity:
        if role == "weight" and self.two_d:
            return Granularity.nvfp4(self.block, self.block)
        return Granularity.nvfp4(1, self.block)


@dataclass(frozen=True)
class MXFP4Training(Fp4Recipe):
    """MXFP4 training: E2M1 in 1x32 blocks along each GEMM's K with E8M0 power-of-two scales.

    The weight is blocked as torchao's MX training blocks it (the nearest anchor: TransformerEngine
    has no MXFP4 recipe): 1x32 along K in every GEMM, so Wᵀ for grad_input is re-quantized along
    the output channels — the only operand layout MX tensor cores take, at the price that forward and
    backward see two different quantizations of W. ``2d=true`` instead gives W 32x32 blocks (one
    E8M0 scale per block, expressible in the 1x32 hardware layout by repeating it over 32 rows), so
    both GEMMs see the same quantized weight, as NVFP4's 16x16 blocks do. rounding: the E8M0
    exponent rule (floor: OCP MX v1.0 and torchao's MX training default; rceil; even). RHT and
    stochastic rounding are off by default (torchao's MX training has neither) and can be switched on.
    """

    rht: bool = False
    stochastic_rounding: bool = False
    two_d: bool = False
    keep_last: int = 0
    seed: int = 0
    rounding: str = "floor"
    name: ClassVar[str] = "fp4-mxfp4"
    block: ClassVar[int] = 32

    def __post_init__(self) -> None:
        self._check_common()
        if self.rounding not in ("floor", "rceil", "even"):
            raise MixprecError(f"MXFP4 rounding must be 'floor', 'rceil' or 'even', got {self.rounding!r}")

    def granularity(self, role: str, transposed: bool) -> Granularity:
        if role == "weight" and self.two_d:
            return Granularity(self.block, self.block, "e8m0", self.rounding)
        return Granularity.mx(self.block, axis=-1, rounding=self.rounding)


__all__ = ["Fp4Recipe", "MXFP4Training", "NVFP4Training"]
