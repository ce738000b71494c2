"""Where the time of mixprec's workflows goes (issue 27): GEMMs, the quantizer, stochastic rounding, the rest.

    python bench/profile_workflows.py                                  # train, demo, compare, quantize
    python bench/profile_workflows.py --workflows train --json prof.json
    python bench/profile_workflows.py --workflows evaluate --eval-model ./smol-hf   # a local HF causal LM

Workflows: train: a training step (forward, backward, mixprec.AdamW, scaling advance) per recipe at
bench/bench_training_step.py's shape: 4 x Linear(1024, 1024), 2048 tokens. demo: `mixprec demo`; compare:
the default `mixprec compare --out cmp`; both with their model, data and intervals, 12 steps a run, no
null runs, extrapolated: each phase's bucket times per call (a training step of recipe R, a held-out
evaluation of R, a run's set-up) times its count in the full workflow (run_specs of the default
configuration); the rest (data, tokenizer, reports, the demo's inference half) once. evaluate (with
--eval-model): `mixprec evaluate` of fp8-dynamic and nvfp4a16 candidates, task lm. quantize: `mixprec
quantize --scheme nvfp4a16` of bench_checkpoint_quantize's synthetic Llama (real shapes: hidden 2048).

Each runs once plain (its wall time) and once under torch.profiler (CPU activities, all threads, no
shapes or stacks). Each op's self CPU time goes into a bucket by its name and the innermost range around
it: "GEMM emu" (mm/addmm/... in an emulated GEMM or a quantized Linear's forward: what a native bf16
backend would run instead), "GEMM native" (other GEMMs, attention), "decode" (the emulated GEMM's other
ops: decode, scales, casts), "quantizer" (mixprec.quantization's entry), "SR" (stochastic rounding: FP4
gradients, bf16 moments), "RHT" (random Hadamard transform), "optimizer" (torch's Optimizer.step range),
"other ops"; "Python" = wall - op self times - waits for worker threads - the profiler's own cost
(profiled - plain wall, spread by number of events): Python, autograd, dispatch, I/O outside ops.

The ranges are wrapped around mixprec's entry points for the profiled run only (wrapped_entries): a
record_function costs ~6 us here, ~6 % of a quantize call at the demo's sizes: too much for the library.

Amdahl bounds: if the emulated GEMMs ran k x faster (k: bf16 vs fp32 torch.mm time at the workflow's
emulated GEMM shapes, measured here in the same run, count-weighted) and decode + quantizer + SR + RHT
r x faster, the whole workflow is at best S(k, r) = 1 / (f_gemm_emu / k + f_quant / r + f_rest) faster.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).parent))

BUCKETS = ("gemm_emu", "gemm_native", "decode", "quantizer", "sr", "rht", "optim", "other", "python")
LABELS = {
    "gemm_emu": "GEMM emu", "gemm_native": "GEMM native", "decode": "decode", "quantizer": "quantizer",
    "sr": "SR", "rht": "RHT", "optim": "optimizer", "other": "other ops", "python": "Python",
}  # fmt: skip
R_BUCKETS = ("decode", "quantizer", "sr", "rht")  # what a fast quantizer / decode speeds up (r)
GEMM_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::matmul", "aten::linear",
    "aten::mv", "aten::addmv", "aten::dot", "aten::_addmm_activation", "aten::_scaled_mm", "aten::mkldnn_linear",
})  # fmt: skip
ATTENTION = ("aten::scaled_dot_product", "aten::_scaled_dot_product")  # fused attention, forward and backward
# the ranges wrapped around mixprec's entry points: (module, attribute, range)
ENTRIES = (
    ("mixprec.quantization", "_quantize", "mixprec.quantize"),
    ("mixprec.rounding", "stochastic_round_to_grid", "mixprec.sr"),
    ("mixprec.rounding", "stochastic_round", "mixprec.sr"),
    ("mixprec.rounding", "stochastic_round_pair_into", "mixprec.sr"),
    ("mixprec.gemm", "_emulated", "mixprec.emulated_gemm"),
    ("mixprec.hadamard", "transform_rows", "mixprec.rht"),
    ("mixprec.hadamard", "transform_columns", "mixprec.rht"),
)
# and around methods; a worker thread's task and the main thread's wait for it (streaming quantize)
WAIT, TASK = "mixprec.wait", "mixprec.task"
METHODS = (
    ("mixprec.scaling", "QuantizedTensor", "dequantize", "mixprec.dequantize"),
    ("concurrent.futures", "Future", "result", WAIT),
    ("concurrent.futures.thread", "_WorkItem", "run", TASK),
)
LINEAR_MODULE = "mixprec.inference.runtime.linear"  # every class defining forward: "mixprec.linear"
RANGE_BUCKET = {"mixprec.quantize": "quantizer", "mixprec.sr": "sr", "mixprec.rht": "rht"}
EMULATION_RANGES = ("mixprec.emulated_gemm", "mixprec.dequantize", "mixprec.linear")
# phases of compare / demo, for the extrapolation: (module, function, phase); the recipe comes from the
# RunSpec argument where there is one
PHASES = (
    ("mixprec.comparison.training_run", "_train_step", "step"),
    ("mixprec.comparison.training_run", "_evaluation", "eval"),
    ("mixprec.comparison.training_run", "_set_up", "run setup"),
    ("mixprec.comparison.training_run", "_save_checkpoint", "checkpoint"),
    ("mixprec.comparison.runner", "load_inputs", "data"),
    ("mixprec.demo", "inference_step", "inference"),
)
FIXED, WORKERS = ("rest", ""), ("worker threads", "")
OPTIMIZER = "Optimizer.step#"  # the range torch.optim.Optimizer puts around every step
TRAIN_RECIPES = ("bf16", "fp8-delayed", "fp8-current", "fp8-rowwise", "fp8-blockwise", "fp8-mxfp8",
                 "fp4-nvfp4", "fp4-mxfp4")  # fmt: skip


def classify(op: str, inner: str | None) -> str:
    """The bucket of an op's self time, from its name and the innermost mixprec range around it."""
    if inner in RANGE_BUCKET:
        return RANGE_BUCKET[inner]
    gemm = op in GEMM_OPS or op.startswith(ATTENTION)
    if inner == OPTIMIZER:
        return "gemm_native" if gemm else "optim"
    if inner in EMULATION_RANGES:
        return "gemm_emu" if gemm else "decode"
    return "gemm_native" if gemm else "other"


def is_op(name: str) -> bool:
    """A dispatched op (aten::, mkldnn::, a custom op), not a range or an autograd node."""
    return "::" in name and not name.startswith(("autograd::", "profiler::"))


# Ranges around mixprec's entry points (profiled runs only)


@dataclass
class Recorder:
    """What the wrapped entries count: phase calls per (phase, recipe), emulated GEMM shapes (M, K, N)."""

    counts: Counter = field(default_factory=Counter)
    shapes: Counter = field(default_factory=Counter)
    in_linear: int = 0


def _rebind(original, replacement) -> list[tuple[object, str, object]]:
    """Every loaded mixprec module global bound to `original` now names `replacement` (names imported
    with `from ... import` included); returns what to restore."""
    undo = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "mixprec" or name.startswith("mixprec.")):
            continue
        for key, value in list(vars(mod).items()):
            if value is original:
                setattr(mod, key, replacement)
                undo.append((mod, key, original))
    return undo


def _ranged(fn: Callable, name: str, before: Callable | None = None) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if before is not None:
            before(*args, **kwargs)
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapper


def _linear_forward(fn: Callable, rec: Recorder) -> Callable:
    @functools.wraps(fn)
    def forward(self, x, *args, **kwargs):
        n = getattr(self, "out_features", None)
        if n is not None:
            rec.shapes[(x.numel() // x.shape[-1], x.shape[-1], n)] += 1
        rec.in_linear += 1
        try:
            with record_function("mixprec.linear"):
                return fn(self, x, *args, **kwargs)
        finally:
            rec.in_linear -= 1

    return forward


def _phase(fn: Callable, phase: str, rec: Recorder) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        spec = next((a for a in args if hasattr(a, "recipe") and hasattr(a, "steps")), None)
        recipe = spec.recipe if spec is not None else ""
        with record_function(f"phase:{phase}|{recipe}"):
            out = fn(*args, **kwargs)
        if phase != "eval" or out:  # _evaluation returns [] on steps without a held-out evaluation
            rec.counts[(phase, recipe)] += 1
        return out

    return wrapper


def _entry(module: str, attr: str):
    fn = getattr(importlib.import_module(module), attr, None)
    if fn is None:  # the buckets would silently be wrong
        raise SystemExit(f"profile_workflows: {module}.{attr} is gone: update this script")
    return fn


@contextlib.contextmanager
def wrapped_entries(rec: Recorder):
    """Ranges around ENTRIES, METHODS, the quantized Linears' forwards and PHASES; restored on exit."""

    def note(a, b, *args, **kwargs):  # an emulated GEMM's shape, unless a quantized Linear counted it
        if not rec.in_linear:
            rec.shapes[(a.data.shape[0], a.data.shape[1], b.data.shape[0])] += 1

    undo: list = []
    try:
        for module, attr, name in ENTRIES:
            fn = _entry(module, attr)
            undo += _rebind(fn, _ranged(fn, name, note if name == "mixprec.emulated_gemm" else None))
        for module, attr, phase in PHASES:
            fn = _entry(module, attr)
            undo += _rebind(fn, _phase(fn, phase, rec))
        for module, cls_name, attr, name in METHODS:
            cls = getattr(importlib.import_module(module), cls_name)
            undo.append((cls, attr, cls.__dict__[attr]))
            setattr(cls, attr, _ranged(cls.__dict__[attr], name))
        linear = importlib.import_module(LINEAR_MODULE)
        for cls in vars(linear).values():
            if isinstance(cls, type) and cls.__module__ == LINEAR_MODULE and "forward" in cls.__dict__:
                undo.append((cls, "forward", cls.__dict__["forward"]))
                cls.forward = _linear_forward(cls.__dict__["forward"], rec)
        yield rec
    finally:
        for owner, attr, value in reversed(undo):
            setattr(owner, attr, value)


# The profile, in buckets per phase


@dataclass
class Profile:
    """Seconds per bucket per phase (phase, recipe); FIXED holds everything outside a phase."""

    buckets: dict = field(default_factory=lambda: defaultdict(lambda: dict.fromkeys(BUCKETS, 0.0)))
    counts: Counter = field(default_factory=Counter)
    plain: float = math.nan  # the same work's wall time unprofiled
    profiled: float = math.nan
    shapes: Counter = field(default_factory=Counter)
    other_ops: Counter = field(default_factory=Counter)  # the "other ops" bucket by op name


def _contexts(events, workers: set) -> dict[int, tuple[str | None, tuple[str, str]]]:
    """id(event) -> (innermost mixprec range, phase) of the ranges around it (itself included); every
    event of a worker thread is in the phase WORKERS."""
    memo: dict[int, tuple] = {}
    for event in events:
        chain, cur = [], event
        while cur is not None and id(cur) not in memo:
            chain.append(cur)
            cur = cur.cpu_parent
        ctx = memo[id(cur)] if cur is not None else (None, WORKERS if event.thread in workers else FIXED)
        for ev in reversed(chain):
            if ev.name.startswith("phase:"):
                phase, _, recipe = ev.name[len("phase:") :].partition("|")
                ctx = (ctx[0], (phase, recipe))
            elif ev.name in RANGE_BUCKET or ev.name in EMULATION_RANGES:
                ctx = (ev.name, ctx[1])
            elif ev.name.startswith(OPTIMIZER):
                ctx = (OPTIMIZER, ctx[1])
            memo[id(ev)] = ctx
    return memo


def analyse(events, profiled: float, plain: float, rec: Recorder) -> Profile:
    """Bucket the op self times per phase; Python = each phase's wall - its op time - its waits for
    worker threads - the profiler's share (profiled - plain wall, spread over the main thread's phases
    by their number of events). Worker threads (streaming quantize) count their tasks' time: the whole
    is then thread-seconds of work, not wall time."""
    contexts = _contexts(events, {ev.thread for ev in events if ev.name == TASK})
    prof = Profile(plain=plain, profiled=profiled, counts=Counter(rec.counts), shapes=Counter(rec.shapes))
    walls: Counter = Counter()
    waits: Counter = Counter()
    n_events: Counter = Counter()
    for ev in events:
        inner, phase = contexts[id(ev)]
        n_events[phase] += phase != WORKERS
        if is_op(ev.name):
            bucket = classify(ev.name, inner)
            prof.buckets[phase][bucket] += ev.self_cpu_time_total / 1e6
            prof.other_ops[ev.name] += ev.self_cpu_time_total / 1e6 if bucket == "other" else 0.0
        elif ev.name.startswith("phase:") or ev.name == TASK:  # phases never nest, nor tasks
            walls[phase] += ev.cpu_time_total / 1e6
        elif ev.name == WAIT:
            waits[phase] += ev.cpu_time_total / 1e6
    walls[FIXED] = max(0.0, profiled - sum(v for k, v in walls.items() if k not in (FIXED, WORKERS)))
    per_event = max(0.0, profiled - plain) / max(1, sum(n_events.values())) if plain == plain else 0.0
    for phase in set(walls) | set(prof.buckets):
        b = prof.buckets[phase]
        ops = sum(v for k, v in b.items() if k != "python")
        b["python"] = max(0.0, walls[phase] - ops - waits[phase] - per_event * n_events[phase])
    prof.counts[FIXED] = 1
    return prof


def profiled_run(work: Callable[[], None], plain: float | None = None) -> Profile:
    """work() once under the profiler with the entry ranges installed, analysed; plain: its wall time
    unprofiled (None: work() is run once unprofiled first to measure it)."""
    plain = plain_seconds(work) if plain is None else plain
    rec = Recorder()
    with (
        wrapped_entries(rec),
        profile(
            activities=[ProfilerActivity.CPU],
            record_shapes=False,
            with_stack=False,
            experimental_config=_ExperimentalConfig(profile_all_threads=True),
        ) as p,
    ):
        t0 = time.perf_counter()
        work()
        profiled = time.perf_counter() - t0
    return analyse(p.events(), profiled, plain, rec)


def plain_seconds(work: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    work()
    return time.perf_counter() - t0


def scaled(prof: Profile, full: Counter | None) -> dict[tuple[str, str], dict[str, float]]:
    """Bucket seconds per phase at the full workflow's counts (full None: as profiled)."""
    out = {}
    for phase, b in prof.buckets.items():
        n = prof.counts.get(phase, 0)
        factor = 1.0 if full is None or phase == FIXED or n == 0 else full.get(phase, n) / n
        out[phase] = {k: v * factor for k, v in b.items()}
    return out


def total(rows: dict) -> dict[str, float]:
    return {x: sum(b[x] for b in rows.values()) for x in BUCKETS}


def amdahl(b: dict[str, float], k: float, r: float) -> float:
    """Whole-workflow speed-up if GEMM emu ran k x and the R_BUCKETS r x faster."""
    t = sum(b.values())
    rest = sum(v for key, v in b.items() if key != "gemm_emu" and key not in R_BUCKETS)
    new = b["gemm_emu"] / k + sum(b[x] for x in R_BUCKETS) / r + rest
    return t / new if new > 0 else math.inf


# k: bf16 vs fp32 GEMM speed at the workflow's shapes


def gemm_ratio(shapes: Counter, top: int = 6, reps: int = 5) -> tuple[float, list[dict]]:
    """k = sum(count * t_fp32) / sum(count * t_bf16) over the `top` shapes (M, K, N) by count * flops,
    fp32 and bf16 timed interleaved (mean of reps, each after a warm-up call); 1.0 without emulated GEMMs."""
    chosen = sorted(shapes.items(), key=lambda kv: -kv[1] * math.prod(kv[0]))[:top]
    if not chosen:
        return 1.0, []
    gen = torch.Generator().manual_seed(0)
    t32: Counter = Counter()
    t16: Counter = Counter()
    for _ in range(reps):
        for (m, k, n), _count in chosen:
            a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
            for times, x, y in ((t32, a, b), (t16, a.bfloat16(), b.bfloat16())):
                torch.mm(x, y)  # warm-up
                t0 = time.perf_counter()
                torch.mm(x, y)
                times[(m, k, n)] += time.perf_counter() - t0
    rows = [{"m": m, "k": k, "n": n, "count": c, "fp32_ms": t32[(m, k, n)] / reps * 1e3,
             "bf16_ms": t16[(m, k, n)] / reps * 1e3} for (m, k, n), c in chosen]  # fmt: skip
    num = sum(r["count"] * r["fp32_ms"] for r in rows)
    den = sum(r["count"] * r["bf16_ms"] for r in rows)
    return num / den, rows


# Workflows: each returns (Profile, full counts or None)


def wf_train(args) -> dict[str, tuple[Profile, Counter | None]]:
    """One training step per recipe, bench_training_step's model and shape: one Profile, a phase each."""
    from bench_training_step import build, train_step

    merged = Profile(plain=0.0, profiled=0.0)
    base = torch.randn(args.tokens, 1024, generator=torch.Generator().manual_seed(0))
    for recipe in args.recipes:
        s = build(recipe, 4, 1024)
        x = base.to(s.dtype)
        for _ in range(2):  # warm-up: allocations, first scales, lazy imports
            train_step(s, x)

        def work(s=s, x=x, recipe=recipe):
            for _ in range(args.steps_per_recipe):
                with record_function(f"phase:step|{recipe}"):
                    train_step(s, x)

        prof = profiled_run(work, min(plain_seconds(work) for _ in range(2)))
        merged.buckets[("step", recipe)] = prof.buckets[("step", recipe)]
        merged.counts[("step", recipe)] = args.steps_per_recipe
        merged.plain += prof.plain
        merged.profiled += prof.profiled
        merged.shapes += prof.shapes
        merged.other_ops += prof.other_ops
    return {f"train step, 4 x Linear(1024), {args.tokens} tokens": (merged, None)}


def _full_counts(full_config) -> Counter:
    from mixprec.comparison.runner import run_specs

    counts: Counter = Counter()
    for spec in run_specs(full_config):
        counts[("step", spec.recipe)] += spec.steps
        evals = {0, spec.steps, *range(spec.eval_every, spec.steps + 1, spec.eval_every)}
        counts[("eval", spec.recipe)] += len(evals)
        counts[("run setup", spec.recipe)] += 1
        saves = {spec.steps, *range(spec.checkpoint_every, spec.steps + 1, spec.checkpoint_every)}
        counts[("checkpoint", "")] += len(saves)
    return counts


def _reduced(full, steps: int, **overrides):
    """The full configuration at `steps` steps, no null runs, the full run's intervals."""
    import dataclasses

    return dataclasses.replace(
        full, steps=steps, null_runs=0, eval_every=full.eval_interval, monitor_every=full.monitor_interval,
        **overrides,
    )  # fmt: skip


def wf_compare(args) -> dict[str, tuple[Profile, Counter | None]]:
    from mixprec.comparison.config import CompareConfig
    from mixprec.comparison.runner import compare

    full = CompareConfig()
    config = _reduced(full, 2 * full.eval_interval)
    with tempfile.TemporaryDirectory(prefix="mixprec-prof-") as tmp:

        def work():
            compare(config=config, out=Path(tmp) / "cmp", force=True, progress=False)

        prof = profiled_run(work)
    return {f"compare (default; profiled at {config.steps} steps, no null runs)": (prof, _full_counts(full))}


def wf_demo(args) -> dict[str, tuple[Profile, Counter | None]]:
    from mixprec.demo import demo_config, run_demo

    full = demo_config()
    config = _reduced(full, full.eval_interval)
    over = {k: getattr(config, k) for k in ("steps", "null_runs", "eval_every", "monitor_every")}
    with tempfile.TemporaryDirectory(prefix="mixprec-prof-") as tmp:

        def work():
            run_demo(Path(tmp) / "demo", force=True, progress=False, **over)

        prof = profiled_run(work)
    return {f"demo (profiled at {config.steps} steps, no null runs)": (prof, _full_counts(full))}


def wf_evaluate(args) -> dict[str, tuple[Profile, Counter | None]]:
    """`mixprec evaluate` of an fp8-dynamic and an nvfp4a16 candidate of --eval-model, task lm."""
    if not args.eval_model:
        print("evaluate: skipped (give --eval-model DIR, a local Hugging Face causal LM)\n")
        return {}
    from mixprec.data import load_corpus
    from mixprec.evaluation.runner import evaluate
    from mixprec.inference import quantize_checkpoint

    with tempfile.TemporaryDirectory(prefix="mixprec-prof-") as tmp:
        data = Path(tmp) / "stdlib.txt"
        data.write_text("\n\n".join(load_corpus(max_chars=400_000).documents))

        def work():  # fp8-dynamic is quantized on the fly; nvfp4a16 (no --candidate-scheme) as a checkpoint
            fp4 = Path(tmp) / "nvfp4a16"
            with record_function("phase:quantize|nvfp4a16"):
                quantize_checkpoint(args.eval_model, fp4, scheme="nvfp4a16", force=True, progress=False)
            for scheme, candidate in (("fp8-dynamic", None), ("nvfp4a16", fp4)):
                with record_function(f"phase:evaluate|{scheme}"):
                    evaluate(reference=args.eval_model, candidate=candidate, data=data, task="lm",
                             candidate_scheme=None if candidate else scheme, samples=args.eval_samples,
                             progress=False)  # fmt: skip

        prof = profiled_run(work)
    name = Path(args.eval_model).name
    return {f"evaluate {name}, {args.eval_samples} samples, fp8-dynamic + nvfp4a16": (prof, None)}


def wf_quantize(args) -> dict[str, tuple[Profile, Counter | None]]:
    from bench_checkpoint_quantize import write_synthetic_llama
    from mixprec.inference import quantize_checkpoint

    with tempfile.TemporaryDirectory(prefix="mixprec-prof-") as tmp:
        info = write_synthetic_llama(Path(tmp) / "src", args.quantize_gb, 0.25)

        def work():
            shutil.rmtree(Path(tmp) / "q", ignore_errors=True)
            quantize_checkpoint(
                Path(tmp) / "src", Path(tmp) / "q", scheme="nvfp4a16", force=True, progress=False
            )

        prof = profiled_run(work)
    name = f"quantize nvfp4a16, synthetic Llama {info['layers']} layer(s), {info['bytes'] / 1e9:.2f} GB"
    return {name: (prof, None)}


WORKFLOWS = {"train": wf_train, "demo": wf_demo, "compare": wf_compare, "evaluate": wf_evaluate,
             "quantize": wf_quantize}  # fmt: skip


# Report


def machine() -> str:
    flags: set[str] = set()
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", platform.machine(), platform.processor()):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    isa = ", ".join(
        f"{f} {'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    return (f"{model}; {isa}; {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads; torch "
            f"{torch.__version__}; load average {load:.1f}")  # fmt: skip


def _row(name: str, n: int, b: dict[str, float], whole: float, k: float) -> str:
    t = sum(b.values())
    shares = " | ".join(f"{100 * b[x] / t:.0f}" if t else "" for x in BUCKETS)
    bounds = " | ".join(f"{amdahl(b, k, r):.2f}" for r in (1.0, 4.0, math.inf))
    return f"| {name} | {n} | {1e3 * t / n:.1f} | {t:.2f} | {100 * t / whole:.0f} | {shares} | {bounds} |"


def table(
    name: str, prof: Profile, full: Counter | None, k: float, whole_row: bool = True
) -> tuple[str, dict]:
    """Markdown: the whole workflow, then each phase (largest first); and the same figures for --json."""
    rows = scaled(prof, full)
    whole = total(rows)
    t = sum(whole.values())
    cols = " | ".join(LABELS[x] + " %" for x in BUCKETS)
    lines = [
        f"**{name}** — plain wall {prof.plain:.1f} s, profiled {prof.profiled:.1f} s"
        + (f"; extrapolated to the full workflow: {t:.0f} s" if full is not None else "")
        + ("; s are thread-seconds (worker threads run in parallel)" if WORKERS in rows else "")
        + f"; k = {k:.2f}",
        "",
        f"| part | calls | ms / call | s | % of all | {cols} | S(k) | S(k, r=4) | S(k, r=inf) |",
        "|---|" + "---:|" * (len(BUCKETS) + 7),
    ]
    if whole_row:
        lines.append(_row("**whole**", 1, whole, t, k))
    for phase in sorted(rows, key=lambda p: -sum(rows[p].values())):
        if (len(rows) > 1 or not whole_row) and (whole_row or phase != FIXED):
            n = (full or prof.counts).get(phase, 1) or 1
            lines.append(_row(f"{phase[0]} {phase[1]}".strip(), n, rows[phase], t, k))
    other = sum(prof.other_ops.values()) or 1.0
    top = ", ".join(f"{op} {100 * v / other:.0f} %" for op, v in prof.other_ops.most_common(6))
    lines += ["", f"Largest of the other ops (as profiled): {top}."]
    doc = {"name": name, "plain_s": prof.plain, "profiled_s": prof.profiled, "k": k, "whole_s": whole,
           "extrapolated": full is not None, "parts": {f"{p[0]}|{p[1]}": v for p, v in rows.items()},
           "amdahl": {f"r={r}": amdahl(whole, k, r) for r in (1.0, 4.0, math.inf)}}  # fmt: skip
    return "\n".join(lines), doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workflows", default="train,demo,compare,quantize",
                    help=f"comma-separated, of {', '.join(WORKFLOWS)} (evaluate needs --eval-model)")  # fmt: skip
    ap.add_argument("--recipes", default=",".join(TRAIN_RECIPES), help="recipes of the train workflow")
    ap.add_argument("--tokens", type=int, default=2048, help="train workflow: tokens per step")
    ap.add_argument("--steps-per-recipe", type=int, default=2, help="train workflow: steps per measurement")
    ap.add_argument("--eval-model", default=None, help="evaluate workflow: a local Hugging Face causal LM")
    ap.add_argument("--eval-samples", type=int, default=8)
    ap.add_argument("--quantize-gb", type=float, default=0.5, help="quantize workflow: checkpoint size")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    args.recipes = [r for r in args.recipes.split(",") if r]
    names = [w for w in args.workflows.split(",") if w]
    if set(names) - set(WORKFLOWS):
        ap.error(f"unknown workflows {sorted(set(names) - set(WORKFLOWS))}; valid: {', '.join(WORKFLOWS)}")
    from mixprec.kernels import allocator

    # as the compute commands do ($MIXPREC_MALLOC=default: glibc's defaults)
    print(f"machine: {machine()}\nallocator: {allocator.keep_freed_memory()}\n")
    k_ref, _ = gemm_ratio(Counter({(1024, 1024, 1024): 1}))
    print(f"k at 1024^3: fp32 / bf16 torch.mm time = {k_ref:.2f}\n")
    docs = []
    for w in names:
        for name, (prof, full) in WORKFLOWS[w](args).items():
            k, shapes = gemm_ratio(prof.shapes)
            text, doc = table(name, prof, full, k, whole_row=w != "train")
            doc["gemm_shapes"] = shapes
            print(text + "\n", flush=True)
            docs.append(doc)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "k_1024": k_ref, "workflows": docs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
