"""`mixprec formats`: every number format's figures, derived from its bit layout."""

from __future__ import annotations

import argparse
import json

from mixprec.formats import FORMATS

NAME = "formats"
HELP = "print the table of number formats (true values, derived from the bit layouts)"

# What the practitioner's guide quotes for the FP8 ranges, shown beside the true values.
GUIDE_RANGES = {"e4m3": "~1e-6..1e4", "e5m2": "~1e-14..1e4"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def run(args: argparse.Namespace) -> int:
    rows = [fmt.summary() for fmt in FORMATS.values()]
    if args.json:
        print(json.dumps({"schema_version": 1, "formats": rows}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Number formats (derived from bit layouts)")
    for column in ("name", "layout", "bias", "max", "min normal", "min subnormal", "epsilon", "decades",
                   "inf", "NaN", "torch dtype"):  # fmt: skip
        table.add_column(
            column, justify="right" if column not in ("name", "layout", "torch dtype") else "left"
        )
    for r in rows:
        table.add_row(
            r["name"], r["layout"], str(r["bias"]), _fmt(r["max"]), _fmt(r["min_normal"]), _fmt(r["min_subnormal"]),
            _fmt(r["epsilon"]), f"{r['decades']:.2f}", "yes" if r["has_inf"] else "no",
            "yes" if r["has_nan"] else "no", r["torch_dtype"] or "(emulated)",
        )  # fmt: skip
    console = Console()
    console.print(table)
    for name, quoted in GUIDE_RANGES.items():
        f = FORMATS[name]
        console.print(
            f"note: the guide quotes {name.upper()} as {quoted}; its definition gives "
            f"{f.min_subnormal:.3g} (smallest subnormal) to {f.max:g}."
        )
    return 0
