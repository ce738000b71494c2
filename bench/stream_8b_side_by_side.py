"""Streaming quantization of a Llama-3.1-8B-shaped checkpoint beside llm-compressor's `model_free_ptq`
(issue 30's acceptance run).

    python bench/stream_8b_side_by_side.py [--llmc-python /work/llmc-venv/bin/python] [--rounds 1] [--dir DIR]
                                           [--resume-check]

Writes a Llama-3.1-8B-shaped bf16 checkpoint (hidden 4096, intermediate 14336, 32 blocks, 32 / 8 heads,
vocabulary 128256, untied head: 16.06 GB) as 4 shards of about 4 GB (two over 4 GB), weights drawn with
std 0.02, into --dir (a temporary directory by default; removed at the end). Then, in each round and in
this order, each in its own child process (wall time, and peak RSS from wait4: bench/child_rss.py):
  - a plain copy of the files (shutil.copytree: the baseline),
  - `mixprec quantize --scheme fp8-dynamic`, then llm-compressor's `model_free_ptq(scheme="FP8_DYNAMIC")`,
  - `mixprec quantize --scheme nvfp4a16`, then `model_free_ptq(scheme="NVFP4A16")`,
both tools with lm_head and the embeddings kept. After each pair, the layer-0 q_proj and down_proj
tensors of the two outputs are compared byte for byte, and both outputs are deleted (disk is limited).
`mixprec quantize --dry-run --json` gives the plan's peak-RSS and time estimates for each scheme. With
--resume-check, an fp8-dynamic run is killed with SIGKILL half-way and resumed with --resume; the
resumed output is compared file by file (sha256) with an uninterrupted run's. With --torch-quantize, each
mixprec run is followed by the same run with MIXPREC_C_KERNELS=off (FP8 quantized by the torch code
instead of kernels.c_quantize), and the two outputs are compared file by file (sha256).
Every timed run starts after an os.sync() and a read of the input (neither timed), so that no run pays
for the writeback of the one before or reads an input another run pushed out of the page cache; "on disk" adds a timed os.sync() after it exits (its output written out, not only to the page
cache). Prints a markdown table: medians over the rounds, ratios to the copy of the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quantized_forward import machine
from child_rss import run_measured
from gptq_8b_blocks import HIDDEN, VOCAB, block_tensors, random_weight, write_config

BLOCKS = 32
SHARD_BLOCKS = [
    range(0, 7),
    range(7, 16),
    range(16, 25),
    range(25, 32),
]  # embed with the first, head with the last
SCHEMES = {"fp8-dynamic": "FP8_DYNAMIC", "nvfp4a16": "NVFP4A16"}
COMPARED = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"]

COPY = "import shutil, sys; shutil.copytree(sys.argv[1], sys.argv[2])"
LLMC = textwrap.dedent(
    """
    import sys
    from llmcompressor import model_free_ptq
    src, out, scheme, workers = sys.argv[1:]
    model_free_ptq(model_stub=src, save_directory=out, scheme=scheme, ignore=["lm_head", "model.embed_tokens"],
                   max_workers=int(workers), device="cpu")
    """
)


def write_checkpoint(directory: Path) -> int:
    """The 8B-shaped bf16 checkpoint (config, 4 shards, index); its bytes."""
    write_config(directory, BLOCKS)
    gen = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    for k, blocks in enumerate(SHARD_BLOCKS):
        name = f"model-{k + 1:05d}-of-{len(SHARD_BLOCKS):05d}.safetensors"
        tensors = {"model.embed_tokens.weight": random_weight((VOCAB, HIDDEN), gen)} if k == 0 else {}
        for i in blocks:
            tensors.update(block_tensors(i, gen))
        if k == len(SHARD_BLOCKS) - 1:
            tensors["model.norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
            tensors["lm_head.weight"] = random_weight((VOCAB, HIDDEN), gen)
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    total = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def tensors_of(directory: Path, modules: list[str]) -> dict[str, tuple[str, bytes]]:
    """(dtype, raw bytes) of every output tensor of `modules` (payload and scales), by name."""
    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no iterator
                if any(key.startswith(m + ".") for m in modules):
                    t = f.get_tensor(key)
                    raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
                    out[key] = (str(t.dtype).removeprefix("torch."), raw)
    return out


def measure(cmd: list[str], log: Path, model: Path) -> tuple[float, int, float]:
    """(wall seconds to exit, peak RSS, wall seconds until its output is on disk). Each run starts with
    no dirty pages (os.sync() first, not timed): otherwise a run pays for the writeback of the run
    before it, and the kernel throttles its writes. And with the input in the page cache (read through
    once, not timed): a run after one that pushed it out would read it from the disk, the others not.
    On disk: the exit plus a timed os.sync()."""
    os.sync()
    for f in sorted(model.iterdir()):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    seconds, code, peak = run_measured(cmd, log)
    if code != 0:
        raise SystemExit(f"failed ({code}): {' '.join(cmd[:6])}...\n{log.read_text()[-3000:]}")
    start = time.perf_counter()
    os.sync()
    return seconds, peak, seconds + time.perf_counter() - start


def plan(model: Path, scheme: str, root: Path) -> dict:
    cmd = [sys.executable, "-m", "mixprec", "quantize", "--model", str(model), "--output", str(root / "planned"),
           "--scheme", scheme, "--dry-run", "--json"]  # fmt: skip
    doc = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    return {"peak_rss": doc["memory"]["total"], "seconds": doc["time"]["total"]}


def one_round(
    model: Path, root: Path, llmc: str | None, workers: int, torch_quantize: bool = False
) -> dict[str, tuple[float, int]]:
    got = {
        "copy": measure([sys.executable, "-c", COPY, str(model), str(root / "copy")], root / "log.txt", model)
    }
    shutil.rmtree(root / "copy")
    for scheme, llmc_scheme in SCHEMES.items():
        out = root / f"mixprec-{scheme}"
        cmd = [sys.executable, "-m", "mixprec", "quantize", "--model", str(model), "--output", str(out),
               "--scheme", scheme, "--quiet"]  # fmt: skip
        got[f"mixprec {scheme}"] = measure(cmd, root / "log.txt", model)
        if torch_quantize:  # the same run with FP8 quantized by the torch code (no compiled C)
            plain = root / f"mixprec-{scheme}-torch"
            off = ["env", "MIXPREC_C_KERNELS=off", *cmd[:7], str(plain), *cmd[8:]]
            got[f"mixprec {scheme}, torch quantize"] = measure(off, root / "log.txt", model)
            ours, theirs = digest(out), digest(plain)
            differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
            got[f"same bytes {scheme}, compiled C and torch quantize"] = (not differ, differ)
            shutil.rmtree(plain)
        if llmc is not None:
            ref = root / f"llmc-{scheme}"
            got[f"llm-compressor {scheme}"] = measure([llmc, "-c", LLMC, str(model), str(ref), llmc_scheme,
                                                       str(workers)], root / "log.txt", model)  # fmt: skip
            ours, theirs = tensors_of(out, COMPARED), tensors_of(ref, COMPARED)
            differ = [f"{k} (mixprec {ours[k][0]}, llm-compressor {theirs[k][0]})" if k in ours and k in theirs
                      else k for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]  # fmt: skip
            got[f"same bytes {scheme}"] = (not differ, differ)
            shutil.rmtree(ref)
        shutil.rmtree(out)
    return got


def digest(directory: Path) -> dict[str, str]:
    import hashlib

    out = {}
    for f in sorted(directory.iterdir()):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
        out[f.name] = h.hexdigest()
    return out


def kill_and_resume(model: Path, root: Path) -> dict:
    """fp8-dynamic uninterrupted; again, killed (SIGKILL) at half that wall time; then --resume: the
    resumed output's files against the uninterrupted one's (sha256), and the resumed run's wall time."""
    import signal

    out = root / "resume-check"
    cmd = [sys.executable, "-m", "mixprec", "quantize", "--model", str(model), "--output", str(out),
           "--scheme", "fp8-dynamic", "--quiet"]  # fmt: skip
    full, _, _ = measure(cmd, root / "log.txt", model)
    reference = digest(out)
    shutil.rmtree(out)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(full / 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    log = out.parent / f".{out.name}.partial" / "shards.jsonl"
    finished = len(log.read_text().splitlines()) if log.exists() else 0
    resumed, _, _ = measure([*cmd, "--resume"], root / "log.txt", model)
    same = digest(out) == reference
    shutil.rmtree(out)
    return {"uninterrupted": full, "killed_at": full / 2, "finished_shards": finished, "resumed": resumed,
            "identical": same}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llmc-python", default=None, help="python of a venv with llmcompressor (0.14)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="model_free_ptq's max_workers")
    p.add_argument("--dir", type=Path, default=None, help="work here (kept); default a temporary directory")
    p.add_argument(
        "--resume-check", action="store_true", help="also kill -9 an fp8-dynamic run and resume it"
    )
    p.add_argument(
        "--torch-quantize",
        action="store_true",
        help="also run mixprec with MIXPREC_C_KERNELS=off (FP8 quantized by the torch code) after each mixprec run",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="stream8b-") as tmp:
        root = args.dir or Path(tmp)
        model = root / "model"
        size = (
            write_checkpoint(model)
            if not model.exists()
            else sum(f.stat().st_size for f in model.glob("*.safetensors"))
        )
        largest = max(f.stat().st_size for f in model.glob("*.safetensors"))
        print(f"checkpoint: {size / 1e9:.2f} GB in 4 shards (largest {largest / 1e9:.2f} GB)", flush=True)
        plans = {s: plan(model, s, root) for s in SCHEMES}
        rounds = []
        for r in range(args.rounds):
            rounds.append(one_round(model, root, args.llmc_python, args.workers, args.torch_quantize))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[0]:.0f} s" for k, v in rounds[-1].items()
                                                 if not k.startswith("same")), flush=True)  # fmt: skip
        resume = kill_and_resume(model, root) if args.resume_check else None
    print(f"\nmachine: {machine()}; torch {torch.__version__}; {args.rounds} round(s), medians\n")
    print("| run | wall | x copy | on disk | x copy on disk | peak RSS | plan: peak RSS / time |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for key in (k for k in rounds[0] if not k.startswith("same")):
        wall, disk = (statistics.median(r[key][i] for r in rounds) for i in (0, 2))
        ratio, disk_ratio = (statistics.median(r[key][i] / r["copy"][i] for r in rounds) for i in (0, 2))
        rss = max(r[key][1] for r in rounds)
        scheme = key.split()[1].rstrip(",") if " " in key else key
        planned = plans.get(scheme) if key.startswith("mixprec") and "torch" not in key else None
        plan_text = f"{planned['peak_rss'] / 2**30:.2f} GiB / {planned['seconds']:.0f} s" if planned else ""
        print(f"| {key} | {wall:.0f} s | {ratio:.2f}x | {disk:.0f} s | {disk_ratio:.2f}x | {rss / 2**30:.2f} GiB "
              f"| {plan_text} |")  # fmt: skip
    if resume is not None:
        print(f"\nkill -9 at {resume['killed_at']:.0f} s of an fp8-dynamic run ({resume['uninterrupted']:.0f} s "
              f"uninterrupted), {resume['finished_shards']} shard(s) recorded; --resume took {resume['resumed']:.0f} s; "
              f"output byte-identical to the uninterrupted run: {'yes' if resume['identical'] else 'NO'}")  # fmt: skip
    for key in (k for k in rounds[0] if k.startswith("same")):
        same, differing = rounds[0][key]
        what = "every file" if "compiled C" in key else "layer-0 q_proj and down_proj, every tensor"
        print(f"\n{key} ({what}): {'yes' if same else 'NO ' + str(differing)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
