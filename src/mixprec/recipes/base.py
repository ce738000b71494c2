"""What every recipe shares: the kinds, roles and GEMMs, the operand layouts, the base of the quantized
recipes (FP8 and FP4 derive from it as siblings) and the high-precision one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mixprec.errors import MixprecError
from mixprec.formats import Format
from mixprec.recipes.options import spec_of
from mixprec.scaling import Granularity

KINDS = ("fp32", "bf16", "bf16-amp", "fp16-amp", "fp8", "fp4")
"""What a recipe does to a model (`Recipe.kind`): fp32 / bf16 parameters, fp32 parameters under bf16 or
fp16 autocast, FP8 GEMMs or FP4 GEMMs (bf16 parameters). Training converts by kind; comparisons pick
baselines and thresholds by kind."""
QUANTIZED_KINDS = ("fp8", "fp4")
"""The kinds whose Linear GEMMs run quantized (mixprec.training.LowPrecisionLinear takes both)."""
ROLES = ("input", "weight", "grad_output")
GEMMS = ("output", "grad_input", "grad_weight")


@dataclass(frozen=True)
class OperandLayout:
    """How one GEMM operand is quantized.

    role: the layer tensor it comes from ("input", "weight", "grad_output").
    transposed: the operand is the transposed 2-D view of that tensor (Wᵀ, dYᵀ, Xᵀ).
    granularity: on the operand as the GEMM sees it ([rows, K]); scales constant along K.
    """

    role: str
    fmt: Format
    granularity: Granularity
    transposed: bool = False
    power_of_two: bool = False
    hadamard: bool = False  # random Hadamard transform along K before quantizing (FP4 wgrad operands)
    stochastic: bool = False  # stochastic rounding of the payload (FP4 gradients)


@dataclass(frozen=True)
class GemmLayout:
    """The two operands of one GEMM: out = a @ b.T."""

    gemm: str
    a: OperandLayout
    b: OperandLayout


# (role, transposed) of a and b, per GEMM
_OPERANDS = {
    "output": (("input", False), ("weight", False)),
    "grad_input": (("grad_output", False), ("weight", True)),
    "grad_weight": (("grad_output", True), ("input", True)),
}


class QuantizedRecipe:
    """What every quantized recipe shares (a mixin for the frozen dataclasses of recipes.fp8 and
    recipes.fp4): the operand layout of each GEMM from a format per role and a granularity per
    operand, the formats, the description and the spec."""

    name: ClassVar[str]
    kind: ClassVar[str]
    delayed: ClassVar[bool] = False  # scales from earlier steps' amax (module buffers)

    def role_format(self, role: str) -> Format:
        raise NotImplementedError

    def granularity(self, role: str, transposed: bool) -> Granularity:
        raise NotImplementedError

    def power_of_two(self) -> bool:
        return False

    def hadamard(self, role: str, transposed: bool) -> bool:
        """Whether this operand is multiplied by the random Hadamard transform before quantizing."""
        return False

    def stochastic(self, role: str) -> bool:
        """Whether this role's payloads are rounded stochastically."""
        return False

    def operand(self, role: str, transposed: bool) -> OperandLayout:
        check_role(role)
        return OperandLayout(
            role, self.role_format(role), self.granularity(role, transposed), transposed, self.power_of_two(),
            self.hadamard(role, transposed), self.stochastic(role),
        )  # fmt: skip

    def gemm_layout(self, gemm: str) -> GemmLayout:
        if gemm not in _OPERANDS:
            raise MixprecError(f"unknown GEMM {gemm!r}; the Linear GEMMs are {', '.join(GEMMS)}")
        (ra, ta), (rb, tb) = _OPERANDS[gemm]
        return GemmLayout(gemm, self.operand(ra, ta), self.operand(rb, tb))

    def precision_layout(self) -> dict[str, Granularity]:
        """role -> granularity of the role's primary quantization, in the tensor's own orientation:
        input and weight as quantized for the forward GEMM, grad_output for the grad_input GEMM."""
        return {role: self.granularity(role, False) for role in ROLES}

    def formats(self) -> dict[str, Format]:
        return {role: self.role_format(role) for role in ROLES}

    def describe(self) -> str:
        """One line per GEMM: operand, format, granularity (for reports and docs)."""
        lines = [f"{self.spec()}:"]
        for gemm in GEMMS:
            lay = self.gemm_layout(gemm)
            ops = []
            for op in (lay.a, lay.b):
                sym = {"input": "X", "weight": "W", "grad_output": "dY"}[op.role] + (
                    "ᵀ" if op.transposed else ""
                )
                extra = ("+RHT" if op.hadamard else "") + ("+SR" if op.stochastic else "")
                ops.append(f"{sym} {op.fmt.name} {op.granularity.name}{extra}")
            lines.append(f"  {gemm:<11} " + " · ".join(ops))
        return "\n".join(lines)

    def spec(self) -> str:
        """The name with options that from_name() reads back to an equal recipe."""
        return spec_of(self)


def check_role(role: str) -> None:
    if role not in ROLES:
        raise MixprecError(f"unknown tensor role {role!r}; roles are {', '.join(ROLES)}")


class HighPrecisionRecipe:
    """What every high-precision recipe shares: a spec() that from_name() reads back."""

    name: ClassVar[str]
    kind: ClassVar[str]

    def spec(self) -> str:
        return spec_of(self)


__all__ = [
    "GEMMS",
    "KINDS",
    "QUANTIZED_KINDS",
    "ROLES",
    "GemmLayout",
    "HighPrecisionRecipe",
    "OperandLayout",
    "QuantizedRecipe",
    "check_role",
]
