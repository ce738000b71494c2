"""ConversionReport: every module of a converted model, the precision it got, and why — one type for
both wings. Training conversion fills the module table; inference quantization (a report with a
`scheme`) adds per-layer scale statistics, weight bytes before and after, and warnings.

Printable as a rich table (``rich.print(report)`` or ``report.print()``), as plain text (``str(report)``),
and as a dict / JSON (``report.to_dict()``, ``report.to_json()``; schema in docs/train.md).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from mixprec.errors import MixprecError

_PACKAGE_DIR = str(Path(__file__).resolve().parent) + os.sep


def _levels_to_the_caller() -> int:
    """The `stacklevel` that points warnings.warn, called by this function's caller, at the first frame
    outside the package: counting helper depths by hand broke each time a pipeline was cut into steps."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


SCHEMA_VERSION = 6  # 6: offline inference reports carry `stages` (time and peak RSS of each); 5: inference reports carry `algorithm` (GPTQ: parameters, data, per-layer output errors); 4: inference reports say the real kind (fp8 / fp4 / mixed) and each layer its own; 3: `calibration` says the clipped share its stop rule watches; 2: inference reports carry `calibration`
# the precision prefixes of a quantized module: the family of its format
QUANTIZED_KINDS = ("fp8", "fp4")


@dataclass
class ModuleEntry:
    name: str  # fully-qualified name; "" is the root module
    type: str  # class name before conversion
    role: str  # linear, head, router, norm, embedding, softmax, experts, container, stateless, other
    precision: (
        str  # e.g. "fp8:fp8-delayed", "bf16", "fp32", "fp32 params, bf16 autocast", "skipped: ...", "-"
    )
    reason: str
    converted_to: str | None = None  # class name after conversion when the module was replaced
    num_params: int = 0


@dataclass
class ConversionReport:
    recipe: str
    kind: str  # training: fp8, fp4, bf16, bf16-amp, fp16-amp, fp32; inference: fp8, fp4, mixed (see reported_kind)
    device: str
    param_dtype: str
    entries: list[ModuleEntry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Inference quantization (quantize_model_, quantize_checkpoint, load_quantized) sets `scheme`; then
    # to_dict() carries these fields too.
    scheme: str | None = None
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> stats (scales file entry)
    weight_bytes_before: int = 0
    weight_bytes_after: int = 0
    warnings: list[str] = field(default_factory=list)
    output: str | None = None
    calibration: dict[str, Any] | None = None  # what calibration ran and why it stopped (static schemes)
    algorithm: dict[str, Any] | None = None  # what ran beyond round to nearest (--algorithm), per layer
    stages: list[dict[str, Any]] | None = None  # an offline quantization's stages: time and peak RSS of each

    # ---- building (inference) --------------------------------------------------------------------
    def add_quantized_linear(
        self, name: str, type_: str, num_params: int, stats: dict[str, Any], converted_to: str, kind: str
    ) -> None:
        """A Linear quantized under this report's scheme; `stats` is its scales-file entry and `kind` its
        scheme's family ("fp8" or "fp4": the precision reads `fp4:nvfp4`)."""
        if kind not in QUANTIZED_KINDS:
            raise ValueError(f"kind {kind!r} is not one of {QUANTIZED_KINDS}")
        rel = stats.get("weight", {}).get("relative_error")
        reason = f"rel. weight error {rel:.2e}" if rel is not None else ""
        self.entries.append(
            ModuleEntry(name, type_, "linear", f"{kind}:{self.scheme}", reason, converted_to, num_params)
        )
        self.layers[name] = stats

    def add_skipped(self, name: str, type_: str, num_params: int, reason: str, role: str = "linear") -> None:
        self.entries.append(ModuleEntry(name, type_, role, f"skipped: {reason}", reason, None, num_params))

    def warn(self, message: str) -> None:
        """Record a warning in the report and raise it as a UserWarning attributed to the first line
        outside mixprec (the user's call), however many of mixprec's helpers lie in between."""
        self.warnings.append(message)
        warnings.warn(message, stacklevel=_levels_to_the_caller())

    # ---- queries -------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> ModuleEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return any(e.name == name for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def names(self, precision_prefix: str) -> list[str]:
        """Qualified names whose precision starts with `precision_prefix` (e.g. "fp8", "skipped")."""
        return [e.name for e in self.entries if e.precision.startswith(precision_prefix)]

    @property
    def converted(self) -> list[str]:
        """Modules that run FP8 (or FP4) GEMMs."""
        return self.names(QUANTIZED_KINDS)  # type: ignore[arg-type]  (str.startswith takes a tuple)

    @property
    def reported_kind(self) -> str:
        """The kind `to_dict` reports. Training: the recipe's kind. Inference: the family of the layers
        it quantized — "fp8", "fp4", or "mixed" when a checkpoint holds both (each layer's precision
        says its own) — and the kind it was built with while it quantized none."""
        if self.scheme is None:
            return self.kind
        kinds = {e.precision.split(":")[0] for e in self.entries if e.precision.startswith(QUANTIZED_KINDS)}
        return kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else self.kind)

    @property
    def skipped(self) -> list[str]:
        """Modules the recipe could not take (each with its reason)."""
        return self.names("skipped")

    @property
    def max_relative_weight_error(self) -> float:
        errs = [s.get("weight", {}).get("relative_error", 0.0) for s in self.layers.values()]
        return max(errs, default=0.0)

    def summary(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for e in self.entries:
            if e.role in ("container", "stateless"):
                continue
            key = e.precision.split(" (")[0]
            counts[key] = counts.get(key, 0) + 1
        return counts

    # ---- output --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {
            "schema_version": SCHEMA_VERSION,
            "recipe": self.recipe,
            "kind": self.reported_kind,
            "device": self.device,
            "param_dtype": self.param_dtype,
            "summary": self.summary(),
            "notes": list(self.notes),
            "modules": [asdict(e) for e in self.entries],
        }
        if self.scheme is not None:
            d.update(
                scheme=self.scheme,
                weight_bytes_before=self.weight_bytes_before,
                weight_bytes_after=self.weight_bytes_after,
                max_relative_weight_error=self.max_relative_weight_error,
                warnings=list(self.warnings),
                output=self.output,
                calibration=self.calibration,
                algorithm=self.algorithm,
                stages=self.stages,
            )
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def rich_table(self, *, show_all: bool = True):
        from rich.table import Table

        table = Table(title=f"mixprec conversion: {self.recipe} ({self.device}, params {self.param_dtype})")
        for col in ("module", "type", "role", "precision", "reason"):
            table.add_column(col, overflow="fold")
        for e in self.entries:
            if not show_all and e.role in ("container", "stateless"):
                continue
            style = (
                "green"
                if e.precision.startswith(("fp8", "fp4"))
                else ("red" if "skipped" in e.precision else None)
            )
            t = e.type if e.converted_to is None else f"{e.type} -> {e.converted_to}"
            table.add_row(e.name or "(root)", t, e.role, e.precision, e.reason, style=style)
        if self.notes:
            table.caption = " | ".join(self.notes)
        return table

    def __rich__(self):
        return self.rich_table()

    def print(self, *, show_all: bool = True) -> None:
        from rich.console import Console

        Console().print(self.rich_table(show_all=show_all))

    def __str__(self) -> str:
        rows = [("module", "type", "role", "precision", "reason")]
        for e in self.entries:
            t = e.type if e.converted_to is None else f"{e.type}->{e.converted_to}"
            rows.append((e.name or "(root)", t, e.role, e.precision, e.reason))
        widths = [min(48, max(len(r[i]) for r in rows)) for i in range(4)]
        lines = [f"mixprec conversion: {self.recipe} on {self.device}, parameters {self.param_dtype}"]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def replace_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` where the submodule `name` ("model.layers.0.mlp.up_proj") of `model` is: the one way
    both wings swap a module on its parent. MixprecError for the root ("") or a name `model` lacks."""
    if not name:
        raise MixprecError(
            f"the root module ({type(model).__name__}) cannot be replaced in place; "
            "convert a model that holds it (e.g. nn.Sequential(module))"
        )
    try:
        model.set_submodule(name, new, strict=True)
    except AttributeError as exc:
        raise MixprecError(f"{type(model).__name__} has no submodule {name!r} to replace: {exc}") from None
