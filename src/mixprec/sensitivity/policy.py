"""The automatic training policy: which layers stay in bf16 for a recipe, read from a profile.

    auto = automatic_policy(profile, "fp8-delayed")
    convert_for_training(model, "fp8-delayed", auto.policy)    # an ordinary Policy of keep rules
    for layer in auto.kept: print(layer.name, layer.reasons)

A layer is kept when, for any of its roles (input, weight, grad_output), the recipe's worst pass
clips more than `limits.saturation` of the tensor, flushes more than `limits.underflow` of its
non-zero elements to zero, or quantizes below `limits.min_snr_db` (sensitivity.limits: the limits
compare judges its precision statistics by). Every other layer follows the base policy (the guide's
default unless given): the automatic rules come first, one `keep` rule per kept layer, naming it
exactly, with its evidence as the rule's reason, so conversion reports show why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from mixprec.errors import MixprecError
from mixprec.recipes import ROLES, from_name
from mixprec.select import REGEX_PREFIX, matches
from mixprec.sensitivity.limits import Limits
from mixprec.sensitivity.profile import Profile
from mixprec.training.policy import Policy, Rule


@dataclass(frozen=True)
class KeptLayer:
    name: str
    reasons: tuple[str, ...]  # one per role and statistic beyond its limit

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


@dataclass(frozen=True)
class AutomaticPolicy:
    recipe: str
    kept: tuple[KeptLayer, ...]
    limits: Limits
    policy: Policy  # what convert_for_training takes

    def to_dict(self) -> dict:
        return {
            "recipe": self.recipe,
            "limits": self.limits.to_dict(),
            "kept": [{"layer": k.name, "reasons": list(k.reasons)} for k in self.kept],
        }

    def describe(self) -> str:
        if not self.kept:
            return f"{self.recipe}: every profiled layer within the limits, nothing kept"
        lines = [f"{self.recipe}: {len(self.kept)} layer(s) kept in bf16"]
        lines += [f"  {k.name}: {k.reason}" for k in self.kept]
        return "\n".join(lines)


def layer_reasons(profile: Profile, layer: str, recipe: str, limits: Limits) -> list[str]:
    """Why `layer` should stay in high precision under `recipe` (empty: it may take the recipe)."""
    reasons = []
    limits = limits.for_kind(from_name(recipe).kind)
    for role in ROLES:
        cell = profile.cell(layer, role, recipe)
        if cell.peak_saturation > limits.saturation:
            reasons.append(f"{role} saturates {cell.peak_saturation:.2%} > {limits.saturation:.2%}")
        if cell.peak_underflow > limits.underflow:
            reasons.append(f"{role} underflows {cell.peak_underflow:.2%} > {limits.underflow:.2%}")
        if cell.min_snr_db < limits.min_snr_db:
            reasons.append(f"{role} SNR {cell.min_snr_db:.1f} dB < {limits.min_snr_db:g} dB")
    return reasons


def exact_pattern(name: str, names: list[str]) -> str:
    """A rule name pattern that selects `name` and nothing else among `names`: the dotted name itself
    when no other name ends with it, else an anchored regular expression."""
    if sum(matches(other, name) for other in names) <= 1:
        return name
    return f"{REGEX_PREFIX}{re.escape(name)}$"


def automatic_policy(
    profile: Profile, recipe: str | object, limits: Limits | None = None, base: Policy | None = None
) -> AutomaticPolicy:
    """The policy for `recipe` (one of the profile's) that keeps every layer beyond `limits` in bf16."""
    limits = limits or Limits()
    spec = from_name(recipe).spec()  # type: ignore[arg-type]
    if spec not in profile.recipes:
        raise MixprecError(
            f"recipe {spec} is not in the profile ({', '.join(profile.recipes)}): profile it first"
        )
    base = base or Policy()
    names = profile.layer_names
    kept, rules = [], []
    for layer in names:
        reasons = layer_reasons(profile, layer, spec, limits)
        if reasons:
            kept.append(KeptLayer(layer, tuple(reasons)))
            why = f"automatic policy for {spec}: " + "; ".join(reasons)
            rules.append(Rule("keep", name=exact_pattern(layer, names), reason=why))
    policy = replace(base, rules=(*rules, *base.rules))
    return AutomaticPolicy(spec, tuple(kept), limits, policy)


__all__ = ["AutomaticPolicy", "KeptLayer", "automatic_policy", "exact_pattern", "layer_reasons"]
