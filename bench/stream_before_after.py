"""Streaming quantization by two source trees of mixprec, interleaved with a plain copy of the files.

    python bench/stream_before_after.py OLD_SRC NEW_SRC --model DIR [--schemes fp8-dynamic nvfp4a16]
                                        [--rounds 3]

OLD_SRC / NEW_SRC: the `src` directories of two checkouts (e.g. a `git worktree` of the commit before);
each run imports mixprec from its tree (PYTHONPATH, ahead of any installed copy). --model: a bf16
checkpoint directory, e.g. the one `python bench/gptq_8b_blocks.py`'s write_checkpoint makes with 4
full-size Llama-3.1-8B blocks. Per round and scheme, in this order: copy (shutil.copytree), the old
tree's `mixprec quantize`, the new tree's; each in its own child process (wall time and peak RSS from
wait4: bench/child_rss.py), after an untimed os.sync(), its output deleted after. The two trees' outputs
of the first round are compared file by file (sha256). Prints per-round rows and medians.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quantized_forward import machine
from child_rss import run_measured

COPY = "import shutil, sys; shutil.copytree(sys.argv[1], sys.argv[2])"


def _run(cmd: list[str], log: Path, env_src: Path | None = None) -> tuple[float, int]:
    os.sync()
    old = os.environ.get("PYTHONPATH")
    if env_src is not None:
        os.environ["PYTHONPATH"] = str(env_src)
    try:
        seconds, code, peak = run_measured(cmd, log)
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    if code != 0:
        raise SystemExit(f"failed ({code}): {' '.join(cmd[:8])}\n{log.read_text()[-3000:]}")
    return seconds, peak


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("old_src", type=Path)
    p.add_argument("new_src", type=Path)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--schemes", nargs="+", default=["fp8-dynamic", "nvfp4a16"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="where outputs go (default: a temporary directory)")
    args = p.parse_args()
    print(machine())
    rows: dict[tuple[str, str], list[tuple[float, int, float]]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        for r in range(args.rounds):
            for scheme in args.schemes:
                copy = _run([sys.executable, "-c", COPY, str(args.model), str(root / "copy")], root / "log")
                shutil.rmtree(root / "copy")
                rows.setdefault((scheme, "copy"), []).append((*copy, 1.0))
                digests = {}
                for tree, src in (("old", args.old_src), ("new", args.new_src)):
                    out = root / tree
                    cmd = [sys.executable, "-m", "mixprec", "quantize", "--model", str(args.model),
                           "--output", str(out), "--scheme", scheme]  # fmt: skip
                    seconds, peak = _run(cmd, root / "log", env_src=src.resolve())
                    rows.setdefault((scheme, tree), []).append((seconds, peak, seconds / copy[0]))
                    print(f"round {r + 1} {scheme} {tree}: {seconds:.1f} s ({seconds / copy[0]:.2f}x the copy's "
                          f"{copy[0]:.1f} s), peak RSS {peak / 2**30:.2f} GiB", flush=True)  # fmt: skip
                    if r == 0:
                        digests[tree] = _digests(out)
                    shutil.rmtree(out)
                if r == 0:
                    same = digests["old"] == digests["new"]
                    print(f"{scheme}: the two trees' outputs are {'byte-identical' if same else 'DIFFERENT'}")
    print(f"\nmedians of {args.rounds} rounds (x copy: the median of each round's ratio to its own copy)\n")
    print("| scheme | run | wall s | x copy | peak RSS GiB |\n|---|---|---:|---:|---:|")
    for (scheme, run), vals in rows.items():
        secs, peaks, ratios = zip(*vals)
        print(f"| {scheme} | {run} | {statistics.median(secs):.1f} | {statistics.median(ratios):.2f} | "
              f"{max(peaks) / 2**30:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
