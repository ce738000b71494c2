"""AWQ probe on a real model: does activation-aware scaling lower what nvfp4a16 round-to-nearest loses?

    python bench/awq_probe.py --model /tmp/realmodels/smol-hf --calib /tmp/realmodels/calib.txt \
        --data /tmp/realmodels/stdlib.txt --samples 32 --work /tmp/awq-probe --json awq-probe.json

1. The bf16 model is loaded, AWQ (mixprec.inference.algorithms.awq.awq_model_) searches and folds its
   scales on --calib-samples x --calib-seq-len tokens of --calib for the Linears `mixprec quantize
   --scheme SCHEME` would quantize (default ignore list), and the folded bf16 model is saved
   (save_pretrained, the tokenizer files copied beside it).
2. `mixprec quantize --scheme SCHEME` writes a checkpoint of the original model (RTN) and one of the
   folded model (AWQ + RTN): the same writer, the same scheme, so the folds are all that differs.
3. `mixprec evaluate --task lm` scores each against the original bf16 model on --data (held out from the
   calibration text): perplexity change with its paired 95 % interval; and the two candidates against
   each other, paired over the same blocks (the AWQ change minus the RTN change).
Prints the AWQ record's summary, the timings and the table; --json writes every figure.

Measured 2026-12-05 on the shared 2-core EPYC (load average 6-7; nice 5), SmolLM2-135M "Q4_1-derived"
(/tmp/realmodels/smol-hf, bench/make_smollm2.py), scales from the activations only (what --scales
activation runs now; duo scales were added after), defaults (16 x 256 calibration tokens, n_grid 20,
32 x 128 scored tokens of stdlib.txt, reference perplexity 17.084); 90 mappings searched and folded
(v -> o skipped in all 30 blocks: grouped-query attention, 192 vs 576 channels):

| scheme | RTN | AWQ + RTN | AWQ vs RTN (paired) | AWQ wall time |
|---|---|---|---|---|
| nvfp4a16 | +18.8 % [+16.1, +21.6] | +8.7 % [+6.4, +10.9] | -8.5 % [-10.7, -6.3] | 681 s |
| mxfp4a16 | +37.2 % [+32.1, +42.0] | +27.7 % [+23.3, +32.1] | -6.9 % [-10.1, -3.1] | 1042 s |
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
from torch import nn

from mixprec.hf import load_model, load_tokenizer
from mixprec.inference.algorithms.awq import awq_model_
from mixprec.inference.calibration.data import load_texts, token_batches
from mixprec.inference.schemes import SCHEMES, resolve_ignore, skip_reason
from mixprec.verdicts import paired_bootstrap, perplexity_change

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt")  # fmt: skip


def run_awq(a: argparse.Namespace, folded_dir: Path) -> dict:
    model = load_model(a.model, head="causal-lm", dtype=torch.bfloat16).eval()
    scheme = SCHEMES[a.scheme]
    ignore = resolve_ignore(None)
    schemes = {
        n: scheme
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and skip_reason(n, m.out_features, m.in_features, ignore, scheme) is None
    }
    batches = token_batches(load_texts(a.calib), load_tokenizer(a.model), a.calib_samples, a.calib_seq_len)
    started = time.perf_counter()
    record = awq_model_(model, batches, schemes, n_grid=a.n_grid, scales=a.scales)
    seconds = time.perf_counter() - started
    model.save_pretrained(folded_dir)
    for f in TOKENIZER_FILES:
        if (Path(a.model) / f).exists():
            shutil.copy(Path(a.model) / f, folded_dir / f)
    alphas = [r["alpha"] or 0.0 for r in record["mappings"].values()]  # None: s = 1
    print(f"AWQ: {len(alphas)} mappings searched, {record['folded']} folded, {len(record['skipped'])} skipped, "
          f"{record['tokens']} tokens, {seconds:.0f} s; mean alpha {sum(alphas) / len(alphas):.2f}", flush=True)  # fmt: skip
    return {**record, "wall_seconds": seconds, "quantized_linears": len(schemes)}


def mixprec(*args: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mixprec.cli", *args], check=True, env=os.environ.copy())
    return time.perf_counter() - started


def evaluate(a: argparse.Namespace, candidate: Path, out: Path) -> tuple[dict, float]:
    seconds = mixprec("evaluate", "--reference", a.model, "--candidate", str(candidate), "--data", a.data,
                      "--task", "lm", "--samples", str(a.samples), "--seq-len", str(a.seq_len), "--no-progress",
                      "--json", str(out), "--force")  # fmt: skip
    return json.loads(out.read_text()), seconds


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--calib", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--scheme", default="nvfp4a16")
    p.add_argument("--calib-samples", type=int, default=16)
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--n-grid", type=int, default=20)
    p.add_argument("--scales", choices=["duo", "activation", "both"], default="duo")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--work", required=True)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    folded = work / "awq-bf16"
    result: dict = {"model": a.model, "scheme": a.scheme, "awq": run_awq(a, folded), "seconds": {}}
    rows = {}
    for label, source in (("rtn", Path(a.model)), ("awq", folded)):
        ckpt = work / f"{label}-{a.scheme}"
        if ckpt.exists():
            shutil.rmtree(ckpt)
        result["seconds"][f"quantize {label}"] = mixprec("quantize", "--model", str(source), "--output", str(ckpt),
                                                         "--scheme", a.scheme, "--quiet")  # fmt: skip
        ev, result["seconds"][f"evaluate {label}"] = evaluate(a, ckpt, work / f"ev-{label}.json")
        lm = ev["tasks"]["lm"]
        rows[label] = {"reference_perplexity": lm["reference_perplexity"],
                       "candidate_perplexity": lm["candidate_perplexity"],
                       "change": lm["intervals"]["perplexity_relative_change"], "kl_mean": lm["kl_mean"],
                       "block_nll": ev["per_sample"]["lm.block_candidate_nll"],
                       "block_tokens": ev["per_sample"]["lm.block_tokens"]}  # fmt: skip
    # AWQ against RTN on the same blocks: the RTN candidate as the reference
    rtn_nll, awq_nll = (torch.tensor(rows[k]["block_nll"], dtype=torch.float64) for k in ("rtn", "awq"))
    tokens = torch.tensor(rows["rtn"]["block_tokens"], dtype=torch.float64)
    paired = paired_bootstrap(perplexity_change, rtn_nll, awq_nll, tokens)
    result["awq_vs_rtn"] = {"estimate": paired.estimate, "low": paired.low, "high": paired.high}
    result["rows"] = {
        k: {kk: vv for kk, vv in v.items() if not kk.startswith("block_")} for k, v in rows.items()
    }
    print(f"\n{a.scheme}, {a.samples} x {a.seq_len} tokens of {a.data}; reference ppl "
          f"{rows['rtn']['reference_perplexity']:.3f}")  # fmt: skip
    print("| candidate | perplexity | change [95 % interval] | KL mean |\n|---|---|---|---|")
    for label, r in rows.items():
        c = r["change"]
        print(f"| {label} | {r['candidate_perplexity']:.3f} | {100 * c['estimate']:+.1f} % "
              f"[{100 * c['low']:+.1f} %, {100 * c['high']:+.1f} %] | {r['kl_mean']:.4f} |")  # fmt: skip
    print(f"AWQ vs RTN perplexity (paired, same blocks): {100 * paired.estimate:+.1f} % "
          f"[{100 * paired.low:+.1f} %, {100 * paired.high:+.1f} %]")  # fmt: skip
    print(
        "seconds:",
        {k: round(v) for k, v in result["seconds"].items()},
        f"awq {result['awq']['wall_seconds']:.0f}",
    )
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
