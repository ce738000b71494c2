"""Evaluation samples from a corpus: the documents, one sample per document for `embed`, padded batches.

The corpus is read by mixprec.texts.read_texts (.txt split at blank lines, a folder of .txt/.md,
.jsonl with "text"). Tokens come from mixprec.hf.text_tokenizer: the reference model directory's
tokenizer, or raw UTF-8 bytes (ids 0..255) for a model directory without one when the vocabulary is
large enough (the result says so); `lm` and `generate` cut their token blocks with mixprec.hf.lm_blocks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mixprec.errors import MixprecError
from mixprec.hf import Tokenizer
from mixprec.texts import read_texts


def read_documents(data: str | Path) -> tuple[list[str], str]:
    """The documents of --data and where they came from."""
    if data is None:
        raise MixprecError(
            "--data is required: a .txt file, a folder of .txt/.md files, or a .jsonl with 'text'"
        )
    corpus = read_texts(data)
    return list(corpus.documents), corpus.source


def embed_samples(docs: list[str], tok: Tokenizer, seq_len: int, samples: int) -> list[list[int]]:
    """One sample per document (a line of .jsonl, a paragraph of .txt), truncated to seq_len tokens."""
    out = []
    for doc in docs:
        ids = tok.encode(doc, special=True)[:seq_len]
        if ids:
            out.append(ids)
        if len(out) >= samples:
            break
    if not out:
        raise MixprecError("the data has no document that tokenizes to at least one token")
    return out


def pad_batch(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and attention mask [B, T]."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(seqs), width), dtype=torch.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.int64)
        mask[i, : len(s)] = 1
    return ids, mask


__all__ = ["embed_samples", "pad_batch", "read_documents"]
