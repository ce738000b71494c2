"""Recipe options: the short words `from_name` reads (per recipe name) and the canonical spec it
writes back."""

from __future__ import annotations

import dataclasses

from mixprec.errors import MixprecError

_FP4KEYWORDS = {
    "rht": "rht",
    "sr": "stochastic_rounding",
    "stochastic_rounding": "stochastic_rounding",
    "2d": "two_d",
    "two_d": "two_d",
    "keep_last": "keep_last",
    "seed": "seed",
}

# option keyword -> dataclass field, per recipe name (the short words the CLI accepts)
KEYWORDS: dict[str, dict[str, str]] = {
    "fp8-delayed": {
        "history": "amax_history_len",
        "amax_history_len": "amax_history_len",
        "algo": "amax_compute_algo",
        "amax_compute_algo": "amax_compute_algo",
        "margin": "margin",
        "format": "fp8_format",
        "fp8_format": "fp8_format",
        "growing": "current_while_growing",
        "current_while_growing": "current_while_growing",
    },
    "fp8-current": {"format": "fp8_format", "fp8_format": "fp8_format"},
    "fp8-blockwise": {"pow2": "power_of_two_scales", "power_of_two_scales": "power_of_two_scales"},
    "fp8-mxfp8": {"rounding": "rounding"},
    "fp4-nvfp4": dict(_FP4KEYWORDS),
    "fp4-mxfp4": {**_FP4KEYWORDS, "rounding": "rounding"},
    "bf16": {"master": "master_weights", "master_weights": "master_weights", "moments": "moments_dtype"},
    "fp16-amp": {
        "init_scale": "init_scale",
        "growth_interval": "growth_interval",
        "growth_factor": "growth_factor",
        "backoff_factor": "backoff_factor",
    },
}

# bare option words (no "=") -> (field, value)
FLAGS: dict[str, dict[str, tuple[str, object]]] = {
    "fp8-delayed": {
        "hybrid": ("fp8_format", "hybrid"),
        "e4m3": ("fp8_format", "e4m3"),
        "max": ("amax_compute_algo", "max"),
        "most_recent": ("amax_compute_algo", "most_recent"),
    },
    "fp8-current": {"hybrid": ("fp8_format", "hybrid"), "e4m3": ("fp8_format", "e4m3")},
    "fp8-blockwise": {"pow2": ("power_of_two_scales", True)},
    "fp8-mxfp8": {"floor": ("rounding", "floor"), "rceil": ("rounding", "rceil")},
    "fp4-mxfp4": {
        "floor": ("rounding", "floor"),
        "rceil": ("rounding", "rceil"),
        "even": ("rounding", "even"),
    },
}


def parse_value(raw: str, like: object, where: str) -> object:
    if isinstance(like, bool):
        low = raw.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise MixprecError(f"{where}: expected a boolean (true/false), got {raw!r}")
    if isinstance(like, int):
        try:
            return int(raw)
        except ValueError:
            raise MixprecError(f"{where}: expected an integer, got {raw!r}") from None
    if isinstance(like, float):
        try:
            return float(eval_power(raw))
        except ValueError:
            raise MixprecError(f"{where}: expected a number, got {raw!r}") from None
    return raw


def eval_power(raw: str) -> float:
    """'2**14' or '16384' or '1e4' -> float (no eval)."""
    if "**" in raw:
        base, exp = raw.split("**", 1)
        return float(base) ** float(exp)
    return float(raw)


def options_help(name: str) -> str:
    words = sorted(FLAGS.get(name, {}))
    keys = sorted(f"{k}=" for k in KEYWORDS.get(name, {}))
    return ", ".join(words + keys) or "none"


def spec_of(recipe: object) -> str:
    """Canonical name with the non-default options, as key=value (from_name reads it back)."""
    name = recipe.name  # type: ignore[attr-defined]
    inverse = {}
    for key, field in KEYWORDS.get(name, {}).items():
        inverse.setdefault(field, key)  # the first (short) keyword of each field
    defaults = type(recipe)()
    opts = []
    for f in dataclasses.fields(recipe):  # type: ignore[arg-type]
        value = getattr(recipe, f.name)
        if value != getattr(defaults, f.name):
            opts.append(
                f"{inverse.get(f.name, f.name)}={str(value).lower() if isinstance(value, bool) else value}"
            )
    return name + (":" + ",".join(opts) if opts else "")


__all__ = ["FLAGS", "KEYWORDS", "eval_power", "options_help", "parse_value", "spec_of"]
