"""A shard file written around the page cache (O_DIRECT), where the file system allows it.

Why: on the project's 2-CPU VM (Firecracker guest, ext4 on virtio, 2026-12-07), sustained buffered
writes of a 3 GB file ran at 0.30-1.29 GB/s, while the same bytes written with O_DIRECT from an aligned
buffer ran at 1.33-1.69 GB/s and a kernel-side copy (copy_file_range, what a plain copy of the files
does) at 1.49-3.17 GB/s (bench/write_speed.py). Streaming quantization is mostly writing, so the page
cache's path set its pace.

O_DIRECT needs the buffer's address, each write's length and its file offset aligned to the device's
block size. The bytes given are gathered in an aligned staging buffer (anonymous mmap: page aligned) and
written in whole staging buffers; the last, partial one is padded to the alignment and the file is then
truncated to its true length. Where O_DIRECT is refused (a file system without it, a platform without
the flag, a write the file system rejects) or switched off, the file is written through the page cache.
The bytes on disk are the same either way.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

from mixprec.errors import MixprecError

# Every O_DIRECT write's length and offset is a multiple of this (a 4 KiB block covers the 512-byte and
# 4 KiB logical blocks of common devices); the staging buffer is a multiple of it.
DIRECT_ALIGN = 4096
STAGING_BYTES = 8 << 20
# MIXPREC_DIRECT_WRITES=0 writes shards through the page cache (e.g. to compare the two).
_SWITCH = "MIXPREC_DIRECT_WRITES"


def direct_writes_enabled() -> bool:
    """Whether shard files are written with O_DIRECT: where the platform has it, unless $MIXPREC_DIRECT_WRITES
    is "0". MixprecError for any other value than "0" or "1" (commands check it before any work)."""
    value = os.environ.get(_SWITCH, "1").strip()
    if value not in ("0", "1"):
        raise MixprecError(
            f"{_SWITCH}={value!r}: expected 1 (write shards around the page cache) or 0 (through it)"
        )
    return hasattr(os, "O_DIRECT") and value == "1"


class ShardFile:
    """A new file (truncated if it exists) taking bytes in order: write(data), then close()."""

    def __init__(self, path: Path, direct: bool | None = None):
        self.path = path
        self.direct = direct_writes_enabled() if direct is None else direct
        self._fd = -1
        if self.direct:
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o666)
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                self.direct = False  # the file system refuses O_DIRECT: buffered below
        if not self.direct:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        self._stage = mmap.mmap(-1, STAGING_BYTES) if self.direct else None
        self._view = memoryview(self._stage) if self._stage is not None else None
        self._used = 0  # bytes gathered in the staging buffer
        self._size = 0  # bytes given so far: the file's length once closed

    def write(self, data: memoryview) -> None:
        data = memoryview(data).cast("B")
        self._size += len(data)
        while len(data) and self.direct:
            take = min(len(data), STAGING_BYTES - self._used)
            self._view[self._used : self._used + take] = data[:take]
            self._used += take
            data = data[take:]
            if self._used == STAGING_BYTES:
                self._write_staged(STAGING_BYTES)
        if not self.direct:  # never direct, or switched to buffered by a refused write
            _write_all(self._fd, data)

    def close(self) -> None:
        """Write what is staged and close; the file then holds exactly the bytes given."""
        if self._fd < 0:
            return
        try:
            if self.direct and self._used:
                padded = -(-self._used // DIRECT_ALIGN) * DIRECT_ALIGN
                self._view[self._used : padded] = bytes(padded - self._used)
                self._write_staged(padded)
                os.ftruncate(self._fd, self._size)
        finally:
            self._release()

    def _write_staged(self, nbytes: int) -> None:
        """The staged bytes to the file (nbytes: their length, padded to the alignment at the end)."""
        done = 0
        while done < nbytes:
            try:
                n = os.write(self._fd, self._view[done:nbytes])
            except OSError as e:
                # a file system that took O_DIRECT at open time but refuses this write: the rest of the
                # file goes through the page cache, from the first byte not yet written
                if e.errno != errno.EINVAL:
                    raise
                import fcntl  # Linux only, as O_DIRECT

                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False
                _write_all(self._fd, self._view[done : max(done, self._used)])
                break
            if n <= 0:
                raise OSError(errno.EIO, "short write")
            done += n
        self._used = 0

    def abort(self) -> None:
        """Close without writing what is staged (the file is incomplete and will be removed)."""
        self._release()

    def _release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
        if self._stage is not None:
            self._view.release()
            self._stage.close()
            self._stage = self._view = None


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        n = os.write(fd, data)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        data = data[n:]


__all__ = ["DIRECT_ALIGN", "STAGING_BYTES", "ShardFile", "direct_writes_enabled"]
