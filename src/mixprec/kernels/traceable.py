"""`scaling.quantize` rewritten without data-dependent Python branches, so torch.compile traces it whole.

`mixprec.scaling.quantize` asks `bool(tensor)` questions (are all amaxes finite? is a given scale
valid?) and probes torch's cast behaviour through a cached helper: each of those is a graph break
under torch.compile. This version computes the same thing with tensor ops only:
- amax over the finite elements directly (`where(isfinite(x), |x|, 0)`), which is what `block_amax`
  returns in both of its branches;
- scales through the same `compute_scale` / `compute_mx_scale` (pure tensor code);
- the payload as `where(isnan(y), y, clamp(y, ±max)).to(fp8)` with y = x / scale: saturation is
  explicit, so the result does not depend on how a torch version casts overflow, and the in-range
  cast is round-to-nearest-even everywhere.
A given scale is only reshaped to the grid, not validated (validation needs `bool(tensor)`): callers
on the hot path pass scales they computed themselves.

Bit-identical to `scaling.quantize` for e4m3/e5m2 payloads (tested, eager and compiled). Note for GPU
compilation: Inductor lowers fp32 `/` to Triton's approximate division unless told to round like
eager; `mixprec.kernels.compiled` turns that on.
"""

from __future__ import annotations

import torch

from mixprec.errors import MixprecError
from mixprec.formats import Format, get_format
from mixprec.scaling import (
    Granularity,
    QuantizedTensor,
    _blocked,
    as_2d,
    compute_mx_scale,
    compute_scale,
)


def finite_block_amax(x2: torch.Tensor, g: Granularity) -> torch.Tensor:
    """Per-block max |x| over finite elements on the scale grid (fp32): `scaling.block_amax`, branch-free."""
    a = torch.where(torch.isfinite(x2), x2.abs(), torch.zeros((), dtype=x2.dtype, device=x2.device)).float()
    rows, cols = x2.shape
    if g.block_rows is None and g.block_cols is None:
        return a.amax().reshape(1, 1)
    if g.block_rows is None and g.block_cols == 1:
        return a.amax(dim=0, keepdim=True)
    if g.block_rows == 1 and g.block_cols is None:
        return a.amax(dim=1, keepdim=True)
    br, bc = g.block_shape(rows, cols)
    return _blocked(a, br, bc).amax(dim=(1, 3))


def scale_from_amax(
    amax: torch.Tensor, fmt: Format, g: Granularity, margin: int = 0, power_of_two: bool = False
):
    if g.scale_format == "e8m0":
        return compute_mx_scale(amax, fmt, g.mx_rounding)
    return compute_scale(amax, fmt, margin, power_of_two)


def expand_scale(scale: torch.Tensor, g: Granularity, rows: int, cols: int) -> torch.Tensor:
    """The scale grid broadcast to one scale per element ([R, C], or broadcastable to it).

    Used instead of `scaling.apply_blockwise`'s pad-reshape-slice view because torch 2.13's CPU
    Inductor miscompiles that pattern followed by a clamp (edge-block elements read garbage; seen
    here 2026-11-30). Dividing by the expanded scale gives the same values.
    """
    br, bc = g.block_shape(rows, cols)
    if scale.shape[0] > 1 and br > 1:
        scale = scale.repeat_interleave(br, dim=0)[:rows]
    if scale.shape[1] > 1 and bc > 1:
        scale = scale.repeat_interleave(bc, dim=1)[:, :cols]
    return scale


def divide_by_scale(x2: torch.Tensor, scale: torch.Tensor, g: Granularity) -> torch.Tensor:
    """x2 / (each element's block scale), out of place: a reshape when the blocks tile x2 exactly
    (one broadcast division), else the expanded scale (see expand_scale). Same quotients either way."""
    rows, cols = x2.shape
    br, bc = g.block_shape(rows, cols)
    if scale.shape in ((1, 1), (rows, 1), (1, cols)):
        return x2 / scale
    if rows % br == 0 and cols % bc == 0:
        return (x2.reshape(rows // br, br, cols // bc, bc) / scale[:, None, :, None]).reshape(rows, cols)
    return x2 / expand_scale(scale, g, rows, cols)


def cast_saturating(y: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Saturating RNE cast of fp32 values to fmt's torch dtype; NaN stays NaN."""
    clamped = y.clamp(-fmt.max, fmt.max)  # clamp propagates NaN
    return clamped.to(fmt.torch_dtype)


def quantize_traceable(
    x: torch.Tensor,
    fmt: str | Format,
    granularity: Granularity | None = None,
    *,
    scale: torch.Tensor | None = None,
    margin: int = 0,
    power_of_two: bool = False,
) -> QuantizedTensor:
    """`scaling.quantize` (same arguments, bit-identical result for e4m3/e5m2) in graph-break-free tensor ops."""
    g = granularity or Granularity.tensor()
    fmt = get_format(fmt)
    if fmt.torch_dtype is None or fmt.bits != 8:
        raise MixprecError(f"quantize_traceable covers torch's FP8 dtypes, not {fmt.name}")
    x2 = as_2d(x).float()
    grid = g.scale_shape(*x2.shape)
    if scale is None:
        scale = scale_from_amax(finite_block_amax(x2, g), fmt, g, margin, power_of_two)
    else:
        # a copy, not the caller's tensor: the payload's scale is saved for backward, and torch.compile
        # cannot save a tensor that aliases one made outside the autograd.Function's forward
        scale = scale.float().reshape(grid).clone()
    data = cast_saturating(divide_by_scale(x2, scale, g), fmt)
    return QuantizedTensor(data, scale, fmt, g, x.shape)
