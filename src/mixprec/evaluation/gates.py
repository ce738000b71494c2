"""Gates on the measured figures: quality drop, memory saved, speed-up — each a verdict of mixprec.verdicts.

A quality gate reads the figure's confidence interval, not its point estimate: `equivalent` when the
whole interval lies on the good side of the threshold, `worse` when it lies wholly on the bad side,
`inconclusive` otherwise (with about how many samples would settle it). Memory is counted, not sampled,
and the speed-up is one measurement: their gates compare the figure itself (equivalent or worse).
A gate passes unless it is `worse`; under `strict`, only `equivalent` passes.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from mixprec.errors import MixprecError
from mixprec.verdicts import EQUIVALENT, INCONCLUSIVE, WORSE, Interval, decide, samples_to_settle

_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip

# Which task produces the figure each quality gate reads.
GATE_TASK = {"max_ppl_increase": "lm", "min_bleu": "generate", "min_cosine": "embed"}


def parse_fraction(text: str | float, what: str) -> float:
    """'0.001', '0.1%' -> 0.001."""
    if isinstance(text, (int, float)):
        return float(text)
    s = str(text).strip()
    try:
        return float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise MixprecError(f"{what}: {text!r} is not a number or a percentage (e.g. 0.01 or 1%)") from None


def parse_memory_saving(text: str | float) -> tuple[float, str]:
    """A saving as bytes ('1.8GB', '500MiB', '2000000') or a fraction ('0.4', '40%'): (value, 'bytes'|'fraction').

    A bare number below 1 is a fraction; 1 or more is bytes. GB is 10^9 bytes, GiB 2^30.
    """
    if isinstance(text, (int, float)):
        return (float(text), "fraction") if text < 1 else (float(text), "bytes")
    s = str(text).strip().lower().replace(" ", "")
    if s.endswith("%"):
        return parse_fraction(s, "--min-memory-saving"), "fraction"
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)([a-z]*)", s)
    if not match or (match.group(2) and match.group(2) not in _UNITS):
        raise MixprecError(
            f"--min-memory-saving: {text!r} is neither bytes (e.g. 1.8GB, 500MiB, 2000000) nor a fraction (0.4, 40%)"
        )
    value, unit = float(match.group(1)), match.group(2)
    if unit:
        return value * _UNITS[unit], "bytes"
    return (value, "fraction") if value < 1 else (value, "bytes")


@dataclass(frozen=True)
class Gates:
    """Thresholds; None means the gate is off.

    max_ppl_increase: relative perplexity increase allowed (0.001 = 0.1%); min_bleu: 0..100;
    min_cosine: on the mean per-sample cosine; min_memory_saving: in-memory weight bytes saved, as bytes
    (>= 1) or a fraction of the reference (< 1); min_speedup: candidate tokens/s over reference tokens/s.
    """

    max_ppl_increase: float | None = None
    min_bleu: float | None = None
    min_cosine: float | None = None
    min_memory_saving: float | str | None = None
    min_speedup: float | None = None

    def active(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def required_tasks(self) -> set[str]:
        return {GATE_TASK[k] for k in self.active() if k in GATE_TASK}


@dataclass(frozen=True)
class GateResult:
    name: str
    threshold: float
    measured: float | None  # the point estimate
    passed: bool  # not worse (strict: equivalent)
    unit: str
    verdict: str = EQUIVALENT  # mixprec.verdicts: equivalent | worse | inconclusive
    bound: str = "at most"  # "at most" (the threshold is an upper bound) or "at least"
    interval: dict | None = None  # the figure's confidence interval (Interval.to_dict), None when not sampled
    samples_to_settle: int | None = (
        None  # inconclusive only: about how many samples would settle it; -1: none
    )

    def to_dict(self) -> dict:
        return asdict(self)


def judge(
    name: str, threshold: float, measured: float | None, interval: Interval | None, unit: str, *,
    at_least: bool, strict: bool = False, sampled: bool = False,
) -> GateResult:  # fmt: skip
    """One gate's verdict: from the interval when there is one, else from the figure itself. A `sampled`
    figure without an interval (one sample: no spread to resample) is inconclusive."""
    bound = "at least" if at_least else "at most"
    if measured is None or (isinstance(measured, float) and math.isnan(measured)):
        return GateResult(name, threshold, measured, False, unit, WORSE, bound)  # not measured: fails
    settle = None
    if interval is None and sampled:
        verdict = INCONCLUSIVE
    elif interval is None:
        ok = measured >= threshold if at_least else measured <= threshold
        verdict = EQUIVALENT if ok else WORSE
    else:
        # an "at least" bound is an "at most" bound on the negated figure
        oriented = (
            Interval(-interval.estimate, -interval.high, -interval.low, interval.level, interval.samples)
            if at_least
            else interval
        )
        limit = -threshold if at_least else threshold
        verdict = decide(oriented.low, oriented.high, upper=limit)
        settle = samples_to_settle(oriented, upper=limit)
    passed = verdict == EQUIVALENT or (verdict == INCONCLUSIVE and not strict)
    return GateResult(name, threshold, measured, passed, unit, verdict, bound,
                      None if interval is None else interval.to_dict(), settle)  # fmt: skip


def check_gates(
    gates: Gates, tasks: dict, memory: dict, throughput: dict, intervals: dict | None = None,
    *, strict: bool = False,
) -> list[GateResult]:  # fmt: skip
    """Every active gate's verdict. `intervals`: task -> figure -> Interval (mixprec.verdicts)."""
    intervals = intervals or {}
    results: list[GateResult] = []

    def quality(name: str, task: str, figure: str, threshold: float, unit: str, at_least: bool) -> None:
        interval = intervals.get(task, {}).get(figure)
        measured = tasks[task][figure]
        results.append(
            judge(name, threshold, measured, interval, unit, at_least=at_least, strict=strict, sampled=True)
        )

    if gates.max_ppl_increase is not None:
        t = parse_fraction(gates.max_ppl_increase, "--max-ppl-increase")
        quality("max_ppl_increase", "lm", "perplexity_relative_change", t, "relative", False)
    if gates.min_bleu is not None:
        quality("min_bleu", "generate", "bleu", float(gates.min_bleu), "BLEU 0-100", True)
    if gates.min_cosine is not None:
        quality("min_cosine", "embed", "cosine_mean", float(gates.min_cosine), "cosine", True)
    if gates.min_memory_saving is not None:
        t, kind = parse_memory_saving(gates.min_memory_saving)
        m = memory["weight_saving_bytes"] if kind == "bytes" else memory["weight_saving_fraction"]
        results.append(judge("min_memory_saving", t, m, None, kind, at_least=True, strict=strict))
    if gates.min_speedup is not None:
        m = throughput.get("speedup")
        results.append(
            judge("min_speedup", float(gates.min_speedup), m, None, "x", at_least=True, strict=strict)
        )
    return results


__all__ = [
    "GATE_TASK",
    "GateResult",
    "Gates",
    "check_gates",
    "judge",
    "parse_fraction",
    "parse_memory_saving",
]
