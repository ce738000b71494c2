"""Quantization-aware training: what you train is what you serve.

`prepare_qat_(model, scheme)` swaps the Linears the scheme quantizes (the selection of apply_scheme_, with
its default ignores) for `QATLinear`s that hold the trainable high-precision master weight and bias. Every
forward quantizes the master weight with the quantizer `save_quantized` writes (schemes.quantize_weight;
NVFP4: the weight global scale shared by the shards of a fused GEMM, as apply_scheme_ computes it), builds
the inference Linear from it (runtime/linear.quantized_linear) and runs that layer's own forward — so the
QAT model's outputs are the served checkpoint's, bit for bit, and no second copy of the GEMM exists. The
backward is straight-through for the weight and input quantizers with their clipping masks
(runtime/gradients.FakeQuantLinearFunction). Static activation scales (fp8-static's input scale, nvfp4's
input global scale) are calibrated once in prepare_qat_ (the calibration apply_scheme_ runs) and frozen.

`convert_qat_(model)` replaces every QATLinear by the inference Linear its forward used: `save_quantized`
writes the ordinary checkpoint and `load_quantized` gives back a model with the same logits.
`distillation_loss` is KL(teacher ‖ student) on logits, for distillation from the original model.

Not handled (refused before any change): KV-cache quantization, MoE experts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.conversion import ConversionReport, ModuleEntry, replace_submodule
from mixprec.errors import MixprecError
from mixprec.inference.calibration.run import StopRule, calibrate
from mixprec.inference.checkpoint.block_tensors import fused_global_scales
from mixprec.inference.checkpoint.layout import INPUT_SCALE
from mixprec.inference.runtime.experts import UnfusedExperts
from mixprec.inference.runtime.gradients import FakeQuantLinearFunction
from mixprec.inference.runtime.linear import QuantizedLinear, quantized_linear
from mixprec.inference.runtime.online import linear_targets, record_quantized, static_input_scale
from mixprec.inference.schemes import InferenceScheme, quantize_weight, resolve_ignore
from mixprec.scaling import QuantizedTensor
from mixprec.select import fused_shards, selects_any
from mixprec.training.policy import fused_expert_params


class QATLinear(nn.Module):
    """A Linear trained for `scheme`: trainable master `weight` (and `bias`), frozen static input scale
    (`input_scale`: fp8-static's E4M3 scale or nvfp4's input global scale; None for dynamic and A16 schemes).
    `peers`: the QATLinears whose weights share this one's NVFP4 weight global scale (its fused GEMM's
    shards, itself included), by name."""

    def __init__(self, linear: nn.Linear, scheme: InferenceScheme, name: str,
                 input_scale: torch.Tensor | None = None, input_amax: float | None = None) -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.scheme = scheme
        self.name = name
        self.weight = linear.weight  # the same Parameter: an optimizer built before prepare keeps working
        self.bias = linear.bias
        self.register_buffer(
            INPUT_SCALE, None if input_scale is None else input_scale.detach().float().clone()
        )
        self.input_amax = input_amax  # the calibrated input amax the scale came from (for the scales file)
        self.peers: dict[str, QATLinear] = {name: self}  # a plain dict: not submodules

    def _apply(self, fn, recurse=True):
        """Casts (`.to(dtype)`, `.half()`) change the master weight and bias; the frozen static input scale
        is the checkpoint's number (fp32, as the inference Linear holds it) and only moves device."""
        kept = self._buffers.get(INPUT_SCALE)
        self._buffers[INPUT_SCALE] = None  # nn.Module._apply skips None buffers
        try:
            super()._apply(fn, recurse)
        finally:
            self._buffers[INPUT_SCALE] = None if kept is None else kept.to(device=self.weight.device)
        return self

    def _weight_global_scale(self) -> torch.Tensor | None:
        """NVFP4: the global scale of the fused group's largest |w|, by apply_scheme_'s rule; else None."""
        if self.scheme.weight_granularity.scale_format != "e4m3":
            return None
        amax = {}
        for n, p in self.peers.items():
            lo, hi = torch.aminmax(p.weight.detach())
            amax[n] = max(-float(lo), float(hi))
        return fused_global_scales(amax, self.weight.dtype)[self.name]

    def quantize(self) -> tuple[QuantizedTensor, Any, QuantizedLinear]:
        """(the quantized master weight, its statistics, the inference Linear holding it): what the forward
        runs and what convert_qat_ installs."""
        q, stats = quantize_weight(
            self.weight.detach(),
            self.scheme,
            name=f"{self.name}.weight",
            global_scale=self._weight_global_scale(),
        )
        bias = None if self.bias is None else self.bias.detach()
        layer = quantized_linear(
            q, bias, self.scheme, input_scale=self.input_scale, out_dtype=self.weight.dtype
        )
        layer.train(False)
        return q, stats, layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, _, layer = self.quantize()
        layer.decoded_cache = False  # a fresh layer per call: nothing to keep
        trains = torch.is_grad_enabled() and (
            x.requires_grad
            or self.weight.requires_grad
            or (self.bias is not None and self.bias.requires_grad)
        )
        if not trains:
            return layer(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        out = FakeQuantLinearFunction.apply(x2, self.weight, self.bias, layer, q)
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        static = "" if self.input_scale is None else ", static input scale"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scheme={self.scheme.name} (QAT){static}")  # fmt: skip


def qat_linears(model: nn.Module) -> dict[str, QATLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QATLinear)}


def _calibration_batches(calib_data: Any) -> Iterable[Any]:
    return [calib_data] if isinstance(calib_data, torch.Tensor) else calib_data


def _refuse_experts(model: nn.Module, targets: list[str], patterns: Sequence[str]) -> None:
    """MoE experts are not trained under QAT yet: name the first experts module that would be."""
    for name, m in model.named_modules():
        fused = isinstance(m, UnfusedExperts) or bool(fused_expert_params(m))
        if fused and not selects_any(name, patterns):
            raise MixprecError(
                f"QAT does not handle MoE experts: {name} ({type(m).__name__}); keep them out with "
                "ignore=['re:.*experts.*']"
            )
    if hit := next((t for t in targets if ".experts." in f".{t}."), None):
        raise MixprecError(
            f"QAT does not handle MoE experts: {hit} is an expert's Linear; keep them out with "
            "ignore=['re:.*experts.*']"
        )


def prepare_qat_(
    model: nn.Module,
    scheme: str | InferenceScheme,
    *,
    calib_data: Any = None,
    ignore: Sequence[str] | None = None,
    default_ignore: bool = True,
    observer: str = "max",
    stop: StopRule | None = None,
    kv_cache: bool = False,
) -> ConversionReport:
    """Swap `model`'s Linears that `scheme` quantizes for QATLinears, in place; returns a report of what
    was swapped and what stays in high precision (and why).

    calib_data (fp8-static, nvfp4): model inputs (an input_ids tensor or an iterable of batches, as
    apply_scheme_ takes) to calibrate the static input scales once, now; they stay frozen during training.
    Checked before any change: the scheme, the ignore patterns, calibration data for a static scheme, a
    model the scheme can quantize at least one Linear of (its own shape rules), no MoE experts, no
    kv_cache (QAT of the KV cache is not supported)."""
    sch = InferenceScheme.from_name(scheme)
    if kv_cache:
        raise MixprecError("QAT does not quantize the KV cache; prepare without kv_cache (the checkpoint keeps "
                           "a high-precision cache)")  # fmt: skip
    if prepared := next(iter(qat_linears(model)), None):
        raise MixprecError(f"the model is already prepared for QAT ({prepared} is a QAT Linear)")
    patterns = resolve_ignore(ignore, defaults=default_ignore)
    targets, skipped = linear_targets(model, sch, patterns)
    if not targets:
        why = next(iter(skipped.values()), "the model has no Linear")
        raise MixprecError(f"scheme {sch.name} quantizes no Linear of this model ({why})")
    _refuse_experts(model, targets, patterns)
    if sch.needs_calibration and calib_data is None:
        raise MixprecError(
            f"scheme {sch.name} needs calibration data (calib_data=) for its static input scales"
        )
    modules = dict(model.named_modules())
    report = ConversionReport(
        recipe=f"qat-{sch.name}", kind=sch.family, device=str(modules[targets[0]].weight.device),
        param_dtype=str(modules[targets[0]].weight.dtype).replace("torch.", ""), scheme=sch.name,
    )  # fmt: skip
    input_amax: dict[str, float] = {}
    if sch.needs_calibration:
        was_training = model.training
        result = calibrate(model, _calibration_batches(calib_data), targets, observer=observer, stop=stop)
        model.train(was_training)
        input_amax = result.input_amax
        report.calibration = {"observer": observer, **result.run.to_dict()}
    swapped: dict[str, QATLinear] = {}
    for name in targets:
        lin = modules[name]
        scale = static_input_scale(sch, input_amax[name], lin.weight.dtype) if sch.needs_calibration else None
        swapped[name] = QATLinear(lin, sch, name, input_scale=scale, input_amax=input_amax.get(name))
    for members in fused_shards(dict.fromkeys(swapped)).values():
        group = {n: swapped[n] for n in members}
        for m in group.values():
            m.peers = group
    for name, new in swapped.items():
        new.train(model.training)
        replace_submodule(model, name, new)
        report.entries.append(
            ModuleEntry(
                name, "Linear", "linear", f"qat:{sch.name}", "", type(new).__name__, new.weight.numel()
            )
        )
    for name, why in skipped.items():
        report.add_skipped(name, type(modules[name]).__name__, modules[name].weight.numel(), why)
    return report


def convert_qat_(model: nn.Module) -> ConversionReport:
    """Replace every QATLinear of `model` by the inference Linear its forward runs (the payload and scales
    of its current master weight): `save_quantized(model, dir)` then writes the ordinary checkpoint. The
    model is put in eval mode. MixprecError if it holds no QATLinear."""
    layers = qat_linears(model)
    if not layers:
        raise MixprecError("the model holds no QAT Linear (prepare_qat_ first)")
    schemes = {m.scheme.name for m in layers.values()}
    first = next(iter(layers.values()))
    report = ConversionReport(
        recipe=first.scheme.name, kind=first.scheme.family, device=str(first.weight.device),
        param_dtype=str(first.weight.dtype).replace("torch.", ""), scheme=first.scheme.name,
    )  # fmt: skip
    if len(schemes) > 1:
        raise MixprecError(
            f"QAT layers of several schemes ({', '.join(sorted(schemes))}): convert one at a time"
        )
    built = {name: m.quantize() for name, m in layers.items()}  # all before any swap: peers read weights
    for name, (q, stats, layer) in built.items():
        replace_submodule(model, name, layer)
        m = layers[name]
        record_quantized(report, name, "Linear", layer, m.scheme, q, stats, m.input_scale, m.input_amax)
    model.train(False)
    model.mixprec_report = report  # as apply_scheme_ does: save_quantized reads the layer statistics
    return report


def distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """KL(teacher ‖ student) of the softmax distributions at `temperature`, summed over the vocabulary
    (last dim), averaged over tokens (every other position), times temperature² (so the gradient's
    scale does not fall as the temperature rises, as in Hinton et al.). In fp32; the teacher gets no
    gradient. Zero exactly when the logits are equal."""
    if student_logits.shape != teacher_logits.shape:
        raise MixprecError(
            f"student and teacher logits differ in shape: {tuple(student_logits.shape)} vs {tuple(teacher_logits.shape)}"
        )
    if not temperature > 0:
        raise MixprecError(f"temperature must be > 0, got {temperature}")
    vocab = student_logits.shape[-1]
    log_s = F.log_softmax(student_logits.float().reshape(-1, vocab) / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.detach().float().reshape(-1, vocab) / temperature, dim=-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)
    return kl.mean() * temperature**2
