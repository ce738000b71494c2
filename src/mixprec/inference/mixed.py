"""Mixed-precision checkpoints: one scheme per Linear ({Linear name: scheme}, what `--scheme auto`
chooses), written by `quantize_checkpoint` as one compressed-tensors config group per scheme.

`mixed_assignment` reads the mapping; `apply_assignment` narrows a single-scheme selection (the
Linears a scheme may take, producers.quantize._select) to it: the Linears it does not name stay in high
precision, each scheme's serving rules (schemes.serving_reasons) apply to its own Linears, and the
fused-group rule (one decision per q/k/v, gate/up, experts) to all.
"""

from __future__ import annotations

from collections.abc import Mapping

from mixprec.errors import MixprecError
from mixprec.inference.schemes import InferenceScheme, serving_reasons
from mixprec.scaling import Granularity
from mixprec.select import fused_groups

# the report's and the scales file's scheme of a mixed-precision checkpoint (each layer names its own)
MIXED = InferenceScheme(
    "mixed-precision", Granularity.rows(), Granularity.rows(), True, "one scheme per layer"
)
KEPT_BY_ASSIGNMENT = "kept in high precision by the mixed-precision assignment"
# the scheme a mixed selection starts from: no shape rule of its own, so only selection and fused groups
PLAIN = "fp8-dynamic"


def mixed_assignment(scheme: object) -> dict[str, InferenceScheme] | None:
    """{Linear: scheme} of a mapping `scheme` (MixprecError naming a bad entry), None for one scheme."""
    if isinstance(scheme, (str, InferenceScheme)) or not isinstance(scheme, Mapping):
        return None
    if not scheme:
        raise MixprecError("a mixed-precision assignment names no Linear")
    out = {}
    for name, s in scheme.items():
        if not isinstance(name, str):
            raise MixprecError(f"a mixed-precision assignment maps Linear names to schemes, got key {name!r}")
        out[name] = InferenceScheme.from_name(s)
    return out


def check_groups_whole(schemes: Mapping[str, InferenceScheme], subject: str) -> None:
    """MixprecError when a fused group (q/k/v, gate/up, one block's experts) of {Linear: scheme} is split
    across schemes: serving engines run its members as one GEMM."""
    for group, members in fused_groups(schemes).items():
        split = {m: schemes[m].name for m in members}
        if len(set(split.values())) > 1:
            raise MixprecError(
                f"{subject} splits fused group {group} across schemes ({split}): serving engines run its "
                "members as one GEMM, so they take one scheme"
            )


def apply_assignment(
    assignment: dict[str, InferenceScheme],
    linears: Mapping[str, tuple[int, int]],
    targets: dict[str, tuple[int, int]],
    skipped: dict[str, str],
    kept: dict[str, tuple[str, str]],
    layout: str,
) -> dict[str, InferenceScheme]:
    """Narrow the selection (targets, skipped, kept: producers.quantize._select's, updated in place) to the
    assignment; returns {target: its scheme}. `linears`: every Linear of the checkpoint."""
    unknown = [n for n in assignment if n not in linears]
    if unknown:
        raise MixprecError(
            f"the mixed-precision assignment names {unknown[0]!r}, which is no Linear of the checkpoint"
        )
    check_groups_whole(assignment, "the mixed-precision assignment")
    for name in [n for n in targets if n not in assignment]:
        del targets[name]
        skipped[name] = KEPT_BY_ASSIGNMENT
        kept[name] = ("Linear", KEPT_BY_ASSIGNMENT)
    plain = InferenceScheme.from_name(PLAIN)
    for sch in dict.fromkeys(assignment.values()):
        own = {n: dims for n, dims in targets.items() if assignment[n] == sch}
        refused = {
            **serving_reasons(sch, layout, own, {}),
            **serving_reasons(plain, layout, linears, skipped),
        }
        for name, why in refused.items():
            if name in targets:
                del targets[name]
                skipped[name] = why
                kept[name] = ("Linear", why)
    return {n: assignment[n] for n in targets}


__all__ = [
    "KEPT_BY_ASSIGNMENT",
    "MIXED",
    "PLAIN",
    "apply_assignment",
    "check_groups_whole",
    "mixed_assignment",
]
