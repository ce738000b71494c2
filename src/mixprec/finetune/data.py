"""The fine-tuning text as windows of token ids: every full window of the tokenized text, in order (the
texts are read as calibration data is: a .txt file's paragraphs, a .jsonl file's "text" fields, or a
folder of them), each text followed by the end-of-text token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mixprec.errors import MixprecError
from mixprec.inference.calibration.data import load_texts


def text_windows(source: str | Path, tokenizer: Any, seq_len: int, *, what: str = "--data",
                 limit: int | None = None) -> torch.Tensor:  # fmt: skip
    """[windows, seq_len] int64 token ids of `source` (at most `limit` windows)."""
    if seq_len < 2:
        raise MixprecError(f"the window length must be at least 2 tokens, got {seq_len}")
    texts = load_texts(source)
    sep = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if sep is not None:
            ids.append(sep)
        if limit is not None and len(ids) >= limit * seq_len:
            break
    n = len(ids) // seq_len if limit is None else min(limit, len(ids) // seq_len)
    if n < 1:
        raise MixprecError(f"{what} {source}: {len(ids)} tokens, fewer than one window of {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).reshape(n, seq_len)


def split_held_out(windows: torch.Tensor, held_out: int, *, what: str = "--data") -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(training windows, the last `held_out` windows): the held-out part is text the run never trains on."""
    if held_out < 2 or windows.shape[0] - held_out < 1:
        raise MixprecError(
            f"{what}: {windows.shape[0]} windows cannot give {held_out} held-out windows (at least 2) and "
            "still leave some to train on"
        )
    return windows[:-held_out], windows[-held_out:]
