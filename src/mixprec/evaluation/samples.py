"""Evaluation samples as users give them, counted before any model is loaded.

Text is read by mixprec.texts.read_texts:

- `embed` samples and `generate` prompts: one per non-empty line of a `.txt` (a file of sentences or
  prompts is written that way), one per record of a `.jsonl`; `paragraphs=True` takes blank-line-separated
  documents of a `.txt` instead;
- `lm`: the documents (paragraphs of a `.txt`, records of a `.jsonl`) joined by end-of-text and cut into
  token blocks (mixprec.hf.lm_blocks).

Tokens come from mixprec.hf.text_tokenizer: the reference model directory's tokenizer, or raw UTF-8 bytes
(ids 0..255) for a directory without one when the vocabulary is large enough (the result says so).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mixprec.errors import MixprecError
from mixprec.hf import Tokenizer
from mixprec.texts import read_texts


def read_documents(data: str | Path, *, unit: str = "paragraph") -> tuple[list[str], str]:
    """The texts of --data, split by `unit` ("paragraph" or "line"), and where they came from."""
    if data is None:
        raise MixprecError(
            "--data is required: a .txt file, a folder of .txt/.md files, or a .jsonl with 'text'"
        )
    corpus = read_texts(data, unit=unit, split_folder_files=unit == "line")
    return list(corpus.documents), corpus.source


def embed_samples(docs: list[str], tok: Tokenizer, seq_len: int, samples: int) -> list[list[int]]:
    """One sample per text (a line, a record, or a paragraph), with special tokens, truncated to seq_len."""
    out = []
    for doc in docs:
        ids = tok.encode(doc, special=True)[:seq_len]
        if ids:
            out.append(ids)
        if len(out) >= samples:
            break
    if not out:
        raise MixprecError("the data has no text that tokenizes to at least one token")
    return out


def prompt_samples(docs: list[str], tok: Tokenizer, prompt_len: int, samples: int) -> list[list[int]]:
    """One prompt per text: its first `prompt_len` tokens (no special tokens, as in the lm blocks)."""
    out = []
    for doc in docs:
        ids = tok.encode(doc)[:prompt_len]
        if ids:
            out.append(ids)
        if len(out) >= samples:
            break
    if not out:
        raise MixprecError("the data has no text that tokenizes to at least one token")
    return out


def check_count(task: str, got: int, requested: int, allow_fewer: bool, unit: str) -> None:
    """Fewer samples than requested is an error unless the user allowed it."""
    if got < requested and not allow_fewer:
        raise MixprecError(
            f"--task {task}: the data gives {got} {unit}, fewer than --samples {requested} "
            "(lower --samples, give more data, or pass --allow-fewer to run on what there is)"
        )


def pad_batch(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and attention mask [B, T]."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(seqs), width), dtype=torch.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.int64)
        mask[i, : len(s)] = 1
    return ids, mask


__all__ = ["check_count", "embed_samples", "pad_batch", "prompt_samples", "read_documents"]
