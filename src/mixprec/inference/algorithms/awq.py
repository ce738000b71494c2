"""AWQ-style activation-aware scaling (Lin et al., 2024; AutoAWQ's search): per mapping of a decoder
block (folds.py), per-input-channel scales searched on the parent module's output error, then folded.

Block by block (the calibration walk, calibration/layerwise.py, with a BlockPass), for each mapping:

    x_mean  = mean |x| per input channel of the following Linears' input, over the calibration tokens
    for alpha in 0, 1/n, ..., (n-1)/n:
        s = x_mean^alpha (at least 1e-4), normalised: s / sqrt(max(s) min(s))
        each following Linear's weight -> RTN(W * s) / s   (its scheme's own round to nearest: the one
                                                           quantize entry with the scheme's format and
                                                           granularity, as schemes.quantize_weight without
                                                           its statistics; fused q/k/v and gate/up share
                                                           their scales as the writer shares them)
        error = MSE of the parent's output on the block's cached inputs against its unquantized output
    keep the alpha of least error

alpha = 0 is s = 1, round to nearest: a mapping whose best alpha is 0 is left alone (its weights keep
their bits), so scales are kept only where they lower the measured error.

Each mapping is folded (folds.py) as soon as it is searched, the Linear -> Linear mappings of a block
(v -> o, up -> down) before the norm ones: a Linear -> Linear fold rescales the rows of v_proj / up_proj,
which the norm mappings then quantize, so this way every search rounds exactly the weights the folded
model ends with (searching all on the original weights, as AutoAWQ does, lets a later row scaling undo
an earlier choice: measured on MXFP4, whose power-of-two block scales it moves). The model stays an
ordinary one: the checkpoint written from it is served unchanged. The next block is calibrated on this
block's outputs, which the folds leave unchanged up to rounding.

The record gives per mapping the chosen alpha and the parent's relative output error (MSE over the mean
square of the unquantized output) at alpha 0 (`error_before`: round to nearest of the weights as they
stand when the mapping is searched, i.e. after the block's Linear -> Linear folds) and at the chosen
alpha (`error_after`). Only weights are rounded in the search, also for the schemes that quantize
activations (as AutoAWQ and llm-compressor search).
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
from mixprec.inference.calibration.layerwise import Captured, calibrate_blockwise
from mixprec.inference.schemes import InferenceScheme
from mixprec.quantization import quantize

NOT_QUANTIZED = "none of its Linears is quantized"


def awq_model_(model: nn.Module, batches: Sequence[torch.Tensor], schemes: Mapping[str, InferenceScheme | str],
               n_grid: int = 20) -> dict[str, Any]:  # fmt: skip
    """Search and fold AWQ scales into `model` in place, for the Linears of `schemes` ({Linear name:
    scheme}) quantized by round to nearest; returns the record (per mapping: alpha, error before and
    after, whether it was folded; the mappings left out with the reason). MixprecError, before any
    change: a model without Llama-like RMSNorm blocks, a scheme for a module that is not a Linear of
    the model, no mapping with a quantized Linear, n_grid < 1, bad batches."""
    if not isinstance(n_grid, int) or n_grid < 1:
        raise MixprecError(f"AWQ n_grid must be a positive number of grid points, got {n_grid!r}")
    check_token_batches(batches)
    found = block_mappings(model)
    resolved = _check_schemes(model, schemes)
    if not any(n in resolved for m in found.mappings for n in m.linears):
        raise MixprecError(
            "AWQ scales the Linears that follow a norm or a projection inside the decoder blocks; none of them "
            f"is among the {len(resolved)} quantized Linear(s)"
        )
    dtype = next(model.parameters()).dtype
    started = time.perf_counter()
    awq = AwqPass(model, found, resolved, n_grid, dtype)
    calibrate_blockwise(model, batches, [], block_pass=awq)
    return {
        "algorithm": "awq", "n_grid": n_grid, "mappings": awq.mappings, "skipped": awq.skipped,
        "folded": sum(r["folded"] for r in awq.mappings.values()), "tokens": sum(b.numel() for b in batches),
        "seconds": round(time.perf_counter() - started, 3),
    }  # fmt: skip


def _check_schemes(
    model: nn.Module, schemes: Mapping[str, InferenceScheme | str]
) -> dict[str, InferenceScheme]:
    if not isinstance(schemes, Mapping) or not schemes:
        raise MixprecError("AWQ needs the quantized Linears and their schemes: a non-empty {name: scheme}")
    modules = dict(model.named_modules())
    wrong = [n for n in schemes if not isinstance(modules.get(n), nn.Linear)]
    if wrong:
        raise MixprecError(f"AWQ: {wrong[0]!r} is not a Linear of {type(model).__name__}")
    return {n: InferenceScheme.from_name(s) for n, s in schemes.items()}


def awq_scales(x_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """x_mean^alpha (at least 1e-4) divided by sqrt(max * min) (fp32): all ones for alpha = 0."""
    s = x_mean.float().pow(alpha).clamp_min(1e-4)
    return s / (s.max() * s.min()).sqrt()


class AwqPass:
    """The BlockPass that searches and folds the scales of every mapping of a block: `hooks` caches
    the parents' inputs and the mean |x| of the Linears' inputs during the block's forward, `after`
    searches and folds. `mappings` holds the record of each mapping, `skipped` those left out."""

    def __init__(self, model: nn.Module, found: BlockMappings, schemes: Mapping[str, InferenceScheme],
                 n_grid: int, dtype: torch.dtype) -> None:  # fmt: skip
        self.model, self.found, self.schemes, self.n_grid, self.dtype = model, found, schemes, n_grid, dtype
        self.mappings: dict[str, dict[str, Any]] = {}
        self.skipped: dict[str, str] = dict(found.skipped)
        self._inputs: dict[str, Captured] = {}  # parent -> its (args, kwargs) per batch
        self._abs_sum: dict[str, torch.Tensor] = {}  # first following Linear -> sum |x| per channel
        self._rows: dict[str, int] = {}

    def hooks(self, own: str, modules: dict[str, nn.Module]) -> list[Any]:
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
            alpha, s, before, after = self._search(m, x_mean, modules)
            self.mappings[m.name] = {
                "linears": [n for n in m.linears if n in self.schemes], "alpha": alpha,
                "error_before": before, "error_after": after, "folded": alpha > 0,
            }  # fmt: skip
            if alpha > 0:
                fold_scales_(self.model, m, s)
        self._inputs.clear()
        self._abs_sum.clear()
        self._rows.clear()
        return outputs  # the folds leave the block's function unchanged

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

    def _search(self, m: FoldMapping, x_mean: torch.Tensor, modules: dict[str, nn.Module]) -> tuple[float, torch.Tensor, float, float]:  # fmt: skip
        """(best alpha, its scales, relative error at alpha 0, at the best alpha)."""
        parent = modules[m.parent]
        inputs = self._inputs[m.parent]
        reference = [_output(parent, a, k) for a, k in inputs]
        power = sum(float(r.float().square().sum()) for r in reference)
        quantized = [n for n in m.linears if n in self.schemes]
        originals = {n: modules[n].weight.data for n in quantized}
        results: list[tuple[float, torch.Tensor, float]] = []
        try:
            for i in range(self.n_grid):
                alpha = i / self.n_grid
                s = awq_scales(x_mean, alpha)
                for n, w in self._rounded(originals, s).items():
                    modules[n].weight.data = w
                sq = sum(float((_output(parent, a, k).float() - r.float()).square().sum())
                         for (a, k), r in zip(inputs, reference, strict=True))  # fmt: skip
                results.append((alpha, s, sq / power if power > 0 else sq))
        finally:
            for n, w in originals.items():
                modules[n].weight.data = w
        best = min(
            results, key=lambda r: r[2]
        )  # the first (smallest alpha) of equal errors: alpha 0 wins ties
        return best[0], best[1], results[0][2], best[2]

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


__all__ = ["NOT_QUANTIZED", "AwqPass", "awq_model_", "awq_scales"]
