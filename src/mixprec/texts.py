"""Reading text: a .txt file, a .jsonl file with a "text" field per line, or a folder of them.

One reader for every place mixprec takes text (the corpus of `mixprec compare`, the calibration data
of `mixprec quantize`, the samples of `mixprec evaluate` and of ONNX calibration):

- a text file (a suffix in `suffixes`, .txt by default) is split at blank lines into paragraphs,
  each stripped of the whitespace around it (`unit="paragraph"`, the default: documents), or into its
  non-empty lines (`unit="line"`: one sample per line, as a file of sentences or prompts is written);
- a .jsonl file gives one text per line, from its "text" field (blank lines skipped);
- a folder gives its files with a suffix in `suffixes`, in sorted path order, each file one text
  (`split_folder_files=False`: a corpus keeps its documents whole) or split as a single file would be.

Blank texts are dropped; a path that gives none is an error, as is anything that is not UTF-8.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from mixprec.errors import MixprecError

DOCUMENT_SUFFIXES = (".txt", ".md")
UNITS = ("paragraph", "line")


@dataclass(frozen=True)
class Corpus:
    """Texts, in a fixed order, with where they came from."""

    documents: tuple[str, ...]
    source: str  # human-readable: a path, or "python-stdlib:<dir>"
    names: tuple[str, ...] = ()  # one per document (relative path, "paragraph N", "line N")


def read_texts(
    path: str | os.PathLike,
    *,
    suffixes: tuple[str, ...] = DOCUMENT_SUFFIXES,
    split_folder_files: bool = False,
    what: str = "data path",
    unit: str = "paragraph",
) -> Corpus:
    """The texts of `path` (see the module docstring); `what` names the path in error messages.

    `unit`: how a text file is split, "paragraph" (at blank lines) or "line" (every non-empty line).
    """
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
    split = _lines if unit == "line" else _paragraphs
    p = Path(path)
    if not p.exists():
        raise MixprecError(f"{what} {p} does not exist")
    texts: list[tuple[str, str]] = []  # (text, name)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in suffixes)
        if not files:
            listed = f"{', '.join(suffixes[:-1])} or {suffixes[-1]}" if len(suffixes) > 1 else suffixes[0]
            raise MixprecError(f"{what} {p} is a folder with no {listed} files")
        for f in files:
            rel = str(f.relative_to(p))
            if f.suffix.lower() == ".jsonl":
                texts += [(t, f"{rel} {n}") for t, n in _jsonl_texts(f)]
            elif split_folder_files:
                texts += [(t, f"{rel} {n}") for t, n in split(f)]
            else:
                texts.append((_read(f), rel))
    elif p.suffix.lower() == ".jsonl":
        texts = _jsonl_texts(p)
    elif p.suffix.lower() in suffixes:
        texts = split(p)
    else:
        plain = "/".join(s for s in suffixes if s != ".jsonl")
        raise MixprecError(
            f"{what} {p}: expected a {plain} file, a .jsonl file or a folder, got {p.suffix!r}"
        )
    kept = [(t, n) for t, n in texts if t.strip()]
    if not kept:
        raise MixprecError(f"{what} {p} holds no text (empty corpus)")
    return Corpus(tuple(t for t, _ in kept), str(p), tuple(n for _, n in kept))


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise MixprecError(f"{path}: not UTF-8 text ({exc.reason})") from None


def _paragraphs(path: Path) -> list[tuple[str, str]]:
    parts = [t for t in (part.strip() for part in _read(path).split("\n\n")) if t]
    return [(t, f"paragraph {i + 1}") for i, t in enumerate(parts)]


def _lines(path: Path) -> list[tuple[str, str]]:
    # split at "\n" only (a "\r\n" file keeps working: each line is stripped)
    numbered = [(line.strip(), n) for n, line in enumerate(_read(path).split("\n"), 1)]
    return [(t, f"line {n}") for t, n in numbered if t]


def _jsonl_texts(path: Path) -> list[tuple[str, str]]:
    out = []
    # split at "\n" only: str.splitlines would also cut at U+2028 and others, which JSON allows in a string
    for number, line in enumerate(_read(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise MixprecError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise MixprecError(f'{path}:{number}: each line must be a JSON object with a string "text" field')
        out.append((row["text"], f"line {number}"))
    return out


__all__ = ["DOCUMENT_SUFFIXES", "UNITS", "Corpus", "read_texts"]
