"""FP8 and FP4 inference: offline checkpoint quantization (streaming), calibration, the scales file,
online quantization of a loaded model, and loading quantized checkpoints (mixprec, llm-compressor,
Hugging Face fp8, ModelOpt). The wing's rooms: docs/architecture.md.

    mixprec.quantize_checkpoint(model_dir, out_dir, scheme="fp8-dynamic")   # `mixprec quantize`
    model = mixprec.load_quantized(out_dir)                                  # Linears run in FP8/FP4
    report = mixprec.quantize_model_(model, scheme="fp8-dynamic")            # online, in place
    mixprec.save_quantized(model, out_dir)                                   # the layout quantize writes

Names are imported lazily so `import mixprec.inference` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "load_quantized": "mixprec.inference.readers.load:load_quantized",
    "quantize_checkpoint": "mixprec.inference.producers.quantize:quantize_checkpoint",
    "save_quantized": "mixprec.inference.producers.save:save_quantized",
    "InferenceScheme": "mixprec.inference.schemes:InferenceScheme",
    "SCHEMES": "mixprec.inference.schemes:SCHEMES",
    "DEFAULT_IGNORE": "mixprec.inference.schemes:DEFAULT_IGNORE",
    "QuantizedLinear": "mixprec.inference.runtime.linear:QuantizedLinear",
    "read_scales_file": "mixprec.inference.checkpoint.scales_file:read_scales_file",
    "calibrate": "mixprec.inference.calibration.run:calibrate",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module, attr = _EXPORTS[name].split(":")
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'mixprec.inference' has no attribute {name!r}")
