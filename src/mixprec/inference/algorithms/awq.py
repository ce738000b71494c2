"""AWQ-style activation-aware scaling (Lin et al., 2024; AutoAWQ's search): per mapping of a decoder
block (folds.py), per-input-channel scales searched on the parent module's output error, then folded.

Block by block (the calibration walk, calibration/layerwise.py, with a BlockPass), for each mapping:

    x_mean  = mean |x| per input channel of the following Linears' input, over the calibration tokens
    w_mean  = mean over the following Linears' rows of |W| / (its quantization block's max |W| + 1e-6),
              per input channel (duo scales only)
    candidates: s = 1, then for alpha in 0, 1/n, ..., (n-1)/n, by `scales`:
        "duo" (the default: AutoAWQ's and llm-compressor's)   s = x_mean^alpha / (w_mean^(1 - alpha) + 1e-4)
        "activation" (the paper's)                            s = x_mean^alpha
        "both"                                                each of the two
        s at least 1e-4, normalised: s / sqrt(max(s) min(s))
        each following Linear's weight -> RTN(W * s) / s   (its scheme's own round to nearest: the one
                                                           quantize entry with the scheme's format and
                                                           granularity, as schemes.quantize_weight without
                                                           its statistics; fused q/k/v and gate/up share
                                                           their scales as the writer shares them)
        error = MSE of the parent's output on the block's cached inputs against its unquantized output
    keep the candidate of least error

s = 1 is round to nearest: a mapping whose best candidate is s = 1 is left alone (its weights keep their
bits), so scales are kept only where they lower the measured error. Duo's alpha = 0 divides by the
weights' magnitude alone; the activation scales' alpha = 0 is s = 1 itself and is not evaluated twice.
Neither family won on both models measured (docs/algorithms.md), hence "both" as a choice.

Each mapping is folded (folds.py) as soon as it is searched, the Linear -> Linear mappings of a block
(v -> o, up -> down) before the norm ones: a Linear -> Linear fold rescales the rows of v_proj / up_proj,
which the norm mappings then quantize, so this way every search rounds exactly the weights the folded
model ends with (searching all on the original weights, as AutoAWQ does, lets a later row scaling undo
an earlier choice: measured on MXFP4, whose power-of-two block scales it moves). The model stays an
ordinary one: the checkpoint written from it is served unchanged. The next block is calibrated on this
block's outputs, which the folds leave unchanged up to rounding.

The record gives per mapping the chosen alpha and family (`scales`: "duo" or "activation"; both None
when s = 1 won), and the parent's relative output error (MSE over the mean square of the unquantized
output) at s = 1 (`error_before`: round to nearest of the weights as they stand when the mapping is
searched, i.e. after the block's Linear -> Linear folds) and at the chosen scales (`error_after`). Only
weights are rounded in the search, also for the schemes that quantize activations (as AutoAWQ and
llm-compressor search).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.inference.algorithms.folds import (
    LINEAR,
    BlockMappings,
    FoldMapping,
    block_mappings,
    check_token_batches,
    fold_scales_,
)
from mixprec.inference.algorithms.gptq_pass import shared_scales
from mixprec.inference.algorithms.spec import AWQ_SCALES
from mixprec.inference.calibration.layerwise import Captured, calibrate_blockwise
from mixprec.inference.schemes import InferenceScheme
from mixprec.quantization import quantize
from mixprec.scaling import block_amax, expand_scale

NOT_QUANTIZED = "none of its Linears is quantized"
DUO, ACTIVATION, BOTH = AWQ_SCALES


def awq_model_(model: nn.Module, batches: Sequence[torch.Tensor], schemes: Mapping[str, InferenceScheme | str],
               n_grid: int = 20, scales: str = DUO) -> dict[str, Any]:  # fmt: skip
    """Search and fold AWQ scales into `model` in place, for the Linears of `schemes` ({Linear name:
    scheme}) quantized by round to nearest, with the family of scales `scales` (AWQ_SCALES: "duo" from
    activation and weight magnitudes, "activation", or "both"); returns the record (per mapping: alpha,
    scales, error before and after, whether it was folded; the mappings left out with the reason).
    MixprecError, before any change: a model without Llama-like RMSNorm blocks, a scheme for a module
    that is not a Linear of the model, no mapping with a quantized Linear, n_grid < 1, unknown scales,
    bad batches."""
    found, resolved = awq_plan(model, batches, schemes, n_grid, scales)
    dtype = next(model.parameters()).dtype
    started = time.perf_counter()
    awq = AwqPass(model, found, resolved, n_grid, dtype, scales)
    calibrate_blockwise(model, batches, [], block_pass=awq)
    return awq.record(batches, time.perf_counter() - started)


def awq_plan(model: nn.Module, batches: Sequence[torch.Tensor], schemes: Mapping[str, InferenceScheme | str],
             n_grid: int, scales: str, loaded: bool = True) -> tuple[BlockMappings, dict[str, InferenceScheme]]:  # fmt: skip
    """(the mappings, the schemes resolved) of an AWQ run, every argument checked first (awq_model_'s
    MixprecErrors); loaded=False: a skeleton on the meta device (block_mappings)."""
    if not isinstance(n_grid, int) or n_grid < 1:
        raise MixprecError(f"AWQ n_grid must be a positive number of grid points, got {n_grid!r}")
    if scales not in AWQ_SCALES:
        raise MixprecError(f"AWQ scales must be one of {', '.join(AWQ_SCALES)}, got {scales!r}")
    check_token_batches(batches)
    found = block_mappings(model, loaded)
    resolved = check_schemes(model, schemes)
    if not any(n in resolved for m in found.mappings for n in m.linears):
        raise MixprecError(
            "AWQ scales the Linears that follow a norm or a projection inside the decoder blocks; none of them "
            f"is among the {len(resolved)} quantized Linear(s)"
        )
    return found, resolved


def check_schemes(
    model: nn.Module, schemes: Mapping[str, InferenceScheme | str]
) -> dict[str, InferenceScheme]:
    if not isinstance(schemes, Mapping) or not schemes:
        raise MixprecError("AWQ needs the quantized Linears and their schemes: a non-empty {name: scheme}")
    modules = dict(model.named_modules())
    wrong = [n for n in schemes if not isinstance(modules.get(n), nn.Linear)]
    if wrong:
        raise MixprecError(f"AWQ: {wrong[0]!r} is not a Linear of {type(model).__name__}")
    return {n: InferenceScheme.from_name(s) for n, s in schemes.items()}


def awq_scales(x_mean: torch.Tensor, alpha: float, w_mean: torch.Tensor | None = None) -> torch.Tensor:
    """x_mean^alpha, over (w_mean^(1 - alpha) + 1e-4) with duo scaling (w_mean given), at least 1e-4,
    divided by sqrt(max * min) (fp32): all ones for alpha = 0 without w_mean."""
    s = x_mean.float().pow(alpha)
    if w_mean is not None:
        s = s / (w_mean.float().pow(1.0 - alpha) + 1e-4)
    s = s.clamp_min(1e-4)
    return s / (s.max() * s.min()).sqrt()


def weight_means(weights: Mapping[str, torch.Tensor], schemes: Mapping[str, InferenceScheme]) -> torch.Tensor:
    """Per input channel, the mean over all rows of `weights` of |W| / (max |W| of its quantization
    block under its scheme + 1e-6) (fp32): how large a channel's weights are where they are rounded."""
    total, rows = None, 0
    for n, w in weights.items():
        g = schemes[n].weight_granularity
        w2 = w.detach().float()
        amax = expand_scale(block_amax(w2, g), g, *w2.shape)
        column_sum = (w2.abs() / (amax + 1e-6)).sum(dim=0, dtype=torch.float64)
        total = column_sum if total is None else total + column_sum
        rows += w2.shape[0]
    return (total / rows).float()


class AwqPass:
    """The BlockPass that searches and folds the scales of every mapping of a block: `hooks` caches
    the parents' inputs and the mean |x| of the Linears' inputs during the block's forward, `after`
    searches and folds. `mappings` holds the record of each mapping, `skipped` those left out."""

    def __init__(self, model: nn.Module | None, found: BlockMappings, schemes: Mapping[str, InferenceScheme],
                 n_grid: int, dtype: torch.dtype, scales: str = DUO) -> None:  # fmt: skip
        self.model, self.found, self.schemes, self.n_grid, self.dtype = model, found, schemes, n_grid, dtype
        self.scales = scales
        self.mappings: dict[str, dict[str, Any]] = {}
        self.skipped: dict[str, str] = dict(found.skipped)
        self._inputs: dict[str, Captured] = {}  # parent -> its (args, kwargs) per batch
        self._abs_sum: dict[str, torch.Tensor] = {}  # first following Linear -> sum |x| per channel
        self._rows: dict[str, int] = {}

    def hooks(self, own: str, modules: dict[str, nn.Module]) -> list[Any]:
        # the walk's model: the one given, or the skeleton a walk over a checkpoint builds (fold_checkpoint.py)
        self.model = modules.get("", self.model)
        handles = []
        for m in self._active(own):
            self._inputs[m.parent] = []
            handles.append(
                modules[m.parent].register_forward_pre_hook(self._cache(m.parent), with_kwargs=True)
            )
            handles.append(modules[m.linears[0]].register_forward_pre_hook(self._mean_abs(m.linears[0])))
        return handles

    def after(self, own: str, block: nn.Module, captured: Captured, outputs: Captured,
              rerun: Callable[[nn.Module, Captured], Captured]) -> Captured:  # fmt: skip
        modules = dict(self.model.named_modules())
        # Linear -> Linear first: their folds rescale rows that the norm mappings then round
        for m in sorted(self._active(own), key=lambda m: m.kind != LINEAR):
            x_mean = self._abs_sum[m.linears[0]] / self._rows[m.linears[0]]
            alpha, family, s, before, after = self._search(m, x_mean, modules)
            self.mappings[m.name] = {
                "linears": [n for n in m.linears if n in self.schemes], "alpha": alpha, "scales": family,
                "error_before": before, "error_after": after, "folded": alpha is not None,
            }  # fmt: skip
            if alpha is not None:
                fold_scales_(self.model, m, s)
        self._inputs.clear()
        self._abs_sum.clear()
        self._rows.clear()
        return outputs  # the folds leave the block's function unchanged

    def record(self, batches: Sequence[torch.Tensor], seconds: float) -> dict[str, Any]:
        """The run's record (awq_model_'s return value)."""
        return {
            "algorithm": "awq", "n_grid": self.n_grid, "scales": self.scales, "mappings": self.mappings,
            "skipped": self.skipped, "folded": sum(r["folded"] for r in self.mappings.values()),
            "tokens": sum(b.numel() for b in batches), "seconds": round(seconds, 3),
        }  # fmt: skip

    def _active(self, own: str) -> list[FoldMapping]:
        active = []
        for m in self.found.inside(own):
            if any(n in self.schemes for n in m.linears):
                active.append(m)
            else:
                self.skipped[m.name] = NOT_QUANTIZED
        return active

    def _cache(self, parent: str):
        def hook(_m, args, kwargs):
            self._inputs[parent].append((args, dict(kwargs)))

        return hook

    def _mean_abs(self, name: str):
        def hook(_m, args):
            x = args[0].detach()
            total = x.abs().reshape(-1, x.shape[-1]).sum(dim=0, dtype=torch.float64)
            self._abs_sum[name] = self._abs_sum[name] + total if name in self._abs_sum else total
            self._rows[name] = self._rows.get(name, 0) + x.numel() // x.shape[-1]

        return hook

    def _search(self, m: FoldMapping, x_mean: torch.Tensor, modules: dict[str, nn.Module]) -> tuple[float | None, str | None, torch.Tensor, float, float]:  # fmt: skip
        """(best alpha and its family, both None for s = 1; the scales; relative error at s = 1, at the
        best scales)."""
        parent = modules[m.parent]
        inputs = self._inputs[m.parent]
        reference = [_output(parent, a, k) for a, k in inputs]
        power = sum(float(r.float().square().sum()) for r in reference)
        quantized = [n for n in m.linears if n in self.schemes]
        originals = {n: modules[n].weight.data for n in quantized}
        results: list[tuple[float | None, str | None, torch.Tensor, float]] = []
        try:
            for alpha, family, s in self._candidates(x_mean, originals):
                for n, w in self._rounded(originals, s).items():
                    modules[n].weight.data = w
                sq = sum(float((_output(parent, a, k).float() - r.float()).square().sum())
                         for (a, k), r in zip(inputs, reference, strict=True))  # fmt: skip
                results.append((alpha, family, s, sq / power if power > 0 else sq))
        finally:
            for n, w in originals.items():
                modules[n].weight.data = w
        best = min(results, key=lambda r: r[3])  # the first of equal errors: s = 1 wins ties
        return best[0], best[1], best[2], results[0][3], best[3]

    def _candidates(self, x_mean: torch.Tensor, originals: dict[str, torch.Tensor]):
        """(alpha, family, scales) in search order: (None, None, ones) first, then each family's grid of
        alpha in [0, 1) (the activation scales from 1/n: their alpha 0 is s = 1 again)."""
        yield None, None, torch.ones_like(x_mean, dtype=torch.float32)
        if self.scales in (ACTIVATION, BOTH):
            for i in range(1, self.n_grid):
                yield i / self.n_grid, ACTIVATION, awq_scales(x_mean, i / self.n_grid)
        if self.scales in (DUO, BOTH):
            w_mean = weight_means(originals, self.schemes)
            for i in range(self.n_grid):
                yield i / self.n_grid, DUO, awq_scales(x_mean, i / self.n_grid, w_mean)

    def _rounded(self, originals: dict[str, torch.Tensor], s: torch.Tensor) -> dict[str, torch.Tensor]:
        """{Linear: RTN(W * s) / s in the weight's dtype}, fused shards sharing their scales."""
        # W * s as the fold computes it (fp64, one rounding to the weight's dtype)
        s64 = s.double()[None, :]
        scaled = {n: (w.double() * s64).to(w.dtype) for n, w in originals.items()}
        amax = {n: float(w.abs().amax()) for n, w in scaled.items()}
        fixed = shared_scales(tuple(scaled), amax, self.schemes, self.dtype)
        out = {}
        for n, w in scaled.items():
            scale, global_scale = fixed.get(n, (None, None))
            sch = self.schemes[n]
            q = quantize(w, sch.fmt, sch.weight_granularity, scale=scale, global_scale=global_scale)
            out[n] = (q.dequantize() / s[None, :]).to(w.dtype)
        return out


def _output(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    out = module(*args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


__all__ = [
    "NOT_QUANTIZED",
    "AwqPass",
    "awq_model_",
    "awq_plan",
    "awq_scales",
    "check_schemes",
    "weight_means",
]
