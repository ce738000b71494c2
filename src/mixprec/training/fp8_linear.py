"""Fp8Linear: an nn.Linear replacement whose three GEMMs all run in FP8 through one autograd.Function.

    layer = Fp8Linear.from_linear(linear, "fp8-delayed", name="model.layers.0.mlp.up_proj")

    output      = input · weightᵀ        scaled_mm(q(X),   q(W))
    grad_input  = grad_output · weight   scaled_mm(q(dY),  q(Wᵀ))
    grad_weight = grad_outputᵀ · input   scaled_mm(q(dYᵀ), q(Xᵀ))

Each operand is quantized as the recipe's gemm_layout says, with scales constant along that GEMM's
K (rowwise, tile and MX recipes re-quantize the transposed operands along their new K, from the
high-precision tensors). Accumulation is fp32 (mixprec.gemm); the output has the input's dtype (the
layer's compute dtype, bf16 usually), grad_weight the weight's dtype, grad_bias is summed in fp32.

Saved for backward: the FP8 payloads the backward GEMMs need, not the high-precision input: for
per-tensor recipes X's forward payload (transposed in backward, same scale), for the others Xᵀ
quantized along the tokens in the forward. The weight is re-quantized in backward when its
transposed layout differs (rowwise, MX) and reused transposed otherwise (per tensor, 128x128).

The parameters are the Linear's own (same objects, same names), so a state_dict holds weight/bias
as nn.Linear's plus, for delayed scaling, the buffers of mixprec.training.scaling_state.

FP4 recipes (kind "fp4": fp4-nvfp4, fp4-mxfp4) run through the same three GEMMs. Operands whose layout
asks for it get the random Hadamard transform along their K first (the wgrad operands dYᵀ and Xᵀ: 16
consecutive tokens mixed by one orthogonal matrix, mixprec.hadamard, from the recipe's seed) and
stochastic rounding (grad_output in both backward GEMMs; mixprec.rounding). The rounding noise is keyed
by (seed, optimizer step, data-parallel rank, tensor): the tensor is the layer's name, the GEMM and
the backward call within the step. The layer keeps its seed and step in the buffer `fp4_state`
(int64 [seed, step]; in the state_dict, hence in every checkpoint), advanced with the optimizer step,
so a resumed run draws the same noise and the same signs as the original.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mixprec.errors import MixprecError
from mixprec.gemm import BACKENDS, scaled_mm, transposable, transpose_quantized, will_emulate, with_decoded
from mixprec.hadamard import rht_matrix, transform_rows
from mixprec.quantization import quantize, quantize_transposed
from mixprec.recipes import (
    GEMMS,
    QUANTIZED_KINDS,
    Fp8Recipe,
    GemmLayout,
    OperandLayout,
    UnscaledFp8,
    from_name,
)
from mixprec.rounding import hash32, stream_key, tensor_id
from mixprec.scaling import Granularity, QuantizedTensor, as_transposed
from mixprec.training import scaling_state
from mixprec.training.weight_cache import cache_of


def _transposable(g: Granularity) -> bool:
    return transposable(g)


def data_parallel_rank() -> int:
    """This process's rank (0 without torch.distributed): one of the four parts of a noise key."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def rounding_key(seed: int, step: int, rank: int, layer: str, gemm: str, role: str, call: int = 1) -> int:
    """The stochastic-rounding noise key of one operand: (seed, optimizer step, rank, tensor), the
    tensor being the layer's name, the GEMM, the role and the backward call within the step (1 for
    the first). The one definition: Fp8Linear and the what-if profile both use it."""
    return stream_key(seed, step, rank, hash32(tensor_id(f"{layer}:{gemm}:{role}") + call))


class _Fp8LinearFunction(torch.autograd.Function):
    """All three GEMMs of a Linear in FP8. Methods are named after the GEMMs."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        layer: Fp8Linear,
        training: bool = True,
    ):
        plan = layer._plan
        x2 = x.reshape(-1, x.shape[-1])
        # under no_grad (evaluation, a reentrant checkpoint's first pass) nothing is kept for a backward
        need_dx, need_dw = training and ctx.needs_input_grad[0], training and ctx.needs_input_grad[1]
        layer._recording = training
        qx = layer._quantize("input", x2, plan["output"].a)
        weight_is_param = weight is layer.weight  # linear_with() passes other weights: never cached
        qw = layer._quantize_weight(weight, plan["output"].b, cached=weight_is_param)
        out = _Fp8LinearFunction.output(qx, qw, bias, x.dtype, layer.backend)

        # what the backward GEMMs need, in FP8
        xt = plan["grad_weight"].b
        qxt = None
        saved_x = _unpack_spec(None)
        if need_dw:
            if _transposable(xt.granularity) and xt.granularity == qx.granularity and xt.fmt == qx.fmt:
                qxt = qx  # transposed in backward (same payload and scale)
                saved_x = _unpack_spec(qx)
            else:
                # Xᵀ quantized on X's own layout; saved untransposed (a saved transposed view of an
                # intermediate breaks torch.compile's autograd.Function tracing), transposed in backward
                qxt = layer._quantize_transposed(x2, xt, transpose=False)
                saved_x = _unpack_spec(qxt, transposed_to=xt.granularity)
        wt = plan["grad_input"].b
        keep_qw = need_dx and _transposable(wt.granularity) and wt.granularity == qw.granularity
        saved_w = _unpack_spec(qw if keep_qw else None)
        ctx.save_for_backward(*saved_x[0], *saved_w[0], weight if need_dx and not keep_qw else None)
        ctx.meta = (saved_x[1], saved_w[1], qxt is qx, weight_is_param)
        ctx.layer = layer
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.w_dtype, ctx.b_dtype = weight.dtype, None if bias is None else bias.dtype
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def output(qx, qw, bias, out_dtype, backend) -> torch.Tensor:
        """output = X · Wᵀ"""
        return scaled_mm(qx, qw, out_dtype=out_dtype, bias=bias, backend=backend)

    @staticmethod
    def grad_input(qdy, qwt, out_dtype, backend) -> torch.Tensor:
        """grad_input = dY · W = scaled_mm(q(dY), q(Wᵀ))"""
        return scaled_mm(qdy, qwt, out_dtype=out_dtype, backend=backend)

    @staticmethod
    def grad_weight(qdyt, qxt, out_dtype, backend) -> torch.Tensor:
        """grad_weight = dYᵀ · X = scaled_mm(q(dYᵀ), q(Xᵀ))"""
        return scaled_mm(qdyt, qxt, out_dtype=out_dtype, backend=backend)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        layer: Fp8Linear = ctx.layer
        layer._recording = True
        plan = layer._plan
        meta_x, meta_w, x_is_forward_payload, weight_is_param = ctx.meta
        saved = list(ctx.saved_tensors)
        qxt = _repack(saved[:3], meta_x) if meta_x is not None else None
        qw = _repack(saved[3:6], meta_w) if meta_w is not None else None
        weight = saved[6]
        dy2 = grad_out.reshape(-1, grad_out.shape[-1])
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if layer._fp4:  # a new noise stream for every backward of the step (FP4's stochastic rounding); FP8
            layer._backward_calls += 1  # layers keep no such state, so torch.compile sees no side effect

        # per-tensor recipes: one dY payload serves both GEMMs (transposed for grad_weight)
        dy_shared = _transposable(plan["grad_weight"].a.granularity)
        qdy = qwt = None
        if need_dx or (need_dw and dy_shared):
            qdy = layer._quantize("grad_output", dy2, plan["grad_input"].a)
        elif need_dw:  # dY's primary quantization is skipped: still record its amax / tell the observer
            layer._record_only("grad_output", dy2, plan["grad_input"].a)
        if need_dx:
            wt = plan["grad_input"].b
            if qw is not None:
                qwt = transpose_quantized(qw)
            else:
                qwt = layer._quantize_weight(weight, wt, cached=weight_is_param, transposed=True)
            if need_dw and dy_shared and will_emulate(qdy, qwt, layer.backend, ctx.x_dtype):
                qdy = with_decoded(qdy)  # decoded once, read by both emulated GEMMs
            grad_x = _Fp8LinearFunction.grad_input(qdy, qwt, ctx.x_dtype, layer.backend).reshape(ctx.x_shape)
        if need_dw:
            if dy_shared:
                qdyt = transpose_quantized(qdy)
            else:  # re-quantized along the tokens (dY's new K) from the high-precision gradient
                qdyt = layer._quantize_transposed(dy2, plan["grad_weight"].a)
            if x_is_forward_payload:
                qxt = transpose_quantized(qxt)
            grad_w = _Fp8LinearFunction.grad_weight(qdyt, qxt, ctx.w_dtype, layer.backend)
        if need_db and ctx.b_dtype is not None:
            grad_b = dy2.sum(dim=0, dtype=torch.float32).to(ctx.b_dtype)
        return grad_x, grad_w, grad_b, None, None


def _unpack_spec(q: QuantizedTensor | None, transposed_to: Granularity | None = None):
    """(tensors to save, meta); transposed_to: rebuild as_transposed(q, transposed_to) in backward."""
    if q is None:
        return (None, None, None), None
    return (q.data, q.scale, q.global_scale), (q.fmt, q.granularity, q.shape, transposed_to)


def _repack(tensors, meta) -> QuantizedTensor:
    fmt, g, shape, transposed_to = meta
    q = QuantizedTensor(tensors[0], tensors[1], fmt, g, shape, tensors[2])
    return q if transposed_to is None else as_transposed(q, transposed_to)


class Fp8Linear(nn.Module):
    """nn.Linear with FP8 GEMMs (forward and both backward GEMMs), per an FP8 recipe.

    Same `weight` [out, in] and `bias` parameters as nn.Linear. Delayed-scaling recipes add the
    buffers `amax_history`, `fp8_scale`, `scaling_step` (see mixprec.training.scaling_state).
    backend: "auto" | "emulated" | "native", passed to mixprec.gemm.scaled_mm.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        recipe: str | Fp8Recipe = "fp8-delayed",
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

    def _setup(self, recipe: str | Fp8Recipe, name: str | None, backend: str) -> None:
        recipe = from_name(recipe)
        if recipe.kind not in QUANTIZED_KINDS:
            raise MixprecError(
                f"Fp8Linear{f' {name}' if name else ''}: recipe {recipe.spec()!r} is not an FP8 recipe nor an FP4 one "
                "(fp8-delayed, fp8-current, fp8-rowwise, fp8-blockwise, fp8-mxfp8, fp4-nvfp4, fp4-mxfp4)"
            )
        if backend not in BACKENDS:
            raise MixprecError(f"unknown GEMM backend {backend!r}; valid: {', '.join(BACKENDS)}")
        self.recipe: Fp8Recipe = recipe
        self.layer_name = name
        self.backend = backend
        self._plan: dict[str, GemmLayout] = {g: recipe.gemm_layout(g) for g in GEMMS}
        self._observer = None
        self._unscaled = isinstance(recipe, UnscaledFp8)
        self._delayed = bool(recipe.delayed)
        self._recording = True  # delayed scaling: record amax (off for forwards without grad)
        # the FP8 weight casts are cached while the weight is unchanged (micro-batches of one optimizer
        # step, activation-checkpointing recomputes): see _quantize_weight
        self.cache_weight_casts = True
        self._weight_generation = 0  # bumped by advance_scaling(): once per optimizer step
        if self._delayed:
            for key, buf in scaling_state.new_buffers(recipe.amax_history_len, self.weight.device).items():
                self.register_buffer(key, buf)
        self._fp4 = recipe.kind == "fp4"
        self._backward_calls = 0  # backward passes through this layer in the current optimizer step
        if self._fp4:  # [seed, optimizer step]: the noise and RHT state, checkpointed with the weights
            state = torch.tensor([recipe.seed, 0], dtype=torch.int64, device=self.weight.device)
            self.register_buffer("fp4_state", state)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, recipe: str | Fp8Recipe, name: str | None = None, *, backend: str = "auto"
    ) -> Fp8Linear:
        """The FP8 layer for `linear`, sharing its parameter objects (optimizer references stay valid)."""
        if not isinstance(linear, nn.Linear):
            raise MixprecError(
                f"Fp8Linear.from_linear{f' ({name})' if name else ''}: expected nn.Linear, got {type(linear).__name__}"
            )
        if not linear.weight.is_floating_point():
            raise MixprecError(
                f"Fp8Linear.from_linear{f' ({name})' if name else ''}: weight is {linear.weight.dtype}, not floating point"
            )
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

    # -- forward --------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise MixprecError(
                f"Fp8Linear{f' {self.layer_name}' if self.layer_name else ''}: input has {x.shape[-1]} features, "
                f"expected {self.in_features}"
            )
        return _Fp8LinearFunction.apply(x, self.weight, self.bias, self, torch.is_grad_enabled())

    def linear_with(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """This layer's FP8 GEMMs (recipe, scaling state, observer) on a weight passed in, e.g. one
        expert's slice of a fused 3-D parameter; gradients flow to that weight."""
        return _Fp8LinearFunction.apply(x, weight, bias, self, torch.is_grad_enabled())

    def _scale(self, role: str, t2: torch.Tensor, op: OperandLayout) -> torch.Tensor | None:
        """The scale to use for a role's quantization (None: from this tensor's own amax)."""
        if self._unscaled:
            return torch.ones(1, 1, device=t2.device)
        if not self._delayed:
            return None
        amax_now = None
        if self._recording:  # forwards without grad (evaluation) leave the training history alone
            amax_now = scaling_state.raw_amax(t2)
            scaling_state.record_amax(self.amax_history, role, amax_now)
        return self._delayed_scale(role, t2, op, amax_now)

    def _delayed_scale(
        self, role: str, t2: torch.Tensor, op: OperandLayout, amax_now: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The role's scale from the history, or this tensor's own (as current scaling) while the role has
        none yet: before the first advance, or when it never recorded a usable amax (fp8_scale 0, see
        scaling_state). A new tensor, [1, 1]: it is saved for backward, so never a view of the buffer."""
        i = scaling_state.ROLE_INDEX[role]
        if amax_now is None:
            amax_now = scaling_state.raw_amax(t2)
        stored = self.fp8_scale[i : i + 1]
        return scaling_state.scale_or_current(stored, amax_now, op.fmt, self.recipe.margin).reshape(1, 1)

    def _quantize(
        self, role: str, t2: torch.Tensor, op: OperandLayout, observe: bool = True
    ) -> QuantizedTensor:
        scale = self._scale(role, t2, op)
        margin = self.recipe.margin if self._delayed else 0
        q = quantize(
            t2, op.fmt, op.granularity, scale=scale, margin=margin, power_of_two=op.power_of_two,
            validate_scale=False, rounding_key=self._rounding_key(op, "grad_input"),
        )  # fmt: skip
        if observe and self._observer is not None:
            self._observer(self.layer_name, role, t2.detach(), q.effective_scale(), op.fmt)
        return q

    def _quantize_weight(
        self, weight: torch.Tensor, op: OperandLayout, *, cached: bool, transposed: bool = False
    ) -> QuantizedTensor:
        """W for the forward GEMM, or Wᵀ re-quantized for grad_input (transposed=True), reused from the
        layer's weight-cast cache while the parameter is provably unchanged.

        The cache key (mixprec.training.weight_cache) holds the parameter's storage and _version, any
        torch optimizer step in the process, this layer's _weight_generation (advance_scaling, once per
        optimizer step), the delayed-scaling scale buffer's version, and everything else the cast
        depends on. Delayed scaling records the weight's amax at the first cast of a step (recording
        is a max, so skipping it for the same weight later in the step changes nothing); a cast made
        while not recording (a no-grad forward) is not reused by a recording one.
        """
        if transposed:
            compute = lambda: self._quantize_transposed(weight, op)  # noqa: E731
        else:
            compute = lambda: self._quantize("weight", weight, op, observe=False)  # noqa: E731
        if not (cached and self.cache_weight_casts):
            q = compute()
        else:
            scale_key = None
            if self._delayed:
                i = scaling_state.ROLE_INDEX["weight"]
                scale_key = self.fp8_scale[i : i + 1]  # a view: the buffer's storage and version
            margin = self.recipe.margin if self._delayed else 0
            recording = self._delayed and self._recording and not transposed
            extra = (op.fmt.name, op.granularity, margin, op.power_of_two, recording)
            q = cache_of(self).get(
                "weight_t" if transposed else "weight",
                weight,
                compute,
                step=self._weight_generation,
                extra=extra,
                scale=scale_key,
            )
        if not transposed and self._observer is not None:
            self._observer(self.layer_name, "weight", weight.detach(), q.effective_scale(), op.fmt)
        return q

    def _record_only(self, role: str, t2: torch.Tensor, op: OperandLayout) -> None:
        """Record amax / notify the observer for a role whose primary quantization is skipped."""
        if self._delayed or self._observer is not None:
            self._quantize(role, t2, op)

    def _quantize_transposed(
        self, t2: torch.Tensor, op: OperandLayout, transpose: bool = True
    ) -> QuantizedTensor:
        """The transposed operand, re-quantized along its new K from the high-precision tensor
        (transpose=False: left on t2's layout, with op.granularity.transposed(); see scaling.as_transposed)."""
        scale = None
        if self._unscaled:
            scale = torch.ones(1, 1, device=t2.device)
        elif self._delayed:
            scale = self._delayed_scale(op.role, t2, op)
        margin = self.recipe.margin if self._delayed else 0
        if op.hadamard:  # mixes every 16 consecutive rows of t2: the K of the transposed operand
            t2 = transform_rows(t2, self._rht_matrix(t2.device))
        key = self._rounding_key(op, "grad_weight")
        if not transpose:
            g = op.granularity.transposed()
            return quantize(
                t2, op.fmt, g, scale=scale, margin=margin, power_of_two=op.power_of_two, validate_scale=False,
                rounding_key=key,
            )  # fmt: skip
        return quantize_transposed(
            t2, op.fmt, op.granularity, scale=scale, margin=margin, power_of_two=op.power_of_two,
            validate_scale=False, rounding_key=key,
        )  # fmt: skip

    # -- FP4: stochastic rounding and the Hadamard transform ------------------------------------------

    def _rounding_key(self, op: OperandLayout, gemm: str) -> int | None:
        """The noise key of this operand's stochastic rounding now (None: round to nearest even):
        (seed, step) from fp4_state, this process's data-parallel rank, and the tensor — the layer,
        the GEMM and which backward of the step it is."""
        if not op.stochastic:
            return None
        seed, step = (int(v) for v in self.fp4_state.tolist())
        return rounding_key(
            seed, step, data_parallel_rank(), self.layer_name or "", gemm, op.role, self._backward_calls
        )

    def _rht_matrix(self, device: torch.device) -> torch.Tensor:
        """The 16x16 random Hadamard matrix of the seed in fp4_state (the same on every rank)."""
        seed = int(self.fp4_state[0])
        cached = getattr(self, "_rht_cache", None)
        if cached is None or cached[0] != seed or cached[1].device != device:
            cached = (seed, rht_matrix(seed).to(device))
            self._rht_cache = cached
        return cached[1]

    # -- delayed-scaling state ------------------------------------------------------------------------

    @torch.no_grad()
    def advance_scaling(self) -> bool:
        """One optimizer step of the delayed-scaling state; False (no scaling state) for other recipes.

        For every recipe it also ends the step's weight-cast cache: the optimizer has changed the weight."""
        self._weight_generation += 1
        cache_of(self).invalidate()  # frees the stale FP8 weights now (the key would miss anyway)
        self._backward_calls = 0
        if self._fp4:
            self.fp4_state[1] += 1  # the next step's rounding noise
        if not self._delayed:
            return False
        r = self.recipe
        scaling_state.advance_buffers(
            self.amax_history, self.fp8_scale, self.scaling_step, r.formats(), r.margin, r.amax_compute_algo,
            current_while_growing=r.current_while_growing,
        )  # fmt: skip
        return True

    def amax_tensors_for_reduction(self) -> list[torch.Tensor]:
        """The tensors data-parallel ranks must all_reduce(MAX) before advance: this step's amax row."""
        return [self.amax_history[0]] if self._delayed else []

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._weight_generation += 1
        cache_of(self).invalidate()
        if self._delayed and int(self.scaling_step) == 0:
            # checkpoints written before 0 meant "no scale yet" hold placeholder scales of 1 before the
            # first advance: before an advance there is no scale
            self.fp8_scale.zero_()

    # -- monitor observer protocol --------------------------------------------------------------------

    def set_precision_observer(self, observer) -> None:
        """observer(layer_name, role, tensor_hp, scale, fmt) per quantized tensor, or None (zero cost)."""
        self._observer = observer

    def precision_layout(self) -> dict[str, Granularity]:
        """role -> granularity of the role's observed quantization (input/weight: forward GEMM,
        grad_output: grad_input GEMM), in the tensor's own 2-D orientation."""
        return self.recipe.precision_layout()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"recipe={self.recipe.spec()}, backend={self.backend}"
        )


__all__ = ["Fp8Linear", "data_parallel_rank", "rounding_key"]
