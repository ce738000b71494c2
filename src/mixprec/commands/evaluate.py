"""`mixprec evaluate`: compare a quantized (or bf16) model with its reference; gates on quality, memory, speed."""

from __future__ import annotations

import argparse
from pathlib import Path

from mixprec.commands import extras
from mixprec.commands.algorithm_args import add_algorithm_arguments, algorithm_spec
from mixprec.errors import MixprecError
from mixprec.evaluation import Gates, evaluate, parse_memory_saving, write_report
from mixprec.evaluation.gates import parse_fraction
from mixprec.evaluation.inputs import check_counts
from mixprec.evaluation.intervals import Bootstrap
from mixprec.evaluation.models import CANDIDATE_SCHEMES
from mixprec.files import check_new_output
from mixprec.verdicts import DEFAULT_LEVEL, DEFAULT_RESAMPLES

NAME = "evaluate"
KEEPS_FREED_MEMORY = True  # its GEMM emulation runs faster so (mixprec.kernels.allocator)
HELP = (
    "compare a candidate (FP8/BF16) model with its reference: perplexity, BLEU/ROUGE-L, cosine, CLIP similarity, "
    "memory, speed; confidence intervals and verdicts"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--reference", required=True, metavar="DIR", help="the high-precision model directory"
    )
    who = parser.add_mutually_exclusive_group(required=True)
    who.add_argument(
        "--candidate", metavar="DIR", help="a mixprec / compressed-tensors / HF-fp8 (or plain) model dir"
    )
    who.add_argument(
        "--candidate-scheme", choices=CANDIDATE_SCHEMES, metavar="SCHEME",
        help=f"derive the candidate from the reference online instead: {', '.join(CANDIDATE_SCHEMES)} "
        "(rounded by --algorithm)",
    )  # fmt: skip
    parser.add_argument("--data", required=True, metavar="PATH",
                        help=".txt (one sample per line), folder of .txt/.md, .jsonl with 'text'; "
                        "clip: a folder of images with captions.tsv/.jsonl, or a .jsonl with 'image' and 'text'")  # fmt: skip
    parser.add_argument("--task", nargs="+", metavar="TASK",
                        help="lm, generate, embed, clip (several allowed; default: lm for causal LMs, embed for "
                        "encoders, clip for image-text models)")  # fmt: skip
    parser.add_argument(
        "--samples", type=int, default=1000, help="samples to run through both models (default 1000)"
    )
    parser.add_argument("--paragraphs", action="store_true",
                        help="embed/generate: one sample per blank-line-separated paragraph of a .txt, not per line")  # fmt: skip
    parser.add_argument("--allow-fewer", action="store_true",
                        help="run on fewer samples than --samples when the data has fewer (else: exit 2)")  # fmt: skip
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--max-new-tokens", type=int, default=32, help="generate: greedy tokens per prompt (default 32)"
    )
    parser.add_argument(
        "--prompt-len", type=int, default=None, help="generate: prompt tokens (default min(32, seq_len/2))"
    )
    parser.add_argument(
        "--calib-samples",
        type=int,
        default=32,
        help="static schemes and --algorithm: calibration blocks from --data, after the evaluated ones",
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    parser.add_argument(
        "--decoded-cache", action=argparse.BooleanOptionalAction, default=False,
        help="quantized Linears of a bf16 model keep their weights decoded to bf16 after first use (the fast "
        "CPU path; counted in weights in memory, so an FP8 candidate can outgrow its bf16 reference); "
        "default off: weights decoded per call",
    )  # fmt: skip
    add_algorithm_arguments(parser)
    add_interval_arguments(parser)
    add_gate_arguments(parser)
    parser.add_argument(
        "--json", metavar="PATH", help="write every figure as JSON (schema: docs/schemas/evaluate.md)"
    )
    parser.add_argument("--out", metavar="DIR", help="write a short HTML/PNG report here")
    parser.add_argument(
        "--force", action="store_true", help="overwrite an existing --json file / --out report"
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bars (transformers' included)"
    )


def add_interval_arguments(parser: argparse.ArgumentParser) -> None:
    """The confidence intervals of every quality figure: level, resamples, seed."""
    group = parser.add_argument_group("confidence intervals (paired bootstrap over samples)")
    group.add_argument(
        "--level", type=float, default=DEFAULT_LEVEL, help=f"two-sided level (default {DEFAULT_LEVEL})"
    )
    group.add_argument(
        "--resamples",
        type=int,
        default=DEFAULT_RESAMPLES,
        help=f"bootstrap resamples (default {DEFAULT_RESAMPLES})",
    )
    group.add_argument(
        "--seed", type=int, default=0, help="bootstrap seed (default 0): same seed, same interval"
    )


def add_gate_arguments(parser: argparse.ArgumentParser) -> None:
    """The thresholds that decide the exit code, and whether an inconclusive verdict fails."""
    group = parser.add_argument_group(
        "gates (exit 1 when one is worse: its whole interval beyond the threshold)"
    )
    group.add_argument(
        "--max-ppl-increase", metavar="X", help="relative perplexity increase allowed: 0.001 or 0.1%%"
    )
    group.add_argument(
        "--min-bleu", type=float, metavar="B", help="minimum BLEU (0-100) of the candidate's generations"
    )
    group.add_argument("--min-cosine", type=float, metavar="C", help="minimum mean cosine of the embeddings")
    group.add_argument(
        "--min-memory-saving",
        metavar="S",
        help="weight memory saved: bytes (1.8GB, 500MiB) or a fraction of the reference (0.4, 40%%)",
    )
    group.add_argument(
        "--min-speedup", type=float, metavar="X", help="candidate tokens/s over reference tokens/s"
    )
    group.add_argument(
        "--strict",
        action="store_true",
        help="an inconclusive gate (interval straddling its threshold) fails too",
    )


def _check_outputs(args: argparse.Namespace) -> None:
    if args.json:
        check_new_output(args.json, args.force, label="--json")
    if args.out and (Path(args.out) / "report.html").exists() and not args.force:
        raise MixprecError(f"--out {args.out} already holds a report (use --force to overwrite)")


def check_extras(args: argparse.Namespace) -> None:
    """The optional packages this evaluation needs, before any model is loaded (mixprec.commands.extras)."""
    needs = {"transformers": "loading the models"}
    tasks = {t.strip() for item in args.task or () for t in item.split(",")}
    if "generate" in tasks or args.min_bleu is not None:
        needs.update(sacrebleu="BLEU of --task generate", rouge_score="ROUGE-L of --task generate")
    if "clip" in tasks:
        needs["PIL"] = "reading the images of --task clip"
    if args.out:
        needs["matplotlib"] = "the plots of the --out report"
    extras.require(NAME, needs)


def run(args: argparse.Namespace) -> int:
    # Every argument check before any model is loaded (evaluate() reads configs and data before loading).
    check_counts(samples=args.samples, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                 prompt_len=args.prompt_len, calib_samples=args.calib_samples)  # fmt: skip
    bootstrap = Bootstrap(level=args.level, resamples=args.resamples, seed=args.seed)
    bootstrap.check()
    check_extras(args)
    _check_outputs(args)
    # Parse thresholds before any model is loaded: a typo is a bad input (exit 2), not a failed gate.
    if args.min_memory_saving is not None:
        parse_memory_saving(args.min_memory_saving)
    if args.max_ppl_increase is not None:
        parse_fraction(args.max_ppl_increase, "--max-ppl-increase")
    gates = Gates(
        max_ppl_increase=args.max_ppl_increase, min_bleu=args.min_bleu, min_cosine=args.min_cosine,
        min_memory_saving=args.min_memory_saving, min_speedup=args.min_speedup,
    )  # fmt: skip
    result = evaluate(
        args.reference, args.candidate, candidate_scheme=args.candidate_scheme, data=args.data, task=args.task,
        samples=args.samples, seq_len=args.seq_len, gates=gates, device=args.device, batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens, prompt_len=args.prompt_len, calib_samples=args.calib_samples,
        progress=not args.no_progress, paragraphs=args.paragraphs, allow_fewer=args.allow_fewer,
        bootstrap=bootstrap, strict=args.strict, decoded_cache=args.decoded_cache, algorithm=algorithm_spec(args),
    )  # fmt: skip
    if args.json:
        result.write_json(args.json)
    if args.out:
        write_report(result, args.out)
    _print(result)
    return 0 if result.passed else 1


def _print(result) -> None:
    from rich.console import Console
    from rich.table import Table

    def f(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.6g}"
        return f"{v:,}" if isinstance(v, int) else str(v)

    def ci(task: dict, key: str, fmt=f) -> str:
        iv = task.get("intervals", {}).get(key)
        return "" if not iv else f" [{fmt(iv['low'])}, {fmt(iv['high'])}]"

    def pct(v) -> str:
        return f"{v:+.4%}"

    level = result.settings.get("bootstrap", {}).get("level", 0.95)
    table = Table(title=f"mixprec evaluate — {result.machine['description']}")
    table.add_column("figure")
    table.add_column("reference", justify="right")
    table.add_column(f"candidate ({result.candidate.get('scheme') or 'as loaded'})", justify="right")
    table.add_column(f"change / score [{level:.0%} interval]", justify="right")
    lm = result.tasks.get("lm")
    if lm:
        table.add_row("perplexity", f(lm["reference_perplexity"]), f(lm["candidate_perplexity"]),
                      pct(lm["perplexity_relative_change"]) + ci(lm, "perplexity_relative_change", pct))  # fmt: skip
        table.add_row("top-1 agreement", "", "", f"{lm['top1_agreement']:.4f}" + ci(lm, "top1_agreement"))
        table.add_row("KL mean (nats)", "", "", f"{lm['kl_mean']:.3g}" + ci(lm, "kl_mean"))
    gen = result.tasks.get("generate")
    if gen:
        table.add_row("BLEU", "", "", f"{gen['bleu']:.2f}" + ci(gen, "bleu"))
        table.add_row("ROUGE-L", "", "", f"{gen['rouge_l']:.4f}" + ci(gen, "rouge_l"))
    emb = result.tasks.get("embed")
    if emb:
        table.add_row("cosine mean", "", "", f"{emb['cosine_mean']:.6f}" + ci(emb, "cosine_mean"))
        table.add_row("cosine min", "", "", f"{emb['cosine_min']:.6f}")
    clip = result.tasks.get("clip")
    if clip:
        table.add_row("image-text cosine", f(clip["reference_similarity"]), f(clip["candidate_similarity"]),
                      f"{clip['similarity_change']:+.6f}" + ci(clip, "similarity_change"))  # fmt: skip
        table.add_row("CLIPScore", f(clip["reference_clip_score"]), f(clip["candidate_clip_score"]),
                      f"{clip['clip_score_change']:+.4f}" + ci(clip, "clip_score_change"))  # fmt: skip
        table.add_row("image / text embedding cosine", "", "",
                      f"{clip['image_embedding_cosine']:.6f} / {clip['text_embedding_cosine']:.6f}")  # fmt: skip
    m = result.memory
    table.add_row("weights in memory (bytes)", f(m["reference_weight_bytes_memory"]), f(m["candidate_weight_bytes_memory"]),
                  f"saved {f(m['weight_saving_bytes'])} ({(m['weight_saving_fraction'] or 0):.1%})")  # fmt: skip
    table.add_row(
        "weights on disk (bytes)",
        f(m["reference_weight_bytes_disk"]),
        f(m["candidate_weight_bytes_disk"]),
        "",
    )
    tp = result.throughput
    table.add_row(f"tokens/s ({tp['measured']})", f(tp["reference_tokens_per_s"]), f(tp["candidate_tokens_per_s"]),
                  f"{tp['speedup']:.3f}x" if tp["speedup"] else "-")  # fmt: skip
    table.add_row("peak RSS / CUDA (bytes)", "", "", f"{f(m['peak_rss_bytes'])} / {f(m['peak_cuda_bytes'])}")
    console = Console()
    console.print(table)
    console.print(f"samples used: {result.data['samples_used']}")
    colour = {"equivalent": "green", "worse": "red", "inconclusive": "yellow"}
    for gate in result.gates:
        iv = gate.interval
        where = f", {level:.0%} interval [{f(iv['low'])}, {f(iv['high'])}]" if iv else ""
        settle = ""
        if gate.samples_to_settle:
            settle = (" — no number of samples settles it" if gate.samples_to_settle < 0
                      else f" — about {gate.samples_to_settle} samples would settle it")  # fmt: skip
        mark = "pass" if gate.passed else "FAIL"
        console.print(
            f"gate {gate.name}: measured {f(gate.measured)}{where} vs {gate.bound} {f(gate.threshold)} ({gate.unit}): "
            f"[{colour[gate.verdict]}]{gate.verdict}[/{colour[gate.verdict]}]{settle} -> {mark}"
        )
    for w in result.warnings:
        console.print(f"[yellow]warning:[/yellow] {w}")
    console.print("[bold green]PASSED[/bold green]" if result.passed else "[bold red]FAILED[/bold red]")
