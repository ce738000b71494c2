"""The fine-tuning loop: the one training step (`TrainingStep`) around a model whose trainable parameters
are QAT master weights or LoRA adapters, on windows of the user's text.

Batch k is a pure function of (windows, batch size, k, seed) (mixprec.data.batch_indices) and the learning
rate one of k, so a run resumed from its last saved state (`state_dir`, mixprec.distributed.checkpoint:
safetensors and JSON, never unpickled) continues with the numbers an uninterrupted run has. The loss is
next-token cross-entropy, or with a teacher (the original model) the distillation loss
`distillation_loss`: KL(teacher ‖ student) of the next-token distributions, so the target is the original
model's distribution and not the fine-tuning text (no credit for adapting to the text).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.data import batch_indices
from mixprec.distributed.checkpoint import load_checkpoint, read_manifest, save_checkpoint
from mixprec.distributed.prepare import DataParallel, unwrap
from mixprec.errors import MixprecError
from mixprec.finetune.qat import distillation_loss
from mixprec.monitor import PrecisionMonitor
from mixprec.progress import ProgressBars
from mixprec.ranks import is_main_process
from mixprec.training.optim import AdamW
from mixprec.training.step import TrainingStep

STATE_KIND = "mixprec-finetune-state"


@dataclass(frozen=True)
class LoopSettings:
    steps: int = 200
    batch_size: int = 4
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 10
    max_grad_norm: float | None = 1.0
    seed: int = 0
    save_every: int = 50  # steps between resumable states (state_dir only)
    temperature: float = 1.0  # of the distillation loss

    def check(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise MixprecError(
                f"steps and batch size must be positive, got {self.steps} and {self.batch_size}"
            )
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise MixprecError(f"the learning rate must be a positive number, got {self.lr}")
        if self.save_every < 1 or self.warmup_steps < 0 or self.temperature <= 0:
            raise MixprecError("save_every must be >= 1, warmup_steps >= 0 and temperature > 0")

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to a tenth of lr at the last step."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class LoopResult:
    losses: list[float] = field(default_factory=list)  # one per optimizer step, all steps (resumed ones too)
    skipped: list[int] = field(default_factory=list)  # steps skipped for a non-finite loss or gradient
    resumed_from: int | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def check_enough_data(windows: torch.Tensor, settings: LoopSettings) -> None:
    """Refuse a run whose steps would repeat the text (a fine-tune that memorises its data measures nothing)."""
    need = settings.steps * settings.batch_size
    if windows.shape[0] < need:
        raise MixprecError(
            f"the fine-tuning text gives {windows.shape[0]} windows of {windows.shape[1]} tokens; "
            f"{settings.steps} steps x batch {settings.batch_size} need {need}: give more text, fewer "
            "steps or a smaller batch"
        )


def train(
    model: nn.Module,
    windows: torch.Tensor,
    settings: LoopSettings,
    *,
    teacher: nn.Module | None = None,
    state_dir: Path | None = None,
    resume: bool = False,
    progress: bool = True,
    on_step: Callable[[int, float], None] | None = None,
    parallel: DataParallel | None = None,
) -> LoopResult:
    """Train `model`'s parameters that require a gradient on `windows` [n, seq_len] of token ids.

    parallel: data-parallel under torchrun (DataParallel("ddp") or ("fsdp2")): every rank holds the same
    model and windows, takes its contiguous share of each global batch of `batch_size` windows, and the
    logged loss is the mean over ranks, so the run computes what one process computes on the whole batch
    (to the order of the gradient reduction). Under FSDP2 `model` is left sharded: mixprec.distributed.fsdp.full_state_dict.
    """
    settings.check()
    check_enough_data(windows, settings)
    parallel = parallel if parallel is not None else DataParallel("none")
    wrapped = parallel.wrap(model)  # before the optimizer: FSDP2 replaces the parameters
    params = [p for p in wrapped.parameters() if p.requires_grad]
    if not params:
        raise MixprecError("the model has no trainable parameters (prepare it for QAT or add LoRA adapters)")
    optimizer = parallel.attach(wrapped, AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay))
    step = TrainingStep(model, optimizer, max_grad_norm=settings.max_grad_norm, parallel=parallel)
    monitor = PrecisionMonitor(model, every=10**9, optimizer=optimizer)
    result, start = LoopResult(), 0
    if resume and state_dir is not None and (state_dir / "manifest.json").exists():
        start, result = _restore(state_dir, wrapped, optimizer, settings)
    wrapped.train()
    if teacher is not None:
        teacher.eval()
    began = time.perf_counter()
    with ProgressBars(progress and is_main_process(), time_remaining=True) as bars:
        bar = bars.add("fine-tuning (steps)", settings.steps)
        bar.update(completed=start)
        for k in range(start, settings.steps):
            loss = _micro_step(wrapped, teacher, windows, settings, k, optimizer, parallel)
            step.accumulate(loss)
            health = monitor.check_step(loss)
            info = step.step(skip=not health.ok)  # every rank skips when one saw a non-finite value
            result.losses.append(parallel.mean(loss.detach()))
            if info.get("skipped"):
                result.skipped.append(k)
            if on_step is not None:
                on_step(k, result.losses[-1])
            bar.advance()
            if state_dir is not None and ((k + 1) % settings.save_every == 0 or k + 1 == settings.steps):
                _save(state_dir, wrapped, optimizer, settings, k + 1, result)
    result.seconds += time.perf_counter() - began
    unwrap(wrapped).eval()
    return result


def _micro_step(model, teacher, windows, settings: LoopSettings, k: int, optimizer, parallel) -> torch.Tensor:
    for group in optimizer.param_groups:
        group["lr"] = settings.lr_at(k)
    ids = parallel.shard(windows[batch_indices(windows.shape[0], settings.batch_size, k, settings.seed)])
    logits = model(ids).logits
    if teacher is None:
        return next_token_loss(logits, ids)
    with torch.no_grad():
        target = teacher(ids).logits
    return distillation_loss(logits, target, settings.temperature)


def _save(state_dir: Path, model, optimizer, settings: LoopSettings, done: int, result: LoopResult) -> None:
    extra = {"kind": STATE_KIND, "step": done, "settings": asdict(settings), "result": result.to_dict()}
    save_checkpoint(state_dir, model, optimizer, extra=extra, overwrite=True)


def _restore(state_dir: Path, model, optimizer, settings: LoopSettings) -> tuple[int, LoopResult]:
    extra = read_manifest(state_dir).get("extra") or {}
    if extra.get("kind") != STATE_KIND:
        raise MixprecError(f"{state_dir} is not a fine-tuning state (kind {extra.get('kind')!r})")
    saved = LoopSettings(**extra["settings"])
    changed = [k for k, v in asdict(settings).items() if asdict(saved)[k] != v]
    if changed:
        raise MixprecError(
            f"--resume: {state_dir} was saved with other settings ({', '.join(changed)}); "
            "resume with the same settings or start again with --force"
        )
    load_checkpoint(state_dir, model, optimizer)
    result = LoopResult(**extra["result"])
    result.resumed_from = int(extra["step"])
    return int(extra["step"]), result
