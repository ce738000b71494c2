"""Benchmark: offline FP8 quantization of a synthetic sharded checkpoint (issue 5).

Makes a LlamaForCausalLM-shaped bf16 checkpoint of >= 2 GB in a temporary directory (deleted
afterwards), then measures, each in its own subprocess (peak RSS from wait4, as the OS counts it,
memory-mapped pages included):
  - a plain copy of the same files (the wall-time baseline),
  - `mixprec quantize --scheme fp8-dynamic` (streaming; target: <= 2x the copy, peak RSS <= largest
    shard + 512 MB),
  - llm-compressor `oneshot` FP8_DYNAMIC on the same model, from a separate virtualenv (it pins its own
    transformers / compressed-tensors), if that environment exists; its output is then loaded with
    mixprec.load_quantized and its FP8 payloads compared with mixprec's.
The copy and mixprec runs alternate `--repeats` times (the machine is shared: each round's ratio
compares runs made seconds apart); the table gives medians, and the time `python -c "import torch"`
takes (start-up every mixprec run pays, measured the same way). Prints a markdown table.

    python bench/bench_checkpoint_quantize.py [--size-gb 2.1] [--shard-gb 1] [--repeats 3] [--llmc-python /work/venv-llmc/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_synthetic_llama(directory: Path, size_gb: float, shard_gb: float, vocab: int = 32000) -> dict:
    """vocab: the embedding rows (a real tokenizer copied beside the checkpoint needs its own size)."""
    import transformers

    hidden, inter = 2048, 5632
    per_layer = 2 * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden)
    layers = max(1, round((size_gb * 1e9 - 2 * 2 * vocab * hidden) / per_layer))
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                   num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
                                   tie_word_embeddings=False, dtype="bfloat16",
                                   architectures=["LlamaForCausalLM"])  # fmt: skip
    directory.mkdir(parents=True)
    cfg.save_pretrained(directory)
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)}
        )
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"self_attn.{n}.weight"] = (hidden, hidden)
        shapes.update({p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter)})  # fmt: skip
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = 2 * torch.Size(shape).numel()
        if groups[-1] and size + n > shard_gb * 2**30:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for n in group:
            t = (
                torch.randn(shapes[n], generator=gen).mul_(0.02)
                if len(shapes[n]) == 2
                else torch.ones(shapes[n])
            )
            tensors[n] = t.to(torch.bfloat16)
        save_file(tensors, directory / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
        del tensors
    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    files = sorted(directory.glob("*.safetensors"))
    return {"layers": layers, "bytes": sum(f.stat().st_size for f in files),
            "largest_shard": max(f.stat().st_size for f in files), "shards": len(files)}  # fmt: skip


# Children report their own peak RSS (VmHWM) at exit: getrusage/wait4's ru_maxrss would also count
# the parent's pages the child had between fork and exec.
WRAP = textwrap.dedent(
    """
    import atexit, runpy, sys
    def _report():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                sys.stderr.write("@@VmHWM %s\\n" % line.split()[1])
    atexit.register(_report)
    mode, target, *rest = sys.argv[1:]
    if mode == "module":
        sys.argv = [target, *rest]
        runpy.run_module(target, run_name="__main__")
    else:
        sys.argv = ["-c", *rest]
        exec(compile(target, "<bench>", "exec"), {"__name__": "__main__"})
    """
)


def measure(python: str, mode: str, target: str, *args: str) -> dict:
    """Wall time and peak RSS (bytes, VmHWM) of a child python; its output tail for errors."""
    t0 = time.perf_counter()
    res = subprocess.run([python, "-c", WRAP, mode, target, *args], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    hwm = [int(line.split()[1]) * 1024 for line in res.stderr.splitlines() if line.startswith("@@VmHWM")]
    return {"seconds": seconds, "peak_rss": hwm[-1] if hwm else 0, "rc": res.returncode,
            "output": (res.stdout + res.stderr)[-3000:]}  # fmt: skip


COPY = "import shutil, sys, pathlib; s, d = map(pathlib.Path, sys.argv[1:]); shutil.copytree(s, d)"

LLMC = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoModelForCausalLM
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    src, out = sys.argv[1:]
    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]))
    model.save_pretrained(out, save_compressed=True)
    """
)

COMPARE = textwrap.dedent(
    """
    import sys, json, torch
    import mixprec
    from mixprec.inference.runtime.linear import QuantizedLinear
    a, b = mixprec.load_quantized(sys.argv[1]), mixprec.load_quantized(sys.argv[2])
    same = total = 0; max_scale_rel = 0.0; n = 0
    for name, m in a.named_modules():
        if isinstance(m, QuantizedLinear):
            o = b.get_submodule(name); n += 1
            same += int((m.weight.view(torch.uint8) == o.weight.view(torch.uint8)).sum()); total += m.weight.numel()
            max_scale_rel = max(max_scale_rel, float(((m.weight_scale - o.weight_scale).abs() / o.weight_scale).max()))
    print(json.dumps({"layers": n, "payload_equal_fraction": same / total, "max_scale_rel_diff": max_scale_rel}))
    """
)


def _median_run(runs: list[dict]) -> dict:
    """The run with the median wall time (its own peak RSS)."""
    return sorted(runs, key=lambda m: m["seconds"])[len(runs) // 2]


def versions(python: str, modules: list[str]) -> str:
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    try: print(m, importlib.import_module(m).__version__)\n    except Exception as e: print(m, 'missing')"
    res = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True)
    return ", ".join(line.replace(" ", " ") for line in res.stdout.split("\n") if line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.1)
    ap.add_argument("--shard-gb", type=float, default=1.0)
    ap.add_argument("--tmp", default=None, help="where to put the synthetic checkpoint (deleted afterwards)")
    ap.add_argument("--llmc-python", default="/work/venv-llmc/bin/python")
    ap.add_argument("--skip-llmc", action="store_true")
    ap.add_argument(
        "--repeats", type=int, default=3, help="alternating copy / mixprec rounds (medians reported)"
    )
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="mixprec-bench-", dir=args.tmp))
    rows, notes = [], []
    try:
        t0 = time.perf_counter()
        info = write_synthetic_llama(root / "src", args.size_gb, args.shard_gb)
        gen_s = time.perf_counter() - t0
        gb = info["bytes"] / 1e9
        largest = info["largest_shard"]
        copies, mps, starts, ratios = [], [], [], []
        for _ in range(args.repeats):
            shutil.rmtree(root / "mixprec", ignore_errors=True)
            copies.append(measure(sys.executable, "code", COPY, str(root / "src"), str(root / "copy")))
            shutil.rmtree(root / "copy", ignore_errors=True)
            mps.append(measure(sys.executable, "module", "mixprec.cli", "quantize", "--model", str(root / "src"),
                               "--output", str(root / "mixprec"), "--scheme", "fp8-dynamic", "--quiet"))  # fmt: skip
            if mps[-1]["rc"] != 0:
                print(mps[-1]["output"], file=sys.stderr)
                return 1
            starts.append(measure(sys.executable, "code", "import torch"))
            ratios.append(mps[-1]["seconds"] / copies[-1]["seconds"])
        copy, mp, start = _median_run(copies), _median_run(mps), _median_run(starts)
        out_bytes = sum(f.stat().st_size for f in (root / "mixprec").glob("*.safetensors"))
        rows.append(("plain copy (baseline)", copy, None))
        rows.append(("mixprec quantize fp8-dynamic (streaming)", mp, out_bytes))
        rows.append(('python -c "import torch" (start-up inside every mixprec run)', start, None))
        llmc_ok = False
        if not args.skip_llmc and Path(args.llmc_python).exists():
            lc = measure(args.llmc_python, "code", LLMC, str(root / "src"), str(root / "llmc"))
            if lc["rc"] == 0:
                llmc_ok = True
                lc_bytes = sum(f.stat().st_size for f in (root / "llmc").glob("*.safetensors"))
                rows.append(("llm-compressor oneshot FP8_DYNAMIC", lc, lc_bytes))
                cmp = subprocess.run([sys.executable, "-c", COMPARE, str(root / "mixprec"), str(root / "llmc")],
                                     capture_output=True, text=True)  # fmt: skip
                if cmp.returncode == 0:
                    notes.append(f"mixprec.load_quantized reads the llm-compressor output; vs mixprec's: "
                                 f"{cmp.stdout.strip().splitlines()[-1]}")  # fmt: skip
                else:
                    notes.append(
                        f"loading the llm-compressor output with mixprec failed: {cmp.stderr[-500:]}"
                    )
            else:
                notes.append(f"llm-compressor failed (rc {lc['rc']}): {lc['output'][-800:]}")
        elif not args.skip_llmc:
            notes.append(f"llm-compressor not run: no {args.llmc_python}")

        print(f"\nMachine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
              f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM; "
              f"python {platform.python_version()}")  # fmt: skip
        print(
            f"mixprec env: {versions(sys.executable, ['torch', 'transformers', 'safetensors', 'compressed_tensors'])}"
        )
        if llmc_ok or Path(args.llmc_python).exists():
            print(
                f"llm-compressor env: {versions(args.llmc_python, ['torch', 'transformers', 'compressed_tensors', 'llmcompressor'])}"
            )
        print(f"Checkpoint: synthetic Llama bf16, {info['layers']} layers, {gb:.2f} GB in {info['shards']} shards, "
              f"largest {largest / 2**30:.2f} GiB (generated in {gen_s:.0f} s)\n")  # fmt: skip
        print("| run | wall s | x copy | peak RSS GiB | peak RSS - largest shard GiB | output GB |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, m, ob in rows:
            print(f"| {name} | {m['seconds']:.1f} | {m['seconds'] / copy['seconds']:.2f} | {m['peak_rss'] / 2**30:.2f} | "
                  f"{(m['peak_rss'] - largest) / 2**30:+.2f} | {'' if ob is None else f'{ob / 1e9:.2f}'} |")  # fmt: skip
        ratio = statistics.median(ratios)
        t_ok = ratio <= 2
        m_ok = max(m["peak_rss"] for m in mps) <= largest + 512 * 2**20
        print(f"\n{args.repeats} alternating rounds; wall s and peak RSS: medians; mixprec / copy per round: "
              f"{', '.join(f'{x:.2f}' for x in ratios)}; load average {os.getloadavg()[0]:.1f} at the end")  # fmt: skip
        print(f"\nTargets: wall <= 2x copy: {'met' if t_ok else 'MISSED'} (median ratio {ratio:.2f}x); "
              f"peak RSS <= largest shard + 512 MiB: {'met' if m_ok else 'MISSED'} "
              f"(worst round {(max(m['peak_rss'] for m in mps) - largest) / 2**20:+.0f} MiB)")  # fmt: skip
        for n in notes:
            print(f"- {n}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
