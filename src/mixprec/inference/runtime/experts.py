"""MoE experts, one Linear per expert: what lets fused transformers experts be calibrated and run in FP8 or FP4.

transformers 5 holds a layer's experts as fused 3-D parameters (`gate_up_proj` [experts, 2*inter,
hidden], `down_proj` [experts, hidden, inter]) behind the `use_experts_implementation` contract;
checkpoints (and vLLM) keep one 2-D weight per expert (`experts.0.w1.weight`, see linear_weights.py).
`UnfusedExperts` runs that contract's eager forward over one module per expert and checkpoint weight
(an nn.Linear for calibration or a high-precision weight, an QuantizedLinear for FP8): the pieces
of a fused row block (w1 and w3 of `gate_up_proj`) stay separate Linears whose outputs are
concatenated, which equals the fused product exactly and lets each keep its own scales.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from mixprec.conversion import replace_submodule
from mixprec.errors import MixprecError
from mixprec.inference.checkpoint.linear_weights import ExpertSlot, expert_slots


def check_supported(module: nn.Module, name: str) -> None:
    """MixprecError unless `module` follows transformers' standard experts contract in the layout
    UnfusedExperts runs (not transposed, gate and up concatenated, no biases, no post-expert norm)."""
    flags = {a: getattr(module, a, None) for a in ("has_gate", "is_transposed", "is_concatenated", "has_bias",
                                                   "has_post_expert_norm")}  # fmt: skip
    if None in flags.values() or not hasattr(module, "num_experts"):
        raise MixprecError(
            f"{name} ({type(module).__name__}) is not a transformers experts module mixprec can unfuse "
            "(it needs the use_experts_implementation contract); keep its experts in high precision with "
            "--ignore 're:.*experts.*'"
        )
    bad = [a for a in ("is_transposed", "has_bias", "has_post_expert_norm") if flags[a]]
    if bad or not flags["is_concatenated"]:
        raise MixprecError(
            f"{name} ({type(module).__name__}): per-expert Linears are run for experts without "
            f"{', '.join(bad) or 'interleaved gate/up'} only; keep them in high precision with "
            "--ignore 're:.*experts.*'"
        )


class UnfusedExperts(nn.Module):
    """A transformers experts module with one module per expert and fused-parameter part.

    `projections[attr][e][p]` computes x -> x W_pᵀ for part p of row block `attr[e]` (attr is
    gate_up_proj / up_proj / down_proj). The forward is the contract's eager forward.
    """

    def __init__(
        self, original: nn.Module, projections: dict[str, list[list[nn.Module]]], name: str = "experts"
    ):
        super().__init__()
        check_supported(original, name)
        # kept for its gating function and activation, not as a submodule: its fused parameters are gone
        object.__setattr__(self, "_original", original)
        self.num_experts = int(original.num_experts)
        self.has_gate = bool(original.has_gate)
        self.projections = nn.ModuleDict(
            {a: nn.ModuleList(nn.ModuleList(parts) for parts in per_expert) for a, per_expert in projections.items()}
        )  # fmt: skip
        need = ("gate_up_proj" if self.has_gate else "up_proj", "down_proj")
        for attr in need:
            if attr not in self.projections or len(self.projections[attr]) != self.num_experts:
                raise MixprecError(f"{name}: {attr} needs one entry per expert ({self.num_experts})")

    def _project(self, attr: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        parts = self.projections[attr][expert]
        if len(parts) == 1:
            return parts[0](x)
        return torch.cat([p(x) for p in parts], dim=-1)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        orig = self._original
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            if e == self.num_experts:  # the slot of tokens sent to no expert (expert parallelism)
                continue
            top_k_pos, token_idx = torch.where(mask[e])
            x = hidden_states[token_idx]
            if self.has_gate:
                h = type(orig)._apply_gate(orig, self._project("gate_up_proj", e, x))
            else:
                h = orig.act_fn(self._project("up_proj", e, x))
            h = self._project("down_proj", e, h)
            h = h * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, h.to(final.dtype))
        return final


def part_path(slot: ExpertSlot) -> str:
    """The module path of a slot's part inside the model once its experts are an UnfusedExperts."""
    return f"{slot.module}.projections.{slot.attr}.{slot.expert}.{slot.part}"


def group_slots(slots: Iterable[tuple[str, ExpertSlot]]) -> dict[str, dict[str, ExpertSlot]]:
    """{experts module: {checkpoint name: slot}}."""
    groups: dict[str, dict[str, ExpertSlot]] = {}
    for name, slot in slots:
        groups.setdefault(slot.module, {})[name] = slot
    return groups


def assemble(model: nn.Module, module_name: str, parts: dict[str, tuple[ExpertSlot, nn.Module]]) -> None:
    """Replace experts module `module_name` by an UnfusedExperts of `parts` ({checkpoint name: (slot,
    part module)}), which must cover every expert and part of its fused parameters."""
    original = model.get_submodule(module_name)
    fused = {n: p for n, p in original.named_parameters(recurse=False) if p.dim() == 3}
    table: dict[str, list[list[nn.Module | None]]] = {}
    for slot, mod in parts.values():
        if slot.attr not in fused:
            raise MixprecError(f"{module_name} has no fused expert parameter {slot.attr!r}")
        rows = table.setdefault(slot.attr, [[None] * slot.parts for _ in range(fused[slot.attr].shape[0])])
        rows[slot.expert][slot.part] = mod
    missing = [f"{a}[{e}] part {p}" for a in fused for e, row in enumerate(table.get(a, [[None]] * fused[a].shape[0]))
               for p, m in enumerate(row) if m is None]  # fmt: skip
    if missing:
        raise MixprecError(
            f"{module_name}: the checkpoint lacks per-expert weights for {', '.join(missing[:4])}"
            + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        )
    replace_submodule(model, module_name, UnfusedExperts(original, table, module_name))  # type: ignore[arg-type]


def unfuse_for_calibration(model: nn.Module, slots: dict[str, ExpertSlot]) -> dict[str, str]:
    """Swap the experts modules holding `slots` for UnfusedExperts of nn.Linear views of their fused
    weights (no copy), so hooks see each expert's inputs; returns {checkpoint name: module path}."""
    paths: dict[str, str] = {}
    for module_name, group in group_slots(slots.items()).items():
        original = model.get_submodule(module_name)
        check_supported(original, module_name)
        parts: dict[str, tuple[ExpertSlot, nn.Module]] = {}
        for name, slot in group.items():
            w = getattr(original, slot.attr)[slot.expert, slot.part * slot.rows : (slot.part + 1) * slot.rows]
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            lin.weight = nn.Parameter(w.detach(), requires_grad=False)
            parts[name] = (slot, lin)
            paths[name] = part_path(slot)
        assemble(model, module_name, parts)
    return paths


def unfuse_skeleton(model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """For loading: replace each fused experts module whose per-expert weights the checkpoint stores
    (`shapes`: {checkpoint module name: weight shape}) by an UnfusedExperts of placeholder nn.Linears
    on the meta device, to be replaced or filled like any Linear; returns {checkpoint name: path}."""

    modules = dict(model.named_modules())
    two_d = {n: (s[0], s[1]) for n, s in shapes.items() if len(s) == 2 and n not in modules}
    slots = expert_slots(model, list(two_d), two_d) if two_d else {}
    for module_name, group in group_slots(slots.items()).items():
        check_supported(model.get_submodule(module_name), module_name)
        parts = {
            n: (slot, nn.Linear(two_d[n][1], two_d[n][0], bias=False, device="meta"))
            for n, slot in group.items()
        }
        assemble(model, module_name, parts)
    return {n: part_path(slot) for n, slot in slots.items()}


_FUSED_ATTRS = ("gate_up_proj", "up_proj", "down_proj")


def _has_fused(module: nn.Module) -> bool:
    return any(isinstance(p := getattr(module, a, None), torch.Tensor) and p.dim() == 3 for a in _FUSED_ATTRS)


def unfuse_live(model: nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """For quantizing a loaded model in place (runtime/online.py): replace each fused transformers experts
    module (3-D `gate_up_proj` / `up_proj` and `down_proj`) by an UnfusedExperts of nn.Linears whose
    weights are views of the fused ones (no copy; the fused parameters leave the model, their storage
    lives on in the views until the Linears are quantized). Gate and up stay two Linears per expert, as
    a checkpoint stores them (w1, w3). Returns ({part path: its fused parameter's path}, {experts module
    left fused: why}); the forward is unchanged (UnfusedExperts runs the same eager computation)."""
    found = [(name, m) for name, m in model.named_modules() if hasattr(m, "num_experts") and _has_fused(m)]
    paths: dict[str, str] = {}
    left: dict[str, str] = {}
    for module_name, original in found:
        try:
            check_supported(original, module_name)
        except MixprecError as e:
            left[module_name] = str(e)
            continue
        parts: dict[str, tuple[ExpertSlot, nn.Module]] = {}
        for attr in ("gate_up_proj" if original.has_gate else "up_proj", "down_proj"):
            fused = getattr(original, attr)
            n_parts = 2 if attr == "gate_up_proj" else 1
            rows = fused.shape[1] // n_parts
            for e in range(fused.shape[0]):
                for part in range(n_parts):
                    slot = ExpertSlot(f"{module_name}.{attr}", e, part, n_parts, rows)
                    lin = nn.Linear(fused.shape[2], rows, bias=False, device="meta")
                    lin.weight = nn.Parameter(fused.detach()[e, part * rows : (part + 1) * rows],
                                              requires_grad=fused.requires_grad)  # fmt: skip
                    parts[part_path(slot)] = (slot, lin)
                    paths[part_path(slot)] = slot.param
        assemble(model, module_name, parts)
        for attr in _FUSED_ATTRS:  # the views hold what the Linears need
            p = getattr(original, attr, None)
            if isinstance(p, nn.Parameter):
                setattr(original, attr, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta")))
    return paths, left
