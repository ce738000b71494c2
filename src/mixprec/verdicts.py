"""The one verdict vocabulary and the statistics behind it, shared by training (compare) and inference (evaluate).

A question such as "is this recipe as good as bf16?" is settled by an interval, never by a point:

- `equivalent`: the whole interval lies inside the acceptable region (within the margin);
- `worse`: the whole interval lies on the bad side of the margin;
- `different` (equivalence questions only): the whole interval lies beyond the margin on the other side —
  a run better than its baseline by more than the margin; for a precision change that is as strong a sign
  that something other than rounding changed as a gap upward, so it fails a gate unless improvements are
  explicitly accepted;
- `inconclusive`: the interval straddles a bound; more samples (or steps) would settle it, and
  `samples_to_settle` says about how many, from the 1/sqrt(n) shrinking of the interval's width.

Intervals come from a seeded paired bootstrap (`paired_bootstrap`): the same resampled indices are applied
to the reference's and the candidate's per-sample figures, so what is shared between the two (an easy
sample, a hard one) cancels in the difference. The same seed gives the same interval.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

EQUIVALENT = "equivalent"
WORSE = "worse"
INCONCLUSIVE = "inconclusive"
DIFFERENT = "different"
VERDICTS = (EQUIVALENT, WORSE, DIFFERENT, INCONCLUSIVE)

DEFAULT_LEVEL = 0.95
DEFAULT_RESAMPLES = 2000

# The margins a verdict is judged against when the user states none (fractions of the baseline figure).
# FP8 against bf16: DeepSeek-V3 reports its FP8 training's relative loss error "consistently below 0.25 %".
# A 16-bit format against fp32: the guide's 0.1 %. FP4 against bf16: NVIDIA's NVFP4 pretraining of a
# 12B model (arXiv 2509.25149) keeps its relative loss error against FP8 below 1 % for most of the run.
FP8_MARGIN = 0.0025
FP4_MARGIN = 0.01
HALF_MARGIN = 0.001


@dataclass(frozen=True)
class Interval:
    """A point estimate with its two-sided confidence interval at `level` (e.g. 0.95)."""

    estimate: float
    low: float
    high: float
    level: float
    samples: int  # how many paired samples (or steps) it rests on
    method: str = "paired-bootstrap"
    # Student's t degrees of freedom of a t interval (None: a bootstrap or a normal interval); the
    # minimum detectable effect needs it to turn the half-width back into a standard error
    dof: float | None = None

    def __post_init__(self) -> None:
        if not (self.low <= self.high):
            raise ValueError(f"interval low {self.low} is above high {self.high}")

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def to_dict(self) -> dict:
        return asdict(self)


def decide(low: float, high: float, *, upper: float, lower: float = -math.inf) -> str:
    """The verdict for an interval [low, high] against the acceptable region [lower, upper].

    `upper` is the bad side (a loss gap, a perplexity increase; negate a figure where lower is worse,
    such as cosine or agreement, or pass it as `lower`). An interval wholly below `lower` when `lower` is
    finite is `worse` too: it lies wholly outside the region on a side the caller declared bad.
    """
    if not (lower <= upper):
        raise ValueError(f"the acceptable region [{lower}, {upper}] is empty")
    if low > upper or high < lower:
        return WORSE
    if lower <= low and high <= upper:
        return EQUIVALENT
    return INCONCLUSIVE


def decide_equivalence(low: float, high: float, *, margin: float) -> str:
    """The verdict of an equivalence question ("is the gap zero, within ±margin?") for a gap where
    higher is worse (a loss gap): `equivalent` when [low, high] lies within [-margin, +margin]; `worse`
    when it lies wholly above +margin; `different` when it lies wholly below -margin (better than the
    baseline by more than the margin: something changed more than rounding); `inconclusive` otherwise.
    """
    if margin < 0:
        raise ValueError(f"the margin must be >= 0, got {margin}")
    if low > margin:
        return WORSE
    if high < -margin:
        return DIFFERENT
    if -margin <= low and high <= margin:
        return EQUIVALENT
    return INCONCLUSIVE


def combine(verdicts: Sequence[str]) -> str:
    """One verdict from several that must all hold (a recipe judged on its train AND held-out loss):
    `worse` if any is, else `different` if any is, `equivalent` only if all are, else `inconclusive`."""
    if not verdicts:
        raise ValueError("combine needs at least one verdict")
    for verdict in (WORSE, DIFFERENT):
        if verdict in verdicts:
            return verdict
    return EQUIVALENT if all(v == EQUIVALENT for v in verdicts) else INCONCLUSIVE


# the power a minimum detectable effect is stated at: the share of comparisons whose interval excludes
# the margin when the true gap is that large (80 %, the usual choice in study design)
DEFAULT_POWER = 0.8


def detectable_effect(interval: Interval, *, margin: float, power: float = DEFAULT_POWER) -> float:
    """The smallest true gap (beyond ±margin, either direction) that an interval as wide as this one
    would place wholly beyond the margin — `worse` or `different` — in `power` of repeated comparisons.

    The estimate scatters around the true gap d with the interval's standard error se = half-width /
    q(level); the interval clears the margin when estimate - q(level)·se > margin, which happens with
    probability `power` when d = margin + (q(level) + q(power))·se. q is Student's t quantile at the
    interval's degrees of freedom, or the normal one for an interval without (a bootstrap's).
    """
    if not (0.5 < power < 1):
        raise ValueError(f"power must be in (0.5, 1), got {power}")
    if interval.half_width == 0:
        return margin

    def quantile(p: float) -> float:
        if interval.dof is None:
            return statistics.NormalDist().inv_cdf(p)
        return student_t_quantile(p, interval.dof)

    q_level = quantile(1 - (1 - interval.level) / 2)
    se = interval.half_width / q_level
    return margin + (q_level + quantile(power)) * se


def samples_to_settle(
    interval: Interval, *, upper: float, lower: float = -math.inf, rate: float = 0.5
) -> int | None:
    """About how many samples would turn an inconclusive interval into a verdict, or None when it is settled.

    The interval's half-width shrinks as n**-rate (1/sqrt(n) by default: independent samples; a caller
    that measured how its interval shrinks, such as compare's band over steps, passes that rate); the
    estimate is taken as fixed. The verdict is settled once the half-width is below the distance from
    the estimate to the nearest bound. An estimate exactly on a bound, or an interval that does not
    shrink (rate <= 0), can never be settled: returns -1 (reported as "no number of samples").
    """
    if decide(interval.low, interval.high, upper=upper, lower=lower) != INCONCLUSIVE:
        return None
    distance = min(abs(interval.estimate - upper), abs(interval.estimate - lower))
    if distance == 0 or interval.half_width == 0 or not math.isfinite(distance) or rate <= 0:
        return -1
    needed = interval.samples * (interval.half_width / distance) ** (1 / rate)
    return max(interval.samples + 1, math.ceil(min(needed, 1e12)))


def paired_bootstrap(
    statistic: Callable[..., torch.Tensor],
    *per_sample: torch.Tensor,
    level: float = DEFAULT_LEVEL,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> Interval:
    """Percentile bootstrap interval of `statistic` over paired per-sample figures.

    `per_sample` are 1-D tensors of equal length n (sample i of each belongs together: the reference's
    and the candidate's NLL of block i, say). `statistic(*arrays)` must accept arrays of shape [B, n]
    and return shape [B] (one value per row), so all resamples are computed at once; it is called once
    more on the original arrays (shape [1, n]) for the point estimate.
    """
    if not per_sample:
        raise ValueError("paired_bootstrap needs at least one per-sample tensor")
    n = per_sample[0].numel()
    if any(t.dim() != 1 or t.numel() != n for t in per_sample):
        raise ValueError(
            "paired_bootstrap: every per-sample tensor must be 1-D of the same length; got shapes "
            + ", ".join(str(tuple(t.shape)) for t in per_sample)
        )
    if n < 2:
        raise ValueError(f"paired_bootstrap needs at least 2 samples, got {n}")
    if not (0 < level < 1):
        raise ValueError(f"confidence level must be in (0, 1), got {level}")
    if resamples < 100:
        raise ValueError(f"at least 100 bootstrap resamples are needed, got {resamples}")
    data = [t.detach().to(torch.float64) for t in per_sample]
    estimate = float(statistic(*[t.unsqueeze(0) for t in data])[0])
    generator = torch.Generator().manual_seed(seed)
    values = []
    chunk = max(1, 2_000_000 // n)  # bounded memory: at most ~2M indices at a time
    for start in range(0, resamples, chunk):
        rows = min(chunk, resamples - start)
        index = torch.randint(0, n, (rows, n), generator=generator)
        values.append(statistic(*[t[index] for t in data]).reshape(rows))
    draws = torch.cat(values)
    alpha = (1 - level) / 2
    low, high = torch.quantile(draws, torch.tensor([alpha, 1 - alpha], dtype=torch.float64)).tolist()
    # A statistic whose estimate lies outside its own percentile interval (a strongly skewed one)
    # would read oddly; widening to include the estimate keeps the interval honest.
    return Interval(
        estimate=estimate,
        low=min(low, estimate),
        high=max(high, estimate),
        level=level,
        samples=n,
    )


@functools.lru_cache(maxsize=1024)
def student_t_quantile(p: float, dof: float) -> float:
    """The p-quantile of Student's t distribution with `dof` degrees of freedom (p in (0.5, 1)).

    By bisection on the CDF, which is 1/2 plus Simpson's rule over the density from 0 to t (the
    density is smooth and the integral bounded, so 4096 panels give ~1e-10; the tests check the
    tabulated values). Written here rather than taken from SciPy, which is not a dependency.
    """
    if not (0.5 < p < 1):
        raise ValueError(f"p must be in (0.5, 1), got {p}")
    if not dof >= 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {dof}")
    log_norm = math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)

    def cdf(t: float) -> float:
        x = torch.linspace(0.0, t, 4097, dtype=torch.float64)
        density = torch.exp(log_norm - (dof + 1) / 2 * torch.log1p(x * x / dof))
        weights = torch.ones_like(x)
        weights[1:-1:2], weights[2:-1:2] = 4.0, 2.0
        return 0.5 + float((weights * density).sum()) * t / 4096 / 3

    # Newton's method from the normal quantile's neighbourhood, kept inside a bracket that bisection
    # shrinks whenever a Newton step leaves it (heavy tails at few degrees of freedom: t_1 at 0.975
    # is 12.7)
    low, high = 0.0, 1.0
    while cdf(high) < p:
        low, high = high, high * 2
    t = (low + high) / 2
    for _ in range(100):
        error = cdf(t) - p
        if abs(error) < 1e-13:
            break
        low, high = (t, high) if error < 0 else (low, t)
        step = t - error / math.exp(log_norm - (dof + 1) / 2 * math.log1p(t * t / dof))
        t = step if low < step < high else (low + high) / 2
    return t


def replicate_interval(
    candidate: float, references: Sequence[float], *, level: float = DEFAULT_LEVEL, method: str = ""
) -> Interval:
    """Interval of the difference between a candidate run's figure and the mean of `references` —
    independent runs of the reference that are equally good by construction (the same training with a
    rounding-level perturbation) — at `level`.

    The runs' spread s (sample standard deviation, n - 1 degrees of freedom) is what an equally good
    single run scatters by; the candidate is taken to scatter alike, so its difference to the mean of
    n references scatters by s * sqrt(1 + 1/n), and the interval is that times Student's t quantile:
    a figure outside it is not explained by the scatter of equally good runs.
    """
    refs = [float(r) for r in references]
    n = len(refs)
    if n < 2:
        raise ValueError(f"a replicate interval needs at least 2 reference runs, got {n}")
    if not all(math.isfinite(r) for r in refs) or not math.isfinite(candidate):
        raise ValueError("replicate_interval: every figure must be finite")
    centre, variance, _ = _moments(refs)
    half = student_t_quantile(1 - (1 - level) / 2, n - 1) * math.sqrt(variance * (1 + 1 / n))
    estimate = candidate - centre
    return Interval(estimate, estimate - half, estimate + half, level=level, samples=n, dof=n - 1,
                    method=method or f"difference to the mean of {n} reference runs ± t·s·sqrt(1 + 1/{n})")  # fmt: skip


def group_interval(
    candidates: Sequence[float],
    references: Sequence[float],
    *,
    level: float = DEFAULT_LEVEL,
    method: str = "",
) -> Interval:
    """Interval of mean(candidates) - mean(references), two groups of independent, equally good runs
    each, whose spreads may differ (Welch's interval: t with the Welch-Satterthwaite degrees of freedom,
    rounded down, so never narrower than the exact one). One candidate run alone has no spread of its
    own: it is taken to scatter like the references (`replicate_interval`)."""
    cands = [float(c) for c in candidates]
    if len(cands) < 2:
        if not cands:
            raise ValueError("group_interval needs at least one candidate run")
        return replicate_interval(cands[0], references, level=level, method=method)
    refs = [float(r) for r in references]
    if len(refs) < 2:
        raise ValueError(f"a group interval needs at least 2 reference runs, got {len(refs)}")
    if not all(math.isfinite(v) for v in (*cands, *refs)):
        raise ValueError("group_interval: every figure must be finite")
    (mc, vc, nc), (mr, vr, nr) = (_moments(cands), _moments(refs))
    se2 = vc / nc + vr / nr
    estimate = mc - mr
    half, dof = 0.0, None
    if se2 > 0:
        dof = max(1, math.floor(se2**2 / ((vc / nc) ** 2 / (nc - 1) + (vr / nr) ** 2 / (nr - 1))))
        half = student_t_quantile(1 - (1 - level) / 2, dof) * math.sqrt(se2)
    return Interval(estimate, estimate - half, estimate + half, level=level, samples=nr, dof=dof,
                    method=method or f"difference of the means of {nc} and {nr} runs (Welch)")  # fmt: skip


def _moments(values: list[float]) -> tuple[float, float, int]:
    """Mean, sample variance (n - 1) and count."""
    n = len(values)
    centre = sum(values) / n
    return centre, sum((v - centre) ** 2 for v in values) / (n - 1), n


def references_to_settle(
    interval: Interval,
    *,
    margin: float,
    spread: float,
    candidate_spread: float | None = None,
    level: float = DEFAULT_LEVEL,
    most: int = 64,
) -> int | None:
    """How many runs would make an inconclusive equivalence interval decide, the estimate and the
    spreads taken as fixed; None when it is already decided.

    One candidate run (`candidate_spread` None): the number of reference runs, or -1 when no number
    would: even a perfectly known reference mean leaves the candidate run's own scatter (z x spread),
    wider than the distance to the margin. Candidate runs with a spread of their own: the number of
    runs of EACH group (they then shrink together), or -1 beyond `most`.
    """
    if decide_equivalence(interval.low, interval.high, margin=margin) != INCONCLUSIVE:
        return None
    distance = min(abs(interval.estimate - margin), abs(interval.estimate + margin))
    quantile = 1 - (1 - level) / 2
    for n in range(interval.samples + 1, most + 1):
        if candidate_spread is None:
            half = student_t_quantile(quantile, n - 1) * spread * math.sqrt(1 + 1 / n)
        else:
            half = student_t_quantile(quantile, 2 * n - 2) * math.sqrt((spread**2 + candidate_spread**2) / n)
        if half < distance:
            return n
    return -1


def mean_difference(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Statistic for `paired_bootstrap`: mean(candidate - reference) per row."""
    return (candidate - reference).mean(dim=-1)


def mean(values: torch.Tensor) -> torch.Tensor:
    """Statistic for `paired_bootstrap`: the mean per row."""
    return values.mean(dim=-1)


def relative_mean_change(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Statistic for `paired_bootstrap`: mean(candidate) / mean(reference) - 1 per row."""
    return candidate.mean(dim=-1) / reference.mean(dim=-1) - 1


def perplexity_change(
    reference_nll: torch.Tensor, candidate_nll: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """Statistic for `paired_bootstrap`: exp(token-weighted mean NLL) ratio - 1 per row.

    The arguments are per-block summed NLLs and per-block token counts, so blocks of unequal length
    weigh by their tokens, as perplexity does.
    """
    total = tokens.sum(dim=-1)
    return torch.exp((candidate_nll.sum(dim=-1) - reference_nll.sum(dim=-1)) / total) - 1


def gap_closed(
    reference_nll: torch.Tensor, baseline_nll: torch.Tensor, candidate_nll: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """Statistic for `paired_bootstrap`: the share of the baseline's perplexity gap the candidate closes,
    1 - (ppl_c / ppl_ref - 1) / (ppl_b / ppl_ref - 1), per row (1: as good as the reference; 0: as the
    baseline; negative: worse than the baseline). Per-block summed NLLs and token counts, as
    `perplexity_change` takes them, so the three models are resampled on the same blocks."""
    return 1 - perplexity_change(reference_nll, candidate_nll, tokens) / perplexity_change(
        reference_nll, baseline_nll, tokens
    )


def ratio_of_sums(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """Statistic for `paired_bootstrap`: sum(numerator) / sum(denominator) per row.

    A share pooled over samples of unequal size (top-1 matches over tokens, summed KL over positions):
    each sample weighs by its denominator, as the pooled figure does.
    """
    return numerator.sum(dim=-1) / denominator.sum(dim=-1)
