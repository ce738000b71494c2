"""The time estimate of a quantize plan (producers/quantize_plan.py): short probes on random tensors
of the checkpoint's real shapes, times the counts of the work the run does (quantize_estimates.py has
the probes and the memory formulas).

- streaming: every quantized weight element at the probe's seconds per element (the workers' count
  of quantizes at once, one thread each, as the streaming workers run) plus the sha256 of every byte
  written (the writer hashes each shard on a thread of its own) at the probed rate, divided by the
  workers; plus the bytes written, and the bytes kept unchanged (read and checked on the writer's
  thread), at assumed speeds (write_bytes_per_second(), KEPT_BYTES_PER_SECOND: the plan reads no shard
  body and writes nothing, so it cannot time them);
- calibration: every block's forward over the calibration tokens (at most: samples x seq_len) at the
  GEMM probe's fp32 rate (twice with GPTQ's sequential re-run); the whole-model path adds the head;
- GPTQ: the Hessians (2 x tokens x in^2 flops per input group), each Linear's solve by the scaled-down
  probe's rule (GptqProbe.seconds_for) and its two output-error records (three triangular solves with the
  solve factor: 3 x out x in^2 flops).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mixprec.inference.algorithms.gptq import HESSIAN_ROW_BLOCKS
from mixprec.inference.algorithms.gptq_pass import input_groups
from mixprec.inference.checkpoint.safetensors_io import Checkpoint
from mixprec.inference.producers import quantize_estimates as est
from mixprec.inference.producers.quantize_job import QuantizeJob, Selection

LAYER_BY_LAYER, WHOLE_MODEL = "layer-by-layer", "whole-model"  # quantize_plan's paths


@dataclass(frozen=True)
class Probes:
    quantize: est.QuantizeProbe | None
    gemm_rate: float | None  # fp32 flops per second, all threads
    gptq: est.GptqProbe | None
    hash_rate: float  # sha256 bytes per second, one thread


def probes(job: QuantizeJob, s: est.Shapes, selection: Selection, path: str, ckpt: Checkpoint) -> Probes:
    """The probes the run's stages need, each on the real largest shape (GPTQ: scaled down)."""
    targets = selection.targets
    quantize = rate = gptq = None
    if targets:
        name = max(targets, key=lambda n: math.prod(targets[n]))
        dtype = ckpt.tensors[f"{name}.weight"].dtype
        quantize = est.probe_quantize(targets[name], dtype, selection.schemes[name], s.workers)
    if path in (LAYER_BY_LAYER, WHOLE_MODEL) or job.algorithm.uses_gptq:
        shape = max(targets.values(), key=math.prod) if targets else (s.intermediate or 1, s.hidden or 1)
        rate = est.probe_gemm_rate(shape)
    if job.algorithm.uses_gptq and targets:
        name = max(targets, key=lambda n: targets[n][0])
        gptq = est.probe_gptq(targets[name][0], selection.schemes[name], rate)
    return Probes(quantize, rate, gptq, est.probe_hash_rate())


def stage_seconds(job: QuantizeJob, s: est.Shapes, selection: Selection, path: str, p: Probes,
                  startup: float, output_bytes: int) -> est.Estimate:  # fmt: skip
    """The time estimate's terms (seconds), stage by stage."""
    targets = selection.targets
    elements = sum(math.prod(d) for d in targets.values())
    terms: dict[str, float] = {"start-up (process start, imports)": startup}
    notes = []
    terms.update(_streaming_terms(s, elements, output_bytes, p))
    if path in (LAYER_BY_LAYER, WHOLE_MODEL) and p.gemm_rate:
        tokens = job.calib_samples * job.calib_seq_len
        gptq = job.algorithm.uses_gptq
        passes = 2 if gptq and job.algorithm.gptq.sequential else 1
        forward = est.forward_seconds(s, tokens, job.calib_seq_len, p.gemm_rate, passes)
        if path == WHOLE_MODEL:  # the head runs too; the stop rule usually ends the run earlier
            forward += 2 * tokens * s.hidden * _vocab(selection) / p.gemm_rate
            notes.append("calibration: at most; the stop rule usually ends it earlier (docs/quantize.md)")
        terms[f"calibration forward: {passes} pass(es) x {s.layers} blocks x {tokens:,} tokens at "
              f"{p.gemm_rate / 1e9:.1f} GFLOP/s (probe)"] = forward  # fmt: skip
        if gptq:
            terms.update(_gptq_terms(selection, tokens, p))
    return est.Estimate(terms, "sum of the stages' terms (docs/quantize.md)", notes)


def _streaming_terms(s: est.Shapes, elements: int, output_bytes: int, p: Probes) -> dict[str, float]:
    """The streaming stage, as its threads share the CPUs: the workers' compute (quantize, and the shards'
    sha256 on the writer's hashing thread) over the workers, then what the writer's own thread does
    beside it: the direct writes (it waits for each) and the tensors kept unchanged, read and checked
    there. The workers' reads of the Linear weights overlap the rest and are not counted. Measured
    against runs on the project's 2-CPU machine: docs/benchmarks.md ("Direct shard writes")."""
    per = p.quantize.seconds_per_element if p.quantize is not None else 0.0
    speed = est.write_bytes_per_second()
    kept = max(0, s.total_bytes - elements * s.act_bytes)
    return {
        f"quantize {elements:,} weight elements x {per * 1e9:.2f} ns (probe: {s.workers} at once, one thread "
        f"each) + sha256 of {output_bytes / 1e9:.2f} GB at {p.hash_rate / 1e9:.2f} GB/s (probe), over "
        f"{s.workers} workers": (elements * per + output_bytes / p.hash_rate) / s.workers,
        f"write {output_bytes / 1e9:.2f} GB at an assumed {speed / 1e9:.2f} GB/s": output_bytes / speed,
        f"read and check the {kept / 1e9:.2f} GB kept unchanged at an assumed "
        f"{est.KEPT_BYTES_PER_SECOND / 1e9:.1f} GB/s": kept / est.KEPT_BYTES_PER_SECOND,
    }  # fmt: skip


def _vocab(selection: Selection) -> int:
    rows = [o for n, (o, _) in selection.lw.linears.items() if n.endswith(("lm_head", "embed_out"))]
    return max(rows, default=0)


def _gptq_terms(selection: Selection, tokens: int, p: Probes) -> dict[str, float]:
    targets = selection.targets
    groups = input_groups(list(targets))
    # the Hessian's lower triangle by row blocks (gptq.HessianAccumulator): (B + 1) / 2B of the full product
    share = (HESSIAN_ROW_BLOCKS + 1) / (2 * HESSIAN_ROW_BLOCKS)
    hessian = sum(2.0 * share * tokens * targets[g[0]][1] ** 2 for g in groups) / p.gemm_rate
    records = sum(1.0 * o * i * i for o, i in targets.values()) / p.gemm_rate
    terms = {f"GPTQ Hessians: 2 x {share:g} x tokens x in^2 flops for {len(groups)} input groups": hessian,
             f"GPTQ error records: out x in^2 flops (round to nearest's triangular solve) for {len(targets)} "
             "Linears": records}  # fmt: skip
    if p.gptq is not None:
        solves = sum(p.gptq.seconds_for(o, i) for o, i in targets.values())
        terms[f"GPTQ solves: probe on {p.gptq.out_features} x {p.gptq.inputs} ({p.gptq.seconds:.2f} s), "
              "column loop x in x out/out_probe + gptq_flops at the GEMM rate"] = solves  # fmt: skip
    return terms


__all__ = ["Probes", "probes", "stage_seconds"]
