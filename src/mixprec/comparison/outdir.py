"""The output directory of a comparison: refuse, start, resume, finish.

While a comparison runs (and after it is interrupted) the directory holds only the marker
INCOMPLETE.json (the settings, so --resume continues the same run) and checkpoints/<run>.pt.
Finishing writes summary.json, metrics.jsonl and report.html, then removes the checkpoints and the marker.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mixprec.comparison.config import CompareConfig
from mixprec.errors import MixprecError
from mixprec.files import atomic_file, write_text_atomic

MARKER = "INCOMPLETE.json"
CHECKPOINTS = "checkpoints"
ARTEFACTS = ("summary.json", "metrics.jsonl", "report.html")


def check_out_dir(out: Path, config: CompareConfig, *, resume: bool, force: bool) -> None:
    """Raise before anything is written when the directory cannot be used as asked."""
    marker = out / MARKER
    if resume:
        if not marker.is_file():
            raise MixprecError(f"--resume: {out} holds no interrupted comparison (no {MARKER})")
        stored = CompareConfig.from_dict(json.loads(marker.read_text())["config"])
        if stored != config:
            diff = [k for k, v in stored.to_dict().items() if config.to_dict().get(k) != v]
            raise MixprecError(
                f"--resume: the settings differ from the interrupted run in {out}: {', '.join(diff)}"
            )
        return
    if out.exists() and not out.is_dir():
        raise MixprecError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        hint = " (an interrupted comparison: add --resume)" if marker.exists() else ""
        raise MixprecError(f"--out {out} is not empty{hint}; pass --force to overwrite")


def stored_config(out: Path) -> CompareConfig:
    """The settings of the interrupted comparison in `out` (what --resume continues)."""
    marker = out / MARKER
    if not marker.is_file():
        raise MixprecError(f"--resume: {out} holds no interrupted comparison (no {MARKER})")
    return CompareConfig.from_dict(json.loads(marker.read_text())["config"])


def start(out: Path, config: CompareConfig, *, resume: bool, force: bool) -> Path:
    """Create the marker and the checkpoint folder; returns the checkpoint folder."""
    if not resume:
        if force and out.is_dir():
            for name in (*ARTEFACTS, MARKER):
                (out / name).unlink(missing_ok=True)
            shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        note = "an interrupted mixprec comparison: continue it with the same command and --resume"
        write_text_atomic(
            out / MARKER,
            json.dumps({"schema_version": 1, "note": note, "config": config.to_dict()}, indent=1),
        )
    ckpt = out / CHECKPOINTS
    ckpt.mkdir(exist_ok=True)
    return ckpt


def checkpoint_path(ckpt_dir: Path, run: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_.~" else "_" for c in run)
    return ckpt_dir / f"{safe}.pt"


def finish(out: Path) -> None:
    shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
    (out / MARKER).unlink(missing_ok=True)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with atomic_file(path) as tmp, tmp.open("w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
