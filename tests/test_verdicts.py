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
    decide_equivalence,
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


def test_paired_bootstrap_matches_the_closed_form_paired_interval():
    """Paired differences d_i = c_i - r_i: the closed form is mean(d) +- z * sd(d) / sqrt(n)."""
    g = torch.Generator().manual_seed(5)
    ref = torch.randn(3000, generator=g, dtype=torch.float64) * 5
    cand = ref + 0.2 + 0.5 * torch.randn(3000, generator=g, dtype=torch.float64)
    interval = paired_bootstrap(mean_difference, ref, cand, resamples=3000, seed=1)
    d = cand - ref
    half = 1.959964 * float(d.std()) / math.sqrt(d.numel())
    assert interval.estimate == pytest.approx(float(d.mean()))
    assert interval.low == pytest.approx(float(d.mean()) - half, abs=0.1 * half)
    assert interval.high == pytest.approx(float(d.mean()) + half, abs=0.1 * half)


def test_paired_bootstrap_covers_the_true_value_about_as_often_as_stated():
    """Repeated draws from a known distribution: the 90 % interval holds the true mean difference in
    about 90 % of them (percentile bootstrap at n = 40 runs slightly under; 200 draws give +-2 % per sd)."""
    g = torch.Generator().manual_seed(11)
    true_shift, hits, draws = 0.1, 0, 200
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: on a busy machine, extra threads only add waiting
    try:
        for i in range(draws):
            ref = torch.randn(40, generator=g, dtype=torch.float64)
            cand = ref + true_shift + 0.3 * torch.randn(40, generator=g, dtype=torch.float64)
            iv = paired_bootstrap(mean_difference, ref, cand, level=0.9, resamples=300, seed=i)
            hits += iv.low <= true_shift <= iv.high
    finally:
        torch.set_num_threads(threads)
    assert 0.82 <= hits / draws <= 0.96, hits / draws


def test_ratio_of_sums_weighs_samples_by_their_size():
    from mixprec.verdicts import ratio_of_sums

    matches = torch.tensor([[9.0, 1.0]], dtype=torch.float64)
    tokens = torch.tensor([[10.0, 2.0]], dtype=torch.float64)
    assert float(ratio_of_sums(matches, tokens)[0]) == pytest.approx(10 / 12)


@pytest.mark.parametrize(
    "low, high, verdict",
    [
        (-0.0025, 0.0025, EQUIVALENT),
        (-0.0026, 0.001, INCONCLUSIVE),
        (-0.01, -0.003, INCONCLUSIVE),  # better than the margin: not equivalent, not worse
        (0.002, 0.003, INCONCLUSIVE),
        (0.0026, 0.003, WORSE),
    ],
)
def test_decide_equivalence_is_two_sided_and_worse_only_above(low, high, verdict):
    assert decide_equivalence(low, high, margin=0.0025) == verdict
