"""The calibration step of an offline quantization (static schemes, --kv-cache fp8, --algorithm):
load the model (whole, or one transformer block at a time when it would not fit), observe the inputs
of the Linears that need a static scale and the KV cache, free the model. With GPTQ the run is always
block by block: in each block the Hessians accumulate beside the observers, the block's Linears are
rounded (algorithms/gptq_pass.py) and their results kept for the writer.

Under a process group of several ranks (every rank calls calibrate_job) the run is split: always block
by block (the walk has no early stop, so the batches run does not depend on how they are split), each
rank on its share of the batches (across_ranks.share), the amaxes MAX-reduced, the run's counts summed
and GPTQ's Hessians SUM-reduced; every rank returns the same Calibration, that of one process running
every batch block by block (docs/quantize.md, "Calibration and GPTQ across processes").
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec.conversion import ConversionReport
from mixprec.errors import MixprecError
from mixprec.hf import load_model, load_tokenizer
from mixprec.inference.algorithms.gptq_pass import GptqPass
from mixprec.inference.calibration.across_ranks import share
from mixprec.inference.calibration.data import token_batches
from mixprec.inference.calibration.layerwise import calibrate_layerwise
from mixprec.inference.calibration.run import (
    CalibrationResult,
    calibrate,
    unseen_experts_warning,
    unseen_take_group_max,
)
from mixprec.inference.checkpoint.linear_weights import LinearWeights
from mixprec.inference.checkpoint.spill import SpilledResults
from mixprec.inference.producers.quantize_job import (
    QuantizeJob,
    Selection,
    Source,
    check_observer_across_ranks,
)
from mixprec.inference.runtime.experts import unfuse_for_calibration, unfuse_skeleton
from mixprec.progress import ProgressBars, progress_bar
from mixprec.ranks import rank, world_size
from mixprec.scaling import QuantizedTensor


@dataclass(frozen=True)
class Calibration:
    """What calibration found: input amax per Linear, KV amax per attention layer (and its module
    name), and what ran and why it stopped (None when nothing was calibrated); with GPTQ, the Linears
    it rounded ({name: what the writer stores}; its record goes to the report's `algorithm`)."""

    input_amax: dict[str, float]
    kv_amax: dict[int, tuple[float, float]]
    kv_names: dict[int, str]
    info: dict[str, Any] | None
    prequantized: Mapping[str, QuantizedTensor] = field(default_factory=dict)

    def close(self) -> None:
        """Remove what `prequantized` keeps on disk (once the writer is done with it)."""
        if isinstance(self.prequantized, SpilledResults):
            self.prequantized.close()


NOT_CALIBRATED = Calibration({}, {}, {}, None)


def calibrate_job(
    job: QuantizeJob, source: Source, selection: Selection, report: ConversionReport
) -> Calibration:
    """Run the calibration the job needs (NOT_CALIBRATED when it needs none); record it in the report.
    Under a process group of several ranks: a collective (every rank calls it), split across the ranks,
    the same result on every rank (the module docstring)."""
    names = [n for n in selection.targets if selection.schemes[n].needs_calibration]
    if not (names or job.kv_cache or job.algorithm.uses_gptq):
        return NOT_CALIBRATED  # the folds (awq, smoothquant) have used the data already: nothing to observe
    check_observer_across_ranks(job.observer)
    batches = token_batches(source.texts, load_tokenizer(job.model_dir), job.calib_samples, job.calib_seq_len)
    layer_by_layer = job.layer_by_layer
    if world_size() > 1:  # the whole-model run's early stop would need every rank's amax after every batch
        layer_by_layer = True
        report.notes.append(
            f"calibration split across {world_size()} processes: layer by layer, every batch run (no early stop)"
        )
    elif layer_by_layer is None:  # decide by memory: the whole model must fit with room to spare
        layer_by_layer = source.ckpt.total_bytes > 0.5 * available_memory()
    gptq = _gptq_pass(job, source, selection)
    try:
        return _calibrate(job, source, selection, report, batches, names, layer_by_layer, gptq)
    except BaseException:
        if gptq is not None and isinstance(gptq.results, SpilledResults):
            gptq.results.close()
        raise


def _calibrate(job: QuantizeJob, source: Source, selection: Selection, report: ConversionReport,
               batches: list[torch.Tensor], names: list[str], layer_by_layer: bool,
               gptq: GptqPass | None) -> Calibration:  # fmt: skip
    """calibrate_job's run, once the batches and the GPTQ pass are ready."""
    if layer_by_layer or gptq is not None:
        n_blocks = int(source.config.get("num_hidden_layers") or 0)
        title = "GPTQ, block by block" if gptq is not None else "calibrating layer by layer"
        split = world_size() > 1
        with progress_bar(job.progress and rank() == 0, title, n_blocks or None) as advance:
            result, model = calibrate_layerwise(
                job.model_dir, source.config, source.ckpt, share(batches) if split else batches, names,
                observer=job.observer, kv_cache=job.kv_cache, progress=advance, block_pass=gptq,
                across_ranks=split, unfuse=_unfuse(source) if selection.lw.experts else None,
            )  # fmt: skip
        input_amax = result.input_amax
    else:
        result, model, input_amax = _calibrate_whole_model(job, selection.lw, batches, names)
    input_amax, unseen = unseen_take_group_max(
        input_amax, {n: s.param for n, s in selection.lw.experts.items()}
    )
    if unseen:
        report.warn(unseen_experts_warning(unseen))
    info = None
    if names or job.kv_cache:
        info = {"data": str(job.calib_data), "seq_len": int(batches[0].shape[1]), "observer": job.observer,
                "samples_requested": job.calib_samples, **result.run.to_dict()}  # fmt: skip
        info["layer_by_layer"] = bool(layer_by_layer or gptq is not None)
        report.calibration = info
        report.notes.append(f"calibration: {result.run.samples} samples, {result.run.reason}")
    kv_names = {i: _attention_module_name(model, i) for i in result.kv_amax}
    del model
    gc.collect()
    if gptq is None:
        return Calibration(input_amax, result.kv_amax, kv_names, info)
    _record_gptq(job, gptq, batches, result.run.seconds, report)
    return Calibration(input_amax, result.kv_amax, kv_names, info, gptq.results)


def _unfuse(source: Source):
    """What gives the layer-by-layer skeleton one Linear per checkpoint expert weight, as the loader
    does (runtime/experts.py): {checkpoint module: module path}."""
    shapes = {n[: -len(".weight")]: i.shape for n, i in source.ckpt.tensors.items() if n.endswith(".weight")}
    return lambda model: unfuse_skeleton(model, shapes)


def _gptq_pass(job: QuantizeJob, source: Source, selection: Selection) -> GptqPass | None:
    """The GPTQ pass of the job's targets (None without --algorithm gptq). MoE expert weights each get
    the Hessian of the tokens routed to their expert (the walk unfuses the experts: _unfuse)."""
    if not job.algorithm.uses_gptq or not selection.targets:
        return None
    dtypes = {source.ckpt.tensors[f"{n}.weight"].dtype for n in selection.targets}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    # each block's rounded weights wait on disk for the writer, beside the output (memory: one block's);
    # every rank keeps all of them, in a directory of its own (SpilledResults: a fresh temporary one)
    return GptqPass({n: selection.schemes[n] for n in selection.targets}, job.algorithm.gptq, dtype,
                    search=job.algorithm.uses_scale_search, results=SpilledResults(_spill_dir(job)),
                    across_ranks=world_size() > 1,
                    experts=[n for n in selection.targets if n in selection.lw.experts])  # fmt: skip


def _spill_dir(job: QuantizeJob):
    """Beside the output (its disk holds the output anyway), or the system's temporary directory."""
    parent = job.output_dir.resolve().parent
    return parent if parent.is_dir() else None


def _record_gptq(job: QuantizeJob, gptq: GptqPass, batches: list[torch.Tensor], seconds: float,
                 report: ConversionReport) -> None:  # fmt: skip
    """GPTQ's record into the report's `algorithm` (the side file's body), its warnings into the report."""
    for message in gptq.warnings():
        report.warn(message)
    record = gptq.record(job.algorithm, batches, seconds, str(job.calib_data))
    report.algorithm = {**(report.algorithm or {}), **record}  # the folds' records kept
    report.notes.append(f"GPTQ: {len(gptq.results)} Linears on {record['tokens']} calibration tokens")


def _calibrate_whole_model(
    job: QuantizeJob, lw: LinearWeights, batches: list[torch.Tensor], names: Sequence[str]
) -> tuple[CalibrationResult, Any, dict[str, float]]:
    """(the result, the loaded model, input amax by checkpoint name) of one run over the whole model."""
    model = load_model(job.model_dir, dtype="auto").eval()
    paths = _calibration_modules(model, names, lw)
    experts = [p for n, p in paths.items() if n in lw.experts]
    # the bar's total is the cap; the stop rule usually ends it early (time left: to the cap)
    with ProgressBars(job.progress, time_remaining=True) as bars:
        advance = bars.add("calibrating (stops once the scales settle)", len(batches)).advance
        result = calibrate(
            model, batches, list(paths.values()), observer=job.observer, kv_cache=job.kv_cache,
            stop=job.calib_stop, progress=advance, may_be_unseen=experts,
        )  # fmt: skip
    return result, model, {n: result.input_amax[p] for n, p in paths.items()}


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _calibration_modules(model: Any, names: Sequence[str], lw: LinearWeights) -> dict[str, str]:
    """{checkpoint name: module path in the loaded model} of the Linears whose inputs are observed;
    fused experts are unfused first (experts.py) so that each expert's inputs can be seen."""
    paths = unfuse_for_calibration(model, lw.experts) if any(n in lw.experts for n in names) else {}
    modules = dict(model.named_modules())
    out = {}
    for n in names:
        path = paths.get(n, n)
        if path not in modules:
            raise MixprecError(f"calibration: the loaded model has no module {n!r} (a checkpoint name)")
        out[n] = path
    return out


def _attention_module_name(model: Any, layer_idx: int) -> str:
    for name, m in model.named_modules():
        if getattr(m, "layer_idx", None) == layer_idx and hasattr(m, "k_proj"):
            return name
    raise MixprecError(f"no attention module with layer_idx {layer_idx} and a k_proj for the KV-cache scales")


__all__ = ["NOT_CALIBRATED", "Calibration", "calibrate_job"]
