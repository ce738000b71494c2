"""`mixprec profile`: what every FP8 recipe would do to each Linear of a model, from high-precision passes.

Model and data are taken as `mixprec compare` takes them (--model / --data / --tokenizer, or the built-in
small Llama on the Python stdlib corpus), and the passes use compare's first batches. Writes
profile.json (docs/schemas/profile.md) and report.html (heat maps) to --out, and prints, per recipe,
its worst tensors and the layers its automatic policy would keep in bf16.
"""

from __future__ import annotations

import argparse
import sys

from mixprec.commands.compare import add_model_and_data_arguments, check_extras, settings_from_args
from mixprec.comparison.config import CompareConfig, parse_fraction
from mixprec.comparison.runner import load_inputs
from mixprec.data import train_batch
from mixprec.errors import MixprecError
from mixprec.files import check_new_output
from mixprec.kernels import emulation
from mixprec.kernels.hardware import describe_machine
from mixprec.recipes import ROLES
from mixprec.sensitivity import (
    FP4_MIN_SNR_DB,
    FP4_UNDERFLOW_LIMIT,
    MIN_SNR_DB,
    PRECISIONS,
    SATURATION_LIMIT,
    UNDERFLOW_LIMIT,
    Limits,
    Profile,
    automatic_policy,
    profile_model,
    quantizing_recipes,
    resolve_recipes,
    write_profile,
)

NAME = "profile"
KEEPS_FREED_MEMORY = True  # its GEMM emulation runs faster so (mixprec.kernels.allocator)
HELP = (
    "what-if precision profile: per layer and tensor, the saturation, underflow and SNR every FP8 recipe "
    "would give, from a few high-precision passes (no FP8 run); the layers to keep in bf16"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--recipes",
        default=None,
        help=f"comma-separated recipes with options (default: every quantizing recipe: {', '.join(quantizing_recipes())})",
    )
    parser.add_argument(
        "--passes", type=int, default=4, help="forward/backward passes (default: %(default)s)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=16, help="sequences per pass (default: %(default)s)"
    )
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    add_model_and_data_arguments(parser, tokenizer_default="as mixprec compare")
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="bf16",
        help="precision of the passes (default: %(default)s)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=0.0,
        help="learning rate of an AdamW step after every pass (default: 0, the weights stay as given)",
    )
    parser.add_argument(
        "--max-saturation",
        default=str(SATURATION_LIMIT),
        help="automatic policy: keep a layer whose tensor saturates more than this (default: %(default)s)",
    )
    parser.add_argument(
        "--max-underflow",
        default=str(UNDERFLOW_LIMIT),
        help="... or underflows more than this share of its non-zero elements (default: %(default)s)",
    )
    parser.add_argument(
        "--min-snr-db",
        type=float,
        default=MIN_SNR_DB,
        help="... or quantizes below this SNR in dB (default: %(default)s)",
    )
    parser.add_argument(
        "--max-underflow-fp4",
        default=str(FP4_UNDERFLOW_LIMIT),
        help="the underflow limit of FP4 recipes, whose E2M1 zeroes every value below 1/24 of its block's "
        "maximum by design (default: %(default)s)",
    )
    parser.add_argument(
        "--min-snr-db-fp4",
        type=float,
        default=FP4_MIN_SNR_DB,
        help="the SNR limit of FP4 recipes: Gaussian values quantize at 19-20 dB in NVFP4/MXFP4 "
        "(default: %(default)s)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: %(default)s)")
    parser.add_argument("--out", default=None, help="output directory for profile.json and report.html")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--settings",
        default=None,
        help='JSON object of further data/model settings of mixprec compare (e.g. \'{"model_config": {"hidden_size": 64}}\')',
    )


def limits_from_args(args: argparse.Namespace) -> Limits:
    return Limits(
        saturation=parse_fraction(args.max_saturation),
        underflow=parse_fraction(args.max_underflow),
        min_snr_db=args.min_snr_db,
        fp4_underflow=parse_fraction(args.max_underflow_fp4),
        fp4_min_snr_db=args.min_snr_db_fp4,
    )


def inputs_config(args: argparse.Namespace) -> CompareConfig:
    """The data and model settings, as mixprec compare reads them (its CompareConfig, one fp32 run)."""
    try:
        config = CompareConfig(
            recipes=("fp32",), steps=max(1, args.passes), batch_size=args.batch_size, seq_len=args.seq_len,
            seed=args.seed, model_dir=args.model, data=args.data, tokenizer=args.tokenizer, device=args.device,
            **settings_from_args(args),
        )  # fmt: skip
    except TypeError as exc:  # an unknown field from --settings
        raise MixprecError(f"--settings: {exc}") from None
    config.validate()
    return config


def run(args: argparse.Namespace) -> int:
    check_extras(args, NAME, plots="the heat maps of report.html in --out")
    if args.passes < 1:
        raise MixprecError(f"--passes must be a positive integer, got {args.passes}")
    recipes = None if args.recipes is None else [r.strip() for r in args.recipes.split(",") if r.strip()]
    if recipes is not None and not recipes:
        raise MixprecError("--recipes is empty")
    resolve_recipes(recipes)  # unknown or non-quantizing recipes are refused before any work
    limits = limits_from_args(args)
    config = inputs_config(args)
    if args.out:
        check_new_output(args.out, args.force)
    data, model, info = load_inputs(config)
    batches = [train_batch(data, config.batch_size, step, config.seed) for step in range(args.passes)]
    profile = profile_model(
        model, batches, recipes=recipes, precision=args.precision, lr=args.lr, device=config.device,
        progress=not args.no_progress,
    )  # fmt: skip
    profile.model, profile.data = info, data.describe()
    profile.machine = f"{describe_machine()}; {emulation.describe(config.device)}"
    policies = [automatic_policy(profile, r, limits) for r in profile.recipes]
    if args.out:
        write_profile(args.out, profile, policies, force=args.force)
    print_profile(profile, policies, args.out)
    return 0


def print_profile(profile: Profile, policies, out: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"mixprec profile: {len(profile.layers)} layers, {profile.passes} passes (worst pass)"
    )
    for col in ("recipe", "peak saturation", "peak underflow", "lowest SNR", "layers to keep"):
        table.add_column(col)
    for spec, policy in zip(profile.recipes, policies):
        cells = [profile.cell(layer, role, spec) for layer in profile.layer_names for role in ROLES]
        sat = max(cells, key=lambda c: c.peak_saturation)
        und = max(cells, key=lambda c: c.peak_underflow)
        snr = min(cells, key=lambda c: c.min_snr_db)
        table.add_row(
            spec,
            f"{sat.peak_saturation:.2%} {sat.role} {sat.layer}",
            f"{und.peak_underflow:.2%} {und.role} {und.layer}",
            f"{snr.min_snr_db:.1f} dB {snr.role} {snr.layer}",
            str(len(policy.kept)),
        )
    console = Console() if sys.stdout.isatty() else Console(width=200)
    console.print(table)
    for policy in policies:
        if policy.kept:
            console.print(policy.describe(), markup=False, highlight=False)
    console.print(f"{profile.seconds:.1f} s for {profile.passes} passes ({profile.machine})")
    if out:
        console.print(f"report: {out}/report.html")
