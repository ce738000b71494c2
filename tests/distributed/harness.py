"""Run a function on N CPU processes with the gloo backend (torch.multiprocessing spawn).

Spawning costs several seconds per process (each one imports torch), so a test module spawns ONCE and
runs all its scenarios inside one process group; every rank writes its results to a file that the
parent reads back (torch.save of plain tensors/lists, read with weights_only=True).
"""

from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, out_dir: str, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # 2 ranks on 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = fn(rank, world, *args)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    except Exception:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world: int, out_dir: Path, *args) -> list:
    """fn(rank, world, *args) on `world` processes; returns the per-rank results (rank order)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        mp.spawn(_entry, args=(world, free_port(), fn, str(out_dir), args), nprocs=world, join=True)
    except Exception as exc:
        errors = "\n".join(p.read_text() for p in sorted(out_dir.glob("rank*.err")))
        raise AssertionError(f"distributed worker failed:\n{errors or exc}") from None
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(world)]
