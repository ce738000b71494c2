"""The scales a recipe gives one layer's tensors, pass after pass, as LowPrecisionLinear computes them.

A high-precision pass through the model shows each layer's input, weight and grad_output; what an FP8
run would do with them depends on the scale, and for delayed scaling the scale at pass t comes from
the amax history of passes < t. `RecipeScales` keeps that history with the very functions LowPrecisionLinear
keeps it with (mixprec.training.scaling_state: record the amax of every quantized tensor into row 0,
scale from the stored scale or, while a role has none, from the tensor's own amax, and advance once
per pass as training advances once per optimizer step), so the simulation and the training layer
cannot drift apart. Recipes without delayed scaling take their scales from the tensor itself (None:
the quantizer computes them); a recipe with a `fixed_scale` (the fp8-unscaled negative control)
gets that scale.
"""

from __future__ import annotations

import torch

from mixprec.formats import Format
from mixprec.recipes import ROLES
from mixprec.training import scaling_state


def is_quantizing(recipe: object) -> bool:
    """Does the recipe quantize a Linear's tensors (FP8 today, FP4 later): it says, per role and
    orientation, which format and granularity each operand gets (`operand`)."""
    return callable(getattr(recipe, "operand", None))


class RecipeScales:
    """The scale state of one layer under one recipe (see the module docstring)."""

    def __init__(self, recipe: object) -> None:
        self.recipe = recipe
        self.delayed = bool(getattr(recipe, "delayed", False))
        self.fixed_scale = getattr(recipe, "fixed_scale", None)
        self.margin = int(getattr(recipe, "margin", 0)) if self.delayed else 0
        if self.delayed:
            buffers = scaling_state.new_buffers(recipe.amax_history_len)  # type: ignore[attr-defined]
            self.history = buffers["amax_history"]
            self.stored = buffers["fp8_scale"]
            self.step = buffers["scaling_step"]

    def scale(self, role: str, t2: torch.Tensor, fmt: Format) -> torch.Tensor | None:
        """The scale for quantizing `t2` in `role` now (None: from t2's own amax); records its amax."""
        if self.fixed_scale is not None:
            return torch.full((1, 1), float(self.fixed_scale))
        if not self.delayed:
            return None
        amax_now = scaling_state.raw_amax(t2).cpu()
        scaling_state.record_amax(self.history, role, amax_now)
        i = scaling_state.ROLE_INDEX[role]
        stored = self.stored[i : i + 1]
        return scaling_state.scale_or_current(stored, amax_now, fmt, self.margin).reshape(1, 1)

    def end_pass(self) -> None:
        """One pass done: the delayed-scaling state advances (as after an optimizer step)."""
        if not self.delayed:
            return
        r = self.recipe
        # the arguments LowPrecisionLinear.advance_scaling passes, read from the recipe the same way
        options = {}
        if hasattr(r, "current_while_growing"):
            options["current_while_growing"] = r.current_while_growing
        formats = {role: r.operand(role, False).fmt for role in ROLES}  # type: ignore[attr-defined]
        algo = r.amax_compute_algo  # type: ignore[attr-defined]
        scaling_state.advance_buffers(
            self.history, self.stored, self.step, formats, self.margin, algo, **options
        )


__all__ = ["RecipeScales", "is_quantizing"]
