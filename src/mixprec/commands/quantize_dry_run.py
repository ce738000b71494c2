"""`mixprec quantize --dry-run`: print the plan (mixprec.inference.producers.quantize_plan) and write
nothing. Exit status 2 (a MixprecError) when the output will not fit on the disk, after the plan."""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter

from mixprec.commands.algorithm_args import algorithm_spec
from mixprec.errors import MixprecError
from mixprec.inference.calibration.run import StopRule
from mixprec.inference.producers.quantize_plan import QuantizePlan, plan_quantize


def _process_age() -> float:
    """Seconds since this process started (its start-up: interpreter and imports), 0 where unknown."""
    try:
        import os

        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def run_dry_run(args: argparse.Namespace) -> int:
    if args.scheme.strip().lower() == "auto":
        raise MixprecError(
            "--dry-run plans one fixed scheme; --scheme auto chooses per layer from scores "
            "it must compute first"
        )
    startup = _process_age()
    plan = plan_quantize(
        args.model,
        args.output,
        args.scheme,
        ignore=args.ignore,
        default_ignore=not args.no_default_ignore,
        calib_data=args.calib_data,
        calib_samples=512 if args.calib_samples is None else args.calib_samples,
        calib_seq_len=args.calib_seq_len,
        observer=args.observer,
        calib_stop=StopRule(args.calib_tolerance, args.calib_window, args.calib_min_tokens),
        format=args.format,
        kv_cache=args.kv_cache,
        force=args.force,
        max_shard_size=args.max_shard_size,
        layer_by_layer=args.layer_by_layer,
        strict=args.strict,
        algorithm=algorithm_spec(args),
        startup_seconds=startup,
    )
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print("\n".join(plan_lines(plan)))
    if not plan.disk["fits"]:
        raise MixprecError(plan.warnings[-1])
    return 0


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)


def plan_lines(plan: QuantizePlan) -> list[str]:
    """The plan in words: layers grouped by name pattern (block numbers as *), sizes, estimates."""
    gb = 1e9
    lines = [
        f"plan (nothing written): {plan.model} -> {plan.output}: {plan.scheme} ({plan.format}"
        f"{', ' + '+'.join(plan.algorithm) if plan.algorithm else ''}), {plan.path}",
        f"layers: {len(plan.layers)} Linear weights quantized, {len(plan.kept)} weights kept in high precision",
    ]
    groups = Counter((_pattern(n), e["scheme"], tuple(e["shape"])) for n, e in plan.layers.items())
    lines += [f"  {p}  {k} x {s} {list(shape)}" for (p, s, shape), k in groups.items()]
    kept = Counter((_pattern(n), why) for n, why in plan.kept.items())
    lines += [f"  kept: {p}{f' (x{k})' if k > 1 else ''}: {why}" for (p, why), k in kept.items()]
    other = sum(plan.files.values())
    lines.append(
        f"output: {plan.output_bytes / gb:.3f} GB: {len(plan.shard_bytes)} shard(s) "
        f"{sum(plan.shard_bytes) / gb:.3f} GB + other files {other / 1e6:.1f} MB "
        f"(input {plan.input_bytes / gb:.3f} GB)"
    )
    mem = plan.memory
    lines.append(f"peak memory: {mem.total / 2**30:.2f} GiB ({mem.formula})")
    lines += [f"  {v / 2**20:10.1f} MiB  {k}" for k, v in mem.terms.items()]
    lines += [f"  {n}" for n in mem.notes]
    if plan.time is None:
        lines.append("time: not probed")
    else:
        lines.append(f"time: {plan.time.total:.1f} s ({plan.time.formula})")
        lines += [f"  {v:10.1f} s  {k}" for k, v in plan.time.terms.items()]
        lines += [f"  {n}" for n in plan.time.notes]
    if plan.calibration:
        c = plan.calibration
        lines.append(f"calibration: at most {c['samples_at_most']} x {c['seq_len']} tokens")
    d = plan.disk
    lines.append(
        f"disk: {d['free_bytes'] / gb:.2f} GB free at {d['at']}, the run writes {d['needed_bytes'] / gb:.3f} GB: "
        f"{'fits' if d['fits'] else 'WILL NOT FIT'}"
    )
    lines += [f"warning: {w}" for w in plan.warnings]
    return lines


__all__ = ["plan_lines", "run_dry_run"]
