"""AWQ (awq.py) folded into a checkpoint on disk, one transformer block at a time: the folded checkpoint is
written tensor by tensor and the model is never held whole.

    record = awq_checkpoint(model_dir, out_dir, batches, {linear: scheme}, n_grid=20, scales="duo")

The walk is the one `awq_model_` runs on a loaded model, over the checkpoint instead
(calibration/layerwise.py: the first block's inputs from the embedding rows of the tokens, then each
block read, run, searched and folded by the same AwqPass, its outputs the next block's inputs). After
each block's search and folds its tensors are written, then it is dropped. The tensors outside the blocks,
which AWQ does not change, are copied first, in 16 MiB pieces. So the checkpoint written is bit for bit
what `awq_model_` followed by a save gives (tested).

Checked before anything is read: the arguments and the structure (awq_plan on the skeleton). Each block's
norms are probed, and its weights to fold checked finite, when it is read (folds.check_block).

Memory: the layer-by-layer calibration walk's (docs/quantize.md) plus AWQ's cached inputs of the block's
parents and the weights of one mapping's candidates.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.hf import read_config
from mixprec.inference.algorithms.awq import DUO, AwqPass, awq_plan
from mixprec.inference.algorithms.folds import BlockMappings, check_block
from mixprec.inference.calibration.layerwise import Captured, calibrate_layerwise, skeleton
from mixprec.inference.checkpoint.publish import parse_size, publish
from mixprec.inference.checkpoint.safetensors_io import (
    PlannedShardWriter,
    PlannedTensor,
    ShardReader,
    copy_side_files,
    open_checkpoint,
    read_chunks,
)
from mixprec.inference.schemes import InferenceScheme

COPY_CHUNK_BYTES = 16 << 20


class _WritingPass:
    """The AwqPass of a walk over a checkpoint, with each block's checks before its forward and its
    tensors written once it is folded (the walk then drops it)."""

    def __init__(self, awq: AwqPass, found: BlockMappings, block_tensors: dict[str, list[str]]) -> None:
        self.awq, self.found, self.block_tensors = awq, found, block_tensors
        self.writer: PlannedShardWriter | None = None

    def hooks(self, own: str, modules: dict[str, nn.Module]) -> list[Any]:
        check_block(modules, self.found, own)
        return self.awq.hooks(own, modules)

    def after(self, own: str, block: nn.Module, captured: Captured, outputs: Captured,
              rerun: Callable[[nn.Module, Captured], Captured]) -> Captured:  # fmt: skip
        out = self.awq.after(own, block, captured, outputs, rerun)
        tensors = block.state_dict(prefix=own, keep_vars=True)
        for name in self.block_tensors[own]:
            self.writer.write(name, tensors[name])  # type: ignore[union-attr]
        return out


def awq_checkpoint(model_dir: Path, out_dir: Path, batches: Sequence[torch.Tensor],
                   schemes: Mapping[str, InferenceScheme | str], *, n_grid: int = 20, scales: str = DUO,
                   max_shard_size: str | int = "2GB") -> dict[str, Any]:  # fmt: skip
    """Write the AWQ-folded checkpoint of `model_dir` into the existing directory `out_dir` (tensors,
    index, config.json, the input's side files); returns awq_model_'s record. MixprecError, before
    anything is written, for arguments or a model AWQ does not take."""
    config, ckpt = read_config(model_dir), open_checkpoint(model_dir)
    model, prefix, blocks, renamed, _ = skeleton(model_dir, config, ckpt, [])
    if renamed:
        raise MixprecError(f"{model_dir}: AWQ over a checkpoint reads tensors by the model's names")
    found, resolved = awq_plan(model, batches, schemes, n_grid, scales, loaded=False)
    dtype = ckpt.tensors[f"{next(iter(resolved))}.weight"].dtype  # the weights' dtype, as the loaded model's
    owns = [f"{prefix}.{i}." for i in range(len(blocks))]
    block_tensors = {own: [n for n in ckpt.tensors if n.startswith(own)] for own in owns}
    inside = {n for names in block_tensors.values() for n in names}
    outside = [n for n in ckpt.tensors if n not in inside]
    planned = [PlannedTensor(n, ckpt.tensors[n].dtype, tuple(ckpt.tensors[n].shape))
               for n in [*outside, *(n for own in owns for n in block_tensors[own])]]  # fmt: skip
    awq = AwqPass(None, found, resolved, n_grid, dtype, scales)
    writing = _WritingPass(awq, found, block_tensors)
    started = time.perf_counter()

    def write(writer: PlannedShardWriter) -> None:
        with ShardReader() as reader:
            buf = torch.empty(COPY_CHUNK_BYTES, dtype=torch.uint8)
            for name in outside:
                info = ckpt.tensors[name]
                writer.write_chunks(name, info.dtype, tuple(info.shape), read_chunks(reader, info, buf))
        writing.writer = writer
        calibrate_layerwise(model_dir, config, ckpt, batches, [], block_pass=writing)

    publish(out_dir, force=False, into=out_dir, planned=planned, max_shard_size=parse_size(max_shard_size),
            producer="mixprec awq", write_tensors=write, config=lambda: config,
            side_files=lambda d: copy_side_files(model_dir, d, set()))  # fmt: skip
    return awq.record(batches, time.perf_counter() - started)


__all__ = ["awq_checkpoint"]
