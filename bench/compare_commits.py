"""Compare two checkouts on the same benchmarks, interleaved: each tree's bench script with its own venv.

    python bench/compare_commits.py /tmp/base .                       # bench_quantize + training step, 5 rounds
    python bench/compare_commits.py OLD NEW --rounds 7 \\
        --bench "bench_quantize.py --repeats 5" --bench "bench_training_step.py --quick --no-torchao"

Every round runs every benchmark once per tree, alternating which tree goes first (ABBA...), so load on
a shared machine hits both alike. Each benchmark prints markdown tables; a row's key is its cells before
the first "ms" column and its value that column (a median over the benchmark's own repeats). The
result per row is the median over rounds for each tree, their ratio new / old (> 1: the new tree is
slower), and the median of the per-round ratios (each round's two runs are neighbours in time). Where
the benchmark also prints a ratio to a baseline measured in the same run (bench_quantize: to
x.to(float8); the training step: x fp32), that ratio is compared too: it cancels the load a run saw,
which on a shared machine moves whole runs by 10-20 %. Each tree runs with `<tree>/.venv/bin/python` (override with --python-old / --python-new)
from the tree's root, with PYTHONDONTWRITEBYTECODE=1 so the old checkout is left as it is.
--env-old / --env-new VAR=VALUE set variables for one side: a tree against itself with a switch, e.g.

    python bench/compare_commits.py . . --env-old MIXPREC_C_KERNELS=off --bench "bench_training_step.py --quick"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_BENCHES = ["bench_quantize.py --repeats 5", "bench_training_step.py --quick --no-torchao"]


def _number(cell: str) -> float:
    return float(cell.strip().rstrip("x"))


def parse_tables(text: str) -> dict[str, tuple[float, float | None]]:
    """{row key: (milliseconds, ratio to the run's own baseline or None)} from a benchmark's markdown
    tables: the time is the first column whose header names "ms", the ratio the first column after it
    whose header starts with "ratio" or "x " (bench_quantize: to x.to(e4m3); training step: x fp32)."""
    rows: dict[str, tuple[float, float | None]] = {}
    col = rcol = None
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            col = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if all(set(c) <= set("-: ") for c in cells):
            continue  # the separator row
        if col is None:  # a header row
            col = next((i for i, c in enumerate(cells) if "ms" in c.split()), None)
            rcol = next(
                (
                    i
                    for i, c in enumerate(cells)
                    if col is not None and i > col and c.startswith(("ratio", "x "))
                ),
                None,
            )
            continue
        try:
            value = _number(cells[col])
        except (ValueError, IndexError, TypeError):
            continue
        try:
            ratio = _number(cells[rcol]) if rcol is not None else None
        except (ValueError, IndexError):
            ratio = None
        key = " / ".join(cells[:col])
        while key in rows:
            key += " (again)"
        rows[key] = (value, ratio)
    return rows


def run_bench(
    tree: Path, python: str, bench: str, extra_env: dict[str, str] | None = None
) -> tuple[dict[str, tuple[float, float | None]], float]:
    """One run of `bench` (script and arguments) in `tree`: its rows and the 1-minute load at the start.
    extra_env: variables set for this run (after PYTHONPATH is cleared, so it may set one)."""
    script, *args = shlex.split(bench)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "Agg"}
    env.pop("PYTHONPATH", None)
    env.update(extra_env or {})
    load = os.getloadavg()[0]
    out = subprocess.run(
        [python, str(tree / "bench" / script), *args], cwd=tree, env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {bench} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    rows = parse_tables(out.stdout)
    if not rows:
        raise SystemExit(f"{tree}: {bench} printed no table:\n{out.stdout[-2000:]}")
    return rows, load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path, help="the reference checkout (e.g. the previous commit)")
    parser.add_argument("new", type=Path, help="the checkout under test")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bench", action="append", help=f"script and arguments (default: {DEFAULT_BENCHES})")
    parser.add_argument("--python-old", help="interpreter for the old tree (default <old>/.venv/bin/python)")
    parser.add_argument("--python-new", help="interpreter for the new tree (default <new>/.venv/bin/python)")
    parser.add_argument("--json", type=Path, help="also write every measurement here")
    for which in ("old", "new"):
        parser.add_argument(
            f"--env-{which}",
            action="append",
            default=[],
            metavar="VAR=VALUE",
            help=f"set VAR for the {which} tree's runs (repeatable): one tree against itself with a switch",
        )
    args = parser.parse_args(argv)
    envs = {w: dict(kv.split("=", 1) for kv in getattr(args, f"env_{w}")) for w in ("old", "new")}

    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    pythons = {
        "old": args.python_old or str(trees["old"] / ".venv" / "bin" / "python"),
        "new": args.python_new or str(trees["new"] / ".venv" / "bin" / "python"),
    }
    benches = args.bench or DEFAULT_BENCHES
    # times[bench][row][tree] = [ms per round]; ratios: the same for the in-run normalized column
    times: dict[str, dict[str, dict[str, list[float]]]] = {b: {} for b in benches}
    ratios: dict[str, dict[str, dict[str, list[float]]]] = {b: {} for b in benches}
    loads: list[float] = []
    start = time.time()
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for bench in benches:
            for which in order:
                rows, load = run_bench(trees[which], pythons[which], bench, envs[which])
                loads.append(load)
                for key, (ms, ratio) in rows.items():
                    times[bench].setdefault(key, {"old": [], "new": []})[which].append(ms)
                    if ratio is not None:
                        ratios[bench].setdefault(key, {"old": [], "new": []})[which].append(ratio)
        print(f"round {r + 1}/{args.rounds} done ({time.time() - start:.0f} s)", file=sys.stderr, flush=True)

    print(f"old: {trees['old']} {envs['old'] or ''}\nnew: {trees['new']} {envs['new'] or ''}")
    print(f"{args.rounds} interleaved rounds; 1-minute load at the runs' starts: "
          f"min {min(loads):.1f}, median {statistics.median(loads):.1f}, max {max(loads):.1f}")  # fmt: skip
    for bench in benches:
        print(f"\n### {bench}\n")
        print(
            "| row | old ms | new ms | new / old ms | median per-round new / old ms "
            "| old ratio to run baseline | new ratio | new / old ratio |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for key, by_tree in times[bench].items():
            if len(by_tree["old"]) != args.rounds or len(by_tree["new"]) != args.rounds:
                continue  # a row only one tree prints
            old, new = statistics.median(by_tree["old"]), statistics.median(by_tree["new"])
            paired = statistics.median(n / o for n, o in zip(by_tree["new"], by_tree["old"]) if o > 0)
            cells = [key, f"{old:.1f}", f"{new:.1f}", f"{new / old:.3f}", f"{paired:.3f}"]
            r = ratios[bench].get(key)
            if r and len(r["old"]) == len(r["new"]) == args.rounds:
                ro, rn = statistics.median(r["old"]), statistics.median(r["new"])
                cells += [f"{ro:.2f}", f"{rn:.2f}", f"{rn / ro:.3f}"]
            else:
                cells += ["", "", ""]
            print("| " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(
            json.dumps({"trees": {k: str(v) for k, v in trees.items()}, "times": times}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
