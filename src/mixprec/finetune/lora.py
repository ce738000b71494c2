"""LoRA over mixprec's quantized inference Linears, through peft (issue 29).

peft wraps the layers it knows (nn.Linear, bitsandbytes, torchao...) and takes others through
`LoraConfig._register_custom_module` (private and experimental in peft; its mapping is not saved with the
adapter). `QuantizedLoraLinear` is peft's own `lora.Linear` — the same forward, base_layer(x) + scaling ·
lora_B(lora_A(dropout(x))), the same adapter parameters and names — over a QuantizedLinear or
BlockQuantizedLinear of any scheme. The base stays frozen (its payloads are buffers); its input gets its
gradient (runtime/gradients.py), so adapters of earlier layers train too. What differs from an nn.Linear
base: the adapters take the layer's compute dtype (`out_dtype`), not its float8 payload's, and a merge
re-quantizes.

The helpers register the mapping where peft needs it: `lora_config` / `add_lora` (a new adapter),
`load_lora` (before `PeftModel.from_pretrained` on a quantized base). The saved adapter is peft's format
with nothing of mixprec in it, so plain peft loads it on the original (unquantized) model, and vLLM serves
it.

Merging is lossy by design: the merged weight (dequantized base + B·A·scaling) is rounded again with the
layer's scheme (RTN, `quantize_weight`), so `save_quantized` writes an ordinary checkpoint. `merge_lora`
gives the shards of one fused GEMM (q/k/v, gate/up) one NVFP4 weight global scale again, as serving needs;
a single layer's `merge()` keeps its global scale (its shards are not its to change) and `unmerge()`
restores the exact base payload it kept.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.inference.checkpoint.block_tensors import fused_global_scales
from mixprec.inference.checkpoint.layout import INPUT_GLOBAL_SCALE, WEIGHT_GLOBAL_SCALE
from mixprec.inference.runtime.linear import BlockQuantizedLinear, QuantizedLinear, quantized_linear
from mixprec.inference.schemes import InferenceScheme, quantize_weight

_PEFT_MISSING = "LoRA over quantized models needs peft: pip install 'mixprec[finetune]'"


def _require_peft() -> None:
    """Before any work: peft is an optional package (the `finetune` extra)."""
    try:
        found = importlib.util.find_spec("peft") is not None
    except ValueError:  # blocked in sys.modules (None there)
        found = False
    if not found:
        raise MixprecError(_PEFT_MISSING)


def _lora_linear_base() -> type:
    _require_peft()
    from peft.tuners.lora.layer import Linear

    return Linear


def _base_payload(layer: QuantizedLinear) -> dict[str, torch.Tensor | None]:
    return {k: layer._buffers.get(k) for k in layer._QUANTIZED_BUFFERS}


def requantize_(
    layer: QuantizedLinear, weight: torch.Tensor, *, global_scale: torch.Tensor | None = None
) -> None:
    """Round `weight` (fp32, the layer's shape) with the layer's scheme into the layer's buffers, in place:
    the static input scale (fp8-static) or input global scale (nvfp4) is kept; NVFP4 weights take
    `global_scale` (None: their own)."""
    q, _ = quantize_weight(
        weight.detach().float(), layer.scheme, name="merged weight", global_scale=global_scale
    )
    input_scale = (
        getattr(layer, INPUT_GLOBAL_SCALE, None)
        if isinstance(layer, BlockQuantizedLinear)
        else layer.input_scale
    )
    fresh = quantized_linear(q, layer.bias, layer.scheme, input_scale=input_scale, out_dtype=layer.out_dtype)
    device = next(t.device for t in _base_payload(layer).values() if t is not None)
    for k in layer._QUANTIZED_BUFFERS:
        t = fresh._buffers.get(k)
        layer._buffers[k] = None if t is None else t.to(device)
    layer.weight_granularity = fresh.weight_granularity
    layer.decoded_weight = None  # the payload changed: its decoded copy is stale


class _QuantizedLoraMixin:
    """What peft's lora.Linear needs changed for a quantized base (mixed into it in `lora_layer_class`)."""

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        return module.in_features, module.out_features  # peft's guess works too, with a warning

    def _get_base_layer_device_and_dtype(self, base_layer):
        # peft casts the adapters to the base weight's dtype: float8 here; the compute dtype is meant
        device = next(t.device for t in _base_payload(base_layer).values() if t is not None)
        return device, base_layer.out_dtype

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Add the adapters' B·A·scaling to the dequantized base and round again (lossy; see the module
        docstring). The exact base payload is kept for unmerge()."""
        from peft.tuners.tuners_utils import check_adapters_to_merge

        names = [a for a in check_adapters_to_merge(self, adapter_names) if a in self.lora_A]
        if not names:
            return
        base = self.get_base_layer()
        if any(self.lora_variant.get(a) is not None or self.lora_bias.get(a) for a in names):
            raise MixprecError(
                "merging into a quantized layer takes plain LoRA adapters (no DoRA/variants, no lora_bias)"
            )
        merged = self.merged_weight(names)
        if safe_merge and not torch.isfinite(merged).all():
            raise MixprecError(f"NaNs in the merged weight of adapters {names}: the adapter seems broken")
        if not self.merged_adapters:
            self._unmerged_payload = (_base_payload(base), base.weight_granularity)
        requantize_(base, merged, global_scale=getattr(base, WEIGHT_GLOBAL_SCALE, None))
        self.merged_adapters.extend(names)

    def merged_weight(self, adapter_names: list[str]) -> torch.Tensor:
        """The base's dequantized weight plus the adapters' deltas, in fp32."""
        with torch.no_grad():
            w = self.get_base_layer().dequantized_weight(torch.float32)
            for a in adapter_names:
                w = w + self.get_delta_weight(a).float().to(w.device)
        return w

    def unmerge(self) -> None:
        if not self.merged:
            return
        base = self.get_base_layer()
        payload, granularity = self._unmerged_payload
        for k, t in payload.items():
            base._buffers[k] = t
        base.weight_granularity = granularity
        base.decoded_weight = None
        self.merged_adapters.clear()
        del self._unmerged_payload


_LAYER_CLASS: list[type] = []


def lora_layer_class() -> type:
    """The LoRA layer class for QuantizedLinear and BlockQuantizedLinear bases (built on first use, so that
    importing mixprec.finetune does not import peft)."""
    if not _LAYER_CLASS:
        base = _lora_linear_base()
        cls = type(
            "QuantizedLoraLinear",
            (_QuantizedLoraMixin, base),
            {
                "__doc__": "peft's lora.Linear over a mixprec quantized Linear (any scheme).",
                "__module__": __name__,
            },
        )
        _LAYER_CLASS.append(cls)
    return _LAYER_CLASS[0]


def register(config: Any) -> Any:
    """`config` (a LoraConfig) with mixprec's quantized Linears mapped to their LoRA layer, in place."""
    config._register_custom_module({QuantizedLinear: lora_layer_class()})  # Block* are QuantizedLinear
    return config


def lora_config(**kwargs: Any) -> Any:
    """A peft LoraConfig (its keyword arguments) with the quantized layers' mapping registered."""
    _require_peft()
    from peft import LoraConfig

    return register(LoraConfig(**kwargs))


def _linear_names(model: nn.Module) -> list[str]:
    """Linears peft could wrap (plain or quantized), the output head left out as peft's all-linear does."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [
        n for n, m in model.named_modules() if isinstance(m, (nn.Linear, QuantizedLinear)) and m is not head
    ]


def _resolve_targets(model: nn.Module, config: Any) -> None:
    """Expand "all-linear" to the quantized Linears too (peft's shorthand knows nn.Linear only) and refuse
    patterns that match no Linear, naming them and some module names."""
    from peft.tuners.tuners_utils import check_target_module_exists

    targets = config.target_modules
    if targets is None:
        return  # peft's own per-architecture defaults
    names = _linear_names(model)
    if isinstance(targets, str) and targets.lower() == "all-linear":
        config.target_modules = {n.rsplit(".", 1)[-1] for n in names}
        return
    if not any(check_target_module_exists(config, n) for n in names):
        shown = ", ".join(names[:5]) + (f" ... ({len(names)} Linears)" if len(names) > 5 else "")
        pattern = targets if isinstance(targets, str) else sorted(targets)
        raise MixprecError(
            f"LoRA target_modules {pattern} match no Linear of the model; its Linears: {shown or 'none'}"
        )


def add_lora(model: nn.Module, config: Any = None, **kwargs: Any) -> Any:
    """A PeftModel with new LoRA adapters over `model` (quantized or not): `config` a LoraConfig, or
    LoraConfig keyword arguments. Like peft's get_peft_model, it wraps `model`'s Linears in place (copying a
    model to adapt would double its memory); the config is copied (the caller's is left as it was)."""
    _require_peft()
    from peft import LoraConfig, get_peft_model

    if config is None:
        config = LoraConfig(**kwargs)
    elif kwargs:
        raise MixprecError("add_lora takes a LoraConfig or its keyword arguments, not both")
    if not isinstance(config, LoraConfig):
        raise MixprecError(f"add_lora takes a peft LoraConfig, got {type(config).__name__}")
    config = register(copy.deepcopy(config))
    _resolve_targets(model, config)
    return get_peft_model(model, config)


def load_lora(model: nn.Module, adapter_dir: Any, **kwargs: Any) -> Any:
    """`PeftModel.from_pretrained(model, adapter_dir)` with the quantized layers' mapping registered first
    (peft does not save it); kwargs go to from_pretrained (is_trainable=True to train on)."""
    _require_peft()
    from peft import PeftConfig, PeftModel

    config = PeftConfig.from_pretrained(str(adapter_dir))
    if getattr(config, "peft_type", None) is None or str(config.peft_type.value) != "LORA":
        raise MixprecError(
            f"{adapter_dir}: not a LoRA adapter (peft_type {getattr(config, 'peft_type', None)})"
        )
    return PeftModel.from_pretrained(model, str(adapter_dir), config=register(config), **kwargs)


def merge_lora(peft_model: Any, *, scheme: str | None = None) -> nn.Module:
    """A copy of the base model with the active adapters merged: every adapted quantized Linear holds its
    merged weight rounded with its scheme (RTN, lossy by design), the shards of a fused GEMM one NVFP4
    global scale (others of a group re-rounded with it only where it changed); plain Linears merge exactly
    as peft does. `scheme` (one without calibrated input scales): every quantized Linear rounded into that
    scheme instead, the adapted ones from their merged weight. `peft_model` is left as it was."""
    target = None if scheme is None else InferenceScheme.from_name(scheme)
    if target is not None and target.needs_calibration:
        raise MixprecError(
            f"merge_lora(scheme={target.name!r}): its static input scales need calibration; merge with the "
            "layers' own schemes, or into a scheme with dynamic or no input quantization"
        )
    model = copy.deepcopy(peft_model)
    cls = lora_layer_class()
    root = model.base_model.model
    adapted = {n: m for n, m in root.named_modules() if isinstance(m, cls)}
    merged = {}
    for name, m in adapted.items():
        if m.merged:
            m.unmerge()
        merged[name] = m.merged_weight([a for a in m.active_adapters if a in m.lora_A])
        parent, _, child = name.rpartition(".")
        setattr(root.get_submodule(parent), child, m.get_base_layer())  # the base takes the wrapper's place
    if target is None:
        _requantize_merged(root, merged)
    else:
        _round_into(root, merged, target)
    return model.merge_and_unload()  # the plain Linears' adapters, merged exactly as peft does


def _nvfp4_global_scales(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One NVFP4 weight global scale per fused GEMM (q/k/v, gate/up), from the weights' amax."""
    return fused_global_scales({n: float(w.abs().max()) for n, w in weights.items()}, dtype)


def _round_into(root: nn.Module, merged: dict[str, torch.Tensor], scheme: InferenceScheme) -> None:
    """Replace every quantized Linear by one of `scheme`, rounded from its merged (or dequantized) weight."""
    layers = {n: m for n, m in root.named_modules() if isinstance(m, QuantizedLinear)}
    weights = {
        n: merged[n] if n in merged else m.dequantized_weight(torch.float32) for n, m in layers.items()
    }
    globals_ = {}
    if layers and scheme.weight_granularity.scale_format == "e4m3":  # NVFP4
        globals_ = _nvfp4_global_scales(weights, next(iter(layers.values())).out_dtype)
    for name, layer in layers.items():
        q, _ = quantize_weight(weights[name], scheme, name=f"{name}.weight", global_scale=globals_.get(name))
        fresh = quantized_linear(q, layer.bias, scheme, out_dtype=layer.out_dtype)
        parent, _, child = name.rpartition(".")
        setattr(root.get_submodule(parent), child, fresh.to(q.data.device))


def _requantize_merged(root: nn.Module, merged: dict[str, torch.Tensor]) -> None:
    """Round the merged weights into their layers; NVFP4 layers get fused-group global scales from the
    merged amax (unmerged shards: their dequantized weight's), and an unmerged shard whose group scale
    changed is re-rounded with it."""
    layers = {n: m for n, m in root.named_modules() if isinstance(m, QuantizedLinear)}
    nvfp4 = {n for n, m in layers.items() if getattr(m, WEIGHT_GLOBAL_SCALE, None) is not None}
    globals_ = {}
    if nvfp4:
        weights = {
            n: merged[n] if n in merged else layers[n].dequantized_weight(torch.float32) for n in nvfp4
        }
        globals_ = _nvfp4_global_scales(weights, next(layers[n] for n in nvfp4).out_dtype)
    for name, layer in layers.items():
        g = globals_.get(name)
        if name in merged:
            requantize_(layer, merged[name], global_scale=g)
        elif g is not None and not torch.equal(g.float().reshape(1), layer.weight_global_scale.reshape(1)):
            requantize_(layer, layer.dequantized_weight(torch.float32), global_scale=g)
