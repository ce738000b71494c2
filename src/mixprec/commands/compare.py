"""`mixprec compare`: train under several recipes from the same weights and data order, and judge them.

Under torchrun (`torchrun --nproc-per-node N $(which mixprec) compare ...`, or `-m mixprec compare`) it
runs data-parallel: every rank trains on its slice of every global batch, rank 0 alone prints and
writes --out (mixprec.commands.torchrun, docs/distributed.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mixprec.commands import extras, torchrun
from mixprec.comparison.config import (
    DEFAULT_LR,
    DEFAULT_NULL_RUNS,
    DEFAULT_RECIPES,
    DEFAULT_STEPS,
    DEFAULT_THRESHOLDS,
    POLICIES,
    VERDICT_LOSSES,
    CompareConfig,
    parse_fraction,
)
from mixprec.comparison.export import check_exportable, export_trained, write_heldout
from mixprec.comparison.outdir import stored_config
from mixprec.comparison.page import JUDGED, detectable_line, null_check_line, verdict_label
from mixprec.comparison.runner import compare
from mixprec.distributed.prepare import DataParallel
from mixprec.distributed.world import broadcast_object, is_main_process
from mixprec.errors import MixprecError
from mixprec.verdicts import DIFFERENT, EQUIVALENT, INCONCLUSIVE, WORSE

NAME = "compare"
KEEPS_FREED_MEMORY = True  # its GEMM emulation runs faster so (mixprec.kernels.allocator)
HELP = (
    "train one model under several precision recipes (same weights, same data order) and judge the loss gaps"
)
TORCHRUN = True  # runs data-parallel under torchrun (mixprec.cli lets it through)
# options that say how to run, not what to compare: a `--resume` with them alone takes the stored settings
HOW_TO_RUN = ("out", "resume", "force", "no_progress", "dp", "check_replicas", "strict", "accept_better")


def add_model_and_data_arguments(parser: argparse.ArgumentParser, tokenizer_default: str = "") -> None:
    """--model, --data, --tokenizer and --seed: how `compare` and `profile` take a model and its data."""
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
        help="a Hugging Face tokenizer directory (default: "
        + (tokenizer_default or "byte-level BPE trained on the spot")
        + ")",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="initial weights and data order (default: %(default)s)"
    )


def add_verdict_arguments(parser: argparse.ArgumentParser) -> None:
    """How the runs are judged: margins, precision limits, the losses judged, and the gate (--strict,
    --accept-better)."""
    parser.add_argument(
        "--margin-16bit",
        "--threshold-bf16",
        dest="threshold_bf16",
        default=str(DEFAULT_THRESHOLDS["bf16"]),
        help="equivalence margin of 16-bit recipes against fp32, fraction or percent like 0.1%% (default: %(default)s)",
    )
    parser.add_argument(
        "--margin-fp8",
        "--threshold-fp8",
        dest="threshold_fp8",
        default=str(DEFAULT_THRESHOLDS["fp8"]),
        help="equivalence margin of fp8 recipes against their baseline (default: %(default)s)",
    )
    parser.add_argument(
        "--margin-fp4",
        dest="threshold_fp4",
        default=str(DEFAULT_THRESHOLDS["fp4"]),
        help="equivalence margin of fp4 recipes against their baseline (default: %(default)s)",
    )
    parser.add_argument(
        "--max-saturation",
        default=str(DEFAULT_THRESHOLDS["saturation"]),
        help="largest share of a tensor that may saturate (peak over the run) before the recipe is worse "
        "whatever its loss (default: %(default)s)",
    )
    parser.add_argument(
        "--max-underflow",
        default=str(DEFAULT_THRESHOLDS["underflow"]),
        help="the same for underflow (default: %(default)s)",
    )
    parser.add_argument(
        "--max-underflow-fp4",
        default=str(DEFAULT_THRESHOLDS["underflow_fp4"]),
        help="the same for the underflow of fp4 recipes, whose E2M1 zeroes every value below 1/24 of its "
        "block's maximum by design (default: %(default)s)",
    )
    parser.add_argument(
        "--verdict-loss",
        choices=VERDICT_LOSSES,
        default="both",
        help="which losses must be equivalent: both (the train loss of the last 10 %% of steps and the "
        "held-out loss), or train or val alone (the other is still reported) (default: %(default)s)",
    )
    parser.add_argument(
        "--strict", action="store_true", help="an inconclusive verdict fails too (exit code 1)"
    )
    parser.add_argument(
        "--accept-better",
        action="store_true",
        help="a recipe whose loss is lower than its baseline's by more than the margin (verdict "
        "'different') passes; off by default: a precision change that helps that much changed something "
        "other than rounding (a frozen layer can lower the loss). With --strict, inconclusive still fails",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_training_arguments(parser)
    add_model_and_data_arguments(parser)
    parser.add_argument(
        "--out", default=None, help="output directory for summary.json, metrics.jsonl, report.html"
    )
    parser.add_argument(
        "--baseline",
        default=None,
        help="judge every recipe against this one (default: bf16 vs fp32, fp8 vs bf16)",
    )
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default="default",
        help="training policy of the FP8 recipes: the guide's default, or auto: layers a profile of the "
        "initial model finds beyond --max-saturation / --max-underflow (or below 20 dB SNR) stay in bf16 "
        "(docs/profile.md) (default: %(default)s)",
    )
    add_noise_arguments(parser)
    add_verdict_arguments(parser)
    parser.add_argument(
        "--monitor-every",
        type=int,
        default=None,
        help="precision statistics interval (default: min(100, steps/20))",
    )
    parser.add_argument(
        "--export",
        default="",
        help="comma-separated recipes whose trained model is written to OUT/model-<recipe> (a Hugging Face "
        "directory with the tokenizer, bf16; fp32 for fp32) with OUT/heldout.jsonl, the validation text: "
        "what quantize, evaluate and --scheme auto read (needs --out)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue the interrupted comparison in --out")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--settings",
        default=None,
        help='JSON object of further CompareConfig fields (e.g. \'{"model_config": {"hidden_size": 64}}\')',
    )
    add_data_parallel_arguments(parser)


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The recipes and how each is trained: steps, evaluation interval, batch, sequence length, rate."""
    parser.add_argument(
        "--recipes",
        default=",".join(DEFAULT_RECIPES),
        help="comma-separated recipe names (default: %(default)s)",
    )
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help="training steps per recipe (default: %(default)s)"
    )
    parser.add_argument(
        "--eval-every", type=int, default=None, help="held-out evaluation interval (default: steps/20)"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default: %(default)s)")
    parser.add_argument(
        "--lr", type=float, default=DEFAULT_LR, help="peak learning rate (default: %(default)s)"
    )


def add_noise_arguments(parser: argparse.ArgumentParser) -> None:
    """The null runs whose band is every verdict's yardstick, and the data-order run."""
    parser.add_argument(
        "--null-runs",
        type=int,
        default=DEFAULT_NULL_RUNS,
        help="rounding-level null runs per baseline (same batches, initial weights moved by one ulp): "
        "their band is the yardstick of every verdict; 0: no band (default: %(default)s)",
    )
    parser.add_argument(
        "--recipe-null-runs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="re-run every judged recipe --null-runs times from perturbed weights too, so its own scatter is "
        "measured; --no-recipe-null-runs takes it to equal its baseline's, except against fp32 "
        "(docs/compare.md) (default: %(default)s)",
    )
    parser.add_argument(
        "--order-noise",
        action="store_true",
        help="also re-run each baseline with another data order (reported beside the band, not judged)",
    )
    parser.add_argument(
        "--no-noise", action="store_true", help="no null runs and no data-order run (--null-runs 0)"
    )


def add_data_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """How the runs are spread over the ranks under torchrun."""
    dp = parser.add_argument_group("data parallelism, under torchrun")
    dp.add_argument(
        "--dp",
        choices=("ddp", "fsdp2"),
        default="ddp",
        help="data-parallel wrapping (default: ddp; a single process wraps nothing)",
    )
    dp.add_argument(
        "--check-replicas",
        action="store_true",
        help="keep the trained models and check that every rank holds bit-identical weights and FP8 scales "
        "(exit 1 if not)",
    )


def settings_from_args(args: argparse.Namespace) -> dict:
    """The --settings JSON object (further CompareConfig fields), {} without it."""
    if not args.settings:
        return {}
    try:
        settings = json.loads(args.settings)
    except json.JSONDecodeError as exc:
        raise MixprecError(f"--settings is not a JSON object: {exc}") from None
    if not isinstance(settings, dict):
        raise MixprecError("--settings must be a JSON object")
    return settings


def config_from_args(args: argparse.Namespace, **overrides) -> CompareConfig:
    recipes = tuple(r.strip() for r in args.recipes.split(",") if r.strip())
    if not recipes:
        raise MixprecError("--recipes is empty")
    settings = dict(
        recipes=recipes, steps=args.steps, eval_every=args.eval_every, batch_size=args.batch_size,
        seq_len=args.seq_len, lr=args.lr, seed=args.seed, baseline=args.baseline,
        thresholds={
            "bf16": parse_fraction(args.threshold_bf16),
            "fp8": parse_fraction(args.threshold_fp8),
            "fp4": parse_fraction(args.threshold_fp4),
            "saturation": parse_fraction(args.max_saturation),
            "underflow": parse_fraction(args.max_underflow),
            "underflow_fp4": parse_fraction(args.max_underflow_fp4),
        },
        verdict_loss=args.verdict_loss, policy=args.policy, null_runs=0 if args.no_noise else args.null_runs,
        recipe_null_runs=args.recipe_null_runs, noise=args.order_noise and not args.no_noise, monitor_every=args.monitor_every,
        model_dir=args.model, data=args.data, tokenizer=args.tokenizer, device=args.device,
    )  # fmt: skip
    settings.update(overrides)
    try:
        return CompareConfig(**settings)
    except TypeError as exc:  # an unknown field from --settings
        raise MixprecError(f"--settings: {exc}") from None


VERDICT_COLOUR = {EQUIVALENT: "green", WORSE: "red", DIFFERENT: "magenta", INCONCLUSIVE: "yellow"}


def print_summary(summary) -> None:
    from rich.console import Console
    from rich.table import Table

    which = JUDGED[summary.verdict_loss]
    table = Table(title=f"mixprec compare (verdict on the {which}, against the null runs' band)")
    for col in ("recipe", "baseline", "train gap", "val gap", "train interval", "val interval", "detectable t/v",
                "margin", "sat. peak", "underflow peak", "NaN", "verdict"):  # fmt: skip
        table.add_column(col)

    def pct(x):
        return "–" if x is None else f"{x * 100:+.3f}%"

    def peak(p):
        return "–" if not p else f"{max(v['value'] for v in p.values()) * 100:.2f}%"

    def interval(r, loss):
        iv = r.intervals.get(loss)
        return "–" if not iv else f"[{pct(iv['low'])}, {pct(iv['high'])}]"

    for name, r in summary.recipes.items():
        colour = VERDICT_COLOUR.get(r.verdict, "blue")
        detect = " / ".join(
            "–" if r.detectable.get(k) is None else f"{r.detectable[k] * 100:.2f}%" for k in ("train", "val")
        )
        margin = "–" if r.margin is None else f"{r.margin * 100:.2f}%"
        table.add_row(name, r.baseline or "–", pct(r.train_gap), pct(r.val_gap), interval(r, "train"),
                      interval(r, "val"), detect if r.detectable else "–", margin, peak(r.saturation_peak),
                      peak(r.underflow_peak), str(r.nan_events), f"[{colour}]{verdict_label(r)}[/{colour}]")  # fmt: skip
    # piped or logged output has no terminal width: rich would squeeze the table into 80 columns
    console = Console() if sys.stdout.isatty() else Console(width=180)
    console.print(table)
    for name, r in summary.recipes.items():
        if r.verdict in (WORSE, DIFFERENT, INCONCLUSIVE):
            colour = VERDICT_COLOUR[r.verdict]
            console.print(f"[{colour}]{name}[/{colour}]: " + "; ".join(r.reasons))
    for base, band in summary.bands.items():
        line = null_check_line(base, band.get("null_check"))
        if line:
            ok = band["null_check"]["verdict"] == EQUIVALENT
            console.print(f"[{'green' if ok else 'red'}]{line}[/{'green' if ok else 'red'}]")
        if detectable_line(base, band):
            console.print(detectable_line(base, band), markup=False, highlight=False)
    auto = summary.model.get("automatic_policy")
    for policy in (auto or {}).get("policies", {}).values():  # --policy auto: what each recipe kept in bf16
        kept = policy["kept"]
        console.print(
            f"automatic policy, {policy['recipe']}: {len(kept)} layer(s) kept in bf16", markup=False
        )
        for k in kept:
            console.print(f"  {k['layer']}: {'; '.join(k['reasons'])}", markup=False, highlight=False)
    if summary.report_path:
        console.print(f"report: {summary.report_path}")


def exit_code(summary, strict: bool, accept_better: bool = False) -> int:
    """0: the gate passes (no recipe worse; none different unless accept_better; none inconclusive if
    strict); 1: it does not."""
    return 0 if summary.gate(strict=strict, accept_better=accept_better) else 1


def check_extras(
    args: argparse.Namespace, command: str = NAME, plots: str = "the plots of report.html in --out"
) -> None:
    """The optional packages a command that takes compare's model and data needs, before any work
    (mixprec.commands.extras); `profile` calls it too, naming its own plots."""
    needs = {"transformers": "the model"}
    if args.tokenizer is None:
        needs["tokenizers"] = "the tokenizer trained on the spot (or pass --tokenizer DIR)"
    if args.out:
        needs["matplotlib"] = plots
    extras.require(command, needs)


def run(args: argparse.Namespace) -> int:
    check_extras(args)
    config = config_from_args(args, **settings_from_args(args))
    if args.resume and args.out:
        stored = stored_config(Path(args.out))
        # settings not given again on the command line are taken from the interrupted run
        if stored != config and _is_default_invocation(args):
            config = stored
    exports = tuple(r.strip() for r in args.export.split(",") if r.strip())
    if exports and not args.out:
        raise MixprecError("--export writes into --out: give --out DIR")
    check_exportable(exports, config)
    with torchrun.session() as world:
        torchrun.check_batch(config.batch_size, world)
        summary = compare(
            config=config,
            out=args.out,
            resume=args.resume,
            force=args.force,
            progress=not args.no_progress and is_main_process(),
            prepare=DataParallel(args.dp if world > 1 else "none"),
            keep_models=config.recipes if args.check_replicas else exports,
        )
        if is_main_process():
            print_summary(summary)
            if exports:
                for name, directory in export_trained(summary, Path(args.out), exports).items():
                    print(f"exported {name}: {directory}")
                print(f"held-out text: {write_heldout(Path(args.out), config)}")
        # the verdict is rank 0's (its summary is the one printed and written; the precision statistics
        # are each rank's own): every rank exits with it
        code = broadcast_object(exit_code(summary, args.strict, args.accept_better))
        if args.check_replicas:
            differ = [
                name for name, m in summary.trained_models.items() if not torchrun.replicas_identical(m)
            ]
            if is_main_process():
                print(
                    f"replicas: {'DIFFER for ' + ', '.join(differ) if differ else 'identical'} on {world} ranks"
                )
            code = 1 if differ else code
    return code


def _is_default_invocation(args: argparse.Namespace) -> bool:
    """`mixprec compare --out DIR --resume` alone: continue with the stored settings."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    return all(getattr(args, k) == v for k, v in defaults.items() if k not in HOW_TO_RUN)
