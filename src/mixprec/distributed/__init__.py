"""mixprec under torch.distributed: DDP and FSDP2 (fully_shard), launched with torchrun.

    torchrun --nproc-per-node 2 $(which mixprec) compare --recipes bf16,fp8-delayed --out runs/c

Pieces (each usable alone):
- world: init_from_env / shard_batch (the one sharding rule) / mean_across_ranks, and rank / world size
  (from mixprec.ranks; all single-process answers in one process)
- amax_reduction.reduce_amax(model): one all_reduce(MAX) of every delayed-scaling amax per step;
  TrainingStep(..., parallel=DataParallel(...)) runs it before every scaling advance
- ddp.wrap_ddp / register_fp32_grad_hook: DDP that reduces mixprec AdamW's fp32 gradient buffers
- fsdp.shard_model / adapt_optimizer / clip_grad_norm_: FSDP2 with fp32 masters, bf16 moments
- fp8_all_gather: FSDP2 all-gathers per-tensor-scaled FP8 weights in FP8
- checkpoint.save_checkpoint / load_checkpoint: per-rank safetensors shards, bit-identical resume
- nan_guard.should_skip_step: one rank's NaN makes every rank skip
- prepare.DataParallel: all of the above for a training loop: mixprec.training.TrainingStep's
  `parallel=` (and mixprec.compare's prepare=)
"""

from __future__ import annotations

from mixprec.distributed.amax_reduction import (
    amax_tensors,
    reduce_amax,
    scales_agree,
)
from mixprec.distributed.checkpoint import load_checkpoint, save_checkpoint
from mixprec.distributed.ddp import wrap_ddp
from mixprec.distributed.fsdp import shard_model
from mixprec.distributed.nan_guard import any_rank, should_skip_step
from mixprec.distributed.prepare import DataParallel, unwrap
from mixprec.distributed.world import (
    init_from_env,
    is_distributed,
    is_main_process,
    mean_across_ranks,
    rank,
    shard_batch,
    world_size,
)

__all__ = [
    "DataParallel",
    "amax_tensors",
    "any_rank",
    "init_from_env",
    "is_distributed",
    "is_main_process",
    "load_checkpoint",
    "mean_across_ranks",
    "rank",
    "reduce_amax",
    "save_checkpoint",
    "scales_agree",
    "shard_batch",
    "shard_model",
    "should_skip_step",
    "unwrap",
    "world_size",
    "wrap_ddp",
]
