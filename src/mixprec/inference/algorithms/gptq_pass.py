"""GPTQ over a whole model, one transformer block at a time (a BlockPass of the calibration walk,
calibration/layerwise.py): while the block runs on its calibration inputs, the Hessian of every
Linear's input accumulates (one Hessian for the Linears that read the same input: the shards of a
fused q/k/v or gate/up); then each Linear is GPTQ-rounded with its scheme's own scale rule, and with
sequential propagation the block runs again, its weights rounded, to give the next block its inputs.

Scales shared by a fused GEMM are fixed before the solve, as the writer and vLLM would share them:
NVFP4's weight global scale (from the shards' largest amax, in the weights' dtype, as the RTN writer
computes it: block_tensors.fused_global_scales) and fp8-static's per-tensor weight scale (the shards'
largest, which vLLM re-quantizes fused shards to).

Per Linear it records the relative calibration output error of round to nearest and of GPTQ, both
measured with the Hessian (tr(E H E^T) / tr(W H W^T), E the weight error; computed from the group's
solve factor, made in the Hessian's memory: gptq.SolveFactor), the time, the dampening,
how many elements the updates pushed past their block's range (clipped), dead inputs and the token
count. MoE expert weights are GPTQ-rounded each with its own Hessian, from the tokens routed to its
expert; one that saw too few is rounded to nearest instead (gptq_experts.py).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.inference.algorithms.gptq import GptqResult, HessianAccumulator, gptq_quantize, solve_factor
from mixprec.inference.algorithms.gptq_experts import fallback_warning, rtn_group, too_few_tokens
from mixprec.inference.algorithms.scale_search import search_global_scale
from mixprec.inference.algorithms.spec import AlgorithmSpec, GptqParams
from mixprec.inference.calibration.across_ranks import (
    broadcast_object,
    broadcast_tensor,
    sum_across_ranks,
    sum_in_place,
)
from mixprec.inference.calibration.data import tokens_sha256
from mixprec.inference.calibration.layerwise import Captured
from mixprec.inference.checkpoint.block_tensors import fused_global_scales
from mixprec.inference.checkpoint.spill import SpilledResults
from mixprec.inference.schemes import InferenceScheme
from mixprec.kernels.allocator import release_free_memory
from mixprec.quantization import QuantizationStats, quantize
from mixprec.ranks import rank, world_size
from mixprec.scaling import QuantizedTensor, compute_scale
from mixprec.select import fused_shards


def input_groups(names: list[str]) -> list[tuple[str, ...]]:
    """The Linears grouped by the input they read: a fused GEMM's shards together (in the engine's
    order), every other Linear alone; in the order of `names`."""
    shared = {m: tuple(ms) for ms in fused_shards(names).values() for m in ms}
    groups = dict.fromkeys(shared.get(n, (n,)) for n in names)
    return list(groups)


class GptqPass:
    """The BlockPass that GPTQ-rounds every Linear of `schemes` ({name: scheme}); `results` holds
    each one's QuantizedTensor (what the writer stores), `layers` its record, `warnings` what the
    caller should say (too few tokens for a Hessian). experts: the names among `schemes` that are MoE
    expert weights (an expert that saw too few routed tokens is rounded to nearest: gptq_experts.py).

    across_ranks: every rank of the process group runs the walk on its share of the batches; each
    block's Hessians are then SUM-reduced (with their token counts), so every rank holds the Hessians of
    all the batches, and each group is solved on one rank and its results broadcast (_solve_block)."""

    def __init__(self, schemes: Mapping[str, InferenceScheme], params: GptqParams, weight_dtype: torch.dtype,
                 search: bool = False, results: SpilledResults | None = None,
                 across_ranks: bool = False, experts: Collection[str] = ()):  # fmt: skip
        self.schemes = dict(schemes)
        self.search = search  # group scales from the scale search (scale_search.py)
        self.params = params
        self.weight_dtype = weight_dtype
        self.groups = input_groups(list(self.schemes))
        # results: where the rounded weights go (a SpilledResults keeps each block's on disk); default a dict
        self.results: dict[str, QuantizedTensor] | SpilledResults = {} if results is None else results
        self.layers: dict[str, dict[str, Any]] = {}
        self.short: list[tuple[str, int, int]] = []  # (Linear, tokens, inputs) with tokens < inputs
        self.experts = frozenset(experts)
        self.fallen: list[tuple[str, int, int]] = []  # (expert weight, tokens, inputs) rounded to nearest
        self._modules: dict[str, nn.Module] | None = None
        self._hessians: dict[tuple[str, ...], HessianAccumulator] = {}
        self._energies: dict[tuple[str, ...], torch.Tensor] = {}  # per group: its Linears' output energies
        self.hessian_arithmetic: set[str] = set()  # what the Hessians' GEMMs ran on (HessianAccumulator)
        self.across_ranks = across_ranks

    @property
    def needs_outputs(self) -> bool:
        """With sequential propagation the block runs again once rounded: its observing forward's
        outputs are not kept (BlockPass)."""
        return not self.params.sequential

    def hooks(self, own: str, modules: dict[str, nn.Module]) -> list[Any]:
        self._modules = modules  # the walk's: unfused experts also under their checkpoint names
        handles = []
        for group in self.groups:
            if not group[0].startswith(own):
                continue
            first = modules[group[0]]
            acc = HessianAccumulator(first.in_features)
            self._hessians[group] = acc

            def add(_m, args, _acc=acc):
                _acc.add(args[0])

            handles.append(first.register_forward_pre_hook(add))
            handles += self._output_energy_hooks(group, modules)
        return handles

    def _output_energy_hooks(self, group: tuple[str, ...], modules: dict[str, nn.Module]) -> list[Any]:
        """Forward hooks that sum each plain Linear's squared outputs (bias taken off): 2/n of that sum is
        tr(W H W^T), the denominator of its output errors, which otherwise costs a triangular solve of
        N K^2 flops (a third of the GPTQ walk's time at hidden 2048 before). The outputs are the model
        dtype's roundings of x W^T: the ratio moves by well under 0.1 %. The sum is from fp32 row norms
        of the outputs as they are (a float64 sum of squares, upcast element by element, took 8 % of a
        SmolLM2 GPTQ run). NaN: not hooked (an expert weight run by its MoE module): its denominator
        comes from the solve."""
        energies = torch.full((len(group),), float("nan"), dtype=torch.float64)
        self._energies[group] = energies
        handles = []
        for i, m in enumerate(group):
            if type(modules[m]) is not nn.Linear:
                continue
            energies[i] = 0.0

            def add_energy(mod, _args, out, _i=i, _e=energies):
                y = out.detach()
                if mod.bias is not None:
                    y = y.float() - mod.bias.detach().float()
                norms = torch.linalg.vector_norm(y, dim=-1, dtype=torch.float32)  # per row, then summed in
                _e[_i] += float(norms.double().square().sum())  # float64 (one norm of it all: 1e-4 off)

            handles.append(modules[m].register_forward_hook(add_energy))
        return handles

    def after(self, own: str, block: nn.Module, captured: Captured, outputs: Captured,
              rerun: Callable[[nn.Module, Captured], Captured]) -> Captured:  # fmt: skip
        # the block's modules, and the walk's aliases of them; the walk's table is not kept past the block
        walk, self._modules = self._modules or {}, None
        modules = {**walk, **{f"{own}{n}": m for n, m in block.named_modules() if n}}
        if self.across_ranks:
            self._reduce_hessians()
        self._solve_block(modules)
        if isinstance(self.results, SpilledResults):
            self.results.flush()
        return rerun(block, captured) if self.params.sequential else outputs

    def record(
        self, spec: AlgorithmSpec, batches: Sequence[torch.Tensor], seconds: float, data: str
    ) -> dict[str, Any]:
        """The report's `algorithm` (and the side file's body) after the walk."""
        return {
            **spec.to_dict(), "data": data, "data_sha256": tokens_sha256(batches),
            "samples": sum(len(b) for b in batches), "seq_len": int(batches[0].shape[-1]),
            "tokens": sum(b.numel() for b in batches), "propagation": PROPAGATION[self.params.sequential],
            "hessian_arithmetic": ", ".join(sorted(self.hessian_arithmetic)),
            "seconds": seconds, "layers": self.layers,
        }  # fmt: skip

    def warnings(self) -> list[str]:
        """What the caller should warn about after the walk: Hessians that saw fewer tokens than they
        have inputs, expert weights rounded to nearest, and Linears the walk never reached (outside the
        blocks: rounded to nearest)."""
        out = []
        if self.short:
            name, tokens, inputs = max(self.short, key=lambda t: t[2] - t[1])
            out.append(
                f"GPTQ: {len(self.short)} Hessian(s) saw fewer calibration tokens than they have inputs (e.g. "
                f"{name}: {tokens} tokens for {inputs} inputs): the dampening carries them; give more "
                "calibration samples or longer sequences"
            )
        if self.fallen:
            out.append(fallback_warning(self.fallen, sum(n in self.experts for n in self.schemes)))
        missed = [n for n in self.schemes if n not in self.results]
        if missed:
            out.append(f"GPTQ did not reach {len(missed)} Linear(s) outside the transformer blocks (e.g. "
                       f"{missed[0]!r}): they are rounded to nearest")  # fmt: skip
        return out

    def _reduce_hessians(self) -> None:
        """SUM every Hessian of the block (and its row count) over the ranks, in the pass's group order
        (the same on every rank): one collective for the counts, one per Hessian, in place."""
        groups = list(self._hessians)
        rows = sum_across_ranks([self._hessians[g].rows for g in groups])
        for g, n in zip(groups, rows):
            sum_in_place(self._hessians[g].sum)
            sum_in_place(self._energies[g])
            self._hessians[g].rows = n

    def _solve_block(self, modules: dict[str, nn.Module]) -> None:
        """Round every group of the block. Across ranks, group j is solved by rank j % world and its
        rounded weights and records broadcast from there, rather than solved on every rank: the rounded
        weights are then identical on every rank even where the ranks' CPUs round the solve's fp32
        differently (each rank writes some of them, and with sequential propagation each reruns the
        block with them), and the solves, the walk's costly part, are split across the ranks; the price
        is sending the rounded weights (about a byte per weight). With one process: the plain loop."""
        groups = list(self._hessians)
        world = world_size() if self.across_ranks else 1
        solved: dict[str, tuple[QuantizedTensor, dict[str, Any]]] = {}
        for j, group in enumerate(groups):
            acc = self._hessians.pop(group)  # each Hessian freed once its group is rounded (or not ours)
            self.hessian_arithmetic |= acc.arithmetic_used
            # the reduced count: the same on every rank, and so the same choice
            rtn = group[0] in self.experts and too_few_tokens(acc.rows, acc.in_features)
            if rtn:
                self.fallen += [(m, acc.rows, acc.in_features) for m in group]
            elif acc.rows < acc.in_features:
                self.short.append((group[0], acc.rows, acc.in_features))
            if j % world == rank() % world and rtn:
                hessian = acc.finish() if acc.rows else None  # an expert no token reached has none
                weights, shared = self._weights_and_shared(group, modules)
                global_scales = {
                    m: g for m, (_, g) in shared.items()
                }  # FP8 keeps its own scale: the writer's
                solved.update(
                    rtn_group(group, hessian, acc.rows, weights, self.schemes, global_scales, self.search)
                )
            elif j % world == rank() % world:  # ours to solve
                solved.update(
                    self._round_group(group, acc.finish(), acc.rows, modules, self._energies[group])
                )
            del acc, self._energies[group]
            release_free_memory()  # the solve's transient buffers, before the next group's
        for j, group in enumerate(groups):  # in group order on every rank: the records' order too
            for m in group:
                q, layer = solved.pop(m) if m in solved else (None, None)
                if world > 1:
                    q, layer = _broadcast_result(q, layer, src=j % world)
                self.results[m], self.layers[m] = q, layer
                if self.params.sequential:
                    modules[m].weight.data = q.dequantize(modules[m].weight.dtype)

    def _weights_and_shared(self, group: tuple[str, ...], modules: dict[str, nn.Module]):
        """({Linear: weight}, shared_scales of the group): the scales a fused GEMM's shards share."""
        weights = {m: modules[m].weight for m in group}
        amax = {m: float(w.detach().abs().amax()) for m, w in weights.items()}
        return weights, shared_scales(group, amax, self.schemes, self.weight_dtype)

    def _round_group(self, group: tuple[str, ...], hessian: torch.Tensor, rows: int, modules: dict[str, nn.Module],
                     energies: torch.Tensor) -> dict[str, tuple[QuantizedTensor, dict[str, Any]]]:  # fmt: skip
        """{Linear: (its rounded weight, its record)} of one input group (weights not yet replaced).
        energies: each Linear's summed squared outputs over the `rows` calibration rows (NaN: unknown)."""
        out = {}
        weights, shared = self._weights_and_shared(group, modules)
        # one factor for the group, made in the Hessian's memory (it is spent: records come from the factor)
        factor = solve_factor(
            hessian, self.params.damp, self.params.act_order, f"{group[0]}.weight", consume=True
        )
        energy = {m: float(e) * 2.0 / rows for m, e in zip(group, energies.tolist())}  # tr(W H W^T)
        for members in stacks(group, self.schemes, shared, weights):
            scale, global_scale = shared.get(members[0], (None, None))
            started = time.perf_counter()
            result = self._solve_stack(members, factor, weights, scale, global_scale)
            seconds = time.perf_counter() - started
            sizes = [weights[m].shape[0] for m in members]
            ends = itertools.accumulate(sizes)
            for m, (q, clipped), r1 in zip(members, split_rows(result, sizes), ends, strict=True):
                w, sch = weights[m], self.schemes[m]
                mine = slice(r1 - w.shape[0], r1)  # its rows in the stacked solve
                rtn = quantize(w.detach().float(), sch.fmt, sch.weight_granularity, scale=scale,
                               global_scale=global_scale)  # fmt: skip
                error_rtn, error = factor.output_errors(
                    w, rtn.dequantize(), solved=(result.rounded[mine], float(result.energy_rows[mine].sum())),
                    den=None if math.isnan(energy[m]) else energy[m],
                )  # fmt: skip
                out[m] = q, {
                    "output_error_rtn": error_rtn, "output_error": error,
                    # a stacked solve's time, shared out by rows
                    "seconds": round(seconds * w.shape[0] / sum(sizes), 3), "damp": result.damp,
                    "clipped": clipped, "dead_inputs": result.dead_columns, "tokens": rows,
                }  # fmt: skip
        return out

    def _solve_stack(self, members: tuple[str, ...], factor, weights: Mapping[str, torch.Tensor],
                     scale: torch.Tensor | None, global_scale: torch.Tensor | None) -> GptqResult:  # fmt: skip
        """GPTQ of the members' weights stacked by rows, with the group's factor and shared scales."""
        sch = self.schemes[members[0]]
        searched = (
            search_global_scale(global_scale) if self.search and global_scale is not None else global_scale
        )
        stacked = weights[members[0]] if len(members) == 1 else torch.cat([weights[m] for m in members])
        return gptq_quantize(
            stacked, factor, sch.fmt.name, sch.weight_granularity, block=self.params.block, scale=scale,
            global_scale=searched, name=f"{members[0]}.weight", search=self.search,
        )  # fmt: skip


def stacks(group: tuple[str, ...], schemes: Mapping[str, InferenceScheme],
           shared: Mapping[str, tuple[torch.Tensor | None, torch.Tensor | None]],
           weights: Mapping[str, torch.Tensor]) -> list[tuple[str, ...]]:  # fmt: skip
    """The group's Linears in solves: those that can be GPTQ-rounded as one stacked weight, together.
    GPTQ treats every output row on its own (its error feedback runs along a row; a column's rounding
    reads only the row's own block scales), so rows stacked under one Hessian round as they would
    apart, in one column loop instead of several: the loop's per-column cost, not the rows, is what a
    solve costs (random weights of SmolLM2's shapes, NVFP4, one thread, AMX Xeon: 960 x 576 stacked q/k/v
    0.107 ms a column, 576 x 576 q alone 0.075 ms). Stacked together: the same format and scale rule, the same fixed scales (fp8-static's shared per-tensor
    scale, NVFP4's shared global scale), the same dtype, and scales that never span two members' rows
    (row blocks that divide every member's rows; a per-tensor scale only when fixed up front)."""
    out: list[tuple[str, ...]] = []
    for m in group:
        for i, members in enumerate(out):
            if _stack_with(members[0], m, schemes, shared, weights):
                out[i] = (*members, m)
                break
        else:
            out.append((m,))
    return out


def _stack_with(first: str, m: str, schemes, shared, weights) -> bool:
    a, b = schemes[first], schemes[m]
    if (a.fmt.name, a.weight_granularity) != (b.fmt.name, b.weight_granularity):
        return False
    if weights[first].dtype != weights[m].dtype or weights[first].shape[1] != weights[m].shape[1]:
        return False
    (sa, ga), (sb, gb) = shared.get(first, (None, None)), shared.get(m, (None, None))
    if not (_same(sa, sb) and _same(ga, gb)):
        return False
    g = a.weight_granularity
    if g.scale_format == "e4m3" and ga is None:
        return False  # each weight's own global scale
    if g.block_rows is None:
        return sa is not None  # a per-tensor (or per-column) scale: only a shared, fixed one
    return all(weights[n].shape[0] % g.block_rows == 0 for n in (first, m))


def _same(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
    return (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))


def split_rows(result: GptqResult, rows: Sequence[int]) -> list[tuple[QuantizedTensor, int]]:
    """A stacked solve's rounded weight cut back into its Linears' (rounded weight, clipped count)."""
    q = result.quantized
    if len(rows) == 1:
        return [(q, result.clipped)]
    per_block = q.granularity.block_rows  # not None: stacks() stacks per-tensor scales only when fixed
    out, r0 = [], 0
    for n in rows:
        scale = q.scale if q.scale.shape[0] == 1 else q.scale[r0 // per_block : (r0 + n) // per_block]
        part = QuantizedTensor(q.data[r0 : r0 + n].clone(), scale.clone(), q.fmt, q.granularity,
                               torch.Size((n, q.data.shape[1])),
                               None if q.global_scale is None else q.global_scale.clone())  # fmt: skip
        out.append((part, int(result.clipped_rows[r0 : r0 + n].sum())))
        r0 += n
    return out


PROPAGATION = {
    True: "sequential: each block calibrated on the outputs of the blocks before it with their weights "
    "rounded (activations not quantized)",
    False: "parallel: each block calibrated on the outputs of the unquantized blocks before it",
}


def shared_scales(group: tuple[str, ...], amax: dict[str, float], schemes: Mapping[str, InferenceScheme],
                   dtype: torch.dtype) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:  # fmt: skip
    """{Linear: (fixed per-tensor scale, NVFP4 global scale)} shared across a fused group."""
    out: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
    nv = {m: a for m, a in amax.items() if schemes[m].weight_granularity.scale_format == "e4m3"}
    for m, g in fused_global_scales(nv, dtype).items():
        out[m] = (None, g)
    per_tensor = [m for m in group if schemes[m].weight_granularity.name == "tensor"]
    if per_tensor:
        top = max(amax[m] for m in per_tensor)
        for m in per_tensor:
            out[m] = (compute_scale(top, schemes[m].fmt).reshape(1, 1), None)
    return out


def _broadcast_result(q: QuantizedTensor | None, layer: dict[str, Any] | None,
                      src: int) -> tuple[QuantizedTensor, dict[str, Any]]:  # fmt: skip
    """(rounded weight, record) of rank `src` on every rank: the record and the tensors' shapes and dtypes
    as one object, then the payload, scales and global scale as their bytes (bit-identical)."""
    parts = None if q is None else (q.data, q.scale, q.global_scale)
    meta = None if q is None else ([None if t is None else (t.shape, t.dtype) for t in parts], q.fmt,
                                   q.granularity, q.shape, layer)  # fmt: skip
    specs, fmt, granularity, shape, layer = broadcast_object(meta, src)
    if parts is None:
        parts = tuple(None if s is None else torch.empty(s[0], dtype=s[1]) for s in specs)
    data, scale, global_scale = (None if t is None else broadcast_tensor(t, src) for t in parts)
    return QuantizedTensor(data, scale, fmt, granularity, shape, global_scale), layer


def rounding_stats(weight: torch.Tensor, rounded: QuantizedTensor) -> QuantizationStats:
    """What the reports record of a weight an algorithm rounded: its amax, and the relative error of
    the rounding against it (as quantize_with_stats gives for round to nearest)."""
    w = weight.detach().float()
    err = torch.linalg.vector_norm(w - rounded.dequantize()) / torch.linalg.vector_norm(w).clamp_min(1e-30)
    return QuantizationStats(float(w.abs().amax()), float(err))


__all__ = ["PROPAGATION", "GptqPass", "input_groups", "rounding_stats", "shared_scales"]
