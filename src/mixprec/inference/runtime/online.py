"""Online quantization: turn the Linears of a loaded model into FP8 or FP4 (NVFP4, MX) inference Linears, in place.

No model code changes: modules are swapped on their parents. The high-precision weights are dropped
(the FP8 payload and scales replace them), so memory really falls.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.conversion import ConversionReport, replace_submodule
from mixprec.errors import MixprecError
from mixprec.formats import E4M3, check_float_tensor
from mixprec.inference.algorithms.fold_stage import fold_model_, fold_names, folds_need_data
from mixprec.inference.algorithms.gptq_pass import GptqPass, rounding_stats
from mixprec.inference.algorithms.scale_search import search_weight
from mixprec.inference.algorithms.spec import AlgorithmSpec
from mixprec.inference.calibration.data import load_texts, token_batches
from mixprec.inference.calibration.layerwise import calibrate_blockwise
from mixprec.inference.calibration.run import (
    StopRule,
    calibrate,
    unseen_experts_warning,
    unseen_take_group_max,
)
from mixprec.inference.checkpoint.block_tensors import fused_global_scales, input_global_scale
from mixprec.inference.checkpoint.scales_file import compact_entry, layer_entry
from mixprec.inference.runtime.experts import unfuse_live
from mixprec.inference.runtime.linear import QuantizedLinear, quantized_linear
from mixprec.inference.schemes import InferenceScheme, quantize_weight, resolve_ignore, skip_reason
from mixprec.scaling import QuantizedTensor, compute_scale


def linear_targets(
    model: nn.Module, scheme: InferenceScheme, ignore: Sequence[str]
) -> tuple[list[str], dict[str, str]]:
    """(names of Linears to quantize, {skipped Linear name: reason})."""
    targets, skipped = [], {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and not isinstance(m, QuantizedLinear):
            why = skip_reason(name, m.out_features, m.in_features, ignore, scheme)
            if why is None and m.weight.device.type == "meta":
                why = "weight on the meta device"
            if why:
                skipped[name] = why
            else:
                targets.append(name)
    return targets, skipped


def _calibration_batches(calib_data: Any, tokenizer: Any, samples: int, seq_len: int) -> Iterable[Any]:
    if isinstance(calib_data, (str,)) or hasattr(calib_data, "__fspath__"):
        if tokenizer is None:
            raise MixprecError("calib_data given as a path needs tokenizer= to turn the text into tokens")
        return token_batches(load_texts(calib_data), tokenizer, samples, seq_len)
    if isinstance(calib_data, torch.Tensor):
        return [calib_data]
    return calib_data


def weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters and persistent buffers (what the weights take in memory)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "meta" or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def apply_scheme_(
    model: nn.Module,
    scheme: str | InferenceScheme = "fp8-dynamic",
    ignore: Sequence[str] | None = None,
    calib_data: Any = None,
    *,
    observer: str = "max",
    tokenizer: Any = None,
    calib_samples: int = 512,
    calib_seq_len: int = 512,
    scales: dict[str, Any] | None = None,
    default_ignore: bool = True,
    stop: StopRule | None = None,
    algorithm: str | Sequence[str] | AlgorithmSpec | None = None,
) -> ConversionReport:
    """Quantize `model`'s Linears in place to `scheme` (FP8, or an FP4/MX block format) and return a
    ConversionReport. The package root's `mixprec.quantize_model_` is the public entry (it also takes
    scheme "auto"); this is the inference wing's, for one scheme.

    scheme: a name of SCHEMES (fp8-dynamic, fp8-static, fp8-block, nvfp4, nvfp4a16, mxfp4, ...).
    ignore: extra module-name patterns kept in high precision (added to the defaults: lm_head,
    embeddings, norms, MoE routers). calib_data (static schemes): an iterable of model inputs (input_ids tensors, dicts of kwargs, tuples), or a text
    path with tokenizer=; calibration stops early once the input amax settle (`stop`, default
    StopRule(); calib_samples is the cap) and `report.calibration` says how much it ran and why it
    stopped. scales: a validated scales document (see scales_file) whose weight/input scales are used
    instead of computing them. algorithm: "gptq", "scale-search", the folds "rotate", "smoothquant",
    "awq", a comma list or an AlgorithmSpec: the folds change the model in place first (as `mixprec
    quantize` folds the model it writes), then GPTQ rounds the weights on calib_data, block by block
    (every batch runs; static input scales are observed in the same walk); recorded in
    `report.algorithm`.
    """
    sch = InferenceScheme.from_name(scheme)
    spec = _live_algorithm(algorithm, sch)
    patterns = resolve_ignore(ignore, defaults=default_ignore)
    _check_live_inputs(spec, linear_targets(model, sch, patterns)[0], scales, calib_data)
    experts, left_fused = unfuse_live(model)  # one Linear per expert weight, as a checkpoint stores them
    targets, skipped = linear_targets(model, sch, patterns)
    layers_in = (scales or {}).get("layers", {})
    param_dtype = next((p.dtype for p in model.parameters()), torch.float32)
    report = ConversionReport(
        recipe=sch.name, kind=sch.family, device=str(next((p.device for p in model.parameters()), "cpu")),
        param_dtype=str(param_dtype).replace("torch.", ""), scheme=sch.name,
    )  # fmt: skip
    report.weight_bytes_before = weight_bytes(model)

    def batches() -> Iterable[Any]:
        return _calibration_batches(calib_data, tokenizer, calib_samples, calib_seq_len)

    folds = _fold_live(model, spec, sch, targets, calib_data, batches)
    modules = dict(model.named_modules())  # the folds may give a module new parameters (an untied head)
    input_amax, prequantized = _observe(
        model, targets, sch, spec, batches if calib_data is not None else None, scales, layers_in,
        param_dtype, observer, stop, report, experts,
    )  # fmt: skip
    was_training = model.training
    weight_globals = _weight_global_scales(modules, targets, sch, param_dtype)
    if spec.uses_scale_search and not prequantized:
        prequantized = _search_scales(modules, targets, sch, weight_globals)
        report.algorithm = spec.to_dict()
    for name in targets:
        _swap_linear(model, modules, name, sch, layers_in.get(name, {}), input_amax, weight_globals.get(name),
                     report, prequantized.get(name))  # fmt: skip
    for name, why in skipped.items():
        m = modules[name]
        report.add_skipped(name, type(m).__name__, m.weight.numel(), why)
    for name, why in left_fused.items():
        m = modules[name]
        report.add_skipped(name, type(m).__name__, sum(p.numel() for p in m.parameters(recurse=False)), why)
        report.warn(f"the MoE experts {name!r} stay in high precision: {why}")
    model.train(was_training)
    gc.collect()
    report.weight_bytes_after = weight_bytes(model)
    if folds is not None:
        report.algorithm = {**(report.algorithm or spec.to_dict()), "folds": folds}
        report.notes.append(f"folded ({', '.join(folds)}) before calibration")
    model.mixprec_report = report  # as load_quantized does; save_quantized reads the layer statistics
    return report


def _live_algorithm(
    algorithm: str | Sequence[str] | AlgorithmSpec | None, sch: InferenceScheme
) -> AlgorithmSpec:
    """The algorithm, checked against the scheme before any work."""
    spec = AlgorithmSpec.parse(algorithm)
    spec.check_scheme(sch)
    return spec


def _fold_live(model: nn.Module, spec: AlgorithmSpec, sch: InferenceScheme, targets: list[str], calib_data: Any,
               batches: Callable[[], Iterable[Any]]) -> dict[str, Any] | None:  # fmt: skip
    """The spec's folds (rotate, smoothquant, awq) on the live model in place, before its calibration
    and GPTQ, as the offline quantization folds before it writes (fold_stage.py); their records, or
    None without folds."""
    if not fold_names(spec) or not targets:
        return None
    data = _token_ids(list(batches()), spec) if folds_need_data(spec) else None
    return fold_model_(model, spec, data, dict.fromkeys(targets, sch))


def _check_live_inputs(spec: AlgorithmSpec, targets: list[str], scales: dict[str, Any] | None,
                       calib_data: Any) -> None:  # fmt: skip
    """MixprecError, before the model is touched, for an algorithm without the data it learns from or
    with given scales it would not match (the folds change the weights; GPTQ chooses their scales)."""
    if not targets or not spec.names:
        return
    if spec.needs_data and calib_data is None:
        raise MixprecError(
            f"algorithm={spec.label!r} needs calib_data= (token ids, or a text path with tokenizer=)"
        )
    if scales is not None and (spec.uses_gptq or fold_names(spec)):
        raise MixprecError(f"algorithm={spec.label!r} computes the weight scales itself (no scales=)")


def _token_ids(batches: list[Any], spec: AlgorithmSpec) -> list[torch.Tensor]:
    """The calibration batches an algorithm walks block by block: token-id tensors, refused otherwise."""
    if any(not isinstance(b, torch.Tensor) or b.is_floating_point() for b in batches):
        raise MixprecError(f"algorithm={spec.label!r} on a live model takes calib_data as token-id tensors "
                           "[batch, seq] (or a text path with tokenizer=)")  # fmt: skip
    return batches


def _observe(model: nn.Module, targets: list[str], sch: InferenceScheme, spec: AlgorithmSpec,
             batches: Callable[[], Iterable[Any]] | None, scales: dict[str, Any] | None,
             layers_in: dict[str, Any], dtype: torch.dtype, observer: str, stop: StopRule | None,
             report: ConversionReport, experts: dict[str, str]) -> tuple[dict[str, float], dict[str, QuantizedTensor]]:  # fmt: skip
    """What the calibration data gives: (static input amax, {Linear: its GPTQ rounding}); GPTQ walks the
    blocks with the static scales observed on the way, else the inputs that lack a given scale are
    calibrated (batches None: no calib_data). experts: {MoE expert weight: its fused parameter}; one no
    token reached takes its layer's largest input amax (calibration/run.py: unseen_take_group_max)."""
    if spec.uses_gptq and targets and batches is not None:  # _check_live_inputs: batches are given
        amax, rounded = _run_gptq(
            model, _token_ids(list(batches()), spec), targets, sch, spec, dtype, observer, report, experts
        )
        return _unseen_experts(amax, experts, report), rounded
    missing = [n for n in targets if "scale" not in (layers_in.get(n, {}).get("input") or {})]
    if not (sch.needs_calibration and missing):
        return {}, {}
    if batches is None:
        raise MixprecError(
            f"scheme {sch.name} needs calibration data (calib_data=) for static input scales "
            f"({len(missing)} layers lack them, e.g. {missing[0]!r})"
        )
    amax = _calibrate_inputs(model, batches(), missing, observer, stop, report, experts)
    return _unseen_experts(amax, experts, report), {}


def _unseen_experts(
    amax: dict[str, float], experts: dict[str, str], report: ConversionReport
) -> dict[str, float]:
    filled, unseen = unseen_take_group_max(amax, experts)
    if unseen:
        report.warn(unseen_experts_warning(unseen))
    return filled


def _weight_global_scales(modules: dict[str, nn.Module], targets: list[str], sch: InferenceScheme,
                          dtype: torch.dtype) -> dict[str, torch.Tensor]:  # fmt: skip
    """NVFP4: the shards of a fused GEMM (q/k/v, gate/up) share one weight global scale."""
    if sch.weight_granularity.scale_format != "e4m3":
        return {}
    amax = {
        n: max(-float(lo), float(hi))
        for n in targets
        for lo, hi in [torch.aminmax(modules[n].weight.detach())]
    }
    return fused_global_scales(amax, dtype)


def _search_scales(modules: dict[str, nn.Module], targets: list[str], sch: InferenceScheme,
                   weight_globals: dict[str, torch.Tensor]) -> dict[str, QuantizedTensor]:  # fmt: skip
    """Every target rounded with the scale search's block scales (NVFP4: the shared global scales
    with the search's headroom)."""
    out = {}
    for name in targets:
        w = modules[name].weight.detach()
        check_float_tensor(w, f"{name}.weight")
        out[name] = search_weight(w, sch.fmt, sch.weight_granularity, weight_globals.get(name))
    return out


def _calibrate_inputs(model: nn.Module, batches: Iterable[Any], names: list[str], observer: str,
                      stop: StopRule | None, report: ConversionReport, experts: dict[str, str]) -> dict[str, float]:  # fmt: skip
    """The static input amax of `names` (calibration stops once they settle); recorded in the report."""
    result = calibrate(model, batches, names, observer=observer, stop=stop, may_be_unseen=experts)
    report.calibration = {"observer": observer, **result.run.to_dict()}
    report.notes.append(
        f"calibrated {len(names)} input scales with the {observer} observer on {result.run.samples} "
        f"samples ({result.run.reason})"
    )
    return result.input_amax


def _run_gptq(model: nn.Module, batches: list[Any], targets: list[str], sch: InferenceScheme, spec: AlgorithmSpec,
              dtype: torch.dtype, observer: str, report: ConversionReport, experts: dict[str, str]) -> tuple[dict[str, float], dict[str, QuantizedTensor]]:  # fmt: skip
    """GPTQ over the live model block by block: (static input amax, {Linear: its GPTQ rounding}); an
    expert weight that saw too few routed tokens is rounded to nearest (gptq_experts.py)."""
    gptq = GptqPass(dict.fromkeys(targets, sch), spec.gptq, dtype, search=spec.uses_scale_search,
                    experts=[n for n in targets if n in experts])  # fmt: skip
    static = targets if sch.needs_calibration else []
    result = calibrate_blockwise(
        model, batches, static, observer=observer, block_pass=gptq, may_be_unseen=experts
    )
    for message in gptq.warnings():
        report.warn(message)
    report.algorithm = gptq.record(spec, batches, result.run.seconds, "calib_data")
    if static:
        report.calibration = {"observer": observer, **result.run.to_dict()}
    return result.input_amax, gptq.results


def static_input_scale(sch: InferenceScheme, amax: float, dtype: torch.dtype) -> torch.Tensor:
    """A calibrated scheme's static input scale from the observed input amax: nvfp4's input global scale
    (in the weights' dtype), else fp8-static's per-tensor E4M3 scale. QAT (finetune/qat.py) uses it too."""
    if sch.input_global:
        return input_global_scale(amax, dtype)
    return compute_scale(amax, E4M3).reshape(1)


def _swap_linear(model: nn.Module, modules: dict[str, nn.Module], name: str, sch: InferenceScheme,
                 given: dict[str, Any], input_amax: dict[str, float], weight_global: torch.Tensor | None,
                 report: ConversionReport, rounded: QuantizedTensor | None = None) -> None:  # fmt: skip
    """Replace the Linear `name` by its quantized Linear (scales `given` by a scales document win over
    computed ones; `rounded`: the weight an algorithm already quantized), and record it in the report."""
    lin = modules[name]
    w_scale = None
    if given.get("weight") and "scale" in given["weight"]:
        w_scale = torch.tensor(given["weight"]["scale"], dtype=torch.float32).reshape(
            given["weight"].get("scale_shape") or [-1]
        )
        if w_scale.dim() == 1:
            w_scale = w_scale.reshape(-1, 1) if w_scale.numel() > 1 else w_scale.reshape(1, 1)
    if rounded is not None:
        q, stats = rounded, rounding_stats(lin.weight.detach(), rounded)
    else:
        q, stats = quantize_weight(
            lin.weight.detach(), sch, name=f"{name}.weight", scale=w_scale, global_scale=weight_global
        )
    in_scale = None
    in_amax = None
    if sch.needs_calibration:
        if "scale" in (given.get("input") or {}):
            in_scale = torch.tensor([given["input"]["scale"]], dtype=torch.float32)
        else:
            in_amax = input_amax[name]
            in_scale = static_input_scale(sch, in_amax, lin.weight.dtype)
    new = quantized_linear(q, lin.bias, sch, input_scale=in_scale, out_dtype=lin.weight.dtype)
    new.train(False)
    replace_submodule(model, name, new)
    modules[name] = new
    record_quantized(report, name, type(lin).__name__, new, sch, q, stats, in_scale, in_amax)


def record_quantized(report: ConversionReport, name: str, original: str, new: QuantizedLinear,
                     sch: InferenceScheme, q: QuantizedTensor, stats: Any, in_scale: torch.Tensor | None,
                     in_amax: float | None) -> None:  # fmt: skip
    """Record the Linear `name` (of class `original`), now the inference Linear `new`, in the report."""
    entry = layer_entry(
        scheme=sch.name, weight_granularity=sch.weight_granularity.name, weight_scale=q.scale,
        weight_amax=stats.amax, relative_weight_error=stats.relative_error, shape=tuple(q.shape),
        input_scale=in_scale, input_amax=in_amax, input_dynamic=sch.input_dynamic,
        input_granularity=sch.input_granularity.name,
    ) if sch.is_fp8 else compact_entry(q, sch, stats, tuple(q.shape), in_scale, in_amax)  # fmt: skip
    report.add_quantized_linear(name, original, q.shape.numel(), entry, type(new).__name__, sch.family)
