"""The base services: atomic writes leave the old content or the new, never a part, and no temporary
behind; an existing output is refused without force; progress bars cost nothing when disabled."""

from __future__ import annotations

import io
import json

import pytest

from mixprec.errors import MixprecError
from mixprec.files import (
    atomic_file,
    atomic_output_dir,
    check_new_output,
    staged_files,
    write_json_atomic,
    write_text_atomic,
)
from mixprec.progress import ProgressBars, progress_bar


def test_atomic_file_replaces_whole_or_not_at_all(tmp_path):
    path = tmp_path / "sub" / "a.json"
    write_json_atomic(path, {"x": 1})  # parents created
    assert path.read_text() == '{\n  "x": 1\n}\n'
    with pytest.raises(RuntimeError), atomic_file(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert json.loads(path.read_text()) == {"x": 1}  # the old content, untouched
    write_text_atomic(path, "new")
    assert path.read_text() == "new"
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.json"]  # no temporary left


def test_output_dir_is_published_at_the_end_and_nothing_is_left_on_error(tmp_path):
    out = tmp_path / "deep" / "er" / "out"
    with pytest.raises(RuntimeError), atomic_output_dir(out, force=False) as tmp:
        (tmp / "w.bin").write_bytes(b"1")
        raise RuntimeError("interrupted")
    assert not (tmp_path / "deep").exists()  # the parents it created are gone too
    with atomic_output_dir(out, force=False) as tmp:
        (tmp / "w.bin").write_bytes(b"1")
        assert not out.exists()  # not visible before it is complete
    assert [p.name for p in out.iterdir()] == ["w.bin"]
    with atomic_output_dir(out, force=True) as tmp:
        (tmp / "v.bin").write_bytes(b"2")
    assert [p.name for p in out.iterdir()] == ["v.bin"]  # replaced, not merged
    assert [p.name for p in out.parent.iterdir()] == ["out"]


def test_staged_files_move_in_beside_what_is_there(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"w")
    with staged_files(tmp_path) as tmp:
        (tmp / "graph.onnx").write_bytes(b"g")
        (tmp / "graph.onnx.data").write_bytes(b"d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graph.onnx", "graph.onnx.data", "weights.bin"]


def test_existing_output_needs_force(tmp_path):
    check_new_output(tmp_path / "new", force=False)
    with pytest.raises(MixprecError, match=r"--json .* already exists; pass --force to replace it"):
        check_new_output(tmp_path, force=False, label="--json")
    check_new_output(tmp_path, force=True)


def test_progress_bars_disabled_and_enabled(monkeypatch):
    with ProgressBars(False) as bars:
        bar = bars.add("nothing shown", total=3)
        bar.advance()
        bar.update(completed=3)
    with progress_bar(False, "nothing", 2) as advance:
        advance()
    import rich.progress

    buf = io.StringIO()
    real = rich.progress.Progress

    def to_buffer(*columns, **kwargs):
        from rich.console import Console

        return real(*columns, console=Console(file=buf, force_terminal=False, width=100), **kwargs)

    monkeypatch.setattr(rich.progress, "Progress", to_buffer)
    with progress_bar(True, "quantizing", 2) as advance:
        advance()
        advance()
    assert "quantizing" in buf.getvalue() and "2/2" in buf.getvalue()
