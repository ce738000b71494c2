"""The shared verdict vocabulary: decisions at the boundaries, the bootstrap against closed forms."""

import math
import statistics

import pytest
import torch

from mixprec.verdicts import (
    DIFFERENT,
    EQUIVALENT,
    INCONCLUSIVE,
    WORSE,
    Interval,
    combine,
    decide,
    decide_equivalence,
    detectable_effect,
    mean,
    mean_difference,
    paired_bootstrap,
    perplexity_change,
    references_to_settle,
    replicate_interval,
    samples_to_settle,
    student_t_quantile,
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
        (-0.01, -0.003, DIFFERENT),  # lower than the margin: a difference, in the other direction
        (-0.01, -0.0025, INCONCLUSIVE),  # touches -margin: not wholly beyond it
        (0.002, 0.003, INCONCLUSIVE),
        (0.0026, 0.003, WORSE),
    ],
)
def test_decide_equivalence_is_two_sided(low, high, verdict):
    assert decide_equivalence(low, high, margin=0.0025) == verdict


@pytest.mark.parametrize(
    "verdicts, combined",
    [
        ((EQUIVALENT, EQUIVALENT), EQUIVALENT),
        ((EQUIVALENT, INCONCLUSIVE), INCONCLUSIVE),
        ((EQUIVALENT, DIFFERENT), DIFFERENT),
        ((DIFFERENT, WORSE), WORSE),
        ((INCONCLUSIVE, WORSE), WORSE),
        ((EQUIVALENT,), EQUIVALENT),
    ],
)
def test_combine_needs_every_verdict_equivalent(verdicts, combined):
    assert combine(verdicts) == combined


def test_detectable_effect_is_margin_plus_both_quantiles_times_the_standard_error():
    # a t interval: half-width = t(0.975, 3) x se with se = 0.001
    iv = Interval(0.0, -3.182446305284263e-3, 3.182446305284263e-3, level=0.95, samples=4, dof=3)
    assert detectable_effect(iv, margin=0.0025) == pytest.approx(
        0.0025 + (3.182446305284263 + 0.9784723123633045) * 1e-3
    )
    # without degrees of freedom (a bootstrap): normal quantiles, 1.959964 and 0.841621
    iv = Interval(0.0, -1.959964e-3, 1.959964e-3, level=0.95, samples=100)
    assert detectable_effect(iv, margin=0.0) == pytest.approx((1.959964 + 0.841621) * 1e-3, rel=1e-6)
    assert detectable_effect(Interval(0.1, 0.1, 0.1, level=0.95, samples=1), margin=0.01) == 0.01
    with pytest.raises(ValueError, match="power"):
        detectable_effect(iv, margin=0.0, power=0.4)


def test_student_t_quantile_against_tabulated_values():
    # Student's t quantiles (tabulated; e.g. scipy.stats.t.ppf): heavy tails at few degrees of freedom
    table = {(0.975, 1): 12.706204736174707, (0.975, 2): 4.302652729911275, (0.975, 3): 3.182446305284263,
             (0.975, 5): 2.5705818366147395, (0.975, 10): 2.2281388519649385, (0.975, 30): 2.0422724563012373,
             (0.95, 4): 2.13184678632665, (0.995, 1): 63.65674116287399}  # fmt: skip
    for (p, dof), value in table.items():
        assert student_t_quantile(p, dof) == pytest.approx(value, rel=1e-8), (p, dof)
    # towards the normal quantile 1.95996, plus (z**3 + z) / (4 dof) at many degrees of freedom
    assert student_t_quantile(0.975, 100_000) == pytest.approx(1.959963984540054 + 9.49 / 400_000, rel=1e-7)
    with pytest.raises(ValueError, match="p must be"):
        student_t_quantile(0.4, 3)
    with pytest.raises(ValueError, match="degrees of freedom"):
        student_t_quantile(0.975, 0)


def test_replicate_interval_is_the_t_prediction_interval_and_covers_equally_good_runs():
    refs = [0.0, 0.001, -0.002, 0.0005]
    iv = replicate_interval(0.003, refs)
    centre, spread = statistics.mean(refs), statistics.stdev(refs)
    half = 3.182446305284263 * spread * math.sqrt(1 + 1 / 4)
    assert iv.estimate == pytest.approx(0.003 - centre)
    assert (iv.low, iv.high) == (pytest.approx(iv.estimate - half), pytest.approx(iv.estimate + half))
    assert iv.samples == 4
    # coverage: a fifth run drawn like the four lands inside its interval ~95 % of the time
    gen = torch.Generator().manual_seed(3)
    draws = torch.randn(4000, 5, generator=gen, dtype=torch.float64)
    inside = sum(
        1 for row in draws.tolist() if (lambda i: i.low <= 0 <= i.high)(replicate_interval(row[4], row[:4]))
    )
    assert 0.94 <= inside / 4000 <= 0.96
    with pytest.raises(ValueError, match="at least 2 reference runs"):
        replicate_interval(0.0, [0.1])


def test_references_to_settle():
    spread = 0.0005
    # estimate 0.1 %, margin 0.25 %: distance 0.15 %; t(n-1) x 0.05 % x sqrt(1 + 1/n) < 0.15 % needs
    # t sqrt(1 + 1/n) < 3: n = 5 gives 2.776 x 1.095 = 3.04, n = 6 gives 2.571 x 1.080 = 2.78
    iv = Interval(0.001, 0.001 - 0.003, 0.001 + 0.003, level=0.95, samples=4)
    assert references_to_settle(iv, margin=0.0025, spread=spread) == 6
    # 0.01 % from the margin: one run's own scatter (1.96 x 0.05 %) is wider: no number of runs
    close = Interval(0.0024, 0.0, 0.0048, level=0.95, samples=4)
    assert references_to_settle(close, margin=0.0025, spread=spread) == -1
    assert references_to_settle(Interval(0.0, -0.001, 0.001, 0.95, 4), margin=0.0025, spread=spread) is None


def test_gap_closed_is_the_share_of_the_baselines_perplexity_gap():
    from mixprec.verdicts import gap_closed

    ref, tokens = (
        torch.tensor([[10.0, 10.0]], dtype=torch.float64),
        torch.tensor([[10.0, 10.0]], dtype=torch.float64),
    )
    base = ref + 2  # perplexity x e^0.2
    half = ref + 1  # perplexity x e^0.1
    expected = 1 - (math.exp(0.1) - 1) / (math.exp(0.2) - 1)
    assert float(gap_closed(ref, base, half, tokens)[0]) == pytest.approx(expected, rel=1e-12)
    assert float(gap_closed(ref, base, ref, tokens)[0]) == pytest.approx(1.0)
    assert float(gap_closed(ref, base, base, tokens)[0]) == pytest.approx(0.0)
    assert float(gap_closed(ref, base, base + 1, tokens)[0]) < 0
