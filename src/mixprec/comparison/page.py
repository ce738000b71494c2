"""The sections of the compare report: verdict table, loss curves, gap over steps, precision heat maps."""

from __future__ import annotations

import math

from mixprec.comparison.config import NOISE_SUFFIX
from mixprec.comparison.summary import (
    ComparisonSummary,
    gap_curve,
    smoothed,
    smoothing_window,
    split_records,
    train_losses,
)
from mixprec.monitor import ROLES
from mixprec.pages import Section, heatmap_grid_png, line_plot_png, paragraph, table_html
from mixprec.recipes import from_name


def _pct(x: float | None, digits: int = 3) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x * 100:+.{digits}f}%"


def _num(x: float | None) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:.4f}"


def _peak(peaks: dict) -> str:
    if not peaks:
        return "–"
    role, top = max(peaks.items(), key=lambda kv: kv[1]["value"])
    return f"{top['value'] * 100:.2f}% {role}"


def verdict_section(summary: ComparisonSummary) -> Section:
    which = "validation" if summary.verdict_loss == "val" else "train"
    headers = ["recipe", "baseline", "final train", "final val", "train gap", "val gap", "baseline noise (train / val)",
               "largest smoothed gap", "saturation peak", "underflow peak", "NaN steps", "verdict", "why"]  # fmt: skip
    rows, classes = [], []
    for name, r in summary.recipes.items():
        noise = "–" if r.noise_train is None else f"{_pct(r.noise_train)} / {_pct(r.noise_val)}"
        big = "–" if r.max_smoothed_gap is None else f"{_pct(r.max_smoothed_gap)} @ {r.max_smoothed_gap_step}"
        rows.append([name, r.baseline or "–", _num(r.final_train_loss), _num(r.final_val_loss), _pct(r.train_gap),
                     _pct(r.val_gap), noise, big, _peak(r.saturation_peak), _peak(r.underflow_peak), r.nan_events,
                     r.verdict.upper(), "; ".join(r.reasons)])  # fmt: skip
        classes.append(r.verdict)
    cfg = summary.config
    note = (
        f"The verdict uses the {which} loss: gap = (loss − baseline) / baseline, signed; a recipe passes when its "
        f"gap is at most the threshold (bf16 {cfg['thresholds']['bf16'] * 100:.2f}%, fp8 {cfg['thresholds']['fp8'] * 100:.2f}%) "
        f"and no step had NaN/inf. Final train loss: mean of the last 10% of steps; final validation loss: mean of "
        f"the last {cfg['eval_last']} evaluations. Baseline noise: the baseline re-run from the same initial weights "
        f"with only the data order changed — gaps smaller than it are not distinguishable from noise."
    )
    status = "ALL PASS" if summary.passed else f"FAIL: {', '.join(summary.failures())}"
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
    images = [
        (f"train loss, moving average over {w} steps (runs marked {NOISE_SUFFIX}: baseline, data order changed)",
         line_plot_png(train, title="train loss (smoothed)", ylabel="loss", logy=True,
                       dashed=[k for k in train if k.endswith(NOISE_SUFFIX)])),
        ("validation loss on the held-out blocks", line_plot_png(val, title="validation loss", ylabel="loss", logy=True)),
    ]  # fmt: skip
    gaps, val_gaps, hlines, bands = {}, {}, {}, {}
    for name, r in summary.recipes.items():
        if r.baseline is None:
            continue
        base_losses = train_losses(runs[r.baseline]["step"], steps)
        gaps[f"{name} vs {r.baseline}"] = (
            xs,
            [
                g if g is not None else float("nan")
                for g in gap_curve(train_losses(runs[name]["step"], steps), base_losses, steps)
            ],
        )
        _bx, bv = val[r.baseline]
        vx, vv = val[name]
        val_gaps[f"{name} vs {r.baseline}"] = (vx, [(a - b) / b for a, b in zip(vv, bv)])
        kind = "fp8" if from_name(name).kind == "fp8" else "16-bit"
        hlines[f"{kind} threshold {r.threshold * 100:.2f}%"] = r.threshold
        noise_key = r.baseline + NOISE_SUFFIX
        if noise_key in runs:
            ng = gap_curve(train_losses(runs[noise_key]["step"], steps), base_losses, steps)
            gaps[f"noise: {noise_key} vs {r.baseline}"] = (
                xs,
                [g if g is not None else float("nan") for g in ng],
            )
        if r.noise_val is not None:
            bands[f"|val noise of {r.baseline}|"] = (-abs(r.noise_val), abs(r.noise_val))
    hl = dict(sorted(hlines.items(), key=lambda kv: kv[1]))
    images_gap = [
        ("relative gap of the smoothed train loss to the baseline (dashed: the noise curve, the baseline against itself with another data order)",
         line_plot_png(gaps, title="relative train-loss gap over steps", ylabel="gap", percent=True, hlines=hl,
                       dashed=[k for k in gaps if k.startswith("noise:")])),
        ("relative gap of the validation loss to the baseline at each evaluation; grey band: the baseline's validation noise",
         line_plot_png(val_gaps, title="relative validation-loss gap", ylabel="gap", percent=True, hlines=hl, bands=bands)),
    ]  # fmt: skip
    return [Section("Loss curves", images=images), Section("Relative gap over steps", images=images_gap)]


def precision_sections(records: list[dict]) -> list[Section]:
    """Per recipe: heat maps over steps x layers of log2 amax, saturation and underflow, per tensor role."""
    runs = split_records(records)
    out = []
    for name, kinds in runs.items():
        rows = kinds.get("precision", [])
        if not rows or name.endswith(NOISE_SUFFIX):
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
