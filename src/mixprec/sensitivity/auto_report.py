"""The report of `--scheme auto`: auto_report.json (docs/schemas/auto.md) and auto_report.html (the
scores of every candidate per layer, the chosen scheme, the budget curve with its measured points,
predicted against measured perplexity of the chosen point), both written beside the checkpoint."""

from __future__ import annotations

from pathlib import Path

from mixprec.files import write_json_atomic
from mixprec.pages import Section, line_plot_png, paragraph, table_html, write_html_report
from mixprec.sensitivity.automatic import AutoResult

REPORT_JSON = "auto_report.json"
REPORT_HTML = "auto_report.html"


def _ppl_change(measured: dict | None) -> str:
    if not measured:
        return "not measured"
    ref, cand = measured["reference_perplexity"], measured["candidate_perplexity"]
    return f"{ref:.3f} -> {cand:.3f} ({cand / ref - 1:+.2%})"


def write_auto_report(result: AutoResult, out_dir: str | Path, *, plots: bool = True) -> tuple[Path, Path]:
    """Write auto_report.json and auto_report.html into `out_dir`; returns their paths. plots=False
    leaves the curve plot out (no matplotlib needed)."""
    out = Path(out_dir)
    doc = result.to_dict()
    json_path = out / REPORT_JSON
    write_json_atomic(json_path, doc)
    sections = [
        _choice_section(result, doc),
        _curve_section(result, plots),
        _uniform_section(doc),
        _layers_section(doc),
    ]
    html_path = write_html_report(out, "mixprec quantize --scheme auto", sections, filename=REPORT_HTML,
                                  subtitle=str(result.output or ""))  # fmt: skip
    return json_path, html_path


def _choice_section(result: AutoResult, doc: dict) -> Section:
    """What was chosen, under which budget or target, and where the scores came from."""
    chosen = doc["chosen"]
    target = doc["target_ppl_increase"]
    scores = (
        "reused from a scores file"
        if doc["scores_reused"]
        else f"computed in {doc['scoring']['seconds']:.0f} s"
    )
    summary = [
        ["method", doc["method"]],
        ["budget", "-" if result.budget is None else result.budget.describe()],
        ["target perplexity increase", "-" if target is None else f"{target:.2%}"],
        ["chosen bits per weight", f"{chosen['bits_per_weight']:.3f}"],
        ["schemes", ", ".join(f"{k}: {v}" for k, v in chosen["schemes"].items())],
        ["predicted score (summed)", f"{chosen['predicted_score']:.4g}"],
        ["measured perplexity (reference -> checkpoint)", _ppl_change(chosen["measured"])],
        ["scores", scores],
    ]
    return Section("Choice", html=table_html(["", ""], summary))


def _curve_section(result: AutoResult, plots: bool) -> Section:
    """The exact choice at every budget of the curve, with the measured points."""
    curve_rows = [
        [
            f"{p['bits_per_weight']:.3f}",
            f"{p['predicted_score']:.4g}",
            _ppl_change(p.get("measured")),
            ", ".join(f"{k}: {v}" for k, v in (p.get("schemes") or {}).items()),
        ]
        for p in result.curve
    ]
    return Section(
        "Budget curve",
        html=paragraph(
            "The exact choice at budgets from the smallest checkpoint to everything kept; "
            "measured points where a checkpoint was evaluated."
        )
        + table_html(["bits per weight", "predicted score", "measured perplexity", "schemes"], curve_rows),
        images=_curve_plots(result.curve) if plots else [],
    )


def _curve_plots(curve: list[dict]) -> list[tuple[str, bytes]]:
    """The predicted score against bits per weight, and the measured perplexity increase where measured."""
    pts = sorted((p["bits_per_weight"], p["predicted_score"]) for p in curve)
    measured = sorted(
        (
            p["bits_per_weight"],
            p["measured"]["candidate_perplexity"] / p["measured"]["reference_perplexity"] - 1,
        )
        for p in curve
        if p.get("measured")
    )
    images = [("predicted score (summed over layers) against bits per weight",
               line_plot_png({"predicted": ([x for x, _ in pts], [y for _, y in pts])},
                             title="budget curve: predicted", xlabel="bits per weight", ylabel="score"))]  # fmt: skip
    if measured:
        images.append(("measured perplexity increase against bits per weight",
                       line_plot_png({"measured": ([x for x, _ in measured], [y for _, y in measured])},
                                     title="budget curve: measured", xlabel="bits per weight",
                                     ylabel="perplexity increase", percent=True)))  # fmt: skip
    return images


def _uniform_section(doc: dict) -> Section:
    rows = [
        [c, f"{u['bits_per_weight']:.3f}", f"{u['predicted_score']:.4g}"] for c, u in doc["uniform"].items()
    ]
    return Section(
        "Each candidate alone", html=table_html(["scheme", "bits per weight", "predicted score"], rows)
    )


def _layers_section(doc: dict) -> Section:
    cands = doc["candidates"]
    rows = [
        [name, e["group"], e["chosen"], *(f"{e['scores'][c]:.3g}" for c in cands)]
        for name, e in doc["layers"].items()
    ]
    return Section("Per layer", html=table_html(["layer", "fused group", "chosen", *cands], rows))


__all__ = ["REPORT_HTML", "REPORT_JSON", "write_auto_report"]
