"""`evaluate()`: run a reference and a candidate model on the same data and measure what changed.

A pipeline of short steps over one frozen `EvaluationJob` (evaluation/job.py): every argument and input
check (configs, tasks, lengths) before any work; then the data, read and counted (still nothing loaded);
then the models; then the tasks; then a confidence interval for every quality figure; then the gates'
verdicts (mixprec.verdicts) and the result.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.evaluation.clip import image_processor, read_pairs, run_clip
from mixprec.evaluation.gates import Gates, check_gates
from mixprec.evaluation.intervals import Bootstrap, task_intervals
from mixprec.evaluation.job import DEFAULT_NEW_TOKENS, DEFAULT_SEQ_LEN, TASKS, EvaluationJob, evaluation_job
from mixprec.evaluation.memory import peak_cuda_bytes, peak_rss_bytes, reset_peak_cuda
from mixprec.evaluation.models import (
    Side,
    as_side,
    check_compatible,
    derive_candidate,
    install_low_precision_hooks,
)
from mixprec.evaluation.page import write_report
from mixprec.evaluation.result import EvaluationResult
from mixprec.evaluation.samples import (
    check_count,
    embed_samples,
    prompt_samples,
    read_documents,
)
from mixprec.evaluation.tasks import run_embed, run_generate, run_lm
from mixprec.hf import (
    Tokenizer,
    has_tokenizer,
    lm_blocks,
    text_tokenizer,
    transformers_progress,
    vocab_size,
)
from mixprec.inference.algorithms.spec import AlgorithmSpec
from mixprec.inference.runtime.linear import set_decoded_cache
from mixprec.kernels import emulation
from mixprec.kernels.hardware import describe_machine, detect
from mixprec.progress import ProgressBars


def evaluate(
    reference: str | os.PathLike | nn.Module,
    candidate: str | os.PathLike | nn.Module | None = None,
    *,
    candidate_scheme: str | None = None,
    data: str | os.PathLike,
    task: str | Sequence[str] | None = None,
    samples: int = 1000,
    seq_len: int = DEFAULT_SEQ_LEN,
    gates: Gates | None = None,
    device: str | torch.device | None = None,
    batch_size: int = 8,
    max_new_tokens: int = DEFAULT_NEW_TOKENS,
    prompt_len: int | None = None,
    calib_samples: int = 32,
    tokenizer=None,
    progress: bool = True,
    paragraphs: bool = False,
    allow_fewer: bool = False,
    bootstrap: Bootstrap | None = None,
    strict: bool = False,
    decoded_cache: bool = False,
    algorithm: str | Sequence[str] | AlgorithmSpec | None = None,
) -> EvaluationResult:
    """Compare `candidate` (a directory or module, or `candidate_scheme` applied to the reference) with
    `reference` on `samples` samples of `data`; returns every figure, its confidence interval and the
    gate verdicts.

    Tasks: "lm" (default for causal LMs), "generate", "embed" (default for encoders), "clip" (default
    for image-text models); several may be given as a list or "lm,generate". Text samples: one per line
    of a .txt (`paragraphs=True`: per blank-line-separated paragraph), one per .jsonl record; fewer than
    `samples` is an error unless `allow_fewer`. `tokenizer`: a transformers tokenizer, else the reference
    directory's. `bootstrap`: level, resamples and seed of the intervals. `strict`: an inconclusive gate
    fails. `decoded_cache`: the quantized Linears of a bf16 model keep their weights decoded to bf16
    after first use (the fast bf16 forward on CPUs with native bf16 GEMMs); the copies are counted in
    "weights in memory". False decodes per call: the throughput without that memory. `algorithm`
    (with candidate_scheme): what rounds the derived candidate's weights ("gptq": calibrated on
    `calib_samples` blocks of `data` after the evaluated ones), so a checkpoint's recipe is verified
    before it is written. Raises MixprecError on bad input, before any model is loaded.
    """
    started = time.perf_counter()
    job = evaluation_job(reference, candidate, candidate_scheme=candidate_scheme, data=data, task=task,
                         samples=samples, seq_len=seq_len, gates=gates, device=device, batch_size=batch_size,
                         max_new_tokens=max_new_tokens, prompt_len=prompt_len, calib_samples=calib_samples,
                         tokenizer=tokenizer, progress=progress, paragraphs=paragraphs, allow_fewer=allow_fewer,
                         bootstrap=bootstrap, strict=strict, decoded_cache=decoded_cache, algorithm=algorithm)  # fmt: skip
    inputs = _read_inputs(job)
    ref, cand, processor = _load_models(job, inputs)
    figures, per_sample = _run_tasks(job, ref, cand, inputs, processor)
    intervals = _add_intervals(figures, per_sample, job.bootstrap)
    ref_desc, cand_desc = _describe_and_unhook(ref, cand)
    memory = _memory(ref_desc, cand_desc, job.device)
    headline = dict(figures[job.tasks[0]]["throughput"])
    gate_results = check_gates(job.gates, figures, memory, headline, intervals, strict=job.strict)
    return EvaluationResult(
        reference=ref_desc,
        candidate=cand_desc,
        data=_data_section(job, inputs),
        tasks=figures,
        memory=memory,
        throughput=headline,
        machine=_machine(job.device),
        gates=gate_results,
        settings=_settings(job),
        warnings=inputs.warnings + _run_warnings(job, inputs.used, ref, cand),
        per_sample={f"{t}.{k}": v for t, ps in per_sample.items() for k, v in ps.items()},
        seconds=time.perf_counter() - started,
    )


@dataclass
class Inputs:
    """The data of every task, tokenized and counted before any model is loaded."""

    tokenizer: Tokenizer
    source: str  # the data path as read (documents, texts or pairs)
    samples: dict[str, Any] = field(default_factory=dict)  # task -> its samples
    used: dict[str, int] = field(default_factory=dict)  # task -> how many samples it runs
    documents: int | None = None
    calibration: list[torch.Tensor] | None = None  # fp8-static's calibration batches
    warnings: list[str] = field(default_factory=list)

    def add(self, task: str, samples: Any, job: EvaluationJob, what: str) -> None:
        self.samples[task] = samples
        self.used[task] = len(samples)
        check_count(task, self.used[task], job.samples, job.allow_fewer, what)


def _read_inputs(job: EvaluationJob) -> Inputs:
    """The data, tokenized and counted — still nothing loaded."""
    ref_cfg = job.models.config
    model_vocab = (
        vocab_size(job.reference) if isinstance(job.reference, nn.Module) else _config_vocab(ref_cfg)
    )
    inputs = Inputs(text_tokenizer(job.models.directory, model_vocab or 0, job.tokenizer), str(job.data))
    tok, seq_len, docs = inputs.tokenizer, int(job.seq_len), None
    if "lm" in job.tasks or job.calibrates:
        docs, inputs.source = read_documents(job.data)
        inputs.documents = len(docs)
    if "lm" in job.tasks:
        inputs.add("lm", lm_blocks(docs, tok, seq_len, job.samples), job, f"blocks of {job.seq_len} tokens")
    if "generate" in job.tasks or "embed" in job.tasks:
        texts, inputs.source = read_documents(job.data, unit=job.unit)
        inputs.documents = len(texts)
        what = "paragraphs" if job.paragraphs else "texts (non-empty lines or records)"
        if "generate" in job.tasks:
            inputs.add("generate", prompt_samples(texts, tok, job.prompt_len, job.samples), job, what)
        if "embed" in job.tasks:
            inputs.add("embed", embed_samples(texts, tok, seq_len, job.samples), job, what)
    if "clip" in job.tasks:
        pairs, inputs.source = read_pairs(job.data)
        inputs.documents = len(pairs)
        inputs.add("clip", pairs[: job.samples], job, "image-caption pairs")
    if job.calibrates:
        inputs.calibration = _calibration_batches(job, docs, tok, inputs.warnings)
    return inputs


def _calibration_batches(
    job: EvaluationJob, docs: list[str], tok: Tokenizer, warnings: list[str]
) -> list[torch.Tensor]:
    """The derived candidate's calibration (static schemes, an algorithm): the blocks after the evaluated
    ones when the data has them (no overlap)."""
    blocks = lm_blocks(docs, tok, int(job.seq_len), job.samples + job.calib_samples)
    if blocks.shape[0] > job.samples:
        blocks = blocks[job.samples :]
    else:
        warnings.append(f"{job.scheme} calibrated on the evaluation blocks (the data has no more text)")
        blocks = blocks[: job.calib_samples]
    return [blocks[i : i + 1] for i in range(blocks.shape[0])]


def _load_models(job: EvaluationJob, inputs: Inputs) -> tuple[Side, Side, Any]:
    """Both sides loaded (or the candidate derived from the reference), and CLIP's image processor."""
    with transformers_progress(job.progress):
        ref = as_side(job.reference, "reference")
        ref.kind = job.models.kind
        if job.candidate is not None:
            cand = as_side(job.candidate, "candidate")
            cand.kind = job.models.candidate_kind
            cand_tok = None
            if cand.directory is not None and job.tokenizer is None and has_tokenizer(cand.directory):
                cand_tok = text_tokenizer(cand.directory, _vocab(cand.model)).vocab()
            check_compatible(ref, cand, inputs.tokenizer.vocab(), cand_tok)
        else:
            cand = derive_candidate(ref, job.scheme, inputs.calibration, job.algorithm)
        processor = image_processor(ref.directory, ref.model) if "clip" in job.tasks else None
    for side in (ref, cand):
        if set_decoded_cache(side.model, job.decoded_cache):  # a model with quantized Linears
            side.info["decoded_weight_cache"] = job.decoded_cache
    return ref, cand, processor


def _run_tasks(
    job: EvaluationJob, ref: Side, cand: Side, inputs: Inputs, processor: Any
) -> tuple[dict[str, dict], dict[str, dict]]:
    """Every task on both models, on the job's device: ({task: figures}, {task: per-sample quantities})."""
    for side in (ref, cand):
        side.model.to(job.device)
        install_low_precision_hooks(side)
    reset_peak_cuda(job.device)
    figures: dict[str, dict] = {}
    per_sample: dict[str, dict] = {}
    with torch.inference_mode(), ProgressBars(job.progress) as bars:
        for name in job.tasks:
            advance = bars.add(f"evaluate {name}", total=inputs.used[name]).advance
            fig, tp, ps = _run_task(name, job, ref.model, cand.model, inputs, processor, advance)
            fig["throughput"] = tp
            figures[name] = fig
            per_sample[name] = ps
    return figures, per_sample


def _run_task(
    name: str,
    job: EvaluationJob,
    ref: nn.Module,
    cand: nn.Module,
    inputs: Inputs,
    processor: Any,
    advance: Callable[..., Any],
) -> tuple[dict, dict, dict]:
    samples, tok, batch_size, dev = inputs.samples[name], inputs.tokenizer, job.batch_size, job.device
    if name == "lm":
        return run_lm(ref, cand, samples, batch_size, dev, advance)
    if name == "generate":
        return run_generate(ref, cand, samples, tok, job.max_new_tokens, batch_size, dev, advance)
    if name == "embed":
        return run_embed(ref, cand, samples, tok.pad_id, batch_size, dev, advance)
    limit = job.models.limit
    max_tokens = min(int(job.seq_len), limit) if limit else int(job.seq_len)
    return run_clip(ref, cand, samples, processor, tok, max_tokens, batch_size, dev, advance)


def _add_intervals(figures: dict[str, dict], per_sample: dict[str, dict], bootstrap: Bootstrap) -> dict:
    """A confidence interval for every quality figure, also written into the task's figures."""
    intervals = {name: task_intervals(name, per_sample[name], bootstrap) for name in figures}
    for name, ivs in intervals.items():
        figures[name]["intervals"] = {k: None if v is None else v.to_dict() for k, v in ivs.items()}
    return intervals


def _describe_and_unhook(ref: Side, cand: Side) -> tuple[dict, dict]:
    """What each side is (before its hooks go), then the hooks removed: a caller's module must not keep them."""
    descriptions = ref.describe(), cand.describe()
    for side in (ref, cand):
        if side.hooks is not None:
            side.hooks.remove()
    return descriptions


def _memory(ref_desc: dict, cand_desc: dict, device: torch.device) -> dict:
    rb, cb = ref_desc["weight_bytes_memory"], cand_desc["weight_bytes_memory"]
    rd, cd = ref_desc["weight_bytes_disk"], cand_desc["weight_bytes_disk"]
    return {
        "reference_weight_bytes_memory": rb,
        "candidate_weight_bytes_memory": cb,
        "weight_saving_bytes": rb - cb,
        "weight_saving_fraction": (rb - cb) / rb if rb else None,
        "reference_weight_bytes_disk": rd,
        "candidate_weight_bytes_disk": cd,
        "disk_saving_bytes": rd - cd if rd is not None and cd is not None else None,
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_cuda_bytes": peak_cuda_bytes(device),
    }


def _run_warnings(job: EvaluationJob, used: dict[str, int], ref: Side, cand: Side) -> list[str]:
    """What the reader of the figures must know about this run: fewer samples, emulated FP8."""
    warnings = []
    if any(v < job.samples for v in used.values()):
        warnings.append(
            f"--allow-fewer: the data gave fewer samples than the {job.samples} requested: {used}"
        )
    emulated = not (job.device.type == "cuda" and detect().fp8_native)
    fp8_sides = [w for w, s in (("reference", ref), ("candidate", cand)) if s.scheme and "fp8" in s.scheme]
    if emulated and fp8_sides:
        warnings.append(
            f"FP8 on {job.device.type.upper()} runs emulated (no FP8 kernels on this device): the speed "
            f"figures of the {' and '.join(fp8_sides)} say nothing about FP8 hardware"
        )
    return warnings


def _data_section(job: EvaluationJob, inputs: Inputs) -> dict:
    return {
        "source": inputs.source,
        "documents": inputs.documents,
        "unit": job.unit if {"embed", "generate"} & set(job.tasks) else None,
        "samples_requested": int(job.samples),
        "samples_used": inputs.used,
        "seq_len": int(job.seq_len),
        "tokenizer": inputs.tokenizer.name,
    }


def _settings(job: EvaluationJob) -> dict:
    return {
        "tasks": job.tasks,
        "batch_size": job.batch_size,
        "max_new_tokens": job.max_new_tokens,
        "device": str(job.device),
        "gates": job.gates.active(),
        "bootstrap": job.bootstrap.to_dict(),
        "strict": job.strict,
        "decoded_cache": job.decoded_cache,
        "allow_fewer": job.allow_fewer,
    }


def _machine(device: torch.device) -> dict:
    caps = detect()
    return {
        "description": describe_machine(caps),
        "device": str(device),
        "cpu": caps.cpu_model,
        "cpu_threads": torch.get_num_threads(),
        "cuda_device": caps.cuda_device,
        "torch": caps.torch_version,
        "fp8_native": caps.fp8_native,
        "gemm_emulation": emulation.describe(device),
    }


def _config_vocab(config: dict) -> int | None:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return text.get("vocab_size")


def _vocab(model: nn.Module) -> int:
    return vocab_size(model) or 0


__all__ = ["TASKS", "evaluate", "write_report"]
