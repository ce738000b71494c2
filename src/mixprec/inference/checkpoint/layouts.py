"""Checkpoint layouts that serving engines read: compressed-tensors (vLLM, transformers with the
compressed-tensors package) and Hugging Face `quant_method: "fp8"` (fine-grained, 128x128 blocks).

Writing: the `quantization_config` dict for config.json and the tensor names per layer.
Reading: parse a config.json `quantization_config` into a `LayoutSpec` saying, per module, which
scheme-like layout its tensors have, so the loader can rebuild FP8 Linears from any of the producers
(mixprec, llm-compressor, Hugging Face fp8 checkpoints, NVIDIA ModelOpt's FP8 algorithms).

Inspect and convert use the layout-neutral description in layout_tables.py (every scheme a layout can
hold, its tensor names, shapes and scale conventions); ModelOpt's algorithm names are defined here
once (MODELOPT_ALGO_SCHEMES) and read there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mixprec.errors import MixprecError
from mixprec.inference.checkpoint.fp4_layout import ct_block_scheme_args
from mixprec.inference.schemes import SCHEMES, InferenceScheme
from mixprec.scaling import Granularity
from mixprec.select import matches

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


def tensor_names(layout: str) -> dict[str, str]:
    """role -> tensor suffix for one quantized Linear."""
    if layout == "compressed-tensors":
        return {"weight": "weight", "weight_scale": "weight_scale", "input_scale": "input_scale"}
    if layout == "hf-fp8":
        return {"weight": "weight", "weight_scale": "weight_scale_inv", "input_scale": "input_scale"}
    raise MixprecError(f"unknown checkpoint format {layout!r}; known: {', '.join(LAYOUTS)}")


# ---------------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class ModuleLayout:
    """How one module's tensors are stored."""

    weight_granularity: Granularity
    input_granularity: Granularity
    input_dynamic: bool
    scale_name: str  # "weight_scale" or "weight_scale_inv"
    block_scheme: str | None = (
        None  # a block-format scheme (nvfp4, mxfp4...): its tensors, fp4_layout.read_layer
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
        ml = ModuleLayout(wg, ig, dynamic, "weight_scale_inv")
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
                sch.weight_granularity, sch.input_granularity, sch.input_dynamic, "weight_scale", block
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
            (tuple(group.get("targets") or ("Linear",)), ModuleLayout(wg, ig, dynamic, "weight_scale"))
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
            fp8[name] = ModuleLayout(
                s.weight_granularity, s.input_granularity, s.input_dynamic, "weight_scale"
            )
    for name, scheme_name in MODELOPT_ALGO_SCHEMES.items():
        s = SCHEMES.get(scheme_name)
        if s is not None and not s.is_fp8:  # NVFP4: tensors read by fp4_layout.read_layer(modelopt=True)
            fp8[name] = ModuleLayout(
                s.weight_granularity, s.input_granularity, s.input_dynamic, "weight_scale", scheme_name
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


def ct_group_args(strategy: str, dynamic: bool, **extra) -> dict:
    """The compressed-tensors QuantizationArgs (as JSON) of an 8-bit float weight or activation."""
    return _ct_args(strategy, dynamic, **extra)
