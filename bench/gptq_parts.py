"""The parts of GPTQ's per-block work, each timed on its own, at the shapes of one block of
bench_checkpoint_quantize.py's synthetic checkpoint (hidden 2048, intermediate 5632, 16 heads without
grouped-query attention: q/k/v stacked 6144 x 2048, o 2048 x 2048, gate/up stacked 11264 x 2048, down
2048 x 5632) and 16 x 256 calibration tokens:

    python bench/gptq_parts.py [--repeats 3] [--tokens 4096]

Per input group: the Hessian's accumulation (4 batches of tokens / 4 rows), the solve factor, the
GPTQ solve (NVFP4) and round to nearest's output-error record (one triangular solve with the factor).
Only calls that every version since the in-place factor has (HessianAccumulator, solve_factor,
gptq_quantize, SolveFactor.output_errors), so that bench/compare_commits.py can run it in an older
checkout too (copy the script there). Prints a markdown table; the median of --repeats in ms.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from mixprec.inference.algorithms.gptq import HessianAccumulator, gptq_quantize, solve_factor
from mixprec.quantization import quantize
from mixprec.scaling import Granularity

GROUPS = {"q/k/v (stacked)": (6144, 2048), "o_proj": (2048, 2048), "gate/up (stacked)": (11264, 2048),
          "down_proj": (2048, 5632)}  # fmt: skip


def one_group(out_f: int, in_f: int, tokens: int, gen: torch.Generator) -> dict[str, float]:
    """Seconds of each part for one input group."""
    x = (torch.randn(tokens, in_f, generator=gen) * 0.5).bfloat16()
    w = (torch.randn(out_f, in_f, generator=gen) * 0.02).bfloat16()
    g = Granularity.nvfp4()
    times = {}
    started = time.perf_counter()
    acc = HessianAccumulator(in_f)
    for part in x.chunk(4):
        acc.add(part)
    h = acc.finish()
    times["Hessian"] = time.perf_counter() - started
    started = time.perf_counter()
    factor = solve_factor(h, 0.01, False, consume=True)
    times["solve factor"] = time.perf_counter() - started
    started = time.perf_counter()
    gptq_quantize(w, factor, "e2m1", g)
    times["GPTQ solve"] = time.perf_counter() - started
    rtn = quantize(w.float(), "e2m1", g).dequantize()
    started = time.perf_counter()
    factor.output_errors(w, rtn)
    times["RTN error record"] = time.perf_counter() - started
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=4096)
    args = p.parse_args()
    print(f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{args.tokens} tokens, NVFP4")  # fmt: skip
    runs: dict[tuple[str, str], list[float]] = {}
    for r in range(args.repeats):
        gen = torch.Generator().manual_seed(r)
        for name, (out_f, in_f) in GROUPS.items():
            for part, seconds in one_group(out_f, in_f, args.tokens, gen).items():
                runs.setdefault((name, part), []).append(seconds)
    print("\n| group | part | ms |\n|---|---|---:|")
    total = 0.0
    for (name, part), values in runs.items():
        ms = statistics.median(values) * 1e3
        total += ms
        print(f"| {name} | {part} | {ms:.1f} |")
    print(f"| all | all | {total:.1f} |")


if __name__ == "__main__":
    main()
