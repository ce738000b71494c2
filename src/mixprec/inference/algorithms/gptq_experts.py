"""GPTQ over MoE expert weights: what differs from a dense Linear (gptq_pass.py runs both).

Each expert weight (w1 / w3 / w2, or gate / up / down, of one expert) is a Linear of its own in the
walk (runtime/experts.py: UnfusedExperts), so its Hessian accumulates from the tokens the router
sends to that expert only, and its record's `tokens` is that count; an expert's gate and up read the
same input and share one Hessian, as q/k/v do (gptq_pass.input_groups), its down reads its own.

A dense Linear sees every calibration token; an expert sees its routed share, which for a rarely
chosen expert is a handful of tokens or none. Such an expert is rounded to nearest instead
(too_few_tokens gives the threshold and why), exactly as the writer would round it without GPTQ
(round_to_nearest), and its record says so: `"fallback": "rtn"`, its two output errors equal.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from mixprec.inference.algorithms.scale_search import search_weight
from mixprec.inference.schemes import InferenceScheme, quantize_weight
from mixprec.scaling import QuantizedTensor

# An expert's Hessian is solved only when it saw at least this many routed tokens per input. Below one
# token per input, H = 2/n X^T X is rank-deficient (rank <= tokens < K): GPTQ's error feedback is then
# free along the directions those few tokens never exercised (only the dampening holds it there), so it
# fits the handful of tokens seen and can raise the error on every other input the expert will get;
# round to nearest's error does not depend on which tokens were seen. A dense Linear below one token
# per input is still solved (with a warning): there it means the whole calibration set is tiny, which
# the user chose; for an expert it is routine (64 or more experts, a few routed to each token).
MIN_TOKENS_PER_INPUT = 1.0


def too_few_tokens(tokens: int, in_features: int) -> bool:
    """Whether an expert weight whose Hessian saw `tokens` routed tokens is rounded to nearest."""
    return tokens < MIN_TOKENS_PER_INPUT * in_features


def round_to_nearest(w: torch.Tensor, sch: InferenceScheme, global_scale: torch.Tensor | None, search: bool,
                     name: str) -> QuantizedTensor:  # fmt: skip
    """`w` rounded as the writer rounds a weight no algorithm rounded (producers/quantize_stream.py and
    quantize_blocks.py): the scheme's quantize entry with the fused GEMM's NVFP4 global scale, or the
    scale search's scales under --algorithm scale-search; an FP8 weight keeps its own per-tensor scale
    (the writer's, not the one GPTQ shares across fused shards)."""
    if search and not sch.is_fp8:
        return search_weight(w, sch.fmt, sch.weight_granularity, global_scale)
    return quantize_weight(w, sch, name=name, global_scale=global_scale)[0]


def rtn_group(group: tuple[str, ...], hessian: torch.Tensor | None, tokens: int,
              weights: Mapping[str, torch.Tensor], schemes: Mapping[str, InferenceScheme],
              global_scales: Mapping[str, torch.Tensor | None],
              search: bool) -> dict[str, tuple[QuantizedTensor, dict[str, Any]]]:  # fmt: skip
    """{expert weight: (rounded to nearest, its record)} of an input group that saw too few tokens;
    hessian: None when it saw none (its output errors are then 0: nothing measured them).
    global_scales: the NVFP4 global scale each shares with its fused GEMM (gptq_pass.shared_scales:
    an expert's w1 and w3 share one, as the writer's)."""
    out = {}
    for m, w in weights.items():
        w = w.detach()
        started = time.perf_counter()
        q = round_to_nearest(w, schemes[m], global_scales.get(m), search, f"{m}.weight")
        error = 0.0 if hessian is None else _output_error(w, q, hessian)
        out[m] = q, {
            "output_error_rtn": error, "output_error": error, "seconds": round(time.perf_counter() - started, 3),
            "tokens": tokens, "fallback": "rtn",
        }  # fmt: skip
    return out


def _output_error(w: torch.Tensor, q: QuantizedTensor, hessian: torch.Tensor) -> float:
    """tr(E H E^T) / tr(W H W^T): the relative calibration output error, from H itself (no solve)."""
    x = w.float()
    den = float((x @ hessian * x).sum())
    e = x - q.dequantize()
    return max(0.0, float((e @ hessian * e).sum())) / den if den > 0 else 0.0


def fallback_warning(fallen: list[tuple[str, int, int]], experts: int) -> str:
    """The one warning for the expert weights rounded to nearest ((name, tokens, inputs) each), of
    `experts` expert weights in all; its example is the one with the fewest tokens per input."""
    name, tokens, inputs = min(fallen, key=lambda t: t[1] / t[2])
    return (
        f"GPTQ: {len(fallen)} of {experts} MoE expert weight(s) saw fewer routed calibration tokens than "
        f"{MIN_TOKENS_PER_INPUT:g} per input and are rounded to nearest (e.g. {name}: {tokens} tokens for "
        f"{inputs} inputs); give more calibration samples or longer sequences to GPTQ them"
    )


__all__ = ["MIN_TOKENS_PER_INPUT", "fallback_warning", "round_to_nearest", "rtn_group", "too_few_tokens"]
