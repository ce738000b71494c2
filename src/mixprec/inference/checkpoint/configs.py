"""The `quantization_config` of a checkpoint's config.json, in every layout serving engines read:
compressed-tensors (vLLM, transformers with the compressed-tensors package), Hugging Face
`quant_method: "fp8"` (fine-grained, 128x128 blocks) and NVIDIA ModelOpt (config.json or its
hf_quant_config.json).

Writing: the `quantization_config` dict for config.json (block schemes as llm-compressor writes its
NVFP4A16 / NVFP4 / MXFP4A16 / MXFP4 / MXFP8 presets).
Reading, twice over the same documents: `parse_quantization_config` -> a `LayoutSpec` saying, per
module, which scheme-like layout its tensors have, so the loader can rebuild quantized Linears from
any producer (mixprec, llm-compressor, Hugging Face fp8, ModelOpt); `read_layout_config` -> a
`LayoutConfig` in the layout table's terms (layout.StoredScheme), for inspect and convert. Tensor
names, shapes and scale conventions are the layout table's (layout.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mixprec.errors import MixprecError
from mixprec.inference.checkpoint.layout import (
    CONVERT_LAYOUTS,
    FP4_GROUP,
    FP8_DYNAMIC,
    FP8_STATIC,
    FP8_TENSOR_DYNAMIC,
    MODELOPT_ALGO_SCHEMES,
    MODELOPT_ALGOS,
    MODELOPT_CONFIG_NAME,
    MX_GROUP,
    MXFP4,
    MXFP4A16,
    MXFP8,
    NVFP4,
    NVFP4A16,
    WEIGHT_SCALE,
    WEIGHT_SCALE_INV,
    StoredScheme,
    fp8_block,
)
from mixprec.inference.schemes import SCHEMES, InferenceScheme
from mixprec.scaling import Granularity
from mixprec.select import matches

CT_FORMATS = {"e4m3": "nvfp4-pack-quantized", "e8m0": "mxfp4-pack-quantized"}


def _ct_args(strategy: str, dynamic: bool, **extra) -> dict:
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": extra.pop("group_size", None),
        "strategy": strategy,
        "block_structure": extra.pop("block_structure", None),
        "dynamic": dynamic,
        "actorder": None,
        "observer": extra.pop("observer", None if dynamic else "minmax"),
        "observer_kwargs": {},
    }


def ct_group_args(strategy: str, dynamic: bool, **extra) -> dict:
    """The compressed-tensors QuantizationArgs (as JSON) of an 8-bit float weight or activation."""
    return _ct_args(strategy, dynamic, **extra)


def ct_format(scheme: InferenceScheme) -> str:
    """The compressed-tensors `format` of a block scheme's config group."""
    if scheme.fmt.bits == 8:
        return "mxfp8-quantized"
    return CT_FORMATS[scheme.weight_granularity.scale_format]


def _block_args(scheme: InferenceScheme, fmt_bits: int, dynamic, observer: str | None) -> dict:
    nv = scheme.weight_granularity.scale_format == "e4m3"
    return {
        "num_bits": fmt_bits,
        "type": "float",
        "symmetric": True,
        "group_size": scheme.block_size,
        "strategy": "tensor_group" if nv else "group",
        "block_structure": None,
        "dynamic": dynamic,
        "actorder": None,
        "observer": observer,
        "observer_kwargs": {},
        "scale_dtype": "torch.float8_e4m3fn" if nv else "torch.uint8",
        "zp_dtype": None,
    }


def ct_block_scheme_args(scheme: InferenceScheme) -> tuple[dict, dict | None, str]:
    """(weights, input_activations, format) of one compressed-tensors config group for a block scheme,
    as llm-compressor writes its NVFP4A16 / NVFP4 / MXFP4A16 / MXFP4 / MXFP8 presets."""
    weights = _block_args(scheme, scheme.fmt.bits, False, "memoryless_minmax")
    inputs = None
    if not scheme.weights_only:
        bits = 4 if scheme.input_format == "e2m1" else 8
        inputs = _block_args(
            scheme,
            bits,
            "local" if scheme.input_global else True,
            "static_minmax" if scheme.input_global else None,
        )
    return weights, inputs, ct_format(scheme)


def ct_scheme_args(scheme: InferenceScheme) -> tuple[dict, dict | None, str]:
    """(weights, input_activations, format) of one compressed-tensors config group for `scheme`: the
    QuantizationArgs llm-compressor writes for it, and the group's compression format."""
    if not scheme.is_fp8:  # NVFP4, MXFP4, MXFP8
        return ct_block_scheme_args(scheme)
    if scheme.name == "fp8-dynamic":
        return _ct_args("channel", False), _ct_args("token", True), "float-quantized"
    if scheme.name == "fp8-static":
        return (
            _ct_args("tensor", False),
            _ct_args("tensor", False, observer="static_minmax"),
            "float-quantized",
        )
    if scheme.name == "fp8-block":
        weights = _ct_args("block", False, block_structure=[128, 128])
        return weights, _ct_args("group", True, group_size=128), "float-quantized"
    raise MixprecError(
        f"no compressed-tensors layout for {scheme.name}"
    )  # pragma: no cover - from_name guards


def ct_config_group(scheme: InferenceScheme, targets: list[str]) -> dict:
    """One `config_groups` entry: `scheme` applied to `targets` (a class name such as "Linear", or
    module names)."""
    weights, inputs, fmt = ct_scheme_args(scheme)
    return {
        "targets": list(targets),
        "weights": weights,
        "input_activations": inputs,
        "output_activations": None,
        "format": fmt,
    }


def _ct_document(groups: list[dict], ignore: list[str], kv_cache: bool) -> dict:
    # compressed-tensors' own rule (compressors/format.py `_flatten_formats`, quant_config.py): the
    # top-level format is the groups' format when they share one, "mixed-precision" when they differ
    formats = {g["format"] for g in groups}
    return {
        "config_groups": {f"group_{i}": g for i, g in enumerate(groups)},
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": _ct_args("tensor", False, observer="minmax") if kv_cache else None,
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": sorted(ignore),
        "sparsity_config": {},
        "transform_config": {},
    }


def ct_quantization_config(scheme: InferenceScheme, ignore: list[str], kv_cache: bool) -> dict:
    """The compressed-tensors `quantization_config` llm-compressor writes for this scheme.

    `ignore` lists the Linear module names left unquantized: with `targets: ["Linear"]`, readers
    (vLLM, compressed-tensors) quantize every other Linear.
    """
    return _ct_document([ct_config_group(scheme, ["Linear"])], ignore, kv_cache)


def ct_mixed_quantization_config(
    assignment: dict[str, InferenceScheme], ignore: list[str], kv_cache: bool
) -> dict:
    """The compressed-tensors `quantization_config` of a mixed-precision checkpoint: one config group
    per scheme, its targets the names of the Linears in it ({Linear: scheme}); `ignore` lists every
    other Linear (vLLM refuses a Linear that no target and no ignore entry names)."""
    by_scheme: dict[str, list[str]] = {}
    schemes: dict[str, InferenceScheme] = {}
    for name, sch in assignment.items():
        by_scheme.setdefault(sch.name, []).append(name)
        schemes[sch.name] = sch
    groups = [ct_config_group(schemes[s], sorted(names)) for s, names in by_scheme.items()]
    return _ct_document(groups, ignore, kv_cache)


def hf_fp8_quantization_config(scheme: InferenceScheme, ignore: list[str]) -> dict:
    if scheme.name != "fp8-block":
        raise MixprecError(
            f"--format hf-fp8 holds 128x128 block scales only (scheme fp8-block); {scheme.name} is written in "
            "the compressed-tensors layout (transformers and vLLM read per-tensor/per-channel hf-fp8 differently)"
        )
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": sorted(ignore),
    }


# ---------------------------------------------------------------------------------------------------
# Reading, for the loader


@dataclass(frozen=True)
class ModuleLayout:
    """How one module's tensors are stored."""

    weight_granularity: Granularity
    input_granularity: Granularity
    input_dynamic: bool
    scale_name: str  # WEIGHT_SCALE or WEIGHT_SCALE_INV
    block_scheme: str | None = (
        None  # a block-format scheme (nvfp4, mxfp4...): its tensors, block_tensors.read_layer
    )

    def as_scheme(self) -> InferenceScheme:
        if self.block_scheme is not None:
            return InferenceScheme.from_name(self.block_scheme)
        for s in (InferenceScheme.from_name(n) for n in ("fp8-dynamic", "fp8-static", "fp8-block")):
            if (s.weight_granularity, s.input_granularity, s.input_dynamic) == (
                self.weight_granularity,
                self.input_granularity,
                self.input_dynamic,
            ):
                return s
        name = f"fp8-w{self.weight_granularity.name}-a{self.input_granularity.name}"
        return InferenceScheme(name, self.weight_granularity, self.input_granularity, self.input_dynamic)


@dataclass(frozen=True)
class LayoutSpec:
    layout: str  # "compressed-tensors" | "hf-fp8"
    groups: tuple[tuple[tuple[str, ...], ModuleLayout], ...]  # (targets, layout)
    ignore: tuple[str, ...]
    kv_cache: bool

    def module_layout(self, name: str, class_name: str) -> ModuleLayout | None:
        """The layout of module `name` (class `class_name`), None when it is not quantized."""
        if any(_ct_target_matches(name, class_name, p) for p in self.ignore):
            return None
        for targets, ml in self.groups:
            if any(_ct_target_matches(name, class_name, t) for t in targets):
                return ml
        return None


def _ct_target_matches(name: str, class_name: str, target: str) -> bool:
    """A checkpoint's target or ignore entry names this module: its class name, or its own name
    (mixprec.select.matches: "re:" from the start of the name, as compressed-tensors and vLLM read it)."""
    return target == class_name or matches(name, target)


def _granularity(args: dict, where: str) -> Granularity:
    strategy = str(args.get("strategy", "")).lower()
    if strategy == "tensor":
        return Granularity.tensor()
    if strategy in ("channel", "token"):
        return Granularity.rows()
    if strategy == "block":
        br, bc = args.get("block_structure") or (128, 128)
        return Granularity.blocks(int(br), int(bc))
    if strategy == "group":
        return Granularity.blocks(1, int(args.get("group_size") or 128))
    raise MixprecError(f"{where}: unsupported quantization strategy {strategy!r}")


def parse_quantization_config(qc: dict, where: str) -> LayoutSpec:
    """Parse a config.json `quantization_config` (compressed-tensors or HF fp8) into a LayoutSpec."""
    if not isinstance(qc, dict):
        raise MixprecError(f"{where}: quantization_config must be a JSON object")
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        wg = Granularity.blocks(int(block[0]), int(block[1])) if block else Granularity.tensor()
        dynamic = str(qc.get("activation_scheme", "dynamic")).lower() == "dynamic"
        ig = Granularity.blocks(1, int(block[1])) if (block and dynamic) else Granularity.tensor()
        ml = ModuleLayout(wg, ig, dynamic, WEIGHT_SCALE_INV)
        ignore = tuple(qc.get("modules_to_not_convert") or ())
        return LayoutSpec("hf-fp8", ((("Linear",), ml),), ignore, False)
    if str(method).lower().startswith("modelopt"):
        return _modelopt_load_spec(qc, where)
    if method != "compressed-tensors":
        raise MixprecError(
            f"{where}: quant_method {method!r} is not one mixprec loads (compressed-tensors, fp8 or modelopt)"
        )
    groups = []
    for gname, group in (qc.get("config_groups") or {}).items():
        w, a = group.get("weights"), group.get("input_activations")
        block = block_scheme_of(group)
        if block is not None:
            sch = InferenceScheme.from_name(block)
            ml = ModuleLayout(
                sch.weight_granularity, sch.input_granularity, sch.input_dynamic, WEIGHT_SCALE, block
            )
            groups.append((tuple(group.get("targets") or ("Linear",)), ml))
            continue
        if not w or w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
            raise MixprecError(f"{where}: config group {gname!r} is not an FP8 weight scheme mixprec loads")
        wg = _granularity(w, f"{where} {gname}.weights")
        if a:
            dynamic = bool(a.get("dynamic"))
            ig = _granularity(a, f"{where} {gname}.input_activations")
        else:  # weight-only FP8: mixprec still runs an FP8 GEMM, with dynamic per-token inputs
            dynamic, ig = True, Granularity.rows()
        groups.append(
            (tuple(group.get("targets") or ("Linear",)), ModuleLayout(wg, ig, dynamic, WEIGHT_SCALE))
        )
    if not groups:
        raise MixprecError(f"{where}: compressed-tensors quantization_config has no config_groups")
    return LayoutSpec(
        "compressed-tensors", tuple(groups), tuple(qc.get("ignore") or ()), bool(qc.get("kv_cache_scheme"))
    )


def block_scheme_of(group: dict) -> str | None:
    """The block scheme (nvfp4a16, nvfp4, mxfp4a16, mxfp4, mxfp8) a compressed-tensors config group
    holds, or None when it is none of them: FP4 weights in groups of 16 (NVFP4) or 32 (MXFP4), or FP8
    weights in groups of 32 with uint8 (E8M0) scales (MXFP8); activations decide A16 or not."""
    w, a = group.get("weights") or {}, group.get("input_activations")
    if w.get("type") != "float" or w.get("strategy") not in ("group", "tensor_group"):
        return None
    bits, size = int(w.get("num_bits", 0)), int(w.get("group_size") or 0)
    if bits == 4 and size == 16:
        return "nvfp4" if a else "nvfp4a16"
    if bits == 4 and size == 32:
        return "mxfp4" if a else "mxfp4a16"
    if bits == 8 and size == 32 and "uint8" in str(w.get("scale_dtype")):
        return "mxfp8"
    return None


def _modelopt_load_spec(qc: dict, where: str) -> LayoutSpec:
    """A ModelOpt `quantization_config` (config.json, `quant_method: modelopt`) or hf_quant_config.json
    ({"quantization": {...}}) as a LayoutSpec, for the algorithms that are mixprec FP8 schemes
    (MODELOPT_ALGO_SCHEMES): FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO (vLLM runs its inputs dynamic per
    1x128 group, as fp8-block). Tensor names are compressed-tensors' (`weight_scale`, `input_scale`);
    only the scale shapes differ ((), (out,), (out/128, 1, in/128, 1)), which the loader reshapes by count."""
    details = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
    algo = str(details.get("quant_algo") or "").upper()
    ignore = tuple(details.get("exclude_modules") or qc.get("ignore") or ())
    kv = bool(details.get("kv_cache_quant_algo") or qc.get("kv_cache_scheme"))
    fp8 = {}
    for name, scheme_name in MODELOPT_ALGO_SCHEMES.items():
        s = SCHEMES.get(scheme_name)
        if s is not None and scheme_name.startswith("fp8-"):  # the loader builds FP8 Linears only
            fp8[name] = ModuleLayout(s.weight_granularity, s.input_granularity, s.input_dynamic, WEIGHT_SCALE)
    for name, scheme_name in MODELOPT_ALGO_SCHEMES.items():
        s = SCHEMES.get(scheme_name)
        if s is not None and not s.is_fp8:  # NVFP4: tensors read by block_tensors.read_layer(modelopt=True)
            fp8[name] = ModuleLayout(
                s.weight_granularity, s.input_granularity, s.input_dynamic, WEIGHT_SCALE, scheme_name
            )
    if algo in fp8:
        return LayoutSpec("modelopt", ((("Linear",), fp8[algo]),), ignore, kv)
    if algo == "MIXED_PRECISION":
        groups = []
        for name, cfg in (details.get("quantized_layers") or {}).items():
            sub = str((cfg or {}).get("quant_algo") or "").upper()
            if sub not in fp8:
                raise MixprecError(
                    f"{where}: layer {name!r} is {sub or 'unnamed'}; mixprec loads ModelOpt's algorithms "
                    f"({', '.join(fp8)}) only; `mixprec inspect` describes the checkpoint"
                )
            groups.append(((name,), fp8[sub]))
        return LayoutSpec("modelopt", tuple(groups), ignore, kv)
    raise MixprecError(
        f"{where}: ModelOpt quant_algo {algo or 'missing'!r} is not one mixprec loads (it runs {', '.join(fp8)}); "
        "`mixprec inspect` describes the checkpoint"
    )


def read_quantization_config(root: Path, config: dict) -> tuple[dict | None, Path]:
    """(the checkpoint's quantization config, the file it came from): config.json's
    `quantization_config`, else ModelOpt's hf_quant_config.json (older ModelOpt exports write only
    that file; vLLM reads it too), else (None, config.json)."""
    qc = config.get("quantization_config")
    if qc is not None:
        return qc, root / "config.json"
    path = root / MODELOPT_CONFIG_NAME
    if not path.exists():
        return None, root / "config.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise MixprecError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("quantization"), dict):
        raise MixprecError(f"{path}: expected an object with a 'quantization' object (ModelOpt's layout)")
    return {**doc, "quant_method": "modelopt"}, path


# ---------------------------------------------------------------------------------------------------
# Reading, in the layout table's terms (inspect, convert)


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
