"""What the training GEMMs need to quantize one layer's tensors: the quantizer state.

The autograd Function of mixprec.training.linear_gemms receives a QuantizerState, never the layer. The
layer (mixprec.training.low_precision_linear) keeps parameters, buffers and hooks, builds its state once
and hands it to every call. The state holds:

    plan      the recipe's operand layouts per GEMM, and which backward operands are a forward payload
              transposed (RecipePlan)
    scales    delayed-scaling amax history and scales, current or unscaled scaling (ScaleState)
    rounding  the stochastic-rounding keys and the Hadamard matrix of FP4 recipes (RoundingKeys:
              seed, optimizer step, data-parallel rank, layer name)
    weight cache, observer (the precision monitor's hook), backend (mixprec.gemm.scaled_mm's)

Everything a forward or backward changes (amax rows, the backward count, the weight-cast cache) goes
through the state's methods. The delayed-scaling and FP4 buffers stay the layer's (state_dict,
checkpoints, .to()): the state reads them through the layer's buffer table, the same dict object
across .to(), load_state_dict and deepcopy, so it always sees the tensors the layer holds now.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mixprec import ranks
from mixprec.gemm import transposable
from mixprec.hadamard import rht_matrix, transform_rows
from mixprec.quantization import quantize
from mixprec.recipes import GemmLayout, OperandLayout, QuantizedRecipe, UnscaledFp8
from mixprec.rounding import hash32, stream_key, tensor_id
from mixprec.scaling import QuantizedTensor
from mixprec.training import scaling_state
from mixprec.training.weight_cache import WeightCastCache

Observer = Callable[[str | None, str, torch.Tensor, torch.Tensor, object], None]


def rounding_key(seed: int, step: int, rank: int, layer: str, gemm: str, role: str, call: int = 1) -> int:
    """The stochastic-rounding noise key of one operand: (seed, optimizer step, rank, tensor), the
    tensor being the layer's name, the GEMM, the role and the backward call within the step (1 for
    the first). The one definition: the training layer and the what-if profile both use it."""
    return stream_key(seed, step, rank, hash32(tensor_id(f"{layer}:{gemm}:{role}") + call))


def recipe_buffers(recipe: QuantizedRecipe, device=None) -> dict[str, torch.Tensor]:
    """The buffers a layer under `recipe` keeps in its state_dict: delayed scaling's amax history and
    scales (mixprec.training.scaling_state), FP4's [seed, optimizer step] (`fp4_state`), else none."""
    if recipe.delayed:
        return scaling_state.new_buffers(recipe.amax_history_len, device)
    if recipe.kind == "fp4":
        return {"fp4_state": torch.tensor([recipe.seed, 0], dtype=torch.int64, device=device)}
    return {}


@dataclass(frozen=True)
class RecipePlan:
    """A recipe's operand layouts for the three GEMMs of a Linear (see mixprec.recipes)."""

    output: GemmLayout  # X · Wᵀ
    grad_input: GemmLayout  # dY · W, its b operand Wᵀ
    grad_weight: GemmLayout  # dYᵀ · X, its operands dYᵀ and Xᵀ

    @classmethod
    def of(cls, recipe: QuantizedRecipe) -> RecipePlan:
        return cls(*(recipe.gemm_layout(gemm) for gemm in ("output", "grad_input", "grad_weight")))

    def transposes_forward_payload(self, role: str) -> bool:
        """Whether the backward's transposed operand of `role` is its first quantization transposed
        (same payload and scales: per-tensor and square-block scales do not change under
        transposition), so that no second quantization is needed."""
        first, transposed = {
            "input": (self.output.a, self.grad_weight.b),
            "weight": (self.output.b, self.grad_input.b),
            "grad_output": (self.grad_input.a, self.grad_weight.a),
        }[role]
        return (
            transposable(transposed.granularity)
            and transposed.granularity == first.granularity
            and transposed.fmt == first.fmt
        )


class ScaleState:
    """The scale of each quantization: from the amax history (delayed scaling, the layer's buffers
    of mixprec.training.scaling_state), 1 (the unscaled negative control), or None (the tensor's own
    amax: current scaling and every block-scaled recipe)."""

    def __init__(self, recipe: QuantizedRecipe, buffers: dict[str, torch.Tensor | None]) -> None:
        self.recipe = recipe
        self.delayed = bool(recipe.delayed)
        self.unscaled = isinstance(recipe, UnscaledFp8)
        self.buffers = buffers  # the layer's buffer table: amax_history, fp8_scale, scaling_step

    @property
    def margin(self) -> int:
        return self.recipe.margin if self.delayed else 0

    def scale(
        self, role: str, t2: torch.Tensor, op: OperandLayout, *, recording: bool
    ) -> torch.Tensor | None:
        """The scale of a role's first quantization; with recording, this step's amax row takes t2's amax
        (forwards without grad, evaluation, leave the training history alone)."""
        if self.unscaled:
            return torch.ones(1, 1, device=t2.device)
        if not self.delayed:
            return None
        amax_now = None
        if recording:
            amax_now = scaling_state.raw_amax(t2)
            scaling_state.record_amax(self.buffers["amax_history"], role, amax_now)
        return self.delayed_scale(role, t2, op, amax_now)

    def scale_without_recording(self, t2: torch.Tensor, op: OperandLayout) -> torch.Tensor | None:
        """The scale of a second quantization of a role (its transposed operand): its amax is recorded
        by the first."""
        if self.unscaled:
            return torch.ones(1, 1, device=t2.device)
        return self.delayed_scale(op.role, t2, op) if self.delayed else None

    def delayed_scale(
        self, role: str, t2: torch.Tensor, op: OperandLayout, amax_now: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The role's scale from the history, or this tensor's own (as current scaling) while the role has
        none yet: before the first advance, or when it never recorded a usable amax (fp8_scale 0, see
        scaling_state). A new tensor, [1, 1]: it is saved for backward, so never a view of the buffer."""
        i = scaling_state.ROLE_INDEX[role]
        if amax_now is None:
            amax_now = scaling_state.raw_amax(t2)
        stored = self.buffers["fp8_scale"][i : i + 1]
        return scaling_state.scale_or_current(stored, amax_now, op.fmt, self.recipe.margin).reshape(1, 1)

    def weight_scale_view(self) -> torch.Tensor | None:
        """The weight's stored scale as a view of the buffer (its storage and version key the weight
        cache, so a changed scale misses); None without delayed scaling."""
        if not self.delayed:
            return None
        i = scaling_state.ROLE_INDEX["weight"]
        return self.buffers["fp8_scale"][i : i + 1]

    def advance(self) -> bool:
        """One optimizer step of the delayed-scaling buffers; False when there are none."""
        if not self.delayed:
            return False
        r, b = self.recipe, self.buffers
        scaling_state.advance_buffers(
            b["amax_history"], b["fp8_scale"], b["scaling_step"], r.formats(), r.margin, r.amax_compute_algo,
            current_while_growing=r.current_while_growing,
        )  # fmt: skip
        return True

    def after_load(self) -> None:
        if self.delayed and int(self.buffers["scaling_step"]) == 0:
            # checkpoints written before 0 meant "no scale yet" hold placeholder scales of 1 before the
            # first advance: before an advance there is no scale
            self.buffers["fp8_scale"].zero_()

    def amax_rows(self) -> list[torch.Tensor]:
        return [self.buffers["amax_history"][0]] if self.delayed else []


class RoundingKeys:
    """FP4's stochastic rounding and Hadamard transform: the noise key of each operand is (seed, optimizer
    step, data-parallel rank, tensor), the tensor being the layer's name, the GEMM, the role and which
    backward of the step it is. Seed and step live in the layer's buffer `fp4_state` (int64 [seed,
    step], in every checkpoint), so a resumed run draws the same noise and the same signs."""

    def __init__(self, layer_name: str | None, buffers: dict[str, torch.Tensor | None], fp4: bool) -> None:
        self.layer_name = layer_name
        self.buffers = buffers
        self.fp4 = fp4
        self.backward_calls = 0  # backward passes through the layer in the current optimizer step
        self.rht_cache: tuple[int, torch.Tensor] | None = None

    def begin_backward(self) -> None:
        """A new noise stream for every backward of the step. FP8 layers keep no such state, so
        torch.compile sees no side effect."""
        if self.fp4:
            self.backward_calls += 1

    def key(self, op: OperandLayout, gemm: str) -> int | None:
        """The noise key of this operand's stochastic rounding now (None: round to nearest even)."""
        if not op.stochastic:
            return None
        seed, step = (int(v) for v in self.buffers["fp4_state"].tolist())
        return rounding_key(
            seed, step, ranks.rank(), self.layer_name or "", gemm, op.role, self.backward_calls
        )

    def rht_matrix(self, device: torch.device) -> torch.Tensor:
        """The 16x16 random Hadamard matrix of the seed in fp4_state (the same on every rank)."""
        seed = int(self.buffers["fp4_state"][0])
        cached = self.rht_cache
        if cached is None or cached[0] != seed or cached[1].device != device:
            cached = (seed, rht_matrix(seed).to(device))
            self.rht_cache = cached
        return cached[1]

    @torch.no_grad()
    def next_step(self) -> None:
        self.backward_calls = 0
        if self.fp4:
            self.buffers["fp4_state"][1] += 1  # the next step's rounding noise


class QuantizerState:
    """One layer's quantizers for the three GEMMs (see the module docstring)."""

    def __init__(
        self,
        recipe: QuantizedRecipe,
        *,
        layer_name: str | None,
        backend: str,
        buffers: dict[str, torch.Tensor | None],
        weight_cache: WeightCastCache,
    ) -> None:
        self.recipe = recipe
        self.plan = RecipePlan.of(recipe)
        self.backend = backend
        self.layer_name = layer_name
        self.scales = ScaleState(recipe, buffers)
        self.rounding = RoundingKeys(layer_name, buffers, recipe.kind == "fp4")
        self.weight_cache = weight_cache
        self.weight_generation = 0  # once per optimizer step (advance) and per load: a weight-cache key
        self.observer: Observer | None = None

    def quantize(
        self, role: str, t2: torch.Tensor, op: OperandLayout, *, recording: bool, observe: bool = True
    ) -> QuantizedTensor:
        """A role's first quantization (X and W for the forward GEMM, dY for grad_input), on t2 as it lies."""
        scale = self.scales.scale(role, t2, op, recording=recording)
        q = quantize(
            t2, op.fmt, op.granularity, scale=scale, margin=self.scales.margin, power_of_two=op.power_of_two,
            validate_scale=False, rounding_key=self.rounding.key(op, "grad_input"),
        )  # fmt: skip
        if observe:
            self.observe(role, t2, q, op)
        return q

    def quantize_for_transposed(self, t2: torch.Tensor, op: OperandLayout) -> QuantizedTensor:
        """The transposed operand `op` (Wᵀ, dYᵀ, Xᵀ), re-quantized along its K from the high-precision
        tensor, on t2's own layout: blocked as op.granularity.transposed(), for linear_gemms.transposed.
        FP4 operands that ask for it get the Hadamard transform along that K first."""
        scale = self.scales.scale_without_recording(t2, op)
        if op.hadamard:  # mixes every 16 consecutive rows of t2: the K of the transposed operand
            t2 = transform_rows(t2, self.rounding.rht_matrix(t2.device))
        key = self.rounding.key(op, "grad_weight")
        return quantize(
            t2, op.fmt, op.granularity.transposed(), scale=scale, margin=self.scales.margin,
            power_of_two=op.power_of_two, validate_scale=False, rounding_key=key,
        )  # fmt: skip

    def quantize_weight(
        self,
        weight: torch.Tensor,
        op: OperandLayout,
        *,
        recording: bool,
        cached: bool,
        for_transposed: bool = False,
    ) -> QuantizedTensor:
        """W for the forward GEMM, or W for Wᵀ (for_transposed: as quantize_for_transposed), reused from
        the weight-cast cache while the parameter is provably unchanged (cached: the layer's own
        parameter with caching on).

        The cache key (mixprec.training.weight_cache) holds the parameter's storage and _version, any
        torch optimizer step in the process, weight_generation (once per optimizer step), the
        delayed-scaling scale buffer's version, and everything else the cast depends on. Delayed
        scaling records the weight's amax at the first cast of a step (recording is a max, so skipping
        it for the same weight later in the step changes nothing); a cast made while not recording (a
        no-grad forward) is not reused by a recording one.
        """
        if for_transposed:
            compute = lambda: self.quantize_for_transposed(weight, op)  # noqa: E731
        else:
            compute = lambda: self.quantize(  # noqa: E731
                "weight", weight, op, recording=recording, observe=False
            )
        if not cached:
            q = compute()
        else:
            records = self.scales.delayed and recording and not for_transposed
            q = self.weight_cache.get(
                "weight_t" if for_transposed else "weight",
                weight,
                compute,
                step=self.weight_generation,
                extra=(op.fmt.name, op.granularity, self.scales.margin, op.power_of_two, records),
                scale=self.scales.weight_scale_view(),
            )
        if not for_transposed:
            self.observe("weight", weight, q, op)
        return q

    def record_only(self, role: str, t2: torch.Tensor, op: OperandLayout) -> None:
        """Record amax / notify the observer for a role whose first quantization is not needed."""
        if self.scales.delayed or self.observer is not None:
            self.quantize(role, t2, op, recording=True)

    def observe(self, role: str, t2: torch.Tensor, q: QuantizedTensor, op: OperandLayout) -> None:
        if self.observer is not None:
            self.observer(self.layer_name, role, t2.detach(), q.effective_scale(), op.fmt)

    def begin_backward(self) -> None:
        self.rounding.begin_backward()

    def weights_changed(self) -> None:
        """The weight may differ from every cached cast (an optimizer step, a load): drop them now."""
        self.weight_generation += 1
        self.weight_cache.invalidate()

    @torch.no_grad()
    def advance(self) -> bool:
        """One optimizer step: the weight-cast cache ends, FP4's noise moves to the next step, the
        delayed-scaling state advances (False: the recipe has none)."""
        self.weights_changed()
        self.rounding.next_step()
        return self.scales.advance()

    def after_load(self) -> None:
        self.weights_changed()
        self.scales.after_load()


__all__ = [
    "Observer",
    "QuantizerState",
    "RecipePlan",
    "RoundingKeys",
    "ScaleState",
    "recipe_buffers",
    "rounding_key",
]
