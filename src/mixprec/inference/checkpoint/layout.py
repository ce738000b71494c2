"""THE layout table: every tensor a quantized Linear stores, per (layout, scheme) — its name, dtype,
shape rule, and whether the stored scale multiplies or divides (TensorSpec.reciprocal) — and the KV-cache
scale names. Every other module takes checkpoint tensor names from here (tests/test_architecture.py
refuses a string constant equal to one of TENSOR_NAMES, or ending in "." + one, anywhere else in src/);
the runtime layers name their buffers after them.

The layouts: compressed-tensors (llm-compressor writes it, vLLM serves it), Hugging Face
`quant_method: "fp8"` (128x128 blocks), NVIDIA ModelOpt. Sources (checked against each producer's and
reader's own code):

- compressed-tensors 0.20 (`compressors/nvfp4/base.py`, `quantization/utils/helpers.py:generate_gparam`)
  and its presets FP8 / FP8_DYNAMIC / FP8_BLOCK / NVFP4 / NVFP4A16: FP8 `weight` + `weight_scale`
  (a multiplier: W ~ q * s) + `input_scale` for static inputs; NVFP4 `weight_packed` uint8 [out, in/2]
  (element 2i in the low nibble), `weight_scale` E4M3 [out, in/16], `weight_global_scale` and
  `input_global_scale` = 448*6/amax: DIVISORS (W ~ q * weight_scale / weight_global_scale).
- Hugging Face `quant_method: "fp8"` (transformers integrations/finegrained_fp8.py): `weight_scale_inv`,
  despite its name a multiplier like compressed-tensors' `weight_scale`.
- NVIDIA ModelOpt 0.47 (`modelopt/torch/export/quant_utils.py`, `unified_export_hf.py`,
  `convert_hf_config.py`, `quantization/qtensor/nvfp4_tensor.py`): FP8 `weight_scale` and
  `input_scale` = amax/448, 0-dim; FP8_PER_CHANNEL_PER_TOKEN `weight_scale` [out];
  FP8_PB_WO `weight_scale` [out/128, 1, in/128, 1] (vLLM's modelopt.py reads that shape); NVFP4
  `weight` uint8 [out, in/2] packed as compressed-tensors packs it, `weight_scale` E4M3 [out, in/16],
  `weight_scale_2` and `input_scale` = amax/(6*448): MULTIPLIERS, the reciprocals of
  compressed-tensors' global scales. KV-cache scales `<attn>.k_proj.k_scale` / `<attn>.v_proj.v_scale`
  (compressed-tensors: `<attn>.k_scale` / `<attn>.v_scale`), amax/448 in both.

Block formats in compressed-tensors, per quantized Linear:

    scheme     format                 tensors
    nvfp4a16   nvfp4-pack-quantized   weight_packed uint8 [out, in/2] (element 2i in the low nibble),
    nvfp4                             weight_scale float8_e4m3fn [out, in/16], weight_global_scale fp32 [1]
                                      (+ input_global_scale fp32 [1] for nvfp4)
    mxfp4a16   mxfp4-pack-quantized   weight_packed uint8 [out, in/2], weight_scale uint8 E8M0 [out, in/32]
    mxfp4
    mxfp8      mxfp8-quantized        weight float8_e4m3fn [out, in], weight_scale uint8 E8M0 [out, in/32]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.errors import MixprecError
from mixprec.inference.schemes import InferenceScheme

# The tensor names (after "<module>.") of quantized checkpoints. "weight" is not among them: it is
# every Linear's own parameter name, quantized or not.
WEIGHT = "weight"
WEIGHT_PACKED = "weight_packed"  # compressed-tensors' packed FP4 payload
WEIGHT_SCALE = "weight_scale"  # a multiplier (W ~ q * s); E4M3 block scales for NVFP4, E8M0 codes for MX
WEIGHT_SCALE_INV = "weight_scale_inv"  # Hugging Face fp8's name for the same multiplier
WEIGHT_GLOBAL_SCALE = "weight_global_scale"  # compressed-tensors' NVFP4 global scale: a divisor
WEIGHT_SCALE_2 = "weight_scale_2"  # ModelOpt's NVFP4 global scale: a multiplier (1 / the divisor)
INPUT_SCALE = "input_scale"  # a static input's multiplier (ModelOpt NVFP4: 1 / the input global scale)
INPUT_GLOBAL_SCALE = "input_global_scale"  # compressed-tensors' NVFP4 input global scale: a divisor
K_SCALE = "k_scale"  # the KV cache's key scale (on the attention, or on its k_proj in ModelOpt)
V_SCALE = "v_scale"
TENSOR_NAMES = (
    WEIGHT_PACKED,
    WEIGHT_SCALE,
    WEIGHT_SCALE_INV,
    WEIGHT_GLOBAL_SCALE,
    WEIGHT_SCALE_2,
    INPUT_SCALE,
    INPUT_GLOBAL_SCALE,
    K_SCALE,
    V_SCALE,
)
# the suffixes that mark a module as stored quantized (besides a one-byte `weight`)
QUANTIZED_SUFFIXES = (WEIGHT_SCALE, WEIGHT_SCALE_INV, WEIGHT_PACKED, WEIGHT_SCALE_2, WEIGHT_GLOBAL_SCALE)
# the payload names a stored Linear may have
PAYLOAD_NAMES = (WEIGHT, WEIGHT_PACKED)

LAYOUTS = ("compressed-tensors", "hf-fp8")

# every layout `mixprec inspect` reads and `mixprec convert` writes
CONVERT_LAYOUTS = ("compressed-tensors", "hf-fp8", "modelopt")

MODELOPT_CONFIG_NAME = "hf_quant_config.json"

# ModelOpt's quant_algo names for the schemes it shares with mixprec and compressed-tensors (its
# modelopt/torch/export/quant_utils.py and convert_hf_config.py; vLLM's modelopt.py QUANT_ALGOS)
MODELOPT_ALGO_SCHEMES = {
    "FP8": "fp8-static",
    "FP8_PER_CHANNEL_PER_TOKEN": "fp8-dynamic",
    "FP8_PB_WO": "fp8-block",
    "NVFP4": "nvfp4",
    "W4A16_NVFP4": "nvfp4a16",
}

FP4_GROUP = 16


@dataclass(frozen=True)
class StoredScheme:
    """What one Linear's stored tensors mean, whichever layout holds them."""

    name: str  # fp8-static | fp8-tensor-dynamic | fp8-dynamic | fp8-block | nvfp4 | nvfp4a16
    weight_bits: int  # 8: FP8 E4M3 payload; 4: FP4 E2M1, two per byte
    weight_strategy: str  # tensor | channel | block | group
    input: str | None  # "static": a stored per-tensor input scale; "dynamic"; None: weight-only
    block: tuple[int, int] | None = None  # FP8 weight blocks (rows, cols)

    @property
    def fp4(self) -> bool:
        return self.weight_bits == 4

    def describe(self) -> str:
        return (
            self.name if self.block in (None, (128, 128)) else f"{self.name} {self.block[0]}x{self.block[1]}"
        )


FP8_STATIC = StoredScheme("fp8-static", 8, "tensor", "static")
FP8_TENSOR_DYNAMIC = StoredScheme("fp8-tensor-dynamic", 8, "tensor", "dynamic")
FP8_DYNAMIC = StoredScheme("fp8-dynamic", 8, "channel", "dynamic")
NVFP4 = StoredScheme("nvfp4", 4, "group", "static")
NVFP4A16 = StoredScheme("nvfp4a16", 4, "group", None)
# OCP MX as compressed-tensors stores it (mxfp4/mxfp8 presets): uint8 E8M0 `weight_scale` [out, in/32]
MX_GROUP = 32
MXFP4 = StoredScheme("mxfp4", 4, "mx", "dynamic")
MXFP4A16 = StoredScheme("mxfp4a16", 4, "mx", None)
MXFP8 = StoredScheme("mxfp8", 8, "mx", "dynamic")


def fp8_block(rows: int = 128, cols: int = 128) -> StoredScheme:
    return StoredScheme("fp8-block", 8, "block", "dynamic", (int(rows), int(cols)))


_BY_NAME = {
    s.name: s
    for s in (
        FP8_STATIC,
        FP8_TENSOR_DYNAMIC,
        FP8_DYNAMIC,
        fp8_block(),
        NVFP4,
        NVFP4A16,
        MXFP4,
        MXFP4A16,
        MXFP8,
    )
}
MODELOPT_ALGOS = {algo: _BY_NAME[name] for algo, name in MODELOPT_ALGO_SCHEMES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor of a quantized Linear."""

    role: str  # weight | weight_scale | weight_global | input_scale | input_global
    suffix: str  # the name after "<module>."
    shape: tuple[int, ...]  # as this layout writes it
    dtype: str  # "fp8" (E4M3), "uint8" (packed FP4), "float" (any float type)
    reciprocal: bool = False  # the stored value is 1 / the dequantization multiplier
    also: tuple[tuple[int, ...], ...] = ()  # other shapes this layout's readers accept


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def holds(layout: str, scheme: StoredScheme, out_f: int, in_f: int) -> str | None:
    """Why `layout` cannot hold `scheme` for a Linear [out_f, in_f], or None when it can."""
    if layout == "compressed-tensors":
        return None
    if scheme.weight_strategy == "mx":
        return f"only the compressed-tensors layout holds OCP MX (E8M0-scaled) weights like {scheme.name}'s"
    if layout == "hf-fp8":
        if scheme.name != "fp8-block":
            return (
                f"the Hugging Face fp8 layout holds 128x128-style block scales only (transformers and vLLM "
                f"read its per-tensor form differently); {scheme.describe()} fits compressed-tensors"
            )
        return None
    if layout == "modelopt":
        if scheme.name == "fp8-tensor-dynamic":
            return (
                "ModelOpt's FP8 has static per-tensor input scales (vLLM requires input_scale); "
                "fp8-tensor-dynamic fits compressed-tensors"
            )
        if scheme.name == "fp8-block":
            if scheme.block != (128, 128):
                return f"ModelOpt's FP8_PB_WO holds 128x128 blocks, not {scheme.block}"
            if out_f % 128 or in_f % 128:
                return (
                    f"ModelOpt's FP8_PB_WO stores whole 128x128 blocks only (vLLM refuses others); "
                    f"[{out_f}, {in_f}] has partial blocks"
                )
        return None
    raise MixprecError(f"unknown layout {layout!r}; known: {', '.join(CONVERT_LAYOUTS)}")


def module_tensors(layout: str, scheme: StoredScheme, out_f: int, in_f: int) -> list[TensorSpec]:
    """The tensors `layout` stores for one Linear [out_f, in_f] quantized with `scheme`."""
    if scheme.weight_strategy == "mx":  # compressed-tensors only (see holds)
        payload = TensorSpec("weight", "weight_packed", (out_f, in_f // 2), "uint8") if scheme.fp4 else (
            TensorSpec("weight", "weight", (out_f, in_f), "fp8")
        )  # fmt: skip
        return [payload, TensorSpec("weight_scale", "weight_scale", (out_f, _cdiv(in_f, MX_GROUP)), "uint8")]
    if scheme.fp4:
        packed, blocks = (out_f, in_f // 2), (out_f, in_f // FP4_GROUP)
        if layout == "compressed-tensors":
            specs = [
                TensorSpec("weight", "weight_packed", packed, "uint8"),
                TensorSpec("weight_scale", "weight_scale", blocks, "fp8"),
                TensorSpec("weight_global", "weight_global_scale", (1,), "float", True, ((),)),
            ]
            if scheme.input:
                specs.append(TensorSpec("input_global", "input_global_scale", (1,), "float", True, ((),)))
            return specs
        if layout == "modelopt":
            specs = [
                TensorSpec("weight", "weight", packed, "uint8"),
                TensorSpec("weight_scale", "weight_scale", blocks, "fp8"),
                TensorSpec("weight_global", "weight_scale_2", (), "float", False, ((1,),)),
            ]
            if scheme.input:
                specs.append(TensorSpec("input_global", "input_scale", (), "float", False, ((1,),)))
            return specs
        raise MixprecError(f"the {layout} layout holds no FP4 scheme")
    scale_name = "weight_scale_inv" if layout == "hf-fp8" else "weight_scale"
    if scheme.weight_strategy == "tensor":
        shape, also = ((), ((1,),)) if layout in ("modelopt", "hf-fp8") else ((1,), ((),))
    elif scheme.weight_strategy == "channel":
        shape, also = ((out_f,), ((out_f, 1),)) if layout == "modelopt" else ((out_f, 1), ((out_f,),))
    else:
        br, bc = scheme.block
        grid = (_cdiv(out_f, br), _cdiv(in_f, bc))
        shape, also = ((grid[0], 1, grid[1], 1), (grid,)) if layout == "modelopt" else (grid, ())
    specs = [
        TensorSpec("weight", "weight", (out_f, in_f), "fp8"),
        TensorSpec("weight_scale", scale_name, shape, "float", False, also),
    ]
    if scheme.input == "static":
        in_shape, in_also = ((), ((1,),)) if layout in ("modelopt", "hf-fp8") else ((1,), ((),))
        specs.append(TensorSpec("input_scale", "input_scale", in_shape, "float", False, in_also))
    return specs


def kv_scale_names(layout: str, attention: str) -> tuple[str, str]:
    """The KV-cache scale tensors of attention module `attention` in `layout`."""
    if layout == "modelopt":
        return f"{attention}.k_proj.k_scale", f"{attention}.v_proj.v_scale"
    return f"{attention}.k_scale", f"{attention}.v_scale"


def kv_scale_shape(layout: str) -> tuple[int, ...]:
    return () if layout == "modelopt" else (1,)


def attention_of_kv_scale(name: str) -> str:
    """'a.self_attn.k_proj.k_scale' (ModelOpt) or 'a.self_attn.k_scale' -> 'a.self_attn'."""
    owner = name.rpartition(".")[0]
    return owner.rpartition(".")[0] if owner.endswith((".k_proj", ".v_proj")) else owner


def tensor_names(layout: str) -> dict[str, str]:
    """role -> tensor suffix for one quantized Linear."""
    if layout == "compressed-tensors":
        return {"weight": "weight", "weight_scale": "weight_scale", "input_scale": "input_scale"}
    if layout == "hf-fp8":
        return {"weight": "weight", "weight_scale": "weight_scale_inv", "input_scale": "input_scale"}
    raise MixprecError(f"unknown checkpoint format {layout!r}; known: {', '.join(LAYOUTS)}")


def planned_tensors(module: str, shape: tuple[int, int], scheme: InferenceScheme, layout: str = "compressed-tensors") -> list[tuple[str, torch.dtype, tuple[int, ...]]]:  # fmt: skip
    """(name, dtype, shape) of the tensors one quantized Linear [out, in] has in `layout`, in the order
    they are written: the payload, its scales (fp32 for the fp8-* schemes; E4M3 or E8M0 blocks and
    NVFP4's global scale for the block formats), a static input scale."""
    out_f, in_f = shape
    if scheme.is_fp8:
        names = tensor_names(layout)
        tensors = [
            (f"{module}.{names[WEIGHT]}", torch.float8_e4m3fn, (out_f, in_f)),
            (f"{module}.{names[WEIGHT_SCALE]}", torch.float32, scheme.scale_shape(out_f, in_f)),
        ]
        if scheme.needs_calibration:
            tensors.append((f"{module}.{names[INPUT_SCALE]}", torch.float32, (1,)))
        return tensors
    grid = scheme.weight_granularity.scale_shape(out_f, in_f)
    nv = scheme.weight_granularity.scale_format == "e4m3"
    if scheme.fmt.bits == 4:
        tensors = [(f"{module}.weight_packed", torch.uint8, (out_f, in_f // 2))]
    else:
        tensors = [(f"{module}.weight", torch.float8_e4m3fn, (out_f, in_f))]
    tensors.append((f"{module}.weight_scale", torch.float8_e4m3fn if nv else torch.uint8, grid))
    if nv:
        tensors.append((f"{module}.weight_global_scale", torch.float32, (1,)))
    if scheme.input_global:
        tensors.append((f"{module}.input_global_scale", torch.float32, (1,)))
    return tensors


def reciprocal_f32(value: float) -> float:
    """1/value correctly rounded to float32: the quotient in float64 (53 >= 2*24+2 bits, so rounding it
    once more to 24 bits is innocuous), then to the nearest float32 (inf when it overflows)."""
    q = 1.0 / value if value != 0 else float("inf")
    return float(torch.tensor(q, dtype=torch.float64).to(torch.float32))
