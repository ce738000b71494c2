"""How much of round to nearest's perplexity gap an algorithm closes, from two `mixprec evaluate --json`
files scored on the same blocks against the same reference (paired 95 % bootstrap over blocks).

    python bench/gap_closed.py e-rtn.json e-gptq.json [e-other.json ...] [--against e-anchor.json]

For each candidate after the first: its perplexity change against the reference, and the fraction of
the first candidate's gap it closes, 1 - (ppl_c / ppl_ref - 1) / (ppl_rtn / ppl_ref - 1). Both come
with intervals from one paired bootstrap over the blocks: each block's token NLL sums, as evaluate
stores them (`per_sample`: lm.block_reference_nll, lm.block_candidate_nll, lm.block_tokens), are
resampled together, so the three models see the same resampled blocks.

--against: another tool's checkpoint scored the same way (llm-compressor's, say); each candidate's
perplexity change minus the anchor's, in points of the reference's perplexity, with its paired interval,
beside a tenth of the baseline's gap (issue 28's bound: the upper end at most that means "no worse").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mixprec.verdicts import gap_closed, paired_bootstrap, perplexity_change


def blocks(path: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    doc = json.loads(path.read_text())
    per = doc["per_sample"]
    ref, cand, tokens = (torch.tensor(per[f"lm.block_{k}"], dtype=torch.float64)
                         for k in ("reference_nll", "candidate_nll", "tokens"))  # fmt: skip
    return ref, cand, tokens, doc["candidate"]["source"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("baseline", type=Path, help="round to nearest's evaluate --json")
    p.add_argument("candidates", type=Path, nargs="+")
    p.add_argument("--against", type=Path, help="an anchor's evaluate --json, scored on the same blocks")
    args = p.parse_args()
    ref, base, tokens, base_name = blocks(args.baseline)
    anchor = same_blocks(args.against, ref, tokens, args.baseline)[1] if args.against else None
    extra = (
        " | change minus the anchor's [95 %] (a tenth of the baseline's gap) |"
        if anchor is not None
        else " |"
    )
    print("| candidate | perplexity change [95 %] | share of the baseline's gap closed [95 %]" + extra)
    print("|---|---:|---:|" + ("---:|" if anchor is not None else ""))
    gap0 = paired_bootstrap(perplexity_change, ref, base, tokens)
    print(f"| {base_name} | {gap0.estimate:+.1%} [{gap0.low:+.1%}, {gap0.high:+.1%}] | (baseline) |"
          + (" |" if anchor is not None else ""))  # fmt: skip
    for path in args.candidates:
        name, cand = same_blocks(path, ref, tokens, args.baseline)
        gap = paired_bootstrap(perplexity_change, ref, cand, tokens)
        share = paired_bootstrap(gap_closed, ref, base, cand, tokens)
        row = (f"| {name} | {gap.estimate:+.1%} [{gap.low:+.1%}, {gap.high:+.1%}] | "
               f"{share.estimate:.1%} [{share.low:.1%}, {share.high:.1%}] |")  # fmt: skip
        if anchor is not None:
            d = paired_bootstrap(change_minus, ref, anchor, cand, tokens)
            row += f" {d.estimate:+.2%} [{d.low:+.2%}, {d.high:+.2%}] ({gap0.estimate / 10:.2%}) |"
        print(row)
    return 0


def same_blocks(
    path: Path, ref: torch.Tensor, tokens: torch.Tensor, baseline: Path
) -> tuple[str, torch.Tensor]:
    """(its candidate's name, its per-block NLL), refused unless scored like the baseline."""
    ref_c, cand, tokens_c, name = blocks(path)
    if not (torch.equal(ref_c, ref) and torch.equal(tokens_c, tokens)):
        raise SystemExit(f"{path}: not scored on the same blocks with the same reference as {baseline}")
    return name, cand


def change_minus(
    ref: torch.Tensor, anchor: torch.Tensor, cand: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """The candidate's perplexity change minus the anchor's, per row (both against the reference)."""
    return perplexity_change(ref, cand, tokens) - perplexity_change(ref, anchor, tokens)


if __name__ == "__main__":
    raise SystemExit(main())
