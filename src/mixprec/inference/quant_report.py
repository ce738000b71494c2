"""QuantizationReport: the training ConversionReport plus what inference quantization adds
(per-layer amax / scales / relative weight error, weight bytes before and after, warnings)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mixprec.conversion import ConversionReport, ModuleEntry

__all__ = ["ModuleEntry", "QuantizationReport"]


@dataclass
class QuantizationReport(ConversionReport):
    scheme: str = ""
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> stats (scales file entry)
    weight_bytes_before: int = 0
    weight_bytes_after: int = 0
    warnings: list[str] = field(default_factory=list)
    output: str | None = None

    def add_fp8(
        self, name: str, type_: str, num_params: int, stats: dict[str, Any], converted_to: str
    ) -> None:
        rel = stats.get("weight", {}).get("relative_error")
        reason = f"rel. weight error {rel:.2e}" if rel is not None else ""
        self.entries.append(
            ModuleEntry(name, type_, "linear", f"fp8:{self.scheme}", reason, converted_to, num_params)
        )
        self.layers[name] = stats

    def add_skipped(self, name: str, type_: str, num_params: int, reason: str, role: str = "linear") -> None:
        self.entries.append(ModuleEntry(name, type_, role, f"skipped: {reason}", reason, None, num_params))

    def warn(self, message: str) -> None:
        import warnings

        self.warnings.append(message)
        warnings.warn(message, stacklevel=3)

    @property
    def max_relative_weight_error(self) -> float:
        errs = [s.get("weight", {}).get("relative_error", 0.0) for s in self.layers.values()]
        return max(errs, default=0.0)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d.update(
            scheme=self.scheme,
            weight_bytes_before=self.weight_bytes_before,
            weight_bytes_after=self.weight_bytes_after,
            max_relative_weight_error=self.max_relative_weight_error,
            warnings=list(self.warnings),
            output=self.output,
        )
        return d
