"""Shard files written around the page cache (checkpoint/direct_file.py) hold exactly the bytes given,
whatever their lengths, with O_DIRECT, without it, and where the file system refuses it; the shard
writer's sha256 is the file's."""

from __future__ import annotations

import errno
import hashlib
import os

import pytest
import torch

from mixprec.inference.checkpoint import direct_file
from mixprec.inference.checkpoint.direct_file import DIRECT_ALIGN, STAGING_BYTES, ShardFile
from mixprec.inference.checkpoint.safetensors_io import PlannedShardWriter, PlannedTensor, plan_shards

# lengths around the alignment and the staging buffer's size, and an empty write
LENGTHS = [0, 1, 7, DIRECT_ALIGN - 1, DIRECT_ALIGN, DIRECT_ALIGN + 1, 3 * DIRECT_ALIGN + 5,
           STAGING_BYTES - 3, STAGING_BYTES, STAGING_BYTES + 11, 2 * STAGING_BYTES + DIRECT_ALIGN]  # fmt: skip


def _pieces(seed: int) -> list[bytes]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).numpy().tobytes() for n in LENGTHS]


def _written(path, direct: bool, seed: int) -> tuple[ShardFile, bytes]:
    """A ShardFile given the pieces of `seed`, closed; (it, the bytes given)."""
    pieces = _pieces(seed)
    f = ShardFile(path, direct=direct)
    for p in pieces:
        f.write(memoryview(p))
    f.close()
    return f, b"".join(pieces)


@pytest.mark.parametrize("direct", [True, False])
def test_shard_file_holds_exactly_the_bytes_given(tmp_path, direct):
    path = tmp_path / "shard.safetensors"
    f, given = _written(path, direct, 0)
    assert path.read_bytes() == given
    f.close()  # a second close does nothing


def test_staged_writes_hold_exactly_the_bytes_given_on_any_file_system(tmp_path, monkeypatch):
    """The staging, padding and truncation of direct writes, whatever tmp_path's file system (tmpfs
    refuses O_DIRECT, so the test above may run buffered there): the flag opened as 0."""
    monkeypatch.setattr(direct_file.os, "O_DIRECT", 0, raising=False)
    path = tmp_path / "shard.safetensors"
    f, given = _written(path, True, 1)
    assert f.direct  # staged all the way: no fallback taken
    assert path.read_bytes() == given


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_refused_o_direct_falls_back_to_buffered_writes(tmp_path, monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_file.os, "open", refusing_open)
    path = tmp_path / "s.safetensors"
    f = ShardFile(path, direct=True)
    assert not f.direct
    f.write(memoryview(b"x" * 5000))
    f.close()
    assert path.read_bytes() == b"x" * 5000


def test_switch_turns_direct_writes_off(monkeypatch):
    monkeypatch.setenv("MIXPREC_DIRECT_WRITES", "0")
    assert not direct_file.direct_writes_enabled()
    monkeypatch.setenv("MIXPREC_DIRECT_WRITES", "1")
    assert direct_file.direct_writes_enabled() == hasattr(os, "O_DIRECT")


def test_abort_closes_without_writing_the_staged_bytes(tmp_path):
    path = tmp_path / "s.safetensors"
    f = ShardFile(path, direct=True)
    f.write(memoryview(b"y" * 100))
    f.abort()
    assert path.stat().st_size == (0 if f.direct else 100)
    f.close()  # nothing left to do


@pytest.mark.parametrize("direct", ["1", "0"])
def test_shard_writer_hash_is_the_files_sha256(tmp_path, monkeypatch, direct):
    monkeypatch.setenv("MIXPREC_DIRECT_WRITES", direct)
    gen = torch.Generator().manual_seed(1)
    tensors = {
        "a": torch.randn(3, 1000, generator=gen),
        "b": torch.randint(0, 256, (STAGING_BYTES + 17,), dtype=torch.uint8, generator=gen),
        "c": torch.randn(5, generator=gen).to(torch.bfloat16),
    }
    planned = [PlannedTensor(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    seen = {}
    writer = PlannedShardWriter(tmp_path, plan_shards(planned, 2 << 20),
                                on_shard=lambda i, path, sha: seen.setdefault(path, sha))  # fmt: skip
    for n, t in tensors.items():
        writer.write(n, t)
    writer.close()
    assert len(seen) == 3  # a; b, over the shard size alone; c
    for path, sha in seen.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == sha
    from safetensors.torch import load_file

    loaded = {}
    for path in seen:
        loaded.update(load_file(path))
    for n, t in tensors.items():
        assert torch.equal(loaded[n], t)


def test_a_bad_switch_value_is_refused_before_any_work(llama_dir, tmp_path, monkeypatch, capsys):
    from mixprec.cli import main

    monkeypatch.setenv("MIXPREC_DIRECT_WRITES", "false")
    assert (
        main(
            [
                "quantize",
                "--model",
                str(llama_dir),
                "--output",
                str(tmp_path / "q"),
                "--scheme",
                "fp8-dynamic",
            ]
        )
        == 2
    )
    assert "MIXPREC_DIRECT_WRITES='false': expected 1" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_a_refused_direct_write_goes_on_through_the_page_cache(tmp_path, monkeypatch):
    """A file system that opens with O_DIRECT but refuses a write (EINVAL): the file still holds every byte."""
    real_write = os.write
    calls = []

    def write_refusing_the_second(fd, data):
        calls.append(len(data))
        if len(calls) == 2:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(direct_file.os, "write", write_refusing_the_second)
    data = _pieces(2)
    path = tmp_path / "s.safetensors"
    f = ShardFile(path, direct=True)
    direct = f.direct
    for p in data:
        f.write(memoryview(p))
    f.close()
    assert path.read_bytes() == b"".join(data)
    if direct:  # the file system took O_DIRECT: the refusal switched the rest to buffered writes
        assert not f.direct and calls[0] == STAGING_BYTES
