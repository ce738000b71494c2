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
from mixprec.inference.algorithms.folds import BlockMappings, FoldMapping, check_block
from mixprec.inference.algorithms.smoothquant import (
    ChannelMaxima,
    smooth_mapping_,
    smoothquant_plan,
    smoothquant_record,
)
from mixprec.inference.calibration.layerwise import Captured, calibrate_layerwise, skeleton
from mixprec.inference.calibration.outside import load_into
from mixprec.inference.checkpoint.publish import parse_size, publish
from mixprec.inference.checkpoint.safetensors_io import (
    Checkpoint,
    PlannedShardWriter,
    PlannedTensor,
    ShardReader,
    copy_side_files,
    open_checkpoint,
    read_chunks,
)
from mixprec.inference.schemes import InferenceScheme
from mixprec.kernels.allocator import release_free_memory

COPY_CHUNK_BYTES = 16 << 20


class _WritingPass:
    """The AwqPass of a walk over a checkpoint, with each block's checks before its forward and its
    tensors written once it is folded (the walk then drops it)."""

    def __init__(self, awq: AwqPass, found: BlockMappings, layout: _Layout) -> None:
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


class _Layout:
    """Which checkpoint tensors lie in which block (`owns`: 'model.layers.3.') and which outside; the order
    written is the model's own (its state dict's, the order rotation_checkpoint writes too): the outside
    tensors before the blocks (the embedding) copied unchanged first, then block after block, then the
    outside tensors after them (the final norm, the head)."""

    def __init__(self, ckpt: Checkpoint, model: nn.Module, prefix: str, blocks: int) -> None:
        self.ckpt = ckpt
        self.owns = [f"{prefix}.{i}." for i in range(blocks)]
        self.block_tensors = {own: [n for n in ckpt.tensors if n.startswith(own)] for own in self.owns}
        inside = {n for names in self.block_tensors.values() for n in names}
        position = {n: i for i, n in enumerate(model.state_dict(keep_vars=True))}
        first = min((position.get(n, len(position)) for n in inside), default=len(position))
        outside = sorted(
            (n for n in ckpt.tensors if n not in inside), key=lambda n: position.get(n, len(position))
        )
        self.before = [n for n in outside if position.get(n, len(position)) < first]
        self.after = [n for n in outside if n not in self.before]

    def planned(self) -> list[PlannedTensor]:
        order = [*self.before, *(n for own in self.owns for n in self.block_tensors[own]), *self.after]
        return [
            PlannedTensor(n, self.ckpt.tensors[n].dtype, tuple(self.ckpt.tensors[n].shape)) for n in order
        ]

    def copy(self, writer: PlannedShardWriter, reader: ShardReader, names: list[str]) -> None:
        """Tensors copied unchanged, in 16 MiB pieces."""
        buf = torch.empty(COPY_CHUNK_BYTES, dtype=torch.uint8)
        for name in names:
            info = self.ckpt.tensors[name]
            writer.write_chunks(name, info.dtype, tuple(info.shape), read_chunks(reader, info, buf))

    def write_block(self, writer: PlannedShardWriter, own: str, block: nn.Module) -> None:
        tensors = block.state_dict(prefix=own, keep_vars=True)
        for name in self.block_tensors[own]:
            writer.write(name, tensors[name])


def _skeleton(model_dir: Path, what: str):
    """(config, checkpoint, the meta skeleton, its block list's name, its blocks)."""
    config, ckpt = read_config(model_dir), open_checkpoint(model_dir)
    model, prefix, blocks, renamed, _ = skeleton(model_dir, config, ckpt, [])
    if renamed:
        raise MixprecError(f"{model_dir}: {what} over a checkpoint reads tensors by the model's names")
    return config, ckpt, model, prefix, blocks


def _publish(model_dir: Path, out_dir: Path, config: dict, layout: _Layout, producer: str, write,
             max_shard_size: str | int) -> None:  # fmt: skip
    publish(out_dir, force=False, into=out_dir, planned=layout.planned(), max_shard_size=parse_size(max_shard_size),
            producer=producer, write_tensors=write, config=lambda: config,
            side_files=lambda d: copy_side_files(model_dir, d, set()))  # fmt: skip


def awq_checkpoint(model_dir: Path, out_dir: Path, batches: Sequence[torch.Tensor],
                   schemes: Mapping[str, InferenceScheme | str], *, n_grid: int = 20, scales: str = DUO,
                   max_shard_size: str | int = "2GB") -> dict[str, Any]:  # fmt: skip
    """Write the AWQ-folded checkpoint of `model_dir` into the existing directory `out_dir` (tensors,
    index, config.json, the input's side files); returns awq_model_'s record. MixprecError, before
    anything is written, for arguments or a model AWQ does not take."""
    config, ckpt, model, prefix, blocks = _skeleton(model_dir, "AWQ")
    found, resolved = awq_plan(model, batches, schemes, n_grid, scales, loaded=False)
    dtype = ckpt.tensors[f"{next(iter(resolved))}.weight"].dtype  # the weights' dtype, as the loaded model's
    layout = _Layout(ckpt, model, prefix, len(blocks))
    awq = AwqPass(None, found, resolved, n_grid, dtype, scales)
    writing = _WritingPass(awq, found, layout)
    started = time.perf_counter()

    def write(writer: PlannedShardWriter) -> None:
        with ShardReader() as reader:
            layout.copy(writer, reader, layout.before)
            writing.writer = writer
            calibrate_layerwise(model_dir, config, ckpt, batches, [], block_pass=writing)
            layout.copy(writer, reader, layout.after)

    _publish(model_dir, out_dir, config, layout, "mixprec awq", write, max_shard_size)
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
    layout = _Layout(ckpt, model, prefix, len(blocks))
    started = time.perf_counter()
    seen = ChannelMaxima()
    calibrate_layerwise(
        model_dir, config, ckpt, batches, [], block_pass=_ObservingPass(found, mappings, seen)
    )
    record: dict[str, Any] = {}
    modules = dict(model.named_modules())

    def write(writer: PlannedShardWriter) -> None:
        with ShardReader() as reader:
            layout.copy(writer, reader, layout.before)
            for own in layout.owns:
                load_into(model, ckpt, layout.block_tensors[own], reader)
                for m in mappings:
                    if m.previous.startswith(own):
                        record[m.name] = smooth_mapping_(model, modules, m, seen.maxima[m.linears[0]], alpha)
                block = model.get_submodule(own[:-1])
                layout.write_block(writer, own, block)
                block.to("meta")
                release_free_memory()
            layout.copy(writer, reader, layout.after)

    _publish(model_dir, out_dir, config, layout, "mixprec smoothquant", write, max_shard_size)
    return smoothquant_record(found, mappings, record, alpha, batches, time.perf_counter() - started)


__all__ = ["awq_checkpoint", "smoothquant_checkpoint"]
