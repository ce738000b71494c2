"""The choice under a budget: one scheme per fused group, minimizing the summed sensitivity score
under a size budget. An exact multiple-choice knapsack.

    plan = allocate(scores, "6.0")                          # average bits per weight, scales counted
    plan = allocate(scores, "1.2GB", fixed_bits=...)        # bytes of the whole checkpoint
    plan.groups, plan.layers                                # {fused group | Linear: scheme}

Which exact method, and why: dynamic programming over the costs that occur (a sparse DP, the
Pareto frontier of the multiple-choice knapsack). After each group the states are the (total cost,
least summed score) pairs reachable with the groups so far; a state that costs at least as much as
another and scores no better is dropped (no completion can make it the better one), as is a state
too expensive for the cheapest choices of the groups still to come. The best state under the budget
at the end, traced back, is the optimum: exact, with integer costs in bits and no discretization.
A dense DP table over the total cost (the textbook form) would not fit: the scales make the costs'
common unit 32 bits, 3 G cells for SmolLM2-135M; an integer program would need a solver package
(none is a dependency) for a problem this small. On a SmolLM2-like instance (120 groups, 7 choices
each) the frontier solve takes 0.1-2.5 s on the project's 2-core machine.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from mixprec.errors import MixprecError
from mixprec.inference.checkpoint.publish import parse_size
from mixprec.inference.schemes import InferenceScheme
from mixprec.sensitivity.scores import KEPT, Scores

MAX_FRONTIER = 20_000_000  # states of one step (about 0.5 GB of arrays)


@dataclass(frozen=True)
class Option:
    name: str
    cost: int  # bits
    score: float


def solve(options: Mapping[str, Sequence[Option]], capacity: int) -> dict[str, str]:
    """{group: the chosen option's name} minimizing the summed score with total cost <= capacity
    (exact; see the module docstring). MixprecError when even the cheapest choices do not fit."""
    groups = list(options)
    if not groups:
        return {}
    cheapest = [min(o.cost for o in options[g]) for g in groups]
    floor = sum(cheapest)
    if capacity < floor:
        raise MixprecError(
            f"the budget ({capacity} bits) is below the smallest checkpoint the candidates allow ({floor} bits)"
        )
    # room[i]: the most the groups before i may cost so that the cheapest choices of the rest still fit
    room = [capacity - sum(cheapest[i:]) for i in range(len(groups) + 1)]
    costs = np.zeros(1, dtype=np.int64)  # the frontier: ascending costs, strictly descending scores
    scores = np.zeros(1)
    steps: list[tuple[np.ndarray, np.ndarray]] = []  # per group: (parent index, option index)
    for i, g in enumerate(groups):
        opts = options[g]
        c = np.concatenate([costs + o.cost for o in opts])
        s = np.concatenate([scores + o.score for o in opts])
        parent = np.tile(np.arange(len(costs)), len(opts))
        option = np.repeat(np.arange(len(opts)), len(costs))
        fits = c <= room[i + 1]
        c, s, parent, option = c[fits], s[fits], parent[fits], option[fits]
        order = np.lexsort((s, c))  # by cost, then score
        c, s, parent, option = c[order], s[order], parent[order], option[order]
        # keep a state only if it scores strictly below every cheaper (or equally cheap) state
        running = np.minimum.accumulate(s)
        keep = np.ones(len(s), dtype=bool)
        keep[1:] = s[1:] < running[:-1]
        costs, scores = c[keep], s[keep]
        steps.append((parent[keep], option[keep]))
        if len(costs) > MAX_FRONTIER:
            raise MixprecError(
                f"the exact allocation's frontier grew past {MAX_FRONTIER} states at group {i} of {len(groups)}"
            )
    k = int(np.argmin(scores))  # every state left fits the budget
    chosen: dict[str, str] = {}
    for i in range(len(groups) - 1, -1, -1):
        parent, option = steps[i]
        chosen[groups[i]] = options[groups[i]][int(option[k])].name
        k = int(parent[k])
    return chosen


# ---------------------------------------------------------------------------------------------------
# Costs and budgets


def kept_bits(dtype_bits: int, shape: tuple[int, int]) -> int:
    return dtype_bits * shape[0] * shape[1]


def layer_bits(candidate: str, shape: tuple[int, int], dtype_bits: int) -> int:
    """The bits one Linear's stored tensors take in `candidate` (its scheme's `stored_bits`: payload,
    scales, static input scale), or as kept in the source dtype."""
    if candidate == KEPT:
        return kept_bits(dtype_bits, shape)
    return InferenceScheme.from_name(candidate).stored_bits(*shape)


def group_options(scores: Scores, dtype_bits: int) -> dict[str, list[Option]]:
    """The options of every fused group: each allowed candidate with its summed cost and score."""
    out = {}
    for g, by_candidate in scores.group_scores().items():
        members = scores.groups()[g]
        out[g] = [
            Option(c, sum(layer_bits(c, scores.shapes[m], dtype_bits) for m in members), s)
            for c, s in by_candidate.items()
        ]
    return out


@dataclass(frozen=True)
class Budget:
    """`bits`: average bits per weight of the scored Linears, scales counted; or `bytes`: the whole
    checkpoint's tensors."""

    bits: float | None = None
    bytes: int | None = None

    @classmethod
    def parse(cls, text: str | float | int) -> Budget:
        if isinstance(text, (int, float)) and not isinstance(text, bool):
            return cls._bits(float(text), str(text))
        s = str(text).strip()
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(bits?)?", s, flags=re.IGNORECASE)
        if m:
            return cls._bits(float(m.group(1)), s)
        try:
            size = parse_size(s)
        except MixprecError:
            size = -1
        if size <= 0 or not re.search(r"[kmgt]?i?b$", s, flags=re.IGNORECASE):
            raise MixprecError(
                f"--budget {text!r}: give average bits per weight (e.g. 6.0) or a size with a unit (e.g. 1.2GB)"
            )
        return cls(bytes=size)

    @classmethod
    def _bits(cls, bits: float, text: str) -> Budget:
        if not (math.isfinite(bits) and 0 < bits <= 64):
            raise MixprecError(f"--budget {text!r}: average bits per weight must be in (0, 64]")
        return cls(bits=bits)

    def capacity(self, weights: int, fixed_bits: int) -> int:
        """The bits the scored Linears may take: `weights` of them; `fixed_bits`: every other tensor
        of the checkpoint (for a budget in bytes)."""
        if self.bits is not None:
            return math.floor(self.bits * weights)
        return int(self.bytes) * 8 - fixed_bits  # type: ignore[operator]

    def describe(self) -> str:
        return f"{self.bits:g} bits per weight" if self.bits is not None else f"{self.bytes} bytes"


@dataclass(frozen=True)
class Allocation:
    groups: dict[str, str]  # fused group -> candidate
    layers: dict[str, str]  # Linear -> candidate
    bits: int  # of the scored Linears
    weights: int
    predicted: float  # summed score

    @property
    def bits_per_weight(self) -> float:
        return self.bits / self.weights if self.weights else 0.0

    def schemes(self) -> dict[str, str]:
        """{Linear: scheme} of the quantized Linears (what quantize_checkpoint takes; KEPT left out)."""
        return {n: c for n, c in self.layers.items() if c != KEPT}


def allocate(scores: Scores, budget: Budget | str | float, *, dtype_bits: int = 16, fixed_bits: int = 0) -> Allocation:  # fmt: skip
    """The exact best choice of one candidate per fused group under `budget`."""
    budget = budget if isinstance(budget, Budget) else Budget.parse(budget)
    options = group_options(scores, dtype_bits)
    weights = sum(o * i for o, i in scores.shapes.values())
    chosen = solve(options, budget.capacity(weights, fixed_bits))
    groups = scores.groups()
    layers = {m: chosen[g] for g, members in groups.items() for m in members}
    by_name = {g: {o.name: o for o in opts} for g, opts in options.items()}
    bits = sum(by_name[g][c].cost for g, c in chosen.items())
    predicted = sum(by_name[g][c].score for g, c in chosen.items())
    return Allocation(chosen, layers, bits, weights, predicted)


def uniform(scores: Scores, candidate: str, *, dtype_bits: int = 16) -> Allocation:
    """Every Linear in `candidate` (groups that may not take it stay kept), for comparison."""
    options = group_options(scores, dtype_bits)
    chosen = {g: candidate if any(o.name == candidate for o in opts) else KEPT for g, opts in options.items()}
    groups = scores.groups()
    layers = {m: chosen[g] for g, members in groups.items() for m in members}
    by_name = {g: {o.name: o for o in opts} for g, opts in options.items()}
    return Allocation(
        chosen, layers, sum(by_name[g][c].cost for g, c in chosen.items()),
        sum(o * i for o, i in scores.shapes.values()), sum(by_name[g][c].score for g, c in chosen.items()),
    )  # fmt: skip


__all__ = ["Allocation", "Budget", "Option", "allocate", "group_options", "layer_bits", "solve", "uniform"]
