"""MixprecTrainerCallback: a converted model trains under transformers.Trainer.

    trainer = Trainer(model, args, train_dataset=ds, optimizers=(mixprec.AdamW(model.parameters()), None),
                      callbacks=[MixprecTrainerCallback()])

- After each optimizer step (not each micro-batch: with gradient_accumulation_steps=k the Trainer steps
  once per k micro-batches) it advances the FP8 scaling state, once.
- With mixprec.AdamW the bf16 parameters' gradients live in the optimizer's fp32 buffers, so the
  Trainer's own clipping sees no gradients; before each optimizer step the callback clips those buffers
  to ``args.max_grad_norm`` instead (``last_grad_norm`` holds the norm before clipping).
"""

from __future__ import annotations

from typing import Any

from mixprec.errors import MixprecError
from mixprec.training.optim import AdamW
from mixprec.training.step import advance_scaling_state

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - depends on the install
    raise MixprecError("MixprecTrainerCallback needs transformers: pip install 'mixprec[hf]'") from exc


def _unwrap_optimizer(optimizer: Any) -> Any:
    # accelerate wraps the optimizer (AcceleratedOptimizer.optimizer)
    while (
        optimizer is not None
        and not hasattr(optimizer, "clip_grad_norm_")
        and hasattr(optimizer, "optimizer")
    ):
        optimizer = optimizer.optimizer
    return optimizer


class MixprecTrainerCallback(TrainerCallback):
    """Advances the FP8 scaling state once per optimizer step; clips mixprec AdamW's fp32 gradients.

    reduce: the amax reduction over data-parallel ranks for delayed scaling under the Trainer's own DDP:
    pass it explicitly (reduce=mixprec.distributed.reduce_amax; nothing is registered on the model, so
    None reduces nothing and warns under torch.distributed); see scaling_state.advance.
    """

    def __init__(self, clip_fp32_grads: bool = True, reduce: Any = None) -> None:
        self.clip_fp32_grads = clip_fp32_grads
        self.reduce = reduce
        self.advances = 0
        self.last_grad_norm: float | None = None
        self._advanced_at: int | None = None

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        opt = _unwrap_optimizer(optimizer)
        if self.clip_fp32_grads and isinstance(opt, AdamW) and args.max_grad_norm and args.max_grad_norm > 0:
            self.last_grad_norm = float(opt.clip_grad_norm_(args.max_grad_norm))
        return control

    def _advance(self, completed_step: int, model) -> None:
        # on_optimizer_step runs before the Trainer increments global_step, on_step_end after: both name
        # the step being completed, so one optimizer step advances the scaling state exactly once.
        if model is None or self._advanced_at == completed_step:
            return
        advance_scaling_state(model, reduce=self.reduce)
        self._advanced_at = completed_step
        self.advances += 1

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        self._advance(state.global_step + 1, model)
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._advance(state.global_step, model)  # fallback for Trainers without on_optimizer_step
        return control
