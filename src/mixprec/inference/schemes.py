"""FP8 inference schemes, the default ignore list, and a scheme's weight quantization.

`quantize_weight` turns a high-precision Linear weight into FP8 or FP4 + scales for a scheme, through the one
quantize entry (mixprec.quantization.quantize_with_stats: on the CPU its tiled backend, bounded memory
and the error statistics from the same pass). The offline (streaming) path, the online path
(`quantize_model_`) and the loader all call it, so the same weight gives bit-identical payloads and
scales whichever way it was quantized.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from mixprec.errors import MixprecError
from mixprec.formats import Format, check_float_tensor, get_format
from mixprec.quantization import QuantizationStats, quantize_with_stats
from mixprec.scaling import Granularity, QuantizedTensor
from mixprec.select import (
    check_pattern,
    fp8_dims_reason,
    fused_group_of,
    fused_groups,
    fused_shards,
    selects_any,
)


@dataclass(frozen=True)
class InferenceScheme:
    """How weights and activations of a Linear are quantized for inference: FP8 E4M3 (the fp8-*
    schemes), or the block formats NVFP4 / MXFP4 / MXFP8 (weight_format e2m1 or e4m3 with E4M3 or E8M0
    block scales; input_format None = weights only, activations stay in high precision)."""

    name: str
    weight_granularity: Granularity
    input_granularity: Granularity
    input_dynamic: bool  # False: one static per-tensor input scale from calibration
    description: str = ""
    weight_format: str = "e4m3"
    input_format: str | None = "e4m3"  # None: weight-only (A16)
    # True (nvfp4): inputs get dynamic per-block scales in the units of a calibrated static
    # per-tensor global scale (compressed-tensors' input_global_scale)
    input_global: bool = False

    @property
    def needs_calibration(self) -> bool:
        return self.input_format is not None and (not self.input_dynamic or self.input_global)

    @property
    def fmt(self) -> Format:
        """The weight payload's format."""
        return get_format(self.weight_format)

    @property
    def weights_only(self) -> bool:
        return self.input_format is None

    @property
    def is_fp8(self) -> bool:
        """An fp8-* scheme: E4M3 payload with fp32 scales (the compressed-tensors float-quantized layout)."""
        return self.weight_granularity.scale_format == "fp32"

    @property
    def family(self) -> str:
        """ "fp4" (E2M1 payload: NVFP4, MXFP4) or "fp8" (E4M3: the fp8-* schemes, MXFP8): what a
        ConversionReport calls the kind of a layer quantized with it."""
        return "fp4" if self.fmt.bits == 4 else "fp8"

    @property
    def block_size(self) -> int | None:
        """Elements per scale along K for the block formats (16 NVFP4, 32 MX), None for FP8 schemes."""
        return None if self.is_fp8 else self.weight_granularity.block_cols

    @property
    def weight_block(self) -> tuple[int, int] | None:
        """(rows, cols) of the FP8 weight blocks (fp8-block: 128 x 128), None for other schemes."""
        g = self.weight_granularity
        if not self.is_fp8 or g.block_rows in (None, 1) or g.block_cols is None:
            return None
        return (g.block_rows, g.block_cols)

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

    def stored_bits(self, out_features: int, in_features: int) -> int:
        """Bits one [out, in] Linear takes in a checkpoint of this scheme, scales counted: the weight
        payload (fmt.bits per element), one weight scale per block (32 bits fp32, 8 bits E8M0/E4M3),
        an fp32 global scale where the block scales are E4M3 (NVFP4), and one fp32 static input
        scale for a calibrated scheme. What `--scheme auto` budgets count: fp8-dynamic 8 + 32/in bits
        per weight, fp8-block 8 + 32/128^2."""
        gran = self.weight_granularity
        scale_bits = 32 if gran.scale_format == "fp32" else 8
        bits = self.fmt.bits * out_features * in_features
        bits += scale_bits * math.prod(gran.scale_shape(out_features, in_features))
        if gran.scale_format == "e4m3":
            bits += 32  # the per-tensor global scale
        return bits + (32 if self.needs_calibration else 0)

    @property
    def bits_per_weight(self) -> float:
        """Nominal bits per weight of a 4096 x 4096 Linear (stored_bits / weights): fp8-dynamic 8.008,
        fp8-block 8.002 — for tables; budgets count each layer's own `stored_bits`."""
        return self.stored_bits(4096, 4096) / 4096**2


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
# NVFP4 as compressed-tensors / llm-compressor / vLLM (1x16 E2M1 blocks, E4M3 block scales in units of
# an fp32 global scale computed in the weight's dtype); MX as compressed-tensors writes it (1x32 blocks,
# E8M0 scales by torchao's "even" rule)
_NV = Granularity.nvfp4(scale_math="input")
_MX = Granularity.mx(32, rounding="even")
SCHEMES.update(
    {
        s.name: s
        for s in (
            InferenceScheme("nvfp4a16", _NV, Granularity.rows(), True,
                            "NVFP4 weights (E2M1, 1x16 blocks, E4M3 scales x fp32 global), 16-bit activations",
                            "e2m1", None),
            InferenceScheme("nvfp4", _NV, _NV, True,
                            "NVFP4 weights and activations: dynamic 1x16 input blocks in a calibrated global scale",
                            "e2m1", "e2m1", input_global=True),
            InferenceScheme("mxfp4a16", _MX, Granularity.rows(), True,
                            "MXFP4 weights (E2M1, 1x32 blocks, E8M0 scales), 16-bit activations", "e2m1", None),
            InferenceScheme("mxfp4", _MX, _MX, True,
                            "MXFP4 weights and dynamic MXFP4 activations (1x32 blocks, E8M0 scales)",
                            "e2m1", "e2m1"),
            InferenceScheme("mxfp8", _MX, _MX, True,
                            "MXFP8 weights and dynamic MXFP8 activations (E4M3, 1x32 blocks, E8M0 scales)",
                            "e4m3", "e4m3"),
        )
    }
)  # fmt: skip
_ALIASES = {"fp8": "fp8-static", "fp8-dynamic-per-token": "fp8-dynamic", "fp8-blockwise": "fp8-block",
            "nvfp4-a16": "nvfp4a16", "w4a16-nvfp4": "nvfp4a16", "mxfp4-a16": "mxfp4a16"}  # fmt: skip


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


BLOCK_DIMS_RULE = "in_features not a multiple of the block"


def block_dims_reason(scheme: InferenceScheme, out_features: int, in_features: int) -> str | None:
    """Why a block-format scheme (NVFP4, MX) leaves this Linear in high precision, or None: its scale
    blocks run along K (in_features), which the block size must divide (compressed-tensors refuses a
    partial group, and packing needs pairs of FP4 values)."""
    block = scheme.block_size
    if block is None or in_features % block == 0:
        return None
    return f"{BLOCK_DIMS_RULE} ({in_features} is not a multiple of {scheme.name}'s {block}-element blocks)"


def skip_reason(
    name: str,
    out_features: int,
    in_features: int,
    ignore: Sequence[str],
    scheme: InferenceScheme | None = None,
) -> str | None:
    """Why this Linear stays in high precision, or None when it is quantized (block formats: also when
    their block does not divide in_features, block_dims_reason)."""
    if selects_any(name, ignore):
        return "ignored by pattern"
    if scheme is not None:
        why = block_dims_reason(scheme, out_features, in_features)
        if why:
            return why
    return fp8_dims_reason(out_features, in_features)


# ---------------------------------------------------------------------------------------------------
# Shape rules of the engines that serve a checkpoint

# The summary keys of the reasons below (ConversionReport.summary() groups at " ("): a test and the
# docs name them.
FUSED_BLOCK_RULE = "vLLM fp8-block: fused shard not a multiple of the block"
PARTLY_QUANTIZED_RULE = "vLLM fuses it with a high-precision module"


def fused_block_reason(
    scheme: InferenceScheme, layout: str, fused: str, shard_out: Sequence[int], *, experts: bool = False
) -> str | None:
    """Why vLLM (one GPU) refuses block-quantized fused layer `fused` whose shards have output sizes
    `shard_out` (in stacking order), or None when it loads it. experts: the shards are one MoE expert's
    gate and up projections (w1, w3), part of a fused-experts layer.

    Read from vLLM 0.32 (model_executor/layers/quantization/utils/fp8_utils.py):
    `validate_fp8_block_shape` checks a merged Linear's output partitions: without tensor parallelism
    every one but the last must be a multiple of block_n (the input dim and the last shard are checked
    only under tensor parallelism). A layer of the Hugging Face `fp8` layout (its `Fp8Config` has
    `weight_block_size`) whose shards are not all multiples sets `allow_fp8_block_shape_mismatch`
    (layers/linear.py, `ColumnParallelLinear._maybe_allow_fp8_block_shape_mismatch`), which skips that
    check; compressed-tensors' config has no `weight_block_size`, so its layers are checked.
    `validate_fp8_block_shape_moe` needs the experts' intermediate size (gate's and up's out_features)
    to be a multiple of block_n in both layouts.
    """
    gran = scheme.weight_granularity
    block_n = gran.block_rows
    if gran.block_cols in (None, 1) or block_n in (None, 1) or len(shard_out) < 2:
        return None  # not a 2-D block scheme, or not a merged layer
    if experts:
        bad = [n for n in shard_out if n % block_n]
        refusal = f"The output_size of gate's and up's weight = {bad[0] if bad else 0} is not divisible"
    else:
        if layout == "hf-fp8":
            return None  # a mismatch switches the check off for this layout's layers
        bad = [n for n in shard_out[:-1] if n % block_n]
        refusal = f"Weight output_partition_size = {bad[0] if bad else 0} is not divisible"
    if not bad:
        return None
    rule = "every shard" if experts else "every shard but the last"
    return (
        f"{FUSED_BLOCK_RULE} ({fused} stacks out_features {list(shard_out)}; {rule} must be a multiple of "
        f"block_n={block_n}, vLLM refuses it: '{refusal} by weight quantization block_n = {block_n}')"
    )


def transformers_dequantize_reason(
    layout: str, block: tuple[int, int] | None, out_features: int, in_features: int
) -> str | None:
    """Why transformers' dequantizing reader refuses this Linear of an hf-fp8 block checkpoint, or None.

    transformers (5.24) reads the Hugging Face `fp8` layout on a machine without its FP8 kernels (a CPU;
    a GPU below compute capability 8.9) by dequantizing each weight, and derives the block from the
    scale grid: it refuses a weight whose dims the grid [ceil(out/128), ceil(in/128)] does not divide
    ("Weight shape (576, 576) not divisible by scale grid (5, 5)": integrations/finegrained_fp8.py,
    `Fp8Dequantize._dequantize_one`). vLLM and transformers' own FP8 kernels take the partial blocks,
    so mixprec still writes these layers in FP8 and says so (quantize warns; inspect names them).
    block: the (rows, cols) of the FP8 weight blocks, None for a scheme without weight blocks."""
    if layout != "hf-fp8" or block is None:
        return None
    rows, cols = math.ceil(out_features / block[0]), math.ceil(in_features / block[1])
    if out_features % rows == 0 and in_features % cols == 0:
        return None
    return (
        f"transformers dequantizes hf-fp8 weights on a CPU (or a GPU without FP8) and refuses a weight its scale "
        f"grid does not divide: ({out_features}, {in_features}) by ({rows}, {cols})"
    )


def serving_reasons(
    scheme: InferenceScheme,
    layout: str,
    linears: Mapping[str, tuple[int, int]],
    kept: Mapping[str, str],
) -> dict[str, str]:
    """{Linear name: why it stays in high precision too}: the Linears that the shape rules of the engines
    serving `layout` (vLLM) send back to high precision, on top of `kept` (already high precision, with
    reasons). `linears`: every Linear of the checkpoint, name -> (out_features, in_features).

    1. FP8 block: a fused layer whose shards break vLLM's block rule (`fused_block_reason`) stays in
       high precision as a whole.
    2. Fused groups (mixprec.select.fused_groups: q/k/v, gate/up, one MoE block's experts) share one
       decision: vLLM refuses a fused layer whose shards are partly quantized ("Detected some but not
       all shards of ... are quantized"), so one member in high precision keeps the whole group there.
    """
    extra: dict[str, str] = {}
    for fused, shards in fused_shards(linears).items():
        experts = fused_group_of(shards[0]) != fused  # one expert's w1/w3 inside a fused-experts layer
        why = fused_block_reason(scheme, layout, fused, [linears[s][0] for s in shards], experts=experts)
        if why:
            extra.update({s: why for s in shards if s not in kept})
    held = {**kept, **extra}
    for group, members in fused_groups(linears).items():
        first = next((m for m in members if m in held), None)
        if first is None or all(m in held for m in members):
            continue
        why = (
            f"{PARTLY_QUANTIZED_RULE} ({group}: {first} stays in high precision, {held[first].split(' (')[0]}; "
            "vLLM refuses a fused layer whose shards are partly quantized)"
        )
        extra.update({m: why for m in members if m not in held})
    return extra


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
    global_scale: torch.Tensor | None = None,
) -> tuple[QuantizedTensor, QuantizationStats]:
    """The weight payload + scales for `scheme` (its format and weight granularity), with statistics:
    quantize_with_stats(w, scheme.fmt, scheme.weight_granularity, scale=scale, out=out,
    global_scale=global_scale). `out`: a contiguous payload tensor of w's shape (a buffer the caller
    reuses). global_scale (NVFP4): the fused group's shared one; None computes the weight's own.
    MixprecError naming the tensor if it is not a 2-D floating-point weight or holds NaN/inf."""
    if w.dim() != 2:
        raise MixprecError(f"{name!r}: a Linear weight must be 2-D, got shape {tuple(w.shape)}")
    check_float_tensor(w, name)
    q, stats = quantize_with_stats(
        w, scheme.fmt, scheme.weight_granularity, scale=scale, out=out, global_scale=global_scale
    )
    if not math.isfinite(stats.relative_error):
        check_finite(w, name)  # NaN/inf raise here, naming the tensor
    return q, stats
