"""Perplexity change of rotation (R1 + R2, mixprec.inference.algorithms.rotation) with and without
FP4 weight quantization, against the unrotated bf16 model (issue 28, `rotate`).

    python bench/rotation_perplexity.py --model /tmp/realmodels/smol-hf --data /tmp/realmodels/stdlib.txt \
        --samples 32 --seq-len 256 --work /tmp/rotation-bench --json rotation.json

1. The model (bf16) is loaded, rotated in memory by rotate_model_ (fp64, cast back to bf16) and written
   with save_pretrained (plus the model's tokenizer files) to WORK/rotated: the head is untied.
2. For {no rotation, rotation} x {bf16, mxfp4a16, nvfp4a16, mxfp4 (W4A4, activations per 32 at run
   time: no calibration)}: `mixprec quantize` (RTN, the default ignore list: lm_head stays bf16) writes
   the checkpoint, `mixprec evaluate --task lm` scores it against the
   unrotated bf16 model on --samples blocks of --seq-len tokens of --data (the first blocks of the
   paragraphs joined by end-of-text: docs/evaluate.md) with paired 95 % bootstrap intervals (the
   unrotated bf16 model is the reference itself: change 0, not run).
3. Rotated against unrotated at the same scheme: a paired bootstrap (mixprec.verdicts, 2000 resamples,
   seed 0) over the same blocks, from both runs' per-block NLLs.
Bits per weight: 8 x the checkpoint's safetensors bytes / the unrotated model's parameter count (so the
untied head a rotation adds is counted, and bf16 unrotated is 16.0); file size: the safetensors bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from mixprec.hf import load_model
from mixprec.inference.algorithms.rotation import rotate_model_
from mixprec.verdicts import paired_bootstrap, perplexity_change

SCHEMES = ("bf16", "mxfp4a16", "nvfp4a16", "mxfp4")
MODEL_FILES = ("config.json", "generation_config.json")


def mixprec(*args: str) -> None:
    cmd = [sys.executable, "-m", "mixprec", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode not in (0, 1):  # 1: a gate is worse (none is set here, but keep the figures)
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def safetensors_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def write_rotated(model_dir: Path, out: Path, seed: int) -> dict:
    """The rotated bf16 model in `out` (tokenizer files copied); the rotation's record, without matrices."""
    model = load_model(model_dir, head="causal-lm", dtype=torch.bfloat16).eval()
    t0 = time.time()
    record = rotate_model_(model, seed=seed)
    record.pop("matrices")
    record["seconds"] = round(time.time() - t0, 1)
    model.save_pretrained(out)
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in MODEL_FILES:
            shutil.copy(f, out / f.name)
    return record


def parameter_count(model_dir: Path) -> int:
    model = load_model(model_dir, head="causal-lm", dtype=torch.bfloat16)
    return sum(p.numel() for p in model.parameters())  # a tied head is one parameter: counted once


def evaluate(reference: Path, candidate: Path, a: argparse.Namespace, out_json: Path) -> dict:
    mixprec("evaluate", "--reference", str(reference), "--candidate", str(candidate), "--data", str(a.data),
            "--task", "lm", "--samples", str(a.samples), "--seq-len", str(a.seq_len), "--device", "cpu",
            "--no-progress", "--json", str(out_json), "--force")  # fmt: skip
    return json.loads(out_json.read_text())


def paired_change(base: dict, other: dict) -> dict:
    """Perplexity change of `other`'s candidate over `base`'s, on the same blocks (paired bootstrap)."""
    nll_a = torch.tensor(base["per_sample"]["lm.block_candidate_nll"], dtype=torch.float64)
    nll_b = torch.tensor(other["per_sample"]["lm.block_candidate_nll"], dtype=torch.float64)
    tokens = torch.tensor(base["per_sample"]["lm.block_tokens"], dtype=torch.float64)
    assert torch.equal(tokens, torch.tensor(other["per_sample"]["lm.block_tokens"], dtype=torch.float64))
    iv = paired_bootstrap(perplexity_change, nll_a, nll_b, tokens, level=0.95, resamples=2000, seed=0)
    return {"estimate": iv.estimate, "low": iv.low, "high": iv.high}


def reference_as_candidate(ev: dict) -> dict:
    """An evaluation of the reference against itself, from one that scored it (change exactly 0): the
    unrotated bf16 cell needs no run of its own."""
    lm = dict(ev["tasks"]["lm"], candidate_perplexity=ev["tasks"]["lm"]["reference_perplexity"])
    zero = {"estimate": 0.0, "low": 0.0, "high": 0.0}
    lm["intervals"] = dict(lm["intervals"], perplexity_relative_change=zero)
    per_sample = dict(
        ev["per_sample"], **{"lm.block_candidate_nll": ev["per_sample"]["lm.block_reference_nll"]}
    )
    return dict(ev, tasks={"lm": lm}, per_sample=per_sample)


def run_cell(source: Path, scheme: str, a: argparse.Namespace, work: Path, tag: str) -> tuple[Path, float]:
    """The checkpoint of `source` in `scheme` (bf16: the source itself) and its quantize seconds."""
    if scheme == "bf16":
        return source, 0.0
    out = work / f"{tag}-{scheme}"
    t0 = time.time()
    mixprec(
        "quantize", "--model", str(source), "--output", str(out), "--scheme", scheme, "--force", "--quiet"
    )
    return out, time.time() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--data", type=Path, required=True, help="held-out text (not the calibration text)")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    p.add_argument("--work", type=Path, required=True, help="scratch directory (checkpoints, JSONs)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    rotated = a.work / "rotated"
    if rotated.exists():
        shutil.rmtree(rotated)
    record = write_rotated(a.model, rotated, a.seed)
    params = parameter_count(a.model)
    result = {"model": str(a.model), "data": str(a.data), "samples": a.samples, "seq_len": a.seq_len,
              "parameters": params, "rotation": record, "cells": {}}  # fmt: skip
    print(
        f"rotated in {record['seconds']} s (untied head: {record['untied_lm_head']}); {params} parameters",
        flush=True,
    )
    for scheme in a.schemes:
        runs = {}
        for tag, source in (("rotate", rotated), ("none", a.model)):
            t0 = time.time()
            checkpoint, quantize_s = run_cell(source, scheme, a, a.work, tag)
            if checkpoint == a.model:
                ev = reference_as_candidate(runs["rotate"])
            else:
                ev = evaluate(a.model, checkpoint, a, a.work / f"{tag}-{scheme}.json")
            lm = ev["tasks"]["lm"]
            iv = lm["intervals"]["perplexity_relative_change"]
            size = safetensors_bytes(checkpoint)
            runs[tag] = ev
            cell = {"perplexity": lm["candidate_perplexity"], "reference_perplexity": lm["reference_perplexity"],
                    "change": iv["estimate"], "low": iv["low"], "high": iv["high"], "bytes": size,
                    "bits_per_weight": 8 * size / params, "quantize_s": round(quantize_s, 1),
                    "seconds": round(time.time() - t0, 1)}  # fmt: skip
            result["cells"][f"{tag}/{scheme}"] = cell
            print(f"{tag:6s} {scheme:9s} ppl {cell['perplexity']:.4f} change {cell['change']:+.2%} "
                  f"[{cell['low']:+.2%}, {cell['high']:+.2%}] {cell['bits_per_weight']:.2f} bpw "
                  f"{size / 1e6:.1f} MB ({cell['seconds']:.0f} s)", flush=True)  # fmt: skip
        vs = paired_change(runs["none"], runs["rotate"])
        result["cells"][f"rotate/{scheme}"]["vs_unrotated_same_scheme"] = vs
        print(
            f"       {scheme:9s} rotated vs unrotated: {vs['estimate']:+.2%} [{vs['low']:+.2%}, {vs['high']:+.2%}]",
            flush=True,
        )
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
