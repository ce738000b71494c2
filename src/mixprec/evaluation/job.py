"""What one `evaluate()` call is asked to do, checked before any work: the frozen `EvaluationJob`.

`evaluation_job` takes evaluate's arguments and runs every argument check and every config check (the
models' kinds, architectures and positions, the tasks that fit them, the gates' tasks) without loading
a model or reading the data; the steps of evaluation/runner.py then read only the job.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.evaluation.gates import GATE_TASK, Gates
from mixprec.evaluation.inputs import (
    check_counts,
    check_same_architecture,
    check_seq_len,
    config_kind,
    max_positions,
    model_config,
)
from mixprec.evaluation.intervals import Bootstrap
from mixprec.evaluation.models import CANDIDATE_SCHEMES
from mixprec.inference.algorithms.spec import AlgorithmSpec
from mixprec.inference.schemes import InferenceScheme

TASKS = ("lm", "generate", "embed", "clip")
DEFAULT_TASK = {"causal-lm": "lm", "encoder": "embed", "image-text": "clip"}
TASK_KINDS = {"lm": ("causal-lm",), "generate": ("causal-lm",), "embed": ("causal-lm", "encoder"),
              "clip": ("image-text",)}  # fmt: skip
DEFAULT_SEQ_LEN = 128
DEFAULT_NEW_TOKENS = 32


@dataclass(frozen=True)
class ModelConfigs:
    """The reference's config (and the candidate's kind) as read before anything is loaded."""

    directory: Path | None  # the reference's directory; None for a module
    config: dict  # the reference's config.json (or its module's config)
    source: str  # how messages name the reference
    kind: str  # "causal-lm", "encoder" or "image-text"
    candidate_kind: str  # the candidate's kind (the reference's when the candidate is derived from it)
    limit: int | None  # the longest token sequence the reference takes, when its config says


@dataclass(frozen=True)
class EvaluationJob:
    """One evaluation, every argument checked: the models (not loaded), the data's path, the tasks and the
    settings. `scheme` is the normalized --candidate-scheme (None with a candidate model)."""

    reference: str | os.PathLike | nn.Module
    candidate: str | os.PathLike | nn.Module | None
    scheme: str | None
    models: ModelConfigs
    data: str | os.PathLike
    tasks: list[str]
    samples: int
    seq_len: Any  # as given (messages quote it); int(seq_len) is the length used
    prompt_len: int  # resolved: the given --prompt-len, else half of seq_len up to 32
    max_new_tokens: int
    calib_samples: int
    batch_size: int
    gates: Gates
    bootstrap: Bootstrap
    device: torch.device
    tokenizer: Any
    progress: bool
    paragraphs: bool
    allow_fewer: bool
    strict: bool
    decoded_cache: bool = False  # quantized Linears keep their bf16-decoded weights (counted as memory)
    algorithm: AlgorithmSpec = field(default_factory=AlgorithmSpec)  # what rounds a derived candidate

    @property
    def calibrates(self) -> bool:
        """The derived candidate needs calibration blocks (a static scheme, or an algorithm)."""
        if self.scheme is None or self.scheme == "bf16":
            return False
        return InferenceScheme.from_name(self.scheme).needs_calibration or self.algorithm.needs_data

    @property
    def unit(self) -> str:
        """What one text sample is."""
        return "paragraph" if self.paragraphs else "line"


def evaluation_job(
    reference: str | os.PathLike | nn.Module,
    candidate: str | os.PathLike | nn.Module | None,
    *,
    candidate_scheme: str | None,
    data: str | os.PathLike,
    task: str | Sequence[str] | None,
    samples: int,
    seq_len: int,
    gates: Gates | None,
    device: str | torch.device | None,
    batch_size: int,
    max_new_tokens: int,
    prompt_len: int | None,
    calib_samples: int,
    tokenizer: Any,
    progress: bool,
    paragraphs: bool,
    allow_fewer: bool,
    bootstrap: Bootstrap | None,
    strict: bool,
    decoded_cache: bool = False,
    algorithm: str | Sequence[str] | AlgorithmSpec | None = None,
) -> EvaluationJob:
    """evaluate()'s arguments checked (MixprecError on the first problem) and its models' configs read."""
    gates = gates or Gates()
    bootstrap = bootstrap or Bootstrap()
    if (candidate is None) == (candidate_scheme is None):
        raise MixprecError("give exactly one of a candidate model (--candidate) and --candidate-scheme")
    check_counts(samples=samples, batch_size=batch_size, max_new_tokens=max_new_tokens, prompt_len=prompt_len,
                 calib_samples=calib_samples)  # fmt: skip
    if int(seq_len) < 2:
        raise MixprecError(f"--seq-len must be at least 2, got {seq_len}")
    bootstrap.check()
    scheme = _scheme(candidate_scheme)
    spec = AlgorithmSpec.parse(algorithm)
    if spec.names and scheme in (None, "bf16"):
        raise MixprecError(
            f"--algorithm {spec.label} rounds a candidate derived with --candidate-scheme (an FP8 or FP4 scheme); "
            "a candidate checkpoint was rounded when it was written"
        )
    if spec.names:
        spec.check_scheme(InferenceScheme.from_name(scheme))  # e.g. smoothquant on a weight-only scheme
    dev = _device(device)
    models = _model_configs(reference, candidate)
    tasks = _tasks(task, models.kind, gates)
    plen = _check_lengths(tasks, scheme, models, seq_len, prompt_len, max_new_tokens, spec)
    return EvaluationJob(
        reference=reference, candidate=candidate, scheme=scheme, models=models, data=data, tasks=tasks,
        samples=samples, seq_len=seq_len, prompt_len=plen, max_new_tokens=max_new_tokens,
        calib_samples=calib_samples, batch_size=batch_size, gates=gates, bootstrap=bootstrap, device=dev,
        tokenizer=tokenizer, progress=progress, paragraphs=paragraphs, allow_fewer=allow_fewer, strict=strict,
        decoded_cache=bool(decoded_cache), algorithm=spec,
    )  # fmt: skip


def _scheme(candidate_scheme: str | None) -> str | None:
    scheme = candidate_scheme.strip().lower() if candidate_scheme is not None else None
    if scheme is not None and scheme not in CANDIDATE_SCHEMES:
        raise MixprecError(
            f"unknown --candidate-scheme {candidate_scheme!r}; known: {', '.join(CANDIDATE_SCHEMES)}"
        )
    return scheme


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


def _model_configs(
    reference: str | os.PathLike | nn.Module, candidate: str | os.PathLike | nn.Module | None
) -> ModelConfigs:
    """The models as configs: kind, architecture, positions — nothing loaded yet."""
    ref_dir, ref_cfg = model_config(reference, "reference")
    ref_source = str(ref_dir) if ref_dir is not None else f"<{type(reference).__name__} object>"
    kind = config_kind(ref_cfg, reference if isinstance(reference, nn.Module) else None)
    cand_kind = kind
    if candidate is not None:
        cand_dir, cand_cfg = model_config(candidate, "candidate")
        cand_source = str(cand_dir) if cand_dir is not None else f"<{type(candidate).__name__} object>"
        check_same_architecture(ref_cfg, cand_cfg, ref_source, cand_source)
        cand_kind = config_kind(cand_cfg, candidate if isinstance(candidate, nn.Module) else None)
    return ModelConfigs(ref_dir, ref_cfg, ref_source, kind, cand_kind, max_positions(ref_cfg))


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


def _check_lengths(
    tasks: list[str],
    scheme: str | None,
    models: ModelConfigs,
    seq_len: int,
    prompt_len: int | None,
    max_new_tokens: int,
    algorithm: AlgorithmSpec,
) -> int:
    """The tasks' lengths against the reference's positions; returns the prompt length of "generate"."""
    static = scheme not in (None, "bf16") and InferenceScheme.from_name(scheme).needs_calibration
    if "clip" in tasks and (static or algorithm.needs_data):
        raise MixprecError(f"--candidate-scheme {scheme}{' --algorithm ' + algorithm.label if algorithm.names else ''} "
                           "calibrates on text blocks; an image-text model needs a dynamic scheme (fp8-dynamic, "
                           "fp8-block, nvfp4a16, ...) or a checkpoint calibrated by `mixprec quantize`")  # fmt: skip
    if any(t != "clip" for t in tasks):
        check_seq_len(int(seq_len), models.config, models.source)
    plen = prompt_len or max(1, min(32, int(seq_len) // 2))
    limit = models.limit
    if "generate" in tasks and limit is not None and plen + max_new_tokens > limit:
        raise MixprecError(f"--prompt-len {plen} + --max-new-tokens {max_new_tokens} is longer than the "
                           f"{limit} positions of {models.source}")  # fmt: skip
    return plen
