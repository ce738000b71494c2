"""Safetensors checkpoints: find and validate shards, read tensor by tensor with bounded memory, write
planned shards incrementally (into a directory mixprec.files.atomic_output_dir publishes at the end).

Reading: `ShardReader` reads each tensor's bytes with positioned reads (os.preadv) at the offsets the
validated headers give, into memory the tensor owns or into a buffer the caller reuses: no memory map,
so the process RSS holds the tensors at hand and nothing of the shard, and a reused buffer costs no
page faults.

Writing: the whole output is planned before any tensor is produced (names, dtypes, shapes are known
from the input headers and the scheme), so each shard's header is written first and every tensor's
bytes are appended as soon as it exists; nothing is buffered beyond the tensor at hand.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mixprec.errors import MixprecError
from mixprec.files import check_new_output
from mixprec.inference.checkpoint.direct_file import ShardFile

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
INDEX_NAME = "model.safetensors.index.json"

# safetensors dtype names <-> torch dtypes
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The bytes a tensor of this shape and dtype takes in a shard (a 0-dim tensor: one element)."""
    return math.prod(shape) * dtype.itemsize


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    shard: Path
    offset: int = -1  # where the tensor's bytes start in the shard file (-1: unknown)

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.dtype)

    @property
    def stored_nbytes(self) -> int:
        """The bytes the input files hold for this tensor."""
        return self.nbytes


@dataclass(frozen=True)
class ComputedTensor(TensorInfo):
    """A tensor the files do not hold as such, computed from stored ones when ShardReader.get reads it
    (an FP8 weight and its block scales read as bf16: checkpoint/fp8_block_input.py). It has no byte
    range of its own: it is read whole, never by range."""

    def compute(self, reader: ShardReader, out: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class Checkpoint:
    """A validated safetensors checkpoint directory."""

    root: Path
    shards: list[Path]
    tensors: dict[str, TensorInfo]  # in file order, shard by shard
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def largest_shard_bytes(self) -> int:
        return max(p.stat().st_size for p in self.shards)

    @property
    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.shards)


def _read_header(path: Path) -> tuple[dict, int]:
    """Parse and check a safetensors header without reading data: (header, data_start)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("file shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100 << 20):
                raise ValueError(f"header length {n} exceeds the file")
            header = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError) as e:
        raise MixprecError(f"{path}: not a valid safetensors file (corrupt header: {e})") from None
    if not isinstance(header, dict):
        raise MixprecError(f"{path}: not a valid safetensors file (header is not a JSON object)")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            a, b = info["data_offsets"]
            if info["dtype"] not in _DTYPES:
                raise MixprecError(f"{path}: tensor {name!r} has dtype {info['dtype']} mixprec does not read")
            numel = 1
            for d in info["shape"]:
                numel *= int(d)
            ok = (
                isinstance(a, int)
                and isinstance(b, int)
                and a >= 0
                and b - a == numel * _DTYPES[info["dtype"]].itemsize
            )
        except (KeyError, TypeError, ValueError):
            raise MixprecError(f"{path}: tensor {name!r} has a malformed header entry") from None
        if not ok:
            raise MixprecError(
                f"{path}: not a valid safetensors file (corrupt header: tensor {name!r} has data_offsets "
                f"{info['data_offsets']} for shape {info['shape']} {info['dtype']})"
            )
        end = max(end, b)
    if 8 + n + end > size:
        raise MixprecError(
            f"{path}: truncated safetensors file ({size} bytes, the header needs {8 + n + end}); "
            "re-download or re-save the checkpoint"
        )
    return header, 8 + n


def open_checkpoint(model_dir: str | os.PathLike) -> Checkpoint:
    """Find the safetensors shards of a Hugging Face model directory and validate their headers."""
    root = Path(model_dir)
    if not root.exists():
        raise MixprecError(f"model directory {root} does not exist")
    if not root.is_dir():
        raise MixprecError(f"{root} is not a directory (expected a Hugging Face model directory)")
    index = root / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise MixprecError(f"{index}: malformed index ({e})") from None
        names = list(dict.fromkeys(weight_map.values()))
        shards = [root / n for n in names]
        for s in shards:
            if not s.exists():
                raise MixprecError(f"{index} lists shard {s.name}, which is missing from {root}")
    else:
        shards = sorted(root.glob("*.safetensors"))
    if not shards:
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise MixprecError(
                f"{root} holds only pickle checkpoints ({', '.join(pickles[:3])}); mixprec never unpickles "
                "them. Convert to safetensors first, e.g. in Python: "
                "AutoModel.from_pretrained(dir, use_safetensors=False).save_pretrained(out) in a trusted environment"
            )
        raise MixprecError(f"{root} has no .safetensors files (expected model.safetensors or shards + index)")
    tensors: dict[str, TensorInfo] = {}
    metadata: dict[str, str] = {}
    for shard in shards:
        header, data_start = _read_header(shard)
        metadata.update(header.get("__metadata__") or {})
        for name, info in _infos(shard, header, data_start).items():
            if name in tensors:
                raise MixprecError(
                    f"tensor {name!r} appears in both {tensors[name].shard.name} and {shard.name}"
                )
            tensors[name] = info
    return Checkpoint(root, shards, tensors, metadata)


def read_tensor_infos(path: Path) -> dict[str, TensorInfo]:
    """{name: TensorInfo} of one safetensors file, from its validated header."""
    return _infos(path, *_read_header(path))


def _infos(shard: Path, header: dict, data_start: int) -> dict[str, TensorInfo]:
    return {
        name: TensorInfo(
            name, _DTYPES[info["dtype"]], tuple(info["shape"]), shard, data_start + info["data_offsets"][0]
        )
        for name, info in header.items()
        if name != "__metadata__"
    }


def read_buffer(nbytes: int, out: torch.Tensor | None, name: str) -> torch.Tensor:
    """`nbytes` of `out` (a contiguous uint8 buffer at least that long) to read `name` into, or new memory."""
    if out is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() < nbytes:
        raise RuntimeError(f"read buffer too small or not contiguous uint8 for {name!r}")
    return out.view(-1)[:nbytes]


class ShardReader:
    """Reads tensors with positioned reads at their header offsets; safe to share between threads.

    `get(info)` returns a tensor owning its memory; `get(info, out=buffer)` reads into the first
    info.nbytes bytes of a reusable uint8 buffer and returns a view of it; `read_range` reads a byte
    range of a tensor (to stream a big tensor through a small buffer).
    """

    def __init__(self) -> None:
        self._files: dict[Path, object] = {}
        self._lock = threading.Lock()

    def _file(self, path: Path):
        with self._lock:
            f = self._files.get(path)
            if f is None:
                try:
                    f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed in close()
                except OSError as e:
                    raise MixprecError(f"{path}: cannot read safetensors file ({e})") from None
                self._files[path] = f
            return f

    def read_range(self, info: TensorInfo, start: int, out: memoryview) -> None:
        """Fill `out` with the tensor's bytes from byte `start` on."""
        if isinstance(info, ComputedTensor):
            raise RuntimeError(f"tensor {info.name!r} is computed when read: read it whole (get)")
        if info.offset < 0:
            raise RuntimeError(f"tensor {info.name!r} has no known file offset")
        f = self._file(info.shard)
        pos, done, want = info.offset + start, 0, len(out)
        try:
            while done < want:
                if hasattr(os, "preadv"):
                    n = os.preadv(f.fileno(), [out[done:]], pos + done)
                else:  # platforms without preadv: one reader at a time
                    with self._lock:
                        f.seek(pos + done)
                        n = f.readinto(out[done:])
                if not n:
                    raise MixprecError(
                        f"{info.shard}: truncated safetensors file (tensor {info.name!r} ends past the end of the file)"
                    )
                done += n
        except OSError as e:
            raise MixprecError(f"{info.shard}: cannot read tensor {info.name!r} ({e})") from None

    def get(self, info: TensorInfo, out: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(info, ComputedTensor):
            return info.compute(self, out)
        nbytes = info.nbytes
        buf = read_buffer(nbytes, out, info.name)
        if nbytes:
            self.read_range(info, 0, memoryview(buf.numpy()))
        return buf.view(info.dtype).view(info.shape)

    def get_rows(self, info: TensorInfo, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows` (sorted, distinct int64 indices along dim 0) of a tensor, as a new tensor
        [len(rows), *shape[1:]]: only their bytes are read, one read per run of consecutive rows."""
        if len(info.shape) < 1:
            raise RuntimeError(f"tensor {info.name!r} has no rows")
        row_bytes = tensor_nbytes(info.shape[1:], info.dtype)
        out = torch.empty(len(rows) * row_bytes, dtype=torch.uint8)
        view = memoryview(out.numpy())
        picked = rows.tolist()
        start = 0
        while start < len(picked):
            end = start + 1  # [start, end): a run of consecutive rows, read at once
            while end < len(picked) and picked[end] == picked[end - 1] + 1:
                end += 1
            self.read_range(info, picked[start] * row_bytes, view[start * row_bytes : end * row_bytes])
            start = end
        return out.view(info.dtype).view(len(picked), *info.shape[1:])

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------
# Writing


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.dtype)


def plan_shards(tensors: list[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Group tensors in order into shards of at most max_shard_bytes (a bigger tensor gets its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def shard_header(tensors: list[PlannedTensor], metadata: dict[str, str]) -> bytes:
    """The JSON header of a planned shard, padded as written (the file is 8 length bytes, this, then
    the tensors' bytes): what PlannedShardWriter writes, and what a quantize plan sizes."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": _NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * ((-len(raw)) % 8)  # data aligned to 8 bytes, as safetensors writes it


def shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


class PlannedShardWriter:
    """Writes planned shards: header first, then each tensor's bytes the moment it is given.

    Tensors must be given in plan order. Each is checked against its plan (name, dtype, shape).
    Once a shard file is complete and closed, `on_shard(index, path, sha256)` is called (a resumable
    producer records it): the file's sha256 is computed from the bytes as they are written, so a
    finished shard is never read back to be hashed. `skip_shards`: the shards this writer does not write (a resumed run's finished ones,
    or the shards other ranks write): tensors planned in them are accepted and dropped.
    """

    def __init__(
        self, out_dir: Path, shards: list[list[PlannedTensor]], metadata: dict[str, str] | None = None,
        *, skip_shards: Collection[int] = (), on_shard: Callable[[int, Path, str], None] | None = None,
    ):  # fmt: skip
        self.out_dir = out_dir
        self.shards = shards
        self.names = shard_names(len(shards))
        self.metadata = {"format": "pt", **(metadata or {})}
        skip = set(skip_shards)
        self._planned = [(i, t) for i, shard in enumerate(shards) for t in shard]
        self._order = [(i, t) for i, t in self._planned if i not in skip]
        self._pos = 0
        self._dropped = {t.name for i, t in self._planned if i in skip}
        self._on_shard = on_shard
        self._file = None
        self._hash = None  # the open shard's sha256 so far (only when on_shard wants it)
        self._shard = -1

    def _finish_shard(self) -> None:
        """Close the open shard and report it."""
        f, self._file = self._file, None
        f.close()
        if self._hash is not None:
            digest, self._hash = self._hash.finish(), None
            self._on_shard(self._shard, self.out_dir / self.names[self._shard], digest)

    def _open_shard(self, i: int) -> None:
        if self._file is not None:
            self._finish_shard()
        raw = shard_header(self.shards[i], self.metadata)
        self._file = ShardFile(self.out_dir / self.names[i])  # closed in _finish_shard / abort
        self._shard = i
        self._hash = _ShardHash() if self._on_shard is not None else None
        self._emit(struct.pack("<Q", len(raw)))
        self._emit(raw)

    def _emit(self, data) -> None:
        view = memoryview(data).cast("B")
        # the shard's sha256 on the hashing thread while this one writes the same bytes (both release
        # the GIL); the hash has seen them before `data` is handed back to its owner
        hashed = self._hash.submit(view) if self._hash is not None else None
        self._file.write(view)
        if hashed is not None:
            hashed.result()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._dropped:  # planned in a shard a resumed run already holds
            return
        if self._pos >= len(self._order):
            raise RuntimeError(f"tensor {name!r} was not planned")
        i, plan = self._order[self._pos]
        if plan.name != name or plan.dtype != tensor.dtype or tuple(plan.shape) != tuple(tensor.shape):
            raise RuntimeError(
                f"tensor {name} {tensor.dtype} {tuple(tensor.shape)} does not match the plan "
                f"{plan.name} {plan.dtype} {plan.shape}"
            )
        if i != self._shard:
            self._open_shard(i)
        t = tensor.detach().contiguous().cpu()
        if t.numel():
            self._emit(memoryview(t.view(-1).view(torch.uint8).numpy()))
        self._pos += 1

    def write_chunks(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...], chunks: Iterable[memoryview]
    ) -> None:
        """Write a planned tensor from its raw bytes, given in pieces (streamed, never whole in memory)."""
        if name in self._dropped:
            return
        if self._pos >= len(self._order):
            raise RuntimeError(f"tensor {name!r} was not planned")
        i, plan = self._order[self._pos]
        if plan.name != name or plan.dtype != dtype or tuple(plan.shape) != tuple(shape):
            raise RuntimeError(f"tensor {name} {dtype} {tuple(shape)} does not match the plan "
                               f"{plan.name} {plan.dtype} {plan.shape}")  # fmt: skip
        if i != self._shard:
            self._open_shard(i)
        written = 0
        for chunk in chunks:
            self._emit(chunk)
            written += len(chunk)
        if written != plan.nbytes:
            raise RuntimeError(f"tensor {name}: {written} bytes written, {plan.nbytes} planned")
        self._pos += 1

    def close(self) -> dict[str, str]:
        """Finish; returns the weight map (tensor name -> shard file name)."""
        if self._pos != len(self._order):
            missing = self._order[self._pos][1].name
            raise RuntimeError(f"output incomplete: tensor {missing!r} was never written")
        if self._file is not None:
            self._finish_shard()
        return {t.name: self.names[i] for i, t in self._planned}

    def abort(self) -> None:
        if self._file is not None:
            self._file.abort()
            self._file = None
        if self._hash is not None:
            self._hash.finish()
            self._hash = None


class _ShardHash:
    """A shard's sha256, computed on a thread of its own from the bytes given, in order."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mixprec-shard-hash")

    def submit(self, data: memoryview) -> Future:
        return self._thread.submit(self._sha.update, data)

    def finish(self) -> str:
        self._thread.shutdown(wait=True)
        return self._sha.hexdigest()


def read_chunks(reader: ShardReader, info: TensorInfo, buf: torch.Tensor) -> Iterator[memoryview]:
    """A tensor's bytes in pieces of len(buf) bytes, each read into `buf` (uint8) and handed out as a
    view of it: a tensor copied to a PlannedShardWriter.write_chunks without being whole in memory."""
    view = memoryview(buf.numpy())
    for start in range(0, info.nbytes, len(buf)):
        n = min(len(buf), info.nbytes - start)
        reader.read_range(info, start, view[:n])
        yield view[:n]


def index_text(weight_map: dict[str, str], total_size: int) -> str | None:
    """model.safetensors.index.json's text (None for a single shard, which has no index)."""
    if len(set(weight_map.values())) <= 1:
        return None
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(index, indent=2) + "\n"


def write_index(out_dir: Path, weight_map: dict[str, str], total_size: int) -> None:
    text = index_text(weight_map, total_size)
    if text is not None:
        (out_dir / INDEX_NAME).write_text(text)


# ---------------------------------------------------------------------------------------------------
# Output directory


def check_output(model_dir: Path, output_dir: Path, force: bool) -> None:
    src, dst = model_dir.resolve(), output_dir.resolve()
    if src == dst:
        raise MixprecError(f"output {output_dir} is the input directory; mixprec never modifies its input")
    if src in dst.parents:
        raise MixprecError(
            f"output {output_dir} is inside the input directory {model_dir}; choose another place"
        )
    if dst in src.parents:
        raise MixprecError(
            f"output {output_dir} contains the input directory {model_dir}; choose another place"
        )
    check_new_output(output_dir, force, flag="--force (force=True)")
    if output_dir.exists() and not output_dir.is_dir():
        raise MixprecError(f"output {output_dir} exists and is not a directory")


def copy_side_files(model_dir: Path, out_dir: Path, skip: set[str]) -> list[str]:
    """Copy tokenizer, generation config and other small non-weight files (not config.json, shards,
    index, pickles, which the writer produces or refuses)."""
    copied = []
    for p in side_files(model_dir, skip):
        shutil.copy2(p, out_dir / p.name)
        copied.append(p.name)
    return copied


def side_files(model_dir: Path, skip: set[str]) -> list[Path]:
    """The files copy_side_files copies, in order."""
    out = []
    for p in sorted(model_dir.iterdir()):
        if not p.is_file() or p.name in skip or p.suffix == ".safetensors" or p.suffix in PICKLE_SUFFIXES:
            continue
        if p.name in (INDEX_NAME, "config.json", "model.fp8_scales.json", "fp8_scales.json"):
            continue
        out.append(p)
    return out
