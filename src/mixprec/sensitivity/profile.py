"""The what-if precision profile: what every quantizing recipe would do to every Linear of a model.

    profile = profile_model(model, batches, passes=4)          # high-precision passes, no FP8 run
    profile.cell("model.layers.0.mlp.down_proj", "input", "fp8-delayed").peak_saturation

A few forward/backward passes run a copy of the model in high precision (bf16 by default: the
parameters and compute of the FP8 recipes' own high-precision parts; or fp32). Every Linear the
default training policy would convert shows its input, weight and grad_output to hooks; each tensor is
quantized, for every recipe, the way that recipe quantizes that role for its primary GEMM (input and
weight as in the forward GEMM, grad_output as in the grad_input GEMM: `recipe.operand(role, False)`,
the layout the precision monitor observes) by THE quantizer, with the scale the recipe would use
(sensitivity.simulate: delayed scaling from the amax history of the earlier passes). The counts per
pass and their sums make the profile (sensitivity.statistics). With lr > 0 every pass ends with an
optimizer step (mixprec's AdamW), so the history sees the weights move as in early training;
lr = 0 (the default) keeps the weights, and the passes differ only by their batches.

Recipes: every recipe of the registry (mixprec.recipes.RECIPES) that quantizes (has `operand`), with
its default options, unless a list is given: new recipes join without a change here. The FP4 recipes'
stochastically rounded grad_output is quantized with the noise training would draw for it at that
step (mixprec.training.quantizer_state.rounding_key: seed, pass as the step, rank 0, the first backward of
the step), so its counts are those of the FP4 run's first backward.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.models import lm_loss
from mixprec.progress import progress_bar
from mixprec.recipes import RECIPES, ROLES, from_name
from mixprec.scaling import as_2d
from mixprec.sensitivity.simulate import RecipeScales, is_quantizing
from mixprec.sensitivity.statistics import Counts, quantization_counts
from mixprec.training import TrainingStep, convert_for_training
from mixprec.training.optim import AdamW
from mixprec.training.policy import Policy, decide
from mixprec.training.quantizer_state import rounding_key

SCHEMA_VERSION = 2  # 2: saturation leaves out block scales' own rounding; limits gained FP4's
PRECISIONS = ("bf16", "fp32")


def quantizing_recipes() -> list[str]:
    """The name of every recipe in the registry that quantizes a Linear's tensors, in registry order."""
    return [name for name in RECIPES if is_quantizing(from_name(name))]


def resolve_recipes(recipes: Sequence[object] | None) -> list[object]:
    """Recipe objects from names with options (or objects); MixprecError for a non-quantizing one."""
    names = quantizing_recipes() if recipes is None else list(recipes)
    if not names:
        raise MixprecError("no recipes to profile")
    objs = [from_name(r) for r in names]  # type: ignore[arg-type]
    for obj in objs:
        if not is_quantizing(obj):
            raise MixprecError(
                f"recipe {obj.spec()} does not quantize (nothing to profile); quantizing recipes: "
                f"{', '.join(quantizing_recipes())}"
            )
    specs = [obj.spec() for obj in objs]
    if len(set(specs)) != len(specs):
        raise MixprecError(f"recipes listed twice: {', '.join(specs)}")
    return objs


@dataclass
class Cell:
    """One layer, one role, one recipe: the counts of every pass."""

    layer: str
    role: str
    recipe: str
    fmt: str
    granularity: str
    passes: list[Counts] = field(default_factory=list)

    @property
    def total(self) -> Counts:
        out = Counts()
        for c in self.passes:
            out = out.merge(c)
        return out

    def _worst(self, key: Callable[[Counts], float], largest: bool) -> tuple[float, int | None]:
        if not self.passes:
            return math.nan, None
        values = [key(c) for c in self.passes]
        value = max(values) if largest else min(values)
        return value, values.index(value)

    @property
    def peak_saturation(self) -> float:
        return self._worst(lambda c: c.saturation, True)[0]

    @property
    def peak_underflow(self) -> float:
        return self._worst(lambda c: c.underflow, True)[0]

    @property
    def min_snr_db(self) -> float:
        return self._worst(lambda c: c.snr_db, False)[0]

    def to_dict(self) -> dict:
        total = self.total
        return {
            "layer": self.layer, "role": self.role, "recipe": self.recipe, "format": self.fmt,
            "granularity": self.granularity, "numel": total.numel, "nonzero": total.nonzero,
            "saturated": total.saturated, "underflowed": total.underflowed,
            "saturation": total.saturation, "underflow": total.underflow, "snr_db": _finite(total.snr_db),
            "peak_saturation": self.peak_saturation, "peak_saturation_pass": self._worst(lambda c: c.saturation, True)[1],
            "peak_underflow": self.peak_underflow, "peak_underflow_pass": self._worst(lambda c: c.underflow, True)[1],
            "min_snr_db": _finite(self.min_snr_db), "min_snr_pass": self._worst(lambda c: c.snr_db, False)[1],
            "per_pass": {
                key: [getattr(c, key) for c in self.passes]
                for key in ("numel", "nonzero", "saturated", "underflowed", "signal", "noise")
            },
        }  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> Cell:
        per = d["per_pass"]
        passes = [
            Counts(*(per[k][i] for k in ("numel", "nonzero", "saturated", "underflowed", "signal", "noise")))
            for i in range(len(per["numel"]))
        ]
        return cls(d["layer"], d["role"], d["recipe"], d["format"], d["granularity"], passes)


def _finite(x: float) -> float | str:
    """JSON has no inf: an exact quantization's SNR is written as the string "inf"."""
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def _float(x: float | str | None) -> float:
    return math.nan if x is None else float(x)


@dataclass
class Profile:
    """What profile_model returns; `to_dict()` is profile.json (docs/schemas/profile.md)."""

    recipes: list[str]  # recipe specs (from_name reads them back)
    layers: list[dict]  # {"name", "in_features", "out_features"}, in module order
    cells: dict[tuple[str, str, str], Cell]  # (layer, role, recipe) -> Cell
    passes: int
    settings: dict = field(default_factory=dict)  # precision, lr, batch size...
    seconds: float = math.nan  # wall time of the passes, statistics included
    model: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)
    machine: str = ""

    def cell(self, layer: str, role: str, recipe: str | object) -> Cell:
        spec = from_name(recipe).spec()  # type: ignore[arg-type]
        key = (layer, role, spec)
        if key not in self.cells:
            if spec not in self.recipes:
                raise MixprecError(f"recipe {spec} is not in this profile ({', '.join(self.recipes)})")
            raise MixprecError(f"no profile entry for layer {layer!r}, role {role!r}")
        return self.cells[key]

    @property
    def layer_names(self) -> list[str]:
        return [layer["name"] for layer in self.layers]

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": "mixprec-profile",
            "recipes": list(self.recipes),
            "roles": list(ROLES),
            "passes": self.passes,
            "settings": dict(self.settings),
            "seconds": self.seconds,
            "seconds_per_pass": self.seconds / self.passes if self.passes else None,
            "model": dict(self.model),
            "data": dict(self.data),
            "machine": self.machine,
            "layers": list(self.layers),
            "cells": [c.to_dict() for c in self.cells.values()],
        }

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        if d.get("kind") != "mixprec-profile" or d.get("schema_version") != SCHEMA_VERSION:
            raise MixprecError(
                f"not a mixprec profile of schema version {SCHEMA_VERSION} "
                f"(kind {d.get('kind')!r}, version {d.get('schema_version')!r})"
            )
        cells = [Cell.from_dict(c) for c in d["cells"]]
        return cls(
            recipes=list(d["recipes"]), layers=list(d["layers"]),
            cells={(c.layer, c.role, c.recipe): c for c in cells}, passes=int(d["passes"]),
            settings=dict(d.get("settings", {})), seconds=_float(d.get("seconds")), model=dict(d.get("model", {})),
            data=dict(d.get("data", {})), machine=d.get("machine", ""),
        )  # fmt: skip


def profiled_linears(model: nn.Module) -> list[str]:
    """The Linears the default training policy converts to an FP8 recipe (the ones a profile scores)."""
    return [
        d.name
        for d in decide(model, Policy())
        if d.action == "convert" and isinstance(model.get_submodule(d.name), nn.Linear)
    ]


class _PassObserver:
    """The forward hooks of a profile: every tensor a profiled Linear shows (input, weight, grad_output)
    is quantized for every recipe, the counts of each pass kept in its cell."""

    def __init__(self, names: list[str], objs: list[object]) -> None:
        self.objs = objs
        self.specs = [obj.spec() for obj in objs]  # type: ignore[attr-defined]
        self.scales = {(n, spec): RecipeScales(obj) for n in names for spec, obj in zip(self.specs, objs)}
        self.cells: dict[tuple[str, str, str], Cell] = {}
        for name in names:
            for role in ROLES:
                for spec, obj in zip(self.specs, objs):
                    op = obj.operand(role, False)  # type: ignore[attr-defined]
                    self.cells[(name, role, spec)] = Cell(name, role, spec, op.fmt.name, op.granularity.name)
        self.pass_index = 0

    def observe(self, name: str, role: str, tensor: torch.Tensor) -> None:
        t2 = as_2d(tensor.detach())
        for spec, obj in zip(self.specs, self.objs):
            op = obj.operand(role, False)  # type: ignore[attr-defined]
            state = self.scales[(name, spec)]
            scale = state.scale(role, t2, op.fmt)
            key = None
            if op.stochastic:  # the noise of this tensor in the run: grad_output in the grad_input GEMM
                key = rounding_key(obj.seed, self.pass_index, 0, name, "grad_input", role)  # type: ignore[attr-defined]
            counts, _ = quantization_counts(
                t2, op.fmt, op.granularity, scale=scale, margin=state.margin, power_of_two=op.power_of_two,
                rounding_key=key,
            )  # fmt: skip
            cell = self.cells[(name, role, spec)]
            if len(cell.passes) > self.pass_index:  # the layer ran twice in this pass (a shared module)
                cell.passes[self.pass_index] = cell.passes[self.pass_index].merge(counts)
            else:
                cell.passes.append(counts)

    def hook_for(self, name: str):
        def hook(module: nn.Module, args, output) -> None:
            self.observe(name, "input", args[0])
            self.observe(name, "weight", module.weight)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: self.observe(name, "grad_output", grad))

        return hook

    def end_pass(self) -> None:
        for state in self.scales.values():
            state.end_pass()
        self.pass_index += 1


def _check_settings(precision: str, lr: float, passes: int | None) -> None:
    if precision not in PRECISIONS:
        raise MixprecError(f"profile precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
        raise MixprecError(f"profile lr must be >= 0, got {lr!r}")
    if passes is not None and (not isinstance(passes, int) or passes < 1):
        raise MixprecError(f"passes must be a positive integer, got {passes!r}")


def profile_model(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    *,
    recipes: Sequence[object] | None = None,
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lm_loss,
    precision: str = "bf16",
    lr: float = 0.0,
    progress: bool = False,
    passes: int | None = None,
    device: str | torch.device | None = None,
) -> Profile:
    """Profile `model` (left unchanged: a copy runs) on `batches`, one pass per batch.

    loss_fn(model, batch) -> scalar loss (default: next-token loss of a causal LM on token blocks).
    precision: "bf16" or "fp32", the precision of the passes. lr > 0: an AdamW step after every pass.
    passes: how many batches to take (None: all). device: where the passes run (None: where the model
    is). Raises MixprecError on bad input before any pass.
    """
    _check_settings(precision, lr, passes)
    objs = resolve_recipes(recipes)
    names = profiled_linears(model)
    if not names:
        raise MixprecError(
            f"{type(model).__name__} has no Linear an FP8 recipe would convert (dims multiples of 16, not a "
            "head, embedding or router): nothing to profile"
        )
    batches = list(batches) if passes is None else [b for _, b in zip(range(passes), batches)]
    if not batches:
        raise MixprecError("no batches to profile with")

    work = copy.deepcopy(model)
    if device is not None:
        work.to(device)
    convert_for_training(work, precision)
    work.train()
    linears = {name: work.get_submodule(name) for name in names}
    observer = _PassObserver(names, objs)
    handles = [m.register_forward_hook(observer.hook_for(n)) for n, m in linears.items()]
    # lr 0: no optimizer, the training step only zeroes the gradients (the passes measure, nothing moves)
    training = TrainingStep(work, AdamW(work.parameters(), lr=lr, weight_decay=0.0) if lr > 0 else None)
    device = next(work.parameters()).device
    start = time.perf_counter()
    try:
        with progress_bar(progress, "profiling", len(batches)) as advance:
            for batch in batches:
                training.backward(loss_fn(work, batch.to(device)))
                observer.end_pass()
                advance()
    finally:
        for h in handles:
            h.remove()
    seconds = time.perf_counter() - start
    layers = [
        {"name": n, "in_features": m.in_features, "out_features": m.out_features} for n, m in linears.items()
    ]
    settings = {"precision": precision, "lr": lr, "batch_shape": list(batches[0].shape)}
    return Profile(observer.specs, layers, observer.cells, len(batches), settings, seconds)


__all__ = ["PRECISIONS", "SCHEMA_VERSION", "Cell", "Profile", "profile_model", "profiled_linears",
           "quantizing_recipes", "resolve_recipes"]  # fmt: skip
