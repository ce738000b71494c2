"""Issue 8 on one GPU (H200 target): FP8 vs BF16 GEMMs, a Llama-8B-sized layer's training step per
recipe, inference prefill/decode, weight memory, fused-quantize bandwidth. Ratios against a BF16
baseline measured in the same run. Writes OUTDIR/summary.md and OUTDIR/results.json.

    python bench/gpu_bench.py OUTDIR [--budget-s 240] [--quick]

Run through bench/gpu.sh (which also runs the GPU tests). Nothing is downloaded: the layer is built
here (hidden 4096, ffn 14336, 32 heads / 8 KV heads, seq 4096). Every section is guarded: a failure is
recorded in the tables and the run goes on; optional parts are skipped once the time budget is spent.
Timing: CUDA events, warm-up first, median of repeated runs, random (never zero) inputs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

TARGETS = {
    "gemm_8192": 1.8,
    "train_tensorwise": 1.4,
    "train_delayed": 1.4,
    "train_blockwise": 1.25,
    "prefill_dynamic": 1.4,
}
HIDDEN, FFN, HEADS, KV_HEADS, SEQ = 4096, 14336, 32, 8, 4096
DEVICE = "cuda"  # --dry-run-cpu: "cpu", tiny shapes, wall-clock timing (checks the script, measures nothing)


class Run:
    """Collects tables (markdown) and numbers (JSON); knows the time budget."""

    def __init__(self, out: Path, budget_s: float, quick: bool):
        self.out, self.budget_s, self.quick, self.t0 = out, budget_s, quick, time.time()
        self.md: list[str] = []
        self.data: dict = {"schema_version": 1, "sections": {}}

    def left(self) -> float:
        return self.budget_s - (time.time() - self.t0)

    def table(self, title: str, header: list[str], rows: list[list], note: str = "") -> None:
        self.md += [f"### {title}", ""]
        if note:
            self.md += [note, ""]
        self.md.append("| " + " | ".join(header) + " |")
        self.md.append("|" + "---|" * len(header))
        self.md += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
        self.md.append("")
        self.save()

    def save(self) -> None:
        (self.out / "summary.md").write_text("\n".join(self.md) + "\n")
        (self.out / "results.json").write_text(json.dumps(self.data, indent=2, default=str))


def median_ms(fn, warmup: int = 3, reps: int = 10) -> float:
    """Median milliseconds of fn() by CUDA events (warm-up excluded)."""
    for _ in range(warmup):
        fn()
    if DEVICE == "cpu":
        times = []
        for _ in range(min(reps, 2)):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fmt_ratio(base: float, t: float) -> str:
    return f"{base / t:.2f}x" if t and math.isfinite(t) else "-"


def guarded(run: Run, section: str):
    """Decorator: record the exception of a section instead of stopping the run."""

    def wrap(fn):
        def inner(*a, **k):
            t = time.time()
            try:
                fn(*a, **k)
            except Exception as exc:
                run.data["sections"].setdefault(section, {})["error"] = f"{type(exc).__name__}: {exc}"
                run.md += [f"### {section}: FAILED", "", "```", traceback.format_exc()[-3000:], "```", ""]
                run.save()
            print(
                f"[gpu_bench] {section}: {time.time() - t:.1f}s (budget left {run.left():.0f}s)", flush=True
            )

        return inner

    return wrap


# ---------------------------------------------------------------------------------------------------
# Environment


def environment(run: Run) -> None:
    from mixprec.kernels.native import describe_report, native_kernel_report

    driver = "unknown"
    with contextlib.suppress(Exception):
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    for mod in ("triton", "transformers"):
        with contextlib.suppress(Exception):
            versions[mod] = __import__(mod).__version__
    cuda = torch.cuda.is_available()
    env = {
        "gpu": torch.cuda.get_device_name() if cuda else "none (dry run on CPU)",
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else "-",
        "driver": driver,
        **versions,
    }
    report = native_kernel_report(DEVICE)
    run.data["env"], run.data["kernels"] = env, report
    run.table("Machine", ["what", "value"], [[k, v] for k, v in env.items()])
    run.table(
        "Kernels chosen (mixprec.kernels.native_kernel_report)", ["what", "backend"], describe_report(report)
    )
    print(json.dumps(env), flush=True)


# ---------------------------------------------------------------------------------------------------
# GEMM 8192^3 and fused quantization


def _auto_quantize(x, fmt, g=None):
    """What "auto" runs on this device (the Triton kernels on CUDA)."""
    from mixprec.quantization import quantize

    return quantize(x, fmt, g, validate_scale=False)


def gemm_section(run: Run) -> None:
    n = 256 if DEVICE == "cpu" else 4096 if run.quick else 8192
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    results, rows = _gemm_timings(a, b, n)
    tensorwise = [
        results["bf16 torch.mm"] / v for k, v in results.items() if k.startswith("fp8 tensorwise (pre")
    ]
    best = max(tensorwise, default=0.0)
    run.data["sections"]["gemm"] = {
        "n": n,
        "ms": results,
        "best_tensorwise_ratio": best,
        "target": TARGETS["gemm_8192"],
    }
    run.table(
        f"FP8 vs BF16 GEMM, {n}x{n}x{n} (target >= {TARGETS['gemm_8192']}x; best tensorwise here {best:.2f}x)",
        ["kernel", "ms", "TFLOP/s", "speed-up vs bf16", "reference"],
        rows,
    )

    _quantize_bandwidth(run, a, n)


def _gemm_timings(a: torch.Tensor, b: torch.Tensor, n: int) -> tuple[dict[str, float], list[list[str]]]:
    """{kernel: ms} and the table rows of bf16 torch.mm against every FP8 GEMM this device runs."""
    from mixprec.kernels import native
    from mixprec.scaling import Granularity as G

    auto_quantize = _auto_quantize
    flops = 2 * n**3
    rows, results = [], {}

    def add(name, ms, note=""):
        results[name] = ms
        rows.append(
            [name, f"{ms:.3f}", f"{flops / ms / 1e9:.0f}", fmt_ratio(results["bf16 torch.mm"], ms), note]
        )

    def attempt(name, thunk, note=""):
        try:
            add(name, thunk(), note)
        except Exception as exc:
            rows.append([name, f"FAILED: {type(exc).__name__}: {str(exc)[:150]}", "", "", note])

    add("bf16 torch.mm", median_ms(lambda: a @ b.t(), reps=20))
    qa_t, qb_t = auto_quantize(a, "e4m3"), auto_quantize(b, "e4m3")
    sa, sb = qa_t.scale.reshape(()), qb_t.scale.reshape(())
    bt = qb_t.data.t()
    for fast in (False, True):
        attempt(
            f"fp8 tensorwise (pre-quantized{', fast accum' if fast else ''})",
            lambda fast=fast: median_ms(
                lambda: torch._scaled_mm(
                    qa_t.data, bt, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast
                ),
                reps=20,
            ),
            "TE H200 pre-quantized: 1.92x",
        )
    qa_r, qb_r = auto_quantize(a, "e4m3", G.rows()), auto_quantize(b, "e4m3", G.rows())
    sbr = qb_r.scale.t().contiguous()
    attempt(
        "fp8 rowwise (pre-quantized)",
        lambda: median_ms(
            lambda: torch._scaled_mm(
                qa_r.data, qb_r.data.t(), scale_a=qa_r.scale, scale_b=sbr, out_dtype=torch.bfloat16
            ),
            reps=20,
        ),
    )
    qa_b, qb_b = auto_quantize(a, "e4m3", G.blocks(1, 128)), auto_quantize(b, "e4m3", G.blocks(128, 128))
    backend = native.blockwise_backend(DEVICE)
    backends = [backend] if backend not in ("triton", "emulated") else []
    if native.triton_usable(DEVICE):
        backends.append("triton")
    for be in backends:
        attempt(
            f"fp8 blockwise 1x128 x 128x128 ({be})",
            lambda be=be: median_ms(
                lambda: native.blockwise_mm(qa_b, qb_b, out_dtype=torch.bfloat16, backend=be), reps=10
            ),
            "TE H200 block: 1.41x (GEMM time, training)",
        )

    def dynamic():
        qa, qb = auto_quantize(a, "e4m3"), auto_quantize(b, "e4m3")
        return torch._scaled_mm(
            qa.data,
            qb.data.t(),
            scale_a=qa.scale.reshape(()),
            scale_b=qb.scale.reshape(()),
            out_dtype=torch.bfloat16,
        )

    attempt("fp8 tensorwise incl. dynamic quantization of both", lambda: median_ms(dynamic, reps=10))
    return results, rows


def _quantize_bandwidth(run: Run, a: torch.Tensor, n: int) -> None:
    """Fused quantization bandwidth, auto backend against the eager one (bit-identical)."""
    from mixprec.quantization import quantize
    from mixprec.scaling import Granularity as G

    auto_quantize = _auto_quantize
    # fused quantization bandwidth: bytes = read bf16 + write 1 byte (+ scales)
    qrows = []
    for g in (G.tensor(), G.rows(), G.blocks(1, 128), G.blocks(128, 128), G.mx(32)):
        try:
            t_fast = median_ms(lambda g=g: auto_quantize(a, "e4m3", g), reps=10)
        except Exception as exc:
            qrows.append([g.name, f"FAILED: {type(exc).__name__}: {str(exc)[:120]}", "", "", ""])
            continue
        try:
            t_torch = median_ms(lambda g=g: quantize(a, "e4m3", g, backend="eager"), warmup=1, reps=3)
        except Exception as exc:  # the eager torch backend on CUDA has failed before: say so
            t_torch = math.nan
            print(f"[gpu_bench] eager quantize {g.name} on CUDA failed: {exc}", flush=True)
        gbs = a.numel() * 3 / t_fast / 1e6
        qrows.append([g.name, f"{t_fast:.3f}", f"{gbs:.0f}", f"{t_torch:.3f}", fmt_ratio(t_torch, t_fast)])
    run.data["sections"]["quantize"] = qrows
    run.table(
        f"Fused quantization of a {n}x{n} bf16 tensor to E4M3 (quantize: auto vs eager backend, bit-identical)",
        ["granularity", "fused ms", "GB/s (3 B/elem)", "torch ms", "speed-up"],
        qrows,
        note="Copy ceiling on this machine ~4.3 TB/s (KINDS.md). Per-tensor reads the input twice.",
    )


# ---------------------------------------------------------------------------------------------------
# The Llama-8B-sized layer


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        hd = HIDDEN // HEADS
        self.q_proj = nn.Linear(HIDDEN, HEADS * hd, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * hd, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * hd, bias=False)
        self.o_proj = nn.Linear(HEADS * hd, HIDDEN, bias=False)

    def forward(self, x, kv_cache=None):
        b, s, _ = x.shape
        hd = HIDDEN // HEADS
        q = self.q_proj(x).view(b, s, HEADS, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, KV_HEADS, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, KV_HEADS, hd).transpose(1, 2)
        if kv_cache is not None:  # decode: attend to the cache plus the new token
            k = torch.cat([kv_cache[0], k], dim=2)
            v = torch.cat([kv_cache[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=kv_cache is None, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, HIDDEN))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """One Llama-3-8B decoder layer (no rotary embedding: it costs the same in every precision)."""

    def __init__(self):
        super().__init__()
        self.input_layernorm = RMSNorm(HIDDEN)
        self.self_attn = Attention()
        self.post_attention_layernorm = RMSNorm(HIDDEN)
        self.mlp = MLP()

    def forward(self, x, kv_cache=None):
        x = x + self.self_attn(self.input_layernorm(x), kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def new_layer() -> Layer:
    torch.manual_seed(0)
    with torch.device(DEVICE):
        layer = Layer()
    for p in layer.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    return layer.to(torch.bfloat16)


@contextlib.contextmanager
def kernels_hook(enabled: bool):
    """The probed native/Triton kernel for blockwise GEMMs, applied for the run. (Fused quantization
    needs no hook: mixprec.quantization picks the Triton kernels on CUDA by itself.)"""
    if not enabled:
        yield
        return
    import mixprec.gemm as gemm
    from mixprec.kernels import native

    saved = (gemm._native, gemm.native_available)
    orig_native, orig_avail = gemm._native, gemm.native_available

    def _native(a, b, out_dtype, bias):
        out = native.native_gemm(a, b, out_dtype=out_dtype, bias=bias)
        return out if out is not None else orig_native(a, b, out_dtype, bias)

    def native_available(a, b, out_dtype=torch.bfloat16):  # scaled_mm passes out_dtype
        if gemm.native_kind(a, b) == "blockwise" and a.data.device.type == "cuda":  # probed, not assumed
            ok = native.blockwise_backend(a.data.device, b.granularity.block_rows) != "emulated"
            return ok, "" if ok else "no blockwise kernel (probe failed, no triton)"
        return orig_avail(a, b, out_dtype)

    gemm._native, gemm.native_available = _native, native_available
    try:
        yield
    finally:
        gemm._native, gemm.native_available = saved


def training_section(run: Run) -> None:
    from mixprec.training import convert_for_training
    from mixprec.training.scaling_state import advance

    seq = 1024 if run.quick and DEVICE == "cuda" else SEQ
    x = torch.randn(1, seq, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    rows, times = [], {}

    def measure(label: str, recipe: str | None, hook: bool, compile_: bool) -> None:
        layer = new_layer()
        if recipe:
            convert_for_training(layer, recipe)
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-5, fused=DEVICE == "cuda")
        fwd = torch.compile(layer) if compile_ else layer

        def fwd_bwd():
            out = fwd(x)
            out.backward(dy)

        def step():
            fwd_bwd()
            opt.step()
            opt.zero_grad(set_to_none=True)
            advance(layer)

        with kernels_hook(hook):
            t_fb = median_ms(fwd_bwd, warmup=3, reps=8)
            t_step = median_ms(step, warmup=2, reps=8)
        times[label] = (t_fb, t_step)
        base = times.get("bf16") or (t_fb, t_step)
        rows.append(
            [label, f"{t_fb:.2f}", fmt_ratio(base[0], t_fb), f"{t_step:.2f}", fmt_ratio(base[1], t_step)]
        )
        run.data["sections"]["training"] = {
            k: {"fwd_bwd_ms": v[0], "step_ms": v[1]} for k, v in times.items()
        }

    plan = [("bf16", None, False, False)]
    for recipe in ("fp8-current", "fp8-delayed", "fp8-rowwise", "fp8-blockwise"):
        plan.append((f"{recipe} (as shipped)", recipe, False, False))
        plan.append((f"{recipe} + kernels hook", recipe, True, False))
    optional = [
        ("bf16 compiled", None, False, True),
        ("fp8-current + kernels hook, compiled", "fp8-current", True, True),
        ("fp8-delayed + kernels hook, compiled", "fp8-delayed", True, True),
        ("fp8-blockwise + kernels hook, compiled", "fp8-blockwise", True, True),
        ("fp8-mxfp8 (emulated on Hopper)", "fp8-mxfp8", False, False),
    ]
    for label, recipe, hook, comp in plan + optional:
        if (label, recipe, hook, comp) in optional and (run.left() < 60 or (comp and DEVICE == "cpu")):
            rows.append([label, "skipped (time budget)", "", "", ""])
            continue
        try:
            measure(label, recipe, hook, comp)
        except Exception as exc:
            rows.append([label, f"FAILED: {type(exc).__name__}: {str(exc)[:150]}", "", "", ""])
        if DEVICE == "cuda":
            torch.cuda.empty_cache()  # the layer of the last variant is gone with measure()'s frame
        print(f"[gpu_bench] training {label}: {times.get(label)}", flush=True)
    run.table(
        f"Training step of one Llama-8B-sized layer (hidden {HIDDEN}, ffn {FFN}, seq {seq}, batch 1), bf16 params",
        ["recipe", "fwd+bwd ms", "speed-up", "step ms (incl. AdamW)", "speed-up"],
        rows,
        note=(
            f"Targets (fwd+bwd+step, vs bf16): tensorwise/delayed >= {TARGETS['train_tensorwise']}x, blockwise >= "
            f"{TARGETS['train_blockwise']}x. TransformerEngine H200 GEMM-time: delayed 1.69x, current 1.57x, block 1.41x; "
            "end-to-end Llama-3-8B 1.46x. 'kernels hook' = the gemm.py change proposed in docs/gpu.md."
        ),
    )


def inference_section(run: Run) -> None:
    from mixprec.inference.runtime.online import apply_scheme_

    seq = 1024 if run.quick and DEVICE == "cuda" else SEQ
    rows, mem_rows = [], []
    results: dict = {}

    def linear_bytes(layer: nn.Module) -> int:
        total = 0
        for m in layer.modules():
            if m is layer or isinstance(m, (RMSNorm, Layer, Attention, MLP)):
                continue
            total += sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
        return total

    x = torch.randn(1, seq, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    cache_len = seq
    variants = [
        ("bf16", None, False),
        ("fp8-dynamic", "fp8-dynamic", False),
        ("fp8-dynamic + kernels hook", "fp8-dynamic", True),
    ]
    variants += [("fp8-block + kernels hook", "fp8-block", True)]
    for label, scheme, hook in variants:
        try:
            layer = new_layer().eval()
            if scheme:
                apply_scheme_(layer, scheme=scheme)
            results[label] = {"weight_bytes": linear_bytes(layer)}
            with torch.inference_mode(), kernels_hook(hook):
                t_prefill = median_ms(lambda layer=layer: layer(x), warmup=2, reps=8)
                dec = {}
                for batch in (1, 32):
                    kv = (
                        torch.randn(
                            batch, KV_HEADS, cache_len, HIDDEN // HEADS, device=DEVICE, dtype=torch.bfloat16
                        ),
                        torch.randn(
                            batch, KV_HEADS, cache_len, HIDDEN // HEADS, device=DEVICE, dtype=torch.bfloat16
                        ),
                    )
                    xt = torch.randn(batch, 1, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
                    t = median_ms(lambda layer=layer, xt=xt, kv=kv: layer(xt, kv), warmup=3, reps=20)
                    dec[batch] = batch / t * 1e3  # tokens per second through this one layer
            results[label].update(prefill_ms=t_prefill, decode_tok_s=dec)
            base = results["bf16"]
            rows.append(
                [
                    label,
                    f"{t_prefill:.2f}",
                    fmt_ratio(base["prefill_ms"], t_prefill),
                    f"{dec[1]:.0f}",
                    f"{dec[1] / base['decode_tok_s'][1]:.2f}x",
                    f"{dec[32]:.0f}",
                    f"{dec[32] / base['decode_tok_s'][32]:.2f}x",
                ]
            )
            mem_rows.append(
                [
                    label,
                    f"{results[label]['weight_bytes'] / 2**20:.1f}",
                    f"{results[label]['weight_bytes'] / base['weight_bytes']:.3f}",
                ]
            )
            del layer
            torch.cuda.empty_cache()
        except Exception as exc:
            rows.append([label, f"FAILED: {type(exc).__name__}: {str(exc)[:150]}", "", "", "", "", ""])
    run.data["sections"]["inference"] = results
    run.table(
        f"Inference, one Llama-8B-sized layer: prefill (seq {seq}) and decode (KV cache {cache_len})",
        [
            "model",
            "prefill ms",
            "speed-up",
            "decode tok/s (batch 1)",
            "vs bf16",
            "decode tok/s (batch 32)",
            "vs bf16",
        ],
        rows,
        note=f"Target: prefill fp8-dynamic >= {TARGETS['prefill_dynamic']}x (torchao H100: 1.46x).",
    )
    run.table(
        "Weight memory of the layer's Linears",
        ["model", "MiB", "ratio vs bf16 (target 0.5 + scales)"],
        mem_rows,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--budget-s", type=float, default=240.0, help="optional parts are skipped after this")
    ap.add_argument("--quick", action="store_true", help="smaller shapes (a smoke test, not the targets)")
    ap.add_argument(
        "--dry-run-cpu", action="store_true", help="check the script on CPU with tiny shapes (no numbers)"
    )
    args = ap.parse_args()
    global DEVICE, HIDDEN, FFN, HEADS, KV_HEADS, SEQ
    if args.dry_run_cpu:
        DEVICE = "cpu"
        HIDDEN, FFN, HEADS, KV_HEADS, SEQ = 256, 512, 4, 2, 64
    elif not torch.cuda.is_available():
        print(
            "gpu_bench: no CUDA device; nothing measured (use --dry-run-cpu to check the script)",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args.out, args.budget_s, args.quick)
    run.md += [
        "## GPU benchmarks (issue 8)",
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
    ]
    for name, fn in (
        ("environment", environment),
        ("gemm", gemm_section),
        ("training", training_section),
        ("inference", inference_section),
    ):
        guarded(run, name)(fn)(run)
    run.save()
    print("\n".join(run.md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
