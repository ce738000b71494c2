"""Atomic writes: a reader sees the old content or the new, never a half-written file or directory.

Everything is written under a temporary name in the destination's own directory (so the final rename
stays on one filesystem, where it is atomic) and renamed into place only once complete; on any error
the temporary is removed. Temporary names start with "." and carry a random part, so two writers of
the same path never share one, and file permissions follow the umask as any new file's do.

    write_text_atomic(path, text) / write_bytes_atomic(path, data) / write_json_atomic(path, obj)
    with atomic_file(path) as tmp: torch.save(obj, tmp)         # a writer that wants a path
    with atomic_output_dir(out_dir, force) as tmp: ...           # a whole directory, published at the end
    with resumable_output_dir(out_dir, work, "output", force, keep) as work: ...   # the same, resumable
    with staged_files(directory) as tmp: ...                     # files (e.g. a graph and its .data) moved in
    check_new_output(path, force)                                # refuse an existing output before any work
    cache_dir("kernels")                                         # mixprec's cache: $MIXPREC_CACHE_DIR or ~/.cache/mixprec
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from mixprec.errors import MixprecError

CACHE_ENV_VAR = "MIXPREC_CACHE_DIR"


def cache_dir(*parts: str) -> Path:
    """A directory under mixprec's cache ($MIXPREC_CACHE_DIR, default ~/.cache/mixprec): local dataset
    copies (datasets/NAME) and the C kernels compiled on this machine (kernels/). Not created here."""
    return Path(os.environ.get(CACHE_ENV_VAR) or "~/.cache/mixprec").expanduser().joinpath(*parts)


def check_new_output(
    path: str | os.PathLike, force: bool, *, label: str = "output", flag: str = "--force"
) -> None:
    """Refuse, before any work, to replace an existing `path` unless `force`.

    label names the path in the message ("output", "--json"); flag says how to allow replacing it.
    """
    p = Path(path)
    if p.exists() and not force:
        raise MixprecError(f"{label} {p} already exists; pass {flag} to replace it")


def _temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write; on success it is renamed onto `path`, on any error
    removed. The parent directories are created."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_name(target)
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write UTF-8 text via a temporary file in the same directory, then rename."""
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json_atomic(path: str | os.PathLike, obj: object, *, indent: int | None = 2, **dumps) -> Path:
    """json.dumps(obj, indent=indent, **dumps) and a final newline, written atomically."""
    return write_text_atomic(path, json.dumps(obj, indent=indent, **dumps) + "\n")


def replace_dir(new: Path, target: Path) -> None:
    """Rename the finished directory `new` to `target`. An existing `target` is first renamed aside and
    removed afterwards, so `target` is never a mix of old and new files."""
    if not target.exists():
        os.replace(new, target)
        return
    old = _temporary_name(target).with_suffix(".old")
    os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


def _missing_parents(path: Path) -> list[Path]:
    """The folders above `path` that do not exist yet, deepest first."""
    parent = path.parent.absolute()
    return [p for p in (parent, *parent.parents) if not p.exists()]


def _remove_created(created: list[Path]) -> None:
    for p in created:
        try:
            p.rmdir()  # only if empty: something another process put there stays
        except OSError:
            break


@contextmanager
def atomic_output_dir(output_dir: str | os.PathLike, force: bool) -> Iterator[Path]:
    """Yield a temporary directory beside `output_dir`; on success it replaces `output_dir`, on any
    error it is removed, and so are the parent folders this call created, leaving nothing behind."""
    output_dir = Path(output_dir)
    created = _missing_parents(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)

    def remove_created() -> None:
        _remove_created(created)

    tmp = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.tmp-", dir=output_dir.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_created()
        raise
    if output_dir.exists() and not force:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_created()
        raise MixprecError(
            f"output {output_dir} appeared while it was being written; pass --force to replace it"
        )
    replace_dir(tmp, output_dir)


@contextmanager
def resumable_output_dir(
    output_dir: str | os.PathLike, work_dir: str | os.PathLike, subdir: str, force: bool,
    keep: Callable[[BaseException], bool],
) -> Iterator[Path]:  # fmt: skip
    """atomic_output_dir for work that resumes after a kill: yields `work_dir` (a fixed place beside
    `output_dir`, made if missing, its content kept); once the body completes, `work_dir/subdir` replaces
    `output_dir` and `work_dir` is removed. On an error for which keep(error) is true `work_dir` stays,
    for a later run to continue; on any other error it is removed, with the parent folders this call
    created."""
    output_dir, work_dir = Path(output_dir), Path(work_dir)
    created = _missing_parents(output_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        yield work_dir
    except BaseException as e:
        if not keep(e):
            shutil.rmtree(work_dir, ignore_errors=True)
            _remove_created(created)
        raise
    if output_dir.exists() and not force:
        raise MixprecError(
            f"output {output_dir} appeared while it was being written; pass --force to replace it "
            f"(the finished run stays in {work_dir}: pass --resume --force to publish it)"
        )
    replace_dir(work_dir / subdir, output_dir)
    shutil.rmtree(work_dir, ignore_errors=True)


@contextmanager
def staged_files(directory: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder inside `directory`; on success every file written into it is renamed
    into `directory` (each rename atomic), for writers that produce a file together with side files
    named after it (an ONNX graph and its external `.data`, a tokenizer's files). The folder is removed
    either way."""
    dest = Path(directory)
    dest.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest, prefix=".staged-"))
    try:
        yield tmp
        for f in sorted(tmp.iterdir()):
            os.replace(f, dest / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = [
    "atomic_file",
    "atomic_output_dir",
    "check_new_output",
    "replace_dir",
    "resumable_output_dir",
    "staged_files",
    "write_bytes_atomic",
    "write_json_atomic",
    "write_text_atomic",
]
