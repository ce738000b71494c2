"""Plots and a self-contained HTML report (PNG images embedded as base64), for compare and evaluate.

    sections = [
        Section("Loss curves", images=[("train loss", line_plot_png(...))]),
        Section("Verdict", html=table_html(["recipe", "gap"], [["bf16", "+0.05%"]])),
    ]
    write_html_report(out_dir, "mixprec compare", sections)   # -> out_dir / "report.html"

matplotlib is imported inside the plot functions (the 'report' extra) with the Agg backend, so no
display is needed and importing this module stays cheap.
"""

from __future__ import annotations

import base64
import html
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mixprec.errors import MixprecError
from mixprec.files import write_text_atomic


@dataclass
class Section:
    """One part of a report: a heading, optional HTML (already escaped) and PNG images with captions."""

    title: str
    html: str = ""
    images: list[tuple[str, bytes]] = field(default_factory=list)


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed), or a MixprecError naming the extra."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        raise MixprecError("plots need the 'report' extra: pip install 'mixprec[report]'") from None
    return plt


def png_bytes(fig) -> bytes:
    """The figure as PNG bytes (no timestamp metadata: the same plot gives the same bytes); closes it."""
    plt = pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def line_plot_png(
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    *,
    title: str,
    xlabel: str = "step",
    ylabel: str = "",
    hlines: dict[str, float] | None = None,
    bands: dict[str, tuple[float, float]] | None = None,
    percent: bool = False,
    logy: bool = False,
    dashed: Sequence[str] = (),
) -> bytes:
    """Overlaid lines {label: (x, y)} (labels in `dashed` drawn dashed); optional labelled horizontal
    lines and shaded bands (lo, hi)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    scale = 100.0 if percent else 1.0
    for label, (x, y) in series.items():
        ax.plot(
            list(x),
            [v * scale for v in y],
            label=label,
            linewidth=1.3,
            linestyle="--" if label in dashed else "-",
        )
    for label, (lo, hi) in (bands or {}).items():
        ax.axhspan(lo * scale, hi * scale, alpha=0.15, color="grey", label=label)
    for label, y in (hlines or {}).items():
        ax.axhline(y * scale, linestyle="--", linewidth=1, color="black", alpha=0.6)
        ax.annotate(
            label, (0.99, y * scale), xycoords=("axes fraction", "data"), ha="right", va="bottom", fontsize=7
        )
    if logy:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel + (" (%)" if percent else ""))
    ax.grid(alpha=0.3)
    if series or bands:
        ax.legend(fontsize=7)
    return png_bytes(fig)


def heatmap_grid_png(
    panels: list[tuple[str, list[list[float]]]],
    *,
    xlabels: Sequence[str | int],
    ylabels: Sequence[str],
    title: str,
    cbar_label: str = "",
    ncols: int = 3,
    vmin: float | None = None,
    vmax: float | None = None,
    xlabel: str = "step",
    xtick_rotation: float = 0,
    cmap: str = "viridis",
) -> bytes:
    """Heat maps (rows = ylabels, columns = xlabels) side by side with a shared colour scale.
    Missing cells are NaN and drawn blank."""
    plt = pyplot()
    import numpy as np

    n = max(1, len(panels))
    ncols = min(ncols, n)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(3.6 * ncols + 0.8, 0.22 * len(ylabels) * nrows + 1.6 * nrows), squeeze=False
    )
    arrays = [np.array(m, dtype=float) for _, m in panels]
    finite = [a[np.isfinite(a)] for a in arrays if a.size]
    finite = [f for f in finite if f.size]
    lo = vmin if vmin is not None else (min(float(f.min()) for f in finite) if finite else 0.0)
    hi = vmax if vmax is not None else (max(float(f.max()) for f in finite) if finite else 1.0)
    if hi <= lo:
        hi = lo + 1e-12
    image = None
    for k, ax in enumerate(axes.flat):
        if k >= len(panels):
            ax.axis("off")
            continue
        name, _ = panels[k]
        image = ax.imshow(arrays[k], aspect="auto", interpolation="nearest", vmin=lo, vmax=hi, cmap=cmap)
        ax.set_title(name, fontsize=8)
        ax.set_yticks(range(len(ylabels)))
        ax.set_yticklabels(ylabels if k % ncols == 0 else [""] * len(ylabels), fontsize=6)
        step = max(1, len(xlabels) // 6)
        ax.set_xticks(range(0, len(xlabels), step))
        ax.set_xticklabels([str(x) for x in list(xlabels)[::step]], fontsize=6, rotation=xtick_rotation)
        ax.set_xlabel(xlabel, fontsize=7)
    fig.suptitle(title, fontsize=10)
    if image is not None:
        fig.colorbar(image, ax=list(axes.flat), shrink=0.8, label=cbar_label)
    return png_bytes(fig)


def table_html(
    headers: Sequence[str], rows: Sequence[Sequence[object]], row_classes: Sequence[str] | None = None
) -> str:
    """An HTML table; cells are escaped; row_classes (e.g. "pass"/"fail") colour whole rows."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{html.escape(row_classes[i])}"' if row_classes and row_classes[i] else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def paragraph(text: str) -> str:
    return f"<p>{html.escape(text)}</p>"


_CSS = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;font-size:.85em;margin:.6em 0}th,td{border:1px solid #ccc;padding:.25em .5em;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
tr.pass td{background:#eef9ee}tr.fail td{background:#fdecec}tr.inconclusive td{background:#fdf6e0}tr.baseline td{background:#f4f6fb}
figure{margin:.8em 0}figcaption{font-size:.8em;color:#555}img{max-width:100%}
p.note{font-size:.85em;color:#444}
"""


def render_html(title: str, sections: Sequence[Section], subtitle: str = "") -> str:
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    if subtitle:
        parts.append(f'<p class="note">{html.escape(subtitle)}</p>')
    for s in sections:
        parts.append(f"<h2>{html.escape(s.title)}</h2>")
        if s.html:
            parts.append(s.html)
        for caption, png in s.images:
            data = base64.b64encode(png).decode("ascii")
            parts.append(
                f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
                f"<figcaption>{html.escape(caption)}</figcaption></figure>"
            )
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html_report(
    out_dir: str | os.PathLike,
    title: str,
    sections: Sequence[Section],
    *,
    filename: str = "report.html",
    subtitle: str = "",
) -> Path:
    """Write a self-contained HTML report (images inline) to out_dir/filename; returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(out / filename, render_html(title, sections, subtitle))


__all__ = [
    "Section",
    "heatmap_grid_png",
    "line_plot_png",
    "paragraph",
    "png_bytes",
    "pyplot",
    "render_html",
    "table_html",
    "write_html_report",
]
