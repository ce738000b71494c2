"""mixprec.training: convert a model for BF16/FP8 training, train it, export it for inference.

Public names (imported lazily so that `import mixprec.training` does not import transformers):
convert_for_training, ConversionReport, Policy, Rule, enable_fast_paths, true_fp32, export_for_inference,
MixprecTrainerCallback, TrainingStep (with the DataParallelism protocol it takes), make_grad_scaler,
advance_scaling_state, fp32_compute, LowPrecisionLinear (the quantized training layer).

Deprecated: `Fp8Linear`, the old name of LowPrecisionLinear (it runs FP4 recipes too), an alias for one
release that warns when used; it is removed in the next release.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_EXPORTS = {
    "convert_for_training": "mixprec.training.convert:convert_for_training",
    "resolve_recipe": "mixprec.training.convert:resolve_recipe",
    "conversion_state": "mixprec.training.convert:conversion_state",
    "ConversionReport": "mixprec.conversion:ConversionReport",
    "ModuleEntry": "mixprec.conversion:ModuleEntry",
    "Policy": "mixprec.training.policy:Policy",
    "Rule": "mixprec.training.policy:Rule",
    "enable_fast_paths": "mixprec.training.fast_paths:enable_fast_paths",
    "FastPaths": "mixprec.training.fast_paths:FastPaths",
    "true_fp32": "mixprec.training.fast_paths:true_fp32",
    "export_for_inference": "mixprec.training.export:export_for_inference",
    "MixprecTrainerCallback": "mixprec.training.callback:MixprecTrainerCallback",
    "TrainingStep": "mixprec.training.step:TrainingStep",
    "make_grad_scaler": "mixprec.training.step:make_grad_scaler",
    "advance_scaling_state": "mixprec.training.step:advance_scaling_state",
    "clip_grad_norm_": "mixprec.training.step:clip_grad_norm_",
    "DataParallelism": "mixprec.training.parallel:DataParallelism",
    "fp32_compute": "mixprec.kernels.bf16_cpu:fp32_compute",
    "LowPrecisionLinear": "mixprec.training.low_precision_linear:LowPrecisionLinear",
    "Fp8Linear": "mixprec.training.low_precision_linear:LowPrecisionLinear",
}
# old name -> new name: aliases kept for one release, removed in the next
_DEPRECATED = {"Fp8Linear": "LowPrecisionLinear"}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        warnings.warn(
            f"mixprec.training.{name} is deprecated and removed in the next release: use "
            f"mixprec.training.{_DEPRECATED[name]}",
            DeprecationWarning,
            stacklevel=2,
        )
    if name in _EXPORTS:
        module, attr = _EXPORTS[name].split(":")
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'mixprec.training' has no attribute {name!r}")
