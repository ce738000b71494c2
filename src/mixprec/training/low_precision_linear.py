"""LowPrecisionLinear: an nn.Linear replacement whose three GEMMs run in FP8 or FP4, per a recipe.

    layer = LowPrecisionLinear.from_linear(linear, "fp8-delayed", name="model.layers.0.mlp.up_proj")

The GEMMs are one autograd.Function (mixprec.training.linear_gemms.LinearGemms) that receives this
layer's quantizer state (mixprec.training.quantizer_state.QuantizerState: recipe plan, scale state,
weight-cast cache, rounding keys, observer, backend), never the layer. The layer keeps what a module
keeps: the parameters (the Linear's own, same objects and names, so a state_dict holds weight/bias as
nn.Linear's), the buffers, and the hooks of the training step and the precision monitor.

Buffers: delayed-scaling recipes add `amax_history`, `fp8_scale`, `scaling_step`
(mixprec.training.scaling_state); FP4 recipes (fp4-nvfp4, fp4-mxfp4) add `fp4_state` (int64 [seed,
optimizer step]: the seed of the Hadamard signs and the rounding noise and the step it is keyed by; in
the state_dict, hence in every checkpoint, advanced with the optimizer step, so a resumed run draws the
same noise and the same signs as the original).

`Fp8Linear` is the old name of this class, kept as a deprecated alias for one release
(`mixprec.training.Fp8Linear`); it is removed in the next release.
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.gemm import BACKENDS
from mixprec.recipes import QUANTIZED_KINDS, QuantizedRecipe, from_name
from mixprec.scaling import Granularity
from mixprec.training.linear_gemms import LinearGemms
from mixprec.training.quantizer_state import Observer, QuantizerState, recipe_buffers
from mixprec.training.weight_cache import cache_of


class LowPrecisionLinear(nn.Module):
    """nn.Linear with quantized GEMMs (forward and both backward GEMMs), per an FP8 or FP4 recipe.

    Same `weight` [out, in] and `bias` parameters as nn.Linear, plus the recipe's buffers (see the
    module docstring). backend: "auto" | "emulated" | "native", passed to mixprec.gemm.scaled_mm.
    cache_weight_casts: reuse the weight's casts while it is unchanged (micro-batches of one optimizer
    step, activation-checkpointing recomputes; mixprec.training.weight_cache).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        recipe: str | QuantizedRecipe = "fp8-delayed",
        *,
        name: str | None = None,
        backend: str = "auto",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.register_parameter(
            "bias", nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        )
        self._setup(recipe, name, backend)
        nn.Linear.reset_parameters(self)  # type: ignore[arg-type]

    def _setup(self, recipe: str | QuantizedRecipe, name: str | None, backend: str) -> None:
        recipe = from_name(recipe)
        if recipe.kind not in QUANTIZED_KINDS:
            raise MixprecError(
                f"LowPrecisionLinear{f' {name}' if name else ''}: recipe {recipe.spec()!r} is not an FP8 "
                "recipe nor an FP4 one (fp8-delayed, fp8-current, fp8-rowwise, fp8-blockwise, fp8-mxfp8, fp4-nvfp4, "
                "fp4-mxfp4)"
            )
        if backend not in BACKENDS:
            raise MixprecError(f"unknown GEMM backend {backend!r}; valid: {', '.join(BACKENDS)}")
        for key, buf in recipe_buffers(recipe, self.weight.device).items():
            self.register_buffer(key, buf)
        self.cache_weight_casts = True
        self.quantizer = QuantizerState(
            recipe, layer_name=name, backend=backend, buffers=self._buffers, weight_cache=cache_of(self)
        )

    @property
    def recipe(self) -> QuantizedRecipe:
        return self.quantizer.recipe

    @property
    def layer_name(self) -> str | None:
        return self.quantizer.layer_name

    @property
    def backend(self) -> str:
        return self.quantizer.backend

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        recipe: str | QuantizedRecipe,
        name: str | None = None,
        *,
        backend: str = "auto",
    ) -> LowPrecisionLinear:
        """The quantized layer for `linear`, sharing its parameter objects (optimizer references stay
        valid)."""
        where = f"LowPrecisionLinear.from_linear{f' ({name})' if name else ''}"
        if not isinstance(linear, nn.Linear):
            raise MixprecError(f"{where}: expected nn.Linear, got {type(linear).__name__}")
        if not linear.weight.is_floating_point():
            raise MixprecError(f"{where}: weight is {linear.weight.dtype}, not floating point")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.register_parameter("weight", linear.weight)
        new.register_parameter("bias", linear.bias)
        new._setup(recipe, name, backend)
        new.train(linear.training)
        return new

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear holding the same parameter objects (the scaling state is dropped)."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight = self.weight
        lin.bias = self.bias
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise MixprecError(
                f"LowPrecisionLinear{f' {self.layer_name}' if self.layer_name else ''}: input has "
                f"{x.shape[-1]} features, expected {self.in_features}"
            )
        return self.linear_with(x, self.weight, self.bias)

    def linear_with(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """This layer's quantized GEMMs (recipe, scaling state, observer) on a weight passed in, e.g. one
        expert's slice of a fused 3-D parameter; gradients flow to that weight. Only the layer's own
        parameter has its casts cached."""
        cache_weight = self.cache_weight_casts and weight is self.weight
        return LinearGemms.apply(x, weight, bias, self.quantizer, torch.is_grad_enabled(), cache_weight)

    @torch.no_grad()
    def advance_scaling(self) -> bool:
        """One optimizer step of the delayed-scaling state; False (no scaling state) for other recipes.

        For every recipe it also ends the step's weight-cast cache (the optimizer has changed the weight)
        and, for FP4, moves the rounding noise to the next step."""
        return self.quantizer.advance()

    def amax_tensors_for_reduction(self) -> list[torch.Tensor]:
        """The tensors data-parallel ranks must all_reduce(MAX) before advance: this step's amax row."""
        return self.quantizer.scales.amax_rows()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.quantizer.after_load()

    def set_precision_observer(self, observer: Observer | None) -> None:
        """observer(layer_name, role, tensor_hp, scale, fmt) per quantized tensor, or None (zero cost)."""
        self.quantizer.observer = observer

    def precision_layout(self) -> dict[str, Granularity]:
        """role -> granularity of the role's observed quantization (input/weight: forward GEMM,
        grad_output: grad_input GEMM), in the tensor's own 2-D orientation."""
        return self.recipe.precision_layout()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"recipe={self.recipe.spec()}, backend={self.backend}"
        )


__all__ = ["LowPrecisionLinear"]
