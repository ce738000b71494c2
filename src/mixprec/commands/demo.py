"""`mixprec demo`: the end-to-end demonstration on embedded defaults."""

from __future__ import annotations

import argparse

NAME = "demo"
HELP = "run the end-to-end demonstration on the built-in model and corpus"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="mixprec-demo", help="output directory (default: mixprec-demo)")


def run(args: argparse.Namespace) -> int:
    from mixprec.cli import main

    main(["formats"])
    return main(["doctor"])
