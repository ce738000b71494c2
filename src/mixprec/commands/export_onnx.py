"""`mixprec export-onnx`: a Hugging Face model directory to an ONNX graph
((input_ids, attention_mask) -> logits / hidden states), checked in onnxruntime on a padded batch."""

from __future__ import annotations

import argparse

from mixprec.onnx.export import check_export_inputs, export_onnx

NAME = "export-onnx"
HELP = "export a model directory to ONNX (torch's exporter, opset >= 19), ready for quantize-onnx"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, metavar="DIR",
        help="model directory: high-precision safetensors, or an FP8 checkpoint (exported dequantized)",
    )  # fmt: skip
    parser.add_argument("--output", required=True, metavar="FILE", help="the .onnx file to write")
    parser.add_argument("--opset", type=int, default=19, help="ONNX opset (>= 19; default 19)")
    parser.add_argument("--seq-len", type=int, default=16, help="length of the example input used to trace")
    parser.add_argument("--force", action="store_true", help="overwrite an existing output")


def run(args: argparse.Namespace) -> int:
    # every argument is checked before the model is loaded (a bad one: one line, exit 2)
    check_export_inputs(args.model, args.output, opset=args.opset, seq_len=args.seq_len, force=args.force)
    report = export_onnx(args.model, args.output, opset=args.opset, seq_len=args.seq_len, force=args.force)
    for note in report.notes:
        print(f"note: {note}")
    print(
        f"wrote {report.output} ({report.kind}, opset {report.opset}, {report.bytes:,} bytes): "
        f"{' + '.join(report.inputs)} -> {' + '.join(report.outputs)}; onnxruntime vs torch on a padded batch "
        f"({report.check_batch}), real tokens: max |diff| {report.max_abs_diff:.3g}, "
        f"relative error {report.relative_error:.3g}"
    )
    return 0
