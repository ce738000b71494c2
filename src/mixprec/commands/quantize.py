"""`mixprec quantize`: FP8 offline quantization of a local Hugging Face checkpoint (thin CLI)."""

from __future__ import annotations

import argparse
import json

from mixprec.errors import MixprecError
from mixprec.formats import E4M3, get_format
from mixprec.inference.calibration import (
    DEFAULT_MIN_TOKENS,
    DEFAULT_TOLERANCE,
    DEFAULT_WINDOW,
    OBSERVERS,
    StopRule,
)
from mixprec.inference.layouts import LAYOUTS
from mixprec.inference.offline import DEFAULT_MAX_SHARD_SIZE, quantize_checkpoint
from mixprec.inference.schemes import SCHEMES

NAME = "quantize"
HELP = "quantize a local Hugging Face safetensors checkpoint to FP8 (compressed-tensors or HF fp8 layout)"


def add_arguments(parser: argparse.ArgumentParser) -> None:

    parser.add_argument("--model", required=True, help="input model directory (config.json + safetensors)")
    parser.add_argument(
        "--output", required=True, help="output directory (refused if it exists, unless --force)"
    )
    parser.add_argument(
        "--scheme", default="fp8-dynamic", help=f"one of {', '.join(SCHEMES)} (default fp8-dynamic)"
    )
    parser.add_argument(
        "--dtype",
        default="fp8_e4m3",
        help="element format; only fp8_e4m3 (the guide's spelling) is accepted",
    )
    parser.add_argument(
        "--calib-data",
        "--calib-dataset",
        dest="calib_data",
        help="calibration text: .txt, folder of .txt, .jsonl with 'text', or a well-known name with a local copy",
    )
    parser.add_argument(
        "--calib-samples", type=int, default=512,
        help="most calibration sequences to run (default 512); calibration stops earlier once the scales settle",
    )  # fmt: skip
    parser.add_argument(
        "--calib-tolerance", type=float, default=DEFAULT_TOLERANCE, metavar="REL",
        help=f"stop once no input amax changed by more than REL over the last --calib-window batches "
        f"(default {DEFAULT_TOLERANCE}; 0: run every --calib-samples)",
    )  # fmt: skip
    parser.add_argument(
        "--calib-window", type=int, default=DEFAULT_WINDOW, metavar="BATCHES",
        help=f"batches (of 4 sequences) the change is measured over (default {DEFAULT_WINDOW})",
    )  # fmt: skip
    parser.add_argument(
        "--calib-min-tokens", type=int, default=DEFAULT_MIN_TOKENS, metavar="N",
        help=f"never stop before N calibration tokens: rare outliers arrive late (default {DEFAULT_MIN_TOKENS})",
    )  # fmt: skip
    parser.add_argument(
        "--calib-seq-len", type=int, default=512, help="tokens per calibration sequence (default 512)"
    )
    parser.add_argument(
        "--observer", default="max", choices=OBSERVERS, help="activation amax observer (default max)"
    )
    parser.add_argument(
        "--ignore", nargs="+", default=[], metavar="PATTERN",
        help="module names kept in high precision, added to the defaults (lm_head, embeddings, norms, "
        "MoE routers), each with everything below it: dotted name parts the name ends with, globs, or "
        "'re:<regex>' matched from the start of the name (as vLLM reads it)",
    )  # fmt: skip
    parser.add_argument(
        "--no-default-ignore", action="store_true", help="do not add the default ignore patterns"
    )
    parser.add_argument("--format", default="compressed-tensors", choices=LAYOUTS, help="checkpoint layout")
    parser.add_argument(
        "--kv-cache", choices=("fp8",), help="calibrate and write per-layer k_scale / v_scale"
    )
    parser.add_argument(
        "--layer-by-layer", action=argparse.BooleanOptionalAction, default=None,
        help="calibrate one transformer block at a time (default: when the model exceeds half the free RAM)",
    )  # fmt: skip
    parser.add_argument(
        "--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, help="output shard bound (e.g. 2GB)"
    )
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    parser.add_argument(
        "--strict", action="store_true",
        help="fail (exit 2, nothing written) instead of keeping in high precision a layer that the serving "
        "engines' shape rules refuse (dims not multiples of 16; vLLM's fused fp8-block shards)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:

    if get_format(args.dtype) is not E4M3:
        raise MixprecError(f"--dtype {args.dtype}: only fp8_e4m3 is written for inference checkpoints")
    report = quantize_checkpoint(
        args.model,
        args.output,
        args.scheme,
        ignore=args.ignore,
        default_ignore=not args.no_default_ignore,
        calib_data=args.calib_data,
        calib_samples=args.calib_samples,
        calib_seq_len=args.calib_seq_len,
        observer=args.observer,
        calib_stop=StopRule(args.calib_tolerance, args.calib_window, args.calib_min_tokens),
        format=args.format,
        kv_cache=args.kv_cache,
        force=args.force,
        max_shard_size=args.max_shard_size,
        layer_by_layer=args.layer_by_layer,
        progress=not args.quiet and not args.json,
        strict=args.strict,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    from rich.console import Console

    console = Console()
    counts = report.summary()
    n_fp8 = sum(v for k, v in counts.items() if k.startswith("fp8"))
    console.print(
        f"[green]wrote {args.output}[/green]: {n_fp8} Linear layers in FP8 ({report.scheme}), "
        f"{len(report.skipped)} kept in high precision; weights {report.weight_bytes_before / 2**20:.1f} MiB -> "
        f"{report.weight_bytes_after / 2**20:.1f} MiB; max relative weight error {report.max_relative_weight_error:.2e}"
    )
    if report.calibration:
        cal = report.calibration
        console.print(f"calibration: {cal['samples']} of at most {cal['samples_available']} samples "
                      f"({cal['tokens']} tokens, {cal['seconds']:.0f} s); {cal['reason']}")  # fmt: skip
    for w in report.warnings:
        console.print(f"[yellow]warning:[/yellow] {w}")
    return 0
