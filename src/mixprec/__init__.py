"""mixprec: take PyTorch models to BF16 and FP8, for training and inference, and verify nothing was lost.

The public names are imported lazily, so `import mixprec` stays cheap and the heavy parts
(transformers, onnx, matplotlib) load only when used.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__version__ = "0.1.0"

# public name -> "module:attribute"
_EXPORTS = {
    "MixprecError": "mixprec.errors:MixprecError",
    "Format": "mixprec.formats:Format",
    "FORMATS": "mixprec.formats:FORMATS",
    "get_format": "mixprec.formats:get_format",
    "cast_to_format": "mixprec.formats:cast_to_format",
    "Granularity": "mixprec.scaling:Granularity",
    "QuantizedTensor": "mixprec.scaling:QuantizedTensor",
    "quantize": "mixprec.quantization:quantize",
    "dequantize": "mixprec.quantization:dequantize",
    "convert_for_training": "mixprec.training:convert_for_training",
    "enable_fast_paths": "mixprec.training:enable_fast_paths",
    "export_for_inference": "mixprec.training:export_for_inference",
    "load_quantized": "mixprec.inference:load_quantized",
    # scheme "auto" chooses per layer (mixprec.sensitivity, above the inference wing); others go on to
    # the inference wing's apply_scheme_ (mixprec.inference.runtime.online) unchanged
    "quantize_model_": "mixprec.sensitivity.automatic:quantize_model_",
    "quantize_checkpoint": "mixprec.inference:quantize_checkpoint",
    "save_quantized": "mixprec.inference:save_quantized",
    "evaluate": "mixprec.evaluation.runner:evaluate",
    "Policy": "mixprec.training:Policy",
    "Rule": "mixprec.training:Rule",
    "compare": "mixprec.comparison.runner:compare",
    "AdamW": "mixprec.training.optim:AdamW",
    "PrecisionMonitor": "mixprec.monitor:PrecisionMonitor",
}

# public module name -> the module (each importable as `mixprec.<name>` too)
_MODULES = {
    "recipes": "mixprec.recipes",
    "monitor": "mixprec.monitor",
    "formats": "mixprec.formats",
    "scaling": "mixprec.scaling",
    "gemm": "mixprec.gemm",
    "distributed": "mixprec.distributed",
}

# old attribute names of modules that live elsewhere: `mixprec.optim` worked as an attribute but not as
# `import mixprec.optim`, so they warn and point at the real module; removed in the next release
_DEPRECATED_MODULES = {
    "optim": "mixprec.training.optim",
    "hardware": "mixprec.kernels.hardware",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module, attr = _EXPORTS[name].split(":")
        return getattr(importlib.import_module(module), attr)
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    if name in _DEPRECATED_MODULES:
        real = _DEPRECATED_MODULES[name]
        warnings.warn(
            f"mixprec.{name} is deprecated and will be removed in the next release: use {real}",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(real)
    raise AttributeError(f"module 'mixprec' has no attribute {name!r}")
