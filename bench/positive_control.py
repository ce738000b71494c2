"""The harm of candidate positive controls at the demo's size, measured over several seeds.

A subtle positive control must carry a known harm of about 1.5-3x the margin it is judged against: large
enough that the demo's comparison can call it `worse`, small enough that it tests the procedure's power
(a gross one such as fp8-unscaled proves little). Its harm is a property of the recipe at this size, so
it is measured beforehand: each seed trains bf16 and every candidate from the same initial weights on
the same batches (the demo's settings, no null runs), and the gap of each candidate to that seed's bf16
run is one draw of its harm. Printed: every draw, their mean and standard deviation, and the mean as a
multiple of the candidate's margin.

    python bench/positive_control.py --seeds 5 --candidates fp4-nvfp4,fp4-mxfp4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mixprec.comparison.config import CompareConfig
from mixprec.comparison.runner import compare
from mixprec.demo import DEMO_SETTINGS
from mixprec.kernels.hardware import describe_machine


def measure(candidates: list[str], seeds: range, data: str | None) -> dict:
    settings = dict(DEMO_SETTINGS, null_runs=0, recipe_null_runs=False, data=data)
    draws: dict[str, dict[str, list[float]]] = {c: {"train": [], "val": []} for c in candidates}
    margins = {}
    for seed in seeds:
        config = CompareConfig(recipes=("bf16", *candidates), seed=seed, **settings)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            summary = compare(config=config, out=Path(tmp) / "out", progress=False)
            seconds = time.perf_counter() - t0
        for c in candidates:
            r = summary.recipes[c]
            margins[c] = r.margin
            draws[c]["train"].append(r.train_gap)
            draws[c]["val"].append(r.val_gap)
        gaps = ", ".join(f"{c} {r.train_gap * 100:+.3f}% / {r.val_gap * 100:+.3f}%"
                         for c, r in summary.recipes.items() if c in candidates)  # fmt: skip
        print(f"seed {seed}: {gaps} (train / val gap to bf16; {seconds:.0f} s)", flush=True)
    out = {}
    for c, d in draws.items():
        out[c] = {"margin": margins[c]}
        for loss, values in d.items():
            mean, sd = statistics.mean(values), statistics.stdev(values) if len(values) > 1 else float("nan")
            out[c][loss] = {"draws": values, "mean": mean, "sd": sd, "x_margin": mean / margins[c]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="how many seeds")
    parser.add_argument("--first-seed", type=int, default=0, help="the first of them")
    parser.add_argument("--candidates", default="fp4-nvfp4", help="comma-separated recipe names")
    parser.add_argument(
        "--data", default=None, help="corpus (default: the demo's, the Python stdlib sources)"
    )
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    print(describe_machine(), flush=True)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    result = measure([c.strip() for c in args.candidates.split(",") if c.strip()], seeds, args.data)
    print(f"\n| candidate | loss | gap to bf16, mean ± sd over {args.seeds} seeds | x margin |")
    print("|---|---|---:|---:|")
    for c, figures in result.items():
        for loss in ("train", "val"):
            f = figures[loss]
            print(
                f"| {c} | {loss} | {f['mean'] * 100:+.3f} % ± {f['sd'] * 100:.3f} % | {f['x_margin']:.2f} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
