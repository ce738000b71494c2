"""AWQ (awq.py) and SmoothQuant (smoothquant.py) folded into a checkpoint on disk, one transformer block at
a time: the folded checkpoint is written tensor by tensor and the model is never held whole.

    record = awq_checkpoint(model_dir, out_dir, batches, {linear: scheme}, n_grid=20, scales="duo")
    record = smoothquant_checkpoint(model_dir, out_dir, batches, alpha=0.5)

The walk is the one `awq_model_` runs on a loaded model, over the checkpoint instead
(calibration/layerwise.py: the first block's inputs from the embedding rows of the tokens, then each
block read, run, searched and folded by the same AwqPass, its outputs the next block's inputs). After
each block's search and folds its tensors are written, then it is dropped. The tensors outside the blocks,
which AWQ does not change, are copied in 16 MiB pieces, in the model's order (the embedding before the
blocks, the norm and head after them). So the checkpoint written is bit for bit
what `awq_model_` followed by a save gives (tested).

Checked before anything is read: the arguments and the structure (awq_plan on the skeleton). Each block's
norms are probed, and its weights to fold checked finite, when it is read (folds.check_block).

SmoothQuant takes two walks, to smooth with the statistics of the unsmoothed model as on a loaded one:
the calibration walk observes each mapping's per-channel input maxima (checking each block as it reads
it), then each block is read again, smoothed mapping by mapping, written and dropped.

Memory: the layer-by-layer calibration walk's (docs/quantize.md); AWQ adds the cached inputs of the
block's searched modules and one mapping's candidate weights, SmoothQuant a vector per mapping.
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
from mixprec.inference.algorithms.block_rewrite import BlockLayout, publish_folded, rewrite_block
from mixprec.inference.algorithms.folds import BlockMappings, FoldMapping, check_block
from mixprec.inference.algorithms.smoothquant import (
    ChannelMaxima,
    smooth_mapping_,
    smoothquant_plan,
    smoothquant_record,
)
from mixprec.inference.calibration.layerwise import Captured, calibrate_layerwise, skeleton
from mixprec.inference.checkpoint.safetensors_io import (
    PlannedShardWriter,
    ShardReader,
    open_checkpoint,
)
from mixprec.inference.schemes import InferenceScheme

COPY_CHUNK_BYTES = 16 << 20


class _WritingPass:
    """The AwqPass of a walk over a checkpoint, with each block's checks before its forward and its
    tensors written once it is folded (the walk then drops it)."""

    def __init__(self, awq: AwqPass, found: BlockMappings, layout: BlockLayout) -> None:
        self.awq, self.found, self.layout = awq, found, layout
        self.writer: PlannedShardWriter | None = None

    def hooks(self, own: str, modules: dict[str, nn.Module]) -> list[Any]:
        check_block(modules, self.found, own)
        return self.awq.hooks(own, modules)

    def after(self, own: str, block: nn.Module, captured: Captured, outputs: Captured,
              rerun: Callable[[nn.Module, Captured], Captured]) -> Captured:  # fmt: skip
        out = self.awq.after(own, block, captured, outputs, rerun)
        self.layout.write_block(self.writer, own, block)  # type: ignore[arg-type]
        return out


def _skeleton(model_dir: Path, what: str):
    """(config, checkpoint, the meta skeleton, its block list's name, its blocks)."""
    config, ckpt = read_config(model_dir), open_checkpoint(model_dir)
    model, prefix, blocks, renamed, _ = skeleton(model_dir, config, ckpt, [])
    if renamed:
        raise MixprecError(f"{model_dir}: {what} over a checkpoint reads tensors by the model's names")
    return config, ckpt, model, prefix, blocks


def awq_checkpoint(model_dir: Path, out_dir: Path, batches: Sequence[torch.Tensor],
                   schemes: Mapping[str, InferenceScheme | str], *, n_grid: int = 20, scales: str = DUO,
                   max_shard_size: str | int = "2GB") -> dict[str, Any]:  # fmt: skip
    """Write the AWQ-folded checkpoint of `model_dir` into the existing directory `out_dir` (tensors,
    index, config.json, the input's side files); returns awq_model_'s record. MixprecError, before
    anything is written, for arguments or a model AWQ does not take."""
    config, ckpt, model, prefix, blocks = _skeleton(model_dir, "AWQ")
    found, resolved = awq_plan(model, batches, schemes, n_grid, scales, loaded=False)
    dtype = ckpt.tensors[f"{next(iter(resolved))}.weight"].dtype  # the weights' dtype, as the loaded model's
    layout = BlockLayout(ckpt, model, prefix, len(blocks))
    awq = AwqPass(None, found, resolved, n_grid, dtype, scales)
    writing = _WritingPass(awq, found, layout)
    started = time.perf_counter()

    def write(writer: PlannedShardWriter) -> None:
        with ShardReader() as reader:
            layout.copy(writer, reader, layout.before)
            writing.writer = writer
            calibrate_layerwise(model_dir, config, ckpt, batches, [], block_pass=writing)
            layout.copy(writer, reader, layout.after)

    publish_folded(model_dir, out_dir, config, layout.planned(), "mixprec awq", write, max_shard_size)
    return awq.record(batches, time.perf_counter() - started)


class _ObservingPass:
    """The first SmoothQuant walk's pass: each block checked when read, its mappings' input maxima seen."""

    def __init__(self, found: BlockMappings, mappings: list[FoldMapping], seen: ChannelMaxima) -> None:
        self.found, self.mappings, self.seen = found, mappings, seen

    def hooks(self, own: str, modules: dict[str, nn.Module]) -> list[Any]:
        check_block(modules, self.found, own)
        first = [m.linears[0] for m in self.mappings if m.previous.startswith(own)]
        return [modules[n].register_forward_pre_hook(self.seen.observe(n)) for n in first]

    def after(self, own: str, block: nn.Module, captured: Captured, outputs: Captured,
              rerun: Callable[[nn.Module, Captured], Captured]) -> Captured:  # fmt: skip
        return outputs


def smoothquant_checkpoint(model_dir: Path, out_dir: Path, batches: Sequence[torch.Tensor], *, alpha: float = 0.5,
                           max_shard_size: str | int = "2GB") -> dict[str, Any]:  # fmt: skip
    """Write the SmoothQuant-folded checkpoint of `model_dir` into the existing directory `out_dir`;
    returns smoothquant_model_'s record. MixprecError, before anything is written, for bad arguments or
    a model SmoothQuant does not take."""
    config, ckpt, model, prefix, blocks = _skeleton(model_dir, "SmoothQuant")
    found, mappings = smoothquant_plan(model, batches, alpha, loaded=False)
    layout = BlockLayout(ckpt, model, prefix, len(blocks))
    started = time.perf_counter()
    seen = ChannelMaxima()
    calibrate_layerwise(
        model_dir, config, ckpt, batches, [], block_pass=_ObservingPass(found, mappings, seen)
    )
    record: dict[str, Any] = {}
    modules = dict(model.named_modules())

    def smooth(block: nn.Module, own: str) -> None:  # the block's mappings, in model order
        for m in (m for m in mappings if m.previous.startswith(own)):
            record[m.name] = smooth_mapping_(model, modules, m, seen.maxima[m.linears[0]], alpha)

    def write(writer: PlannedShardWriter) -> None:
        with ShardReader() as reader:
            layout.copy(writer, reader, layout.before)
            for own in layout.owns:
                rewrite_block(writer, reader, ckpt, model, own, layout.block_tensors[own],
                              lambda block, own=own: smooth(block, own))  # fmt: skip
            layout.copy(writer, reader, layout.after)

    publish_folded(model_dir, out_dir, config, layout.planned(), "mixprec smoothquant", write, max_shard_size)
    return smoothquant_record(found, mappings, record, alpha, batches, time.perf_counter() - started)


__all__ = ["awq_checkpoint", "smoothquant_checkpoint"]
