"""save_quantized: a model whose Linears run in FP8 or FP4 (from `load_quantized` or `quantize_model_`) ->
the checkpoint directory `mixprec quantize` writes, with the same writer.

The payloads and scales are written as the model holds them, bit for bit (casting a quantized model
with `.to(dtype)` changes its compute dtype only, see linear.py), the other tensors in the dtype the
model has now; config.json gets the layout's `quantization_config` and the dtype of those tensors, and
`model.fp8_scales.json` lists every quantized layer. Streaming and atomic, as quantize: nothing is
left half-written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.files import check_new_output
from mixprec.inference.checkpoint import configs, layout
from mixprec.inference.checkpoint.layout import INPUT_SCALE, K_SCALE, V_SCALE, WEIGHT_SCALE
from mixprec.inference.checkpoint.publish import publish
from mixprec.inference.checkpoint.safetensors_io import (
    PlannedShardWriter,
    PlannedTensor,
)
from mixprec.inference.checkpoint.scales_file import build_document, layer_entry
from mixprec.inference.mixed import MIXED, check_groups_whole
from mixprec.inference.runtime.experts import UnfusedExperts
from mixprec.inference.runtime.linear import BlockQuantizedLinear, QuantizedLinear
from mixprec.inference.schemes import SCHEMES, InferenceScheme

DEFAULT_MAX_SHARD_SIZE = 2 << 30


def _scheme_of(name: str, m: QuantizedLinear) -> InferenceScheme:
    """The named scheme the layer's stored tensors follow (what the checkpoint's config will say)."""
    if isinstance(m, BlockQuantizedLinear):  # NVFP4 / MX: its buffers are already the layout's tensors
        return m.scheme
    for candidate in (InferenceScheme.from_name(n) for n in SCHEMES):
        static = not candidate.input_dynamic
        if (
            candidate.weight_granularity == m.weight_granularity
            and static == (m.input_scale is not None)
            and (static or candidate.input_granularity == m.input_granularity)
        ):
            return candidate
    raise MixprecError(
        f"{name}: weights {m.weight_granularity.name}, inputs "
        f"{'static per-tensor' if m.input_scale is not None else 'dynamic ' + m.input_granularity.name} "
        f"is none of the schemes a checkpoint is written in ({', '.join(SCHEMES)})"
    )


def _check_mixed(schemes: dict[str, InferenceScheme], format: str) -> None:
    """A mixed-precision model is written as compressed-tensors config groups, each fused group
    (q/k/v, gate/up, experts) in one scheme: serving engines run its members as one GEMM."""
    if format != "compressed-tensors":
        names = sorted({s.name for s in schemes.values()})
        raise MixprecError(
            f"the model's Linears are in several schemes ({', '.join(names)}): a mixed-precision checkpoint is "
            f"written in the compressed-tensors layout only, not {format}"
        )
    check_groups_whole(schemes, "the model")


def _output_dtype_name(model: nn.Module) -> str | None:
    dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return str(dtypes[0]).replace("torch.", "") if dtypes else None


def save_quantized(
    model: nn.Module,
    output_dir: str | os.PathLike,
    *,
    format: str = "compressed-tensors",
    tokenizer: Any = None,
    force: bool = False,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write `model` (a Hugging Face model with QuantizedLinear layers) as a quantized checkpoint directory
    that `load_quantized`, vLLM and transformers read; returns the directory. Linears in several schemes
    make a mixed-precision checkpoint (compressed-tensors, one config group per scheme).

    format: "compressed-tensors" or "hf-fp8" (fp8-block only), as `mixprec quantize --format`.
    tokenizer: saved beside the weights when given (the model does not know its tokenizer).
    """
    from mixprec import __version__

    out = Path(output_dir)
    names = layout.tensor_names(format)  # refuses an unknown format
    quantized, schemes, scheme = _savable(model, format)
    check_new_output(out, force, flag="force=True")
    ignored = sorted(
        n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, QuantizedLinear)
    )
    kv_cache = any(n.endswith((f".{K_SCALE}", f".{V_SCALE}")) for n, _ in model.named_buffers())
    if format == "hf-fp8" and kv_cache:
        raise MixprecError("--kv-cache fp8 scales are written in the compressed-tensors layout only")
    tensors = _state_tensors(model, quantized, schemes, names)
    report = getattr(model, "mixprec_report", None)
    layers = _layer_entries(quantized, schemes, getattr(report, "layers", None) or {})
    not_quantized = {n: "not quantized in the model" for n in ignored}
    for e in getattr(report, "entries", []):
        if e.name in not_quantized and e.precision.startswith("skipped"):
            not_quantized[e.name] = e.reason
    planned = [PlannedTensor(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    out_cfg = _output_config(model, format, scheme, schemes, ignored, kv_cache)
    kv_doc = {
        owner: {k: float(m.get_buffer(k).reshape(-1)[0]) for k in (K_SCALE, V_SCALE) if hasattr(m, k)}
        for owner, m in model.named_modules()
        if isinstance(getattr(m, K_SCALE, None), torch.Tensor)
    }

    def write_tensors(writer: PlannedShardWriter) -> None:
        for k, t in tensors.items():
            writer.write(k, t)

    def side_files(tmp: Path) -> None:
        generation = getattr(model, "generation_config", None)
        if generation is not None and hasattr(generation, "save_pretrained"):
            generation.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)

    def scales() -> dict[str, Any]:
        return build_document(
            scheme=scheme.name, layout=format, layers=layers, kv_cache=kv_doc, ignored=not_quantized,
            calibration=getattr(report, "calibration", None), producer=f"mixprec {__version__} (save_quantized)",
        )  # fmt: skip

    publish(
        out, force=force, planned=planned, max_shard_size=max_shard_size, producer=f"mixprec {__version__}",
        write_tensors=write_tensors, config=lambda: out_cfg, side_files=side_files, scales=scales,
    )  # fmt: skip
    return out


def _savable(model: nn.Module, format: str) -> tuple[dict[str, QuantizedLinear], dict[str, InferenceScheme], InferenceScheme]:  # fmt: skip
    """({name: quantized Linear}, {name: its scheme}, the checkpoint's scheme: MIXED when several),
    MixprecError when the model cannot be saved in `format`."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        raise MixprecError(
            f"save_quantized writes Hugging Face checkpoints; {type(model).__name__} has no config "
            "(save a plain module's state_dict() with safetensors instead)"
        )
    unfused = [n for n, m in model.named_modules() if isinstance(m, UnfusedExperts)]
    if unfused:
        raise MixprecError(
            f"save_quantized does not write per-expert MoE Linears yet ({unfused[0]}); "
            "quantize the original checkpoint with `mixprec quantize` instead"
        )
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    if not quantized:
        raise MixprecError(
            f"{type(model).__name__} has no quantized Linear layers: quantize it with mixprec.quantize_model_ "
            "first, or save it with save_pretrained"
        )
    schemes = {n: _scheme_of(n, m) for n, m in quantized.items()}
    # several schemes (quantize_model_(model, "auto") or a {Linear: scheme} mapping): one
    # compressed-tensors config group per scheme, as quantize_checkpoint writes it
    mixed = len(set(schemes.values())) > 1
    scheme = MIXED if mixed else next(iter(schemes.values()))
    if mixed:
        _check_mixed(schemes, format)
    if format == "hf-fp8":
        configs.hf_fp8_quantization_config(scheme, [])  # refuses non-block schemes
    return quantized, schemes, scheme


def _state_tensors(model: nn.Module, quantized: dict[str, QuantizedLinear], schemes: dict[str, InferenceScheme],
                   names: dict[str, str]) -> dict[str, torch.Tensor]:  # fmt: skip
    """Every tensor of the state dict once (tied weights share storage: the first name keeps it, as
    save_pretrained does), scales named and shaped as the layout stores them."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, torch.dtype, tuple[int, ...]]] = set()
    for key, t in model.state_dict().items():
        if t.device.type == "meta":
            raise MixprecError(f"{key} is on the meta device: nothing to write")
        ident = (t.data_ptr(), t.dtype, tuple(t.shape)) if t.numel() else None
        if ident is not None and ident in seen:
            continue
        if ident is not None:
            seen.add(ident)
        module, _, leaf = key.rpartition(".")
        m = quantized.get(module)
        if m is not None and leaf == WEIGHT_SCALE:
            tensors[f"{module}.{names[WEIGHT_SCALE]}"] = t.reshape(
                schemes[module].scale_shape(m.out_features, m.in_features)
            )
        elif m is not None and leaf == INPUT_SCALE:
            tensors[f"{module}.{names[INPUT_SCALE]}"] = t.reshape(1)
        else:
            tensors[key] = t
    return tensors


def _layer_entries(quantized: dict[str, QuantizedLinear], schemes: dict[str, InferenceScheme],
                   known: dict[str, Any]) -> dict[str, dict[str, Any]]:  # fmt: skip
    """The scales-file entry of each FP8 Linear (`known`: the model's report's, for what the model no
    longer knows: relative error, input amax); block-format scales live in the checkpoint (millions)."""
    layers: dict[str, dict[str, Any]] = {}
    for n, m in quantized.items():
        if isinstance(m, BlockQuantizedLinear):
            continue
        before = known.get(n, {})
        q = m.quantized_weight()
        layers[n] = layer_entry(
            scheme=schemes[n].name, weight_granularity=m.weight_granularity.name, weight_scale=m.weight_scale.cpu(),
            weight_amax=float(q.dequantize(torch.float32).abs().max()),
            relative_weight_error=(before.get("weight") or {}).get("relative_error"),
            shape=(m.out_features, m.in_features), input_scale=None if m.input_scale is None else m.input_scale.cpu(),
            input_amax=(before.get("input") or {}).get("amax"), input_dynamic=m.input_scale is None,
            input_granularity=m.input_granularity.name,
        )  # fmt: skip
    return layers


def _output_config(model: nn.Module, format: str, scheme: InferenceScheme, schemes: dict[str, InferenceScheme],
                   ignored: list[str], kv_cache: bool) -> dict[str, Any]:  # fmt: skip
    """The model's config (as save_pretrained writes it) with the layout's quantization_config."""
    out_cfg = json.loads(model.config.to_json_string(use_diff=True))
    out_cfg.pop("quantization_config", None)
    out_cfg["architectures"] = [
        type(model).__name__
    ]  # as save_pretrained records it: loaders build this class
    dtype = _output_dtype_name(model)
    if dtype is not None:
        out_cfg["dtype"] = dtype
        out_cfg.pop("torch_dtype", None)
    if scheme is MIXED:
        out_cfg["quantization_config"] = configs.ct_mixed_quantization_config(schemes, ignored, kv_cache)
    elif format == "compressed-tensors":
        out_cfg["quantization_config"] = configs.ct_quantization_config(scheme, ignored, kv_cache)
    else:
        out_cfg["quantization_config"] = configs.hf_fp8_quantization_config(scheme, ignored)
    return out_cfg
