"""From the per-step records of every run to the per-recipe figures and verdicts (a pure function).

`summarize(records, config)` reads only the rows that metrics.jsonl holds, so anyone can recompute
summary.json from metrics.jsonl (the tests do). Gaps are signed fractions, (loss - baseline) / baseline;
a negative gap means the recipe did better than its baseline, and passes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from mixprec.comparison.config import NOISE_SUFFIX, CompareConfig
from mixprec.monitor import ROLES

# summary.json: 2 added the "inconclusive" verdict (and `passed` counts it as not failed); metrics.jsonl
# rows are unchanged since 1
SCHEMA_VERSION = 2
METRICS_SCHEMA_VERSION = 1


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
    noise_train: float | None  # the baseline's run-to-run noise (data order changed only), fraction
    noise_val: float | None
    noise_max_smoothed_gap: float | None
    threshold: float | None
    verdict: str  # "pass", "fail", "inconclusive" (gap above threshold but within noise) or "baseline"
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
        return [name for name, r in self.recipes.items() if r.verdict == "fail"]


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


def summarize(records: list[dict], config: CompareConfig) -> ComparisonSummary:
    runs = split_records(records)
    steps = config.steps
    last_n = max(1, math.ceil(0.1 * steps))
    skip = max(smoothing_window(steps), steps // 10)
    finals: dict[str, tuple[float, float]] = {}
    curves: dict[str, list[float]] = {}
    for name, kinds in runs.items():
        losses = train_losses(kinds["step"], steps)
        evals = [r["val_loss"] for r in sorted(kinds["eval"], key=lambda r: r["step"])]
        finals[name] = (_mean(losses[-last_n:]), _mean(evals[-config.eval_last :]))
        curves[name] = losses

    noise_runs = {}
    for base in {b for b in config.baselines().values() if b}:
        noise = base + NOISE_SUFFIX
        if noise in finals:
            big, _ = _largest(gap_curve(curves[noise], curves[base], steps), skip)
            noise_runs[base] = {
                "train": _gap(finals[noise][0], finals[base][0]),
                "val": _gap(finals[noise][1], finals[base][1]),
                "max_smoothed_gap": big,
            }

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
            threshold=None if base is None else config.threshold_for(recipe), verdict="baseline",
            saturation_peak=_peaks(precision, "saturation"), underflow_peak=_peaks(precision, "underflow"),
            nan_events=len(nan_rows), first_nan_event=dict(nan_rows[0]) if nan_rows else None,
            skipped_steps=sum(1 for r in kinds.get("step", []) if r.get("skipped")),
        )  # fmt: skip
        if base is not None:
            btrain, bval = finals[base]
            s.train_gap, s.val_gap = _gap(train, btrain), _gap(val, bval)
            s.max_smoothed_gap, s.max_smoothed_gap_step = _largest(
                gap_curve(curves[recipe], curves[base], steps), skip
            )
            noise = noise_runs.get(base, {})
            s.noise_train, s.noise_val = noise.get("train"), noise.get("val")
            s.noise_max_smoothed_gap = noise.get("max_smoothed_gap")
        s.verdict, s.reasons = _verdict(s, config)
        out[recipe] = s
    passed = all(r.verdict != "fail" for r in out.values())
    return ComparisonSummary(
        recipes=out,
        verdict_loss=config.verdict_loss,
        passed=passed,
        config=config.to_dict(),
        noise_runs=noise_runs,
    )


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.3f}%"


def _verdict(s: RecipeSummary, config: CompareConfig) -> tuple[str, list[str]]:
    reasons = []
    failed = False
    if not (math.isfinite(s.final_train_loss) and math.isfinite(s.final_val_loss)):
        failed = True
        reasons.append("final loss is NaN/inf")
    if s.nan_events:
        failed = True
        e = s.first_nan_event or {}
        reasons.append(
            f"{s.nan_events} step(s) with NaN/inf, first at step {e.get('step')} in {e.get('layer') or ''} {e.get('tensor')}".replace(
                "  ", " "
            )
        )
    inconclusive = False
    if s.baseline is not None:
        gap = s.val_gap if config.verdict_loss == "val" else s.train_gap
        noise = s.noise_val if config.verdict_loss == "val" else s.noise_train
        which = "validation" if config.verdict_loss == "val" else "train"
        above = f"{which} loss {_pct(gap)} vs {s.baseline}, above the {s.threshold * 100:.2f}% threshold"
        if gap is None:
            failed = True
            reasons.append(f"no {which} gap to {s.baseline}")
        elif gap <= s.threshold:
            within = (
                f"{which} loss {_pct(gap)} vs {s.baseline}, within the {s.threshold * 100:.2f}% threshold"
            )
            evidence = _precision_evidence(s, config)
            if evidence:
                # A short run can keep the loss on the baseline while a tensor role loses most of its
                # values (a tiny model whose loss is still unigram statistics learnt by the embeddings
                # and head: 100 % underflowing gradients moved it by -0.2 %, measured): the loss has
                # not shown the damage yet, the statistics do.
                failed = True
                reasons.append(f"{within}, but the precision statistics are beyond their limits")
                reasons.extend(evidence)
            else:
                reasons.append(within)
        elif noise is not None and gap <= abs(noise) and not _precision_evidence(s, config):
            # The baseline differs from itself by more than this when only the data order changes: a
            # gap this size is not evidence of a precision loss (short runs: the demo's 120 steps show
            # 1.8-4 % noise), and the precision statistics show nothing wrong either. Not a pass: the
            # run is too short to tell.
            inconclusive = True
            reasons.append(
                f"{above}, but within the baseline's run-to-run noise ({_pct(noise)}, data order changed) "
                "and with no saturation or underflow beyond the limits: this run is too short to tell; "
                "run more steps"
            )
        else:
            failed = True
            reasons.append(above)
    if failed:
        reasons.extend(r for r in _peaks_above(s, _EXPLAIN_PEAKS_ABOVE) if r not in reasons)
    if s.baseline is None:
        return ("fail" if failed else "baseline"), reasons
    return ("fail" if failed else "inconclusive" if inconclusive else "pass"), reasons


def _precision_evidence(s: RecipeSummary, config: CompareConfig) -> list[str]:
    """The run's saturation / underflow peaks above the limits of config.thresholds: evidence of a
    precision problem that a loss gap within the noise cannot give."""
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
