"""Verification of a quantized model against its reference: quality, memory and speed, with gates.

Public entry: :func:`evaluate` (also importable as ``mixprec.evaluation.runner.evaluate``).
"""

from mixprec.evaluation.gates import GateResult, Gates, parse_memory_saving
from mixprec.evaluation.intervals import Bootstrap
from mixprec.evaluation.page import write_report
from mixprec.evaluation.result import SCHEMA_VERSION, EvaluationResult
from mixprec.evaluation.runner import TASKS, evaluate

__all__ = [
    "SCHEMA_VERSION",
    "TASKS",
    "Bootstrap",
    "EvaluationResult",
    "GateResult",
    "Gates",
    "evaluate",
    "parse_memory_saving",
    "write_report",
]
