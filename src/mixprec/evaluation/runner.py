"""`evaluate()`: run a reference and a candidate model on the same data and measure what changed.

Order of work: every argument and input check (configs, data, sample counts) before any model is loaded;
then the models; then the tasks; then a confidence interval for every quality figure and the gates'
verdicts (mixprec.verdicts).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.evaluation.clip import image_processor, read_pairs, run_clip
from mixprec.evaluation.gates import GATE_TASK, Gates, check_gates
from mixprec.evaluation.inputs import (
    check_counts,
    check_same_architecture,
    check_seq_len,
    config_kind,
    max_positions,
    model_config,
)
from mixprec.evaluation.intervals import Bootstrap, task_intervals
from mixprec.evaluation.memory import peak_cuda_bytes, peak_rss_bytes, reset_peak_cuda
from mixprec.evaluation.models import (
    CANDIDATE_SCHEMES,
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
from mixprec.hf import has_tokenizer, lm_blocks, text_tokenizer, transformers_progress, vocab_size
from mixprec.kernels.hardware import describe_machine, detect
from mixprec.progress import ProgressBars

TASKS = ("lm", "generate", "embed", "clip")
DEFAULT_TASK = {"causal-lm": "lm", "encoder": "embed", "image-text": "clip"}
TASK_KINDS = {"lm": ("causal-lm",), "generate": ("causal-lm",), "embed": ("causal-lm", "encoder"),
              "clip": ("image-text",)}  # fmt: skip
DEFAULT_SEQ_LEN = 128
DEFAULT_NEW_TOKENS = 32


def _tasks(task: str | Sequence[str] | None, kind: str, gates: Gates) -> list[str]:
    if task is None:
        chosen = [DEFAULT_TASK[kind]]
        # A gate names the figure it needs: run that task too rather than fail.
        chosen += sorted(t for t in gates.required_tasks() if t not in chosen)
    else:
        items = [task] if isinstance(task, str) else list(task)
        chosen = [t.strip().lower() for item in items for t in item.split(",") if t.strip()]
        for t in chosen:
            if t not in TASKS:
                raise MixprecError(f"unknown task {t!r}; known: {', '.join(TASKS)}")
        chosen = list(dict.fromkeys(chosen))
    for t in chosen:
        if kind not in TASK_KINDS[t]:
            fits = ", ".join(k for k, kinds in TASK_KINDS.items() if kind in kinds)
            raise MixprecError(f"task {t} does not apply to this model: it is an {kind} model (use {fits})")
    for gate in gates.active():
        need = GATE_TASK.get(gate)
        if need is not None and need not in chosen:
            raise MixprecError(
                f"gate --{gate.replace('_', '-')} needs task {need!r}, which is not in --task {','.join(chosen)}"
            )
    return chosen


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise MixprecError(f"--device {device!r} is not a device (cpu, cuda, cuda:1)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MixprecError(f"device {device} requested but CUDA is not available")
    return dev


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
    }


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
) -> EvaluationResult:
    """Compare `candidate` (a directory or module, or `candidate_scheme` applied to the reference) with
    `reference` on `samples` samples of `data`; returns every figure, its confidence interval and the
    gate verdicts.

    Tasks: "lm" (default for causal LMs), "generate", "embed" (default for encoders), "clip" (default
    for image-text models); several may be given as a list or "lm,generate". Text samples: one per line
    of a .txt (`paragraphs=True`: per blank-line-separated paragraph), one per .jsonl record; fewer than
    `samples` is an error unless `allow_fewer`. `tokenizer`: a transformers tokenizer, else the reference
    directory's. `bootstrap`: level, resamples and seed of the intervals. `strict`: an inconclusive gate
    fails. Raises MixprecError on bad input, before any model is loaded.
    """
    started = time.perf_counter()
    gates = gates or Gates()
    bootstrap = bootstrap or Bootstrap()
    warnings: list[str] = []
    if (candidate is None) == (candidate_scheme is None):
        raise MixprecError("give exactly one of a candidate model (--candidate) and --candidate-scheme")
    check_counts(samples=samples, batch_size=batch_size, max_new_tokens=max_new_tokens, prompt_len=prompt_len,
                 calib_samples=calib_samples)  # fmt: skip
    if int(seq_len) < 2:
        raise MixprecError(f"--seq-len must be at least 2, got {seq_len}")
    bootstrap.check()
    scheme = candidate_scheme.strip().lower() if candidate_scheme is not None else None
    if scheme is not None and scheme not in CANDIDATE_SCHEMES:
        raise MixprecError(
            f"unknown --candidate-scheme {candidate_scheme!r}; known: {', '.join(CANDIDATE_SCHEMES)}"
        )
    dev = _device(device)

    # The models as configs: kind, architecture, positions — nothing loaded yet.
    ref_dir, ref_cfg = model_config(reference, "reference")
    ref_source = str(ref_dir) if ref_dir is not None else f"<{type(reference).__name__} object>"
    kind = config_kind(ref_cfg, reference if isinstance(reference, nn.Module) else None)
    cand_kind = kind
    if candidate is not None:
        cand_dir, cand_cfg = model_config(candidate, "candidate")
        cand_source = str(cand_dir) if cand_dir is not None else f"<{type(candidate).__name__} object>"
        check_same_architecture(ref_cfg, cand_cfg, ref_source, cand_source)
        cand_kind = config_kind(cand_cfg, candidate if isinstance(candidate, nn.Module) else None)
    tasks = _tasks(task, kind, gates)
    text_tasks = [t for t in tasks if t != "clip"]
    if "clip" in tasks and scheme == "fp8-static":
        raise MixprecError("--candidate-scheme fp8-static calibrates on text blocks; an image-text model needs "
                           "fp8-dynamic or fp8-block (or a checkpoint calibrated by `mixprec quantize`)")  # fmt: skip
    limit = max_positions(ref_cfg)
    if text_tasks:
        check_seq_len(int(seq_len), ref_cfg, ref_source)
    plen = prompt_len or max(1, min(32, int(seq_len) // 2))
    if "generate" in tasks and limit is not None and plen + max_new_tokens > limit:
        raise MixprecError(f"--prompt-len {plen} + --max-new-tokens {max_new_tokens} is longer than the "
                           f"{limit} positions of {ref_source}")  # fmt: skip

    # The data, tokenized and counted — still nothing loaded.
    model_vocab = vocab_size(reference) if isinstance(reference, nn.Module) else _config_vocab(ref_cfg)
    tok = text_tokenizer(ref_dir, model_vocab or 0, tokenizer)
    unit = "paragraph" if paragraphs else "line"
    inputs: dict[str, object] = {}
    used: dict[str, int] = {}
    data_source, documents = str(data), None
    if "lm" in tasks or scheme == "fp8-static":
        docs, data_source = read_documents(data)
        documents = len(docs)
    if "lm" in tasks:
        inputs["lm"] = lm_blocks(docs, tok, int(seq_len), samples)
        used["lm"] = int(inputs["lm"].shape[0])
        check_count("lm", used["lm"], samples, allow_fewer, f"blocks of {seq_len} tokens")
    if "generate" in tasks or "embed" in tasks:
        texts, data_source = read_documents(data, unit=unit)
        documents = len(texts)
        what = "paragraphs" if paragraphs else "texts (non-empty lines or records)"
        if "generate" in tasks:
            inputs["generate"] = prompt_samples(texts, tok, plen, samples)
            used["generate"] = len(inputs["generate"])
            check_count("generate", used["generate"], samples, allow_fewer, what)
        if "embed" in tasks:
            inputs["embed"] = embed_samples(texts, tok, int(seq_len), samples)
            used["embed"] = len(inputs["embed"])
            check_count("embed", used["embed"], samples, allow_fewer, what)
    if "clip" in tasks:
        pairs, data_source = read_pairs(data)
        documents = len(pairs)
        inputs["clip"] = pairs[:samples]
        used["clip"] = len(inputs["clip"])
        check_count("clip", used["clip"], samples, allow_fewer, "image-caption pairs")
    calib = None
    if scheme == "fp8-static":
        # Calibrate on the blocks after the evaluated ones when the data has them (no overlap).
        calib_blocks = lm_blocks(docs, tok, int(seq_len), samples + calib_samples)
        if calib_blocks.shape[0] > samples:
            calib_blocks = calib_blocks[samples:]
        else:
            warnings.append("fp8-static calibrated on the evaluation blocks (the data has no more text)")
            calib_blocks = calib_blocks[:calib_samples]
        calib = [calib_blocks[i : i + 1] for i in range(calib_blocks.shape[0])]

    with transformers_progress(progress):
        ref = as_side(reference, "reference")
        ref.kind = kind
        if candidate is not None:
            cand = as_side(candidate, "candidate")
            cand.kind = cand_kind
            cand_tok = None
            if cand.directory is not None and tokenizer is None and has_tokenizer(cand.directory):
                cand_tok = text_tokenizer(cand.directory, _vocab(cand.model)).vocab()
            check_compatible(ref, cand, tok.vocab(), cand_tok)
        else:
            cand = derive_candidate(ref, scheme, calib)
        processor = image_processor(ref.directory, ref.model) if "clip" in tasks else None

    for side in (ref, cand):
        side.model.to(dev)
        install_low_precision_hooks(side)
    reset_peak_cuda(dev)
    figures: dict[str, dict] = {}
    per_sample: dict[str, dict] = {}
    with torch.inference_mode(), ProgressBars(progress) as bars:
        for name in tasks:
            advance = bars.add(f"evaluate {name}", total=used[name]).advance
            if name == "lm":
                fig, tp, ps = run_lm(ref.model, cand.model, inputs["lm"], batch_size, dev, advance)
            elif name == "generate":
                fig, tp, ps = run_generate(
                    ref.model, cand.model, inputs["generate"], tok, max_new_tokens, batch_size, dev, advance
                )
            elif name == "embed":
                fig, tp, ps = run_embed(
                    ref.model, cand.model, inputs["embed"], tok.pad_id, batch_size, dev, advance
                )
            else:
                max_tokens = min(int(seq_len), limit) if limit else int(seq_len)
                fig, tp, ps = run_clip(ref.model, cand.model, inputs["clip"], processor, tok, max_tokens, batch_size,
                                       dev, advance)  # fmt: skip
            fig["throughput"] = tp
            figures[name] = fig
            per_sample[name] = ps
    intervals = {name: task_intervals(name, per_sample[name], bootstrap) for name in figures}
    for name, ivs in intervals.items():
        figures[name]["intervals"] = {k: None if v is None else v.to_dict() for k, v in ivs.items()}

    ref_desc, cand_desc = ref.describe(), cand.describe()
    for side in (ref, cand):  # a caller's module must not keep our hooks
        if side.hooks is not None:
            side.hooks.remove()
    rb, cb = ref_desc["weight_bytes_memory"], cand_desc["weight_bytes_memory"]
    rd, cd = ref_desc["weight_bytes_disk"], cand_desc["weight_bytes_disk"]
    memory = {
        "reference_weight_bytes_memory": rb,
        "candidate_weight_bytes_memory": cb,
        "weight_saving_bytes": rb - cb,
        "weight_saving_fraction": (rb - cb) / rb if rb else None,
        "reference_weight_bytes_disk": rd,
        "candidate_weight_bytes_disk": cd,
        "disk_saving_bytes": rd - cd if rd is not None and cd is not None else None,
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_cuda_bytes": peak_cuda_bytes(dev),
    }
    headline = dict(figures[tasks[0]]["throughput"])
    gate_results = check_gates(gates, figures, memory, headline, intervals, strict=strict)
    if any(v < samples for v in used.values()):
        warnings.append(f"--allow-fewer: the data gave fewer samples than the {samples} requested: {used}")
    emulated = not (dev.type == "cuda" and detect().fp8_native)
    fp8_sides = [w for w, s in (("reference", ref), ("candidate", cand)) if s.scheme and "fp8" in s.scheme]
    if emulated and fp8_sides:
        warnings.append(
            f"FP8 on {dev.type.upper()} runs emulated (no FP8 kernels on this device): the speed figures of the "
            f"{' and '.join(fp8_sides)} say nothing about FP8 hardware"
        )
    return EvaluationResult(
        reference=ref_desc,
        candidate=cand_desc,
        data={
            "source": data_source,
            "documents": documents,
            "unit": unit if {"embed", "generate"} & set(tasks) else None,
            "samples_requested": int(samples),
            "samples_used": used,
            "seq_len": int(seq_len),
            "tokenizer": tok.name,
        },
        tasks=figures,
        memory=memory,
        throughput=headline,
        machine=_machine(dev),
        gates=gate_results,
        settings={
            "tasks": tasks,
            "batch_size": batch_size,
            "max_new_tokens": max_new_tokens,
            "device": str(dev),
            "gates": gates.active(),
            "bootstrap": bootstrap.to_dict(),
            "strict": strict,
            "allow_fewer": allow_fewer,
        },
        warnings=warnings,
        per_sample={f"{t}.{k}": v for t, ps in per_sample.items() for k, v in ps.items()},
        seconds=time.perf_counter() - started,
    )


def _config_vocab(config: dict) -> int | None:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return text.get("vocab_size")


def _vocab(model: nn.Module) -> int:
    return vocab_size(model) or 0


__all__ = ["TASKS", "evaluate", "write_report"]
