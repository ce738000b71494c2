"""`inspect_checkpoint`: what a quantized checkpoint holds, layer by layer, and whether the engines
that serve it will take it, from any producer (mixprec, llm-compressor / compressed-tensors, Hugging
Face fp8, NVIDIA ModelOpt).

Reads safetensors headers, and of the tensors only the scales (one at a time); payloads are never
read. The document it returns is versioned (docs/schemas/inspect.md). Each check has a verdict:
"pass", "warn" (loads, at a cost the detail states) or "fail" (a reader refuses it or computes wrong
values).

What vLLM does with the shards of a fused layer (q/k/v -> qkv_proj, gate/up -> gate_up_proj), from
its source (model_executor/layers/quantization/{modelopt.py, compressed_tensors/schemes/*.py,
utils/w8a8_utils.py}):
- per-tensor FP8 weight scales that differ: `requantize_with_max_scale` re-rounds every shard to the
  largest scale; a shard whose scale is r times smaller loses log2(r) bits of its 3-bit mantissa grid.
- static input scales that differ: the largest is used for all; the others' inputs lose log2(r) bits.
- NVFP4 global scales that differ: one is used for all and the block scales are NOT recomputed, so a
  shard's weights come out multiplied by a wrong factor (compressed-tensors: 1/max of its divisors, so
  the others shrink; ModelOpt: the max of its multipliers, so the others grow).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from mixprec.errors import MixprecError
from mixprec.hf import read_config
from mixprec.inference.checkpoint.configs import LayoutConfig, read_layout_config
from mixprec.inference.checkpoint.layout import (
    INPUT_SCALE,
    K_SCALE,
    PAYLOAD_NAMES,
    V_SCALE,
    WEIGHT,
    WEIGHT_GLOBAL_SCALE,
    WEIGHT_PACKED,
    WEIGHT_SCALE,
    WEIGHT_SCALE_2,
    WEIGHT_SCALE_INV,
    StoredScheme,
    attention_of_kv_scale,
    kv_scale_names,
    module_tensors,
)
from mixprec.inference.checkpoint.safetensors_io import Checkpoint, ShardReader, open_checkpoint
from mixprec.inference.checkpoint.stored_modules import StoredModule, module_names, quantized_modules
from mixprec.inference.schemes import (
    PARTLY_QUANTIZED_RULE,
    SCHEMES,
    InferenceScheme,
    fused_block_reason,
    transformers_dequantize_reason,
)
from mixprec.scaling import Granularity
from mixprec.select import fused_shards

SCHEMA_VERSION = 1
VERDICTS = ("pass", "warn", "fail")
# schemes each engine's reader for the layout takes (vLLM 0.32, transformers 5.24, mixprec load_quantized)
_VLLM = {
    "compressed-tensors": {
        "fp8-static",
        "fp8-tensor-dynamic",
        "fp8-dynamic",
        "fp8-block",
        "nvfp4",
        "nvfp4a16",
        # its CPU build recognizes these and then finds no kernel on a CPU ("Failed to find a kernel that
        # can implement the MXFP4 linear layer": docs/serving.md); its GPU kernels take them
        "mxfp4",
        "mxfp4a16",
        "mxfp8",
    },
    "hf-fp8": {"fp8-block"},
    "modelopt": {"fp8-static", "fp8-dynamic", "fp8-block", "nvfp4", "nvfp4a16"},
}
_MIXPREC = {
    *SCHEMES,
    "fp8-tensor-dynamic",
}  # load_quantized reads every scheme mixprec writes, and per-tensor dynamic FP8


def _check(name: str, verdict: str, detail: str, items: list[str] | None = None) -> dict[str, Any]:
    return {"name": name, "verdict": verdict, "detail": detail, "items": items or []}


def _bits(ratio: float) -> str:
    return f"{math.log2(ratio):.2f} bits" if ratio > 0 and math.isfinite(ratio) else "all precision"


def inspect_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The inspect document of a checkpoint directory (see docs/schemas/inspect.md)."""
    root = Path(path)
    config = read_config(root, role="checkpoint")
    ckpt = open_checkpoint(root)
    cfg = read_layout_config(root, config)
    mods = quantized_modules(ckpt, cfg)
    layers, scalars, checks = [], {}, []
    bad_scales, bad_shapes = [], []
    with ShardReader() as reader:
        for m in mods.values():
            row, problems = _layer_row(m, cfg)
            bad_shapes += [f"{m.name}: {p}" for p in problems]
            for suffix, info in m.tensors.items():
                if suffix in (*PAYLOAD_NAMES, "bias"):
                    continue
                values = reader.get(info).float()
                why = _scale_problem(values)
                if why:
                    bad_scales.append(f"{m.name}.{suffix}: {why}")
                if values.numel() == 1:
                    scalars[(m.name, suffix)] = float(values.reshape(()))
            layers.append(row)
        kv = _kv_check(ckpt, cfg, reader, bad_scales, mods)
    checks.append(_scales_check(bad_scales))
    checks.append(_shapes_check(bad_shapes, len(mods)))
    checks.append(_unreadable_check(cfg))
    fused, fused_engine = _fused_check(ckpt, cfg, mods, scalars)
    checks.append(fused)
    checks.append(kv)
    checks.append(_mixed_check(cfg, mods))
    quantized_bytes = sum(r["bytes"] for r in layers)
    total = sum(i.nbytes for i in ckpt.tensors.values())
    return {
        "schema_version": SCHEMA_VERSION,
        "path": str(root),
        "layout": cfg.layout,
        "config_file": cfg.source.name,
        "quantization": {
            "description": cfg.description,
            "groups": [{"name": g, "targets": list(t), "scheme": s.describe()} for g, t, s in cfg.groups]
            + [{"name": n, "targets": [n], "scheme": s.describe()} for n, s in cfg.per_layer.items()],
            "ignore": list(cfg.ignore),
            "kv_cache": cfg.kv_cache,
            "mixed_precision": cfg.mixed,
        },
        "layers": layers,
        "totals": {
            "quantized_layers": len(layers),
            "quantized_bytes": quantized_bytes,
            "other_bytes": total - quantized_bytes,
            "total_bytes": total,
        },
        "checks": checks,
        "verdict": max((c["verdict"] for c in checks), key=VERDICTS.index),
        "engines": _engines(cfg, mods, checks, fused_engine),
    }


def _scales_check(bad: list[str]) -> dict[str, Any]:
    if not bad:
        return _check("scales finite and positive", "pass", "every stored scale is finite and positive")
    verdict = "fail" if any("NaN" in b or "negative" in b for b in bad) else "warn"
    detail = f"{len(bad)} scale tensor(s) with non-finite, negative or zero values"
    return _check("scales finite and positive", verdict, detail, bad)


def _shapes_check(bad: list[str], layers: int) -> dict[str, Any]:
    if not bad:
        detail = f"{layers} quantized layers hold the tensors, dtypes and shapes their scheme needs"
        return _check("shapes as the config says", "pass", detail)
    return _check("shapes as the config says", "fail", f"{len(bad)} problem(s)", bad)


def _layer_row(m: StoredModule, cfg: LayoutConfig) -> tuple[dict[str, Any], list[str]]:
    problems: list[str] = []
    payload = m.tensors.get(WEIGHT_PACKED) or m.tensors.get(WEIGHT)
    row = {
        "name": m.name,
        "scheme": m.scheme.describe() if m.scheme else None,
        "payload_dtype": str(payload.dtype).replace("torch.", "") if payload else None,
        "shape": list(m.dims) if m.dims else None,
        "scales": {
            s: {"shape": list(i.shape), "dtype": str(i.dtype).replace("torch.", "")}
            for s, i in m.tensors.items()
            if s not in (*PAYLOAD_NAMES, "bias")
        },
        "bytes": sum(i.nbytes for i in m.tensors.values()),
    }
    if m.scheme is None:
        if cfg.unreadable and not cfg.ignores(m.name):
            return row, []  # a scheme outside the table: said once, under "config schemes known"
        where = "is in its ignore list" if cfg.ignores(m.name) else "targets no such module"
        return row, [f"stored quantized, but the config ({cfg.source.name}) {where}"]
    if m.dims is None:
        return row, ["no 2-D weight payload"]
    for spec in module_tensors(cfg.layout, m.scheme, *m.dims):
        info = m.tensors.get(spec.suffix)
        if info is None:
            problems.append(f"{spec.suffix} missing ({m.scheme.describe()} in {cfg.layout} needs it)")
            continue
        want = {"fp8": (torch.float8_e4m3fn,), "uint8": (torch.uint8,)}.get(spec.dtype)
        if want and info.dtype not in want:
            problems.append(f"{spec.suffix} is {info.dtype}, expected {want[0]}")
        elif spec.dtype == "float" and not info.dtype.is_floating_point:
            problems.append(f"{spec.suffix} is {info.dtype}, expected a float type")
        if tuple(info.shape) not in (spec.shape, *spec.also):
            problems.append(
                f"{spec.suffix} has shape {list(info.shape)}, {m.scheme.describe()} needs {list(spec.shape)}"
            )
    return row, problems


def _scale_problem(values: torch.Tensor) -> str | None:
    if values.numel() == 0:
        return "empty"
    if not bool(torch.isfinite(values).all()):
        return f"{int((~torch.isfinite(values)).sum())} NaN/inf values"
    if bool((values < 0).any()):
        return f"{int((values < 0).sum())} negative values"
    if bool((values == 0).any()):
        return f"{int((values == 0).sum())} zero values (their blocks dequantize to 0)"
    return None


def _unreadable_check(cfg: LayoutConfig) -> dict[str, Any]:
    if cfg.unreadable:
        return _check(
            "config schemes known",
            "warn",
            "config entries describing schemes this table does not cover; their layers are not checked",
            cfg.unreadable,
        )
    return _check("config schemes known", "pass", f"{cfg.description}: every config group read")


def _as_inference_scheme(s: StoredScheme) -> InferenceScheme:
    return InferenceScheme(s.name, Granularity.blocks(*s.block), Granularity.blocks(1, s.block[1]), True)


def _fused_group_findings(
    fused: str,
    shards: list[str],
    cfg: LayoutConfig,
    mods: dict[str, StoredModule],
    scalars: dict[tuple[str, str], float],
) -> tuple[list[str], list[str], str]:
    """(findings, the ones vLLM refuses the checkpoint for, verdict) of one fused layer's shards."""
    quant = [s for s in shards if s in mods]
    if not quant:
        return [], [], "pass"
    if len(quant) < len(shards):
        hp = [s for s in shards if s not in mods]
        msg = f"{fused}: {', '.join(hp)} in high precision, {', '.join(quant)} quantized: {PARTLY_QUANTIZED_RULE}"
        return [msg], [msg], "fail"
    schemes = {mods[s].scheme for s in shards}
    if len(schemes) > 1:
        named = ", ".join(sorted(x.describe() if x else "unknown" for x in schemes))
        msg = f"{fused}: shards quantized with different schemes ({named})"
        return [msg], [msg], "fail"
    scheme = next(iter(schemes))
    if scheme is None:
        return [], [], "pass"
    found, refused, verdict = [], [], "pass"
    if scheme.name == "fp8-block" and all(mods[s].dims for s in shards):
        out_features = [mods[s].dims[0] for s in shards]
        why = fused_block_reason(_as_inference_scheme(scheme), cfg.layout, fused, out_features)
        if why:
            found, refused, verdict = [why], [why], "fail"
    for suffix, what, cost in _shared_roles(cfg.layout, scheme):
        values = [scalars.get((s, suffix)) for s in shards]
        if any(v is None or v <= 0 for v in values) or max(values) == min(values):
            continue
        hi, lo = max(values), min(values)
        found.append(f"{fused}: {what} differ (max/min {hi / lo:.4g}); {cost(hi, lo)}")
        verdict = "fail" if scheme.fp4 else max(verdict, "warn", key=VERDICTS.index)
    return found, refused, verdict


def _fused_check(
    ckpt: Checkpoint, cfg: LayoutConfig, mods: dict[str, StoredModule], scalars: dict[tuple[str, str], float]
) -> tuple[dict[str, Any], list[str]]:
    """(the fused-groups check, reasons vLLM refuses the checkpoint). Fused layers: mixprec.select's
    fused_shards (q/k/v, gate/up, w1/w3) over every module that stores a weight."""
    items, refusals, worst, groups = [], [], "pass", 0
    for fused, shards in fused_shards(module_names(ckpt)).items():
        found, refused, verdict = _fused_group_findings(fused, shards, cfg, mods, scalars)
        items += found
        refusals += refused
        worst = max(worst, verdict, key=VERDICTS.index)
        groups += any(s in mods for s in shards)
    if not items:
        return _check(
            "fused q/k/v and gate/up",
            "pass",
            f"{groups} fused groups: shards quantized alike, shared scales equal",
        ), refusals
    detail = "vLLM fuses these shards into one GEMM; where shared scales differ it picks one (costs below)"
    return _check("fused q/k/v and gate/up", worst, detail, items), refusals


def _shared_roles(layout: str, scheme: StoredScheme):
    """(tensor suffix, what, cost(max, min)) of the per-tensor scales a fused GEMM must share."""
    roles = []
    if scheme.weight_bits == 8 and scheme.weight_strategy == "tensor":
        scale = WEIGHT_SCALE_INV if layout == "hf-fp8" else WEIGHT_SCALE
        roles.append(
            (
                scale,
                "per-tensor weight scales",
                lambda hi, lo: (
                    f"vLLM requantizes every shard to the max scale: the smallest-scale shard loses {_bits(hi / lo)} of resolution"
                ),
            )
        )
    if scheme.input == "static" and scheme.weight_bits == 8:
        roles.append(
            (
                INPUT_SCALE,
                "static input scales",
                lambda hi, lo: (
                    f"vLLM uses the max: inputs lose {_bits(hi / lo)} of resolution on the other shards"
                ),
            )
        )
    if scheme.fp4:
        if layout == "modelopt":
            roles.append(
                (
                    WEIGHT_SCALE_2,
                    "NVFP4 global weight scales (weight_scale_2)",
                    lambda hi, lo: (
                        f"vLLM uses the max without recomputing block scales: shards are scaled by up to {hi / lo:.4g}x (wrong weights)"
                    ),
                )
            )
        else:
            roles.append(
                (
                    WEIGHT_GLOBAL_SCALE,
                    "NVFP4 global weight scales",
                    lambda hi, lo: (
                        f"vLLM uses 1/max without recomputing block scales: shards are scaled by as little as {lo / hi:.4g}x (wrong weights)"
                    ),
                )
            )
    return roles


def _kv_check(
    ckpt: Checkpoint,
    cfg: LayoutConfig,
    reader: ShardReader,
    bad_scales: list[str],
    mods: dict[str, StoredModule],
) -> dict[str, Any]:
    stored = [n for n in ckpt.tensors if n.endswith((f".{K_SCALE}", f".{V_SCALE}"))]
    for n in stored:
        why = _scale_problem(reader.get(ckpt.tensors[n]).float())
        if why:
            bad_scales.append(f"{n}: {why}")
    attentions = sorted({n.rpartition(".")[0] for n in module_names(ckpt) if n.endswith(".k_proj")})
    if not cfg.kv_cache:
        if stored:
            return _check(
                "KV-cache scales",
                "warn",
                f"{len(stored)} k/v scales stored but the config does not ask for an "
                "FP8 KV cache: engines ignore them",
                stored[:8],
            )
        return _check("KV-cache scales", "pass", "the config asks for no KV-cache quantization; none stored")
    have_k = {attention_of_kv_scale(n) for n in stored if n.endswith(f".{K_SCALE}")}
    have = have_k & {attention_of_kv_scale(n) for n in stored if n.endswith(f".{V_SCALE}")}
    missing = [a for a in attentions if a not in have]
    names = kv_scale_names(cfg.layout, attentions[0]) if attentions else ()
    if missing:
        return _check(
            "KV-cache scales",
            "warn",
            f"the config asks for an FP8 KV cache; {len(missing)} of {len(attentions)} attention modules "
            f"have no k/v scales (expected e.g. {', '.join(names)}); vLLM then uses scale 1.0 for them",
            missing[:8],
        )
    return _check(
        "KV-cache scales", "pass", f"{len(attentions)} attention modules have k/v scales ({', '.join(names)})"
    )


def _mixed_check(cfg: LayoutConfig, mods: dict[str, StoredModule]) -> dict[str, Any]:
    used: dict[str, int] = {}
    for m in mods.values():
        key = m.scheme.describe() if m.scheme else "unknown"
        used[key] = used.get(key, 0) + 1
    items = [f"{k}: {v} layers" for k, v in used.items()]
    if cfg.mixed:
        how = (
            "ModelOpt MIXED_PRECISION (quantized_layers)"
            if cfg.per_layer
            else f"{len(cfg.groups)} config groups"
        )
        return _check("mixed precision", "pass", f"mixed-precision config: {how}", items)
    return _check("mixed precision", "pass", "one scheme for every quantized layer", items)


def _engines(
    cfg: LayoutConfig, mods: dict[str, StoredModule], checks: list[dict], fused: list[str]
) -> dict[str, Any]:
    schemes = {m.scheme.name for m in mods.values() if m.scheme}
    broken = [c["name"] for c in checks if c["verdict"] == "fail" and c["name"] != "fused q/k/v and gate/up"]
    vllm = [
        f"{cfg.layout} {s}: vLLM has no reader for it" for s in sorted(schemes - _VLLM[cfg.layout])
    ] + fused
    vllm += [f"check failed: {b}" for b in broken]
    if cfg.layout == "modelopt" and "fp8-static" in schemes:
        no_input = [
            m.name
            for m in mods.values()
            if m.scheme and m.scheme.name == "fp8-static" and INPUT_SCALE not in m.tensors
        ]
        if no_input:
            vllm.append(f"ModelOpt FP8 needs input_scale for every layer; {no_input[0]} has none")
    if cfg.layout == "modelopt" and "fp8-block" in schemes:
        bad = [
            m.name
            for m in mods.values()
            if m.scheme and m.scheme.name == "fp8-block" and m.dims and (m.dims[0] % 128 or m.dims[1] % 128)
        ]
        if bad:
            vllm.append(
                f"ModelOpt FP8_PB_WO: vLLM needs dims divisible by 128; {bad[0]} is {list(mods[bad[0]].dims)}"
            )
    tf: list[str] = []
    if cfg.layout == "modelopt":
        tf.append(
            "transformers (5.24) has no ModelOpt quantizer: quant_method 'modelopt' is not among its quantization methods"
        )
    elif cfg.layout == "hf-fp8" and schemes - {"fp8-block"}:
        tf.append(
            "transformers' fp8 reader names per-tensor scales differently; only weight_block_size checkpoints agree"
        )
    elif cfg.layout == "hf-fp8":
        refused = [
            (m.name, why)
            for m in mods.values()
            if m.scheme
            and m.dims
            and (why := transformers_dequantize_reason(cfg.layout, m.scheme.block, *m.dims))
        ]
        if refused:
            tf.append(f"{len(refused)} layer(s), e.g. {refused[0][0]}: {refused[0][1]}")
    tf += [f"check failed: {b}" for b in broken]
    mp = [f"{s}: mixprec has no reader for it" for s in sorted(schemes - _MIXPREC)]
    mp += [f"check failed: {b}" for b in broken]
    notes = {
        "vllm": "compressed-tensors and ModelOpt checkpoints through vLLM's readers of those names; kernels also "
        "depend on the device (FP8 needs compute capability 8.9+, NVFP4 10.0+ natively; vLLM 0.32's CPU build "
        "without AMX serves fp8-dynamic only: docs/serving.md)",
        "transformers": "compressed-tensors checkpoints need the compressed-tensors package",
        "mixprec": "mixprec.load_quantized",
    }
    return {
        name: {"loads": not why, "reasons": why, "note": notes[name]}
        for name, why in (("vllm", vllm), ("transformers", tf), ("mixprec", mp))
    }


def check_inspectable(path: str | os.PathLike) -> None:
    """MixprecError before any work when `path` is not a checkpoint directory."""
    p = Path(path)
    if not p.is_dir():
        raise MixprecError(
            f"checkpoint directory {p} does not exist" if not p.exists() else f"{p} is not a directory"
        )
