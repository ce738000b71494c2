"""Rounded weights kept on disk between the block walk that makes them and the writer that stores them
(GPTQ on a checkpoint): memory holds the block at hand, not every block's results.

`SpilledResults` is a mapping {Linear name: QuantizedTensor}. Items set go to a pending dict; `flush()`
(at the end of each block) writes them to one safetensors file in a private temporary directory and
forgets their tensors; reading an item reads its tensors back with positioned reads (ShardReader). The
payload, scales and global scale are stored as they are, so what comes back is bit-identical; the format,
granularity and shape stay in memory. The directory is removed by `close()` (or when the object is
collected).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from mixprec.formats import Format
from mixprec.inference.checkpoint.safetensors_io import ShardReader, TensorInfo, read_tensor_infos
from mixprec.scaling import Granularity, QuantizedTensor


@dataclass(frozen=True)
class _Stored:
    data: TensorInfo
    scale: TensorInfo
    global_scale: TensorInfo | None
    fmt: Format
    granularity: Granularity
    shape: torch.Size


class SpilledResults(Mapping[str, QuantizedTensor]):
    """{name: QuantizedTensor} whose flushed tensors live in safetensors files in a temporary directory
    created inside `directory` (None: the system's temporary directory)."""

    def __init__(self, directory: Path | None = None) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix=".mixprec-spill-", dir=directory)
        self.root = Path(self._tmp.name)
        self._pending: dict[str, QuantizedTensor] = {}
        self._stored: dict[str, _Stored] = {}
        self._reader = ShardReader()
        self._files = 0

    def __setitem__(self, name: str, q: QuantizedTensor) -> None:
        self._stored.pop(name, None)
        self._pending[name] = q

    def flush(self) -> None:
        """Write the pending items to one file and drop them from memory."""
        if not self._pending:
            return
        path = self.root / f"part-{self._files:05d}.safetensors"
        self._files += 1
        tensors: dict[str, torch.Tensor] = {}
        for name, q in self._pending.items():
            tensors[f"{name}|data"] = q.data.contiguous()
            tensors[f"{name}|scale"] = q.scale.contiguous()
            if q.global_scale is not None:
                tensors[f"{name}|global_scale"] = q.global_scale.contiguous()
        save_file(tensors, str(path))
        infos = read_tensor_infos(path)
        for name, q in self._pending.items():
            self._stored[name] = _Stored(
                infos[f"{name}|data"], infos[f"{name}|scale"], infos.get(f"{name}|global_scale"), q.fmt,
                q.granularity, q.shape,
            )  # fmt: skip
        self._pending.clear()

    def __getitem__(self, name: str) -> QuantizedTensor:
        if name in self._pending:
            return self._pending[name]
        s = self._stored[name]
        g = self._reader.get(s.global_scale) if s.global_scale is not None else None
        return QuantizedTensor(
            self._reader.get(s.data), self._reader.get(s.scale), s.fmt, s.granularity, s.shape, g
        )

    def __contains__(self, name: object) -> bool:
        return name in self._pending or name in self._stored

    def __iter__(self) -> Iterator[str]:
        yield from self._stored
        yield from (n for n in self._pending if n not in self._stored)

    def __len__(self) -> int:
        return len(self._stored) + len(self._pending)

    def close(self) -> None:
        self._reader.close()
        self._tmp.cleanup()


__all__ = ["SpilledResults"]
