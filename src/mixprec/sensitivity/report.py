"""profile.json and report.html of `mixprec profile`: heat maps of layers x recipes, the automatic policies.

write_profile(out_dir, profile, policies, force=False)    # one directory, published atomically
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

from mixprec.files import atomic_output_dir, write_text_atomic
from mixprec.pages import Section, heatmap_grid_png, paragraph, table_html, write_html_report
from mixprec.recipes import ROLES
from mixprec.sensitivity.policy import AutomaticPolicy
from mixprec.sensitivity.profile import Profile

# SNR above this is drawn at it (an exact quantization is +inf dB)
SNR_DISPLAY_MAX_DB = 60.0


def profile_document(profile: Profile, policies: Sequence[AutomaticPolicy] = ()) -> dict:
    """profile.json: the profile and, per recipe, the layers its automatic policy keeps."""
    doc = profile.to_dict()
    doc["policies"] = {p.recipe: p.to_dict() for p in policies}
    return doc


def _short(name: str, width: int = 48) -> str:
    return name if len(name) <= width else "…" + name[-(width - 1) :]


def _matrix(profile: Profile, role: str, value) -> list[list[float]]:
    return [[value(profile.cell(layer, role, r)) for r in profile.recipes] for layer in profile.layer_names]


def heatmap_section(profile: Profile) -> Section:
    ylabels = [_short(n) for n in profile.layer_names]
    figures = (
        ("peak saturation (%, worst pass)", lambda c: 100 * c.peak_saturation, "magma_r", None),
        ("peak underflow (% of non-zero, worst pass)", lambda c: 100 * c.peak_underflow, "magma_r", None),
        ("SNR (dB, worst pass)", lambda c: min(c.min_snr_db, SNR_DISPLAY_MAX_DB), "viridis", 0.0),
    )
    images = []
    for title, value, cmap, vmin in figures:
        panels = [(role, _matrix(profile, role, value)) for role in ROLES]
        png = heatmap_grid_png(
            panels, xlabels=profile.recipes, ylabels=ylabels, title=title, cbar_label=title.split(" (")[0],
            xlabel="recipe", xtick_rotation=60, cmap=cmap, vmin=vmin,
        )  # fmt: skip
        images.append((f"{title}: rows are layers, columns recipes, one panel per tensor role", png))
    note = (
        "Each cell quantizes the tensors of the high-precision passes as the recipe would, with the scale it "
        "would use (delayed scaling from the amax history of the earlier passes); the worst pass is shown."
    )
    return Section("Heat maps", html=paragraph(note), images=images)


def policy_section(policies: Sequence[dict]) -> Section:
    """The layers each automatic policy keeps, with why (from AutomaticPolicy.to_dict() documents)."""
    rows, classes = [], []
    for p in policies:
        if not p["kept"]:
            rows.append([p["recipe"], "–", "every profiled layer within the limits"])
            classes.append("pass")
        for k in p["kept"]:
            rows.append([p["recipe"], k["layer"], "; ".join(k["reasons"])])
            classes.append("fail")
    note = ""
    if policies:
        lim = policies[0]["limits"]
        note = (
            f"Limits: saturation {lim['saturation']:.2%}, underflow {lim['underflow']:.2%}, "
            f"SNR {lim['min_snr_db']:g} dB; FP4 recipes underflow {lim.get('fp4_underflow', lim['underflow']):.2%}, "
            f"SNR {lim.get('fp4_min_snr_db', lim['min_snr_db']):g} dB (worst pass of any role: input, weight, "
            "grad_output)."
        )
    return Section(
        "Automatic policy: layers kept in bf16",
        html=table_html(["recipe", "kept layer", "why"], rows, classes) + paragraph(note),
    )


def summary_section(profile: Profile) -> Section:
    s = profile.settings
    per_pass = profile.seconds / profile.passes if profile.passes else math.nan
    text = (
        f"{len(profile.layers)} Linear layers x {len(profile.recipes)} recipes x {len(ROLES)} roles from "
        f"{profile.passes} {s.get('precision', '')} passes (batch {s.get('batch_shape')}, lr {s.get('lr')}): "
        f"{profile.seconds:.1f} s ({per_pass:.2f} s per pass, statistics included)."
    )
    model = profile.model.get("source", "")
    return Section("Profile", html=paragraph(text) + (paragraph(f"model: {model}") if model else ""))


def write_profile(
    out_dir: str | os.PathLike,
    profile: Profile,
    policies: Sequence[AutomaticPolicy] = (),
    *,
    force: bool = False,
) -> Path:
    """out_dir/profile.json and out_dir/report.html, published together (files.atomic_output_dir)."""
    out = Path(out_dir)
    with atomic_output_dir(out, force) as tmp:
        write_text_atomic(tmp / "profile.json", json.dumps(profile_document(profile, policies), indent=1))
        sections = [summary_section(profile), policy_section([p.to_dict() for p in policies])]
        sections.append(heatmap_section(profile))
        write_html_report(tmp, "mixprec profile", sections, subtitle=profile.machine)
    return out


__all__ = ["heatmap_section", "policy_section", "profile_document", "write_profile"]
