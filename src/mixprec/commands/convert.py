"""`mixprec convert`: rewrite a quantized checkpoint in another layout, numerics kept (thin CLI)."""

from __future__ import annotations

import argparse
import json

from mixprec.inference.checkpoint.direct_file import direct_writes_enabled
from mixprec.inference.checkpoint.layout import CONVERT_LAYOUTS
from mixprec.inference.checkpoint.publish import DEFAULT_MAX_SHARD_SIZE
from mixprec.inference.producers.convert import convert_checkpoint

NAME = "convert"
HELP = (
    "rewrite a quantized checkpoint in another layout (compressed-tensors, hf-fp8, modelopt): payloads and "
    "block scales bit-identical, reciprocal scales correctly rounded"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", metavar="IN", help="quantized checkpoint directory")
    parser.add_argument(
        "output", metavar="OUT", help="output directory (refused if it exists, unless --force)"
    )
    parser.add_argument("--to", required=True, choices=CONVERT_LAYOUTS, help="the layout to write")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    parser.add_argument(
        "--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, help="largest shard (default 2GB)"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    direct_writes_enabled()  # a bad $MIXPREC_DIRECT_WRITES fails here, before any work
    summary = convert_checkpoint(
        args.input,
        args.output,
        args.to,
        force=args.force,
        max_shard_size=args.max_shard_size,
        progress=not args.quiet and not args.json,
    )
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(
        f"{summary['from']} -> {summary['to']}: {summary['layers']} quantized layers written to {summary['output']} "
        f"({summary['bytes_copied_unchanged']} bytes of payloads and scales copied unchanged; {summary['scales_renamed']} scales "
        f"renamed/reshaped, {summary['scales_reciprocal']} replaced by their correctly rounded reciprocal)"
    )
    for note in summary["notes"]:
        print(f"note: {note}")
    return 0
