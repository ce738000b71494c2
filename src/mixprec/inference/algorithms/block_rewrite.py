"""Writing a folded checkpoint block by block (the streamed folds: rotation_checkpoint.py,
fold_checkpoint.py): which tensors lie in which block and the order they are written, a block read,
changed in place, written and dropped, and the publish of the folded directory."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.inference.calibration.outside import load_into
from mixprec.inference.checkpoint.publish import parse_size, publish
from mixprec.inference.checkpoint.safetensors_io import (
    Checkpoint,
    PlannedShardWriter,
    PlannedTensor,
    ShardReader,
    copy_side_files,
    read_chunks,
)
from mixprec.kernels.allocator import release_free_memory

COPY_CHUNK_BYTES = 16 << 20


class BlockLayout:
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
        """The block's checkpoint tensors, as the block now holds them, in checkpoint order."""
        write_block(writer, own, block, self.block_tensors[own])


def write_block(writer: PlannedShardWriter, own: str, block: nn.Module, names: Sequence[str]) -> None:
    """The checkpoint tensors `names` of the block whose names start with `own`, as it holds them now."""
    tensors = block.state_dict(prefix=own, keep_vars=True)
    for name in names:
        writer.write(name, tensors[name])


def rewrite_block(writer: PlannedShardWriter, reader: ShardReader, ckpt: Checkpoint, model: nn.Module, own: str,
                  names: Sequence[str], change: Callable[[nn.Module], Any]) -> None:  # fmt: skip
    """The block `own` ('model.layers.3.') read into the skeleton `model`, changed in place by
    `change(block)`, its tensors `names` written, its weights dropped to the meta device again."""
    load_into(model, ckpt, list(names), reader)
    block = model.get_submodule(own[:-1])
    change(block)
    write_block(writer, own, block, names)
    block.to("meta")
    release_free_memory()


def publish_folded(model_dir: Path, out_dir: Path, config: dict[str, Any], planned: list[PlannedTensor],
                   producer: str, write: Callable[[PlannedShardWriter], None], max_shard_size: str | int) -> None:  # fmt: skip
    """Shards (filled by `write`, in `planned` order), index, `config` and the input's side files, into the
    existing directory `out_dir`."""
    publish(out_dir, force=False, into=out_dir, planned=planned, max_shard_size=parse_size(max_shard_size),
            producer=producer, write_tensors=write, config=lambda: config,
            side_files=lambda d: copy_side_files(model_dir, d, set()))  # fmt: skip


__all__ = ["COPY_CHUNK_BYTES", "BlockLayout", "publish_folded", "rewrite_block", "write_block"]
