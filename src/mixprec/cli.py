"""The `mixprec` command: a thin dispatcher. Each subcommand lives in mixprec/commands/<name>.py and
defines NAME, HELP, add_arguments(parser) and run(args) -> int (0 ok, 1 a gate or verdict failed)."""

from __future__ import annotations

import argparse
import importlib
import sys

from mixprec.errors import MixprecError

COMMAND_MODULES = (
    "compare",
    "demo",
    "formats",
    "doctor",
    "quantize",
    "evaluate",
    "export_onnx",
    "onnx",
)


def build_parser() -> argparse.ArgumentParser:
    from mixprec import __version__

    parser = argparse.ArgumentParser(
        prog="mixprec",
        description="Take PyTorch models to BF16 and FP8, for training and inference, and verify nothing was lost.",
    )
    parser.add_argument("--version", action="version", version=f"mixprec {__version__}")
    parser.add_argument("--debug", action="store_true", help="show a traceback on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        module = importlib.import_module(f"mixprec.commands.{module_name}")
        command = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except MixprecError as err:
        if args.debug:
            raise
        print(f"mixprec {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mixprec {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
