"""Confidence intervals for every quality figure of an evaluation (mixprec.verdicts.paired_bootstrap).

Each figure is rebuilt from per-sample quantities, so resampling samples (with the same indices for the
reference and the candidate) gives its sampling spread:

- lm: per-block summed NLL of both models and token counts -> the perplexity change; per-block top-1
  matches and summed KL over tokens -> agreement and mean KL (pooled over tokens, as the figures are);
- generate: per-sentence BLEU sufficient statistics, summed and scored by sacrebleu (Koehn 2004's paired
  bootstrap of corpus BLEU); per-prompt ROUGE-L; per-prompt matching tokens;
- embed: per-sample cosine; clip: per-pair CLIPScore difference and embedding cosines.

One seed for all figures: figures over the same samples resample the same indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.errors import MixprecError
from mixprec.evaluation.metrics import BLEU_STATISTICS, bleu_of_statistics
from mixprec.verdicts import (
    DEFAULT_LEVEL,
    DEFAULT_RESAMPLES,
    Interval,
    mean,
    mean_difference,
    paired_bootstrap,
    perplexity_change,
    ratio_of_sums,
)


@dataclass(frozen=True)
class Bootstrap:
    """How intervals are drawn: two-sided `level`, `resamples` bootstrap draws, `seed`."""

    level: float = DEFAULT_LEVEL
    resamples: int = DEFAULT_RESAMPLES
    seed: int = 0

    def check(self) -> None:
        if not (0.5 <= self.level < 1):
            raise MixprecError(f"--level must be in [0.5, 1), got {self.level}")
        if self.resamples < 100:
            raise MixprecError(f"--resamples must be at least 100, got {self.resamples}")

    def interval(self, statistic, *per_sample: torch.Tensor) -> Interval | None:
        """The interval, or None when there are fewer than 2 samples (no spread to resample)."""
        if per_sample[0].numel() < 2:
            return None
        return paired_bootstrap(
            statistic, *per_sample, level=self.level, resamples=self.resamples, seed=self.seed
        )

    def to_dict(self) -> dict:
        return {
            "level": self.level,
            "resamples": self.resamples,
            "seed": self.seed,
            "method": "paired-bootstrap",
        }


def _t(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float64).reshape(-1)


def task_intervals(task: str, per_sample: dict, bootstrap: Bootstrap) -> dict[str, Interval | None]:
    """figure -> Interval for one task, from the per-sample quantities its runner returned."""
    b = {k: _t(v) for k, v in per_sample.items()}
    iv = bootstrap.interval
    if task == "lm":
        return {
            "perplexity_relative_change": iv(perplexity_change, b["block_reference_nll"], b["block_candidate_nll"],
                                             b["block_tokens"]),
            "top1_agreement": iv(ratio_of_sums, b["block_top1_matches"], b["block_tokens"]),
            "kl_mean": iv(ratio_of_sums, b["block_kl"], b["block_tokens"]),
        }  # fmt: skip
    if task == "generate":
        return {
            "bleu": iv(bleu_of_statistics, *(b[f"bleu_{k}"] for k in BLEU_STATISTICS)),
            "bleu_tokens": iv(bleu_of_statistics, *(b[f"bleu_tokens_{k}"] for k in BLEU_STATISTICS)),
            "rouge_l": iv(mean, b["rouge_l"]),
            "token_agreement": iv(ratio_of_sums, b["same_tokens"], b["new_tokens"]),
        }
    if task == "embed":
        return {"cosine_mean": iv(mean, b["cosine"])}
    if task == "clip":
        return {
            "similarity_change": iv(mean_difference, b["reference_similarity"], b["candidate_similarity"]),
            "clip_score_change": iv(mean_difference, b["reference_clip_score"], b["candidate_clip_score"]),
            "image_embedding_cosine": iv(mean, b["image_cosine"]),
            "text_embedding_cosine": iv(mean, b["text_cosine"]),
        }
    raise ValueError(f"no intervals for task {task!r}")


__all__ = ["Bootstrap", "task_intervals"]
