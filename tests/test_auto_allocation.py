"""The budget solver of `--scheme auto` (mixprec.sensitivity.allocation): exact against brute force on
small random cases, fused groups take one scheme, budgets parse."""

from __future__ import annotations

import itertools
import random

import pytest

from mixprec.errors import MixprecError
from mixprec.sensitivity.allocation import Budget, Option, allocate, solve, uniform
from mixprec.sensitivity.scores import KEPT, Scores


def _brute_force(options, capacity):
    groups = list(options)
    best, best_score = None, float("inf")
    for combo in itertools.product(*(options[g] for g in groups)):
        cost = sum(o.cost for o in combo)
        score = sum(o.score for o in combo)
        if cost <= capacity and score < best_score:
            best, best_score = combo, score
    return best_score, best


@pytest.mark.parametrize("seed", range(40))
def test_solver_is_exact_against_brute_force(seed):
    rng = random.Random(seed)
    n_groups = rng.randint(1, 6)
    options = {}
    for g in range(n_groups):
        k = rng.randint(1, 4)
        # costs with a common unit and odd remainders, as scales make them; scores with ties sometimes
        options[f"g{g}"] = [
            Option(
                f"s{j}",
                rng.choice([0, 32, 64]) + 8 * rng.randint(1, 40),
                round(rng.uniform(0, 5), rng.choice([0, 3])),
            )
            for j in range(k)
        ]
    lo = sum(min(o.cost for o in opts) for opts in options.values())
    hi = sum(max(o.cost for o in opts) for opts in options.values())
    for capacity in (lo, (lo + hi) // 2, rng.randint(lo, hi), hi):
        want, _ = _brute_force(options, capacity)
        got = solve(options, capacity)
        chosen = [next(o for o in options[g] if o.name == name) for g, name in got.items()]
        assert sum(o.cost for o in chosen) <= capacity
        assert sum(o.score for o in chosen) == pytest.approx(want, abs=1e-9)


def test_a_budget_below_the_cheapest_choices_is_refused():
    with pytest.raises(MixprecError, match="below the smallest checkpoint"):
        solve({"a": [Option("x", 10, 0.0)]}, 9)


def _scores() -> Scores:
    shapes = {
        "m.layers.0.self_attn.q_proj": (64, 32),
        "m.layers.0.self_attn.k_proj": (32, 32),
        "m.layers.0.self_attn.v_proj": (32, 32),
        "m.layers.0.self_attn.o_proj": (32, 64),
        "m.layers.0.mlp.gate_proj": (64, 32),
        "m.layers.0.mlp.up_proj": (64, 32),
        "m.layers.0.mlp.down_proj": (32, 64),
    }
    rng = random.Random(1)
    layers = {
        n: {KEPT: 0.0, "fp8-dynamic": rng.uniform(0, 1), "fp8-block": rng.uniform(0, 2)} for n in shapes
    }
    groups = {"m.layers.0.self_attn.qkv_proj", "m.layers.0.self_attn.o_proj", "m.layers.0.mlp.gate_up_proj",
              "m.layers.0.mlp.down_proj"}  # fmt: skip
    allowed = {g: [KEPT, "fp8-dynamic", "fp8-block"] for g in groups}
    return Scores("gradient", [KEPT, "fp8-dynamic", "fp8-block"], layers, shapes, allowed)


@pytest.mark.parametrize("bits", [8.1, 9.0, 12.0, 16.0])
def test_fused_groups_take_one_scheme_and_the_budget_holds(bits):
    scores = _scores()
    plan = allocate(scores, bits)
    assert plan.bits_per_weight <= bits
    for members in scores.groups().values():
        assert len({plan.layers[m] for m in members}) == 1, members
    assert set(plan.groups) == set(scores.groups())
    # the summed score is the members' scores of the chosen schemes
    assert plan.predicted == pytest.approx(sum(scores.layers[n][c] for n, c in plan.layers.items()))


def test_more_budget_never_predicts_worse_and_everything_kept_at_16_bits():
    scores = _scores()
    predicted = [allocate(scores, b).predicted for b in (8.1, 9, 10, 12, 14, 16)]
    assert predicted == sorted(predicted, reverse=True)
    assert predicted[-1] == 0.0
    assert set(allocate(scores, 16).layers.values()) == {KEPT}
    assert uniform(scores, "fp8-dynamic").bits_per_weight > 8.0


def test_budgets_parse_and_bad_ones_are_refused():
    assert Budget.parse("6.5").bits == 6.5
    assert Budget.parse("4.25bits").bits == 4.25
    assert Budget.parse(6).bits == 6.0
    assert Budget.parse("1.2GB").bytes == int(1.2 * (1 << 30))
    assert Budget.parse("500MB").capacity(10, 100) == 500 * (1 << 20) * 8 - 100
    for bad in ("", "fast", "0", "-3", "100", "1.2XB"):
        with pytest.raises(MixprecError, match="--budget"):
            Budget.parse(bad)
