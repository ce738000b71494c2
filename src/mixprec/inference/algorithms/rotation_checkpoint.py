"""The rotation (rotation.py) of a checkpoint on disk, one transformer block at a time: the rotated
checkpoint is written tensor by tensor and the model is never held whole.

    record = rotate_checkpoint(model_dir, out_dir, seed=0, r2=True)

It computes what `rotate_model_` computes on the loaded model, with the same functions on the same
tensors: each block is read into the model's skeleton and rotated by `rotate_layer_`; the embedding and
the head are read in the rows `rotate_model_` takes at a time (CHUNK_ROWS), each chunk multiplied in
fp64 exactly as there. So the tensors written are bit for bit those of `rotate_model_` followed by a
save (tested). A tied head is written as its own tensor, and config.json says untied.

The structure is checked on the skeleton before anything is read (the names, types and shapes
`plan_rotation` checks); each norm's probe (is it an RMSNorm without an offset?) runs when its weight is
read, the final norm's before any block.

Memory: one block in its dtype with the fp64 working copy of its largest weight, and one chunk of
CHUNK_ROWS rows of the embedding or head in fp64 (Llama-3.1-8B: 8192 x 4096 x 8 bytes = 256 MiB).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.hf import build_model, read_config
from mixprec.inference.algorithms.block_rewrite import publish_folded, rewrite_block
from mixprec.inference.algorithms.rotation import (
    CHUNK_ROWS,
    RotationPlan,
    check_layer,
    check_rms_norm,
    orthogonal_matrix,
    plan_rotation,
    rotate_layer_,
    rotation_record,
)
from mixprec.inference.calibration.outside import load_into
from mixprec.inference.checkpoint.safetensors_io import (
    Checkpoint,
    PlannedShardWriter,
    PlannedTensor,
    ShardReader,
    open_checkpoint,
)

LAYERS = "model.layers"  # the block list plan_rotation recognises


class _Names:
    """The checkpoint names the rotation reads and writes: the embedding, the head (None when tied: it
    is then written under head_out from the embedding's rows), the final norm, each block's tensors."""

    def __init__(self, model: nn.Module, plan: RotationPlan, ckpt: Checkpoint, blocks: int) -> None:
        path = {id(m): n for n, m in model.named_modules()}
        self.embed = f"{path[id(plan.embed)]}.weight"
        self.head_out = f"{path[id(plan.head)]}.weight"
        self.head = None if plan.tied else self.head_out
        self.norm = f"{path[id(plan.final_norm)]}.weight"
        self.blocks = [[n for n in ckpt.tensors if n.startswith(f"{LAYERS}.{i}.")] for i in range(blocks)]
        known = {self.embed, self.norm, *(n for b in self.blocks for n in b)} | ({self.head} - {None})
        missing = [n for n in (self.embed, self.norm, self.head) if n is not None and n not in ckpt.tensors]
        if missing:
            raise MixprecError(f"rotate: the checkpoint has no {', '.join(missing)}")
        extra = [n for n in ckpt.tensors if n not in known]
        if extra:
            raise MixprecError(
                f"rotate: the checkpoint holds tensors the rotation does not know: {', '.join(extra[:3])}"
            )

    def planned(self, ckpt: Checkpoint) -> list[PlannedTensor]:
        """Every tensor written, in the order written."""
        info = ckpt.tensors
        order = [self.embed, *(n for b in self.blocks for n in b), self.norm]
        out = [PlannedTensor(n, info[n].dtype, tuple(info[n].shape)) for n in order]
        source = info[self.head or self.embed]
        return [*out, PlannedTensor(self.head_out, source.dtype, tuple(source.shape))]


def rotate_checkpoint(model_dir: Path, out_dir: Path, *, seed: int = 0, r2: bool = True,
                      max_shard_size: str | int = "2GB") -> dict[str, Any]:  # fmt: skip
    """Write the rotated checkpoint of `model_dir` into the existing directory `out_dir` (tensors,
    index, config.json with the head untied, the input's side files); returns the rotation's record as
    `rotate_model_` gives it, without the matrices. MixprecError, before anything is written, for a
    model the rotation does not take."""
    config = read_config(model_dir)
    ckpt = open_checkpoint(model_dir)
    model = build_model(config, source=model_dir).eval()
    plan = plan_rotation(model, loaded=False)
    names = _Names(model, plan, ckpt, len(plan.layers))
    r1 = orthogonal_matrix(plan.hidden, seed)
    r2_matrix = orthogonal_matrix(plan.head_dim, seed + 1) if r2 else None
    with ShardReader() as reader:
        load_into(model, ckpt, [names.norm], reader)
        final_gain = check_rms_norm(plan.final_norm, "model.norm", plan.hidden).weight.detach().clone()

        def write(writer: PlannedShardWriter) -> None:
            _write_rows(writer, reader, ckpt, names.embed, names.embed, r1)
            for i, block_names in enumerate(names.blocks):
                rotate = lambda block, i=i: rotate_layer_(check_layer(i, block, plan.hidden), r1, r2_matrix)  # noqa: E731
                rewrite_block(writer, reader, ckpt, model, f"{LAYERS}.{i}.", block_names, rotate)
            writer.write(names.norm, torch.ones_like(final_gain))
            _write_rows(writer, reader, ckpt, names.head or names.embed, names.head_out, r1, final_gain)

        publish_folded(model_dir, out_dir, _untied(config), names.planned(ckpt), "mixprec rotate", write,
                       max_shard_size)  # fmt: skip
    return rotation_record(plan, seed, r2)


def _write_rows(writer: PlannedShardWriter, reader: ShardReader, ckpt: Checkpoint, source: str, target: str,
                r1: torch.Tensor, gain: torch.Tensor | None = None) -> None:  # fmt: skip
    """`target` <- the rows of `source` times R1 (after the gain, a folded norm's weight, when given), in
    the chunks rotate_model_ takes, each in fp64 and cast back to the tensor's dtype."""
    info = ckpt.tensors[source]
    scale = gain.double() if gain is not None else None

    def chunks() -> Iterator[memoryview]:
        for start in range(0, info.shape[0], CHUNK_ROWS):
            rows = reader.get_rows(info, torch.arange(start, min(info.shape[0], start + CHUNK_ROWS)))
            wide = rows.double() if scale is None else rows.double() * scale
            rotated = (wide @ r1).to(info.dtype)
            yield memoryview(rotated.reshape(-1).view(torch.uint8).numpy())

    writer.write_chunks(target, info.dtype, tuple(info.shape), chunks())


def _untied(config: dict[str, Any]) -> dict[str, Any]:
    """config.json with the head untied (also in a nested text config)."""
    out = {**config, "tie_word_embeddings": False}
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = {**out["text_config"], "tie_word_embeddings": False}
    return out


__all__ = ["rotate_checkpoint"]
