"""The result of `mixprec evaluate`: every figure, as an object and as JSON (docs/schemas/evaluate.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from mixprec.evaluation.gates import GateResult
from mixprec.files import write_json_atomic

# 2: confidence intervals and gate verdicts, one text sample per line, the clip task
SCHEMA_VERSION = 2


@dataclass
class EvaluationResult:
    reference: dict  # source, kind, architecture, dtype, weight bytes on disk / in memory
    candidate: dict  # same, plus scheme for online candidates
    data: dict  # path, samples requested / used, seq_len, tokenizer
    tasks: dict  # task name -> figures
    memory: dict
    throughput: dict  # headline throughput (the first task run); per task under tasks[name]["throughput"]
    machine: dict
    gates: list[GateResult] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    per_sample: dict = field(default_factory=dict)  # lists for plots: nll per sample, cosine per sample
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        """True when no gate is `worse` (under strict: every gate `equivalent`); true when no gate was set."""
        return all(g.passed for g in self.gates)

    def to_dict(self) -> dict:
        return _finite({
            "schema_version": SCHEMA_VERSION,
            "passed": self.passed,
            "reference": self.reference,
            "candidate": self.candidate,
            "data": self.data,
            "tasks": self.tasks,
            "memory": self.memory,
            "throughput": self.throughput,
            "machine": self.machine,
            "gates": [g.to_dict() for g in self.gates],
            "settings": self.settings,
            "warnings": self.warnings,
            "per_sample": self.per_sample,
            "seconds": self.seconds,
        })  # fmt: skip

    def write_json(self, path: str | Path) -> Path:
        return write_json_atomic(path, self.to_dict())


def _finite(obj):
    """JSON has no inf/NaN: write them as strings "inf", "-inf", "nan" (documented in the schema)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


__all__ = ["SCHEMA_VERSION", "EvaluationResult"]
