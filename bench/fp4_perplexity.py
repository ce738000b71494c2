"""Perplexity change of the FP4 inference schemes against the high-precision model (docs/fp4.md).

    python bench/fp4_perplexity.py --model /tmp/realmodels/smol-hf --blocks 64 --json fp4-ppl.json

Text: the project's default corpus (the Python standard library's .py sources, mixprec.data.load_corpus),
its documents joined by the tokenizer's end-of-text token and cut into --seq-len blocks; --blocks of
them, evenly spaced over the whole stream (so they come from many files), are scored. The reference is
the checkpoint's bf16 weights computed in fp32 (exact upcast; this CPU has no fast bf16 GEMM).

Candidates are quantized from the bf16 weights by mixprec.quantize_model_ (so scales and global scales are
those `mixprec quantize` writes), then run in fp32: the weight-only schemes multiply by the dequantized
weight, W4A4 quantizes activations per call. nvfp4's input global scales come from the input amax of the
fp32 reference on --calib-blocks other blocks (the max observer; 448 * 6 / amax, in bf16 as
llm-compressor computes it). Perplexity change and its 95 % interval: mixprec.verdicts.paired_bootstrap
over blocks (2000 resamples, seed 0).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from mixprec.data import load_corpus
from mixprec.hf import load_model, load_tokenizer
from mixprec.inference.calibration.run import calibrate
from mixprec.inference.checkpoint.block_tensors import input_global_scale
from mixprec.inference.runtime.online import apply_scheme_, linear_targets
from mixprec.inference.schemes import SCHEMES, resolve_ignore
from mixprec.verdicts import paired_bootstrap, perplexity_change


def blocks_of(model_dir: str, n: int, seq_len: int, calib: int) -> tuple[torch.Tensor, torch.Tensor]:
    tok = load_tokenizer(model_dir)
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    ids: list[int] = []
    for doc in load_corpus().documents:
        ids += tok(doc, add_special_tokens=False)["input_ids"] + [eos]
    stream = torch.tensor(ids[: len(ids) // seq_len * seq_len]).view(-1, seq_len)
    picks = torch.linspace(0, len(stream) - 1, n + calib).round().long()
    chosen = stream[picks]
    return chosen[calib:], chosen[:calib]  # scored blocks, calibration blocks (interleaved positions)


@torch.no_grad()
def block_nll(model, blocks: torch.Tensor, batch: int = 8) -> torch.Tensor:
    out = []
    for i in range(0, len(blocks), batch):
        ids = blocks[i : i + batch]
        logits = model(ids).logits.float()
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        )
        out.append(nll.view(len(ids), -1).sum(dim=1).double())
    return torch.cat(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--calib-blocks", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--schemes", nargs="+", default=["nvfp4a16", "nvfp4", "mxfp4"])
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.manual_seed(0)
    blocks, calib = blocks_of(a.model, a.blocks, a.seq_len, a.calib_blocks)
    tokens = torch.full((len(blocks),), float(a.seq_len - 1), dtype=torch.float64)
    t0 = time.time()
    ref = load_model(a.model, dtype=torch.float32).eval()
    ref_nll = block_nll(ref, blocks)
    result = {"model": a.model, "blocks": len(blocks), "seq_len": a.seq_len,
              "reference_ppl": math.exp(float(ref_nll.sum() / tokens.sum())), "schemes": {}}  # fmt: skip
    print(f"reference ppl {result['reference_ppl']:.4f} ({time.time() - t0:.0f} s)", flush=True)
    input_amax = None
    for name in a.schemes:
        t0 = time.time()
        cand = load_model(a.model, dtype="auto").eval()  # bf16: scales computed as a checkpoint's are
        scales = None
        if SCHEMES[name].needs_calibration:
            if input_amax is None:
                names, _ = linear_targets(ref, SCHEMES[name], resolve_ignore(None))
                input_amax = calibrate(ref, [calib], names).input_amax
            scales = {"layers": {n: {"input": {"scale": float(input_global_scale(v, torch.bfloat16))}}
                                 for n, v in input_amax.items()}}  # fmt: skip
        apply_scheme_(cand, name, scales=scales)
        cand.float()
        nll = block_nll(cand, blocks)
        iv = paired_bootstrap(perplexity_change, ref_nll, nll, tokens, level=0.95, resamples=2000, seed=0)
        ppl = math.exp(float(nll.sum() / tokens.sum()))
        result["schemes"][name] = {"ppl": ppl, "change": iv.estimate, "low": iv.low, "high": iv.high}
        print(f"{name}: ppl {ppl:.4f}, change {iv.estimate:+.2%} [{iv.low:+.2%}, {iv.high:+.2%}] "
              f"({time.time() - t0:.0f} s)", flush=True)  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
