"""The plan of an offline quantization (`mixprec quantize --dry-run`): what `quantize_checkpoint` would
do with the same arguments, before any work and writing nothing. It reads config.json and the
safetensors headers only (a 70B plan needs no 140 GB of disk: header-only files plan the same), and
runs short probes on random tensors of the real shapes for the time (quantize_estimates.py).

The plan: every Linear and the scheme it gets (and what stays in high precision, with the reason),
the output's size (each shard's bytes exactly as the writer lays them out; config, index and side
files exactly; the scales file estimated), the peak-memory and time estimates with their terms, and
the free disk space where the output goes.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mixprec.conversion import ConversionReport
from mixprec.inference.algorithms.gptq import CHUNK_BYTES
from mixprec.inference.algorithms.gptq_pass import input_groups
from mixprec.inference.algorithms.rotation import CHUNK_ROWS
from mixprec.inference.algorithms.spec import AWQ, FOLDS, ROTATE, SMOOTHQUANT, AlgorithmSpec
from mixprec.inference.calibration.run import StopRule
from mixprec.inference.checkpoint.algorithm_file import ALGORITHM_FILE
from mixprec.inference.checkpoint.layout import planned_tensors
from mixprec.inference.checkpoint.publish import DEFAULT_MAX_SHARD_SIZE
from mixprec.inference.checkpoint.safetensors_io import (
    Checkpoint,
    index_text,
    plan_shards,
    shard_header,
    shard_names,
    side_files,
)
from mixprec.inference.checkpoint.scales_file import SCALES_NAMES, build_document, layer_entry, scales_text
from mixprec.inference.producers import quantize_estimates as est
from mixprec.inference.producers.quantize import output_config, plan_tensors, select
from mixprec.inference.producers.quantize_blocks import nvfp4_groups, packed_layout, payload_bytes
from mixprec.inference.producers.quantize_calibration import Calibration, available_memory
from mixprec.inference.producers.quantize_job import QuantizeJob, Selection, Source, open_source
from mixprec.inference.producers.quantize_stream import COPY_CHUNK_BYTES, stream_workers
from mixprec.inference.producers.quantize_timing import LAYER_BY_LAYER, WHOLE_MODEL, probes, stage_seconds
from mixprec.inference.schemes import InferenceScheme

SCHEMA_VERSION = 1
STREAM = "streaming"  # the other paths: LAYER_BY_LAYER, WHOLE_MODEL


@dataclass
class QuantizePlan:
    """What a quantize run would do (docs/schemas/quantize_plan.md is its JSON)."""

    model: str
    output: str
    scheme: str
    format: str
    algorithm: list[str]
    path: str  # STREAM, LAYER_BY_LAYER or WHOLE_MODEL (after the folds, when --algorithm has any)
    layers: dict[str, dict[str, Any]]  # quantized Linear -> {"scheme", "shape"}
    kept: dict[str, str]  # weight left in high precision -> why
    input_bytes: int
    shard_bytes: list[int]
    files: dict[str, int]  # the other files' bytes (the scales file's estimated)
    memory: est.Estimate
    time: est.Estimate | None  # None when not probed
    disk: dict[str, Any]
    calibration: dict[str, Any] | None
    warnings: list[str] = field(default_factory=list)

    @property
    def output_bytes(self) -> int:
        return sum(self.shard_bytes) + sum(self.files.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION, "model": self.model, "output": self.output,
            "scheme": self.scheme, "format": self.format, "algorithm": self.algorithm, "path": self.path,
            "layers": self.layers, "kept": self.kept, "input_bytes": self.input_bytes,
            "output_bytes": self.output_bytes, "shards": self.shard_bytes, "files": self.files,
            "memory": self.memory.to_dict(), "time": None if self.time is None else self.time.to_dict(),
            "disk": self.disk, "calibration": self.calibration, "warnings": self.warnings,
        }  # fmt: skip


def plan_quantize(
    model_dir: str | Path,
    output_dir: str | Path,
    scheme: str | InferenceScheme | Mapping[str, str | InferenceScheme] = "fp8-dynamic",
    *,
    ignore: Sequence[str] | None = None,
    default_ignore: bool = True,
    calib_data: str | Path | None = None,
    calib_samples: int = 512,
    calib_seq_len: int = 512,
    observer: str = "max",
    calib_stop: StopRule | None = None,
    format: str = "compressed-tensors",
    kv_cache: str | None = None,
    force: bool = False,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    layer_by_layer: bool | None = None,
    strict: bool = False,
    algorithm: str | Sequence[str] | AlgorithmSpec | None = None,
    probe: bool = True,
    startup_seconds: float = 0.0,
) -> QuantizePlan:
    """The plan of quantize_checkpoint with the same arguments; the same MixprecError for bad input
    (nothing read beyond config.json and the headers, nothing written). probe: time the quantize (and
    GEMM, GPTQ) probes for the time estimate and the quantize temporaries (False: no time estimate).
    startup_seconds: the process's start-up (the CLI passes its own) added to the time."""
    job = QuantizeJob.build(
        model_dir, output_dir, scheme, ignore=ignore, default_ignore=default_ignore, kv_cache=kv_cache,
        max_shard_size=max_shard_size, calib_data=calib_data, calib_samples=calib_samples,
        calib_seq_len=calib_seq_len, observer=observer, calib_stop=calib_stop, format=format, force=force,
        layer_by_layer=layer_by_layer, progress=False, strict=strict, algorithm=algorithm,
    )  # fmt: skip
    started = time.perf_counter()
    # the same checks, in the same order, as quantize's resolve; an FP8 block input as the bf16
    # checkpoint it is read as (its sizes in memory: a weight dequantized at a time)
    ckpt, config, fp8 = open_source(job)
    source = Source(ckpt, config, None, fp8)
    scratch = ConversionReport(recipe="", kind="", device="cpu", param_dtype="")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        selection = select(job, source, scratch)
    baseline = est.current_rss()  # imports done as the run does them (select may build a meta model)
    attention = _attention_modules(ckpt) if job.kv_cache else []
    stand_in = Calibration(
        {}, {i: (1.0, 1.0) for i in range(len(attention))}, dict(enumerate(attention)), None
    )
    tensors = plan_tensors(job, ckpt, selection, stand_in).tensors
    shard_bytes, weight_map = _shards(tensors, job.max_shard_bytes)
    files = _files(job, source, selection, weight_map, sum(t.nbytes for t in tensors))
    path = _path(job, ckpt)
    shapes = _shapes(job, source, selection)
    output_bytes = sum(shard_bytes) + sum(files.values())
    memory, seconds, calibration = _estimates(job, ckpt, shapes, selection, path, baseline, probe,
                                              (startup_seconds + time.perf_counter() - started, output_bytes))  # fmt: skip
    plan = QuantizePlan(
        str(job.model_dir), str(job.output_dir), job.scheme.name, job.format, list(job.algorithm.names), path,
        {n: {"scheme": selection.schemes[n].name, "shape": list(d)} for n, d in selection.targets.items()},
        {n: why for n, (_, why) in selection.kept.items()}, ckpt.total_bytes, shard_bytes, files,
        memory, seconds, {}, calibration, list(scratch.warnings),
    )  # fmt: skip
    if fp8 is not None:
        plan.warnings.append(f"the input is FP8 ({fp8.block[0]}x{fp8.block[1]} blocks), read one weight at a time "
                             "dequantized to bf16: the time estimate leaves the dequantization out")  # fmt: skip
    plan.disk = _disk(job, plan)
    if not plan.disk["fits"]:
        plan.warnings.append(_disk_message(plan))
    return plan


def _disk_message(plan: QuantizePlan) -> str:
    d = plan.disk
    return (f"the output needs {d['needed_bytes'] / 1e9:.2f} GB and {d['free_bytes'] / 1e9:.2f} GB are free "
            f"at {d['at']}: it will not fit")  # fmt: skip


def _attention_modules(ckpt: Checkpoint) -> list[str]:
    """The attention modules (those with a k_proj) in checkpoint order: where --kv-cache fp8 puts the
    k_scale / v_scale (quantize_calibration names them after the loaded model's; the same names)."""
    return list(
        dict.fromkeys(n[: -len(".k_proj.weight")] for n in ckpt.tensors if n.endswith(".k_proj.weight"))
    )


def _shards(tensors, max_shard_bytes: int) -> tuple[list[int], dict[str, str]]:
    """Each output shard's bytes as PlannedShardWriter lays it out, and the weight map."""
    from mixprec import __version__

    shards = plan_shards(tensors, max_shard_bytes)
    metadata = {"format": "pt", "producer": f"mixprec {__version__}"}
    names = shard_names(len(shards))
    sizes = [8 + len(shard_header(s, metadata)) + sum(t.nbytes for t in s) for s in shards]
    return sizes, {t.name: names[i] for i, s in enumerate(shards) for t in s}


def _files(job: QuantizeJob, source: Source, selection: Selection, weight_map: dict[str, str],
           total: int) -> dict[str, int]:  # fmt: skip
    """The other files' bytes: config.json, the index, the side files copied (exact), the scales file
    (estimated: its scale values printed at 22 characters each, the width of most float reprs)."""
    out = {"config.json": len(json.dumps(output_config(job, source.config, selection), indent=2)) + 1}
    index = index_text(weight_map, total)
    if index is not None:
        out["model.safetensors.index.json"] = len(index.encode())
    for p in side_files(job.model_dir, skip={ALGORITHM_FILE}):
        out[p.name] = p.stat().st_size
    layers = {}
    for n, (o, i) in selection.targets.items():
        sch = selection.schemes[n]
        if sch.is_fp8:  # block formats keep their scales out of the file
            scale = torch.full(sch.scale_shape(o, i), 2.0 / 3.0 * 1e-4)
            in_scale = torch.ones(1) / 3 if sch.needs_calibration else None
            layers[n] = layer_entry(scheme=sch.name, weight_granularity=sch.weight_granularity.name,
                                    weight_scale=scale, weight_amax=1 / 3, relative_weight_error=1 / 3,
                                    shape=(o, i), input_scale=in_scale, input_amax=1 / 3 if in_scale is not None else None,
                                    input_dynamic=sch.input_dynamic, input_granularity=sch.input_granularity.name)  # fmt: skip
    doc = build_document(scheme=job.scheme.name, layout=job.format, layers=layers, kv_cache=None,
                         ignored=selection.skipped, calibration=None, producer="mixprec 0.0.0")  # fmt: skip
    out[SCALES_NAMES[0] + " (estimated)"] = len(scales_text(doc).encode())
    return out


def _path(job: QuantizeJob, ckpt: Checkpoint) -> str:
    """How the run calibrates (quantize_calibration.calibrate_job's choice)."""
    if not job.observes:
        return STREAM
    lbl = job.layer_by_layer
    if lbl is None:
        lbl = ckpt.total_bytes > 0.5 * available_memory()
    return LAYER_BY_LAYER if lbl or job.algorithm.uses_gptq else WHOLE_MODEL


_BLOCK = re.compile(r"^(.*?)\.(\d+)\.")


def _blocks(ckpt: Checkpoint, layers: int) -> tuple[dict[str, list[str]], list[str]]:
    """({block prefix: its tensors}, the tensors outside the blocks): the block list is the numbered
    prefix with `layers` entries (the ModuleList layer-by-layer calibration walks)."""
    by_list: dict[str, dict[str, list[str]]] = {}
    for n in ckpt.tensors:
        m = _BLOCK.match(n)
        if m:
            by_list.setdefault(m.group(1), {}).setdefault(f"{m.group(1)}.{m.group(2)}.", []).append(n)
    blocks = next((b for b in by_list.values() if len(b) == layers), None) if layers else None
    if blocks is None:
        blocks = max(by_list.values(), key=len, default={})
    inside = {n for names in blocks.values() for n in names}
    return blocks, [n for n in ckpt.tensors if n not in inside]


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


def _shapes(job: QuantizeJob, source: Source, selection: Selection) -> est.Shapes:
    ckpt, cfg = source.ckpt, _text_config(source.config)
    layers = int(cfg.get("num_hidden_layers") or 0)
    blocks, outside = _blocks(ckpt, layers)
    targets = selection.targets
    sizes = {n: ckpt.tensors[f"{n}.weight"].nbytes for n in targets}
    payload = max((payload_bytes(d, selection.schemes[n]) for n, d in targets.items()), default=0)
    groups, _ = nvfp4_groups(ckpt, targets, selection.schemes)
    largest = max(sizes.values(), default=0)
    # the read buffers one group task takes (q/k/v may share one: quantize_blocks.packed_layout)
    group_buffers = max(
        (packed_layout([sizes[m] for m in g], largest)[-1][0] + 1 for g in groups.values()), default=1
    )
    # a block-format weight's block scales (one byte per 16 or 32 elements), new tensors each
    block_scales = max((math.prod(d) // selection.schemes[n].weight_granularity.block_cols
                        for n, d in targets.items() if selection.schemes[n].fmt.bits == 4), default=0)  # fmt: skip
    linear = [n for n in selection.lw.linears if n in targets or n in selection.kept]
    per_block = [sum(math.prod(selection.lw.linears[n]) for n in linear if n.startswith(b)) for b in blocks]
    dtype = next((ckpt.tensors[f"{n}.weight"].dtype for n in targets), torch.bfloat16)
    return est.Shapes(
        hidden=int(cfg.get("hidden_size") or 0), intermediate=int(cfg.get("intermediate_size") or 0),
        heads=int(cfg.get("num_attention_heads") or 0), layers=layers or len(blocks), act_bytes=dtype.itemsize,
        outside_bytes=sum(ckpt.tensors[n].nbytes for n in outside),
        block_bytes=max((sum(ckpt.tensors[n].nbytes for n in b) for b in blocks.values()), default=0),
        block_linear_params=max(per_block, default=0), total_bytes=ckpt.total_bytes,
        largest_weight_bytes=largest, largest_payload_bytes=payload, largest_block_scales_bytes=block_scales,
        largest_group=max((len(g) for g in groups.values()), default=1), group_buffers=group_buffers,
        workers=stream_workers(),
    )  # fmt: skip


def _estimates(job: QuantizeJob, ckpt: Checkpoint, s: est.Shapes, selection: Selection, path: str,
               baseline: int, probe: bool, startup_and_output: tuple[float, int],
               ) -> tuple[est.Estimate, est.Estimate | None, dict[str, Any] | None]:  # fmt: skip
    """(memory, time, the calibration's size) of the run's stages; the peak is the larger stage's."""
    p = probes(job, s, selection, path, ckpt) if probe else None
    stream = est.stream_memory(s, baseline, p.quantize if p else None, COPY_CHUNK_BYTES)
    tokens = job.calib_samples * job.calib_seq_len
    calibration = None
    stages = {"streaming (writing)": stream}
    if path != STREAM:
        calibration = {
            "samples_at_most": job.calib_samples,
            "seq_len": job.calib_seq_len,
            "tokens_at_most": tokens,
        }
        if path == LAYER_BY_LAYER:
            gptq = _gptq_memory(s, selection) if job.algorithm.uses_gptq else None
            stages["calibration, block by block"] = est.layerwise_memory(
                s, baseline, tokens, job.calib_seq_len, gptq
            )
        else:
            stages["calibration, whole model"] = est.whole_model_memory(s, baseline, job.calib_seq_len)
    notes = [f"{name}: {sum(t.values()) / 2**30:.2f} GiB" for name, t in stages.items()]
    folds = [n for n in job.algorithm.names if n in FOLDS]
    streamed = {}  # the folds, each streamed over the checkpoint first (rotation_checkpoint.py, fold_checkpoint.py)
    if ROTATE in folds:
        streamed["rotation, block by block"] = est.rotation_memory(s, baseline, CHUNK_ROWS)
    if SMOOTHQUANT in folds:
        streamed["SmoothQuant, block by block"] = est.layerwise_memory(
            s, baseline, tokens, job.calib_seq_len, None
        )
    if AWQ in folds:
        streamed["AWQ, block by block"] = est.awq_memory(s, baseline, tokens, job.calib_seq_len)
    stages.update(streamed)
    notes += [f"{name}: {sum(t.values()) / 2**30:.2f} GiB" for name, t in streamed.items()]
    peak_stage = max(stages, key=lambda k: sum(stages[k].values()))
    memory = est.Estimate(stages[peak_stage], f"peak of the stages: {peak_stage} (docs/quantize.md)", notes)
    if p is None:
        return memory, None, calibration
    return memory, stage_seconds(job, s, selection, path, p, *startup_and_output), calibration


def _gptq_memory(s: est.Shapes, selection: Selection) -> est.GptqMemory:
    targets = selection.targets
    first_block = _BLOCK.match(next(iter(targets), "")) if targets else None
    prefix = first_block.group(0) if first_block else ""
    groups = input_groups([n for n in targets if n.startswith(prefix)])
    hessians = sum(targets[g[0]][1] ** 2 * 4 for g in groups)
    out_f, in_f = max(targets.values(), key=lambda d: d[0] * d[1], default=(0, 0))
    rounded = sum(
        math.prod(shape) * dtype.itemsize
        for n, d in targets.items()
        for _, dtype, shape in planned_tensors(n, d, selection.schemes[n], "compressed-tensors")
    )
    # the factor is made in the Hessian's own memory (counted above): beside it a chunk of rows at most,
    # and the column loop's per-group multipliers and clip limits (8 bytes a row per 16-wide group)
    return est.GptqMemory(hessians, 4 * out_f * in_f * 4 + out_f * in_f // 2 + CHUNK_BYTES, rounded)


def _disk(job: QuantizeJob, plan: QuantizePlan) -> dict[str, Any]:
    """Free space at the output's nearest existing ancestor; what the run writes there (the output, the
    folded model's temporary copies when a fold runs (two at once with several folds), GPTQ's rounded weights spilled beside the output)."""
    at = job.output_dir.absolute().parent
    while not at.exists():
        at = at.parent
    free = shutil.disk_usage(at).free
    needed = plan.output_bytes
    folds = [n for n in job.algorithm.names if n in FOLDS]
    if folds:  # the folded copies: a fold after another reads the one before's while it writes its own
        needed += plan.input_bytes * min(2, len(folds))
    if job.algorithm.uses_gptq:
        needed += plan.output_bytes  # the spill: the rounded Linears, at most the output's size
    return {"at": str(at), "free_bytes": free, "needed_bytes": needed, "fits": needed <= free}


__all__ = ["SCHEMA_VERSION", "QuantizePlan", "plan_quantize"]
