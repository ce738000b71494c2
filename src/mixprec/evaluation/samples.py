"""Evaluation samples from a corpus: token blocks for `lm`, prompts for `generate`, texts for `embed`.

The corpus is read by mixprec.data.load_corpus (.txt split at blank lines, a folder of .txt/.md,
.jsonl with "text"). Tokens come from the reference model directory's tokenizer; a model directory
without one falls back to raw UTF-8 bytes (ids 0..255) when the vocabulary is large enough, and the
result says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixprec.errors import MixprecError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "tokenizer.model", "vocab.json")


@dataclass
class Tokenizer:
    """The small surface evaluation needs, over a transformers tokenizer or raw bytes."""

    hf: Any  # a transformers tokenizer, or None for bytes
    name: str

    @property
    def vocab_size(self) -> int:
        return len(self.hf) if self.hf is not None else 256

    @property
    def pad_id(self) -> int:
        if self.hf is None:
            return 0
        for tid in (self.hf.pad_token_id, self.hf.eos_token_id, self.hf.sep_token_id):
            if tid is not None:
                return int(tid)
        return 0

    @property
    def separator_id(self) -> int | None:
        """Joins documents in the lm token stream (end-of-text where the tokenizer has one)."""
        if self.hf is None:
            return ord("\n")
        tid = self.hf.eos_token_id if self.hf.eos_token_id is not None else self.hf.sep_token_id
        return None if tid is None else int(tid)

    def encode(self, text: str, special: bool = False) -> list[int]:
        if self.hf is None:
            return list(text.encode("utf-8"))
        return list(self.hf(text, add_special_tokens=special)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        if self.hf is None:
            return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
        return self.hf.decode(ids, skip_special_tokens=True)

    def vocab(self) -> dict[str, int] | None:
        return None if self.hf is None else dict(self.hf.get_vocab())


def has_tokenizer(directory: Path) -> bool:
    return any((directory / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(directory: Path | None, model_vocab: int, tokenizer: Any = None) -> Tokenizer:
    """The tokenizer given, else the one in `directory`, else bytes (when the vocabulary has >= 256 ids)."""
    if tokenizer is not None:
        return (
            tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer, type(tokenizer).__name__)
        )
    if directory is not None and has_tokenizer(directory):
        from mixprec.data import load_hf_tokenizer

        return Tokenizer(load_hf_tokenizer(directory), str(directory))
    if model_vocab < 256:
        where = f"model directory {directory}" if directory is not None else "the reference model"
        raise MixprecError(
            f"{where} has no tokenizer and its vocabulary ({model_vocab}) is too small for raw bytes: "
            "save a tokenizer beside the weights (tokenizer.save_pretrained(dir))"
        )
    return Tokenizer(None, "utf-8 bytes (no tokenizer in the model directory)")


def read_documents(data: str | Path) -> tuple[list[str], str]:
    from mixprec.data import load_corpus

    if data is None:
        raise MixprecError(
            "--data is required: a .txt file, a folder of .txt/.md files, or a .jsonl with 'text'"
        )
    corpus = load_corpus(data)
    docs = [d for d in corpus.documents if d.strip()]
    if not docs:
        raise MixprecError(f"data {data} holds no text (empty corpus)")
    return docs, corpus.source


def lm_blocks(docs: list[str], tok: Tokenizer, seq_len: int, samples: int) -> torch.Tensor:
    """Up to `samples` blocks [N, seq_len] of the documents' tokens joined by end-of-text.

    Tokenizes only as much text as the blocks need. A corpus shorter than one block gives one shorter
    block (at least 2 tokens, so one next-token prediction is scored).
    """
    need = samples * seq_len
    ids: list[int] = []
    for doc in docs:
        ids.extend(tok.encode(doc))
        if tok.separator_id is not None:
            ids.append(tok.separator_id)
        if len(ids) >= need:
            break
    n = min(samples, len(ids) // seq_len)
    if n == 0:
        if len(ids) < 2:
            raise MixprecError("the data has fewer than 2 tokens: nothing to score")
        return torch.tensor([ids], dtype=torch.int64)
    return torch.tensor(ids[: n * seq_len], dtype=torch.int64).reshape(n, seq_len)


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


__all__ = ["Tokenizer", "embed_samples", "lm_blocks", "load_tokenizer", "pad_batch", "read_documents"]
