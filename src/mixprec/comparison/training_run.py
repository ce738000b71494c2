"""One training run of a comparison: a clean function a distributed launcher can wrap.

    result = train_run(spec, base_model, data, checkpoint_path=..., on_step=...)

The run converts a copy of the base model (same initial weights for every recipe), trains it with
mixprec.optim.AdamW (fp32 master weights, bf16 moments for bf16 parameters), takes batch `s` from the
deterministic data order (a function of the order seed and the step only), evaluates the held-out loss
every `eval_every` steps, runs the PrecisionMonitor, skips steps with NaN/inf, advances the FP8 scaling
state once per optimizer step and checkpoints so that a resumed run continues bit-identically.

Under torch.distributed (only if a process group is initialized) each rank takes its slice of every
batch; the logged loss is the mean over ranks; a NaN/inf seen by one rank makes every rank skip the step.
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

from mixprec.data import TokenizedData, train_batch
from mixprec.distributed.checkpoint import load_checkpoint as load_shards
from mixprec.distributed.checkpoint import save_checkpoint
from mixprec.distributed.fsdp import clip_grad_norm_ as clip_sharded
from mixprec.distributed.nan_guard import any_rank
from mixprec.errors import MixprecError
from mixprec.files import atomic_file
from mixprec.models import lm_loss
from mixprec.monitor import PrecisionMonitor
from mixprec.recipes import from_name
from mixprec.training import (
    advance_scaling_state,
    clip_grad_norm_,
    conversion_state,
    convert_for_training,
    make_grad_scaler,
)
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


def _dist() -> tuple[int, int]:
    d = torch.distributed
    if d.is_available() and d.is_initialized():
        return d.get_rank(), d.get_world_size()
    return 0, 1


def _mean_over_ranks(x: torch.Tensor) -> torch.Tensor:
    _, world = _dist()
    if world > 1:
        x = x.detach().clone()
        torch.distributed.all_reduce(x)
        x /= world
    return x


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


def _clip(model: nn.Module, optimizer, max_norm: float, sharded: bool, clip_plain) -> torch.Tensor:
    """Global-norm clipping; over FSDP2 shards the norm needs one all_reduce (fsdp.clip_grad_norm_)."""
    if sharded:
        return clip_sharded(optimizer, max_norm)
    return clip_plain(model, optimizer, max_norm)


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

    rank, world = _dist()
    model = copy.deepcopy(base_model).to(spec.device)
    if spec.perturb_seed is not None:
        perturb_weights(model, spec.perturb_seed, ulp_dtype_of(spec.recipe))
    conversion = _convert(model, spec.recipe, spec.policy)
    state = conversion_state(model)
    loss_scaled = state is not None and state.kind == "fp16-amp"
    scaler = make_grad_scaler(model) if loss_scaled else None
    # convert, wrap, THEN build the optimizer: FSDP2 replaces every parameter by a DTensor shard
    train_model = prepare(model) if prepare is not None else model
    optimizer = AdamW(train_model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    attach = getattr(prepare, "attach", None)
    if attach is not None:
        attach(train_model, optimizer)  # DDP's fp32 gradient hook / FSDP2's DTensor moment rounding
    train_model.train()
    sharded = any(hasattr(p, "placements") for p in model.parameters())  # FSDP2 DTensor shards

    records: list[dict] = []
    start = 0
    ckpt = Path(checkpoint_path) if checkpoint_path is not None else None
    if ckpt is not None and world > 1:
        ckpt = distributed_checkpoint_path(ckpt)
    if ckpt is not None and ckpt.exists():
        if world > 1:
            start, records = _load_distributed(ckpt, train_model, optimizer, scaler)
        else:
            payload = load_checkpoint(ckpt)
            model.load_state_dict(payload["model"])
            optimizer.load_state_dict(payload["optimizer"])
            if scaler is not None and payload["scaler"]:
                scaler.load_state_dict(payload["scaler"])
            records = json.loads(payload["records"])
            start = int(payload["step"])
    resumed_from = start

    monitor = PrecisionMonitor(
        model, every=spec.monitor_every, optimizer=optimizer, check_gradients=not loss_scaled
    )
    if not spec.monitor:
        monitor.layers = {}
    if start == 0:
        records.append(
            {
                "kind": "eval",
                "run": spec.name,
                "step": 0,
                "val_loss": evaluate_loss(model, data.val, spec.batch_size),
            }
        )

    train_seconds = 0.0
    try:
        for step in range(start + 1, spec.steps + 1):
            t0 = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, spec)
            batch = train_batch(data, spec.batch_size, step - 1, spec.order_seed)
            if world > 1:
                batch = batch[rank::world]
            batch = batch.to(spec.device)
            monitor.begin_step(step)
            loss = lm_loss(train_model, batch)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            health = monitor.check_step(loss)
            skipped = not health.ok
            if world > 1:  # one rank's NaN/inf (e.g. in its FSDP2 gradient shard) skips on every rank
                skipped = any_rank(skipped)
            grad_norm = None
            if skipped:
                optimizer.zero_grad(set_to_none=True)
            else:
                if scaler is not None:
                    scaler.unscale_(optimizer)
                if spec.max_grad_norm is not None:
                    grad_norm = float(_clip(model, optimizer, spec.max_grad_norm, sharded, clip_grad_norm_))
                if scaler is not None:
                    before = scaler.get_scale()
                    scaler.step(optimizer)
                    scaler.update()
                    skipped = scaler.get_scale() < before
                else:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            # the FP8 scaling state advances once per optimizer step (its guards keep the previous
            # scale when a skipped step saw amax inf/NaN)
            advance_scaling_state(model)
            precision = monitor.end_step()
            train_seconds += time.perf_counter() - t0
            row = {"kind": "step", "run": spec.name, "step": step, "loss": float(_mean_over_ranks(loss.detach().float())),
                   "lr": lr_at(step, spec), "grad_norm": grad_norm, "skipped": skipped}  # fmt: skip
            records.append(row)
            records.extend({"kind": "precision", "run": spec.name, **r} for r in precision)
            if not health.ok:
                bad = health.first_bad
                records.append({"kind": "nan_event", "run": spec.name, "step": step, "layer": bad.layer,
                                "tensor": bad.tensor, "type": bad.kind})  # fmt: skip
            if step % spec.eval_every == 0 or step == spec.steps:
                val = evaluate_loss(model, data.val, spec.batch_size)
                records.append({"kind": "eval", "run": spec.name, "step": step, "val_loss": val})
            if ckpt is not None and (step % spec.checkpoint_every == 0 or step == spec.steps):
                if world > 1:  # collective: every rank writes its own shard
                    _save_distributed(ckpt, step, train_model, optimizer, scaler, records)
                else:
                    _save_checkpoint(ckpt, step, model, optimizer, scaler, records)
            if on_step is not None:
                on_step(spec.name, step)
            if stop_after is not None and step >= stop_after and step < spec.steps:
                raise KeyboardInterrupt(f"stopped after step {step} (stop_after)")
    finally:
        monitor.close()
    done = spec.steps - resumed_from
    return RunResult(
        name=spec.name,
        recipe=spec.recipe,
        records=records,
        model=model,
        seconds_per_step=train_seconds / done if done > 0 else float("nan"),
        conversion=conversion,
        resumed_from=resumed_from,
    )


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
