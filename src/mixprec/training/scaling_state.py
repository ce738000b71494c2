"""Delayed-scaling state: amax history and scales in module buffers, advanced once per optimizer step.

Layout (buffers of a LowPrecisionLinear under DelayedScaling; saved in and restored from its state_dict):
    amax_history  fp32 [history_len, 3]  columns = roles (input, weight, grad_output); row 0 is the
                  CURRENT step, rows 1.. the finished steps, newest first
    fp8_scale     fp32 [3]               the dequantization scale of each role used during this step;
                                         0 while the role has never seen a usable amax (see below)
    scaling_step  int64 []               optimizer steps advanced so far (0: no history yet)

During a step every forward records max(row 0, amax of x / W) and every backward max(row 0, amax of
dY): the maximum over micro-batches, and idempotent, so a forward recomputed under activation
checkpointing records nothing new and quantizes with the same scales (they change only in advance()).
A role whose scale is 0 has none yet and scales from the current amax, as current scaling would
(`scale_or_current`): every role before the first advance, and after it any role that never recorded
a usable amax (every amax 0, inf or NaN — an MoE expert that got no tokens, a layer skipped in the
first steps), until a step records one. A placeholder scale instead would flush its small values to
zero.

advance() — call once per optimizer step (the training helpers and the Trainer callback do):
  1. a role whose amax this step is inf or NaN (an overflowing step) is recorded as 0 in the history,
     so it cannot poison the window, and keeps its previous scale;
  2. amax = max over the history rows ("max") or row 0 ("most_recent");
  3. scale = amax / (fmt.max * 2**margin); a role whose amax this step is 0, or whose amax from the
     history is 0, keeps its previous scale;
  3b. with `current_while_growing` (DelayedScaling's default): a role whose amax this step is above
     every finished step in the history (a new record: the history does not bound it yet) gets scale 0,
     so its next step scales from its own amax, as current scaling does. Early in training the amax
     grows step after step and a history-based scale lags behind it (measured at the demo's size: an
     `o_proj` input saturating 1.2 % at step 12); once the amax stops setting records, the history
     bounds it and the scales are delayed again. Off, this is TransformerEngine's delayed scaling;
  4. the history rolls by one row (row 0 becomes the previous step), row 0 is zeroed.
Under data parallelism the current rows must be all-reduced (MAX) over ranks before advance(). That
reduction is a service of the layer above (mixprec.distributed.reduce_amax, which reads
`amax_tensors_for_reduction()`), so it is passed in: `advance(model, reduce=...)`, bound into the loop
by `TrainingStep(..., parallel=dp)` (it calls `dp.reduce_amax`) or given to the Trainer callback
(`MixprecTrainerCallback(reduce=...)`). Nothing is registered anywhere: no module-level state.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from mixprec.formats import Format
from mixprec.ranks import world_size
from mixprec.scaling import compute_scale

ROLE_INDEX = {"input": 0, "weight": 1, "grad_output": 2}


def new_buffers(history_len: int, device=None) -> dict[str, torch.Tensor]:
    return {
        "amax_history": torch.zeros(history_len, len(ROLE_INDEX), dtype=torch.float32, device=device),
        "fp8_scale": torch.zeros(len(ROLE_INDEX), dtype=torch.float32, device=device),  # 0: no scale yet
        "scaling_step": torch.zeros((), dtype=torch.int64, device=device),
    }


def raw_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| including inf and NaN (so that the advance guard sees an overflowing step), fp32 [1]."""
    lo, hi = torch.aminmax(x)
    return torch.maximum(-lo, hi).float().reshape(1)


@torch.no_grad()
def record_amax(history: torch.Tensor, role: str, amax: torch.Tensor) -> None:
    """row 0 of the history <- max(row 0, amax) for one role (NaN propagates, the guard handles it)."""
    slot = history[0, ROLE_INDEX[role] : ROLE_INDEX[role] + 1]
    torch.maximum(slot, amax.reshape(1).to(slot.dtype), out=slot)


def scale_or_current(
    stored: torch.Tensor, amax_now: torch.Tensor, fmt: Format, margin: int = 0
) -> torch.Tensor:
    """The role's delayed scale, or, while it has none yet (0), the scale of this tensor's own amax.

    Elementwise on the device (no host sync): stored and amax_now broadcast together.
    """
    return torch.where(stored > 0, stored, compute_scale(amax_now, fmt, margin).to(stored.device))


@torch.no_grad()
def advance_buffers(
    history: torch.Tensor,
    scale: torch.Tensor,
    step: torch.Tensor,
    formats: dict[str, Format],
    margin: int = 0,
    algo: str = "max",
    current_while_growing: bool = True,
) -> None:
    """One optimizer step of the delayed-scaling state, in place (see the module docstring)."""
    current = history[0]
    bad = ~torch.isfinite(current)
    current.masked_fill_(bad, 0.0)
    # before the roll, rows 1.. are the finished steps: a current amax above all of them is a record
    growing = current > history[1:].amax(dim=0) if history.shape[0] > 1 else current > 0
    if algo == "max":
        amax = history.amax(dim=0)
    elif algo == "most_recent":
        amax = current.clone()
    else:
        raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {algo!r}")
    new = torch.stack([compute_scale(amax[i], formats[role], margin) for role, i in ROLE_INDEX.items()])
    new = new.to(scale.device)
    if current_while_growing:
        new = torch.where(growing, torch.zeros_like(new), new)
    keep = bad | (current <= 0) | (amax <= 0)
    scale.copy_(torch.where(keep, scale, new))
    history.copy_(history.roll(1, dims=0))
    history[0].zero_()
    step.add_(1)


AmaxReduction = Callable[[nn.Module], object]
_UNREDUCED = (
    "delayed scaling under torch.distributed without an amax reduction: each rank scales from its own "
    "amax. Train with TrainingStep(model, optimizer, parallel=mixprec.distributed.DataParallel(...)), or "
    "pass reduce=mixprec.distributed.reduce_amax (advance_scaling_state, TrainingStep, "
    "MixprecTrainerCallback); reduce=False silences this"
)


def advance(model: nn.Module, *, reduce: AmaxReduction | Literal[False] | None = None) -> int:
    """Advance the scaling state of every module that has one (`advance_scaling()`); returns how many.

    Call exactly once per optimizer step, after backward. Modules without delayed scaling are skipped
    at no cost.
    reduce: makes every rank's current amax rows agree before the scales advance, called as
    reduce(model) (mixprec.distributed.reduce_amax: one all_reduce(MAX) for all layers). None: none,
    with a warning when delayed-scaling layers train under torch.distributed. False: none, silently.
    """
    if reduce is None and world_size() > 1 and _has_delayed_scaling(model):
        warnings.warn(_UNREDUCED, stacklevel=2)
    if reduce:
        reduce(model)
    count = 0
    for module in model.modules():
        fn = getattr(module, "advance_scaling", None)
        if callable(fn) and fn():
            count += 1
    return count


def _has_delayed_scaling(model: nn.Module) -> bool:
    return any(callable(getattr(m, "amax_tensors_for_reduction", None)) for m in model.modules())


__all__ = [
    "ROLE_INDEX",
    "AmaxReduction",
    "advance",
    "advance_buffers",
    "new_buffers",
    "raw_amax",
    "record_amax",
    "scale_or_current",
]
