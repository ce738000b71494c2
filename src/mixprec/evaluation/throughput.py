"""Throughput of the two models, measured in the same run on the same batches."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Throughput:
    """Tokens and seconds per model; the first (warm-up) call of each model is not counted."""

    reference_tokens: int = 0
    reference_seconds: float = 0.0
    candidate_tokens: int = 0
    candidate_seconds: float = 0.0

    @contextmanager
    def time(self, which: str, tokens: int, device: torch.device) -> Iterator[None]:
        _sync(device)
        start = time.perf_counter()
        yield
        _sync(device)
        elapsed = time.perf_counter() - start
        if which == "reference":
            self.reference_tokens += tokens
            self.reference_seconds += elapsed
        else:
            self.candidate_tokens += tokens
            self.candidate_seconds += elapsed

    def summary(self, what: str) -> dict:
        ref = self.reference_tokens / self.reference_seconds if self.reference_seconds > 0 else None
        cand = self.candidate_tokens / self.candidate_seconds if self.candidate_seconds > 0 else None
        return {
            "measured": what,
            "reference_tokens_per_s": ref,
            "candidate_tokens_per_s": cand,
            "speedup": cand / ref if ref and cand else None,
            "reference_tokens": self.reference_tokens,
            "candidate_tokens": self.candidate_tokens,
            "reference_seconds": self.reference_seconds,
            "candidate_seconds": self.candidate_seconds,
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["Throughput"]
