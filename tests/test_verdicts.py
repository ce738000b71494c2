"""The shared verdict vocabulary: decisions at the boundaries, the bootstrap against closed forms."""

import math

import pytest
import torch

from mixprec.verdicts import (
    EQUIVALENT,
    INCONCLUSIVE,
    WORSE,
    Interval,
    decide,
    mean,
    mean_difference,
    paired_bootstrap,
    perplexity_change,
    samples_to_settle,
)


@pytest.mark.parametrize(
    "low, high, verdict",
    [
        (-0.001, 0.001, EQUIVALENT),
        (-0.0025, 0.0025, EQUIVALENT),  # touching the margin is still inside
        (0.0024, 0.0026, INCONCLUSIVE),
        (0.00251, 0.01, WORSE),
        (-0.01, -0.003, WORSE),  # wholly below a finite lower bound
    ],
)
def test_decide_two_sided(low, high, verdict):
    assert decide(low, high, upper=0.0025, lower=-0.0025) == verdict


def test_decide_one_sided_never_calls_better_worse():
    assert decide(-5.0, -4.0, upper=0.01) == EQUIVALENT
    with pytest.raises(ValueError, match="empty"):
        decide(0, 1, upper=-1, lower=1)


def test_samples_to_settle_follows_one_over_sqrt_n():
    # estimate 0.5 % against a 1 % bound, half-width 1 %: the width must halve -> 4x the samples
    interval = Interval(estimate=0.005, low=-0.005, high=0.015, level=0.95, samples=100)
    assert samples_to_settle(interval, upper=0.01) == 400
    settled = Interval(estimate=0.0, low=-0.001, high=0.001, level=0.95, samples=100)
    assert samples_to_settle(settled, upper=0.01) is None
    on_bound = Interval(estimate=0.01, low=0.0, high=0.02, level=0.95, samples=100)
    assert samples_to_settle(on_bound, upper=0.01) == -1


def test_bootstrap_mean_matches_the_normal_interval():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4000, generator=g, dtype=torch.float64) * 2 + 3
    interval = paired_bootstrap(mean, x, resamples=4000, seed=0)
    se = float(x.std()) / math.sqrt(x.numel())
    z = 1.959964
    assert interval.estimate == pytest.approx(float(x.mean()))
    assert interval.low == pytest.approx(float(x.mean()) - z * se, abs=0.1 * z * se)
    assert interval.high == pytest.approx(float(x.mean()) + z * se, abs=0.1 * z * se)


def test_bootstrap_is_seeded_and_paired():
    g = torch.Generator().manual_seed(2)
    shared = torch.randn(500, generator=g, dtype=torch.float64) * 10  # large per-sample spread
    ref = shared
    cand = shared + 0.1 + 0.01 * torch.randn(500, generator=g, dtype=torch.float64)
    a = paired_bootstrap(mean_difference, ref, cand, seed=7)
    b = paired_bootstrap(mean_difference, ref, cand, seed=7)
    assert a == b
    # pairing cancels the shared spread: the interval is about the 0.01 noise wide, not the 10
    assert a.high - a.low < 0.01
    assert a.low < 0.1 < a.high


def test_perplexity_change_weighs_blocks_by_tokens():
    ref = torch.tensor([[2.0, 8.0]], dtype=torch.float64)
    cand = torch.tensor([[2.0, 8.0 + 4 * math.log(1.1)]], dtype=torch.float64)
    tokens = torch.tensor([[1.0, 4.0]], dtype=torch.float64)
    assert float(perplexity_change(ref, cand, tokens)[0]) == pytest.approx(1.1 ** (4 / 5) - 1)


def test_bootstrap_rejects_bad_input():
    with pytest.raises(ValueError, match="same length"):
        paired_bootstrap(mean_difference, torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="at least 2"):
        paired_bootstrap(mean, torch.zeros(1))
