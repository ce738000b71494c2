"""`mixprec finetune`: fine-tune a model for a scheme (QAT) or adapters over its quantized form (LoRA), then
judge the result against the original and round to nearest on held-out text.

What `--model` may be, per mode:

| --model | qat | lora |
|---|---|---|
| an original (unquantized) model | masters from its weights; the original is the verdict's reference | quantized on the fly with `--scheme` (RTN), adapters over it |
| a quantized checkpoint (`load_quantized`) | masters from its dequantized weights (e.g. GPTQ-then-QAT); `--teacher` gives the reference | adapters over it; `--teacher` gives the reference |

`--teacher DIR` (the original model) turns on distillation: the loss is KL(teacher ‖ student), so what is
recovered is the original's behaviour, not the fine-tuning text. Without it the loss is next-token
cross-entropy on `--data`.

The output (written atomically): qat — the ordinary quantized checkpoint (save_quantized) plus
`finetune_report.json`; lora — the peft adapter (adapter_config.json, adapter_model.safetensors) plus the
report. The resumable training state lives in `.<output name>.finetune-state/` beside it until the run ends.
"""

from __future__ import annotations

import copy
import shutil
import time
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.distributed.fsdp import full_state_dict
from mixprec.distributed.prepare import STRATEGIES, DataParallel
from mixprec.distributed.world import barrier
from mixprec.errors import MixprecError
from mixprec.evaluation.models import load_dir
from mixprec.files import atomic_output_dir, check_new_output, write_json_atomic
from mixprec.finetune.data import split_held_out, text_windows
from mixprec.finetune.loop import LoopResult, LoopSettings, check_enough_data, train
from mixprec.finetune.lora import add_lora
from mixprec.finetune.qat import convert_qat_, prepare_qat_
from mixprec.finetune.verdict import recovery, score
from mixprec.hf import check_model_dir, load_tokenizer
from mixprec.inference.producers.save import save_quantized
from mixprec.inference.runtime.linear import QuantizedLinear
from mixprec.inference.runtime.online import apply_scheme_
from mixprec.inference.schemes import InferenceScheme
from mixprec.ranks import is_main_process, world_size
from mixprec.training.gradient_flow import check_gradient_flow

MODES = ("qat", "lora")
REPORT_NAME = "finetune_report.json"
SCHEMA_VERSION = 2  # 2: one verdict per held-out text (`verdicts`), `parallel`


@dataclass(frozen=True)
class FinetuneJob:
    model: Path
    scheme: str
    mode: str
    data: Path
    output: Path
    teacher: Path | None = None
    eval_data: tuple[Path, ...] = ()  # more held-out texts, each scored apart (e.g. another corpus)
    held_out: int = 16  # windows scored by the verdict
    seq_len: int = 256
    loop: LoopSettings = field(default_factory=LoopSettings)
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_targets: str = "all-linear"
    calib_samples: int = 16  # static input scales (fp8-static, nvfp4), from the training windows
    compare_gptq: bool = False
    margin: float = 0.01  # of the verdict against the original (perplexity change)
    resume: bool = False
    force: bool = False
    progress: bool = True
    data_parallel: str = "none"  # "ddp" or "fsdp2" under torchrun (mixprec.distributed.DataParallel)

    @cached_property
    def model_is_quantized(self) -> bool:
        """--model is a quantized checkpoint (its config says how), not an original model."""
        return bool(check_model_dir(self.model).get("quantization_config"))

    def calib_batches(self, windows: torch.Tensor) -> list[torch.Tensor]:
        """The first `calib_samples` training windows in batches of 4: static input scales and GPTQ."""
        return list(windows[: self.calib_samples].split(4))

    @property
    def state_dir(self) -> Path:
        return self.output.parent / f".{self.output.name}.finetune-state"

    def check(self) -> None:
        """Everything that can be checked before loading a model."""
        if self.mode not in MODES:
            raise MixprecError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        InferenceScheme.from_name(self.scheme)
        check_model_dir(self.model, role="--model")
        if self.teacher is not None:
            check_model_dir(self.teacher, role="--teacher")
        for flag, path in (("--data", self.data), *(("--eval-data", p) for p in self.eval_data)):
            if not Path(path).exists():
                raise MixprecError(f"{flag} {path} does not exist")
        self.loop.check()
        if self.lora_rank < 1:
            raise MixprecError(f"--lora-rank must be >= 1, got {self.lora_rank}")
        if self.data_parallel not in STRATEGIES:
            raise MixprecError(f"--dp must be one of {', '.join(STRATEGIES)}, got {self.data_parallel!r}")
        if not self.resume:
            check_new_output(self.output, self.force)
            if self.state_dir.exists() and not self.force:
                raise MixprecError(f"{self.state_dir} holds a fine-tuning run that did not finish: pass --resume "
                                   "to continue it or --force to start again")  # fmt: skip


def finetune(job: FinetuneJob) -> dict[str, Any]:
    """Run the job; returns the report written to output/finetune_report.json.

    Under torchrun every rank builds the same student and trains its share of each batch (job.data_parallel);
    rank 0 alone scores the verdict and writes the output."""
    job.check()
    if world_size() > 1 and job.data_parallel == "none":
        raise MixprecError(f"{world_size()} processes in torch.distributed: fine-tune with data_parallel "
                           "'ddp' or 'fsdp2' (every process would train alone and write the same output)")  # fmt: skip
    parallel = DataParallel(job.data_parallel if world_size() > 1 else "none")
    tokenizer = load_tokenizer(job.teacher if job.model_is_quantized and job.teacher else job.model)
    train_windows, held = _windows(job, tokenizer)
    check_enough_data(train_windows, job.loop)
    if job.force and not job.resume and job.state_dir.exists() and is_main_process():
        shutil.rmtree(job.state_dir)
    barrier()
    began = time.perf_counter()
    original = _original(job)
    student, start = _student(job, original, train_windows)
    flow = check_gradient_flow(student, train_windows[:1])
    flow.raise_if_broken()
    teacher = original if job.teacher is not None else None
    result = train(student, train_windows, job.loop, teacher=teacher, state_dir=job.state_dir, resume=job.resume,
                   progress=job.progress, parallel=parallel)  # fmt: skip
    whole = full_state_dict(student) if parallel.strategy == "fsdp2" else None  # every rank gathers
    report: dict[str, Any] = {}
    if is_main_process():
        if whole is not None:  # the trained model is sharded: rank 0 loads it into a fresh, whole student
            student, _ = _student(job, original, train_windows)
            student.load_state_dict(whole)
        served = _served(job, student)
        verdicts = _verdict(job, original, served, start, held, train_windows)
        seconds = time.perf_counter() - began
        report = _report(
            job, result, verdicts, flow.to_dict(), train_windows, held, seconds, parallel.strategy
        )
        with atomic_output_dir(job.output, force=True) as tmp:
            _save_result(job, served, tokenizer, tmp)
            write_json_atomic(tmp / REPORT_NAME, report)
        shutil.rmtree(job.state_dir, ignore_errors=True)
    barrier()
    return report


def _windows(job: FinetuneJob, tokenizer: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(training windows, {held-out text: its windows}): the last --held-out windows of --data, never trained
    on, then up to --held-out windows of each --eval-data text."""
    train_windows, tail = split_held_out(text_windows(job.data, tokenizer, job.seq_len), job.held_out)
    held = {f"{job.data} (last {tail.shape[0]} windows)": tail}
    for path in job.eval_data:
        windows = text_windows(path, tokenizer, job.seq_len, what="--eval-data", limit=job.held_out)
        if windows.shape[0] < 2:
            raise MixprecError(
                f"--eval-data {path}: {windows.shape[0]} window of {job.seq_len} tokens; need 2"
            )
        held[str(path)] = windows
    return train_windows, held


def _original(job: FinetuneJob) -> nn.Module | None:
    """The unquantized model: the verdict's reference and the distillation teacher (None when --model is
    quantized and no --teacher is given: the verdict then has no reference)."""
    source = job.teacher if job.teacher is not None else None if job.model_is_quantized else job.model
    if source is None:
        return None
    model = load_dir(source, "reference").model.float()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _student(
    job: FinetuneJob, original: nn.Module | None, windows: torch.Tensor
) -> tuple[nn.Module, nn.Module]:
    """(the model to train, its quantized starting point for the verdict)."""
    calib = job.calib_batches(windows)
    if job.model_is_quantized:
        start = load_dir(job.model, "candidate").model.float()
        _check_stored_scheme(job, start)
        base = _as_plain_linears(copy.deepcopy(start)) if job.mode == "qat" else copy.deepcopy(start)
    else:
        base = (
            copy.deepcopy(original)
            if original is not None
            else load_dir(job.model, "reference").model.float()
        )
        start = copy.deepcopy(base)
        apply_scheme_(start, job.scheme, calib_data=calib)
        if job.mode == "lora":
            base = copy.deepcopy(start)
    for p in base.parameters():
        p.requires_grad_(job.mode == "qat")
    if job.mode == "qat":
        prepare_qat_(base, job.scheme, calib_data=calib)
        return base, start
    # peft draws lora_A from torch's generator: the same adapters on every rank and in every run
    torch.manual_seed(job.loop.seed)
    return add_lora(base, r=job.lora_rank, lora_alpha=job.lora_alpha, target_modules=job.lora_targets), start


def _check_stored_scheme(job: FinetuneJob, model: nn.Module) -> None:
    """A quantized --model must hold --scheme: QAT would otherwise train for one format and start from
    another, and the verdict's "start" row would not be --scheme's RTN."""
    stored = sorted({m.scheme.name for m in model.modules() if isinstance(m, QuantizedLinear)})
    if stored != [InferenceScheme.from_name(job.scheme).name]:
        raise MixprecError(
            f"--model {job.model} holds {', '.join(stored) or 'no quantized Linear'}, not --scheme {job.scheme}: "
            "pass the scheme it holds, or the original model to quantize it with --scheme"
        )


def _as_plain_linears(model: nn.Module) -> nn.Module:
    """Every quantized Linear replaced by an nn.Linear of its exactly dequantized weight (QAT's masters)."""
    for name, m in list(model.named_modules()):
        if isinstance(m, QuantizedLinear):
            linear = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            linear.weight = nn.Parameter(m.dequantized_weight(torch.float32))
            if m.bias is not None:
                linear.bias = nn.Parameter(m.bias.detach().float())
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, linear)
    return model


def _verdict(
    job: FinetuneJob, original, served, start, held: dict[str, torch.Tensor], windows: torch.Tensor
) -> list[dict]:
    """One verdict per held-out text: the original, RTN (and GPTQ) and the result scored on its windows;
    none without an original to judge against."""
    if original is None:
        return []
    models = {f"{job.scheme} RTN" if not job.model_is_quantized else f"{job.model.name} (start)": start}
    if job.compare_gptq and not job.model_is_quantized:
        gptq = copy.deepcopy(original)
        apply_scheme_(gptq, job.scheme, calib_data=job.calib_batches(windows), algorithm="gptq")
        models[f"{job.scheme} GPTQ"] = gptq
    models[f"{job.scheme} {job.mode}"] = served
    verdicts = []
    for text, ids in held.items():
        rtn, *candidates = (score(name, model, ids) for name, model in models.items())
        verdicts.append(
            {"text": text, **recovery(score("original", original, ids), rtn, candidates, margin=job.margin)}
        )
    return verdicts


def _served(job: FinetuneJob, student: nn.Module) -> nn.Module:
    """What is served: QAT converted to the inference layers (in place; its eval logits are unchanged),
    LoRA with its adapters unmerged."""
    if job.mode == "qat":
        convert_qat_(student)
    return student


def _save_result(job: FinetuneJob, student: nn.Module, tokenizer: Any, into: Path) -> None:
    if job.mode == "qat":
        save_quantized(student, into / "checkpoint", tokenizer=tokenizer)
        for f in (into / "checkpoint").iterdir():
            f.rename(into / f.name)
        (into / "checkpoint").rmdir()
    else:
        student.save_pretrained(str(into))


def _report(job: FinetuneJob, result: LoopResult, verdicts: list[dict], flow: dict, train_windows: torch.Tensor,
            held: dict[str, torch.Tensor], seconds: float, strategy: str) -> dict[str, Any]:  # fmt: skip
    return {
        "schema_version": SCHEMA_VERSION,
        "mode": job.mode,
        "scheme": job.scheme,
        "model": str(job.model),
        "teacher": None if job.teacher is None else str(job.teacher),
        "data": {
            "train_windows": int(train_windows.shape[0]),
            "seq_len": job.seq_len,
            "held_out": {text: int(ids.shape[0]) for text, ids in held.items()},
        },
        "settings": asdict(job.loop),
        "gradient_flow": flow,
        "training": {**result.to_dict(), "loss": "distillation" if job.teacher is not None else "next-token"},
        "parallel": {"world_size": world_size(), "strategy": strategy},
        "verdicts": verdicts,
        "seconds": seconds,
    }
