"""`mixprec inspect`: a quantized checkpoint's layers, checks and engines (thin CLI)."""

from __future__ import annotations

import argparse
import json

from mixprec.inference.readers.inspection import check_inspectable, inspect_checkpoint

NAME = "inspect"
HELP = (
    "describe a quantized checkpoint (mixprec, compressed-tensors, Hugging Face fp8, ModelOpt): per-layer "
    "table, checks with a verdict, which engines load it"
)
_SHORT = {"float8_e4m3fn": "e4m3", "float32": "f32", "bfloat16": "bf16", "float16": "f16", "uint8": "u8"}
_MARK = {"pass": "[green]pass[/]", "warn": "[yellow]warn[/]", "fail": "[red]fail[/]"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="DIR", help="checkpoint directory (config.json + safetensors)")
    parser.add_argument(
        "--json", action="store_true", help="print the JSON document (docs/schemas/inspect.md)"
    )
    parser.add_argument("--layers", type=int, default=None, metavar="N", help="show only the first N layers")


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def run(args: argparse.Namespace) -> int:
    check_inspectable(args.checkpoint)
    doc = inspect_checkpoint(args.checkpoint)
    failed = int(doc["verdict"] == "fail")
    if args.json:
        print(json.dumps(doc, indent=2))
        return failed
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    q = doc["quantization"]
    console.print(f"[bold]{escape(doc['path'])}[/]: {escape(q['description'])} (from {doc['config_file']})")
    table = Table(title=f"{doc['totals']['quantized_layers']} quantized layers")
    for column in ("layer", "scheme", "payload", "shape", "scales", "bytes"):
        table.add_column(column, justify="right" if column == "bytes" else "left")
    rows = doc["layers"] if args.layers is None else doc["layers"][: args.layers]
    for r in rows:
        scales = ", ".join(
            f"{k} {_SHORT.get(s['dtype'], s['dtype'])} {s['shape']}" for k, s in r["scales"].items()
        )
        table.add_row(
            escape(r["name"]),
            r["scheme"] or "?",
            _SHORT.get(r["payload_dtype"], r["payload_dtype"] or "-"),
            str(r["shape"] or "-"),
            escape(scales),
            _size(r["bytes"]),
        )
    console.print(table)
    t = doc["totals"]
    console.print(
        f"quantized tensors {_size(t['quantized_bytes'])}, other tensors {_size(t['other_bytes'])}, "
        f"total {_size(t['total_bytes'])}; ignore: {escape(', '.join(q['ignore']) or '(none)')}"
    )
    for c in doc["checks"]:
        console.print(f"{_MARK[c['verdict']]}  {c['name']}: {escape(c['detail'])}")
        for item in c["items"][:10]:
            console.print(f"      {escape(item)}")
        if len(c["items"]) > 10:
            console.print(f"      ... and {len(c['items']) - 10} more (--json lists all)")
    for engine, e in doc["engines"].items():
        said = "loads it" if e["loads"] else "does not load it: " + "; ".join(e["reasons"])
        # the reader, not the kernels: whether this device has kernels for the scheme is the note's
        console.print(f"{engine}: {escape(said)} ({escape(e['note'])})")
    return failed
