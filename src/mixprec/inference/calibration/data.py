"""Calibration data: a path (or a well-known dataset name with a local copy) -> texts -> token batches.
mixprec downloads nothing: a well-known name must have a local copy under files.cache_dir("datasets")
(~/.cache/mixprec/datasets, or $MIXPREC_CACHE_DIR/datasets).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mixprec.errors import MixprecError
from mixprec.files import cache_dir
from mixprec.texts import read_texts

# Names that look like datasets people download; mixprec downloads nothing, so they must be local.
WELL_KNOWN_DATASETS = (
    "wikitext-2-raw",
    "wikitext-2-raw-v1",
    "wikitext-2",
    "wikitext2",
    "wikitext-103-raw",
    "wikitext-103-raw-v1",
    "c4",
    "pile-val",
    "pileval",
    "ultrachat",
    "ultrachat-200k",
    "open-platypus",
)


# ---------------------------------------------------------------------------------------------------
# Data


def resolve_calib_source(spec: str | Path) -> Path:
    """A path to calibration text, or a well-known name with a local copy."""
    p = Path(spec).expanduser()
    if p.exists():
        return p
    key = str(spec).strip().lower()
    if key in WELL_KNOWN_DATASETS:
        root = cache_dir("datasets", key)
        if root.exists():
            return root
        raise MixprecError(
            f"calibration dataset {spec!r} is a well-known name, but mixprec downloads nothing. Provide a local "
            f"copy: put its text (.txt files, or .jsonl with a 'text' field) in {root}/, or pass --calib-data PATH. "
            f"For example, where the 'datasets' package and network are available: "
            f"python -c \"import datasets; d=datasets.load_dataset('wikitext','wikitext-2-raw-v1',split='train'); "
            f"open('wiki.train.txt','w').write(''.join(d['text']))\""
        )
    raise MixprecError(
        f"calibration data {spec} not found (expected a .txt, a .jsonl with 'text', or a folder of them)"
    )


CALIBRATION_SUFFIXES = (".txt", ".raw", ".jsonl")


def load_texts(spec: str | Path) -> list[str]:
    """The calibration texts of a path or well-known name (mixprec.texts.read_texts): a .txt file's
    paragraphs, a .jsonl file's "text" fields, or those of every .txt/.raw/.jsonl file in a folder."""
    path = resolve_calib_source(spec)
    corpus = read_texts(path, suffixes=CALIBRATION_SUFFIXES, split_folder_files=True, what="calibration data")
    return list(corpus.documents)


def token_batches(
    texts: Sequence[str], tokenizer: Any, samples: int, seq_len: int, batch_size: int = 4
) -> list[torch.Tensor]:
    """Concatenate tokenized texts and cut `samples` windows of `seq_len` tokens; batches of ids."""
    if samples < 1 or seq_len < 1:
        raise MixprecError("--calib-samples and --calib-seq-len must be positive")
    ids: list[int] = []
    sep = getattr(tokenizer, "eos_token_id", None)
    for t in texts:
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        if sep is not None:
            ids.append(sep)
        if len(ids) >= samples * seq_len:
            break
    if not ids:
        raise MixprecError("calibration text tokenized to nothing")
    n = max(1, min(samples, len(ids) // seq_len))
    length = min(seq_len, len(ids))
    rows = torch.tensor(ids[: n * length], dtype=torch.long).reshape(n, length)
    return list(rows.split(batch_size))


def tokens_sha256(batches: Sequence[torch.Tensor]) -> str:
    """The SHA-256 of calibration batches' token ids (int64, in batch order): what an algorithm's record
    names its data by, so that two runs (or two tools) can be shown to have seen the same tokens."""
    digest = hashlib.sha256()
    for b in batches:
        digest.update(b.to(torch.int64).numpy().tobytes())
    return digest.hexdigest()
