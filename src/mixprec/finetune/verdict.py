"""The fine-tuning verdict: on held-out text, how far each model is from the original, and how much of
round-to-nearest's gap the fine-tuned one wins back, with paired intervals.

Every model is scored on the same windows (per-window summed next-token NLL and token counts), so one
paired bootstrap over windows (mixprec.verdicts) resamples the same windows for all of them:

- perplexity change against the original (`perplexity_change`), judged against `margin` with the shared
  vocabulary (`equivalent` / `worse` / `inconclusive`, mixprec.verdicts.decide);
- share of RTN's gap closed (`gap_closed`: 1 = as good as the original, 0 = no better than RTN) and the
  answer to "better than RTN?": `better` when the whole interval of the share lies above 0, `worse` when
  it lies below, `inconclusive` otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.evaluation.metrics import token_nll
from mixprec.verdicts import (
    INCONCLUSIVE,
    WORSE,
    Interval,
    decide,
    gap_closed,
    paired_bootstrap,
    perplexity_change,
)

BETTER = "better"
SCHEMA_VERSION = 1


@dataclass
class Scored:
    name: str
    nll: torch.Tensor  # [windows] float64, summed next-token NLL per window
    tokens: torch.Tensor  # [windows] predicted tokens per window


@torch.no_grad()
def score(name: str, model: nn.Module, windows: torch.Tensor, batch_size: int = 4) -> Scored:
    """Per-window summed NLL of `model` predicting each window's tokens 1..T-1 from the ones before."""
    was_training = model.training
    model.eval()
    sums = []
    for start in range(0, windows.shape[0], batch_size):
        ids = windows[start : start + batch_size]
        logits = model(ids).logits
        sums.append(token_nll(logits[:, :-1], ids[:, 1:]).double().sum(-1))
    model.train(was_training)
    tokens = torch.full((windows.shape[0],), windows.shape[1] - 1, dtype=torch.float64)
    return Scored(name, torch.cat(sums), tokens)


def _interval_dict(interval: Interval) -> dict[str, float]:
    return {"estimate": interval.estimate, "low": interval.low, "high": interval.high}


def recovery(reference: Scored, baseline: Scored | None, candidates: list[Scored], *, margin: float,
             seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """The verdict document (schema in docs/schemas/finetune.md): one row per model, scored on the same
    windows as `reference` (the original model); `baseline` is RTN (None: no share of its gap)."""
    rows = []
    for cand in ([baseline] if baseline is not None else []) + candidates:
        if not torch.equal(cand.tokens, reference.tokens):
            raise ValueError(f"{cand.name} was scored on other windows than {reference.name}")
        change = paired_bootstrap(perplexity_change, reference.nll, cand.nll, reference.tokens, seed=seed)
        row: dict[str, Any] = {
            "model": cand.name,
            "perplexity": float(torch.exp(cand.nll.sum() / cand.tokens.sum())),
            "perplexity_change": _interval_dict(change),
            "verdict_vs_original": decide(change.low, change.high, upper=margin),
        }
        if baseline is not None and cand is not baseline:
            share = paired_bootstrap(
                gap_closed, reference.nll, baseline.nll, cand.nll, reference.tokens, seed=seed
            )
            row["gap_closed"] = _interval_dict(share)
            row["verdict_vs_rtn"] = BETTER if share.low > 0 else WORSE if share.high < 0 else INCONCLUSIVE
        rows.append(row)
    return {
        "schema_version": SCHEMA_VERSION,
        "windows": int(reference.nll.numel()),
        "tokens": int(reference.tokens.sum()),
        "reference": reference.name,
        "reference_perplexity": float(torch.exp(reference.nll.sum() / reference.tokens.sum())),
        "baseline": None if baseline is None else baseline.name,
        "margin": margin,
        "rows": rows,
    }


def table(doc: dict[str, Any]) -> str:
    """The verdict document as a markdown table."""
    lines = [
        f"held-out: {doc['windows']} windows, {doc['tokens']} tokens; {doc['reference']} perplexity "
        f"{doc['reference_perplexity']:.3f}",
        "| model | perplexity | change vs original [95 %] | verdict | share of RTN's gap closed [95 %] | vs RTN |",
        "|---|---:|---:|---|---:|---|",
    ]
    for row in doc["rows"]:
        c = row["perplexity_change"]
        g = row.get("gap_closed")
        share = f"{g['estimate']:.1%} [{g['low']:.1%}, {g['high']:.1%}]" if g else "—"
        lines.append(
            f"| {row['model']} | {row['perplexity']:.3f} | {c['estimate']:+.2%} [{c['low']:+.2%}, {c['high']:+.2%}] "
            f"| {row['verdict_vs_original']} | {share} | {row.get('verdict_vs_rtn', '—')} |"
        )
    return "\n".join(lines)
