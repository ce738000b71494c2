"""The command-line flags of the algorithms (`--algorithm gptq` and GPTQ's parameters), shared by
`mixprec quantize` and `mixprec evaluate --candidate-scheme`."""

from __future__ import annotations

import argparse

from mixprec.inference.algorithms.spec import (
    ALGORITHMS,
    AWQ_SCALES,
    RTN,
    AlgorithmSpec,
    FoldParams,
    GptqParams,
)


def add_algorithm_arguments(parser: argparse.ArgumentParser) -> None:
    """What rounds the weights beyond round to nearest (docs/algorithms.md)."""
    group = parser.add_argument_group("algorithms (docs/algorithms.md)")
    group.add_argument(
        "--algorithm", default=RTN, metavar="NAME[,NAME]",
        help="rtn: round to nearest (default); gptq: GPTQ on --calib-data, every Linear rounded with its "
        "scheme's own scale rule; scale-search: FP4 / MX block scales of least squared error (4 over 6 "
        "included; with gptq: the scales GPTQ rounds with); rotate, smoothquant, awq: folds written into the "
        f"weights before calibration; several run in that order (known: {', '.join(ALGORITHMS)})",
    )  # fmt: skip
    defaults = GptqParams()
    group.add_argument("--gptq-damp", type=float, default=defaults.damp, metavar="FRACTION",
                       help=f"added to the Hessian diagonal, a fraction of its mean (default {defaults.damp})")  # fmt: skip
    group.add_argument("--gptq-block", type=int, default=defaults.block, metavar="COLUMNS",
                       help=f"columns per lazy update (default {defaults.block})")  # fmt: skip
    group.add_argument(
        "--act-order", action=argparse.BooleanOptionalAction, default=defaults.act_order,
        help="GPTQ: columns by decreasing Hessian diagonal, group scales fixed up front (default on)",
    )  # fmt: skip
    group.add_argument(
        "--sequential", action=argparse.BooleanOptionalAction, default=defaults.sequential,
        help="GPTQ: calibrate each block on the outputs of the blocks before it with their weights rounded "
        "(default on); --no-sequential: on the unquantized outputs",
    )  # fmt: skip
    add_fold_arguments(group)


def add_fold_arguments(group: argparse._ArgumentGroup) -> None:
    """The parameters of the folds (rotate, smoothquant, awq)."""
    folds = FoldParams()
    group.add_argument("--rotate-seed", type=int, default=folds.seed, metavar="N",
                       help=f"rotate: seed of the random orthogonal matrices (default {folds.seed})")  # fmt: skip
    group.add_argument("--smoothquant-alpha", type=float, default=folds.alpha, metavar="A",
                       help=f"smoothquant: migration strength in [0, 1] (default {folds.alpha})")  # fmt: skip
    group.add_argument("--awq-grid", type=int, default=folds.n_grid, metavar="N",
                       help=f"awq: grid points of the scale exponent in [0, 1) (default {folds.n_grid})")  # fmt: skip
    group.add_argument("--awq-scales", choices=AWQ_SCALES, default=folds.awq_scales,
                       help="awq: the scales searched: duo (activation and weight magnitudes), activation "
                       f"(activation magnitudes only) or both (default {folds.awq_scales})")  # fmt: skip


def algorithm_spec(args: argparse.Namespace) -> AlgorithmSpec:
    """--algorithm and its parameters, checked before any work."""
    return AlgorithmSpec.parse(args.algorithm, damp=args.gptq_damp, block=args.gptq_block,
                               act_order=args.act_order, sequential=args.sequential, seed=args.rotate_seed,
                               alpha=args.smoothquant_alpha, n_grid=args.awq_grid,
                               awq_scales=args.awq_scales)  # fmt: skip


__all__ = ["add_algorithm_arguments", "algorithm_spec"]
