"""Public entry for inference verification; the implementation lives in mixprec.evaluation."""

from mixprec.evaluation import SCHEMA_VERSION, EvaluationResult, Gates, evaluate, write_report

__all__ = ["SCHEMA_VERSION", "EvaluationResult", "Gates", "evaluate", "write_report"]
