"""The ```python examples of the quick docs pages run as written (in order, one namespace per page).

Only pages whose examples together take a few seconds are run here; the slower pages (train, quantize,
evaluate, onnx: tiny models, but training steps, calibration, exports) are checked by running their
examples by hand before a release (see the report of the docs check)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
FAST_PAGES = ("formats.md", "recipes.md")
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: str) -> list[tuple[int, str]]:
    text = (DOCS / page).read_text(encoding="utf-8")
    return [(text[: m.start()].count("\n") + 1, m.group(1)) for m in _BLOCK.finditer(text)]


@pytest.mark.parametrize("page", FAST_PAGES)
def test_page_examples_run(page, tmp_path, monkeypatch):
    blocks = python_blocks(page)
    assert blocks, f"docs/{page} has no python examples"
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    namespace: dict = {"__name__": "__docs__"}
    for line, code in blocks:
        exec(compile(code, f"docs/{page}:{line}", "exec"), namespace)
