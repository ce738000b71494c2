"""convert_for_training: one call takes a model to a training recipe, in place, and reports every module.

    report = mixprec.convert_for_training(model, "fp8-delayed")      # or a recipe object, or a Policy
    print(report)                                                    # every module, precision, reason

What each recipe kind does to the model:
- fp8 (fp8-delayed, fp8-current, fp8-rowwise, fp8-blockwise, fp8-mxfp8): parameters to bf16; every Linear
  the policy lets through becomes ``LowPrecisionLinear`` (training-core's module, all three GEMMs in FP8); fused
  3-D experts get FP8 GEMMs per expert (training/grouped.py) or are reported skipped.
- fp4 (fp4-nvfp4, fp4-mxfp4): the same, with FP4 GEMMs (``LowPrecisionLinear`` takes FP4 recipes); a recipe's
  ``keep_last=N`` keeps the model's last N blocks in bf16 (policy.last_blocks), after the policy's own rules.
- bf16: parameters to bf16 ("pure" bf16; pair with mixprec.AdamW for fp32 master weights,
  fp32 gradient accumulation and bf16 moments).
- bf16-amp / fp16-amp: fp32 parameters, the model's forward runs under torch.autocast (hooks on the
  root module; activation checkpointing keeps autocast). fp16-amp needs loss scaling:
  ``mixprec.training.make_grad_scaler(model)`` (guide defaults init_scale 2**14, growth_interval 1000).
- fp32: parameters to fp32; the forward and backward run with TF32 off even if enable_fast_paths() is on.
On CPUs without AVX-512-BF16 / AMX, every bf16/fp16 GEMM of the converted model computes in fp32 and
rounds (kernels/bf16_cpu.py; ``cpu_bf16_gemm`` chooses).
Modules the policy keeps stay in the recipe's high precision; rule action "fp32" makes an fp32 island.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.conversion import ConversionReport, ModuleEntry, replace_submodule
from mixprec.errors import MixprecError
from mixprec.kernels import bf16_cpu
from mixprec.recipes import QUANTIZED_KINDS, from_name
from mixprec.training.fast_paths import true_fp32_hooks
from mixprec.training.grouped import convert_experts
from mixprec.training.low_precision_linear import LowPrecisionLinear
from mixprec.training.policy import Decision, Policy, decide, keep_last_blocks


def resolve_recipe(recipe: Any) -> tuple[str, Any, str]:
    """(kind, recipe object, display name) from a recipe name or object; MixprecError when unknown."""
    obj = from_name(recipe)  # names with options, or a recipe object; MixprecError otherwise
    return obj.kind, obj, obj.spec()


@dataclass
class ConversionState:
    """What convert_for_training left on the model (``model._mixprec``), for step helpers and export."""

    kind: str
    recipe: Any
    recipe_name: str
    report: ConversionReport
    converted: dict[str, str] = field(default_factory=dict)  # qualified name -> new class name
    handles: list = field(default_factory=list)


def conversion_state(model: nn.Module) -> ConversionState | None:
    return model.__dict__.get("_mixprec")


class _ContextHooks:
    """Enter a context manager in a forward pre-hook and leave it in the (always-called) forward hook."""

    def __init__(self, factory) -> None:
        self.factory = factory
        self.local = threading.local()

    def pre(self, module, args):
        stack = self.local.__dict__.setdefault("stack", [])
        ctx = self.factory()
        ctx.__enter__()
        stack.append(ctx)

    def post(self, module, args, output):
        self.local.stack.pop().__exit__(None, None, None)

    def register(self, module: nn.Module) -> list:
        return [
            module.register_forward_pre_hook(self.pre),
            module.register_forward_hook(self.post, always_call=True),
        ]


def _cast_tree(x, dtype: torch.dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_cast_tree(v, dtype) for v in x)
    if isinstance(x, dict):  # plain dicts and transformers ModelOutput (a dict subclass)
        y = copy.copy(x)
        for k, v in x.items():
            y[k] = _cast_tree(v, dtype)
        return y
    return x


def _first_float_dtype(x) -> torch.dtype | None:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.dtype
    if isinstance(x, (list, tuple)):
        for v in x:
            d = _first_float_dtype(v)
            if d is not None:
                return d
    return None


def _device_type(module: nn.Module) -> str:
    """Where the module's parameters are now (read per call: a model may move after conversion)."""
    p = next(module.parameters(), None)
    return p.device.type if p is not None else "cpu"


def _fp32_island(module: nn.Module) -> list:
    """fp32 parameters and compute for `module`: inputs to fp32, autocast off, outputs back to input dtype."""
    local = threading.local()

    def pre(mod, args, kwargs):
        ctx = torch.autocast(_device_type(mod), enabled=False)
        ctx.__enter__()
        dtype = _first_float_dtype(args) or _first_float_dtype(list(kwargs.values()))
        local.__dict__.setdefault("stack", []).append((ctx, dtype))
        return _cast_tree(args, torch.float32), {k: _cast_tree(v, torch.float32) for k, v in kwargs.items()}

    def post(mod, args, output):
        ctx, dtype = local.stack.pop()
        ctx.__exit__(None, None, None)
        return _cast_tree(output, dtype) if dtype is not None else output

    return [
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post, always_call=True),
    ]


def _cast_params(modules: list[nn.Module], dtype: torch.dtype, done: set[int]) -> None:
    for m in modules:
        for p in m.parameters(recurse=False):
            if id(p) in done or not p.is_floating_point():
                continue
            done.add(id(p))
            if p.dtype != dtype:
                p.data = p.data.to(dtype)
                if p.grad is not None:
                    p.grad = p.grad.to(dtype)


def _precision(kind: str, recipe_name: str, action: str) -> str:
    if action == "fp32":
        return "fp32" if kind in ("fp32", "bf16", *QUANTIZED_KINDS) else "fp32 (autocast off)"
    if kind in QUANTIZED_KINDS:
        return f"{kind}:{recipe_name}" if action == "convert" else "bf16"
    if kind == "bf16":
        return "bf16"
    if kind in ("bf16-amp", "fp16-amp"):
        return f"fp32 params, {kind[:4]} autocast"
    return "fp32"


def _check_model(model: Any) -> torch.device:
    if not isinstance(model, nn.Module):
        raise MixprecError(f"convert_for_training needs a torch.nn.Module, got {type(model).__name__}")
    if conversion_state(model) is not None:
        raise MixprecError(
            f"{type(model).__name__} was already converted with {conversion_state(model).recipe_name!r}; "
            "convert a fresh model"
        )
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise MixprecError(
            f"convert before wrapping: {type(model.module).__name__} is already wrapped in "
            "DistributedDataParallel (its gradient buckets are fixed to the parameters it saw); convert the "
            "plain model, then wrap it"
        )
    params = list(model.parameters())
    sharded = [n for n, p in model.named_parameters() if hasattr(p, "placements") and hasattr(p, "to_local")]
    if sharded:
        raise MixprecError(
            f"convert before wrapping: {type(model).__name__} has DTensor parameters ({sharded[0]}"
            f"{f' and {len(sharded) - 1} more' if len(sharded) > 1 else ''}): FSDP2 (fully_shard) or tensor "
            "parallelism was already applied; convert the plain model, then shard it"
        )
    if not params:
        raise MixprecError(f"{type(model).__name__} has no parameters: nothing to convert")
    floating = [p for p in params if p.is_floating_point()]
    if not floating:
        dtypes = sorted({str(p.dtype) for p in params})
        raise MixprecError(
            f"{type(model).__name__} has no floating-point parameters (dtypes {', '.join(dtypes)}): "
            "mixprec trains floating-point models; dequantize it first"
        )
    return floating[0].device


def convert_for_training(
    model: nn.Module,
    recipe: Any,
    policy: Policy | Mapping[str, str] | None = None,
    *,
    cpu_bf16_gemm: str = "auto",
) -> ConversionReport:
    """Convert `model` in place for training with `recipe` (a name such as "fp8-delayed" or a recipe object).

    policy: a :class:`mixprec.training.Policy` (default: the guide's policy), or a dict
    ``{name pattern: action}`` (``Policy.from_rules``).
    cpu_bf16_gemm: CPU models only — "auto" computes bf16/fp16 GEMMs in fp32 and rounds when the CPU
    has no AVX-512-BF16 / AMX (native bf16 is slow there), "fp32" always, "native" never. Returns a
    :class:`ConversionReport` listing every module with its precision and the reason. Raises
    MixprecError for an unknown recipe, a model without floating-point parameters, a model already
    converted, or an FP8 recipe with no layer that can take FP8.
    """
    device = _check_model(model)
    kind, recipe_obj, recipe_name = resolve_recipe(recipe)
    fp32_compute = kind != "fp32" and bf16_cpu.should_install(model, cpu_bf16_gemm)
    decisions = decide(model, _policy_of(model, policy, recipe_obj, recipe_name))
    if kind in QUANTIZED_KINDS:
        _check_something_converts(model, decisions, recipe_name)

    low = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp4": torch.bfloat16}.get(kind, torch.float32)
    modules = dict(model.named_modules())
    island_names = [d.name for d in decisions if d.action == "fp32"]
    done: set[int] = set()
    # fp32 islands first so that a parameter shared with the rest of the model follows the island
    _cast_params([modules[n] for n in island_names], torch.float32, done)
    _cast_params(list(modules.values()), low, done)

    state = ConversionState(kind, recipe_obj, recipe_name, report=None)  # type: ignore[arg-type]
    entries: dict[str, ModuleEntry] = {}
    for d in decisions:
        prec = "-" if d.action == "none" else _precision(kind, recipe_name, d.action)
        entries[d.name] = ModuleEntry(d.name, d.type_name, d.role, prec, d.reason, num_params=d.num_params)

    if kind in QUANTIZED_KINDS:
        _apply_fp8(model, decisions, recipe_obj, recipe_name, entries, state)

    state.handles += _precision_hooks(model, kind, island_names, fp32_compute)
    notes = _notes(kind, fp32_compute, device)
    config = getattr(model, "config", None)
    if config is not None and kind in ("bf16", *QUANTIZED_KINDS):
        config.dtype = torch.bfloat16  # what save_pretrained records; export_for_inference sets its own

    report = ConversionReport(
        recipe=recipe_name,
        kind=kind,
        device=str(device),
        param_dtype=str(low).replace("torch.", ""),
        entries=[entries[d.name] for d in decisions],
        notes=notes,
    )
    state.report = report
    model.__dict__["_mixprec"] = state
    return report


def _policy_of(model: nn.Module, policy: Any, recipe_obj: Any, recipe_name: str) -> Policy:
    """The Policy to decide with: a dict of rules becomes one; a recipe's keep_last keeps its last blocks."""
    if isinstance(policy, Mapping):
        policy = Policy.from_rules(policy)  # {"name pattern": "keep" | "convert" | "fp32"}
    policy = policy or Policy()
    if not isinstance(policy, Policy):
        raise MixprecError(
            f"policy must be a mixprec.training.Policy or a dict of name pattern -> action, got {type(policy).__name__}"
        )
    if getattr(recipe_obj, "keep_last", 0):
        policy = keep_last_blocks(model, policy, recipe_obj.keep_last, recipe_name)
    return policy


def _check_something_converts(model: nn.Module, decisions: list, recipe_name: str) -> None:
    """A quantized recipe that would convert no layer is refused, naming why each candidate was kept."""
    layers = ("linear", "head", "router", "experts")
    if any(d.action == "convert" and d.role in layers for d in decisions):
        return
    kept = [f"{d.name} ({d.reason})" for d in decisions if d.role in layers]
    detail = "; ".join(kept[:6]) if kept else "it has no nn.Linear and no fused experts"
    raise MixprecError(f"nothing to convert to {recipe_name} in {type(model).__name__}: {detail}")


def _precision_hooks(model: nn.Module, kind: str, island_names: list[str], fp32_compute: bool) -> list:
    """The hooks that hold each part at its precision: fp32 islands, autocast for the amp kinds, true
    fp32 matmuls for fp32, and the CPU's fp32-compute bf16 GEMMs (installed last, as before)."""
    handles = []
    for n in island_names:
        handles += _fp32_island(model.get_submodule(n))
    if kind in ("bf16-amp", "fp16-amp"):
        amp_dtype = torch.bfloat16 if kind == "bf16-amp" else torch.float16
        autocast = _ContextHooks(lambda: torch.autocast(_device_type(model), dtype=amp_dtype))
        handles += autocast.register(model)
    if kind == "fp32":
        handles += true_fp32_hooks(model)
    if fp32_compute:
        handles.append(bf16_cpu.install(model))
    return handles


def _notes(kind: str, fp32_compute: bool, device: torch.device) -> list[str]:
    notes = []
    if fp32_compute:
        notes.append("CPU: bf16/fp16 GEMMs compute in fp32 and round (as a GPU GEMM with fp32 accumulation)")
    elif kind != "fp32" and device.type == "cpu":
        notes.append("CPU: native bf16/fp16 GEMMs (this CPU has AVX-512-BF16/AMX, or cpu_bf16_gemm='native')")
    if kind in ("bf16", *QUANTIZED_KINDS):
        notes.append("use mixprec.AdamW: fp32 master weights, fp32 gradient accumulation, bf16 moments")
    if kind == "fp16-amp":
        notes.append("fp16 needs loss scaling: mixprec.training.make_grad_scaler(model)")
    return notes


def _apply_fp8(
    model: nn.Module,
    decisions: list[Decision],
    recipe: Any,
    recipe_name: str,
    entries: dict[str, ModuleEntry],
    state: ConversionState,
) -> None:

    converted_any = False
    for d in decisions:
        if d.action != "convert":
            continue
        module = model.get_submodule(d.name) if d.name else model
        e = entries[d.name]
        try:
            if isinstance(module, nn.Linear):
                new = LowPrecisionLinear.from_linear(module, recipe, name=d.name)
            elif d.role == "experts":
                new = convert_experts(module, recipe, name=d.name)
            else:
                continue
            if new is not module:
                replace_submodule(model, d.name, new)  # the root itself cannot be swapped: refused here
        except (MixprecError, NotImplementedError) as exc:
            e.precision = "skipped (stays bf16)"
            e.reason = f"{recipe_name} cannot take it: {exc}"
            continue
        e.converted_to = type(new).__name__
        state.converted[d.name] = type(new).__name__
        converted_any = True
    if not converted_any:
        skipped = "; ".join(
            f"{e.name}: {e.reason}" for e in entries.values() if e.precision.startswith("skipped")
        )
        raise MixprecError(f"nothing converted to {recipe_name}: every candidate was refused ({skipped})")
