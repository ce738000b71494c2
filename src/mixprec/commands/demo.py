"""`mixprec demo`: the end-to-end demonstration on embedded defaults (the README's first command)."""

from __future__ import annotations

import argparse

from rich.console import Console

from mixprec.commands import extras
from mixprec.commands.compare import print_summary
from mixprec.demo import CONTROLS, DETECTED, REAL_RECIPES, run_demo
from mixprec.verdicts import EQUIVALENT

NAME = "demo"
KEEPS_FREED_MEMORY = True  # its GEMM emulation runs faster so (mixprec.kernels.allocator)
HELP = "compare bf16/fp8 training of a small built-in Llama (with null runs and a negative control), quantize the result to FP8 and evaluate it"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="mixprec-demo", help="output directory (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    parser.add_argument(
        "--steps", type=int, default=None, help="training steps per recipe (default: the demo's own)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    extras.require(
        NAME,
        {
            "transformers": "the built-in model and the FP8 evaluation",
            "tokenizers": "the tokenizer trained on the spot",
            "matplotlib": "the plots of the report",
        },
    )
    result = run_demo(args.out, force=args.force, progress=not args.no_progress, steps=args.steps)
    print_summary(result.training)
    console = Console()
    recipes = result.training.recipes
    for name in REAL_RECIPES:
        if name in recipes:
            ok = recipes[name].verdict == EQUIVALENT
            shown = "[green]shown equivalent[/green]" if ok else "[red]NOT shown equivalent[/red]"
            console.print(f"real recipe {name}: {recipes[name].verdict} ({shown})")
    for control in CONTROLS:
        if control in recipes:
            verdict = recipes[control].verdict
            caught = "[green]detected[/green]" if verdict in DETECTED else "[red]NOT detected[/red]"
            gap = recipes[control].train_gap
            console.print(f"control {control}: {verdict} ({caught}; train gap {gap * 100:+.2f}%)" if gap is not None
                          else f"control {control}: {verdict} ({caught})")  # fmt: skip
    info = result.inference
    if info.get("status") == "done":
        console.print(f"FP8 inference: {'[green]pass[/green]' if info['passed'] else '[red]FAIL[/red]'} "
                      f"(quantized model: {info['quantized_dir']})")  # fmt: skip
    else:
        console.print(f"FP8 inference: not run ({info.get('reason')})")
    console.print(f"demo finished in {result.seconds['total']:.0f} s")
    console.print(f"report: [bold]{result.report_path.resolve()}[/bold]")
    return 0 if result.passed else 1
