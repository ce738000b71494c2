"""Pass/fail gates on the measured figures: quality drop, memory saved, speed-up."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from mixprec.errors import MixprecError

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
    measured: float | None
    passed: bool
    unit: str

    def to_dict(self) -> dict:
        return asdict(self)


def check_gates(gates: Gates, tasks: dict, memory: dict, throughput: dict) -> list[GateResult]:
    """Compare every active gate with the measured figures."""
    results: list[GateResult] = []

    def add(name: str, threshold: float, measured: float | None, ok: bool, unit: str) -> None:
        results.append(GateResult(name, threshold, measured, bool(measured is not None and ok), unit))

    if gates.max_ppl_increase is not None:
        t = parse_fraction(gates.max_ppl_increase, "--max-ppl-increase")
        m = tasks["lm"]["perplexity_relative_change"]
        add("max_ppl_increase", t, m, m <= t, "relative")
    if gates.min_bleu is not None:
        m = tasks["generate"]["bleu"]
        add("min_bleu", float(gates.min_bleu), m, m >= float(gates.min_bleu), "BLEU 0-100")
    if gates.min_cosine is not None:
        m = tasks["embed"]["cosine_mean"]
        add("min_cosine", float(gates.min_cosine), m, m >= float(gates.min_cosine), "cosine")
    if gates.min_memory_saving is not None:
        t, kind = parse_memory_saving(gates.min_memory_saving)
        m = memory["weight_saving_bytes"] if kind == "bytes" else memory["weight_saving_fraction"]
        add("min_memory_saving", t, m, m is not None and m >= t, kind)
    if gates.min_speedup is not None:
        m = throughput.get("speedup")
        add("min_speedup", float(gates.min_speedup), m, m is not None and m >= float(gates.min_speedup), "x")
    return results


__all__ = ["GATE_TASK", "GateResult", "Gates", "check_gates", "parse_fraction", "parse_memory_saving"]
