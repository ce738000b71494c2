"""Weight scale search for the FP4 / MX block schemes (`--algorithm scale-search`): per block, the
scale with the least squared rounding error among a few candidates, instead of the one that maps the
block's amax to the format's largest value.

    q = search_scales(w, scheme.fmt, scheme.weight_granularity, global_scale=g)   # a QuantizedTensor

Candidates per block, as the scale formats allow:
- NVFP4 (E4M3 block scales in units of a global scale): the round-to-nearest scale times
  SCALE_FACTORS (re-rounded to E4M3). Factors below 1 clip the block's largest elements to gain
  resolution for the rest; factors above 1 reach "4 over 6" (the block's amax mapped to 4 instead of
  6: 1.5x the scale, a finer grid relative to the amax where E2M1's step from 4 to 6 costs most). So
  that 1.5x the largest block scale still fits E4M3 (448), the global scale is computed for 256 instead
  of 448: NVFP4_SEARCH_HEADROOM. That is the "256 normalisation"; a checkpoint keeps any global scale
  it is given.
- MX (E8M0 powers of two): the round-to-nearest exponent, one below and one above.
Every candidate is rounded by the one quantize entry; the chosen scales are returned as the grid the
writer stores (and GPTQ rounds with, when both run: gptq.py takes its group scales from here).
Formats with fp32 scales (the FP8 schemes) have nothing to search and are refused by the spec.
"""

from __future__ import annotations

import torch

from mixprec.errors import MixprecError
from mixprec.formats import E4M3, Format
from mixprec.quantization import quantize
from mixprec.scaling import Granularity, QuantizedTensor

# Multipliers of the round-to-nearest NVFP4 block scale that are tried (1.5: "4 over 6").
SCALE_FACTORS = (0.8, 0.85, 0.9, 0.95, 1.1, 1.2, 1.3, 1.4, 1.5)
# The global scale maps the tensor's amax to 256 (not 448) E4M3 block-scale units: room for 1.5x.
NVFP4_SEARCH_HEADROOM = 256.0 / 448.0


def searchable(g: Granularity) -> bool:
    return g.scale_format in ("e4m3", "e8m0") and g.block_rows == 1 and g.block_cols is not None


def search_global_scale(global_scale: torch.Tensor) -> torch.Tensor:
    """The global scale a search quantizes with: the round-to-nearest one times the headroom."""
    return (global_scale.float() * NVFP4_SEARCH_HEADROOM).reshape(global_scale.shape)


def search_scales(
    w: torch.Tensor,
    fmt: Format,
    g: Granularity,
    *,
    global_scale: torch.Tensor | None = None,
    column_weights: torch.Tensor | None = None,
) -> QuantizedTensor:
    """`w` [N, K] quantized with, per block, the candidate scale of least squared error (ties: the
    round-to-nearest scale). NVFP4: `global_scale` as used (search_global_scale of the
    round-to-nearest one; fused shards share it); None: computed so from w. column_weights [K]: each
    input column's weight in the error (GPTQ passes its Hessian's diagonal, the mean square of that
    input: the error measured on the layer's output, not on the weight). Inputs are not modified."""
    if not searchable(g):
        raise MixprecError(f"scale search covers 1-D FP4 / MX blocks, not {g.name} scales")
    if g.scale_format == "e4m3" and global_scale is None:
        global_scale = search_global_scale(quantize(w, fmt, g).global_scale)
    base = quantize(w, fmt, g, global_scale=global_scale)
    x = w.detach().float()
    best_scale, best_err = base.scale, _block_errors(x, base, column_weights)
    for candidate in _candidates(base.scale, g):
        q = quantize(w, fmt, g, scale=candidate, global_scale=global_scale)
        err = _block_errors(x, q, column_weights)
        better = err < best_err
        best_scale = torch.where(better, candidate, best_scale)
        best_err = torch.where(better, err, best_err)
    return quantize(w, fmt, g, scale=best_scale, global_scale=global_scale)


def search_weight(w: torch.Tensor, fmt: Format, g: Granularity, fused_global_scale: torch.Tensor | None) -> QuantizedTensor:  # fmt: skip
    """A weight's scale search as the writer stores it (checkpoint, live model, an MoE expert's fallback):
    NVFP4 with its fused GEMM's round-to-nearest global scale given the search's headroom (None: from w)."""
    g_scale = None if fused_global_scale is None else search_global_scale(fused_global_scale)
    return search_scales(w, fmt, g, global_scale=g_scale)


def _candidates(scale: torch.Tensor, g: Granularity) -> list[torch.Tensor]:
    if g.scale_format == "e8m0":
        return [scale * 0.5, scale * 2.0]
    out = []
    for f in SCALE_FACTORS:
        s = (scale * f).clamp(max=E4M3.max).to(E4M3.torch_dtype).float()
        out.append(torch.where(s > 0, s, scale))  # a scale that rounds to 0 keeps the block's own
    return out


def _block_errors(x: torch.Tensor, q: QuantizedTensor, column_weights: torch.Tensor | None) -> torch.Tensor:
    """Squared rounding error per block (each column's weighted), on the scale grid [N, K / block]."""
    n, k = x.shape
    width = q.granularity.block_cols
    err = (q.dequantize() - x).square()
    if column_weights is not None:
        err = err * column_weights.float().reshape(1, k)
    pad = (-k) % width
    if pad:
        err = torch.nn.functional.pad(err, (0, pad))
    return err.view(n, -1, width).sum(-1)


__all__ = [
    "NVFP4_SEARCH_HEADROOM",
    "SCALE_FACTORS",
    "search_global_scale",
    "search_scales",
    "search_weight",
    "searchable",
]
