"""The sections of the compare report: verdict table, loss curves, gap over steps, precision heat maps."""

from __future__ import annotations

import math

from mixprec.comparison.config import NOISE_SUFFIX, NULL_SUFFIX, is_extra_run
from mixprec.comparison.summary import (
    WINDOW_SHARE,
    ComparisonSummary,
    gap_curve,
    smoothed,
    smoothing_window,
    split_records,
    train_losses,
)
from mixprec.monitor import ROLES
from mixprec.pages import Section, heatmap_grid_png, line_plot_png, paragraph, table_html
from mixprec.recipes import QUANTIZED_KINDS, from_name
from mixprec.verdicts import DIFFERENT, EQUIVALENT, INCONCLUSIVE, WORSE

# row colours of the verdict table (mixprec.pages styles "pass" / "fail" / "inconclusive" rows)
VERDICT_CLASS = {EQUIVALENT: "pass", WORSE: "fail", DIFFERENT: "fail", INCONCLUSIVE: "inconclusive"}
# what a verdict table says of the losses it judges
JUDGED = {"both": "train and held-out losses", "train": "train loss", "val": "held-out loss"}


def _pct(x: float | None, digits: int = 3) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x * 100:+.{digits}f}%"


def _num(x: float | None) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:.4f}"


def _peak(peaks: dict) -> str:
    if not peaks:
        return "–"
    role, top = max(peaks.items(), key=lambda kv: kv[1]["value"])
    return f"{top['value'] * 100:.2f}% {role}"


def _interval(iv: dict | None) -> str:
    return "–" if not iv else f"[{_pct(iv['low'])}, {_pct(iv['high'])}]"


def _band(r) -> str:
    if r.band_train is None and r.band_val is None:
        return "–"
    return f"±{_pct(r.band_train)[1:]} / ±{_pct(r.band_val)[1:]}"


def verdict_label(r) -> str:
    """The verdict word, with its direction (worse / different) or how many null runs would settle an
    inconclusive one."""
    if r.verdict == DIFFERENT:
        return f"{r.verdict} (lower loss than {r.baseline})"
    if r.verdict == INCONCLUSIVE and r.null_runs_to_settle:
        return r.verdict + (" (no number of null runs settles it)" if r.null_runs_to_settle < 0
                            else f" (~{r.null_runs_to_settle} null runs would settle it)")  # fmt: skip
    return r.verdict


def verdict_section(summary: ComparisonSummary) -> Section:
    which = JUDGED[summary.verdict_loss]
    headers = ["recipe", "baseline", "final train", "final val", "train gap", "val gap", "train interval",
               "val interval", "null band (train / val)", "detectable gap (train / val)", "data-order noise (train / val)",
               "largest smoothed gap", "saturation peak", "underflow peak", "NaN steps", "verdict", "why"]  # fmt: skip
    rows, classes = [], []
    for name, r in summary.recipes.items():
        noise = "–" if r.noise_train is None else f"{_pct(r.noise_train)} / {_pct(r.noise_val)}"
        big = "–" if r.max_smoothed_gap is None else f"{_pct(r.max_smoothed_gap)} @ {r.max_smoothed_gap_step}"
        detectable = (
            "–" if not r.detectable else " / ".join(_pct(r.detectable.get(k))[1:] for k in ("train", "val"))
        )
        rows.append([name, r.baseline or "–", _num(r.final_train_loss), _num(r.final_val_loss), _pct(r.train_gap),
                     _pct(r.val_gap), _interval(r.intervals.get("train")), _interval(r.intervals.get("val")), _band(r),
                     detectable, noise, big, _peak(r.saturation_peak), _peak(r.underflow_peak), r.nan_events,
                     verdict_label(r).upper(), "; ".join(r.reasons)])  # fmt: skip
        classes.append(VERDICT_CLASS.get(r.verdict, "baseline"))
    cfg = summary.config
    margins = cfg["thresholds"]
    window = max(1, math.ceil(WINDOW_SHARE * cfg["steps"]))
    note = (
        f"The verdict judges the {which}: gap = (loss − baseline) / baseline, signed; the train loss over the last "
        f"{window} steps (the same batches for every run), the held-out loss as the mean of the last evaluations on the "
        f"same blocks. Margins: FP8 recipes {margins['fp8'] * 100:.2f}% and FP4 recipes "
        f"{margins.get('fp4', margins['fp8']) * 100:.2f}% against their baseline, 16-bit recipes "
        f"{margins['bf16'] * 100:.2f}%. Null runs: the baseline again on the same batches from initial weights moved "
        f"by one ulp at random positions ({cfg.get('null_runs', 0)} per baseline, and per recipe when it has its own) — "
        f"equally good runs, whose spread is how far such runs land apart. Decided interval: the recipe's figure "
        f"minus the mean of the baseline's runs, ± Student's t (95 %) times their spread times sqrt(1 + 1/n); a "
        f"recipe with null runs of its own is judged on the mean of its runs with both spreads (Welch). equivalent: "
        f"every judged loss's whole interval within ± the margin; worse: an interval wholly above it (or NaN/inf steps, "
        f"or saturation / underflow beyond their limits); different: an interval wholly below − the margin (a lower "
        f"loss than rounding explains; it fails like worse unless improvements are accepted); inconclusive: otherwise, "
        f"with about how many null runs would settle it. Detectable gap: the smallest gap beyond the margin the "
        f"recipe's interval would detect (worse or different) in 80 % of comparisons of this size. "
        f"Data-order noise (when run): the baseline with its batches reordered, reported for comparison, not used by "
        f"the verdict."
    )
    bad, open_ = summary.failures(), summary.inconclusive()
    status = (
        ("WORSE / DIFFERENT: " + ", ".join(bad))
        if bad
        else ("INCONCLUSIVE: " + ", ".join(open_))
        if open_
        else "ALL EQUIVALENT"
    )
    return Section(
        f"Verdict — {status}", html=table_html(headers, rows, classes) + f'<p class="note">{note}</p>'
    )


def curve_sections(summary: ComparisonSummary, records: list[dict]) -> list[Section]:
    runs = split_records(records)
    steps = summary.config["steps"]
    w = smoothing_window(steps)
    xs = list(range(1, steps + 1))
    train = {name: (xs, smoothed(train_losses(k["step"], steps), w)) for name, k in runs.items()}
    val = {
        name: ([r["step"] for r in sorted(k["eval"], key=lambda r: r["step"])], [r["val_loss"] for r in sorted(k["eval"], key=lambda r: r["step"])])
        for name, k in runs.items()
    }  # fmt: skip
    extra = [k for k in train if is_extra_run(k)]
    images = [
        (f"train loss, moving average over {w} steps (dashed: the baselines' null runs {NULL_SUFFIX}k and data-order runs {NOISE_SUFFIX})",
         line_plot_png(train, title="train loss (smoothed)", ylabel="loss", logy=True, dashed=extra)),
        ("validation loss on the held-out blocks", line_plot_png(val, title="validation loss", ylabel="loss", logy=True,
                                                                 dashed=extra)),
    ]  # fmt: skip
    gaps, val_gaps, hlines, bands = {}, {}, {}, {}
    for name, r in summary.recipes.items():
        if r.baseline is None:
            continue
        base_losses = train_losses(runs[r.baseline]["step"], steps)
        gaps[f"{name} vs {r.baseline}"] = (
            xs,
            _nan(gap_curve(train_losses(runs[name]["step"], steps), base_losses, steps)),
        )
        _bx, bv = val[r.baseline]
        vx, vv = val[name]
        val_gaps[f"{name} vs {r.baseline}"] = (vx, [(a - b) / b for a, b in zip(vv, bv)])
        kind = from_name(name).kind if from_name(name).kind in QUANTIZED_KINDS else "16-bit"
        hlines[f"{kind} margin {r.margin * 100:.2f}%"] = r.margin
        for extra_run in (*summary.bands.get(r.baseline, {}).get("runs", []), r.baseline + NOISE_SUFFIX):
            if extra_run in runs and f"{extra_run} vs {r.baseline}" not in gaps:
                ng = gap_curve(train_losses(runs[extra_run]["step"], steps), base_losses, steps)
                gaps[f"{extra_run} vs {r.baseline}"] = (xs, _nan(ng))
        if r.band_val is not None:
            bands[f"null band of {r.baseline}"] = (-r.band_val, r.band_val)
    hl = dict(sorted(hlines.items(), key=lambda kv: kv[1]))
    images_gap = [
        ("relative gap of the smoothed train loss to the baseline (dashed: the baseline's null runs and data-order run against it)",
         line_plot_png(gaps, title="relative train-loss gap over steps", ylabel="gap", percent=True, hlines=hl,
                       dashed=[k for k in gaps if is_extra_run(k.split(" vs ")[0])])),
        ("relative gap of the validation loss to the baseline at each evaluation; grey band: the null runs' validation band",
         line_plot_png(val_gaps, title="relative validation-loss gap", ylabel="gap", percent=True, hlines=hl, bands=bands)),
    ]  # fmt: skip
    return [Section("Loss curves", images=images), Section("Relative gap over steps", images=images_gap),
            band_section(summary)]  # fmt: skip


def null_check_line(base: str, check: dict | None) -> str:
    """One sentence: the null check of `base` (a null run judged against the others' band)."""
    if not check:
        return ""
    intervals = ", ".join(f"{loss} {_interval(iv)}" for loss, iv in (check.get("intervals") or {}).items())
    return (
        f"Null check of {base}: {check['run']} judged like a recipe against {', '.join(check['against'])} "
        f"(leave-one-out), margin ±{check['margin'] * 100:.2f}%: "
        f"{check['verdict']}{f' (intervals: {intervals})' if intervals else ''} — a run as good as the baseline must "
        f"come out equivalent, or the procedure cannot decide at this size."
    )


def detectable_line(base: str, band: dict) -> str:
    """One sentence: the power of a comparison against `base` — the smallest gap one run of a recipe
    needs to come out worse (or different) in 80 % of comparisons of this size, at 95 % confidence."""
    if band.get("detectable_train") is None and band.get("detectable_val") is None:
        return ""
    return (
        f"Minimum detectable effect against {base} (one run of a recipe, margin ±{band['margin'] * 100:.2f}%, 95 % "
        f"confidence, 80 % power): a gap of {_pct(band.get('detectable_train'))[1:]} on the train loss, "
        f"{_pct(band.get('detectable_val'))[1:]} on the held-out loss; a smaller harm beyond the margin may come out "
        f"inconclusive."
    )


def _nan(curve: list) -> list[float]:
    return [g if g is not None else float("nan") for g in curve]


def band_section(summary: ComparisonSummary) -> Section:
    """The null runs' band of each baseline and how it evolved over the run (beside the data-order run)."""
    rows = []
    for base, band in summary.bands.items():
        order = summary.noise_runs.get(base, {}).get("evolution", [])
        order_at = {p["step"]: p["train"] for p in order}
        for point in band["evolution"]:
            rows.append([base, point["step"], f"±{_pct(point['train'])[1:]}" if point["train"] is not None else "–",
                         _pct(order_at.get(point["step"]))])  # fmt: skip
        rows.append([base, "final (val)", f"±{_pct(band['half_width_val'])[1:]}" if band["half_width_val"] is not None
                     else "–", _pct(summary.noise_runs.get(base, {}).get("val"))])  # fmt: skip
    checks = [null_check_line(base, band.get("null_check")) for base, band in summary.bands.items()]
    checks += [detectable_line(base, band) for base, band in summary.bands.items()]
    html = (
        "".join(paragraph(c) for c in checks if c)
        + paragraph(
            "Half-width of the band (how far one more equally good run may land from the mean of the baseline and "
            "its null runs: Student's t x their spread x sqrt(1 + 1/n), train loss over the window of 10 % of the "
            "steps ending at that step) as the run went on, beside the data-order run's gap over the same window."
        )
        + table_html(["baseline", "step", "null band", "data-order gap"], rows)
    )
    return Section("Null band over steps", html=html)


def precision_sections(records: list[dict]) -> list[Section]:
    """Per recipe: heat maps over steps x layers of log2 amax, saturation and underflow, per tensor role."""
    runs = split_records(records)
    out = []
    for name, kinds in runs.items():
        rows = kinds.get("precision", [])
        if not rows or is_extra_run(name):
            continue
        steps = sorted({r["step"] for r in rows})
        layers = list(dict.fromkeys(r["layer"] for r in rows))
        col = {s: i for i, s in enumerate(steps)}
        images = []
        for metric, label, fn in (
            ("amax", "log2 amax", lambda v: math.log2(v) if v > 0 else float("nan")),
            ("saturation", "saturated share (%)", lambda v: v * 100),
            ("underflow", "underflowed share of non-zeros (%)", lambda v: v * 100),
        ):
            panels = []
            for role in ROLES:
                grid = [[float("nan")] * len(steps) for _ in layers]
                for r in rows:
                    if r["role"] == role:
                        grid[layers.index(r["layer"])][col[r["step"]]] = fn(r[metric])
                panels.append((role, grid))
            vmin, vmax = (0.0, None) if metric != "amax" else (None, None)
            images.append((f"{name}: {label}, layers x steps",
                           heatmap_grid_png(panels, xlabels=steps, ylabels=[_short(x) for x in layers], title=f"{name} — {label}",
                                            cbar_label=label, vmin=vmin, vmax=vmax)))  # fmt: skip
        fmts = {r["role"]: r["fmt"] for r in rows}
        note = paragraph(
            "Formats: "
            + ", ".join(f"{k} {v}" for k, v in fmts.items())
            + f"; statistics every {steps[1] - steps[0] if len(steps) > 1 else '-'} steps."
        )
        out.append(Section(f"Precision statistics — {name}", html=note, images=images))
    return out


def _short(layer: str) -> str:
    return layer.replace("model.layers.", "L").replace("self_attn.", "attn.")


def info_section(summary: ComparisonSummary) -> Section:
    speed = summary.speed or {}
    rows = [[k, f"{v * 1000:.1f} ms" if v and math.isfinite(v) else "–", _ratio(speed.get("ratio_vs_fp32", {}).get(k))]
            for k, v in speed.get("seconds_per_step", {}).items()]  # fmt: skip
    data = summary.data or {}
    model = summary.model or {}
    info = [["data", data.get("source", "–")], ["tokenizer", data.get("tokenizer", "–")],
            ["train / val tokens", f"{data.get('train_tokens', '–')} / {data.get('val_tokens', '–')}"],
            ["model", f"{model.get('source', '–')} ({model.get('parameters', 0):,} parameters)"],
            ["steps x batch x seq", f"{summary.config['steps']} x {summary.config['batch_size']} x {summary.config['seq_len']}"],
            ["seed", summary.config["seed"]]]  # fmt: skip
    html = table_html(["", ""], info) + table_html(["run", "time / step", "vs fp32"], rows)
    html += paragraph(speed.get("note", ""))
    return Section("Setup and speed", html=html)


def _ratio(x) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:.2f}x"


def compare_sections(summary: ComparisonSummary, records: list[dict]) -> list[Section]:
    return [
        verdict_section(summary),
        *curve_sections(summary, records),
        *precision_sections(records),
        info_section(summary),
    ]
