"""The inference Linear: FP8 E4M3 weight + scales, inputs quantized per call (dynamic) or with a
static per-tensor scale, and the GEMM through the shared seam `mixprec.gemm.scaled_mm`.

It keeps exactly what a compressed-tensors checkpoint stores (`weight` payload, `weight_scale`,
`input_scale`), as buffers named like the checkpoint tensors, so `state_dict()` round-trips.

Casting the model (`.to(dtype)`, `.half()`, `.bfloat16()`, `.float()`) changes the compute and output
dtype only: the FP8 payload and its float32 scales are the quantized model and keep their dtypes and
bits (`_apply`); device moves move them.

A bf16 model's layers run the bf16 forward (runtime/bf16_forward.py) where the CPU has native bf16
GEMMs: the weight decoded exactly to bf16, one bf16 GEMM, the scales in an fp32 epilogue. The decoded
weight is kept after its first use (`decoded_cache`, on by default: a plain tensor attribute, so every
count of the model's tensors — evaluate's "weights in memory" — includes it) or decoded per call
(`decoded_cache = False`, or `set_decoded_cache(model, False)`, which also drops the caches held).
`bf16_gemm`: "auto" (native bf16 CPUs), "always" (tests, any CPU) or "never" (the fp32 emulation).
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.formats import E4M3, pack_nibbles, pow2, unpack_nibbles
from mixprec.gemm import scaled_mm
from mixprec.inference.checkpoint.layout import (
    INPUT_GLOBAL_SCALE,
    INPUT_SCALE,
    WEIGHT,
    WEIGHT_GLOBAL_SCALE,
    WEIGHT_PACKED,
    WEIGHT_SCALE,
)
from mixprec.inference.runtime.bf16_forward import (
    BF16_MODES,
    cpu_bf16_native,
    e2m1_block_weight_bf16,
    e4m3_to_bf16,
    e4m3_to_bf16_unscaled,
    folded,
    scaled_bf16_linear,
    takes_bf16_path,
)
from mixprec.inference.runtime.gradients import QuantizedLinearFunction
from mixprec.inference.schemes import InferenceScheme, quantize_weight
from mixprec.quantization import quantize
from mixprec.scaling import Granularity, QuantizedTensor, expand_scale


class QuantizedLinear(nn.Module):
    """y = x Wᵀ + b with W stored in FP8 and x quantized to FP8 on the fly. The payloads are frozen; an
    input that requires a gradient gets one (runtime/gradients.py), so adapters and earlier layers train."""

    def __init__(
        self,
        weight: QuantizedTensor,
        bias: torch.Tensor | None,
        scheme: InferenceScheme,
        *,
        input_scale: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        out_features, in_features = weight.shape
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.scheme = scheme
        self.out_dtype = out_dtype  # the original Linear's dtype: outputs come back in it
        self.weight_granularity: Granularity = weight.granularity
        self.register_buffer(WEIGHT, weight.data)
        self.register_buffer(WEIGHT_SCALE, weight.scale.float())
        self.register_buffer(INPUT_SCALE, None if input_scale is None else input_scale.float().reshape(1, 1))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(out_dtype), requires_grad=False)
        self._observer = None
        self._observer_name: str | None = None
        self._init_bf16_forward()

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        scheme: InferenceScheme,
        *,
        input_scale: torch.Tensor | None = None,
        weight_scale: torch.Tensor | None = None,
        name: str = "weight",
    ) -> QuantizedLinear:
        """The Linear quantized for `scheme` (block-format schemes give a BlockQuantizedLinear, whose
        input_scale is the NVFP4 input global scale)."""
        q, _ = quantize_weight(linear.weight.detach(), scheme, name=name, scale=weight_scale)
        return quantized_linear(
            q, linear.bias, scheme, input_scale=input_scale, out_dtype=linear.weight.dtype
        )

    # ---- casts and moves -------------------------------------------------------------------------
    _QUANTIZED_BUFFERS = (WEIGHT, WEIGHT_SCALE, INPUT_SCALE)
    _OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

    def _apply(self, fn, recurse=True):
        """`nn.Module.to/half/float/cuda/...` end here: they hand every floating tensor to `fn`, which
        would upcast the float8 payload (and round the scales). Where `fn` sends a tensor of the output
        dtype says the target device and compute dtype; payload and scales only move to that device."""
        device = next(t.device for k in self._QUANTIZED_BUFFERS if (t := self._buffers.get(k)) is not None)
        probe = fn(torch.empty(0, dtype=self.out_dtype, device=device))
        kept = {k: self._buffers[k] for k in self._QUANTIZED_BUFFERS}
        for k in kept:
            self._buffers[k] = None  # nn.Module._apply skips None buffers
        try:
            super()._apply(fn, recurse)  # the bias and anything else follow the cast as usual
        finally:
            for k, t in kept.items():
                self._buffers[k] = None if t is None else t.to(device=probe.device)
        if probe.dtype in self._OUT_DTYPES:
            self.out_dtype = probe.dtype
        self.decoded_weight = None  # decoded again on its new device when next used
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        self.decoded_weight = None  # the payload changes: its decoded copy is stale
        super()._load_from_state_dict(*args, **kwargs)

    # ---- the bf16 forward and its decoded-weight cache ------------------------------------------
    def _init_bf16_forward(self) -> None:
        self.bf16_gemm = "auto"
        self.decoded_cache = True
        self.decoded_weight: torch.Tensor | None = None  # a plain attribute: counted as model memory
        cpu_bf16_native()  # detect() now, eagerly: never inside a torch.compile trace

    def _bf16_weight_values(self) -> torch.Tensor:
        """The weight's exact values in bf16 (the E4M3 payload; see bf16_forward)."""
        return e4m3_to_bf16(self.weight)

    def bf16_weight(self) -> torch.Tensor:
        """The weight decoded to bf16 for the bf16 GEMM: the cached copy, else decoded now (and kept
        when decoded_cache is on; never stored from inside a torch.compile trace)."""
        if self.decoded_weight is not None:
            return self.decoded_weight
        w = self._bf16_weight_values()
        if self.decoded_cache and not torch.compiler.is_compiling():
            self.decoded_weight = w
        return w

    def _takes_bf16_path(self, x2: torch.Tensor) -> bool:
        if self.bf16_gemm not in BF16_MODES:
            raise MixprecError(f"bf16_gemm must be one of {', '.join(BF16_MODES)}, got {self.bf16_gemm!r}")
        # scales constant along K on both operands: they can multiply the GEMM's sums afterwards
        k_uniform = self.weight_granularity.block_cols is None and self.input_granularity.block_cols is None
        return k_uniform and takes_bf16_path(self.bf16_gemm, x2.device, self.out_dtype)

    def _forward_bf16(self, x2: torch.Tensor) -> tuple[torch.Tensor, QuantizedTensor]:
        xq = quantize(x2, E4M3, self.input_granularity, scale=self.input_scale)
        if self._observer is not None:
            self._observer(self._observer_name, "input", x2.detach(), xq.scale, E4M3)
        rows = expand_scale(xq.effective_scale(), xq.granularity, *x2.shape)  # [M, 1] or [1, 1]
        cols = expand_scale(self.weight_scale, self.weight_granularity, self.out_features, self.in_features)
        # the input's values times 2^-8 (decode_unscaled): the 2^8 joins its scale, exactly, which
        # multiplies the sums first — every product after it is the same number as without it
        a, factor = e4m3_to_bf16_unscaled(xq.data)
        if (row_scale := folded(rows, factor)) is None:  # scales near fp32's maximum: exact values
            a, row_scale = a.mul_(factor), rows
        out = scaled_bf16_linear(
            a, self.bf16_weight(), row_scale=row_scale, col_scale=cols.t(), divisor=None, bias=self.bias,
            out_dtype=self.out_dtype,
        )  # fmt: skip
        return out, xq

    # ---- quantities --------------------------------------------------------------------------
    @property
    def input_granularity(self) -> Granularity:
        return Granularity.tensor() if self.input_scale is not None else self.scheme.input_granularity

    def quantized_weight(self) -> QuantizedTensor:
        return QuantizedTensor(
            self.weight,
            self.weight_scale,
            E4M3,
            self.weight_granularity,
            torch.Size((self.out_features, self.in_features)),
        )

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.quantized_weight().dequantize(dtype)

    @property
    def qweight(self) -> torch.Tensor:
        """The stored payload (`weight`, or NVFP4/MXFP4's `weight_packed`): where peft looks for a quantized
        layer's weight (its device) when it wraps the layer in a LoRA layer (mixprec.finetune.lora)."""
        packed = self._buffers.get(WEIGHT_PACKED)
        return packed if packed is not None else self.weight

    # ---- monitor protocol -----------------------------------------------------------------------
    def set_precision_observer(self, observer, name: str | None = None) -> None:
        self._observer = observer
        self._observer_name = name

    def precision_layout(self) -> dict[str, Granularity]:
        return {"input": self.input_granularity, "weight": self.weight_granularity}

    # ---- forward --------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            return x.new_zeros(*lead, self.out_features, dtype=self.out_dtype)
        if torch.is_grad_enabled() and x2.requires_grad:  # fine-tuning: the input gets its gradient
            out = QuantizedLinearFunction.apply(x2, self)
        else:
            with torch.no_grad():  # the payloads are frozen buffers: nothing to record
                out, _ = self.forward_2d(x2)
        return out.reshape(*lead, self.out_features)

    def forward_2d(self, x2: torch.Tensor) -> tuple[torch.Tensor, QuantizedTensor | None]:
        """(x2 Wᵀ + b for a [M, K] input, the quantized input or None where the input is not quantized)."""
        if self._takes_bf16_path(x2):
            return self._forward_bf16(x2)
        # the one quantize entry: fused Triton kernels on CUDA, graph-break-free under torch.compile,
        # the eager (or, for big inputs, tiled) torch code on the CPU; bit-identical everywhere
        xq = quantize(x2, E4M3, self.input_granularity, scale=self.input_scale)
        if self._observer is not None:
            self._observer(self._observer_name, "input", x2.detach(), xq.scale, E4M3)
        return scaled_mm(xq, self.quantized_weight(), out_dtype=self.out_dtype, bias=self.bias), xq

    def extra_repr(self) -> str:
        act = (
            "static per-tensor" if self.input_scale is not None else f"dynamic {self.input_granularity.name}"
        )
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"scheme={self.scheme.name}, weight=e4m3 {self.weight_granularity.name}, input={act}"
        )


class BlockQuantizedLinear(QuantizedLinear):
    """The inference Linear of the block formats (NVFP4, MXFP4, MXFP8): buffers named and typed as a
    compressed-tensors checkpoint stores them — `weight_packed` (E2M1 codes, two per byte, element 2i
    in the low nibble) or `weight` (E4M3), `weight_scale` (float8_e4m3fn NVFP4 block scales, or uint8
    E8M0 codes), `weight_global_scale` (NVFP4) and `input_global_scale` (nvfp4's calibrated one).

    Forward, emulated exactly: weight-only schemes (a16) multiply the input by the dequantized weight
    (payload * scale / global, exact in fp32) in fp32; W4A4 / MXFP8 quantize the input per call (1x16
    NVFP4 blocks in the units of input_global_scale, or 1x32 MX blocks) through the one quantize
    entry and run the GEMM seam (mixprec.gemm.scaled_mm, fp32 accumulation).
    """

    _QUANTIZED_BUFFERS = (WEIGHT_PACKED, WEIGHT, WEIGHT_SCALE, WEIGHT_GLOBAL_SCALE, INPUT_GLOBAL_SCALE)

    def __init__(
        self,
        weight: QuantizedTensor,
        bias: torch.Tensor | None,
        scheme: InferenceScheme,
        *,
        input_scale: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.float32,
    ):
        nn.Module.__init__(self)
        out_features, in_features = weight.shape
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.scheme = scheme
        self.out_dtype = out_dtype
        self.weight_granularity = weight.granularity
        self.fmt = weight.fmt
        packed = weight.fmt.bits == 4
        self.register_buffer(WEIGHT_PACKED, pack_nibbles(weight.data) if packed else None)
        self.register_buffer(WEIGHT, None if packed else weight.data)
        e4m3 = weight.granularity.scale_format == "e4m3"
        self.register_buffer(WEIGHT_SCALE, weight.scale_e4m3() if e4m3 else weight.scale_e8m0())
        self.register_buffer(
            WEIGHT_GLOBAL_SCALE,
            None if weight.global_scale is None else weight.global_scale.float().reshape(1),
        )
        self.register_buffer(
            INPUT_GLOBAL_SCALE, None if input_scale is None else input_scale.float().reshape(1)
        )
        self.input_scale = None  # no static FP8 input scale (the protocol of QuantizedLinear)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(out_dtype), requires_grad=False)
        self._observer = None
        self._observer_name = None
        self._init_bf16_forward()

    @property
    def input_granularity(self) -> Granularity:
        return self.scheme.input_granularity

    def quantized_weight(self) -> QuantizedTensor:
        data = unpack_nibbles(self.weight_packed) if self.weight_packed is not None else self.weight
        if self.weight_scale.dtype == torch.uint8:  # E8M0 codes: 2^(code - 127)
            scale = pow2(self.weight_scale.to(torch.int32) - 127)
        else:
            scale = self.weight_scale.float()
        return QuantizedTensor(
            data, scale, self.fmt, self.weight_granularity,
            torch.Size((self.out_features, self.in_features)), self.weight_global_scale,
        )  # fmt: skip

    def _bf16_weight_values(self) -> torch.Tensor:
        """E2M1 codes times their E4M3 block scales, exact in bf16 (the global scale divides the sums)."""
        return e2m1_block_weight_bf16(
            unpack_nibbles(self.weight_packed), self.weight_scale, self.weight_granularity
        )

    def _takes_bf16_path(self, x2: torch.Tensor) -> bool:
        if self.bf16_gemm not in BF16_MODES:
            raise MixprecError(f"bf16_gemm must be one of {', '.join(BF16_MODES)}, got {self.bf16_gemm!r}")
        nvfp4_a16 = (
            self.scheme.weights_only
            and self.weight_packed is not None
            and self.weight_global_scale is not None
        )
        return (
            nvfp4_a16
            and x2.dtype == torch.bfloat16
            and takes_bf16_path(self.bf16_gemm, x2.device, self.out_dtype)
        )

    def forward_2d(self, x2: torch.Tensor) -> tuple[torch.Tensor, QuantizedTensor | None]:
        if self._takes_bf16_path(x2):  # NVFP4 A16 with a bf16 input: the bf16 GEMM, then / global scale
            out = scaled_bf16_linear(
                x2, self.bf16_weight(), row_scale=None, col_scale=None, divisor=self.weight_global_scale,
                bias=self.bias, out_dtype=self.out_dtype,
            )  # fmt: skip
            return out, None
        wq = self.quantized_weight()
        if self.scheme.weights_only:
            bias = None if self.bias is None else self.bias.float()
            return torch.nn.functional.linear(x2.float(), wq.dequantize(), bias).to(self.out_dtype), None
        xq = quantize(
            x2, self.scheme.input_format, self.input_granularity, global_scale=self.input_global_scale
        )
        if self._observer is not None:
            self._observer(self._observer_name, "input", x2.detach(), xq.effective_scale(), xq.fmt)
        return scaled_mm(xq, wq, out_dtype=self.out_dtype, bias=self.bias), xq

    def extra_repr(self) -> str:
        act = "high precision" if self.scheme.weights_only else f"dynamic {self.input_granularity.name}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"scheme={self.scheme.name}, weight={self.fmt.name} {self.weight_granularity.name}, input={act}"
        )


def quantized_linear(
    weight: QuantizedTensor,
    bias: torch.Tensor | None,
    scheme: InferenceScheme,
    *,
    input_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> QuantizedLinear:
    """The inference Linear for `scheme`: QuantizedLinear for the fp8-* schemes, BlockQuantizedLinear
    for NVFP4 / MXFP4 / MXFP8 (input_scale: nvfp4's input global scale)."""
    cls = QuantizedLinear if scheme.is_fp8 else BlockQuantizedLinear
    return cls(weight, bias, scheme, input_scale=input_scale, out_dtype=out_dtype)


def quantized_linears(model: nn.Module) -> list[QuantizedLinear]:
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


def set_decoded_cache(model: nn.Module, enabled: bool) -> int:
    """Turn the decoded-weight cache of every quantized Linear in `model` on or off (off also drops
    the decoded copies held); returns how many layers were set."""
    layers = quantized_linears(model)
    for m in layers:
        m.decoded_cache = bool(enabled)
        if not enabled:
            m.decoded_weight = None
    return len(layers)


def decoded_cache_bytes(model: nn.Module) -> int:
    """Bytes of the decoded weights the model's quantized Linears hold now (part of its weight memory)."""
    held = (m.decoded_weight for m in quantized_linears(model))
    return sum(t.numel() * t.element_size() for t in held if t is not None)
