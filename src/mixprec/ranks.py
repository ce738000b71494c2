"""Who this process is in a job: its rank, the world size, whether it is the main process (rank 0).

The one place that asks torch.distributed (and torchrun's environment) who we are: every other module
of mixprec reads the rank and world through these functions (tests/test_architecture.py checks it).
Outside a process group every answer is the single-process one (rank 0 of a world of 1), so code
written with them runs unchanged with `python` and with `torchrun --nproc-per-node N`.

Two sources, two moments:
- the process group (`rank`, `world_size`, `is_main_process`): what collectives will see, once
  torch.distributed is initialized;
- torchrun's environment (`launched_*`, `local_rank`): what the launcher started, readable before the
  group exists (the CLI refuses a multi-process launch of a command before any work).
"""

from __future__ import annotations

import os

import torch.distributed as dist

from mixprec.errors import MixprecError


def is_distributed() -> bool:
    """True when a default process group exists (torchrun + init_process_group)."""
    return dist.is_available() and dist.is_initialized()


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in `group` (the default group when None); 0 outside a process group."""
    return dist.get_rank(group) if is_distributed() else 0


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """How many processes `group` holds (the default group when None); 1 outside a process group."""
    return dist.get_world_size(group) if is_distributed() else 1


def is_main_process() -> bool:
    """Rank 0 of the default group (or the only process): the one that writes files and prints."""
    return rank() == 0


def launched_by_torchrun() -> bool:
    """torchrun (and torch.distributed.launch) export WORLD_SIZE and RANK to every worker."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def launched_world_size() -> int:
    """How many processes torchrun started for this job (1 outside torchrun); readable before any work."""
    if not launched_by_torchrun():
        return 1
    try:
        return int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise MixprecError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


def launched_rank() -> int:
    """This process's rank in the job torchrun started (0 outside torchrun): the one that prints."""
    return int(os.environ.get("RANK", "0")) if launched_by_torchrun() else 0


def local_rank() -> int:
    """This process's rank on its node (torchrun's LOCAL_RANK; 0 outside torchrun): its GPU index."""
    return int(os.environ.get("LOCAL_RANK", "0"))


__all__ = [
    "is_distributed",
    "is_main_process",
    "launched_by_torchrun",
    "launched_rank",
    "launched_world_size",
    "local_rank",
    "rank",
    "world_size",
]
