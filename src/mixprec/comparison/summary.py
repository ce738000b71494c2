"""From the per-step records of every run to the per-recipe figures and verdicts (a pure function).

`summarize(records, config)` reads only the rows that metrics.jsonl holds, so anyone can recompute
summary.json from metrics.jsonl (the tests do). Gaps are signed fractions, (loss - baseline) / baseline;
a negative gap means the recipe did better than its baseline.

The verdict (mixprec.verdicts: equivalent / worse / inconclusive) reads the recipe's gap against its
margin (verdicts.FP8_MARGIN for FP8 against bf16, HALF_MARGIN for 16-bit against fp32) with two
uncertainties around it:
- the paired bootstrap interval of the train gap over the window (the last 10 % of steps, the same
  batches for both runs), which says how much the figure depends on which batches fall in the window;
- the band: the largest |gap| of the baseline's rounding-level null runs (the baseline again, same
  batches, initial weights moved by one ulp) over the same window, which says how far two equally good
  runs drift apart. The interval [bootstrap low - band, bootstrap high + band] is what is decided.
How to settle an inconclusive verdict comes from how that interval narrowed between half the run and the
whole run (`steps_to_settle`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from mixprec.comparison.config import NOISE_SUFFIX, NULL_SUFFIX, CompareConfig
from mixprec.monitor import ROLES
from mixprec.verdicts import (
    EQUIVALENT,
    INCONCLUSIVE,
    WORSE,
    Interval,
    decide_equivalence,
    paired_bootstrap,
    relative_mean_change,
    samples_to_settle,
)

# summary.json: 2 added the "inconclusive" verdict; 3 the verdicts equivalent / worse / inconclusive
# against a margin with the null runs' band (`bands`, `interval`, `band_*`, `steps_to_settle`), `passed`
# false only for `worse`; metrics.jsonl rows are unchanged since 1
SCHEMA_VERSION = 3
METRICS_SCHEMA_VERSION = 1
BASELINE = "baseline"  # the verdict of a recipe others are judged against
WINDOW_SHARE = 0.1  # the verdict window: the last 10 % of steps
# where the band's evolution is sampled (fractions of the run); the last two give the rate at which the
# interval narrows, from which an inconclusive verdict's steps_to_settle is extrapolated
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
    margin: float | None  # the largest acceptable gap (verdicts.FP8_MARGIN / HALF_MARGIN by default)
    verdict: str  # "equivalent", "worse", "inconclusive" or "baseline"
    band_train: float | None = None  # half-width of the null runs' band of the train gap (largest |gap|)
    band_val: float | None = None
    interval: dict | None = None  # the decided interval of `verdict_loss` (verdicts.Interval fields)
    steps_to_settle: int | None = None  # inconclusive only: about how many steps; -1 none would
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
    verdict_loss: (
        str  # which loss the verdict uses: "val" (held-out, same blocks for every recipe) or "train"
    )
    passed: bool
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
        """0: no recipe is worse (inconclusive ones included), 1: one is."""
        return 0 if self.passed else 1

    def to_dict(self) -> dict:
        d = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("trained_models", "tokenizer")
        }
        d["recipes"] = {k: asdict(v) for k, v in self.recipes.items()}
        return json_safe(d)

    def failures(self) -> list[str]:
        return [name for name, r in self.recipes.items() if r.verdict == WORSE]

    def inconclusive(self) -> list[str]:
        return [name for name, r in self.recipes.items() if r.verdict == INCONCLUSIVE]


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


def _band(base: str, nulls: list[str], curves: dict, finals: dict, steps: int) -> dict:
    """The null runs' gaps to their baseline, the band (largest |gap|) and how it evolves over steps."""
    train = [window_gap(curves[n], curves[base], steps) for n in nulls]
    val = [_gap(finals[n][1], finals[base][1]) for n in nulls]
    evolution = []
    for share in EVOLUTION_POINTS:
        end = max(1, int(share * steps))
        gaps = [window_gap(curves[n], curves[base], end) for n in nulls]
        evolution.append({"step": end, "train": _half_width(gaps)})
    return {"runs": nulls, "train": train, "val": val, "half_width_train": _half_width(train),
            "half_width_val": _half_width(val), "window_steps": window_length(steps), "evolution": evolution}  # fmt: skip


def null_check(
    base: str, nulls: list[str], curves: dict, finals: dict, config: CompareConfig, margin: float
) -> dict | None:
    """The procedure checked on a case whose answer is known: null run 1 is as good as the baseline, so
    judged like a recipe — against the band of the OTHER null runs (leave-one-out), at the strictest
    margin asked of this baseline — it must come out `equivalent`. Needs at least 3 null runs."""
    if len(nulls) < 3:
        return None
    candidate, others = nulls[0], nulls[1:]
    band = _band(base, others, curves, finals, config.steps)
    probe = RecipeSummary(
        recipe=candidate, baseline=base, final_train_loss=finals[candidate][0], final_val_loss=finals[candidate][1],
        train_gap=window_gap(curves[candidate], curves[base], config.steps),
        val_gap=_gap(finals[candidate][1], finals[base][1]), max_smoothed_gap=None, max_smoothed_gap_step=None,
        noise_train=None, noise_val=None, noise_max_smoothed_gap=None, margin=margin, verdict=BASELINE,
    )  # fmt: skip
    interval = decided_interval(probe, curves[candidate], curves[base], config, band)
    if interval is None:
        return {"run": candidate, "against": others, "margin": margin, "verdict": WORSE, "symmetric_verdict": WORSE,
                "interval": None}  # fmt: skip
    verdict = decide_equivalence(interval.low, interval.high, margin=margin)
    # kept for readers of schema 3: the verdict is itself symmetric (within [-margin, +margin])
    symmetric = verdict
    return {"run": candidate, "against": others, "margin": margin, "verdict": verdict,
            "symmetric_verdict": symmetric, "interval": interval.to_dict()}  # fmt: skip


def _half_width(gaps: list[float | None]) -> float | None:
    finite = [abs(g) for g in gaps if g is not None and math.isfinite(g)]
    return max(finite) if finite and len(finite) == len(gaps) else None


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
            bands[base] = _band(base, nulls, curves, finals, steps)
            margins = [config.threshold_for(r) for r, b in config.baselines().items() if b == base]
            bands[base]["null_check"] = null_check(base, nulls, curves, finals, config, min(margins))

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
            interval = decided_interval(s, curves[recipe], curves[base], config, band)
            s.interval = None if interval is None else interval.to_dict()
            if interval is not None:
                s.steps_to_settle = _steps_to_settle(s, interval, curves[recipe], curves[base], config, band)
        s.verdict, s.reasons = _verdict(s, config)
        if s.verdict != INCONCLUSIVE:
            s.steps_to_settle = None
        out[recipe] = s
    passed = all(r.verdict != WORSE for r in out.values())
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
    end: int | None = None,
) -> Interval | None:
    """The interval the verdict decides: the gap's bootstrap interval widened by the band on each side.

    Train loss: a paired bootstrap of relative_mean_change over the window's steps (seeded by the
    comparison's seed), so the same records give the same interval. Validation loss: the gap itself
    (a mean over the last evaluations of the same blocks), widened by the validation band.
    """
    end = config.steps if end is None else end
    if config.verdict_loss == "val":
        gap, width = s.val_gap, band.get("half_width_val") or 0.0
        if gap is None or not math.isfinite(gap):
            return None
        return Interval(
            gap, gap - width, gap + width, level=0.95, samples=end, method="validation gap ± band"
        )
    n = window_length(end)
    b = torch.tensor(base[end - n : end], dtype=torch.float64)
    r = torch.tensor(run[end - n : end], dtype=torch.float64)
    if not (bool(torch.isfinite(b).all()) and bool(torch.isfinite(r).all())) or float(b.mean()) == 0:
        return None
    width = (band.get("half_width_train") or 0.0) if end == config.steps else _band_at(band, end)
    if n >= 2:
        boot = paired_bootstrap(relative_mean_change, b, r, seed=config.seed)
        low, high, gap = boot.low, boot.high, boot.estimate
    else:
        gap = float(r.mean() / b.mean() - 1)
        low = high = gap
    return Interval(
        gap, low - width, high + width, level=0.95, samples=end, method="paired-bootstrap ± null band"
    )


def _band_at(band: dict, end: int) -> float:
    for point in band.get("evolution", []):
        if point["step"] == end and point["train"] is not None:
            return point["train"]
    return 0.0


def _steps_to_settle(
    s: RecipeSummary,
    interval: Interval,
    run: list[float],
    base: list[float],
    config: CompareConfig,
    band: dict,
) -> int | None:
    """Steps that would settle an inconclusive verdict: the interval's half-width at half the run and
    at the whole run give the rate at which it narrows (half-width ~ steps**-rate); -1 when it did not
    narrow (a band that grows with steps: more steps of this run will not settle it)."""
    if decide_equivalence(interval.low, interval.high, margin=s.margin) != INCONCLUSIVE:
        return None
    half = config.steps // 2
    if config.verdict_loss == "val" or half < 2:
        return -1
    earlier = decided_interval(s, run, base, config, band, end=half)
    if earlier is None or earlier.half_width <= 0 or interval.half_width <= 0:
        return -1
    rate = math.log(earlier.half_width / interval.half_width) / math.log(config.steps / half)
    return samples_to_settle(interval, upper=s.margin, lower=-s.margin, rate=rate)


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
    which = "validation" if config.verdict_loss == "val" else "train"
    gap = s.val_gap if config.verdict_loss == "val" else s.train_gap
    iv = s.interval
    verdict = INCONCLUSIVE
    if iv is None or gap is None:
        worse = True
        reasons.append(f"no {which} gap to {s.baseline}")
    else:
        band = s.band_val if config.verdict_loss == "val" else s.band_train
        band_text = (
            f"null band ±{band * 100:.3f}%" if band is not None else "no null runs: the band is not measured"
        )
        where = (
            f"{which} loss {_pct(gap)} vs {s.baseline}, interval [{_pct(iv['low'])}, {_pct(iv['high'])}] "
            f"({band_text})"
        )
        verdict = decide_equivalence(iv["low"], iv["high"], margin=s.margin)
        if verdict == EQUIVALENT:
            reasons.append(f"{where}: within ±{s.margin * 100:.2f}%")
        elif verdict == WORSE:
            reasons.append(f"{where}: wholly above the {s.margin * 100:.2f}% margin")
        else:
            settle = s.steps_to_settle
            how = (
                "no number of steps of this run would settle it (the interval did not narrow with steps)"
                if settle is None or settle < 0
                else f"about {settle} steps would settle it (from how the interval narrowed over this run)"
            )
            reasons.append(f"{where}: not wholly within ±{s.margin * 100:.2f}%; {how}")
        evidence = _precision_evidence(s, config)
        if evidence:
            # A short run can keep the loss on the baseline while a tensor role loses most of its
            # values (a tiny model whose loss is still unigram statistics learnt by the embeddings
            # and head: 100 % underflowing gradients moved it by -0.2 %, measured): the loss has
            # not shown the damage yet, the statistics do.
            worse = True
            reasons.append("the precision statistics are beyond their limits")
            reasons.extend(evidence)
    if worse:
        reasons.extend(r for r in _peaks_above(s, _EXPLAIN_PEAKS_ABOVE) if r not in reasons)
        return WORSE, reasons
    return verdict, reasons


def _precision_evidence(s: RecipeSummary, config: CompareConfig) -> list[str]:
    """The run's saturation / underflow peaks above the limits of config.thresholds: evidence of a
    precision problem that a loss gap within the margin cannot give."""
    return _peaks_above(s, {k: config.thresholds[k] for k in ("saturation", "underflow")})


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
