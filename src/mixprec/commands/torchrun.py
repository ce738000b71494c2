"""torchrun entry point for mixprec's training commands.

    torchrun --nproc-per-node 2 -m mixprec.commands.torchrun compare --recipes bf16,fp8-delayed --out runs/c
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
             --rdzv-id job1 -m mixprec.commands.torchrun compare ...

Every rank runs the same comparison with the same seed; each takes its slice of every global batch
(--batch-size must divide by the world size), gradients are averaged (DDP by default, --dp fsdp2 for
FSDP2), the logged losses are means over ranks, and only rank 0 writes --out and prints. Run without
torchrun it is exactly `mixprec compare`.
"""

from __future__ import annotations

import argparse
import json
import sys

from mixprec.errors import MixprecError


def build_parser() -> argparse.ArgumentParser:
    from mixprec.commands import compare as compare_cmd

    parser = argparse.ArgumentParser(
        prog="torchrun ... -m mixprec.commands.torchrun",
        description="mixprec commands under torchrun (data parallel over every rank of the job)",
    )
    parser.add_argument("--debug", action="store_true", help="show a traceback on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cmp = sub.add_parser("compare", help=compare_cmd.HELP, description=compare_cmd.HELP)
    compare_cmd.add_arguments(cmp)
    cmp.add_argument(
        "--dp", choices=("ddp", "fsdp2"), default="ddp", help="data-parallel wrapping (default: ddp)"
    )
    cmp.add_argument(
        "--check-replicas",
        action="store_true",
        help="keep the trained models and check that every rank holds bit-identical weights and FP8 scales "
        "(exit 1 if not)",
    )
    cmp.add_argument(
        "--settings",
        default=None,
        help='JSON object of further CompareConfig fields (e.g. \'{"model_config": {"hidden_size": 64}}\')',
    )
    return parser


def check_batch(batch_size: int, world: int) -> None:
    if batch_size % world:
        raise MixprecError(
            f"--batch-size {batch_size} does not split evenly over {world} ranks; use a multiple of {world} "
            "(the global batch is the same as in a single-process run, each rank takes its slice)"
        )


def run_compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mixprec.commands.compare import config_from_args, print_summary
    from mixprec.comparison import outdir
    from mixprec.comparison.outdir import stored_config
    from mixprec.comparison.runner import compare
    from mixprec.distributed.prepare import DataParallel
    from mixprec.distributed.world import is_main_process, world_size

    overrides = {}
    if args.settings:
        try:
            overrides = json.loads(args.settings)
        except json.JSONDecodeError as exc:
            raise MixprecError(f"--settings is not a JSON object: {exc}") from None
        if not isinstance(overrides, dict):
            raise MixprecError("--settings must be a JSON object")
    try:
        config = config_from_args(args, **overrides)
    except TypeError as exc:
        raise MixprecError(f"--settings: {exc}") from None
    if args.resume and args.out:
        config = stored_config(Path(args.out))  # continue the interrupted run with its own settings
    check_batch(config.batch_size, world_size())
    if args.dp == "fsdp2" and world_size() > 1 and not _loop_supports("fsdp2"):
        raise MixprecError(
            "--dp fsdp2: this version of the comparison loop builds its optimizer before wrapping the model, "
            "which FSDP2 cannot take; use --dp ddp (see docs/distributed.md)"
        )
    if args.resume and world_size() > 1 and not _loop_supports("resume"):
        raise MixprecError(
            "--resume under torchrun needs every rank to read the run's checkpoint; this version of the "
            "comparison loop reads it on rank 0 only (see docs/distributed.md)"
        )
    if args.out:
        # every rank checks (rank 0 alone would raise while the others wait in a collective)
        outdir.check_out_dir(Path(args.out), config, resume=args.resume, force=args.force)
    dp = DataParallel(args.dp if world_size() > 1 else "none")
    summary = compare(
        config=config,
        out=args.out,
        resume=args.resume,
        force=args.force,
        progress=not args.no_progress and is_main_process(),
        prepare=dp,
        keep_models=config.recipes if args.check_replicas else (),
    )
    if is_main_process():
        print_summary(summary)
    code = summary.exit_code
    if args.check_replicas:
        differ = [name for name, model in summary.trained_models.items() if not replicas_identical(model)]
        if is_main_process():
            print(
                f"replicas: {'DIFFER for ' + ', '.join(differ) if differ else 'identical'} on {world_size()} ranks"
            )
        code = 1 if differ else code
    return code


def _loop_supports(feature: str) -> bool:
    """Whether mixprec.comparison.training_run declares support for a distributed feature (DISTRIBUTED_FEATURES)."""
    from mixprec.comparison import run

    return feature in getattr(run, "DISTRIBUTED_FEATURES", ())


def replicas_identical(model) -> bool:
    """Every rank holds bit-identical parameters and FP8 scaling buffers; True in one process."""
    import torch
    import torch.distributed as dist

    from mixprec.distributed.world import device_for_rank, world_size

    if world_size() == 1:
        return True
    # parameters and floating buffers (the FP8 amax histories and scales: amax reduction keeps them equal);
    # FSDP2 shards differ by design: compare the whole parameters (full_tensor is a collective, called in
    # the same order on every rank)
    params = [p.full_tensor() if hasattr(p, "placements") else p for p in model.parameters()]
    tensors = [*params, *(b for b in model.buffers() if b.is_floating_point())]
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors]).to(device_for_rank())
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return bool(torch.equal(hi, lo))


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from mixprec.distributed.world import init_from_env, is_main_process

    args = build_parser().parse_args(argv)
    init_from_env()
    try:
        return run_compare(args)
    except MixprecError as err:
        if args.debug:
            raise
        if is_main_process():
            print(f"mixprec {args.command}: error: {err}", file=sys.stderr)
        return 2
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
