"""Checkpoint layouts that serving engines read: compressed-tensors (vLLM, transformers with the
compressed-tensors package) and Hugging Face `quant_method: "fp8"` (fine-grained, 128x128 blocks).

Writing: the `quantization_config` dict for config.json and the tensor names per layer.
Reading: parse a config.json `quantization_config` into a `LayoutSpec` saying, per module, which
scheme-like layout its tensors have, so the loader can rebuild FP8 Linears from any of the producers
(mixprec, llm-compressor, Hugging Face fp8 checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass

from mixprec.errors import MixprecError
from mixprec.inference.schemes import InferenceScheme
from mixprec.scaling import Granularity
from mixprec.select import matches

LAYOUTS = ("compressed-tensors", "hf-fp8")


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


def ct_quantization_config(scheme: InferenceScheme, ignore: list[str], kv_cache: bool) -> dict:
    """The compressed-tensors `quantization_config` llm-compressor writes for this scheme.

    `ignore` lists the Linear module names left unquantized: with `targets: ["Linear"]`, readers
    (vLLM, compressed-tensors) quantize every other Linear.
    """
    if scheme.name == "fp8-dynamic":
        weights = _ct_args("channel", False)
        inputs = _ct_args("token", True)
    elif scheme.name == "fp8-static":
        weights = _ct_args("tensor", False)
        inputs = _ct_args("tensor", False, observer="static_minmax")
    elif scheme.name == "fp8-block":
        weights = _ct_args("block", False, block_structure=[128, 128])
        inputs = _ct_args("group", True, group_size=128)
    else:  # pragma: no cover - from_name guards
        raise MixprecError(f"no compressed-tensors layout for {scheme.name}")
    kv = None
    if kv_cache:
        kv = _ct_args("tensor", False, observer="minmax")
    return {
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": inputs,
                "output_activations": None,
                "format": "float-quantized",
            }
        },
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": kv,
        "format": "float-quantized",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": sorted(ignore),
        "sparsity_config": {},
        "transform_config": {},
    }


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

    def as_scheme(self) -> InferenceScheme:
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
    if method != "compressed-tensors":
        raise MixprecError(
            f"{where}: quant_method {method!r} is not one mixprec loads (compressed-tensors or fp8)"
        )
    groups = []
    for gname, group in (qc.get("config_groups") or {}).items():
        w, a = group.get("weights"), group.get("input_activations")
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
