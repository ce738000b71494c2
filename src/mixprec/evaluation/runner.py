"""`evaluate()`: run a reference and a candidate model on the same data and measure what changed."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.evaluation.gates import GATE_TASK, Gates, check_gates
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
from mixprec.evaluation.samples import embed_samples, read_documents
from mixprec.evaluation.tasks import run_embed, run_generate, run_lm
from mixprec.hf import has_tokenizer, lm_blocks, text_tokenizer, vocab_size
from mixprec.kernels.hardware import describe_machine, detect
from mixprec.progress import ProgressBars

TASKS = ("lm", "generate", "embed")
DEFAULT_SEQ_LEN = 128
DEFAULT_NEW_TOKENS = 32


def _tasks(task: str | Sequence[str] | None, kind: str, gates: Gates) -> list[str]:
    if task is None:
        chosen = ["lm"] if kind == "causal-lm" else ["embed"]
        # A gate names the figure it needs: run that task too rather than fail.
        chosen += sorted(t for t in gates.required_tasks() if t not in chosen)
    else:
        items = [task] if isinstance(task, str) else list(task)
        chosen = [t.strip().lower() for item in items for t in item.split(",") if t.strip()]
        for t in chosen:
            if t not in TASKS:
                raise MixprecError(f"unknown task {t!r}; known: {', '.join(TASKS)}")
        chosen = list(dict.fromkeys(chosen))
    if kind != "causal-lm" and any(t in ("lm", "generate") for t in chosen):
        raise MixprecError(
            f"tasks lm and generate need a causal language model; this one is an {kind} (use embed)"
        )
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
    dev = torch.device(device)
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
) -> EvaluationResult:
    """Compare `candidate` (a directory or module, or `candidate_scheme` applied to the reference) with
    `reference` on up to `samples` samples of `data`; returns every figure and the gate verdicts.

    Tasks: "lm" (default for causal LMs), "generate", "embed" (default for encoders); several may be
    given as a list or "lm,generate". `tokenizer`: a transformers tokenizer, else the reference
    directory's. Raises MixprecError on bad input (nothing measured yet).
    """
    started = time.perf_counter()
    gates = gates or Gates()
    warnings: list[str] = []
    if (candidate is None) == (candidate_scheme is None):
        raise MixprecError("give exactly one of a candidate model (--candidate) and --candidate-scheme")
    if int(samples) < 1:
        raise MixprecError(f"--samples must be at least 1, got {samples}")
    if int(seq_len) < 2:
        raise MixprecError(f"--seq-len must be at least 2, got {seq_len}")
    if batch_size < 1 or max_new_tokens < 1 or (prompt_len is not None and prompt_len < 1):
        raise MixprecError("--batch-size, --max-new-tokens and --prompt-len must be at least 1")
    if candidate_scheme is not None and candidate_scheme.strip().lower() not in CANDIDATE_SCHEMES:
        raise MixprecError(
            f"unknown --candidate-scheme {candidate_scheme!r}; known: {', '.join(CANDIDATE_SCHEMES)}"
        )
    docs, data_source = read_documents(data)  # empty data fails here, before any model is loaded
    dev = _device(device)

    ref = as_side(reference, "reference")
    tasks = _tasks(task, ref.kind, gates)
    tok = text_tokenizer(ref.directory, _vocab(ref.model), tokenizer)
    blocks = lm_blocks(docs, tok, seq_len, samples) if {"lm", "generate"} & set(tasks) else None
    if candidate is not None:
        cand = as_side(candidate, "candidate")
        cand_tok = None
        if cand.directory is not None and tokenizer is None and has_tokenizer(cand.directory):
            cand_tok = text_tokenizer(cand.directory, _vocab(cand.model)).vocab()
        check_compatible(ref, cand, tok.vocab(), cand_tok)
    else:
        calib = None
        if candidate_scheme.strip().lower() == "fp8-static":
            # Calibrate on the blocks after the evaluated ones when the data has them (no overlap).
            calib_blocks = lm_blocks(docs, tok, seq_len, samples + calib_samples)
            if calib_blocks.shape[0] > samples:
                calib_blocks = calib_blocks[samples:]
            else:
                warnings.append("fp8-static calibrated on the evaluation blocks (the data has no more text)")
                calib_blocks = calib_blocks[:calib_samples]
            calib = [calib_blocks[i : i + 1] for i in range(calib_blocks.shape[0])]
        cand = derive_candidate(ref, candidate_scheme, calib)

    for side in (ref, cand):
        side.model.to(dev)
        install_low_precision_hooks(side)
    reset_peak_cuda(dev)
    figures: dict[str, dict] = {}
    per_sample: dict[str, list] = {}
    with torch.inference_mode(), ProgressBars(progress) as bars:
        for name in tasks:
            advance = bars.add(f"evaluate {name}", total=_count(name, blocks, docs, samples)).advance
            if name == "lm":
                fig, tp, ps = run_lm(ref.model, cand.model, blocks, batch_size, dev, advance)
            elif name == "generate":
                plen = prompt_len or max(1, min(32, blocks.shape[1] // 2))
                fig, tp, ps = run_generate(
                    ref.model, cand.model, blocks[:, :plen], tok, max_new_tokens, batch_size, dev, advance
                )
            else:
                emb = embed_samples(docs, tok, seq_len, samples)
                fig, tp, ps = run_embed(ref.model, cand.model, emb, tok.pad_id, batch_size, dev, advance)
            fig["throughput"] = tp
            figures[name] = fig
            per_sample.update({f"{name}.{k}": v for k, v in ps.items()})

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
    gate_results = check_gates(gates, figures, memory, headline)
    n_used = {t: figures[t].get("samples", figures[t].get("prompts")) for t in figures}
    if "lm" in figures:
        n_used["lm"] = int(blocks.shape[0])
    if any(v is not None and v < samples for v in n_used.values()):
        warnings.append(f"the data gave fewer samples than the {samples} requested: {n_used}")
    if dev.type == "cpu" and candidate_scheme and candidate_scheme.startswith("fp8"):
        warnings.append("FP8 on CPU runs emulated: the speed figures say nothing about FP8 hardware")
    return EvaluationResult(
        reference=ref_desc,
        candidate=cand_desc,
        data={
            "source": data_source,
            "documents": len(docs),
            "samples_requested": int(samples),
            "samples_used": n_used,
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
        },
        warnings=warnings,
        per_sample=per_sample,
        seconds=time.perf_counter() - started,
    )


def _vocab(model: nn.Module) -> int:
    return vocab_size(model) or 0


def _count(name: str, blocks, docs: list[str], samples: int) -> int:
    if name in ("lm", "generate"):
        return int(blocks.shape[0])
    return min(samples, len(docs))


__all__ = ["TASKS", "evaluate", "write_report"]
