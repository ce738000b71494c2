"""`mixprec quantize-onnx`: an ONNX model to FP8 E4M3 Q/DQ (opset >= 19), checked with onnxruntime.

(`mixprec export-onnx`, which makes the ONNX file from a model directory, lives in export_onnx.py.)
"""

from __future__ import annotations

import argparse

from mixprec.errors import MixprecError
from mixprec.files import check_new_output, write_json_atomic
from mixprec.onnx.common import load_model
from mixprec.onnx.inputs import load_calib_inputs
from mixprec.onnx.quantize import DEFAULT_EXCLUDE, quantize_onnx

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
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--calib-seq-len", type=int, default=64)
    parser.add_argument("--exclude", nargs="*", default=None, metavar="PATTERN",
                        help="module paths / node / initializer names kept in fp32 (default: lm_head)")  # fmt: skip
    parser.add_argument("--no-check", action="store_true", help="skip the onnxruntime comparison")
    parser.add_argument("--max-error", type=float, default=None, metavar="E",
                        help="exit 1 when the worst relative L2 error of an output exceeds E")  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="write the report (scales, errors) as JSON")
    parser.add_argument("--force", action="store_true", help="overwrite an existing output")


def run(args: argparse.Namespace) -> int:

    if args.max_error is not None and args.no_check:
        raise MixprecError("--max-error needs the check (drop --no-check)")
    if args.json:
        check_new_output(args.json, args.force, label="--json")
    calib = None
    if args.calib_data:
        calib = load_calib_inputs(args.calib_data, load_model(args.input), tokenizer_dir=args.tokenizer,
                                  samples=args.calib_samples, seq_len=args.calib_seq_len)  # fmt: skip
    report = quantize_onnx(
        args.input, args.output, granularity=args.granularity, calib_inputs=calib,
        exclude=DEFAULT_EXCLUDE if args.exclude is None else tuple(args.exclude), force=args.force,
        check=not args.no_check,
    )  # fmt: skip
    if args.json:
        write_json_atomic(args.json, report.to_dict(), default=str)
    print(
        f"wrote {report.output}: {len(report.weights)} FP8 weights ({report.granularity} scales), "
        f"{len(report.activation_scales)} static activation scales, {len(report.skipped)} MatMul/Gemm kept in fp32; "
        f"weights {report.weight_bytes_before:,} -> {report.weight_bytes_after:,} bytes"
    )
    failed = False
    if report.check:
        for name, o in report.check["outputs"].items():
            top1 = f", top-1 agreement {o['top1_agreement']:.4f}" if o["top1_agreement"] is not None else ""
            print(f"check ({report.check['inputs']}, onnxruntime CPU) {name}: relative L2 error "
                  f"{o['relative_l2_error']:.4g}, max |diff| {o['max_abs_error']:.4g}, SNR {o['snr_db']:.1f} dB{top1}")  # fmt: skip
        if args.max_error is not None and report.check["worst_relative_l2_error"] > args.max_error:
            print(
                f"FAILED: error {report.check['worst_relative_l2_error']:.4g} > --max-error {args.max_error}"
            )
            failed = True
    return 1 if failed else 0
