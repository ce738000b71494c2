"""Publishing a checkpoint: the bound on its shards' size (parsed from "2GB"-like words), and the one
publish sequence every producer (quantize, save, convert) runs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from contextlib import nullcontext
from pathlib import Path
from typing import Any, TypeVar

from mixprec.errors import MixprecError
from mixprec.files import atomic_output_dir, write_json_atomic
from mixprec.inference.checkpoint.safetensors_io import (
    PlannedShardWriter,
    PlannedTensor,
    plan_shards,
    write_index,
)
from mixprec.inference.checkpoint.scales_file import SCALES_NAMES, write_scales_file

T = TypeVar("T")

DEFAULT_MAX_SHARD_SIZE = "2GB"


def parse_size(size: str | int) -> int:
    if isinstance(size, int):
        return size
    s = size.strip().upper().replace("IB", "B")
    for unit, mult in (("KB", 1 << 10), ("MB", 1 << 20), ("GB", 1 << 30), ("TB", 1 << 40), ("B", 1)):
        if s.endswith(unit):
            try:
                return int(float(s[: -len(unit)]) * mult)
            except ValueError:
                break
    try:
        return int(s)
    except ValueError:
        raise MixprecError(f"bad size {size!r} (use e.g. 500MB, 2GB)") from None


def publish(
    out: Path,
    *,
    force: bool,
    planned: list[PlannedTensor],
    max_shard_size: int,
    producer: str,
    write_tensors: Callable[[PlannedShardWriter], None],
    config: Callable[[], dict[str, Any]],
    side_files: Callable[[Path], T] | None = None,
    scales: Callable[[], dict[str, Any]] | None = None,
    into: Path | None = None,
    skip_shards: Collection[int] = (),
    on_shard: Callable[[int, Path, str], None] | None = None,
    finish: bool = True,
) -> T | None:
    """Write a checkpoint to `out` the one way every producer does, atomically (mixprec.files: a
    temporary directory renamed into place once complete, nothing left behind on error):

      shards    the planned shards (`planned`, cut at `max_shard_size` bytes; `producer` in each
                header), filled by `write_tensors(writer)` in plan order; aborted on any error
      index     model.safetensors.index.json
      config    config.json, `config()` (called once the tensors are written)
      side      `side_files(directory)`: tokenizer, generation config, extra config documents...
      scales    the scales file (model.fp8_scales.json), `scales()`, when given

    A resumable producer passes `into`: the directory to write (it publishes that directory itself,
    files.resumable_output_dir), `skip_shards` (the shards already there, or written by other ranks)
    and `on_shard` (told of each shard file once it is complete). finish=False: write the shards only
    (a rank other than 0 of a quantize split across ranks; rank 0 writes the rest).

    Returns what `side_files` returned (None without it)."""
    place = atomic_output_dir(out, force) if into is None else nullcontext(into)
    with place as tmp:
        writer = PlannedShardWriter(tmp, plan_shards(planned, max_shard_size), {"producer": producer},
                                    skip_shards=skip_shards, on_shard=on_shard)  # fmt: skip
        try:
            write_tensors(writer)
            weight_map = writer.close()
        except BaseException:
            writer.abort()
            raise
        if not finish:
            return None
        write_index(tmp, weight_map, sum(p.nbytes for p in planned))
        write_json_atomic(tmp / "config.json", config())
        side = side_files(tmp) if side_files is not None else None
        if scales is not None:
            write_scales_file(tmp / SCALES_NAMES[0], scales())
    return side
