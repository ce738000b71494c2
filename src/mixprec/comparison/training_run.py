"""One training run of a comparison: a clean function a distributed launcher can wrap.

    result = train_run(spec, base_model, data, checkpoint_path=..., on_step=...)

The run converts a copy of the base model (same initial weights for every recipe), trains it with
mixprec.AdamW (fp32 master weights, bf16 moments for bf16 parameters), takes batch `s` from the
deterministic data order (a function of the order seed and the step only), evaluates the held-out loss
every `eval_every` steps, runs the PrecisionMonitor, skips steps with NaN/inf, advances the FP8 scaling
state once per optimizer step and checkpoints so that a resumed run continues bit-identically. Each step
is mixprec.training.TrainingStep's (clipping, loss scaling, the optimizer step, the scaling advance):
this module sets up, checks, records, evaluates and checkpoints around it.

Under torch.distributed (only if a process group is initialized) each rank takes its contiguous slice of
every batch (DataParallel.shard, the one sharding rule); the logged loss is the mean over ranks; a NaN/inf
seen by one rank makes every rank skip the step; delayed scaling reduces its amaxes over the ranks.
Wrapping the model (DDP / FSDP2) is the caller's: pass `prepare=` (called on the converted model, returns
the model to train); the optimizer is built AFTER it, on the wrapped model's parameters (FSDP2 replaces
them by DTensor shards), and `prepare.attach(model, optimizer)` connects the two when `prepare` has it
(mixprec.distributed.DataParallel does). With more than one rank the checkpoint is a directory written
by every rank (mixprec.distributed.checkpoint: each rank's shard), so every rank resumes from its own.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from mixprec import ranks
from mixprec.data import TokenizedData, train_batch
from mixprec.distributed.checkpoint import load_checkpoint as load_shards
from mixprec.distributed.checkpoint import save_checkpoint
from mixprec.distributed.prepare import DataParallel
from mixprec.errors import MixprecError
from mixprec.files import atomic_file
from mixprec.models import lm_loss
from mixprec.monitor import PrecisionMonitor, StepHealth
from mixprec.recipes import from_name
from mixprec.training import TrainingStep, convert_for_training
from mixprec.training.optim import AdamW
from mixprec.training.policy import Policy

CHECKPOINT_FORMAT = 1


@dataclass(frozen=True)
class RunSpec:
    """What one run trains: `name` is unique in a comparison ("bf16", or "bf16~reorder" for a noise run)."""

    name: str
    recipe: str
    order_seed: int
    steps: int
    batch_size: int
    lr: float
    warmup: int
    eval_every: int
    monitor_every: int
    checkpoint_every: int
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    monitor: bool = True
    device: str = "cpu"
    # a null run: the initial weights moved by one unit in the last place (of the recipe's own weight
    # format) at random positions drawn from this seed, before conversion; None: the weights as given
    perturb_seed: int | None = None
    # the training policy (mixprec.training.Policy) the recipe converts with; None: the default policy
    policy: Policy | None = None


@dataclass
class RunResult:
    name: str
    recipe: str
    records: list[dict]  # step / eval / precision / nan_event rows, in order
    model: nn.Module | None = field(default=None, repr=False)
    seconds_per_step: float = float("nan")  # wall time of training steps (not evaluation), this session
    conversion: list[dict] = field(default_factory=list)  # which modules got which precision
    resumed_from: int = 0


def lr_at(step: int, spec: RunSpec) -> float:
    """Linear warmup to lr, then cosine decay to 10 % of lr at the last step (step is 1-based)."""
    if spec.warmup and step <= spec.warmup:
        return spec.lr * step / spec.warmup
    span = max(1, spec.steps - spec.warmup)
    progress = min(1.0, (step - spec.warmup) / span)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate_loss(model: nn.Module, val: torch.Tensor, batch_size: int) -> float:
    """Mean next-token loss over the held-out blocks (each block weighs the same)."""
    was_training = model.training
    # evaluation must not touch training state: delayed-scaling layers record the amax of every forward
    saved = {name: b.clone() for name, b in model.named_buffers()}
    model.eval()
    total, n = 0.0, 0
    device = next(model.parameters()).device
    for i in range(0, val.shape[0], batch_size):
        chunk = val[i : i + batch_size].to(device)
        total += float(lm_loss(model, chunk)) * chunk.shape[0]
        n += chunk.shape[0]
    model.train(was_training)
    for name, b in model.named_buffers():
        b.copy_(saved[name])
    return total / max(n, 1)


# share of weight elements a null run moves by one ulp (each up or down at random)
PERTURBED_SHARE = 0.5


@torch.no_grad()
def perturb_weights(model: nn.Module, seed: int, ulp_dtype: torch.dtype) -> None:
    """Move PERTURBED_SHARE of every parameter's non-zero elements by one ulp of `ulp_dtype`, up or down.

    A rounding-level perturbation: the initial weights could as well have been rounded the other way,
    so a run from these weights is as good as the original; how far the two runs drift apart is the
    yardstick a precision change is read against. The same seed moves the same elements the same way.
    """
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        w = p.data
        if not w.is_floating_point() or w.numel() == 0:
            continue
        chosen = torch.rand(w.shape, generator=generator) < PERTURBED_SHARE
        upward = torch.rand(w.shape, generator=generator) < 0.5
        wf = w.detach().float().cpu()
        rounded = wf.to(ulp_dtype)  # the weight as that format holds it; its neighbours are one ulp away
        up = torch.nextafter(rounded, torch.full_like(rounded, math.inf)).float()
        down = torch.nextafter(rounded, torch.full_like(rounded, -math.inf)).float()
        moved = torch.where(chosen & (wf != 0), torch.where(upward, up, down), wf)
        w.copy_(moved.to(device=w.device, dtype=w.dtype))


def ulp_dtype_of(recipe: str) -> torch.dtype:
    """The weight format whose rounding a null run of `recipe` perturbs: fp32 for fp32, else bf16."""
    return torch.float32 if from_name(recipe).kind == "fp32" else torch.bfloat16


def _convert(model: nn.Module, recipe: str, policy: Policy | None = None) -> list[dict]:
    report = convert_for_training(model, recipe, policy)
    entries = getattr(report, "entries", [])
    return [
        {"module": e.name, "precision": e.precision, "reason": e.reason}
        for e in entries
        if getattr(e, "precision", "-") != "-"
    ]


def _save_checkpoint(path: Path, step: int, model, optimizer, scaler, records: list[dict]) -> None:
    payload = {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else {},
        "records": json.dumps(records),  # a string: loads under weights_only=True
    }
    with atomic_file(path) as tmp:
        torch.save(payload, tmp)


def load_checkpoint(path: Path) -> dict:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt or foreign file: the user's to fix, named here
        raise MixprecError(f"cannot read checkpoint {path}: {exc}") from None
    if payload.get("format") != CHECKPOINT_FORMAT:
        raise MixprecError(f"checkpoint {path} has an unknown format")
    return payload


def distributed_checkpoint_path(path: Path) -> Path:
    """The directory a multi-rank run checkpoints into, beside the single-process file `path`."""
    return path.with_suffix(".dist")


def _save_distributed(path: Path, step: int, model, optimizer, scaler, records: list[dict]) -> None:
    extra = {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "scaler": scaler.state_dict() if scaler is not None else {},
        "records": json.dumps(records),  # rank 0's records: the ones written to metrics.jsonl
    }
    save_checkpoint(path, model, optimizer, extra=extra, overwrite=True)


def _load_distributed(path: Path, model, optimizer, scaler) -> tuple[int, list[dict]]:
    extra = load_shards(path, model, optimizer)
    if extra.get("format") != CHECKPOINT_FORMAT:
        raise MixprecError(f"checkpoint {path} has an unknown format")
    if scaler is not None and extra["scaler"]:
        scaler.load_state_dict(extra["scaler"])
    return int(extra["step"]), json.loads(extra["records"])


@dataclass
class _Run:
    """What one run trains with: the converted model, what the forward runs (the wrapping DDP / FSDP2
    made of it, or the model), the optimizer, the training step and the data-parallel object it uses."""

    model: nn.Module
    train_model: nn.Module
    optimizer: AdamW
    step: TrainingStep
    parallel: DataParallel
    conversion: list[dict]


def _set_up(spec: RunSpec, base_model: nn.Module, prepare: Callable | None) -> _Run:
    """Copy, perturb (null runs), convert, wrap, THEN build the optimizer (FSDP2 replaces every
    parameter by a DTensor shard) and the training step around it."""
    model = copy.deepcopy(base_model).to(spec.device)
    if spec.perturb_seed is not None:
        perturb_weights(model, spec.perturb_seed, ulp_dtype_of(spec.recipe))
    conversion = _convert(model, spec.recipe, spec.policy)
    train_model = prepare(model) if prepare is not None else model
    optimizer = AdamW(train_model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    attach = getattr(prepare, "attach", None)
    if attach is not None:
        attach(train_model, optimizer)  # DDP's fp32 gradient hook / FSDP2's DTensor moment rounding
    train_model.train()
    # a prepare= that is no DataParallel wraps only: ranks, skips and amaxes then agree over the default
    # group (DataParallel "none" wraps nothing and works in one process as under torchrun)
    parallel = prepare if isinstance(prepare, DataParallel) else DataParallel("none")
    # fp16-amp: TrainingStep builds the recipe's GradScaler (make_grad_scaler); others have none
    step = TrainingStep(model, optimizer, max_grad_norm=spec.max_grad_norm, parallel=parallel)
    return _Run(model, train_model, optimizer, step, parallel, conversion)


def _checkpoint_location(checkpoint_path: str | os.PathLike | None) -> Path | None:
    """<run>.pt in one process; with more than one rank the directory of per-rank shards <run>.dist."""
    if checkpoint_path is None:
        return None
    ckpt = Path(checkpoint_path)
    return distributed_checkpoint_path(ckpt) if ranks.world_size() > 1 else ckpt


def _resume(run: _Run, ckpt: Path | None) -> tuple[int, list[dict]]:
    """The step a checkpoint left off at and the records up to it (0 and none without a checkpoint)."""
    if ckpt is None or not ckpt.exists():
        return 0, []
    scaler = run.step.scaler
    if ranks.world_size() > 1:
        return _load_distributed(ckpt, run.train_model, run.optimizer, scaler)
    payload = load_checkpoint(ckpt)
    run.model.load_state_dict(payload["model"])
    run.optimizer.load_state_dict(payload["optimizer"])
    if scaler is not None and payload["scaler"]:
        scaler.load_state_dict(payload["scaler"])
    return int(payload["step"]), json.loads(payload["records"])


def _checkpoint(run: _Run, spec: RunSpec, ckpt: Path | None, step: int, records: list[dict]) -> None:
    if ckpt is None or not (step % spec.checkpoint_every == 0 or step == spec.steps):
        return
    if ranks.world_size() > 1:  # collective: every rank writes its own shard
        _save_distributed(ckpt, step, run.train_model, run.optimizer, run.step.scaler, records)
    else:
        _save_checkpoint(ckpt, step, run.model, run.optimizer, run.step.scaler, records)


def _monitor(run: _Run, spec: RunSpec) -> PrecisionMonitor:
    # under loss scaling the gradients are scaled (and may overflow by design): the scaler judges them
    monitor = PrecisionMonitor(
        run.model, every=spec.monitor_every, optimizer=run.optimizer, check_gradients=run.step.scaler is None
    )
    if not spec.monitor:
        monitor.layers = {}
    return monitor


@dataclass
class _StepOutcome:
    loss: torch.Tensor
    info: dict  # TrainingStep.step's: grad_norm, skipped (loss scaling: loss_scale)
    health: StepHealth  # PrecisionMonitor.check_step's verdict on this rank
    precision: list[dict]  # the monitor's rows of this step


def _train_step(
    run: _Run, monitor: PrecisionMonitor, spec: RunSpec, data: TokenizedData, step: int
) -> _StepOutcome:
    """One optimizer step on batch `step` of the data order (this rank's share of it).

    A NaN/inf the monitor sees in the loss or gradients skips the step (on every rank: the training
    step agrees over them); fp16-amp's scaler may skip it too. The FP8 scaling state advances once per
    step, skipped or not (its guards keep the previous scale when a skipped step saw amax inf/NaN).
    """
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(step, spec)
    batch = run.step.shard(train_batch(data, spec.batch_size, step - 1, spec.order_seed)).to(spec.device)
    monitor.begin_step(step)
    loss = lm_loss(run.train_model, batch)
    run.step.accumulate(loss)
    health = monitor.check_step(loss)
    info = run.step.step(skip=not health.ok)
    return _StepOutcome(loss, info, health, monitor.end_step())


def _step_records(run: _Run, spec: RunSpec, step: int, outcome: _StepOutcome) -> list[dict]:
    """The step row (the loss as the mean over ranks), the monitor's precision rows, a NaN event."""
    loss = run.parallel.mean(outcome.loss.detach().float())
    rows = [{"kind": "step", "run": spec.name, "step": step, "loss": loss, "lr": lr_at(step, spec),
             "grad_norm": outcome.info.get("grad_norm"), "skipped": outcome.info.get("skipped", False)}]  # fmt: skip
    rows.extend({"kind": "precision", "run": spec.name, **r} for r in outcome.precision)
    if not outcome.health.ok:
        bad = outcome.health.first_bad
        rows.append({"kind": "nan_event", "run": spec.name, "step": step, "layer": bad.layer,
                     "tensor": bad.tensor, "type": bad.kind})  # fmt: skip
    return rows


def _evaluation(run: _Run, spec: RunSpec, data: TokenizedData, step: int) -> list[dict]:
    """The held-out loss row at step 0, every `eval_every` steps and at the last step."""
    if step and step % spec.eval_every and step != spec.steps:
        return []
    val = evaluate_loss(run.model, data.val, spec.batch_size)
    return [{"kind": "eval", "run": spec.name, "step": step, "val_loss": val}]


def train_run(
    spec: RunSpec,
    base_model: nn.Module,
    data: TokenizedData,
    *,
    checkpoint_path: str | os.PathLike | None = None,
    on_step: Callable[[str, int], None] | None = None,
    prepare: Callable[[nn.Module], nn.Module] | None = None,
    stop_after: int | None = None,
) -> RunResult:
    """Train one recipe from a copy of `base_model`; resumes from `checkpoint_path` if it exists.

    stop_after: stop (as if interrupted) after this many steps, leaving the checkpoint — for tests.
    """
    run = _set_up(spec, base_model, prepare)
    ckpt = _checkpoint_location(checkpoint_path)
    start, records = _resume(run, ckpt)
    monitor = _monitor(run, spec)
    if start == 0:
        records.extend(_evaluation(run, spec, data, 0))
    train_seconds = 0.0
    try:
        for step in range(start + 1, spec.steps + 1):
            t0 = time.perf_counter()
            outcome = _train_step(run, monitor, spec, data, step)
            train_seconds += time.perf_counter() - t0
            records.extend(_step_records(run, spec, step, outcome))
            records.extend(_evaluation(run, spec, data, step))
            _checkpoint(run, spec, ckpt, step, records)
            if on_step is not None:
                on_step(spec.name, step)
            if stop_after is not None and stop_after <= step < spec.steps:
                raise KeyboardInterrupt(f"stopped after step {step} (stop_after)")
    finally:
        monitor.close()
    done = spec.steps - start
    return RunResult(name=spec.name, recipe=spec.recipe, records=records, model=run.model,
                     seconds_per_step=train_seconds / done if done > 0 else float("nan"),
                     conversion=run.conversion, resumed_from=start)  # fmt: skip


def restore_trained_model(
    spec: RunSpec, base_model: nn.Module, checkpoint_path: str | os.PathLike
) -> nn.Module:
    """The model of a finished single-process run, rebuilt from its final checkpoint (<run>.pt)."""
    model = copy.deepcopy(base_model).to(spec.device)
    _convert(
        model, spec.recipe, spec.policy
    )  # the checkpoint holds the (perturbed, trained) weights themselves
    model.load_state_dict(load_checkpoint(Path(checkpoint_path))["model"])
    return model
