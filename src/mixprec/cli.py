"""The `mixprec` command (also `python -m mixprec`): a thin dispatcher. Each subcommand lives in
mixprec/commands/<name>.py and defines NAME, HELP, add_arguments(parser) and run(args) -> int (0 ok,
1 a gate or verdict failed), and TORCHRUN = True if it runs data-parallel under torchrun (every other
command refuses a multi-process torchrun launch before any work: mixprec.commands.torchrun), and
KEEPS_FREED_MEMORY = True for the compute workflows that run faster when the C allocator keeps freed
memory (mixprec.kernels.allocator; never the streaming quantize, whose peak memory is a promise)."""

from __future__ import annotations

import argparse
import sys

from mixprec import __version__
from mixprec.commands import (
    compare,
    convert,
    demo,
    doctor,
    evaluate,
    export_onnx,
    finetune,
    formats,
    inspect,
    profile,
    quantize,
    quantize_onnx,
    torchrun,
)
from mixprec.errors import MixprecError
from mixprec.kernels import allocator, emulation
from mixprec.ranks import launched_rank

COMMANDS = (
    compare,
    demo,
    profile,
    formats,
    doctor,
    quantize,
    inspect,
    convert,
    evaluate,
    finetune,
    export_onnx,
    quantize_onnx,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mixprec",
        description="Take PyTorch models to BF16 and FP8, for training and inference, and verify nothing was lost.",
    )
    parser.add_argument("--version", action="version", version=f"mixprec {__version__}")
    parser.add_argument("--debug", action="store_true", help="show a traceback on errors")
    parser.add_argument(
        "--gemm-emulation",
        choices=emulation.BACKENDS,
        help="arithmetic of the emulated FP8/FP4 GEMMs on the CPU: bf16 units where the CPU has them "
        f"(auto, the default), or fp32 to reproduce numbers across machines (also ${emulation.ENV_VAR})",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        command = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(
            _run=module.run,
            _torchrun=getattr(module, "TORCHRUN", False),
            _keep_freed=getattr(module, "KEEPS_FREED_MEMORY", False),
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        refusal = torchrun.refuse_reason(args.command, args._torchrun)
        if refusal and launched_rank() != 0:
            # Every rank meets this refusal (it depends on WORLD_SIZE only) and rank 0 reports it. A
            # rank that exited non-zero first would make torchrun kill rank 0 before it could print,
            # so the other ranks leave quietly and the job fails with rank 0's exit code 2.
            return 0
        if refusal:
            raise MixprecError(refusal)
        emulation.requested()  # a bad $MIXPREC_GEMM_EMULATION fails here, before any work
        emulation.set_backend(args.gemm_emulation)
        if args._keep_freed:
            allocator.requested()  # a bad $MIXPREC_MALLOC fails here, before any work
            allocator.keep_freed_memory()
        return int(args._run(args) or 0)
    except MixprecError as err:
        if args.debug:
            raise
        if launched_rank() == 0:  # under torchrun every rank meets the same error: rank 0 says it
            print(f"mixprec {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mixprec {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        emulation.set_backend(None)


if __name__ == "__main__":
    sys.exit(main())
