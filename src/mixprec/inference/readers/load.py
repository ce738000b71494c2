"""load_quantized: a quantized checkpoint directory -> a model whose Linears run in FP8 or FP4 (eval mode).

Reads the layouts of mixprec, llm-compressor (compressed-tensors, float-quantized) and Hugging Face
`quant_method: "fp8"`. The model skeleton is built from config.json with its parameters on the meta
device (buffers such as rotary tables stay real), quantized Linears are swapped for QuantizedLinear
built from the stored payload and scales, and the other tensors are assigned as stored.

Missing scales: a weight scale comes from the checkpoint, else the scales file
(model.fp8_scales.json / fp8_scales.json beside the weights), else `scales=`; a weight stored in high
precision gets its scale recomputed (said in a warning and in the report). A static input scale that
is nowhere falls back to dynamic per-tensor input scaling, with a warning.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.conversion import ConversionReport, replace_submodule
from mixprec.errors import MixprecError
from mixprec.formats import E4M3
from mixprec.hf import build_model, config_dtype, read_config
from mixprec.inference.checkpoint.block_tensors import read_layer
from mixprec.inference.checkpoint.configs import (
    LayoutSpec,
    ModuleLayout,
    parse_quantization_config,
    read_quantization_config,
)
from mixprec.inference.checkpoint.layout import (
    INPUT_SCALE,
    K_SCALE,
    V_SCALE,
    WEIGHT_PACKED,
    WEIGHT_SCALE,
    attention_of_kv_scale,
)
from mixprec.inference.checkpoint.linear_weights import model_keys
from mixprec.inference.checkpoint.safetensors_io import Checkpoint, ShardReader, open_checkpoint
from mixprec.inference.checkpoint.scales_file import (
    check_against_checkpoint,
    compact_entry,
    find_scales_file,
    input_scale_tensor,
    layer_entry,
    normalize_hand_scales,
    read_scales_file,
    weight_scale_tensor,
)
from mixprec.inference.runtime.experts import unfuse_skeleton
from mixprec.inference.runtime.linear import QuantizedLinear, quantized_linear, set_decoded_cache
from mixprec.inference.schemes import InferenceScheme, quantize_weight
from mixprec.scaling import QuantizedTensor


def _scale_grid(scale: torch.Tensor, ml: ModuleLayout, shape: tuple[int, int], where: str) -> torch.Tensor:
    """Stored scale shapes vary by producer ((), (1,), (out,), (out,1), grid): bring to the grid."""
    grid = ml.weight_granularity.scale_shape(*shape)
    s = scale.float()
    if s.numel() != grid[0] * grid[1]:
        raise MixprecError(
            f"{where}: scale has {s.numel()} values, the {ml.weight_granularity.name} layout needs {grid}"
        )
    return s.reshape(grid)


def _load_block_linear(model, path, mod, name, ml, tensors, spec, dtype, report, root) -> None:
    """Swap the Linear at `path` for the BlockQuantizedLinear its stored block-format tensors make."""
    sch = ml.as_scheme()
    shape = (mod.out_features, mod.in_features)
    q, input_global = read_layer(tensors, name, sch, shape, str(root), modelopt=spec.layout == "modelopt")
    if sch.input_global and input_global is None:
        raise MixprecError(f"{root}: {name} has no input global scale, which scheme {sch.name} needs")
    bias = tensors.pop(f"{name}.bias", None)
    if bias is None and mod.bias is not None:
        raise MixprecError(f"{root}: {name}.bias is missing from the checkpoint")
    new = quantized_linear(
        q, bias, sch, input_scale=input_global if sch.input_global else None, out_dtype=dtype
    )
    replace_submodule(model, path, new)
    entry = compact_entry(q, sch, None, shape, input_global if sch.input_global else None, None)
    entry["weight"]["scale_source"] = "checkpoint"
    report.add_quantized_linear(name, "Linear", q.data.numel(), entry, type(new).__name__, sch.family)


def _spec_from_scales(doc: dict[str, Any], where: str) -> LayoutSpec:
    try:
        sch = InferenceScheme.from_name(doc.get("scheme", "fp8-dynamic"))
    except MixprecError as e:
        raise MixprecError(f"malformed scales file {where}: 'scheme': {e}") from None
    ml = ModuleLayout(sch.weight_granularity, sch.input_granularity, sch.input_dynamic, WEIGHT_SCALE)
    names = tuple(doc["layers"])
    return LayoutSpec("scales-file", ((names, ml),), (), False)


def load_quantized(
    path: str | os.PathLike,
    *,
    scales: Any = None,
    device: str | torch.device = "cpu",
    decoded_cache: bool = False,
) -> nn.Module:
    """Load a quantized checkpoint directory as a model whose Linears run FP8 (or FP4) GEMMs; returns it
    in eval mode.

    The loader's report (what was quantized, recomputed scales, warnings) is `model.mixprec_report`.
    `scales=`: a path to a scales file, a scales document, or {layer: {"weight_scale": ..., "input_scale": ...}},
    overriding what the checkpoint and scales file hold.
    `decoded_cache`: a bf16 model's quantized Linears keep their weights decoded to bf16 after first use
    (the fast bf16 forward on CPUs with native bf16 GEMMs; the copies count as the model's memory);
    False decodes them on every call (runtime/linear.py).
    """
    root = Path(path)
    ckpt = open_checkpoint(root)
    config = read_config(root)
    file_doc, file_path, hand, hand_where = _scales_documents(root, ckpt, scales)
    qc, spec = _layout_spec(root, config, file_doc, file_path, hand, hand_where)
    model = build_model(config, source=root)
    dtype = config_dtype(config)
    renamed, ckpt_module = _checkpoint_names(root, model, ckpt)
    report = ConversionReport(recipe=spec.layout, kind="fp8", device=str(device),
                                param_dtype=str(dtype).replace("torch.", ""), scheme=spec.layout)  # fmt: skip
    tensors: dict[str, torch.Tensor] = {}
    with ShardReader() as reader:
        for name, info in ckpt.tensors.items():
            tensors[name] = reader.get(info)
    ld = _Loading(root, spec, tensors, dtype, report, (file_doc or {}).get("layers", {}),
                  (hand or {}).get("layers", {}), file_path)  # fmt: skip
    hf_default_skip = _hf_default_skip(model, spec, qc)
    for module_path, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear):
            # the checkpoint's name: its tensors, ignore list and scales files use it
            _load_linear(
                model, module_path, mod, ckpt_module.get(module_path, module_path), hf_default_skip, ld
            )
    tensors = {renamed.get(k, k): t for k, t in ld.tensors.items()}
    _place_kv_scales(model, tensors, report)
    _assign_the_rest(model, tensors, root, report)
    if file_path is not None:
        used = sum(1 for e in report.layers.values() if e["weight"].get("scale_source") == "scales file")
        how = (
            "applied: the high-precision weights were quantized with its scales"
            if spec.layout == "scales-file"
            else f"checked against the checkpoint; {used} weight scales taken from it (the checkpoint's own are used first)"
        )
        report.notes.append(f"scales file {file_path.name}: {len(ld.file_layers)} layers, {how}")
    model.to(device)
    model.eval()
    set_decoded_cache(model, decoded_cache)
    model.mixprec_report = report
    return model


@dataclass
class _Loading:
    """What loading one checkpoint carries from Linear to Linear: the tensors not consumed yet, and
    where scales may come from besides the checkpoint (the scales file's layers, scales=)."""

    root: Path
    spec: LayoutSpec
    tensors: dict[str, torch.Tensor]
    dtype: torch.dtype
    report: ConversionReport
    file_layers: dict[str, Any]
    hand_layers: dict[str, Any]
    file_path: Path | None


def _scales_documents(root: Path, ckpt: Checkpoint, scales: Any) -> tuple[dict | None, Path | None, dict | None, str]:  # fmt: skip
    """(the scales file's document and path, scales='s document and where it came from), each checked
    against the checkpoint's weights (names, shapes, scale counts) before anything is built or read:
    a wrong file is an error naming it and the key path."""
    weight_shapes = {
        n[: -len(".weight")]: tuple(i.shape) for n, i in ckpt.tensors.items() if n.endswith(".weight")
    }
    file_doc, file_path = None, find_scales_file(root)
    if file_path is not None:
        file_doc = read_scales_file(file_path)
        check_against_checkpoint(file_doc, str(file_path), weight_shapes)
    hand = normalize_hand_scales(scales) if scales is not None else None
    hand_where = str(scales) if isinstance(scales, (str, os.PathLike)) else "scales="
    if hand is not None:
        check_against_checkpoint(hand, hand_where, weight_shapes)
    return file_doc, file_path, hand, hand_where


def _layout_spec(root: Path, config: dict[str, Any], file_doc: dict | None, file_path: Path | None,
                 hand: dict | None, hand_where: str) -> tuple[dict | None, LayoutSpec]:  # fmt: skip
    """(the quantization config, how each module is stored): config.json's or ModelOpt's
    hf_quant_config.json, else a plain checkpoint + scales, quantized online with them (the guide's
    "scales next to the model")."""
    qc, qc_path = read_quantization_config(root, config)
    if qc is not None:
        return qc, parse_quantization_config(qc, str(qc_path))
    if file_doc is not None or hand is not None:
        return qc, _spec_from_scales(
            *((file_doc, str(file_path)) if file_doc is not None else (hand, hand_where))
        )
    raise MixprecError(
        f"{root} is not a quantized checkpoint (no quantization_config in config.json and no scales file); "
        "quantize it with `mixprec quantize` or load it normally and call mixprec.quantize_model_"
    )


def _checkpoint_names(
    root: Path, model: nn.Module, ckpt: Checkpoint
) -> tuple[dict[str, str], dict[str, str]]:
    """({checkpoint key: model key} where they differ, {model module: checkpoint module}); per-expert
    checkpoint weights of fused transformers experts become one Linear each (experts.py)."""
    part_of = unfuse_skeleton(model, _weight_shapes(ckpt))
    renamed, unmapped = model_keys(model, ckpt.tensors, part_of)
    if unmapped:
        raise MixprecError(
            f"{root}: mixprec cannot map {len(unmapped)} checkpoint tensors onto {type(model).__name__}: "
            f"transformers converts them (e.g. {unmapped[0]}), which mixprec's loader does only for per-expert "
            "MoE weights; load this checkpoint with transformers or vLLM"
        )
    ckpt_module = {
        v[: -len(".weight")]: k[: -len(".weight")] for k, v in renamed.items() if k.endswith(".weight")
    }
    ckpt_module.update({path: n for n, path in part_of.items()})  # an FP4 expert stores no `.weight`
    return renamed, ckpt_module


def _weight_shapes(ckpt: Checkpoint) -> dict[str, tuple[int, ...]]:
    """{checkpoint module: its weight's shape}, from `.weight` or, for a packed FP4 weight (NVFP4,
    MXFP4: two values a byte), from `.weight_packed` [out, in / 2]: so FP4 experts are found too."""
    shapes = {n[: -len(".weight")]: tuple(i.shape) for n, i in ckpt.tensors.items() if n.endswith(".weight")}
    for n, i in ckpt.tensors.items():
        module, _, leaf = n.rpartition(".")
        if leaf == WEIGHT_PACKED and len(i.shape) == 2 and module not in shapes:
            shapes[module] = (i.shape[0], 2 * i.shape[1])
    return shapes


def _hf_default_skip(model: nn.Module, spec: LayoutSpec, qc: dict | None) -> set[str]:
    """hf-fp8 with modules_to_not_convert null: transformers skips its default modules (the output
    embeddings) and stores them in high precision; it and vLLM run lm_head unquantized."""
    if spec.layout != "hf-fp8" or (qc or {}).get("modules_to_not_convert") is not None:
        return set()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {n for n, m in model.named_modules() if head is not None and m is head}


def _load_linear(
    model: nn.Module, path: str, mod: nn.Linear, name: str, skip: set[str], ld: _Loading
) -> None:
    """Swap the Linear at `path` (checkpoint name `name`) for the quantized Linear its tensors make,
    when the layout quantizes it."""
    ml = ld.spec.module_layout(name, type(mod).__name__)
    w_name = f"{name}.weight"
    if ml is not None and ml.block_scheme is not None:  # NVFP4 / MXFP4 / MXFP8 (block_tensors)
        _load_block_linear(model, path, mod, name, ml, ld.tensors, ld.spec, ld.dtype, ld.report, ld.root)
        return
    if ml is None or w_name not in ld.tensors:
        return
    if path in skip and ld.tensors[w_name].dtype != torch.float8_e4m3fn:
        return
    w = ld.tensors.pop(w_name)
    shape = (mod.out_features, mod.in_features)
    if tuple(w.shape) != shape:
        raise MixprecError(f"{ld.root}: {w_name} has shape {tuple(w.shape)}, the model expects {shape}")
    scale, source = _weight_scale(name, ml, ld)
    sch = ml.as_scheme()
    q, rel = _quantized_weight(w, w_name, name, scale, source, ml, sch, ld)
    in_scale = _input_scale(name, ml, ld)
    bias = ld.tensors.pop(f"{name}.bias", None)
    if bias is None and mod.bias is not None:
        raise MixprecError(f"{ld.root}: {name}.bias is missing from the checkpoint")
    new = QuantizedLinear(q, bias, sch, input_scale=in_scale, out_dtype=ld.dtype)
    if in_scale is None and not ml.input_dynamic:
        new.scheme = InferenceScheme(sch.name, sch.weight_granularity, sch.input_granularity, True)
    replace_submodule(model, path, new)
    entry = layer_entry(
        scheme=sch.name, weight_granularity=ml.weight_granularity.name, weight_scale=q.scale, weight_amax=float("nan"),
        relative_weight_error=float("nan") if rel is None else rel, shape=shape, input_scale=in_scale,
        input_dynamic=in_scale is None, input_granularity=new.input_granularity.name,
    )  # fmt: skip
    entry["weight"]["scale_source"] = source or "recomputed"
    ld.report.add_quantized_linear(name, "Linear", w.numel(), entry, "QuantizedLinear", "fp8")


def _weight_scale(name: str, ml: ModuleLayout, ld: _Loading) -> tuple[torch.Tensor | None, str | None]:
    """(the weight scale, where it came from): scales=, else the checkpoint, else the scales file."""
    scale, source = None, None
    if name in ld.hand_layers and weight_scale_tensor(ld.hand_layers[name]) is not None:
        scale, source = weight_scale_tensor(ld.hand_layers[name]), "scales="
    stored = ld.tensors.pop(f"{name}.{ml.scale_name}", None)
    if scale is None and stored is not None:
        scale, source = stored, "checkpoint"
    if scale is None and name in ld.file_layers and weight_scale_tensor(ld.file_layers[name]) is not None:
        scale, source = weight_scale_tensor(ld.file_layers[name]), "scales file"
        if ld.spec.layout != "scales-file":  # a quantized checkpoint should have held it
            ld.report.warn(
                f"{name}.weight: weight scale missing from the checkpoint; taken from {ld.file_path.name}"
            )
    return scale, source


def _quantized_weight(w: torch.Tensor, w_name: str, name: str, scale: torch.Tensor | None, source: str | None,
                      ml: ModuleLayout, sch: InferenceScheme, ld: _Loading) -> tuple[QuantizedTensor, float | None]:  # fmt: skip
    """(the weight as a QuantizedTensor, its relative error when it was quantized here): an FP8 payload
    with its scale, or a high-precision weight quantized with the scale given (else recomputed)."""
    shape = tuple(w.shape)
    if w.dtype == torch.float8_e4m3fn:
        if scale is None:
            raise MixprecError(
                f"{ld.root}: FP8 weight {w_name} has no scale ({name}.{ml.scale_name} missing, not in a scales "
                "file, not given by scales=); it cannot be recomputed from FP8 values"
            )
        grid = _scale_grid(scale, ml, shape, f"{ld.root}: {name}.{ml.scale_name}")
        if not bool(torch.isfinite(grid).all() and (grid > 0).all()):
            raise MixprecError(f"{ld.root}: {name}.{ml.scale_name} has non-finite or non-positive scales")
        return QuantizedTensor(w, grid, E4M3, ml.weight_granularity, torch.Size(shape)), None
    if w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise MixprecError(f"{ld.root}: {w_name} has dtype {w.dtype}, not FP8 E4M3 or a float type")
    given = None if scale is None else _scale_grid(scale, ml, shape, f"{name} scale from {source}")
    q, stats = quantize_weight(w, sch, name=w_name, scale=given)
    if given is None:
        ld.report.warn(
            f"{w_name}: stored in {w.dtype} without a weight scale; scale recomputed from the weight"
        )
    return q, stats.relative_error


def _input_scale(name: str, ml: ModuleLayout, ld: _Loading) -> torch.Tensor | None:
    """A static scheme's input scale: scales=, else the checkpoint, else the scales file, else none
    (dynamic per-tensor inputs, with a warning)."""
    stored_in = ld.tensors.pop(f"{name}.{INPUT_SCALE}", None)
    if ml.input_dynamic:
        return None
    if name in ld.hand_layers and input_scale_tensor(ld.hand_layers[name]) is not None:
        return input_scale_tensor(ld.hand_layers[name])
    if stored_in is not None:
        return stored_in.float().reshape(-1)[:1]
    if name in ld.file_layers and input_scale_tensor(ld.file_layers[name]) is not None:
        if ld.spec.layout != "scales-file":
            ld.report.warn(
                f"{name}.{INPUT_SCALE} missing from the checkpoint; taken from {ld.file_path.name}"
            )
        return input_scale_tensor(ld.file_layers[name])
    ld.report.warn(f"{name}: static input scale missing everywhere; inputs use dynamic per-tensor scales")
    return None


def _place_kv_scales(model: nn.Module, tensors: dict[str, torch.Tensor], report: ConversionReport) -> None:
    """KV-cache scales: buffers on their attention modules, for engines with an FP8 KV cache. mixprec's
    forward does not round keys and values: a plain E4M3 round trip did not match vLLM's CPU cache
    (docs/serving.md), and nothing is emulated that does not match an engine."""
    for name in [n for n in tensors if n.endswith((f".{K_SCALE}", f".{V_SCALE}"))]:
        # on the attention module in every layout (ModelOpt stores them under k_proj / v_proj)
        owner, attr = attention_of_kv_scale(name), name.rpartition(".")[2]
        try:
            model.get_submodule(owner).register_buffer(attr, tensors.pop(name).float())
        except AttributeError:
            report.warn(f"{name}: no module {owner!r} to hold it; ignored")


def _assign_the_rest(model: nn.Module, tensors: dict[str, torch.Tensor], root: Path, report: ConversionReport) -> None:  # fmt: skip
    """Every other tensor assigned as stored; tied weights the checkpoint omits tied; an error for
    parameters still missing, a warning for tensors the model does not use."""
    _, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    with contextlib.suppress(Exception):  # tie weights the checkpoint omits (lm_head <- embeddings)
        model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if still_meta:
        raise MixprecError(f"{root}: tensors missing from the checkpoint: {', '.join(still_meta[:5])}"
                           + (f" and {len(still_meta) - 5} more" if len(still_meta) > 5 else ""))  # fmt: skip
    # A copy of a buffer the model computes itself (BERT's embeddings.position_ids, which older
    # transformers saved and `mixprec quantize` carries over) is not a lost tensor: no warning.
    own_buffers = {n for n, _ in model.named_buffers()}
    unexpected = [n for n in unexpected if n not in own_buffers]
    if unexpected:
        report.warn(
            f"{root}: {len(unexpected)} checkpoint tensors not used by the model, e.g. {unexpected[:3]}"
        )
