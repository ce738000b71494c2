"""The verdict intervals cover the true value as often as they say, checked tightly enough that an
interval one notch too narrow (a 90 % interval sold as 95 %) fails.

Each test draws many seeded data sets from a known distribution, builds the nominal 95 % interval of
each and counts how often it holds the true value. With N draws the count's standard error at a
coverage p is sqrt(p (1 - p) / N); each band below is set from the coverage the correct interval has
(measured once with 200,000 draws, quoted beside it) and from the coverage of the same interval at 90 %,
and leaves at least 4.5 standard errors to each: a correct interval passes whatever the seed, a 90 %
one fails whatever the seed.
"""

from __future__ import annotations

import pytest
import torch

from mixprec.verdicts import group_interval, mean_difference, paired_bootstrap, replicate_interval

LEVEL = 0.95


@pytest.fixture
def one_thread():
    """Tiny tensors: on a busy machine, extra threads only add waiting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Welch's interval of mean(candidates) - mean(references), degrees of freedom rounded down. With 200,000
# draws its 95 % interval covers 0.9613, 0.9498, 0.9641 and 0.9503 of the time in the four cases below
# (the rounding makes it conservative, least so where the smaller group has the larger spread: Welch-
# Satterthwaite's approximation is weakest there), and a 90 % one 0.9137, 0.9056, 0.9210 and 0.9017.
# N = 20,000 draws: standard error 0.0015 at 0.95, 0.0019 at 0.92. The band [0.94, 0.975] is 6.3
# standard errors below the lowest correct coverage, 8 above the highest, and 10 above the highest
# coverage of a 90 % interval (it also refuses a 99 % interval sold as 95 %).
GROUP_DRAWS = 20_000


@pytest.mark.parametrize(
    "n_cand, n_ref, sd_cand, sd_ref",
    [(3, 4, 1.0, 3.0), (3, 4, 3.0, 1.0), (2, 5, 1.0, 2.0), (5, 8, 2.0, 0.5)],
)
def test_group_interval_covers_the_difference_of_means_as_stated(n_cand, n_ref, sd_cand, sd_ref):
    shift = 0.3  # the true difference of the means
    g = torch.Generator().manual_seed(1000 * n_cand + n_ref)
    cands = (shift + sd_cand * torch.randn(GROUP_DRAWS, n_cand, generator=g, dtype=torch.float64)).tolist()
    refs = (sd_ref * torch.randn(GROUP_DRAWS, n_ref, generator=g, dtype=torch.float64)).tolist()
    hits = 0
    for c, r in zip(cands, refs, strict=True):
        iv = group_interval(c, r, level=LEVEL)
        assert iv.level == LEVEL
        hits += iv.low <= shift <= iv.high
    coverage = hits / GROUP_DRAWS
    assert 0.94 <= coverage <= 0.975, f"group_interval 95 % coverage {coverage:.4f} outside [0.94, 0.975]"


# The t prediction interval of one run against n references is exact for normal runs: coverage 0.95
# (200,000 draws: 0.9495, 0.9499, 0.9501 for n = 2, 3, 8; at 90 %: 0.9001, 0.8998, 0.9000). N = 20,000:
# standard error 0.0015; the band [0.94, 0.96] is 6.5 of them either side of 0.95 and 26 above 0.90.
# (tests/test_verdicts.py checks n = 4.)
REPLICATE_DRAWS = 20_000


@pytest.mark.parametrize("n_ref", [2, 3, 8])
def test_replicate_interval_covers_an_equally_good_run_as_stated(n_ref):
    g = torch.Generator().manual_seed(n_ref)
    runs = torch.randn(REPLICATE_DRAWS, n_ref + 1, generator=g, dtype=torch.float64).tolist()
    hits = 0
    for row in runs:
        iv = replicate_interval(row[n_ref], row[:n_ref], level=LEVEL)
        hits += iv.low <= 0.0 <= iv.high  # the candidate is drawn like the references: no difference
    coverage = hits / REPLICATE_DRAWS
    assert 0.94 <= coverage <= 0.96, f"replicate_interval 95 % coverage {coverage:.4f} outside [0.94, 0.96]"


# The percentile bootstrap of a mean difference under-covers at small n (it uses the plug-in spread and
# normal rather than t quantiles) and with few resamples (its end points are noisy order statistics):
# at n = 40 and 300 resamples a 95 % interval covers ~0.93, too close to a 90 % one to tell them apart.
# At n = 200 paired samples and 500 resamples it covers 0.9454 (200,000 draws would be slow: 20,000
# draws, standard error 0.0016), a 90 % interval 0.8971. N = 6,000 draws: standard error 0.0029 at 0.945,
# 0.0039 at 0.90. The band [0.93, 0.96] is 5.3 standard errors below the expected coverage, 5 above it
# (and holds the nominal 0.95), and 8.4 above the coverage of a 90 % interval.
BOOTSTRAP_DRAWS = 6_000
BOOTSTRAP_SAMPLES = 200
BOOTSTRAP_RESAMPLES = 500


def test_paired_bootstrap_covers_the_true_mean_difference_as_stated(one_thread):
    shift = 0.1  # the true mean difference, candidate - reference
    g = torch.Generator().manual_seed(11)
    shape = (BOOTSTRAP_DRAWS, BOOTSTRAP_SAMPLES)
    ref = torch.randn(shape, generator=g, dtype=torch.float64)
    cand = ref + shift + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)  # paired: ref shared
    hits = 0
    for i in range(BOOTSTRAP_DRAWS):
        iv = paired_bootstrap(mean_difference, ref[i], cand[i], level=LEVEL, resamples=BOOTSTRAP_RESAMPLES,
                              seed=i)  # fmt: skip
        assert iv.level == LEVEL
        hits += iv.low <= shift <= iv.high
    coverage = hits / BOOTSTRAP_DRAWS
    assert 0.93 <= coverage <= 0.96, f"paired_bootstrap 95 % coverage {coverage:.4f} outside [0.93, 0.96]"
