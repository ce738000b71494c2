"""An offline quantization split across the processes of a torchrun job (`torchrun --nproc-per-node N
-m mixprec quantize ...`; gloo on CPU, NCCL on GPU; several machines with the same launcher, the output
on a file system they share).

Every rank runs the same pipeline on the same input: it plans the same output shards, and calibration
(when the job has one) splits its batches across the ranks and reduces what it observed, so every rank
holds the one process's statistics (producers/quantize_calibration.py). The writing is split by output
shard: the unfinished shards are dealt to the ranks, biggest first onto the least-loaded rank, and each
rank reads, quantizes and writes the input tensors of its own shards only (a Linear cut by a shard
boundary is quantized by both ranks, deterministically, each writing its part). A shard's bytes depend
on its tensors alone, so the files are the ones a single process writes. Rank 0 then gathers every
rank's scales-file entries and writes the index, config.json, the side files and the scales file.

Rank 0 owns the partial run (producers/resume.py: it makes, locks and publishes the work directory and
writes the manifest); every rank appends the shards it finishes to the shard log, so a killed job
resumes with `--resume` under torchrun or in one process (any split: shards are the unit).
"""

from __future__ import annotations

from collections.abc import Collection

from mixprec.inference.checkpoint.safetensors_io import PlannedTensor
from mixprec.ranks import rank, world_size


def shard_owners(shards: list[list[PlannedTensor]], todo: Collection[int], world: int) -> dict[int, int]:
    """{shard index: the rank that writes it} for the shards in `todo`: biggest first onto the rank with
    the fewest bytes so far (the lowest rank on a tie), the same on every rank."""
    load = [0] * world
    owners: dict[int, int] = {}
    for i in sorted(todo, key=lambda i: (-sum(t.nbytes for t in shards[i]), i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += sum(t.nbytes for t in shards[i])
    return owners


def own_shards(shards: list[list[PlannedTensor]], finished: Collection[int]) -> frozenset[int]:
    """The shards this process writes: every unfinished one in a single process."""
    todo = [i for i in range(len(shards)) if i not in finished]
    owners = shard_owners(shards, todo, world_size())
    me = rank()
    return frozenset(i for i, r in owners.items() if r == me)


__all__ = ["own_shards", "shard_owners"]
