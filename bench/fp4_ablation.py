"""Which of fp4-nvfp4's techniques matters: each variant against the full recipe, from one comparison.

    mixprec compare --recipes bf16,fp4-nvfp4,fp4-nvfp4:rht=false,fp4-nvfp4:sr=false,fp4-nvfp4:2d=false \
        --baseline bf16 --out cmp
    python bench/fp4_ablation.py cmp [--reference fp4-nvfp4]

Every judged recipe of a comparison runs with its own null runs (the recipe again from initial weights
moved by one ulp: `--recipe-null-runs`, the default), so each recipe is a group of equally good runs.
Each run's figure is compare's own: the relative train-loss gap to the baseline run over the verdict
window (the last 10 % of steps; mixprec.comparison.summary.window_gap). A variant against the reference
recipe is the difference of the two groups' means with Welch's 95 % interval
(mixprec.verdicts.group_interval): an interval wholly above 0 says switching the technique off costs
loss; one that straddles 0 says the runs cannot tell the two apart at this size.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mixprec.comparison.config import CompareConfig
from mixprec.comparison.summary import null_runs_of, split_records, train_losses, window_gap
from mixprec.verdicts import group_interval


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="a finished comparison's --out directory")
    ap.add_argument("--reference", default="fp4-nvfp4", help="the recipe every other is compared with")
    args = ap.parse_args()
    summary = json.loads((args.out / "summary.json").read_text())
    config = CompareConfig.from_dict(summary["config"])
    records = [json.loads(line) for line in (args.out / "metrics.jsonl").read_text().splitlines()]
    runs = split_records(records)
    steps = config.steps
    baseline = summary["recipes"][args.reference]["baseline"]
    base = train_losses(runs[baseline]["step"], steps)

    def group(recipe: str) -> list[float]:
        names = [recipe, *null_runs_of(runs, recipe)]
        return [window_gap(train_losses(runs[n]["step"], steps), base, steps) for n in names]

    reference = group(args.reference)
    print(
        f"window: the last {summary['bands'][baseline]['window_steps']} of {steps} steps; gaps to the {baseline} run\n"
    )
    print(
        f"| recipe | runs | mean train gap to {baseline} | minus {args.reference} [95 % interval, Welch] | reading |"
    )
    print("|---|---|---|---|---|")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(f"| {args.reference} | {len(reference)} | {mean(reference) * 100:+.3f} % | – | the reference |")
    for recipe, entry in summary["recipes"].items():
        if recipe in (args.reference, baseline) or entry.get("baseline") != baseline:
            continue
        runs_of = group(recipe)
        iv = group_interval(runs_of, reference)
        reading = (
            "higher loss than the reference" if iv.low > 0
            else "lower loss than the reference" if iv.high < 0
            else "not distinguishable from the reference"
        )  # fmt: skip
        print(f"| {recipe} | {len(runs_of)} | {mean(runs_of) * 100:+.3f} % | {iv.estimate * 100:+.3f} % "
              f"[{iv.low * 100:+.3f} %, {iv.high * 100:+.3f} %] | {reading} |")  # fmt: skip


if __name__ == "__main__":
    main()
