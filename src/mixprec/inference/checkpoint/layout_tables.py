"""Every quantized-Linear scheme a checkpoint layout can hold, and how each layout stores it: tensor
names, dtypes, shapes, and whether a stored scale multiplies or divides. Layout-neutral, so `mixprec
inspect` reads any of them and `mixprec convert` maps one onto another.

Sources (checked against each producer's and reader's own code):

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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from mixprec.errors import MixprecError
from mixprec.inference.checkpoint.layouts import (
    CONVERT_LAYOUTS,
    MODELOPT_ALGO_SCHEMES,
    read_quantization_config,
)
from mixprec.inference.checkpoint.safetensors_io import Checkpoint, TensorInfo
from mixprec.select import REGEX_PREFIX, matches

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


# ---------------------------------------------------------------------------------------------------
# Reading a checkpoint's quantization config


@dataclass
class LayoutConfig:
    """A checkpoint's quantization config, read into layout-neutral terms."""

    layout: str
    source: Path
    description: str
    groups: list[tuple[str, tuple[str, ...], StoredScheme]]  # (group name, targets, scheme)
    ignore: tuple[str, ...]
    kv_cache: bool
    per_layer: dict[str, StoredScheme] = field(default_factory=dict)  # ModelOpt MIXED_PRECISION
    unreadable: list[str] = field(default_factory=list)  # config entries describing schemes not listed here

    def scheme_for(self, name: str) -> StoredScheme | None:
        """The scheme the config gives module `name` (assumed a Linear), None when it is not quantized."""
        if self.per_layer:
            return self.per_layer.get(name)
        if any(_pattern_matches(name, p) for p in self.ignore):
            return None
        for _, targets, scheme in self.groups:
            if any(t == "Linear" or _pattern_matches(name, t) for t in targets):
                return scheme
        return None

    def ignores(self, name: str) -> bool:
        return any(_pattern_matches(name, p) for p in self.ignore)

    @property
    def schemes(self) -> list[StoredScheme]:
        found = list(self.per_layer.values()) + [s for _, _, s in self.groups]
        return list({s: None for s in found})

    @property
    def mixed(self) -> bool:
        return len(self.schemes) > 1


def _pattern_matches(name: str, pattern: str) -> bool:
    """A config's target / ignore entry names module `name`: exact or dotted-suffix names, "re:" regexes
    (compressed-tensors, vLLM) and globs (ModelOpt's exclude_modules, which vLLM reads with fnmatch),
    all through mixprec.select.matches."""
    return matches(name, pattern)


def _ct_scheme(group: dict) -> StoredScheme | str:
    w, a = group.get("weights") or {}, group.get("input_activations")
    bits, kind, strategy = int(w.get("num_bits") or 0), w.get("type"), str(w.get("strategy") or "").lower()
    described = f"{bits}-bit {kind} weights, strategy {strategy or 'none'}"
    if kind != "float":
        return described
    dynamic = bool(a.get("dynamic")) if a else None
    a_strategy = str((a or {}).get("strategy") or "").lower()
    if bits == 8 and a is not None:
        if strategy == "tensor":
            return FP8_TENSOR_DYNAMIC if dynamic else (FP8_STATIC if a_strategy == "tensor" else described)
        if strategy == "channel" and dynamic:
            return FP8_DYNAMIC
        if strategy == "block" and dynamic:
            rows, cols = w.get("block_structure") or (128, 128)
            return fp8_block(rows, cols)
    if (
        strategy == "group"
        and int(w.get("group_size") or 0) == MX_GROUP
        and "uint8" in str(w.get("scale_dtype"))
    ):
        if bits == 4:
            return MXFP4A16 if a is None else MXFP4
        if bits == 8 and a is not None:
            return MXFP8
    if bits == 4 and strategy == "tensor_group" and int(w.get("group_size") or 0) == FP4_GROUP:
        if a is None:
            return NVFP4A16
        if int(a.get("num_bits") or 0) == 4:
            return NVFP4
    return described + (", weight-only" if a is None else f", inputs {a_strategy or 'unknown'}")


def read_layout_config(root: Path, config: dict) -> LayoutConfig:
    """The checkpoint's quantization config (config.json, or ModelOpt's hf_quant_config.json)."""
    qc, source = read_quantization_config(root, config)
    if qc is None:
        raise MixprecError(
            f"{root} is not a quantized checkpoint: no quantization_config in config.json "
            "and no hf_quant_config.json (quantize it with `mixprec quantize`)"
        )
    if not isinstance(qc, dict):
        raise MixprecError(f"{source}: quantization_config must be a JSON object")
    method = str(qc.get("quant_method") or "")
    if method == "compressed-tensors":
        groups, unreadable = [], []
        for gname, group in (qc.get("config_groups") or {}).items():
            scheme = _ct_scheme(group or {})
            if isinstance(scheme, str):
                unreadable.append(f"config group {gname!r}: {scheme}")
                continue
            groups.append((gname, tuple(group.get("targets") or ("Linear",)), scheme))
        desc = f"compressed-tensors, format {qc.get('format')}"
        return LayoutConfig(
            "compressed-tensors",
            source,
            desc,
            groups,
            tuple(qc.get("ignore") or ()),
            bool(qc.get("kv_cache_scheme")),
            unreadable=unreadable,
        )
    if method == "fp8":
        block = qc.get("weight_block_size")
        dynamic = str(qc.get("activation_scheme", "dynamic")).lower() == "dynamic"
        scheme = fp8_block(*block) if block else (FP8_TENSOR_DYNAMIC if dynamic else FP8_STATIC)
        ignore = qc.get("modules_to_not_convert")
        desc = f"Hugging Face fp8, weight_block_size {block}, activation_scheme {qc.get('activation_scheme', 'dynamic')}"
        # modules_to_not_convert null: transformers keeps its output embeddings (lm_head) unquantized
        return LayoutConfig(
            "hf-fp8",
            source,
            desc,
            [("fp8", ("Linear",), scheme)],
            tuple(ignore) if ignore is not None else ("lm_head",),
            False,
        )
    if method.lower().startswith("modelopt"):
        return _read_modelopt(qc, source)
    raise MixprecError(
        f"{source}: quant_method {method!r} is not a layout mixprec reads ({', '.join(CONVERT_LAYOUTS)})"
    )


def _read_modelopt(qc: dict, source: Path) -> LayoutConfig:
    details = qc["quantization"] if isinstance(qc.get("quantization"), dict) else qc
    algo = str(details.get("quant_algo") or "").upper()
    ignore = tuple(details.get("exclude_modules") or qc.get("ignore") or ())
    kv = bool(details.get("kv_cache_quant_algo") or qc.get("kv_cache_scheme"))
    group = details.get("group_size")
    unreadable: list[str] = []

    def scheme_of(name: str, gsize, where: str) -> StoredScheme | None:
        scheme = MODELOPT_ALGOS.get(name)
        if scheme is None:
            unreadable.append(
                f"{where}: quant_algo {name or 'missing'!r} (mixprec reads {', '.join(MODELOPT_ALGOS)})"
            )
        elif scheme.fp4 and gsize not in (None, FP4_GROUP):
            unreadable.append(f"{where}: {name} with group_size {gsize} (NVFP4 groups are {FP4_GROUP})")
            return None
        return scheme

    desc = f"ModelOpt {algo or '(no quant_algo)'}"
    if algo == "MIXED_PRECISION":
        per_layer = {}
        for name, cfg in (details.get("quantized_layers") or {}).items():
            s = scheme_of(
                str((cfg or {}).get("quant_algo") or "").upper(), (cfg or {}).get("group_size"), name
            )
            if s is not None:
                per_layer[name] = s
        return LayoutConfig("modelopt", source, desc, [], ignore, kv, per_layer, unreadable)
    scheme = scheme_of(algo, group, str(source))
    groups = [(algo, ("Linear",), scheme)] if scheme else []
    return LayoutConfig("modelopt", source, desc, groups, ignore, kv, unreadable=unreadable)


# ---------------------------------------------------------------------------------------------------
# Finding the quantized Linears among a checkpoint's tensors (headers only)

_SCALE_SUFFIXES = (
    "weight_scale",
    "weight_scale_inv",
    "weight_packed",
    "weight_scale_2",
    "weight_global_scale",
)


@dataclass
class StoredModule:
    name: str
    scheme: StoredScheme | None  # None: stored quantized although the config does not quantize it
    dims: tuple[int, int] | None  # (out, in) of the Linear, from its payload
    tensors: dict[str, TensorInfo]  # suffix -> tensor, every tensor "<name>.<suffix>" of the module


def quantized_modules(ckpt: Checkpoint, cfg: LayoutConfig) -> dict[str, StoredModule]:
    """Every module whose tensors are stored quantized (an FP8/packed payload or a weight scale), in
    file order, with the scheme its config gives it."""
    found: dict[str, StoredModule] = {}
    for name, info in ckpt.tensors.items():
        module, _, suffix = name.rpartition(".")
        quantized = suffix in _SCALE_SUFFIXES or (suffix == "weight" and info.dtype.itemsize == 1)
        if quantized and module not in found:
            found[module] = StoredModule(module, cfg.scheme_for(module), None, {})
    for name, info in ckpt.tensors.items():
        module, _, suffix = name.rpartition(".")
        if module in found and suffix not in ("k_scale", "v_scale"):  # ModelOpt's KV scales sit on k/v_proj
            found[module].tensors[suffix] = info
    for m in found.values():
        payload = m.tensors.get("weight_packed") or m.tensors.get("weight")
        if payload is not None and len(payload.shape) == 2:
            out_f, cols = payload.shape
            m.dims = (out_f, cols * 2) if payload.dtype == torch.uint8 else (out_f, cols)
    return found


def module_names(ckpt: Checkpoint) -> list[str]:
    """Every module that stores a weight (quantized or not), in file order."""
    names = [
        n.rpartition(".")[0] for n in ckpt.tensors if n.rpartition(".")[2] in ("weight", "weight_packed")
    ]
    return list(dict.fromkeys(names))


def expand_ignore(cfg: LayoutConfig, modules: list[str], quantized: set[str]) -> list[str]:
    """The config's ignore list as exact module names, which every layout's readers take alike
    (compressed-tensors' regexes, ModelOpt's globs and Hugging Face's names differ): each unquantized
    module an entry matches, plus plain-name entries that match no stored module (a tied lm_head)."""
    out = {m for m in modules if m not in quantized and cfg.ignores(m)}
    for p in cfg.ignore:
        plain = not p.startswith(REGEX_PREFIX) and not any(c in p for c in "*?[")
        if plain and not any(matches(m, p) for m in modules):
            out.add(p)
    return sorted(out)


def reciprocal_f32(value: float) -> float:
    """1/value correctly rounded to float32: the quotient in float64 (53 >= 2*24+2 bits, so rounding it
    once more to 24 bits is innocuous), then to the nearest float32 (inf when it overflows)."""
    q = 1.0 / value if value != 0 else float("inf")
    return float(torch.tensor(q, dtype=torch.float64).to(torch.float32))
