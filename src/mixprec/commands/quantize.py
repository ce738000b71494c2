"""`mixprec quantize`: offline quantization of a local Hugging Face checkpoint to FP8, NVFP4 or MX (thin CLI).
Under torchrun the work is split across the ranks (producers/quantize_ranks.py); rank 0 prints."""

from __future__ import annotations

import argparse
import json
import statistics

from mixprec.commands import torchrun
from mixprec.commands.algorithm_args import add_algorithm_arguments, algorithm_spec
from mixprec.commands.quantize_dry_run import run_dry_run
from mixprec.errors import MixprecError
from mixprec.evaluation.runner import evaluate
from mixprec.formats import E4M3, get_format
from mixprec.inference.calibration.observers import OBSERVERS
from mixprec.inference.calibration.run import DEFAULT_MIN_TOKENS, DEFAULT_TOLERANCE, DEFAULT_WINDOW, StopRule
from mixprec.inference.checkpoint.direct_file import direct_writes_enabled
from mixprec.inference.checkpoint.layout import LAYOUTS
from mixprec.inference.checkpoint.publish import DEFAULT_MAX_SHARD_SIZE
from mixprec.inference.producers.quantize import quantize_checkpoint
from mixprec.inference.schemes import SCHEMES, InferenceScheme
from mixprec.ranks import launched_rank, launched_world_size
from mixprec.sensitivity.auto_report import write_auto_report
from mixprec.sensitivity.automatic import auto_quantize_checkpoint
from mixprec.sensitivity.scores import METHODS

NAME = "quantize"
TORCHRUN = True  # splits its work across the ranks under torchrun (mixprec.cli lets it through)
AUTO_CALIB_SAMPLES = 16  # sequences the scores are computed on (one forward + backward per 4)
HELP = (
    "quantize a local Hugging Face safetensors checkpoint to FP8, NVFP4 or MXFP4/MXFP8 "
    "(compressed-tensors layout, or HF fp8 for the FP8 schemes)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="input model directory (config.json + safetensors)")
    parser.add_argument(
        "--output", required=True, help="output directory (refused if it exists, unless --force)"
    )
    parser.add_argument(
        "--scheme",
        default="fp8-dynamic",
        help=f"one of {', '.join(SCHEMES)} (default fp8-dynamic), or auto: one scheme per layer under --budget",
    )
    add_format_arguments(parser)
    add_calibration_arguments(parser)
    add_algorithm_arguments(parser)
    add_selection_arguments(parser)
    add_auto_arguments(parser)
    parser.add_argument(
        "--force", action="store_true",
        help="replace an existing output directory; discard a partial run of it (unless --resume)",
    )  # fmt: skip
    parser.add_argument(
        "--resume", action="store_true",
        help="continue the partial run a killed quantize left in .<output>.partial/ beside --output (refused "
        "when its inputs or options differ; without one, start afresh); with --force, the result replaces an "
        "existing --output",
    )  # fmt: skip
    parser.add_argument(
        "--dry-run", action="store_true",
        help="print the plan (layers and schemes, output size, peak memory and time estimates, free disk) "
        "from config.json and the safetensors headers; write nothing",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def add_format_arguments(parser: argparse.ArgumentParser) -> None:
    """The element format and how the checkpoint is laid out on disk."""
    group = parser.add_argument_group("checkpoint format")
    group.add_argument(
        "--dtype",
        default="fp8_e4m3",
        help="element format of the FP8 schemes; only fp8_e4m3 (the guide's spelling) is accepted (NVFP4 and "
        "MX schemes take theirs from --scheme)",
    )
    group.add_argument("--format", default="compressed-tensors", choices=LAYOUTS, help="checkpoint layout")
    group.add_argument("--kv-cache", choices=("fp8",), help="calibrate and write per-layer k_scale / v_scale")
    group.add_argument(
        "--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, help="output shard bound (e.g. 2GB)"
    )


def add_calibration_arguments(parser: argparse.ArgumentParser) -> None:
    """What the static schemes calibrate their activation scales on, and when calibration stops."""
    static = [name for name in SCHEMES if InferenceScheme.from_name(name).needs_calibration]
    group = parser.add_argument_group(
        f"calibration (schemes {', '.join(static)}, --kv-cache; --scheme auto scores on --calib-data)"
    )
    group.add_argument(
        "--calib-data",
        "--calib-dataset",
        dest="calib_data",
        help="calibration text: .txt, folder of .txt, .jsonl with 'text', or a well-known name with a local copy",
    )
    group.add_argument(
        "--calib-samples", type=int, default=None,
        help="most calibration sequences to run (default 512; calibration stops earlier once the scales "
        f"settle); --scheme auto scores on this many (default {AUTO_CALIB_SAMPLES})",
    )  # fmt: skip
    group.add_argument(
        "--calib-tolerance", type=float, default=DEFAULT_TOLERANCE, metavar="SHARE",
        help=f"stop once, over the last --calib-window batches, no Linear input carried more than SHARE of its "
        f"energy above the amax held before each batch (what stopping earlier would have clipped; default "
        f"{DEFAULT_TOLERANCE:g}; 0: run every --calib-samples)",
    )  # fmt: skip
    group.add_argument(
        "--calib-window", type=int, default=DEFAULT_WINDOW, metavar="BATCHES",
        help=f"batches (of 4 sequences) the clipped share is measured over (default {DEFAULT_WINDOW})",
    )  # fmt: skip
    group.add_argument(
        "--calib-min-tokens", type=int, default=DEFAULT_MIN_TOKENS, metavar="N",
        help=f"never stop before N calibration tokens: rare outliers arrive late (default {DEFAULT_MIN_TOKENS})",
    )  # fmt: skip
    group.add_argument(
        "--calib-seq-len", type=int, default=512, help="tokens per calibration sequence (default 512)"
    )
    group.add_argument(
        "--observer", default="max", choices=OBSERVERS, help="activation amax observer (default max)"
    )
    group.add_argument(
        "--layer-by-layer", action=argparse.BooleanOptionalAction, default=None,
        help="calibrate one transformer block at a time (default: when the model exceeds half the free RAM); "
        "--scheme auto also scores block by block (default: when the model in fp32 exceeds half the free RAM)",
    )  # fmt: skip


def add_selection_arguments(parser: argparse.ArgumentParser) -> None:
    """Which Linears stay in high precision, and what happens to those the serving engines refuse."""
    group = parser.add_argument_group("which layers are quantized")
    group.add_argument(
        "--ignore", nargs="+", default=[], metavar="PATTERN",
        help="module names kept in high precision, added to the defaults (lm_head, embeddings, norms, "
        "MoE routers), each with everything below it: dotted name parts the name ends with, globs, or "
        "'re:<regex>' matched from the start of the name (as vLLM reads it)",
    )  # fmt: skip
    group.add_argument(
        "--no-default-ignore", action="store_true", help="do not add the default ignore patterns"
    )
    group.add_argument(
        "--strict", action="store_true",
        help="fail (exit 2, nothing written) instead of keeping in high precision a layer that the serving "
        "engines' shape rules refuse (dims not multiples of 16; vLLM's fused fp8-block shards)",
    )  # fmt: skip


def add_auto_arguments(parser: argparse.ArgumentParser) -> None:
    """--scheme auto: the budget (or perplexity target), the scores and the measured evaluation."""
    group = parser.add_argument_group("--scheme auto (docs/auto.md)")
    group.add_argument(
        "--budget", metavar="BITS|SIZE",
        help="average bits per weight of the quantizable Linears, scales counted (e.g. 6.0), or the whole "
        "checkpoint's size (e.g. 1.2GB)",
    )  # fmt: skip
    group.add_argument(
        "--target-ppl-increase", metavar="REL",
        help="instead of --budget: the smallest checkpoint whose perplexity on --eval-data rises by at most "
        "REL (e.g. 1%%), found by bisection over budgets, each checkpoint measured",
    )  # fmt: skip
    group.add_argument(
        "--score", default="gradient", choices=METHODS,
        help="gradient: sum((grad_out * (Y_q - Y))^2) from one forward+backward per batch (default); "
        "kl: the logits' KL with one layer group in the candidate at a time (slower)",
    )  # fmt: skip
    group.add_argument(
        "--candidates", nargs="+", metavar="SCHEME",
        help=f"schemes to choose from besides keeping the layer (default: all of {', '.join(SCHEMES)})",
    )  # fmt: skip
    group.add_argument(
        "--scores", metavar="FILE",
        help="auto_scores.json of an earlier run to reuse (refused unless model, data, candidates match)",
    )  # fmt: skip
    group.add_argument(
        "--eval-data", metavar="TEXT",
        help="text to measure perplexity on (mixprec evaluate's lm task): the chosen checkpoint, and every "
        "step of --target-ppl-increase",
    )  # fmt: skip
    group.add_argument("--eval-samples", type=int, default=32, help="blocks of --eval-data (default 32)")
    group.add_argument("--eval-seq-len", type=int, default=128, help="tokens per block (default 128)")
    group.add_argument(
        "--search-steps", type=int, default=5, help="evaluations of --target-ppl-increase (default 5)"
    )


def _perplexity(model: str, data: str, samples: int, seq_len: int):
    """measure(checkpoint) -> the lm task's figures of `mixprec evaluate` (reference: the input model)."""

    def measure(candidate) -> dict:
        result = evaluate(
            model, candidate, data=data, task="lm", samples=samples, seq_len=seq_len, progress=False
        )
        lm = result.tasks["lm"]
        keys = ("reference_perplexity", "candidate_perplexity", "perplexity_relative_change", "kl_mean")
        return {k: lm[k] for k in keys} | {"samples": samples, "seq_len": seq_len, "data": str(data)}

    return measure


def run_auto(args: argparse.Namespace) -> int:
    if args.format != "compressed-tensors":
        raise MixprecError("--scheme auto writes the compressed-tensors layout only")
    if args.calib_data is None:
        raise MixprecError("--scheme auto needs --calib-data (text to score the layers on)")
    measure = None
    if args.eval_data is not None:
        measure = _perplexity(args.model, args.eval_data, args.eval_samples, args.eval_seq_len)
    result = auto_quantize_checkpoint(
        args.model, args.output, budget=args.budget, target_ppl_increase=args.target_ppl_increase,
        calib_data=args.calib_data, calib_samples=args.calib_samples or AUTO_CALIB_SAMPLES,
        calib_seq_len=args.calib_seq_len, candidates=args.candidates, score=args.score, scores=args.scores, ignore=args.ignore,
        default_ignore=not args.no_default_ignore, measure=measure, search_steps=args.search_steps,
        force=args.force, progress=not args.quiet and not args.json, max_shard_size=args.max_shard_size,
        observer=args.observer, strict=args.strict, algorithm=algorithm_spec(args),
        layer_by_layer=args.layer_by_layer,
    )  # fmt: skip
    write_auto_report(result, args.output)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    from rich.console import Console

    chosen = result.to_dict()["chosen"]
    schemes = ", ".join(f"{k} {v}" for k, v in chosen["schemes"].items())
    Console().print(
        f"[green]wrote {args.output}[/green]: {chosen['bits_per_weight']:.3f} bits per weight ({schemes} Linears); "
        f"scores {'reused' if result.scores_reused else f'computed in {result.scores.seconds:.0f} s'}; "
        f"report {args.output}/auto_report.html"
    )
    if result.measured:
        m = result.measured
        Console().print(f"perplexity {m['reference_perplexity']:.3f} -> {m['candidate_perplexity']:.3f} "
                        f"({m['perplexity_relative_change']:+.2%})")  # fmt: skip
    return 0


def run(args: argparse.Namespace) -> int:
    direct_writes_enabled()  # a bad $MIXPREC_DIRECT_WRITES fails here, before any work
    if get_format(args.dtype) is not E4M3:
        raise MixprecError(f"--dtype {args.dtype}: only fp8_e4m3 is written for inference checkpoints")
    auto = args.scheme.strip().lower() == "auto"
    if launched_world_size() > 1 and auto:
        raise MixprecError("--scheme auto runs in one process: start it without torchrun")
    if args.dry_run:  # a plan from the headers: rank 0 prints it, the other ranks have nothing to do
        return run_dry_run(args) if launched_rank() == 0 else 0
    if auto:
        if args.resume:
            raise MixprecError("--resume continues one scheme's quantization; --scheme auto does not resume")
        return run_auto(args)
    if args.budget is not None or args.target_ppl_increase is not None:
        raise MixprecError("--budget and --target-ppl-increase are for --scheme auto")
    algorithm = algorithm_spec(args)
    with torchrun.session():
        report = quantize_checkpoint(
            args.model, args.output, args.scheme, ignore=args.ignore, default_ignore=not args.no_default_ignore,
            calib_data=args.calib_data, calib_samples=512 if args.calib_samples is None else args.calib_samples,
            calib_seq_len=args.calib_seq_len, observer=args.observer,
            calib_stop=StopRule(args.calib_tolerance, args.calib_window, args.calib_min_tokens),
            format=args.format, kv_cache=args.kv_cache, force=args.force, max_shard_size=args.max_shard_size,
            layer_by_layer=args.layer_by_layer, progress=not args.quiet and not args.json and launched_rank() == 0,
            strict=args.strict, algorithm=algorithm, resume=args.resume,
        )  # fmt: skip
    if launched_rank() != 0:  # rank 0 prints (the process group is gone by now)
        return 0
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    from rich.console import Console

    console = Console()
    counts = report.summary()
    n_quantized = sum(v for k, v in counts.items() if k.startswith(("fp8", "fp4")))
    console.print(
        f"[green]wrote {args.output}[/green]: {n_quantized} Linear layers quantized ({report.scheme}), "
        f"{len(report.skipped)} kept in high precision; weights {report.weight_bytes_before / 2**20:.1f} MiB -> "
        f"{report.weight_bytes_after / 2**20:.1f} MiB; max relative weight error {report.max_relative_weight_error:.2e}"
    )
    if report.calibration:
        cal = report.calibration
        console.print(f"calibration: {cal['samples']} of at most {cal['samples_available']} samples "
                      f"({cal['tokens']} tokens, {cal['seconds']:.0f} s); {cal['reason']}")  # fmt: skip
    if report.algorithm:
        console.print(_algorithm_line(report.algorithm))
    if report.stages:
        console.print("stages: " + ", ".join(_stage_text(s) for s in report.stages if s["seconds"] >= 0.05))
    for w in report.warnings:
        console.print(f"[yellow]warning:[/yellow] {w}")
    return 0


def _stage_text(stage: dict) -> str:
    peak = stage["peak_rss_bytes"]
    return f"{stage['stage']} {stage['seconds']:.1f} s" + (f" ({peak / 2**30:.2f} GiB peak)" if peak else "")


def _algorithm_line(record: dict) -> str:
    """One line: what ran, and the calibration output error it reached against round to nearest."""
    if "layers" not in record:  # data-free (scale-search alone): nothing was calibrated
        return f"{'+'.join(record['names'])}: every quantized Linear's block scales searched (no calibration)"
    layers = record["layers"].values()
    ratio = statistics.median(
        r["output_error"] / r["output_error_rtn"] for r in layers if r["output_error_rtn"] > 0
    )
    return (
        f"{'+'.join(record['names'])}: {len(record['layers'])} Linears on {record['tokens']} calibration tokens in "
        f"{record['seconds']:.0f} s; calibration output error {ratio:.2f}x round to nearest's (median over layers)"
    )
