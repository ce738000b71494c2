"""The choice of `--scheme auto` across budgets: the predicted budget curve, each candidate alone, and
the bisection over budgets for the smallest checkpoint whose measured perplexity increase meets a
target (`--target-ppl-increase`)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mixprec.conversion import ConversionReport
from mixprec.errors import MixprecError
from mixprec.sensitivity.allocation import Allocation, Budget, allocate, group_options, uniform
from mixprec.sensitivity.scores import Scores

Measure = Callable[[Path], Mapping[str, float]]


def count_schemes(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def budget_curve(scores: Scores, dtype_bits: int, points: int = 9) -> list[dict[str, Any]]:
    """The predicted score of the exact choice at `points` budgets from the smallest possible
    checkpoint to everything kept (bits per weight)."""
    options = group_options(scores, dtype_bits)
    weights = sum(o * i for o, i in scores.shapes.values())
    lo = sum(min(o.cost for o in opts) for opts in options.values()) / weights
    hi = sum(max(o.cost for o in opts) for opts in options.values()) / weights
    out = []
    for i in range(points):
        bits = lo + (hi - lo) * i / max(1, points - 1)
        plan = allocate(scores, Budget(bits=bits + 1e-9), dtype_bits=dtype_bits)
        out.append({"budget_bits": bits, "bits_per_weight": plan.bits_per_weight, "predicted_score": plan.predicted,
                    "schemes": count_schemes(plan.layers.values())})  # fmt: skip
    return out


def uniform_table(scores: Scores, dtype_bits: int) -> dict[str, dict[str, Any]]:
    out = {}
    for c in scores.candidates:
        plan = uniform(scores, c, dtype_bits=dtype_bits)
        out[c] = {"bits_per_weight": plan.bits_per_weight, "predicted_score": plan.predicted}
    return out


def search_budget(
    scores: Scores,
    dtype_bits: int,
    target: float,
    measure: Measure,
    write: Callable[[Allocation, Path, bool], ConversionReport],
    output_dir: Path,
    steps: int,
) -> tuple[Allocation, dict[str, Any], list[dict[str, Any]]]:
    """Bisection over the budget (bits per weight) for the smallest checkpoint whose measured
    perplexity increase is at most `target`: everything kept meets it, the smallest checkpoint is
    tried first. Assumes the measured increase falls as the budget grows (the predicted score does);
    every evaluation is recorded."""
    options = group_options(scores, dtype_bits)
    weights = sum(o * i for o, i in scores.shapes.values())
    lo = sum(min(o.cost for o in opts) for opts in options.values()) / weights
    hi = sum(max(o.cost for o in opts) for opts in options.values()) / weights
    search: list[dict[str, Any]] = []
    best: tuple[Allocation, dict[str, Any]] | None = None
    work = Path(tempfile.mkdtemp(prefix=".auto-search-", dir=output_dir.parent))
    try:
        bits, low_fails = lo, None
        for step in range(max(1, steps)):
            plan = allocate(scores, Budget(bits=bits + 1e-9), dtype_bits=dtype_bits)
            out = work / f"step{step}"
            write(plan, out, False)
            m = dict(measure(out))
            shutil.rmtree(out, ignore_errors=True)
            increase = m["candidate_perplexity"] / m["reference_perplexity"] - 1
            ok = increase <= target
            search.append({"step": step, "budget_bits": bits, "bits_per_weight": plan.bits_per_weight,
                           "predicted_score": plan.predicted, "measured": m, "meets_target": ok})  # fmt: skip
            if ok:
                if best is None or plan.bits < best[0].bits:
                    best = (plan, m)
                hi = bits
            else:
                low_fails = bits
            if ok and step == 0:
                break  # the smallest checkpoint meets it
            bits = (hi + (low_fails if low_fails is not None else lo)) / 2
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if best is None:
        tried = ", ".join(f"{p['bits_per_weight']:.2f} bits: {p['measured']['candidate_perplexity'] / p['measured']['reference_perplexity'] - 1:+.2%}" for p in search)  # fmt: skip
        raise MixprecError(
            f"no checkpoint of the {len(search)} measured met --target-ppl-increase {target:.2%} ({tried}); "
            "allow more --search-steps or a larger increase"
        )
    return best[0], best[1], search


__all__ = ["Measure", "budget_curve", "count_schemes", "search_budget", "uniform_table"]
