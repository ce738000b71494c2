"""Offline quantization of a Hugging Face safetensors checkpoint: `quantize_checkpoint`, a pipeline of
short steps over one frozen job description (QuantizeJob, built from the arguments and validated
before any work): resolve the input -> select the Linears -> calibrate (static schemes, KV cache) ->
plan every output tensor -> stream them through the one publish (checkpoint/publish.py).

Calibration-free schemes (fp8-dynamic, fp8-block, the a16 block formats) never instantiate the model:
Linear weights are recognised by name and 2-D shape (linear_weights.py: confirmed against the model
built on the meta device, per-expert MoE weights and tied heads included), and every tensor streams
from the input shards to planned output shards, a few Linear weights in memory at a time
(quantize_stream.py). Calibration (fp8-static, nvfp4, --kv-cache fp8) loads the model once to observe
activations (quantize_calibration.py), frees it, then streams the weights the same way.

Every 2-D floating weight is accounted for: quantized, kept by an ignore pattern, or kept for a
reason the report gives with a warning (a Linear whose dims do not suit the kernels, a tied head,
a weight that is no Linear's, fused 3-D experts).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixprec.conversion import ConversionReport
from mixprec.errors import MixprecError
from mixprec.formats import E4M3
from mixprec.inference.algorithms.spec import FOLDS, AlgorithmSpec
from mixprec.inference.calibration.across_ranks import broadcast_object, merged_entries, wait_for_all_ranks
from mixprec.inference.calibration.run import StopRule
from mixprec.inference.checkpoint import configs
from mixprec.inference.checkpoint.algorithm_file import (
    ALGORITHM_FILE,
    algorithm_document,
    write_algorithm_file,
)
from mixprec.inference.checkpoint.fp8_block_input import Fp8BlockWeight, fp8_weights
from mixprec.inference.checkpoint.layout import K_SCALE, V_SCALE, planned_tensors
from mixprec.inference.checkpoint.linear_weights import LinearWeights, find_linear_weights
from mixprec.inference.checkpoint.publish import DEFAULT_MAX_SHARD_SIZE, publish
from mixprec.inference.checkpoint.safetensors_io import (
    Checkpoint,
    PlannedShardWriter,
    PlannedTensor,
    copy_side_files,
    plan_shards,
)
from mixprec.inference.checkpoint.scales_file import build_document
from mixprec.inference.mixed import KEPT_BY_ASSIGNMENT, PLAIN, apply_assignment
from mixprec.inference.producers.quantize_blocks import nvfp4_groups
from mixprec.inference.producers.quantize_calibration import Calibration, calibrate_job
from mixprec.inference.producers.quantize_folds import folded
from mixprec.inference.producers.quantize_job import QuantizeJob, Selection, Source, resolve
from mixprec.inference.producers.quantize_ranks import own_shards
from mixprec.inference.producers.quantize_stream import StreamPlan, record_layers, stream_tensors
from mixprec.inference.producers.resume import PartialRun, ReportMark, ShardMap, partial_run
from mixprec.inference.schemes import (
    InferenceScheme,
    serving_reasons,
    skip_reason,
    transformers_dequantize_reason,
)
from mixprec.progress import StageMeter
from mixprec.ranks import is_main_process, rank, world_size
from mixprec.scaling import compute_scale
from mixprec.select import selects_any


def quantize_checkpoint(
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
    progress: bool = True,
    strict: bool = False,
    algorithm: str | Sequence[str] | AlgorithmSpec | None = None,
    resume: bool = False,
) -> ConversionReport:
    """Quantize a local Hugging Face safetensors checkpoint to FP8 or FP4 (the scheme's format); write
    it to output_dir atomically. Only what the serving engines accept is written
    (schemes.serving_reasons): a Linear whose dims no kernel takes, or a fused group (q/k/v, gate/up,
    experts) that vLLM would refuse, stays in high precision in the checkpoint's ignore list, its
    reason in the report; strict: MixprecError instead, before anything is read or written.

    calib_stop: when calibration may stop before `calib_samples` (the cap) have run (default
    StopRule(); the report's and scales file's `calibration` say how many ran and why it stopped).
    layer_by_layer: calibrate one transformer block at a time (True), the whole model (False), or
    decide by memory (None: when the checkpoint exceeds half of the available RAM). scheme as a
    mapping {Linear name: scheme}: a mixed-precision checkpoint (`--scheme auto`), one
    compressed-tensors config group per scheme; every Linear it does not name stays in high precision.
    algorithm: what rounds the weights beyond round to nearest ("gptq", or an AlgorithmSpec with its
    parameters; docs/algorithms.md); it learns from calib_data and is recorded in the report's
    `algorithm` and the checkpoint's mixprec_algorithm.json. resume: continue the partial run a killed
    run left beside output_dir (producers/resume.py); force without resume discards it.
    """
    job = QuantizeJob.build(
        model_dir, output_dir, scheme, ignore=ignore, default_ignore=default_ignore, kv_cache=kv_cache,
        max_shard_size=max_shard_size, calib_data=calib_data, calib_samples=calib_samples,
        calib_seq_len=calib_seq_len, observer=observer, calib_stop=calib_stop, format=format, force=force,
        layer_by_layer=layer_by_layer, progress=progress, strict=strict, algorithm=algorithm, resume=resume,
    )  # fmt: skip
    source = resolve(job)
    report = ConversionReport(recipe=job.scheme.name, kind=job.scheme.family, device="cpu", scheme=job.scheme.name,
                              param_dtype=_dtype_name(source.config), output=str(job.output_dir))  # fmt: skip
    with StageMeter() as meter:
        # the partial run's set-up, and the folds when --algorithm asks for one (they hold the whole model)
        meter.next("folds" if set(job.algorithm.names) & set(FOLDS) else "prepare")
        with (
            partial_run(job, source) as run,
            folded(job, source, report, _scratch_selection, run) as (job, source),
        ):
            _select_calibrate_write(job, source, report, run, meter)
    report.stages = meter.stages
    return report


def _dtype_name(config: dict[str, Any]) -> str:
    return str(config.get("dtype") or config.get("torch_dtype"))


def _select_calibrate_write(job: QuantizeJob, source: Source, report: ConversionReport, run: PartialRun,
                            meter: StageMeter) -> ConversionReport:  # fmt: skip
    meter.next("select")
    selection = select(job, source, report)
    meter.next("calibration")
    calibration = _calibrate(job, source, selection, report, run)
    try:
        if report.algorithm is None and job.algorithm.names:  # data-free algorithms: their parameters
            report.algorithm = job.algorithm.to_dict()
        meter.next("write")
        plan = plan_tensors(job, source.ckpt, selection, calibration)
        return write(job, source, selection, calibration, plan, report, run)
    finally:
        calibration.close()  # GPTQ's results spilled to disk between the walk and the writer


def _calibrate(job: QuantizeJob, source: Source, selection: Selection, report: ConversionReport,
               run: PartialRun) -> Calibration:  # fmt: skip
    """The partial run's calibration result when it has one (--resume); else calibrate and record it."""
    cached = run.cached_calibration(report)
    if cached is not None:
        return cached
    mark = ReportMark.of(report)
    calibration = calibrate_job(job, source, selection, report)
    if job.calibrates and is_main_process():  # the manifest is rank 0's
        run.save_calibration(calibration, report, mark)
    return calibration


def _scratch_selection(job: QuantizeJob, source: Source) -> Selection:
    """The selection of the unfolded input, its warnings left out (the folded model's selection,
    made after the folds, reports them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return select(job, source, ConversionReport(recipe="", kind="", device="cpu", param_dtype=""))


def select(job: QuantizeJob, source: Source, report: ConversionReport) -> Selection:
    """The Linears quantized, and every weight kept in high precision with its reason (warned about
    when no ignore pattern names it)."""
    lw = find_linear_weights(source.ckpt, job.model_dir, source.config)
    if lw.warning:
        report.warn(lw.warning)
    plain = job.scheme if job.assignment is None else InferenceScheme.from_name(PLAIN)
    targets, skipped, kept = _select(lw, job.ignore, plain, job.format, strict=job.strict)
    schemes = (
        dict.fromkeys(targets, job.scheme)
        if job.assignment is None
        else apply_assignment(dict(job.assignment), lw.linears, targets, skipped, kept, job.format)
    )
    if not targets:
        report.warn(f"no Linear weight of {job.model_dir} is quantized (all ignored or none recognised)")
    unnamed = {
        n: why for n, (_, why) in kept.items() if why not in ("ignored by pattern", KEPT_BY_ASSIGNMENT)
    }
    if unnamed:
        listed = "; ".join(f"{n}: {why.split(' (')[0]}" for n, why in list(unnamed.items())[:3])
        report.warn(
            f"{len(unnamed)} weight tensor(s) stay in high precision although no ignore pattern names them "
            f"(e.g. {listed}{'; ...' if len(unnamed) > 3 else ''}); the report lists each with its reason"
        )
    dequantize_refused = {
        n: why
        for n, dims in targets.items()
        if (why := transformers_dequantize_reason(job.format, schemes[n].weight_block, *dims))
    }
    if dequantize_refused:
        name, why = next(iter(dequantize_refused.items()))
        report.warn(
            f"{len(dequantize_refused)} Linear layer(s) load in vLLM and on FP8 GPUs but not in transformers on a "
            f"CPU (e.g. {name}: {why}); the compressed-tensors layout has no such limit"
        )
    return Selection(lw, targets, skipped, kept, schemes)


@dataclass(frozen=True)
class Plan:
    """Every output tensor in order (what the shard writer is planned with), and the KV-cache scales
    with their scales-file entries."""

    tensors: list[PlannedTensor]
    kv_tensors: dict[str, torch.Tensor]
    kv_doc: dict[str, dict[str, float]]


def plan_tensors(job: QuantizeJob, ckpt: Checkpoint, selection: Selection, calibration: Calibration) -> Plan:
    """Plan every output tensor: each input tensor in file order (a quantized Linear's weight as the
    layout table's tensors), then the KV-cache scales."""
    targets, schemes = selection.targets, selection.schemes
    planned: list[PlannedTensor] = []
    for n, info in ckpt.tensors.items():
        module = n[: -len(".weight")] if n.endswith(".weight") else None
        if module in targets:  # the layout table's tensors, in the order they are written
            planned += [PlannedTensor(*t) for t in planned_tensors(module, targets[module], schemes[module], job.format)]  # fmt: skip
        else:
            planned.append(PlannedTensor(n, info.dtype, info.shape))
    kv_tensors: dict[str, torch.Tensor] = {}
    kv_doc: dict[str, dict[str, float]] = {}
    for i, (ka, va) in calibration.kv_amax.items():
        attn = calibration.kv_names[i]
        ks, vs = compute_scale(ka, E4M3).reshape(1), compute_scale(va, E4M3).reshape(1)
        kv_tensors[f"{attn}.{K_SCALE}"], kv_tensors[f"{attn}.{V_SCALE}"] = ks, vs
        kv_doc[attn] = {K_SCALE: float(ks), V_SCALE: float(vs), "k_amax": ka, "v_amax": va}
    planned += [PlannedTensor(n, torch.float32, (1,)) for n in kv_tensors]
    return Plan(planned, kv_tensors, kv_doc)


def write(job: QuantizeJob, source: Source, selection: Selection, calibration: Calibration, plan: Plan,
          report: ConversionReport, run: PartialRun) -> ConversionReport:  # fmt: skip
    """Stream the tensors through the one publish (checkpoint/publish.py) into the partial run's
    output, from its first unfinished shard; complete the report."""
    from mixprec import __version__

    ckpt, schemes = source.ckpt, selection.schemes
    layers: dict[str, dict[str, Any]] = {}
    shards = ShardMap(plan_shards(plan.tensors, job.max_shard_bytes), selection, job.format)
    finished = broadcast_object(run.finished_shards(shards, report) if is_main_process() else None, src=0)
    if finished:
        report.notes.append(
            f"resumed: {len(finished)} of {len(shards.names)} shards kept from the partial run"
        )
    mine = own_shards(shards.shards, finished)
    skip = frozenset(range(len(shards.names))) - mine
    if world_size() > 1:
        report.notes.append(f"split across {world_size()} processes (torchrun): rank {rank()} wrote "
                            f"{len(mine)} of the {len(shards.names) - len(finished)} shards written")  # fmt: skip
    done = shards.done_inputs(ckpt, finished, run.layers)
    stream = StreamPlan(selection.targets, schemes, job.format, calibration.input_amax,
                        *nvfp4_groups(ckpt, selection.targets, schemes), calibration.prequantized,
                        job.algorithm.uses_scale_search, done,
                        frozenset(shards.inputs_within(ckpt, skip)) - done.keys())  # fmt: skip

    def write_tensors(writer: PlannedShardWriter) -> None:
        stream_tensors(ckpt, writer, stream, layers, report, job.progress)
        for n, t in plan.kv_tensors.items():
            writer.write(n, t)
        merged = merged_entries(layers)  # every rank's Linears (a run split across ranks) ...
        in_order = (n[: -len(".weight")] for n in ckpt.tensors if n.endswith(".weight"))
        layers.clear()
        layers.update({m: merged[m] for m in in_order if m in merged})  # ... in the input's order
        record_layers(ckpt, stream, layers, report)

    def scales() -> dict[str, Any]:
        return build_document(
            # block-format layers stay out: their scales are in the checkpoint, millions of them
            scheme=job.scheme.name, layout=job.format, layers={n: e for n, e in layers.items() if schemes[n].is_fp8},
            kv_cache=plan.kv_doc, ignored=selection.skipped,
            calibration=without_timing(calibration.info), producer=f"mixprec {__version__}",
        )  # fmt: skip

    copied = publish(
        job.output_dir, force=job.force, planned=plan.tensors, max_shard_size=job.max_shard_bytes,
        producer=f"mixprec {__version__}", write_tensors=write_tensors,
        config=lambda: output_config(job, source.config, selection),
        side_files=lambda tmp: _side_files(job, tmp, report), scales=scales, into=run.output,
        skip_shards=skip, on_shard=run.recorder(shards, layers), finish=is_main_process(),
    )  # fmt: skip
    run.wait()  # this rank's finished shards are in the log
    wait_for_all_ranks()  # ... and every rank's shards are written before rank 0 publishes
    report.weight_bytes_after = sum(t.nbytes for t in plan.tensors)
    for name, (kind, why) in selection.kept.items():
        info = ckpt.tensors.get(name) or ckpt.tensors.get(f"{name}.weight")
        numel = info.nbytes // info.dtype.itemsize if info is not None else 0
        role = {"Linear": "linear", "experts": "experts"}.get(
            kind, "embedding" if name in selection.lw.embeddings else "other"
        )
        if isinstance(info, Fp8BlockWeight):
            why = f"{why}; {DEQUANTIZED}"
        report.add_skipped(name, kind, numel, why, role=role)
    report.notes.append(f"copied {', '.join(copied or []) or 'no side files'}")
    if source.fp8_input is not None:
        report.notes.append(_fp8_input_note(job, source, selection))
    return report


DEQUANTIZED = "stored FP8 in the input: written dequantized to bf16"


def _fp8_input_note(job: QuantizeJob, source: Source, selection: Selection) -> str:
    """What became of an FP8 block input's weights."""
    fp8 = fp8_weights(source.ckpt)
    requantized = sum(n[: -len(".weight")] in selection.targets for n in fp8)
    rows, cols = source.fp8_input.block
    return (
        f"input: FP8 with {rows}x{cols} block scales: {len(fp8)} weights dequantized to bf16 one at a time "
        f"({requantized} quantized to {job.scheme.name}, {len(fp8) - requantized} kept and written in bf16); "
        "their block scales are not written"
    )


def _side_files(job: QuantizeJob, tmp: Path, report: ConversionReport) -> list[str]:
    """The input's side files, and the algorithm's record when one ran."""
    from mixprec import __version__

    copied = copy_side_files(job.model_dir, tmp, skip={ALGORITHM_FILE})
    if report.algorithm is not None:
        record = without_timing({"scheme": job.scheme.name, **report.algorithm})
        doc = algorithm_document(record, f"mixprec {__version__}")
        copied.append(write_algorithm_file(tmp, doc))
    return copied


def without_timing(record: Any) -> Any:
    """A record without its `seconds`: times stay in the report, out of the checkpoint, so that two runs
    of one job (an interrupted and resumed one too) write the same bytes."""
    if isinstance(record, dict):
        return {k: without_timing(v) for k, v in record.items() if k != "seconds"}
    if isinstance(record, list):
        return [without_timing(v) for v in record]
    return record


def output_config(job: QuantizeJob, config: dict[str, Any], selection: Selection) -> dict[str, Any]:
    """The input's config.json with the layout's quantization_config."""
    ignored, kv_cache = sorted(selection.skipped), job.kv_cache
    out_cfg = dict(config)
    if job.assignment is not None:
        out_cfg["quantization_config"] = configs.ct_mixed_quantization_config(
            {n: selection.schemes[n] for n in selection.targets}, ignored, kv_cache
        )
    elif job.format == "compressed-tensors":
        out_cfg["quantization_config"] = configs.ct_quantization_config(job.scheme, ignored, kv_cache)
    else:
        out_cfg["quantization_config"] = configs.hf_fp8_quantization_config(job.scheme, ignored)
    return out_cfg


def _select(lw: LinearWeights, patterns: Sequence[str], sch: InferenceScheme, layout: str, *, strict: bool = False) -> tuple[dict[str, tuple[int, int]], dict[str, str], dict[str, tuple[str, str]]]:  # fmt: skip
    """(targets: Linears to quantize, skipped: the Linear modules a reader must leave alone (the
    checkpoint's ignore list) with reasons, kept: every weight left in high precision -> (kind, reason)).
    strict: MixprecError when a Linear no ignore pattern names stays in high precision for a shape rule."""
    targets: dict[str, tuple[int, int]] = {}
    skipped: dict[str, str] = {}
    kept: dict[str, tuple[str, str]] = {}
    for name, (out_f, in_f) in lw.linears.items():
        why = skip_reason(name, out_f, in_f, patterns, sch)
        if why:
            skipped[name] = why
            kept[name] = ("Linear", why)
        else:
            targets[name] = (out_f, in_f)
    for name, why in serving_reasons(sch, layout, lw.linears, skipped).items():
        del targets[name]
        skipped[name] = why
        kept[name] = ("Linear", why)
    if strict:
        broken = {n: why for n, why in skipped.items() if n in lw.linears and why != "ignored by pattern"}
        if broken:
            name, why = next(iter(broken.items()))
            raise MixprecError(
                f"--strict: {len(broken)} Linear layer(s) would stay in high precision for the serving engines' "
                f"shape rules, e.g. {name}: {why}; name them with --ignore to keep them in high precision, "
                "or drop --strict"
            )
    # tied heads: readers see the module, the checkpoint lacks its weight
    for name, why in lw.unstored.items():
        why = "ignored by pattern" if selects_any(name, patterns) else why
        skipped[name] = why
        kept[name] = ("Linear", why)
    for name, what in lw.not_linear.items():
        if not selects_any(name, patterns):
            kept[name] = ("weight", f"{what}, not quantized")
        elif name not in lw.embeddings:  # e.g. MoE routers: Linear layers to readers such as vLLM
            skipped[name] = "ignored by pattern"
            kept[name] = ("weight", "ignored by pattern")
    for name in lw.fused_experts:
        kept[name] = ("experts", "fused 3-D expert weights: mixprec quantizes per-expert 2-D weights only")
    return targets, skipped, kept
