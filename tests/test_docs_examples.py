"""Every ```python and ```bash example of docs/ runs as written: in page order, in a fresh directory per page.

Python blocks of a page share one namespace (exec, in this process); bash blocks run with
`bash -euo pipefail` in the same directory, with this Python's bin directory first on PATH (so `mixprec`
and `torchrun` are the ones installed here) and MPLBACKEND=Agg. An HTML comment on the line before a
block (blank lines between are allowed) changes what happens to it:

    <!-- docs-test: skip: REASON -->     not run; the reason (required) says why and how it is checked
    <!-- docs-test: file: NAME -->       the block is written to NAME in the page's directory, not run

Any other docs-test comment, or one that is not right before a python/bash block, fails the test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
# the workflow pages the README promises; each must keep runnable examples
WORKFLOW_PAGES = {
    "train.md",
    "compare.md",
    "quantize.md",
    "evaluate.md",
    "onnx.md",
    "distributed.md",
    "serving.md",
    "checkpoints.md",
    "profile.md",
    "fp4.md",
    "auto.md",
    "algorithms.md",
    "finetune.md",
}
# pages whose examples take more than a few seconds (training steps, calibration, exports, torchrun);
# `pytest -q` runs them too, `-m "not slow"` leaves them out
SLOW_PAGES = {
    "compare.md",
    "profile.md",
    "quantize.md",
    "evaluate.md",
    "onnx.md",
    "distributed.md",
    "serving.md",
    "checkpoints.md",
    "fp4.md",
    "auto.md",
    "algorithms.md",
}
RUN_LANGS = ("python", "bash")
BASH_TIMEOUT_S = 600

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:(.*?)-->\s*$")
_ANY_MARKER = re.compile(r"<!--\s*docs-test")


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    action: str = "run"  # run | skip | file
    arg: str = ""  # the skip reason or the file name

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


def _parse_marker(text: str, where: str) -> tuple[str, str]:
    kind, _, arg = text.strip().partition(":")
    kind, arg = kind.strip(), arg.strip()
    if kind == "skip":
        if not arg:
            raise ValueError(f"{where}: a docs-test skip needs a reason: <!-- docs-test: skip: WHY -->")
        return "skip", arg
    if kind == "file":
        if not arg or "/" in arg or arg.startswith("."):
            raise ValueError(f"{where}: docs-test file needs a plain file name, got {arg!r}")
        return "file", arg
    raise ValueError(f"{where}: unknown docs-test marker {text.strip()!r} (known: skip: WHY, file: NAME)")


def parse_page(page: str) -> list[Block]:
    """The python and bash blocks of a page, in order, with their markers; raises ValueError on a bad marker."""
    return parse_text((DOCS / page).read_text(encoding="utf-8"), page)


def parse_text(text: str, page: str) -> list[Block]:
    lines = text.splitlines()
    blocks: list[Block] = []
    used_markers: set[int] = set()
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        lang, start = fence.group(1), i
        end = start + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"docs/{page}:{start + 1}: code block never closed")
        code = "\n".join(lines[start + 1 : end]) + "\n"
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        action, arg = "run", ""
        marker = _MARKER.match(lines[j]) if j >= 0 else None
        if marker:
            action, arg = _parse_marker(marker.group(1), f"docs/{page}:{j + 1}")
            used_markers.add(j)
        if lang in RUN_LANGS:
            blocks.append(Block(page, start + 1, lang, code, action, arg))
        elif marker:
            raise ValueError(f"docs/{page}:{j + 1}: docs-test marker before a {lang or 'plain'} block")
        i = end + 1
    for n, text in enumerate(lines):
        if _ANY_MARKER.search(text) and n not in used_markers:
            raise ValueError(f"docs/{page}:{n + 1}: docs-test marker not right before a code block: {text!r}")
    return blocks


def pages_with_examples() -> list[str]:
    pages = []
    for path in sorted(DOCS.rglob("*.md")):
        text = path.read_text(encoding="utf-8")
        if any(_FENCE.match(line) and _FENCE.match(line).group(1) in RUN_LANGS for line in text.splitlines()):
            pages.append(path.relative_to(DOCS).as_posix())
    return pages


PAGES = pages_with_examples()


def test_every_workflow_page_has_examples_and_markers_are_well_formed():
    missing = WORKFLOW_PAGES - set(PAGES)
    assert not missing, f"workflow pages without python/bash examples: {sorted(missing)}"
    for page in PAGES:
        blocks = parse_page(page)  # raises on a skip without a reason, an unknown or a stray marker
        assert any(b.action != "skip" for b in blocks), f"docs/{page}: every example is skipped"


@pytest.mark.parametrize(
    "marker, message",
    [
        ("<!-- docs-test: skip -->", "needs a reason"),
        ("<!-- docs-test: skip:   -->", "needs a reason"),
        ("<!-- docs-test: sikp: typo -->", "unknown docs-test marker"),
        ("<!-- docs-test: file: ../x.py -->", "plain file name"),
        ("<!-- docs-test: skip: why -->\nsome prose", "not right before a code block"),
    ],
)
def test_bad_markers_are_refused(marker, message):
    with pytest.raises(ValueError, match=message):
        parse_text(f"# page\n\n{marker}\n\n```bash\necho hi\n```\n", "x.md")


def test_markers_apply_to_the_next_block():
    text = "<!-- docs-test: skip: slow -->\n```bash\nsleep 1\n```\n\n```python\nx = 1\n```\n"
    assert [(b.lang, b.action, b.arg) for b in parse_text(text, "x.md")] == [
        ("bash", "skip", "slow"),
        ("python", "run", ""),
    ]


def _bash_env() -> dict[str, str]:
    bin_dir = os.path.dirname(sys.executable)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "MPLBACKEND": "Agg"}


def _run_bash(block: Block, cwd: Path) -> None:
    try:
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block.code], cwd=cwd, env=_bash_env(), capture_output=True,
            text=True, timeout=BASH_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where}: bash block ran longer than {BASH_TIMEOUT_S} s:\n{block.code}")
    if proc.returncode != 0:
        pytest.fail(
            f"{block.where}: bash block exited {proc.returncode}:\n{block.code}\n"
            f"--- stdout (tail) ---\n{proc.stdout[-4000:]}\n--- stderr (tail) ---\n{proc.stderr[-4000:]}"
        )


@pytest.mark.parametrize(
    "page", [pytest.param(p, marks=[pytest.mark.slow] if p in SLOW_PAGES else []) for p in PAGES]
)
def test_page_examples_run(page, tmp_path, monkeypatch):
    blocks = parse_page(page)
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace: dict = {"__name__": "__docs__"}
    for block in blocks:
        if block.action == "skip":
            continue
        if block.action == "file":
            (tmp_path / block.arg).write_text(block.code, encoding="utf-8")
        elif block.lang == "python":
            exec(compile(block.code, block.where, "exec"), namespace)
        else:
            _run_bash(block, tmp_path)
