"""`mixprec quantize-onnx`: an ONNX model to FP8 E4M3 Q/DQ (opset >= 19), checked with onnxruntime.

(`mixprec export-onnx`, which makes the ONNX file from a model directory, lives in export_onnx.py.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mixprec.files import write_json_atomic
from mixprec.onnx.common import load_model
from mixprec.onnx.inputs import load_calib_inputs
from mixprec.onnx.quantize import DEFAULT_EXCLUDE, MaxErrorExceeded, check_quantize_inputs, quantize_onnx

NAME = "quantize-onnx"
HELP = "convert an ONNX model to FP8 E4M3 QuantizeLinear/DequantizeLinear and check it with onnxruntime"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, metavar="FILE", help="the ONNX model (fp32 weights)")
    parser.add_argument("--output", required=True, metavar="FILE", help="the FP8 ONNX model to write (.onnx)")
    parser.add_argument("--granularity", choices=("channel", "tensor"), default="channel",
                        help="weight scales per output channel (default) or one per tensor")  # fmt: skip
    parser.add_argument("--calib-data", metavar="PATH",
                        help="static activation scales from this data: .npz (one array per graph input) or text "
                             "(.txt, folder, .jsonl) for a graph with input_ids; without it the graph is weight-only")  # fmt: skip
    parser.add_argument(
        "--tokenizer", metavar="DIR", help="tokenizer for text --calib-data (default: the exported model's)"
    )
    parser.add_argument("--calib-samples", type=int, default=32, help="calibration sequences (default 32)")
    parser.add_argument("--calib-seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--exclude", nargs="*", default=None, metavar="PATTERN",
                        help="module paths / node / initializer names kept in fp32 (default: lm_head)")  # fmt: skip
    parser.add_argument("--no-check", action="store_true", help="skip the onnxruntime comparison")
    parser.add_argument("--max-error", type=float, default=None, metavar="E",
                        help="exit 1, writing no graph, when the worst relative L2 error of an output exceeds E")  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="write the report (scales, errors) as JSON")
    parser.add_argument("--force", action="store_true", help="overwrite an existing output")


def run(args: argparse.Namespace) -> int:
    # every argument is checked before a graph is loaded (a bad one: one line, exit 2)
    exclude = DEFAULT_EXCLUDE if args.exclude is None else tuple(args.exclude)
    check_quantize_inputs(
        args.input, args.output, force=args.force, exclude=exclude, check=not args.no_check,
        max_error=args.max_error, calib_data=args.calib_data, tokenizer=args.tokenizer,
        calib_samples=args.calib_samples, calib_seq_len=args.calib_seq_len, json_path=args.json,
    )  # fmt: skip
    src, dst = Path(args.input), Path(args.output)

    calib = None
    if args.calib_data:
        calib = load_calib_inputs(args.calib_data, load_model(src), tokenizer_dir=args.tokenizer,
                                  samples=args.calib_samples, seq_len=args.calib_seq_len)  # fmt: skip
    try:
        report = quantize_onnx(
            src, dst, granularity=args.granularity, calib_inputs=calib, exclude=exclude, force=args.force,
            check=not args.no_check, max_error=args.max_error,
        )  # fmt: skip
        failure = None
    except MaxErrorExceeded as exc:
        report, failure = exc.report, exc
    if args.json:
        write_json_atomic(args.json, report.to_dict(), default=str)
    if failure is None:
        print(
            f"wrote {report.output}: {len(report.weights)} FP8 weights ({report.granularity} scales), "
            f"{len(report.activation_scales)} static activation scales, {len(report.skipped)} MatMul/Gemm kept in fp32; "
            f"weights {report.weight_bytes_before:,} -> {report.weight_bytes_after:,} bytes"
        )  # fmt: skip
    if report.check:
        for name, o in report.check["outputs"].items():
            top1 = f", top-1 agreement {o['top1_agreement']:.4f}" if o["top1_agreement"] is not None else ""
            print(f"check ({report.check['inputs']}, onnxruntime CPU) {name}: relative L2 error "
                  f"{o['relative_l2_error']:.4g}, max |diff| {o['max_abs_error']:.4g}, SNR {o['snr_db']:.1f} dB{top1}")  # fmt: skip
    if failure is not None:  # a failed gate, not a bad input: exit 1, and no graph was written
        print(f"FAILED: {failure}")
        return 1
    return 0
