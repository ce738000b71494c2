"""The gradient-flow check: which modules stop the gradient that their inputs should receive.

Fine-tuning a quantized model goes wrong silently when a layer runs its forward without autograd (an
inference layer under `torch.no_grad()`, transformers' FP8 Linear) or its backward drops the input gradient:
adapters behind it still train, the layers before it get nothing. The check runs one forward and backward
with the hidden states leaving the input embeddings made trainable, so every later module's input should
receive a gradient, and names each leaf module where it does not:

- "cut": the input requires a gradient and the output does not (the forward ran outside autograd);
- "dropped": the output received a gradient and the input none (the backward returned None);
- "zeroed": the output's gradient is non-zero and the input's is zero everywhere, although the module's
  weight is not all zeros (a zero weight, as LoRA's B starts, zeroes the input gradient by arithmetic).

Leaf modules with weights are checked (Linears, quantized Linears, norms); parameter-free leaves are not.

The loss is Σ output · r with r fixed by `seed` (non-zero, all positions), so no gradient vanishes by the
loss's own symmetry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError


@dataclass
class ModuleFlow:
    name: str
    kind: str  # the module's class name
    calls: int = 0
    input_requires_grad: bool = False
    output_requires_grad: bool = True
    output_grad_nonzero: bool = False
    input_grad_arrived: bool = False
    input_grad_nonzero: bool = False
    weight_is_zero: bool = False

    @property
    def problem(self) -> str | None:
        if not self.input_requires_grad:
            return None  # nothing trainable before it: nothing to pass on
        if not self.output_requires_grad:
            return "cut"
        if self.output_grad_nonzero and not self.input_grad_arrived:
            return "dropped"
        if self.output_grad_nonzero and not self.input_grad_nonzero and not self.weight_is_zero:
            return "zeroed"
        return None


@dataclass
class GradientFlowReport:
    modules: list[ModuleFlow]

    @property
    def broken(self) -> list[ModuleFlow]:
        return [m for m in self.modules if m.problem is not None]

    @property
    def ok(self) -> bool:
        return not self.broken

    def message(self) -> str:
        bad = self.broken
        if not bad:
            return f"gradient flows through all {len(self.modules)} checked modules"
        named = ", ".join(f"{m.name} ({m.kind}: {m.problem})" for m in bad[:6])
        more = f" and {len(bad) - 6} more" if len(bad) > 6 else ""
        return f"{len(bad)} modules stop the gradient their inputs should receive: {named}{more}"

    def raise_if_broken(self) -> None:
        if not self.ok:
            raise MixprecError(self.message())

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "checked": len(self.modules),
                "broken": [{**asdict(m), "problem": m.problem} for m in self.broken]}  # fmt: skip


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return getattr(value, "logits", None) if not isinstance(value, (tuple, list)) else None


def _watch(name: str, module: nn.Module, flows: dict[str, ModuleFlow]) -> list[Any]:
    """Hooks recording one leaf module's calls. The input is handed on as a view of itself so that its
    gradient hook sees this module's contribution alone (q/k/v share one input: a hook on the shared
    tensor would see the others' gradient even where this module drops its own)."""

    def before(mod: nn.Module, args: tuple) -> tuple | None:
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None or not x.is_floating_point() or not x.requires_grad:
            return None
        alias = x.view_as(x)
        flow = flows.setdefault(name, ModuleFlow(name, type(mod).__name__))
        flow.input_requires_grad = True
        weight = getattr(mod, "weight", None)
        flow.weight_is_zero = isinstance(weight, torch.Tensor) and not bool(weight.detach().any())
        alias.register_hook(lambda g: _arrived(flow, g))
        return (alias, *args[1:])

    def after(mod: nn.Module, args: tuple, output: Any) -> None:
        x, y = _first_tensor(args), _first_tensor(output)
        if x is None or y is None or not x.requires_grad or not y.is_floating_point():
            return
        flow = flows[name]
        flow.calls += 1
        flow.output_requires_grad &= y.requires_grad
        if y.requires_grad:
            y.register_hook(lambda g: _output_grad(flow, g))

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


def _arrived(flow: ModuleFlow, grad: torch.Tensor | None) -> None:
    if grad is None:  # a backward that returned None for the input
        return
    flow.input_grad_arrived = True
    flow.input_grad_nonzero |= bool(grad.abs().sum() > 0)


def _output_grad(flow: ModuleFlow, grad: torch.Tensor) -> None:
    flow.output_grad_nonzero |= bool(grad.abs().sum() > 0)


def _trainable_embeddings(model: nn.Module) -> Any:
    """A hook making the input embeddings' output a trainable leaf (so every later input needs a grad)."""
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    if embeddings is None:
        raise MixprecError(
            f"{type(model).__name__} has no get_input_embeddings(): pass `inputs=` hidden states that "
            "require a gradient instead"
        )
    return embeddings.register_forward_hook(lambda m, a, out: out.detach().requires_grad_())


def check_gradient_flow(
    model: nn.Module,
    batch: torch.Tensor | dict[str, Any],
    *,
    seed: int = 0,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> GradientFlowReport:
    """One forward and backward of `model` on `batch` (input ids, or a dict of model kwargs) with the input
    embeddings' output trainable; the report names every leaf module that stops the gradient. The model's
    parameters' .grad are left as they were; its training mode too."""
    leaves = {n: m for n, m in model.named_modules() if _holds_weights(m)}
    flows: dict[str, ModuleFlow] = {}
    saved = {n: p.grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None  # backward would add into the caller's gradients in place
    handles = [h for n, m in leaves.items() for h in _watch(n, m, flows)]
    handles.append(_trainable_embeddings(model))
    try:
        with torch.enable_grad():
            out = model(**batch) if isinstance(batch, dict) else model(batch)
            loss = loss_fn(out) if loss_fn is not None else _probe_loss(out, seed)
            if loss.requires_grad:
                loss.backward()
    finally:
        for h in handles:
            h.remove()
        for n, p in model.named_parameters():
            p.grad = saved[n]
    return GradientFlowReport([f for n, f in flows.items() if not _is_input_embedding(model, n)])


def _probe_loss(out: Any, seed: int) -> torch.Tensor:
    y = _first_tensor(out)
    if y is None:
        raise MixprecError(f"cannot find the model's output tensor in a {type(out).__name__}: pass loss_fn=")
    gen = torch.Generator().manual_seed(seed)
    r = torch.rand(y.shape, generator=gen).add_(0.5).to(y.device)  # in [0.5, 1.5): never zero
    return (y.float() * r).sum()


def _holds_weights(module: nn.Module) -> bool:
    """A leaf module with parameters, or Linear-like (`in_features`: quantized Linears hold their frozen
    weights as buffers): the modules whose output depends on their input through weights. Parameter-free
    leaves (rotary embeddings read their input's dtype only; activations) are not checked."""
    if any(True for _ in module.children()):
        return False
    return hasattr(module, "in_features") or any(True for _ in module.parameters(recurse=False))


def _is_input_embedding(model: nn.Module, name: str) -> bool:
    get = getattr(model, "get_input_embeddings", None)
    return callable(get) and model.get_submodule(name) is get()
