"""ONNX: export a model directory, convert the graph to FP8 E4M3 Q/DQ, check it with onnxruntime."""

from mixprec.onnx.check import check_fp8_onnx
from mixprec.onnx.export import export_onnx
from mixprec.onnx.quantize import quantize_onnx

__all__ = ["check_fp8_onnx", "export_onnx", "quantize_onnx"]
