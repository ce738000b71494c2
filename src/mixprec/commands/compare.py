"""`mixprec compare`: train under several recipes from the same weights and data order, and judge them."""

from __future__ import annotations

import argparse
import sys

NAME = "compare"
HELP = (
    "train one model under several precision recipes (same weights, same data order) and judge the loss gaps"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mixprec.comparison.config import DEFAULT_RECIPES, DEFAULT_THRESHOLDS

    parser.add_argument(
        "--recipes",
        default=",".join(DEFAULT_RECIPES),
        help="comma-separated recipe names (default: %(default)s)",
    )
    parser.add_argument(
        "--steps", type=int, default=1000, help="training steps per recipe (default: %(default)s)"
    )
    parser.add_argument(
        "--eval-every", type=int, default=None, help="held-out evaluation interval (default: steps/20)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=16, help="sequences per step (default: %(default)s)"
    )
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default: %(default)s)")
    parser.add_argument(
        "--model",
        default=None,
        help="a local Hugging Face causal LM directory (default: the built-in small Llama)",
    )
    parser.add_argument(
        "--data",
        default=None,
        help=".txt file, folder of .txt/.md, or .jsonl with a 'text' field (default: the Python stdlib sources)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="a Hugging Face tokenizer directory (default: byte-level BPE trained on the spot)",
    )
    parser.add_argument(
        "--out", default=None, help="output directory for summary.json, metrics.jsonl, report.html"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="initial weights and data order (default: %(default)s)"
    )
    parser.add_argument(
        "--baseline",
        default=None,
        help="judge every recipe against this one (default: bf16 vs fp32, fp8 vs bf16)",
    )
    parser.add_argument(
        "--threshold-bf16",
        default=str(DEFAULT_THRESHOLDS["bf16"]),
        help="largest accepted gap for 16-bit recipes, fraction or percent like 0.1%% (default: %(default)s)",
    )
    parser.add_argument(
        "--threshold-fp8",
        default=str(DEFAULT_THRESHOLDS["fp8"]),
        help="largest accepted gap for fp8 recipes (default: %(default)s)",
    )
    parser.add_argument(
        "--max-saturation",
        default=str(DEFAULT_THRESHOLDS["saturation"]),
        help="largest share of a tensor that may saturate before a gap within the noise counts as a "
        "failure (default: %(default)s)",
    )
    parser.add_argument(
        "--max-underflow",
        default=str(DEFAULT_THRESHOLDS["underflow"]),
        help="the same for underflow (default: %(default)s)",
    )
    parser.add_argument(
        "--verdict-loss",
        choices=("val", "train"),
        default="train",
        help="which loss the verdict compares (default: %(default)s)",
    )
    parser.add_argument(
        "--no-noise", action="store_true", help="skip the baseline re-run with a changed data order"
    )
    parser.add_argument(
        "--monitor-every",
        type=int,
        default=None,
        help="precision statistics interval (default: min(100, steps/20))",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue the interrupted comparison in --out")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def config_from_args(args: argparse.Namespace, **overrides):
    from mixprec.comparison.config import CompareConfig, parse_fraction
    from mixprec.errors import MixprecError

    recipes = tuple(r.strip() for r in args.recipes.split(",") if r.strip())
    if not recipes:
        raise MixprecError("--recipes is empty")
    settings = dict(
        recipes=recipes, steps=args.steps, eval_every=args.eval_every, batch_size=args.batch_size,
        seq_len=args.seq_len, lr=args.lr, seed=args.seed, baseline=args.baseline,
        thresholds={
            "bf16": parse_fraction(args.threshold_bf16),
            "fp8": parse_fraction(args.threshold_fp8),
            "saturation": parse_fraction(args.max_saturation),
            "underflow": parse_fraction(args.max_underflow),
        },
        verdict_loss=args.verdict_loss, noise=not args.no_noise, monitor_every=args.monitor_every,
        model_dir=args.model, data=args.data, tokenizer=args.tokenizer, device=args.device,
    )  # fmt: skip
    settings.update(overrides)
    return CompareConfig(**settings)


def print_summary(summary) -> None:
    from rich.console import Console
    from rich.table import Table

    which = "validation" if summary.verdict_loss == "val" else "train"
    table = Table(title=f"mixprec compare (verdict on the {which} loss)")
    for col in (
        "recipe",
        "baseline",
        "train gap",
        "val gap",
        "baseline noise t/v",
        "sat. peak",
        "underflow peak",
        "NaN",
        "verdict",
    ):
        table.add_column(col)

    def pct(x):
        return "–" if x is None else f"{x * 100:+.3f}%"

    def peak(p):
        return "–" if not p else f"{max(v['value'] for v in p.values()) * 100:.2f}%"

    for name, r in summary.recipes.items():
        colour = {"pass": "green", "fail": "red", "inconclusive": "yellow"}.get(r.verdict, "blue")
        noise = "–" if r.noise_train is None else f"{pct(r.noise_train)} / {pct(r.noise_val)}"
        table.add_row(name, r.baseline or "–", pct(r.train_gap), pct(r.val_gap), noise, peak(r.saturation_peak),
                      peak(r.underflow_peak), str(r.nan_events), f"[{colour}]{r.verdict}[/{colour}]")  # fmt: skip
    # piped or logged output has no terminal width: rich would squeeze the table into 80 columns
    console = Console() if sys.stdout.isatty() else Console(width=160)
    console.print(table)
    for name, r in summary.recipes.items():
        if r.verdict in ("fail", "inconclusive"):
            colour = "red" if r.verdict == "fail" else "yellow"
            console.print(f"[{colour}]{name}[/{colour}]: " + "; ".join(r.reasons))
    if summary.report_path:
        console.print(f"report: {summary.report_path}")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mixprec.comparison.outdir import stored_config
    from mixprec.comparison.runner import compare

    config = config_from_args(args)
    if args.resume and args.out:
        stored = stored_config(Path(args.out))
        # settings not given again on the command line are taken from the interrupted run
        if stored != config:
            config = stored if _is_default_invocation(args) else config
    summary = compare(
        config=config, out=args.out, resume=args.resume, force=args.force, progress=not args.no_progress
    )
    print_summary(summary)
    return summary.exit_code


def _is_default_invocation(args: argparse.Namespace) -> bool:
    """`mixprec compare --out DIR --resume` alone: continue with the stored settings."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    return all(
        getattr(args, k) == v
        for k, v in defaults.items()
        if k not in ("out", "resume", "force", "no_progress")
    )
