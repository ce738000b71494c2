"""A short HTML report of an evaluation (gates, figures, example generations, PNG plots), built with the
shared helpers of mixprec.pages (self-contained: images inline; the PNGs are also written beside it)."""

from __future__ import annotations

import os
from pathlib import Path

from mixprec.evaluation.result import EvaluationResult
from mixprec.files import write_bytes_atomic
from mixprec.pages import Section, paragraph, png_bytes, pyplot, table_html, write_html_report


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10_000:
        return f"{v:,}"
    return str(v)


def _interval(interval: dict | None) -> str:
    return "-" if not interval else f"[{_fmt(interval['low'])}, {_fmt(interval['high'])}]"


def _plots(result: EvaluationResult) -> list[tuple[str, str, bytes]]:
    """(file name, caption, PNG bytes)."""
    plt = pyplot()
    out = []
    mem, tp = result.memory, result.throughput
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    axes[0].bar(["reference", "candidate"],
                [mem["reference_weight_bytes_memory"] / 2**20, mem["candidate_weight_bytes_memory"] / 2**20])  # fmt: skip
    axes[0].set_title("weights in memory (MiB)")
    axes[1].bar(
        ["reference", "candidate"],
        [tp.get("reference_tokens_per_s") or 0, tp.get("candidate_tokens_per_s") or 0],
    )
    axes[1].set_title(f"throughput, {tp.get('measured', '')}")
    out.append(("memory_speed.png", "weight memory and throughput, measured in the same run", png_bytes(fig)))
    ps = result.per_sample
    if "lm.reference_nll" in ps:
        fig, ax = plt.subplots(figsize=(4.5, 4))
        both = ps["lm.reference_nll"] + ps["lm.candidate_nll"]
        ax.scatter(ps["lm.reference_nll"], ps["lm.candidate_nll"], s=6)
        ax.plot([min(both), max(both)], [min(both), max(both)], "k--", lw=0.8)
        ax.set_xlabel("reference NLL per sample")
        ax.set_ylabel("candidate NLL per sample")
        out.append(
            (
                "lm_nll.png",
                "mean NLL per sample: candidate vs reference (diagonal: no change)",
                png_bytes(fig),
            )
        )
    for key, title in (
        ("embed.cosine", "cosine similarity per sample"),
        ("generate.rouge_l", "ROUGE-L per prompt"),
        ("clip.image_cosine", "image embedding cosine (reference vs candidate) per pair"),
    ):
        if key in ps:
            fig, ax = plt.subplots(figsize=(5, 3))
            ax.hist(ps[key], bins=30)
            ax.set_title(title)
            out.append((f"{key.replace('.', '_')}.png", title, png_bytes(fig)))
    return out


def write_report(result: EvaluationResult, out_dir: str | os.PathLike) -> Path:
    """Write out_dir/report.html, out_dir/evaluation.json and the PNGs; returns the HTML path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result.write_json(out / "evaluation.json")
    gates = table_html(
        ["gate", "threshold", "unit", "measured", "interval", "verdict", "pass"],
        [[g.name, f"{g.bound} {_fmt(g.threshold)}", g.unit, _fmt(g.measured), _interval(g.interval),
          g.verdict + (f" (about {g.samples_to_settle} samples would settle it)" if g.samples_to_settle else ""),
          "pass" if g.passed else "FAIL"] for g in result.gates],
        ["pass" if g.passed else "fail" for g in result.gates],
    ) if result.gates else paragraph("No gate was set.")  # fmt: skip
    rows = [[task, k, _fmt(v), _interval(figs.get("intervals", {}).get(k))] for task, figs in result.tasks.items()
            for k, v in figs.items() if k not in ("throughput", "examples", "intervals")]  # fmt: skip
    rows += [["memory", k, _fmt(v), ""] for k, v in result.memory.items()]
    rows += [["throughput", k, _fmt(v), ""] for k, v in result.throughput.items()]
    level = result.settings.get("bootstrap", {}).get("level", 0.95)
    sections = [
        Section("Gates", gates),
        Section("Figures", table_html(["task", "figure", "value", f"{level:.0%} interval"], rows)),
    ]
    if "generate" in result.tasks:
        ex = result.tasks["generate"].get("examples", [])
        sections.append(Section("Example generations", table_html(["reference", "candidate"],
                                                                    [[e["reference"], e["candidate"]] for e in ex])))  # fmt: skip
    try:
        plots = _plots(result)
    except Exception as exc:  # plots are a nicety: a missing matplotlib must not lose the figures
        plots = []
        sections.append(Section("Plots", paragraph(f"no plots: {exc}")))
    for name, _, png in plots:
        write_bytes_atomic(out / name, png)
    if plots:
        sections.append(Section("Plots", images=[(caption, png) for _, caption, png in plots]))
    if result.warnings:
        sections.append(Section("Warnings", "".join(paragraph(w) for w in result.warnings)))
    subtitle = (
        f"{'PASSED' if result.passed else 'FAILED'} - reference {result.reference['source']}, candidate "
        f"{result.candidate['source']} (scheme {result.candidate.get('scheme') or '-'}), data "
        f"{result.data['source']} ({result.data['samples_used']} samples); "
        f"{result.machine['description']}"
    )
    return write_html_report(out, "mixprec evaluate", sections, subtitle=subtitle)


__all__ = ["write_report"]
