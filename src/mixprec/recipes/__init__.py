"""Training recipes: which precision each tensor of a Linear gets, and how it is scaled.

A recipe is a frozen dataclass. The quantized recipes (QuantizedRecipe; its FP8 and FP4 families,
Fp8Recipe and Fp4Recipe, are siblings) also say, for each of the three GEMMs of a Linear layer, how each
operand is quantized (`gemm_layout`). The GEMM seam (`mixprec.gemm.scaled_mm`)
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
fp8-unscaled (a deliberately broken negative control), fp4-nvfp4, fp4-mxfp4, fp32, bf16, bf16-amp,
fp16-amp.

The FP4 recipes (kind "fp4") add two things an operand can ask for: `hadamard` (the random Hadamard
transform of mixprec.hadamard along its K, applied to both wgrad operands so their product is
unchanged) and `stochastic` (stochastic rounding of its E2M1 values, keyed by seed, step, rank and
tensor: mixprec.rounding.stream_key).
"""

from __future__ import annotations

import dataclasses

from mixprec.errors import MixprecError
from mixprec.recipes.base import (
    GEMMS,
    KINDS,
    QUANTIZED_KINDS,
    ROLES,
    GemmLayout,
    OperandLayout,
    QuantizedRecipe,
)
from mixprec.recipes.fp4 import Fp4Recipe, MXFP4Training, NVFP4Training
from mixprec.recipes.fp8 import (
    FP8_FORMATS,
    BlockwiseScaling,
    CurrentScaling,
    DelayedScaling,
    Fp8Recipe,
    MXFP8Scaling,
    RowwiseScaling,
    UnscaledFp8,
)
from mixprec.recipes.high_precision import Bf16AmpRecipe, Bf16Recipe, Fp16AmpRecipe, Fp32Recipe
from mixprec.recipes.options import FLAGS, KEYWORDS, eval_power, options_help, parse_value

Recipe = (
    DelayedScaling
    | CurrentScaling
    | RowwiseScaling
    | BlockwiseScaling
    | MXFP8Scaling
    | UnscaledFp8
    | NVFP4Training
    | MXFP4Training
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
        NVFP4Training,
        MXFP4Training,
        Fp32Recipe,
        Bf16Recipe,
        Bf16AmpRecipe,
        Fp16AmpRecipe,
    )
}


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
    fp4-nvfp4       ``rht=true|false``, ``sr=true|false`` (stochastic rounding of gradients),
                    ``2d=true|false`` (16x16 weight blocks), ``keep_last=N`` (last N blocks in bf16),
                    ``seed=S`` (RHT signs and rounding noise)
    fp4-mxfp4       the same options (rht, sr, 2d off by default), ``floor`` | ``rceil`` | ``even``,
                    ``rounding=floor|rceil|even``
    fp32            (no options)
    bf16            ``master=true|false``, ``moments=bf16|fp32``
    bf16-amp        (no options)
    fp16-amp        ``init_scale=2**14``, ``growth_interval=1000``, ``growth_factor=2``, ``backoff_factor=0.5``
    ==============  ==========================================================================

    Examples: ``fp8-delayed:e4m3``, ``fp8-delayed:history=16,algo=most_recent,margin=1``,
    ``fp8-blockwise:pow2``, ``fp8-mxfp8:rceil``, ``fp4-nvfp4:rht=false,keep_last=2``. Names are case-insensitive; ``_`` and ``-`` are alike.
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
            field = KEYWORDS.get(name, {}).get(key.lower().replace("-", "_"))
            if field is None or field not in fields:
                raise MixprecError(f"unknown option {key!r} for {name}; valid options: {options_help(name)}")
            kwargs[field] = parse_value(value, getattr(defaults, field), where)
        else:
            flag = FLAGS.get(name, {}).get(raw_opt.lower().replace("-", "_"))
            if flag is None:
                raise MixprecError(
                    f"unknown option {raw_opt!r} for {name}; valid options: {options_help(name)}"
                )
            kwargs[flag[0]] = flag[1]
    return cls(**kwargs)


__all__ = [
    "FP8_FORMATS",
    "GEMMS",
    "KINDS",
    "QUANTIZED_KINDS",
    "RECIPES",
    "ROLES",
    "Bf16AmpRecipe",
    "Bf16Recipe",
    "BlockwiseScaling",
    "CurrentScaling",
    "DelayedScaling",
    "Fp4Recipe",
    "Fp8Recipe",
    "Fp16AmpRecipe",
    "Fp32Recipe",
    "GemmLayout",
    "MXFP4Training",
    "MXFP8Scaling",
    "NVFP4Training",
    "OperandLayout",
    "QuantizedRecipe",
    "Recipe",
    "RowwiseScaling",
    "UnscaledFp8",
    "eval_power",
    "from_name",
]
