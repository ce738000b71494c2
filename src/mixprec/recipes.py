"""Training recipes: which precision each tensor of a Linear gets, and how it is scaled.

A recipe is a frozen dataclass. The FP8 recipes also say, for each of the three GEMMs of a Linear
layer, how each operand is quantized (`gemm_layout`). The GEMM seam (`mixprec.gemm.scaled_mm`)
computes a @ b.T with a [M, K] and b [N, K], so every operand is described in its own GEMM
orientation, with the reduction dimension K as its columns:

    GEMM         a (rows x K)                      b (rows x K)
    output       x   [tokens, in]                  W   [out, in]
    grad_input   dY  [tokens, out]                 Wᵀ  [in, out]       (b is W transposed)
    grad_weight  dYᵀ [out, tokens]                 Xᵀ  [in, tokens]    (both transposed)

Every granularity is one whose scales are constant along K within a kernel's K-block (per tensor,
per row, 1x128 tiles, 128x128 blocks, 1x32 MX blocks), the only layouts hardware FP8 GEMMs accept.
So a per-token scale of x becomes, for grad_weight, a per-input-channel scale of Xᵀ: rowwise, tile
and MX recipes re-quantize the transposed operands along their new K.

Names (CLI and `from_name`): fp8-delayed, fp8-current, fp8-rowwise, fp8-blockwise, fp8-mxfp8,
fp8-unscaled (a deliberately broken negative control), fp32, bf16, bf16-amp, fp16-amp.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from mixprec.errors import MixprecError
from mixprec.formats import E4M3, E5M2, Format
from mixprec.scaling import Granularity

KINDS = ("fp32", "bf16", "bf16-amp", "fp16-amp", "fp8")
"""What a recipe does to a model (`Recipe.kind`): fp32 / bf16 parameters, fp32 parameters under bf16 or
fp16 autocast, or FP8 GEMMs (bf16 parameters). Training converts by kind; comparisons pick baselines and
thresholds by kind."""
ROLES = ("input", "weight", "grad_output")
GEMMS = ("output", "grad_input", "grad_weight")
FP8_FORMATS = ("hybrid", "e4m3")


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


class Fp8Recipe:
    """Shared behaviour of the FP8 recipes (a mixin for the frozen dataclasses below)."""

    name: ClassVar[str]
    kind: ClassVar[str] = "fp8"
    delayed: ClassVar[bool] = False  # scales from earlier steps' amax (module buffers)

    def role_format(self, role: str) -> Format:
        return E4M3

    def granularity(self, role: str, transposed: bool) -> Granularity:
        raise NotImplementedError

    def power_of_two(self) -> bool:
        return False

    def operand(self, role: str, transposed: bool) -> OperandLayout:
        _check_role(role)
        return OperandLayout(
            role, self.role_format(role), self.granularity(role, transposed), transposed, self.power_of_two()
        )

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
                ops.append(f"{sym} {op.fmt.name} {op.granularity.name}")
            lines.append(f"  {gemm:<11} " + " · ".join(ops))
        return "\n".join(lines)

    def spec(self) -> str:
        """The name with options that from_name() reads back to an equal recipe."""
        return _spec(self)


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise MixprecError(f"unknown tensor role {role!r}; roles are {', '.join(ROLES)}")


def _hybrid_format(fp8_format: str, role: str) -> Format:
    # hybrid: E4M3 (more precision) for inputs and weights, E5M2 (more range) for gradients
    return E5M2 if fp8_format == "hybrid" and role == "grad_output" else E4M3


def _check_fp8_format(fp8_format: str) -> None:
    if fp8_format not in FP8_FORMATS:
        raise MixprecError(f"fp8_format must be one of {', '.join(FP8_FORMATS)}, got {fp8_format!r}")


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
        _check_fp8_format(self.fp8_format)

    def role_format(self, role: str) -> Format:
        return _hybrid_format(self.fp8_format, role)

    def granularity(self, role: str, transposed: bool) -> Granularity:
        return Granularity.tensor()


@dataclass(frozen=True)
class CurrentScaling(Fp8Recipe):
    """Per-tensor scales from this step's amax of each tensor (just in time)."""

    fp8_format: str = "hybrid"
    name: ClassVar[str] = "fp8-current"

    def __post_init__(self) -> None:
        _check_fp8_format(self.fp8_format)

    def role_format(self, role: str) -> Format:
        return _hybrid_format(self.fp8_format, role)

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


# ---------------------------------------------------------------------------------------------------
# Non-FP8 recipes: defined here, applied by mixprec.training (convert / policy / optim).


class _HighPrecisionRecipe:
    """What every non-FP8 recipe shares: a spec() that from_name() reads back."""

    name: ClassVar[str]
    kind: ClassVar[str]

    def spec(self) -> str:
        return _spec(self)


@dataclass(frozen=True)
class Fp32Recipe(_HighPrecisionRecipe):
    """True fp32 training: the baseline (no TF32, no autocast)."""

    name: ClassVar[str] = "fp32"
    kind: ClassVar[str] = "fp32"


@dataclass(frozen=True)
class Bf16Recipe(_HighPrecisionRecipe):
    """bf16 parameters and compute, fp32 master weights and fp32 gradient accumulation, bf16 Adam moments."""

    master_weights: bool = True
    moments_dtype: str = "bf16"
    name: ClassVar[str] = "bf16"
    kind: ClassVar[str] = "bf16"

    def __post_init__(self) -> None:
        if self.moments_dtype not in ("bf16", "fp32"):
            raise MixprecError(f"moments_dtype must be 'bf16' or 'fp32', got {self.moments_dtype!r}")


@dataclass(frozen=True)
class Bf16AmpRecipe(_HighPrecisionRecipe):
    """torch.autocast(dtype=bfloat16) around the forward; fp32 parameters and optimizer."""

    name: ClassVar[str] = "bf16-amp"
    kind: ClassVar[str] = "bf16-amp"


@dataclass(frozen=True)
class Fp16AmpRecipe(_HighPrecisionRecipe):
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


Recipe = (
    DelayedScaling
    | CurrentScaling
    | RowwiseScaling
    | BlockwiseScaling
    | MXFP8Scaling
    | UnscaledFp8
    | Fp32Recipe
    | Bf16Recipe
    | Bf16AmpRecipe
    | Fp16AmpRecipe
)

RECIPES: dict[str, type] = {
    cls.name: cls
    for cls in (
        DelayedScaling,
        CurrentScaling,
        RowwiseScaling,
        BlockwiseScaling,
        MXFP8Scaling,
        UnscaledFp8,
        Fp32Recipe,
        Bf16Recipe,
        Bf16AmpRecipe,
        Fp16AmpRecipe,
    )
}

# option keyword -> dataclass field, per recipe name (the short words the CLI accepts)
_KEYWORDS: dict[str, dict[str, str]] = {
    "fp8-delayed": {
        "history": "amax_history_len",
        "amax_history_len": "amax_history_len",
        "algo": "amax_compute_algo",
        "amax_compute_algo": "amax_compute_algo",
        "margin": "margin",
        "format": "fp8_format",
        "fp8_format": "fp8_format",
        "growing": "current_while_growing",
        "current_while_growing": "current_while_growing",
    },
    "fp8-current": {"format": "fp8_format", "fp8_format": "fp8_format"},
    "fp8-blockwise": {"pow2": "power_of_two_scales", "power_of_two_scales": "power_of_two_scales"},
    "fp8-mxfp8": {"rounding": "rounding"},
    "bf16": {"master": "master_weights", "master_weights": "master_weights", "moments": "moments_dtype"},
    "fp16-amp": {
        "init_scale": "init_scale",
        "growth_interval": "growth_interval",
        "growth_factor": "growth_factor",
        "backoff_factor": "backoff_factor",
    },
}

# bare option words (no "=") -> (field, value)
_FLAGS: dict[str, dict[str, tuple[str, object]]] = {
    "fp8-delayed": {
        "hybrid": ("fp8_format", "hybrid"),
        "e4m3": ("fp8_format", "e4m3"),
        "max": ("amax_compute_algo", "max"),
        "most_recent": ("amax_compute_algo", "most_recent"),
    },
    "fp8-current": {"hybrid": ("fp8_format", "hybrid"), "e4m3": ("fp8_format", "e4m3")},
    "fp8-blockwise": {"pow2": ("power_of_two_scales", True)},
    "fp8-mxfp8": {"floor": ("rounding", "floor"), "rceil": ("rounding", "rceil")},
}


def _parse_value(raw: str, like: object, where: str) -> object:
    if isinstance(like, bool):
        low = raw.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise MixprecError(f"{where}: expected a boolean (true/false), got {raw!r}")
    if isinstance(like, int):
        try:
            return int(raw)
        except ValueError:
            raise MixprecError(f"{where}: expected an integer, got {raw!r}") from None
    if isinstance(like, float):
        try:
            return float(eval_power(raw))
        except ValueError:
            raise MixprecError(f"{where}: expected a number, got {raw!r}") from None
    return raw


def eval_power(raw: str) -> float:
    """'2**14' or '16384' or '1e4' -> float (no eval)."""
    if "**" in raw:
        base, exp = raw.split("**", 1)
        return float(base) ** float(exp)
    return float(raw)


def _options_help(name: str) -> str:
    words = sorted(_FLAGS.get(name, {}))
    keys = sorted(f"{k}=" for k in _KEYWORDS.get(name, {}))
    return ", ".join(words + keys) or "none"


def from_name(spec: str | Recipe) -> Recipe:
    """Build a recipe from its name with options: ``NAME[:OPTION[,OPTION...]]``.

    An OPTION is a bare word or ``key=value``; options are separated by commas (or further colons).

    ==============  ==========================================================================
    fp8-delayed     ``e4m3`` | ``hybrid`` (format), ``max`` | ``most_recent`` (algo),
                    ``history=N``, ``algo=max|most_recent``, ``margin=M``, ``format=hybrid|e4m3``,
                    ``growing=true|false`` (current scaling while the amax sets records)
    fp8-current     ``e4m3`` | ``hybrid``, ``format=...``
    fp8-rowwise     (no options)
    fp8-blockwise   ``pow2`` (power-of-two scales), ``pow2=true|false``
    fp8-mxfp8       ``floor`` | ``rceil``, ``rounding=floor|rceil``
    fp8-unscaled    (no options; negative control)
    fp32            (no options)
    bf16            ``master=true|false``, ``moments=bf16|fp32``
    bf16-amp        (no options)
    fp16-amp        ``init_scale=2**14``, ``growth_interval=1000``, ``growth_factor=2``, ``backoff_factor=0.5``
    ==============  ==========================================================================

    Examples: ``fp8-delayed:e4m3``, ``fp8-delayed:history=16,algo=most_recent,margin=1``,
    ``fp8-blockwise:pow2``, ``fp8-mxfp8:rceil``. Names are case-insensitive; ``_`` and ``-`` are alike.
    A recipe object passes through unchanged. Unknown names or options raise MixprecError listing the
    valid ones.
    """
    if not isinstance(spec, str):
        if isinstance(spec, tuple(RECIPES.values())):
            return spec
        raise MixprecError(f"a recipe must be a name or a recipe object, got {type(spec).__name__}")
    text = spec.strip()
    name, _, rest = text.partition(":")
    name = name.strip().lower().replace("_", "-")
    if name not in RECIPES:
        raise MixprecError(f"unknown recipe {spec!r}; valid recipes: {', '.join(RECIPES)}")
    cls = RECIPES[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    defaults = cls()
    kwargs: dict[str, object] = {}
    for raw_opt in (o.strip() for o in rest.replace(":", ",").split(",")):
        if not raw_opt:
            continue
        where = f"recipe {spec!r}, option {raw_opt!r}"
        if "=" in raw_opt:
            key, _, value = (s.strip() for s in raw_opt.partition("="))
            field = _KEYWORDS.get(name, {}).get(key.lower().replace("-", "_"))
            if field is None or field not in fields:
                raise MixprecError(f"unknown option {key!r} for {name}; valid options: {_options_help(name)}")
            kwargs[field] = _parse_value(value, getattr(defaults, field), where)
        else:
            flag = _FLAGS.get(name, {}).get(raw_opt.lower().replace("-", "_"))
            if flag is None:
                raise MixprecError(
                    f"unknown option {raw_opt!r} for {name}; valid options: {_options_help(name)}"
                )
            kwargs[flag[0]] = flag[1]
    return cls(**kwargs)


def _spec(recipe: object) -> str:
    """Canonical name with the non-default options, as key=value (from_name reads it back)."""
    name = recipe.name  # type: ignore[attr-defined]
    inverse = {}
    for key, field in _KEYWORDS.get(name, {}).items():
        inverse.setdefault(field, key)  # the first (short) keyword of each field
    defaults = type(recipe)()
    opts = []
    for f in dataclasses.fields(recipe):  # type: ignore[arg-type]
        value = getattr(recipe, f.name)
        if value != getattr(defaults, f.name):
            opts.append(
                f"{inverse.get(f.name, f.name)}={str(value).lower() if isinstance(value, bool) else value}"
            )
    return name + (":" + ",".join(opts) if opts else "")


__all__ = [
    "GEMMS",
    "KINDS",
    "RECIPES",
    "ROLES",
    "Bf16AmpRecipe",
    "Bf16Recipe",
    "BlockwiseScaling",
    "CurrentScaling",
    "DelayedScaling",
    "Fp8Recipe",
    "Fp16AmpRecipe",
    "Fp32Recipe",
    "GemmLayout",
    "MXFP8Scaling",
    "OperandLayout",
    "Recipe",
    "RowwiseScaling",
    "UnscaledFp8",
    "from_name",
]
