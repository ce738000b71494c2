"""From the per-step records of every run to the per-recipe figures and verdicts (a pure function).

`summarize(records, config)` reads only the rows that metrics.jsonl holds, so anyone can recompute
summary.json from metrics.jsonl (the tests do). Gaps are signed fractions, (loss - baseline) / baseline;
a negative gap means the recipe did better than its baseline.

The verdict (mixprec.verdicts: equivalent / worse / inconclusive) reads the recipe's gap against its
margin (verdicts.FP8_MARGIN for FP8 against bf16, HALF_MARGIN for 16-bit against fp32). The yardstick
is the baseline's rounding-level null runs: the baseline again with the same batches and initial
weights moved by one ulp at seeded random positions. The baseline and its null runs are equally good
by construction, so their spread is how far equally good runs land apart; in bf16 it grows with the
steps (rounding decisions flip and the runs drift), in fp32 it stays near zero. The decided interval is
the recipe's figure minus the mean of those runs, ± Student's t times their spread times
sqrt(1 + 1/n) (verdicts.replicate_interval) — the figure being the mean train loss over the window
(the last 10 % of steps, the same batches for every run) or the mean of the last validation
evaluations. An inconclusive verdict says how many null runs would settle it (`null_runs_to_settle`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from mixprec.comparison.config import LOSSES, NOISE_SUFFIX, NULL_SUFFIX, CompareConfig
from mixprec.monitor import ROLES
from mixprec.verdicts import (
    DIFFERENT,
    EQUIVALENT,
    INCONCLUSIVE,
    WORSE,
    Interval,
    combine,
    decide_equivalence,
    detectable_effect,
    group_interval,
    paired_bootstrap,
    references_to_settle,
    relative_mean_change,
    student_t_quantile,
)

# summary.json: 2 added the "inconclusive" verdict; 3 the verdicts equivalent / worse / inconclusive
# against a margin with the null runs' band (`bands`, `interval`, `band_*`, `steps_to_settle`), `passed`
# false only for `worse`; 4: the interval from the spread of the baseline's runs (`bands.*.members`,
# `spread_*`), `null_runs_to_settle` replaces `steps_to_settle`; 5: FP4 margins and limits; 6: the verdict
# `different` (an interval wholly below -margin) with `direction`, both losses judged (`intervals`,
# `loss_verdicts` per loss replace `interval`; `verdict_loss` "both" by default), the minimum detectable
# effect (`detectable` per recipe, `detectable_*` per band), `passed` false for `different` too; metrics.jsonl rows are unchanged since 1
SCHEMA_VERSION = 6
METRICS_SCHEMA_VERSION = 2
BASELINE = "baseline"  # the verdict of a recipe others are judged against
WINDOW_SHARE = 0.1  # the verdict window: the last 10 % of steps
# where the band's evolution is sampled (fractions of the run): how the spread of equally good runs
# grows with the steps
EVOLUTION_POINTS = (0.25, 0.5, 0.75, 1.0)


@dataclass
class RecipeSummary:
    recipe: str
    baseline: str | None
    final_train_loss: float
    final_val_loss: float
    train_gap: float | None  # vs baseline, fraction
    val_gap: float | None
    max_smoothed_gap: float | None  # largest |gap| of the smoothed train-loss curve (signed)
    max_smoothed_gap_step: int | None
    noise_train: float | None  # the baseline's data-order noise run (--order-noise), fraction
    noise_val: float | None
    noise_max_smoothed_gap: float | None
    margin: (
        float | None
    )  # the largest acceptable gap (verdicts.FP8_MARGIN / FP4_MARGIN / HALF_MARGIN by default)
    verdict: str  # "equivalent", "worse", "different", "inconclusive" or "baseline"
    band_train: float | None = None  # half-width of the band: how far an equally good run may land
    band_val: float | None = None
    # per judged loss ("train", "val"): the decided interval (verdicts.Interval fields), its verdict, and
    # the smallest gap beyond the margin this comparison would detect (95 % confidence, 80 % power)
    intervals: dict[str, dict | None] = field(default_factory=dict)
    loss_verdicts: dict[str, str] = field(default_factory=dict)
    detectable: dict[str, float | None] = field(default_factory=dict)
    direction: str | None = None  # "lower" (loss below the baseline's) or "higher", for worse / different
    null_runs_to_settle: int | None = None  # inconclusive only: about how many null runs; -1 none would
    reasons: list[str] = field(default_factory=list)
    saturation_peak: dict[str, dict] = field(default_factory=dict)  # role -> {value, step, layer}
    underflow_peak: dict[str, dict] = field(default_factory=dict)
    nan_events: int = 0
    first_nan_event: dict | None = None
    skipped_steps: int = 0


@dataclass
class ComparisonSummary:
    """What `mixprec.compare` returns; `to_dict()` is summary.json."""

    recipes: dict[str, RecipeSummary]
    # which losses the verdict judges: "both" (train and held-out; equivalent only if both are), "train"
    # or "val" (held-out, the same blocks for every recipe) alone
    verdict_loss: str
    passed: bool  # the default gate: no recipe worse or different (`gate()` takes --strict / --accept-better)
    config: dict
    noise_runs: dict[str, dict] = field(default_factory=dict)  # baseline -> {train, val, max_smoothed_gap}
    bands: dict[str, dict] = field(default_factory=dict)  # baseline -> its null runs' band (see _band)
    data: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    speed: dict = field(default_factory=dict)  # wall time per step; not part of the numbers a seed fixes
    machine: str = ""
    out_dir: str | None = None
    report_path: str | None = None
    trained_models: dict = field(default_factory=dict, repr=False)  # recipe -> nn.Module (not serialized)
    tokenizer: Any = field(default=None, repr=False)  # the tokenizer the runs used (not serialized)
    schema_version: int = SCHEMA_VERSION

    @property
    def exit_code(self) -> int:
        """0: no recipe is worse or different (inconclusive ones included), 1: one is."""
        return 0 if self.passed else 1

    def gate(self, *, strict: bool = False, accept_better: bool = False) -> bool:
        """Whether the comparison passes: no recipe `worse`; none `different` unless `accept_better`;
        with `strict`, none `inconclusive` either."""
        return gate_passes(
            [r.verdict for r in self.recipes.values()], strict=strict, accept_better=accept_better
        )

    def to_dict(self) -> dict:
        d = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("trained_models", "tokenizer")
        }
        d["recipes"] = {k: asdict(v) for k, v in self.recipes.items()}
        return json_safe(d)

    def failures(self) -> list[str]:
        return [name for name, r in self.recipes.items() if r.verdict in (WORSE, DIFFERENT)]

    def inconclusive(self) -> list[str]:
        return [name for name, r in self.recipes.items() if r.verdict == INCONCLUSIVE]


def gate_passes(verdicts: list[str], *, strict: bool = False, accept_better: bool = False) -> bool:
    """The comparison's gate over its recipes' verdicts. `different` fails like `worse`: a precision
    change that lowers the loss by more than the margin changed something other than rounding (a frozen
    layer can do that, measured in docs/compare.md); `accept_better` lets it pass for a user who expects
    the change to help (a regularising effect they have checked). `strict`: `inconclusive` fails too."""
    failing = {WORSE} | ({INCONCLUSIVE} if strict else set()) | (set() if accept_better else {DIFFERENT})
    return not any(v in failing for v in verdicts)


def json_safe(x: Any) -> Any:
    """JSON has no NaN/inf: they become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def _gap(x: float, base: float) -> float | None:
    if not (math.isfinite(x) and math.isfinite(base)) or base == 0:
        return None
    return (x - base) / base


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing moving average (NaN/None entries are left out of their windows)."""
    out = []
    for i in range(len(values)):
        out.append(_mean(values[max(0, i - window + 1) : i + 1]))
    return out


def smoothing_window(steps: int) -> int:
    return max(1, steps // 20)


def gap_curve(run: list[float], base: list[float], steps: int) -> list[float | None]:
    """Relative gap of the smoothed train-loss curves, step by step."""
    w = smoothing_window(steps)
    return [_gap(a, b) for a, b in zip(smoothed(run, w), smoothed(base, w))]


def _largest(curve: list[float | None], skip: int) -> tuple[float | None, int | None]:
    best, at = None, None
    for i, g in enumerate(curve):
        if i < skip or g is None:
            continue
        if best is None or abs(g) > abs(best):
            best, at = g, i + 1
    return best, at


def split_records(records: list[dict]) -> dict[str, dict[str, list[dict]]]:
    """run -> kind -> rows."""
    out: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        out[r["run"]][r["kind"]].append(r)
    return out


def train_losses(rows: list[dict], steps: int) -> list[float]:
    by_step = {r["step"]: r["loss"] for r in rows}
    return [by_step.get(s) if by_step.get(s) is not None else float("nan") for s in range(1, steps + 1)]


def _peaks(rows: list[dict], key: str) -> dict[str, dict]:
    out = {}
    for role in ROLES:
        these = [r for r in rows if r["role"] == role]
        if these:
            top = max(these, key=lambda r: r[key])
            out[role] = {"value": top[key], "step": top["step"], "layer": top["layer"]}
    return out


def window_length(steps: int) -> int:
    """Steps in the verdict window: the last 10 % (at least 2 where the run has them, for a bootstrap)."""
    return min(steps, max(2, math.ceil(WINDOW_SHARE * steps)))


def window_gap(run: list[float], base: list[float], end: int) -> float | None:
    """Relative gap mean(run) / mean(base) - 1 over the window ending at step `end` (1-based)."""
    n = window_length(end)
    return _gap(_mean(run[end - n : end]), _mean(base[end - n : end]))


def null_runs_of(runs: dict, baseline: str) -> list[str]:
    prefix = baseline + NULL_SUFFIX
    return sorted((r for r in runs if r.startswith(prefix)), key=lambda r: int(r[len(prefix) :] or 0))


def _spread(values: list[float | None]) -> float | None:
    """Sample standard deviation (n - 1 degrees of freedom) of the runs' figures, or None."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if len(finite) < 2 or len(finite) != len(values):
        return None
    centre = sum(finite) / len(finite)
    return math.sqrt(sum((v - centre) ** 2 for v in finite) / (len(finite) - 1))


def _half_width(spread: float | None, runs: int) -> float | None:
    """How far one more equally good run may land from the mean of `runs` runs (95 %, Student's t)."""
    if spread is None or runs < 2:
        return None
    return student_t_quantile(0.975, runs - 1) * spread * math.sqrt(1 + 1 / runs)


def _band(
    base: str, nulls: list[str], curves: dict, finals: dict, steps: int, margin: float | None = None
) -> dict:
    """The baseline's runs — itself and its rounding-level null runs, equally good by construction —
    their figures relative to the baseline, their spread, the band (how far one more equally good run
    may land from their mean), how the spread evolves over steps, and — given the strictest margin
    asked of the baseline — the smallest gap one run of a recipe must have to be detected (`worse` or
    `different`) in 80 % of comparisons of this size (verdicts.detectable_effect)."""
    members = [base, *nulls]
    train = [window_gap(curves[m], curves[base], steps) for m in members]
    val = [_gap(finals[m][1], finals[base][1]) for m in members]
    evolution = []
    for share in EVOLUTION_POINTS:
        end = max(1, int(share * steps))
        spread = _spread([window_gap(curves[m], curves[base], end) for m in members])
        evolution.append({"step": end, "spread_train": spread, "train": _half_width(spread, len(members))})
    spread_train, spread_val = _spread(train), _spread(val)
    band = {"runs": nulls, "members": members, "train": train[1:], "val": val[1:],
            "spread_train": spread_train, "spread_val": spread_val,
            "half_width_train": _half_width(spread_train, len(members)),
            "half_width_val": _half_width(spread_val, len(members)),
            "window_steps": window_length(steps), "evolution": evolution}  # fmt: skip
    if margin is not None:
        band["margin"] = margin
        for loss in LOSSES:  # one run of a recipe against this band: an interval as wide as the band
            half = band[f"half_width_{loss}"]
            one_run = (
                Interval(0.0, -half, half, 0.95, len(members), dof=len(members) - 1)
                if half is not None
                else None
            )
            band[f"detectable_{loss}"] = (
                detectable_effect(one_run, margin=margin) if one_run is not None else None
            )
    return band


def _own_runs(
    recipe: str, base: str, nulls: list[str], curves: dict, finals: dict, steps: int
) -> dict | None:
    """A recipe's own null runs (it has them when it is a baseline too, or judged against fp32), as
    gaps to ITS baseline, and the spread of its runs; None without."""
    if not nulls:
        return None
    train = [window_gap(curves[n], curves[base], steps) for n in nulls]
    val = [_gap(finals[n][1], finals[base][1]) for n in nulls]
    own_train = [window_gap(curves[recipe], curves[base], steps), *train]
    own_val = [_gap(finals[recipe][1], finals[base][1]), *val]
    return {"train": train, "val": val, "spread_train": _spread(own_train), "spread_val": _spread(own_val)}


def null_check(
    base: str, nulls: list[str], curves: dict, finals: dict, config: CompareConfig, margin: float
) -> dict | None:
    """The procedure checked on a case whose answer is known: null run 1 is as good as the baseline, so
    judged like a recipe — against the baseline and the OTHER null runs (leave-one-out), at the
    strictest margin asked of this baseline, on every judged loss — it must come out `equivalent`.
    Needs at least 2 null runs."""
    if len(nulls) < 2:
        return None
    candidate, others = nulls[0], nulls[1:]
    band = _band(base, others, curves, finals, config.steps)
    probe = RecipeSummary(
        recipe=candidate, baseline=base, final_train_loss=finals[candidate][0], final_val_loss=finals[candidate][1],
        train_gap=window_gap(curves[candidate], curves[base], config.steps),
        val_gap=_gap(finals[candidate][1], finals[base][1]), max_smoothed_gap=None, max_smoothed_gap_step=None,
        noise_train=None, noise_val=None, noise_max_smoothed_gap=None, margin=margin, verdict=BASELINE,
    )  # fmt: skip
    for loss in config.judged_losses():
        interval = decided_interval(probe, curves[candidate], curves[base], config, band, loss=loss)
        probe.intervals[loss] = None if interval is None else interval.to_dict()
        probe.loss_verdicts[loss], _ = _loss_verdict(probe, loss)
    return {"run": candidate, "against": [base, *others], "margin": margin,
            "verdict": combine(list(probe.loss_verdicts.values())), "loss_verdicts": probe.loss_verdicts,
            "intervals": probe.intervals}  # fmt: skip


def summarize(records: list[dict], config: CompareConfig) -> ComparisonSummary:
    runs = split_records(records)
    steps = config.steps
    last_n = max(1, math.ceil(WINDOW_SHARE * steps))
    skip = max(smoothing_window(steps), steps // 10)
    finals: dict[str, tuple[float, float]] = {}
    curves: dict[str, list[float]] = {}
    for name, kinds in runs.items():
        losses = train_losses(kinds["step"], steps)
        evals = [r["val_loss"] for r in sorted(kinds["eval"], key=lambda r: r["step"])]
        finals[name] = (_mean(losses[-last_n:]), _mean(evals[-config.eval_last :]))
        curves[name] = losses

    baselines = [b for b in dict.fromkeys(config.baselines().values()) if b]
    noise_runs, bands = {}, {}
    for base in baselines:
        noise = base + NOISE_SUFFIX
        if noise in finals:
            big, _ = _largest(gap_curve(curves[noise], curves[base], steps), skip)
            noise_runs[base] = {
                "train": window_gap(curves[noise], curves[base], steps),
                "val": _gap(finals[noise][1], finals[base][1]),
                "max_smoothed_gap": big,
                "evolution": [
                    {"step": (end := max(1, int(sh * steps))), "train": window_gap(curves[noise], curves[base], end)}
                    for sh in EVOLUTION_POINTS
                ],
            }  # fmt: skip
        nulls = null_runs_of(runs, base)
        if nulls and base in curves:
            margin = min(config.threshold_for(r) for r, b in config.baselines().items() if b == base)
            bands[base] = _band(base, nulls, curves, finals, steps, margin)
            bands[base]["null_check"] = null_check(base, nulls, curves, finals, config, margin)

    out: dict[str, RecipeSummary] = {}
    for recipe, base in config.baselines().items():
        kinds = runs.get(recipe, {})
        train, val = finals.get(recipe, (float("nan"), float("nan")))
        nan_rows = kinds.get("nan_event", [])
        precision = kinds.get("precision", [])
        s = RecipeSummary(
            recipe=recipe, baseline=base, final_train_loss=train, final_val_loss=val,
            train_gap=None, val_gap=None, max_smoothed_gap=None, max_smoothed_gap_step=None,
            noise_train=None, noise_val=None, noise_max_smoothed_gap=None,
            margin=None if base is None else config.threshold_for(recipe), verdict=BASELINE,
            saturation_peak=_peaks(precision, "saturation"), underflow_peak=_peaks(precision, "underflow"),
            nan_events=len(nan_rows), first_nan_event=dict(nan_rows[0]) if nan_rows else None,
            skipped_steps=sum(1 for r in kinds.get("step", []) if r.get("skipped")),
        )  # fmt: skip
        if base is not None and base in curves and recipe in curves:
            s.train_gap = window_gap(curves[recipe], curves[base], steps)
            s.val_gap = _gap(val, finals[base][1])
            s.max_smoothed_gap, s.max_smoothed_gap_step = _largest(
                gap_curve(curves[recipe], curves[base], steps), skip
            )
            noise = noise_runs.get(base, {})
            s.noise_train, s.noise_val = noise.get("train"), noise.get("val")
            s.noise_max_smoothed_gap = noise.get("max_smoothed_gap")
            band = bands.get(base, {})
            s.band_train, s.band_val = band.get("half_width_train"), band.get("half_width_val")
            own = _own_runs(recipe, base, null_runs_of(runs, recipe), curves, finals, steps)
            settle = []
            for loss in config.judged_losses():
                interval = decided_interval(s, curves[recipe], curves[base], config, band, own, loss=loss)
                s.intervals[loss] = None if interval is None else interval.to_dict()
                if interval is not None:
                    s.detectable[loss] = detectable_effect(interval, margin=s.margin)
                    settle.append(_runs_to_settle(s, interval, band, own, loss))
            s.null_runs_to_settle = _most_runs(settle)
        s.verdict, s.reasons = _verdict(s, config)
        if s.verdict != INCONCLUSIVE:
            s.null_runs_to_settle = None
        out[recipe] = s
    passed = gate_passes([r.verdict for r in out.values()])
    return ComparisonSummary(
        recipes=out, verdict_loss=config.verdict_loss, passed=passed, config=config.to_dict(),
        noise_runs=noise_runs, bands=bands,
    )  # fmt: skip


def decided_interval(
    s: RecipeSummary,
    run: list[float],
    base: list[float],
    config: CompareConfig,
    band: dict,
    own: dict | None = None,
    *,
    loss: str = "train",
) -> Interval | None:
    """The interval the verdict decides on `loss` ("train" or "val").

    With null runs: the mean of the recipe's figures (train: the window's mean loss; val: the mean of
    the last evaluations) minus the mean of the baseline's runs (the baseline and its null runs), all
    relative to the baseline, with Student's t: the recipe's run is one draw, as each of theirs is, so
    what it must be told apart from is the scatter of equally good runs, which already contains the
    batch-to-batch noise of the window. A recipe with null runs of its own (`own`: its figures, itself
    first) brings its own spread (verdicts.group_interval, Welch); one run alone is taken to scatter
    like the baseline's runs (verdicts.replicate_interval).
    Without null runs: the paired bootstrap over the window's steps (same batches for both runs), which
    sees only that batch-to-batch noise and not how far equally good runs drift apart.
    """
    val = loss == "val"
    gap = s.val_gap if val else s.train_gap
    if gap is None or not math.isfinite(gap):
        return None
    members = band.get("val" if val else "train")
    candidates = [gap, *((own or {}).get("val" if val else "train") or [])]
    if members is not None and all(m is not None and math.isfinite(m) for m in (*members, *candidates)):
        runs = f"{len(candidates)} runs of the recipe" if len(candidates) > 1 else "the recipe's run"
        return group_interval(candidates, [0.0, *members], method=f"{runs} against the {s.baseline} run and its "
                              f"{len(members)} null run(s), Student's t")  # fmt: skip
    if val:
        return Interval(gap, gap, gap, level=0.95, samples=1, method="validation gap (no null runs)")
    end = config.steps
    n = window_length(end)
    b = torch.tensor(base[end - n : end], dtype=torch.float64)
    r = torch.tensor(run[end - n : end], dtype=torch.float64)
    if not (bool(torch.isfinite(b).all()) and bool(torch.isfinite(r).all())) or float(b.mean()) == 0:
        return None
    if n < 2:
        return Interval(gap, gap, gap, level=0.95, samples=1, method="train gap (no null runs)")
    boot = paired_bootstrap(relative_mean_change, b, r, seed=config.seed)
    return Interval(boot.estimate, boot.low, boot.high, level=0.95, samples=n,
                    method="paired bootstrap over the window's steps (no null runs)")  # fmt: skip


def _runs_to_settle(
    s: RecipeSummary, interval: Interval, band: dict, own: dict | None, loss: str
) -> int | None:
    """How many null runs (of the baseline; of each, when the recipe has its own) would settle the
    interval of `loss`, the estimate and the spreads taken as fixed; None when it is settled, -1 when
    no number would."""
    key = f"spread_{loss}"
    spread = band.get(key)
    if spread is None or interval.samples < 2:
        return (
            None if decide_equivalence(interval.low, interval.high, margin=s.margin) != INCONCLUSIVE else -1
        )
    runs = references_to_settle(
        interval, margin=s.margin, spread=spread, candidate_spread=(own or {}).get(key)
    )
    return None if runs is None else (runs if runs < 0 else runs - 1)


def _most_runs(counts: list[int | None]) -> int | None:
    """What settles every judged loss: the largest count; -1 if any cannot be settled; None if all are."""
    open_ = [c for c in counts if c is not None]
    if not open_:
        return None
    return -1 if any(c < 0 for c in open_) else max(open_)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.3f}%"


def _verdict(s: RecipeSummary, config: CompareConfig) -> tuple[str, list[str]]:
    reasons = []
    worse = False
    if not (math.isfinite(s.final_train_loss) and math.isfinite(s.final_val_loss)):
        worse = True
        reasons.append("final loss is NaN/inf")
    if s.nan_events:
        worse = True
        e = s.first_nan_event or {}
        reasons.append(
            f"{s.nan_events} step(s) with NaN/inf, first at step {e.get('step')} in {e.get('layer') or ''} {e.get('tensor')}".replace(
                "  ", " "
            )
        )
    if s.baseline is None:
        return (WORSE if worse else BASELINE), reasons
    verdicts = []
    for loss in config.judged_losses():
        verdict, reason = _loss_verdict(s, loss)
        s.loss_verdicts[loss] = verdict
        verdicts.append(verdict)
        reasons.append(reason)
    verdict = combine(verdicts)
    if verdict == INCONCLUSIVE:
        settle = s.null_runs_to_settle
        if settle is None or settle < 0:
            reasons.append("no number of null runs would settle it: one run of the recipe scatters too widely "
                           "on its own (fewer steps, or a larger margin)")  # fmt: skip
        else:
            reasons.append(f"about {settle} null runs would settle it (--null-runs {settle})")
    evidence = _precision_evidence(s, config)
    if evidence:
        # A short run can keep the loss on the baseline while a tensor role loses most of its
        # values (a tiny model whose loss is still unigram statistics learnt by the embeddings
        # and head: 100 % underflowing gradients moved it by -0.2 %, measured): the loss has
        # not shown the damage yet, the statistics do.
        worse = True
        reasons.append("the precision statistics are beyond their limits")
        reasons.extend(evidence)
    if worse or verdict == WORSE:
        reasons.extend(r for r in _peaks_above(s, _EXPLAIN_PEAKS_ABOVE) if r not in reasons)
        s.direction = "lower" if verdict == DIFFERENT else "higher"
        return WORSE, reasons
    s.direction = "lower" if verdict == DIFFERENT else None
    return verdict, reasons


_LOSS_NAMES = {"train": "train", "val": "validation"}


def _loss_verdict(s: RecipeSummary, loss: str) -> tuple[str, str]:
    """The verdict of one loss's interval and the reason that says it (gap, interval, band, margin)."""
    which = _LOSS_NAMES[loss]
    iv = s.intervals.get(loss)
    gap = s.val_gap if loss == "val" else s.train_gap
    if iv is None or gap is None:
        return WORSE, f"no {which} gap to {s.baseline}"
    band = s.band_val if loss == "val" else s.band_train
    band_text = (
        f"band of equally good runs ±{band * 100:.3f}%"
        if band is not None
        else "no null runs: only the batch-to-batch noise is measured"
    )
    where = (
        f"{which} loss {_pct(gap)} vs {s.baseline}, {_pct(iv['estimate'])} vs the mean of its runs, "
        f"interval [{_pct(iv['low'])}, {_pct(iv['high'])}] ({band_text})"
    )
    verdict = decide_equivalence(iv["low"], iv["high"], margin=s.margin)
    margin = f"{s.margin * 100:.2f}%"
    if verdict == EQUIVALENT:
        return verdict, f"{where}: within ±{margin}"
    if verdict == WORSE:
        return verdict, f"{where}: wholly above the {margin} margin"
    if verdict == DIFFERENT:
        return verdict, (f"{where}: wholly below -{margin}, lower than its baseline by more than the margin: "
                         "something changed more than rounding")  # fmt: skip
    return verdict, f"{where}: not wholly within ±{margin}"


def _precision_evidence(s: RecipeSummary, config: CompareConfig) -> list[str]:
    """The run's saturation / underflow peaks above the limits of config.thresholds: evidence of a
    precision problem that a loss gap within the margin cannot give."""
    limits = config.limits_for(s.recipe)
    return _peaks_above(s, {"saturation": limits.saturation, "underflow": limits.underflow})


# a failing recipe's reasons name any saturation or underflow above this, to say why it failed
_EXPLAIN_PEAKS_ABOVE = {"saturation": 0.01, "underflow": 0.01}


def _peaks_above(s: RecipeSummary, limits: dict[str, float]) -> list[str]:
    """The worst saturation and underflow of the run (any role), for each that exceeds its limit."""
    found = []
    for label, peaks in (("saturation", s.saturation_peak), ("underflow", s.underflow_peak)):
        if peaks:
            role, top = max(peaks.items(), key=lambda kv: kv[1]["value"])
            if top["value"] > limits[label]:
                found.append(
                    f"{label} up to {top['value'] * 100:.1f}% of {role} ({top['layer']}, step {top['step']})"
                )
    return found
