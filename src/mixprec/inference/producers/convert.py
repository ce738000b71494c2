"""`convert_checkpoint`: rewrite a quantized checkpoint in another layout (compressed-tensors, Hugging
Face fp8, ModelOpt) where the target can hold its schemes, with the numerics kept:

- payloads (FP8 E4M3, packed FP4) and FP8/FP4 block scales: the same bytes;
- multipliers stored under other names or shapes (HF's `weight_scale_inv`, ModelOpt's 0-dim and
  [out/128, 1, in/128, 1] scales, KV-cache `k_scale`/`v_scale`): the same values, widened to float32
  where the target stores float32 (bf16 -> fp32 is exact);
- NVFP4 global scales, divisors in compressed-tensors (448*6/amax) and multipliers in ModelOpt
  (amax/(448*6)): replaced by the correctly rounded float32 reciprocal. Converting back and forth
  returns each such scale or a float32 neighbour one ulp away (a correctly rounded reciprocal of a
  correctly rounded reciprocal is within one ulp of the start); every other tensor round-trips bit
  for bit.

A scheme the target cannot hold (layout.holds) is a MixprecError naming the layer and why,
raised before anything is written. Tensors stream from the input shards to planned output shards
(safetensors_io) inside an atomic output directory (mixprec.files), as `mixprec quantize` writes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixprec.errors import MixprecError
from mixprec.files import write_json_atomic
from mixprec.hf import read_config
from mixprec.inference.checkpoint.configs import LayoutConfig, ct_group_args, read_layout_config
from mixprec.inference.checkpoint.layout import (
    CONVERT_LAYOUTS,
    FP4_GROUP,
    K_SCALE,
    MODELOPT_ALGOS,
    MODELOPT_CONFIG_NAME,
    V_SCALE,
    StoredScheme,
    TensorSpec,
    attention_of_kv_scale,
    holds,
    kv_scale_names,
    kv_scale_shape,
    module_tensors,
    reciprocal_f32,
)
from mixprec.inference.checkpoint.publish import parse_size, publish
from mixprec.inference.checkpoint.safetensors_io import (
    Checkpoint,
    PlannedShardWriter,
    PlannedTensor,
    ShardReader,
    TensorInfo,
    check_output,
    copy_side_files,
    open_checkpoint,
    read_chunks,
)
from mixprec.inference.checkpoint.stored_modules import (
    StoredModule,
    expand_ignore,
    module_names,
    quantized_modules,
)
from mixprec.progress import progress_bar

CONVERT_SCHEMA_VERSION = 1  # of the summary convert_checkpoint returns (docs/schemas/inspect.md)
_CHUNK_BYTES = 16 << 20
_ALGO_OF = {s.name: algo for algo, s in MODELOPT_ALGOS.items()}


@dataclass(frozen=True)
class _Move:
    """One output tensor: where it comes from and how."""

    source: TensorInfo
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    how: str  # "copy" (the bytes), "value" (same values, new dtype/shape), "reciprocal"


def convert_checkpoint(
    input_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    to: str,
    *,
    force: bool = False,
    max_shard_size: str | int = "2GB",
    progress: bool = True,
) -> dict[str, Any]:
    """Write the quantized checkpoint `input_dir` in layout `to` at `output_dir` (atomically); returns
    a summary (layers, bytes copied, scales renamed and reciprocated, notes)."""
    from mixprec import __version__

    if to not in CONVERT_LAYOUTS:
        raise MixprecError(f"unknown layout {to!r}; known: {', '.join(CONVERT_LAYOUTS)}")
    src, out = Path(input_dir), Path(output_dir)
    config = read_config(src, role="input checkpoint")
    ckpt = open_checkpoint(src)
    check_output(src, out, force)
    cfg = read_layout_config(src, config)
    max_bytes = parse_size(max_shard_size)
    if cfg.unreadable:
        raise MixprecError(f"{cfg.source}: cannot convert {cfg.unreadable[0]}")
    mods = quantized_modules(ckpt, cfg)
    if not mods:
        raise MixprecError(f"{src}: no quantized layer found (no FP8/FP4 payload or weight scale tensor)")
    moves, schemes, renamed, reciprocals = _layer_moves(src, cfg, mods, to)
    kv = _kv_moves(src, ckpt, to, moves)
    planned = [
        PlannedTensor(mv.name, mv.dtype, mv.shape)
        if (mv := moves.get(n))
        else PlannedTensor(n, info.dtype, info.shape)
        for n, info in ckpt.tensors.items()
    ]
    ignore = expand_ignore(cfg, module_names(ckpt), set(mods))
    qc, extra = _quantization_config(
        to, schemes, ignore, cfg, bool(kv) or cfg.kv_cache, f"mixprec {__version__}"
    )
    out_cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    out_cfg["quantization_config"] = qc
    copied_payload = 0

    def write_tensors(writer: PlannedShardWriter) -> None:
        nonlocal copied_payload
        with (
            ShardReader() as reader,
            progress_bar(progress, f"converting to {to}", len(planned)) as advance,
        ):
            buf = torch.empty(_CHUNK_BYTES, dtype=torch.uint8)
            for n, info in ckpt.tensors.items():
                mv = moves.get(n)
                if mv is None or mv.how == "copy":
                    name = mv.name if mv else n
                    writer.write_chunks(name, info.dtype, info.shape, read_chunks(reader, info, buf))
                    copied_payload += info.nbytes if mv is not None else 0
                else:
                    writer.write(mv.name, _transform(reader.get(info), mv))
                advance()

    def side_files(tmp: Path) -> list[str]:
        for fname, doc in extra.items():
            write_json_atomic(tmp / fname, doc)
        return copy_side_files(src, tmp, skip={MODELOPT_CONFIG_NAME})

    copied = publish(
        out, force=force, planned=planned, max_shard_size=max_bytes,
        producer=f"mixprec {__version__} (convert)", write_tensors=write_tensors, config=lambda: out_cfg,
        side_files=side_files,
    )  # fmt: skip
    summary = {"from": cfg.layout, "to": to, "input": str(src), "output": str(out), "layers": len(mods),
               "schemes": sorted({s.describe() for s in schemes.values()}), "bytes_copied_unchanged": copied_payload,
               "scales_renamed": renamed, "scales_reciprocal": reciprocals, "kv_scales": len(kv), "ignore": ignore}  # fmt: skip
    return _with_notes(summary, src, copied)


def _with_notes(summary: dict[str, Any], src: Path, copied: list[str]) -> dict[str, Any]:
    """The summary document (CONVERT_SCHEMA_VERSION), with what was copied and what was not."""
    notes = [f"copied {', '.join(copied) or 'no side files'}"]
    if (src / "model.fp8_scales.json").exists():
        notes.append(
            "model.fp8_scales.json (mixprec's record, written for its own layout) was not carried over"
        )
    return {"schema_version": CONVERT_SCHEMA_VERSION, **summary, "notes": notes}


def _layer_moves(src: Path, cfg: LayoutConfig, mods: dict[str, StoredModule], to: str) -> tuple[dict[str, _Move], dict[str, StoredScheme], int, int]:  # fmt: skip
    """({input tensor: its move}, {layer: its scheme}, scales renamed, scales reciprocated) of every
    quantized layer, each checked against the layout table: stored as its scheme says, and holdable in `to`."""
    moves: dict[str, _Move] = {}
    schemes: dict[str, StoredScheme] = {}
    reciprocals = renamed = 0
    for m in mods.values():
        where = f"{src}: layer {m.name}"
        if m.scheme is None or m.dims is None:
            raise MixprecError(
                f"{where} is stored quantized but its config ({cfg.source.name}) does not quantize it"
            )
        why = holds(to, m.scheme, *m.dims)
        if why:
            raise MixprecError(f"{where} ({m.scheme.describe()}) cannot be written as {to}: {why}")
        schemes[m.name] = m.scheme
        targets = {s.role: s for s in module_tensors(to, m.scheme, *m.dims)}
        for spec in module_tensors(cfg.layout, m.scheme, *m.dims):
            info = m.tensors.get(spec.suffix)
            if info is None or tuple(info.shape) not in (spec.shape, *spec.also):
                found = "missing" if info is None else f"shape {list(info.shape)}"
                raise MixprecError(
                    f"{where}: {spec.suffix} {found}; {m.scheme.describe()} in {cfg.layout} stores "
                    f"{list(spec.shape)} (run `mixprec inspect {src}`)"
                )
            move = _move(info, spec, targets[spec.role], m.name, to)
            moves[info.name] = move
            reciprocals += move.how == "reciprocal"
            renamed += move.how != "reciprocal" and spec.role != "weight"
        leftover = (
            set(m.tensors) - {s.suffix for s in module_tensors(cfg.layout, m.scheme, *m.dims)} - {"bias"}
        )
        if leftover:
            raise MixprecError(
                f"{where}: tensor(s) {', '.join(sorted(leftover))} have no place in {m.scheme.describe()} "
                "and would be lost"
            )
    return moves, schemes, renamed, reciprocals


def _kv_moves(src: Path, ckpt: Checkpoint, to: str, moves: dict[str, _Move]) -> list[str]:
    """The checkpoint's KV-cache scales, each moved (into `moves`) to where `to` keeps it."""
    kv = [n for n in ckpt.tensors if n.endswith((f".{K_SCALE}", f".{V_SCALE}"))]
    if kv and to == "hf-fp8":
        raise MixprecError(
            f"{src} holds KV-cache scales ({kv[0]}); the Hugging Face fp8 layout has no place for them"
        )
    for n in kv:
        k_name, v_name = kv_scale_names(to, attention_of_kv_scale(n))
        info = ckpt.tensors[n]
        moves[n] = _Move(
            info, k_name if n.endswith(f".{K_SCALE}") else v_name, torch.float32, kv_scale_shape(to), "value"
        )
    return kv


def _move(info: TensorInfo, src: TensorSpec, dst: TensorSpec, module: str, to: str) -> _Move:
    name = f"{module}.{dst.suffix}"
    if src.dtype != "float":  # payloads and FP8 block scales of FP4: the bytes, unchanged
        return _Move(info, name, info.dtype, dst.shape, "copy")
    how = "reciprocal" if src.reciprocal != dst.reciprocal else "value"
    # compressed-tensors takes a scale in any float dtype: keep the stored one (bit-identical); the others,
    # and every reciprocal, store float32
    keep = to == "compressed-tensors" and how == "value"
    dtype = info.dtype if keep else torch.float32
    if how == "value" and dtype == info.dtype and tuple(dst.shape) == tuple(info.shape):
        how = "copy"
    return _Move(info, name, dtype, dst.shape, how)


def _transform(t: torch.Tensor, mv: _Move) -> torch.Tensor:
    if mv.how == "reciprocal":
        values = [reciprocal_f32(float(v)) for v in t.double().reshape(-1)]
        return torch.tensor(values, dtype=torch.float32).reshape(mv.shape)
    return t.to(mv.dtype).reshape(mv.shape)  # widening a float to float32 is exact


# ---------------------------------------------------------------------------------------------------
# Quantization configs of the target layouts


def _quantization_config(
    to: str, schemes: dict[str, StoredScheme], ignore: list[str], cfg: LayoutConfig, kv: bool, producer: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json's quantization_config, {extra file name: JSON}) for layout `to`."""
    distinct = list(dict.fromkeys(schemes.values()))
    if to == "hf-fp8":
        if len(distinct) > 1:
            raise MixprecError(
                f"{cfg.source}: the Hugging Face fp8 layout holds one block size; this checkpoint "
                f"mixes {', '.join(s.describe() for s in distinct)}"
            )
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": list(distinct[0].block),
            "modules_to_not_convert": ignore,
        }, {}
    if to == "compressed-tensors":
        return _ct_config(schemes, distinct, ignore, kv), {}
    return _modelopt_config(schemes, distinct, ignore, kv, producer)


def _ct_args(scheme: StoredScheme) -> tuple[dict, dict | None, str]:
    """(weights, input_activations, format) of a compressed-tensors config group."""
    if scheme.fp4:
        fp4 = dict(
            num_bits=4,
            type="float",
            symmetric=True,
            group_size=FP4_GROUP,
            strategy="tensor_group",
            block_structure=None,
            actorder=None,
            observer_kwargs={},
            # the E4M3 block scales: without it compressed-tensors decompresses them as the weight's dtype
            scale_dtype="torch.float8_e4m3fn",
            zp_dtype=None,
        )
        # as llm-compressor 0.14 writes its NVFP4 / NVFP4A16 presets
        weights = {**fp4, "dynamic": False, "observer": "memoryless_minmax"}
        inputs = {**fp4, "dynamic": "local", "observer": "static_minmax"} if scheme.input else None
        return weights, inputs, "nvfp4-pack-quantized"
    if scheme.name == "fp8-static":
        w, a = ct_group_args("tensor", False), ct_group_args("tensor", False, observer="static_minmax")
    elif scheme.name == "fp8-tensor-dynamic":
        w, a = ct_group_args("tensor", False), ct_group_args("token", True)
    elif scheme.name == "fp8-dynamic":
        w, a = ct_group_args("channel", False), ct_group_args("token", True)
    else:
        w = ct_group_args("block", False, block_structure=list(scheme.block))
        a = ct_group_args("group", True, group_size=scheme.block[1])
    return w, a, "float-quantized"


def _ct_config(
    schemes: dict[str, StoredScheme], distinct: list[StoredScheme], ignore: list[str], kv: bool
) -> dict:
    groups, formats = {}, []
    for i, scheme in enumerate(distinct):
        weights, inputs, fmt = _ct_args(scheme)
        # one scheme: every Linear not ignored (as llm-compressor writes it); several: each layer by name
        targets = ["Linear"] if len(distinct) == 1 else sorted(n for n, s in schemes.items() if s == scheme)
        groups[f"group_{i}"] = {
            "targets": targets,
            "weights": weights,
            "input_activations": inputs,
            "output_activations": None,
            "format": fmt,
        }
        formats.append(fmt)
    return {
        "config_groups": groups,
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": ct_group_args("tensor", False, observer="minmax") if kv else None,
        "format": formats[0] if len(set(formats)) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": ignore,
        "sparsity_config": {},
        "transform_config": {},
    }


def _modelopt_group(algo: str) -> dict:
    """The config group ModelOpt's convert_hf_quant_config_format writes for `algo` (convert_hf_config.py)."""
    fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": FP4_GROUP}
    return {
        "FP8": {"input_activations": fp8, "weights": fp8},
        "FP8_PER_CHANNEL_PER_TOKEN": {"input_activations": fp8, "weights": {**fp8, "strategy": "channel"}},
        "NVFP4": {"input_activations": fp4, "weights": fp4},
        "W4A16_NVFP4": {"weights": fp4},
    }.get(algo, {"quant_algo": algo})


def _modelopt_config(schemes, distinct, ignore, kv, producer) -> tuple[dict, dict]:
    algos = {n: _ALGO_OF[s.name] for n, s in schemes.items()}
    quant: dict[str, Any] = {"quant_algo": None, "kv_cache_quant_algo": "FP8" if kv else None}
    fp4 = {"group_size": FP4_GROUP}
    if len(distinct) == 1:
        algo = _ALGO_OF[distinct[0].name]
        quant["quant_algo"] = algo
        quant.update(fp4 if distinct[0].fp4 else {})
        groups = {"group_0": {**_modelopt_group(algo), "targets": ["Linear"]}}
    else:
        quant["quant_algo"] = "MIXED_PRECISION"
        quant["quantized_layers"] = {
            n: {"quant_algo": a, **(fp4 if schemes[n].fp4 else {})} for n, a in algos.items()
        }
        groups = {}
        for i, algo in enumerate(dict.fromkeys(algos.values())):
            targets = sorted(n for n, a in algos.items() if a == algo)
            groups[f"group_{i}"] = {**_modelopt_group(algo), "targets": targets}
    quant["exclude_modules"] = ignore
    hf_quant = {"producer": {"name": "mixprec", "version": producer.split()[-1]}, "quantization": quant}
    qc = {"config_groups": groups, "ignore": ignore, "quant_algo": quant["quant_algo"]}
    if "quantized_layers" in quant:
        qc["quantized_layers"] = quant["quantized_layers"]
    if kv:
        qc["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    qc.update({"producer": hf_quant["producer"], "quant_method": "modelopt"})
    return qc, {MODELOPT_CONFIG_NAME: hf_quant}
