"""The "traceable" quantize backend: no data-dependent Python, so torch.compile traces it whole.

The eager backend asks `bool(tensor)` questions (are all amaxes finite? is a given scale valid?) and
probes torch's cast behaviour through a cached helper: each of those is a graph break under
torch.compile. This backend computes the same thing with tensor ops only:
- amax over the finite elements directly (`where(isfinite(x), |x|, 0)`), which is what
  `scaling.block_amax` returns in both of its branches;
- scales by `scaling.scale_from_amax` (pure tensor code);
- the payload: for torch's FP8 dtypes `where(y != y, y, clamp(y, ±max)).to(fp8)` with
  y = x / scale (saturation is explicit, so the result does not depend on how a torch version casts
  overflow, and the in-range cast is round-to-nearest-even everywhere); for the sub-byte formats
  `formats.saturating_codes`, out of place, with a NaN flag for the caller to act on.
A given scale is used as the caller passes it (on the grid, fp32): mixprec.quantization validates
it outside traced code.

mixprec.quantization picks it under torch.compile; mixprec.kernels.compiled compiles it for the CPU
(and for GPUs with Inductor, where fp32 `/` must round like eager: see compile_options there).
"""

from __future__ import annotations

import torch

from mixprec.formats import Format, saturating_codes
from mixprec.scaling import Granularity, expand_scale, scale_from_amax


def _zero_padded_blocks(a: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """[R, C] -> [nR, br, nC, bc], zero-padding the edge blocks (zeros change no amax)."""
    rows, cols = a.shape
    pr, pc = (-rows) % br, (-cols) % bc
    if pr or pc:
        a = torch.nn.functional.pad(a, (0, pc, 0, pr))
    return a.reshape(a.shape[0] // br, br, a.shape[1] // bc, bc)


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
    return _zero_padded_blocks(a, br, bc).amax(dim=(1, 3))


def divide_by_scale(x2: torch.Tensor, scale: torch.Tensor, g: Granularity) -> torch.Tensor:
    """x2 / (each element's block scale), out of place: a reshape when the blocks tile x2 exactly
    (one broadcast division), else the expanded scale. Same quotients either way.

    Not apply_blockwise's block views or a pad-reshape-slice: torch 2.13's CPU Inductor miscompiled
    that pattern followed by a clamp (edge-block elements read garbage; seen here 2026-11-30).
    """
    rows, cols = x2.shape
    br, bc = g.block_shape(rows, cols)
    if scale.shape in ((1, 1), (rows, 1), (1, cols)):
        return x2 / scale
    if rows % br == 0 and cols % bc == 0:
        return (x2.reshape(rows // br, br, cols // bc, bc) / scale[:, None, :, None]).reshape(rows, cols)
    return x2 / expand_scale(scale, g, rows, cols)


def quantize_traceable(
    x2: torch.Tensor,
    fmt: Format,
    g: Granularity,
    *,
    scale: torch.Tensor | None = None,
    margin: int = 0,
    power_of_two: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(payload, scale, has_nan) of the 2-D x2 in graph-break-free tensor ops. has_nan: a bool tensor
    for formats without a NaN code (the caller refuses a NaN input), None for torch's FP8 dtypes."""
    x2 = x2.float()
    if scale is None:
        scale = scale_from_amax(finite_block_amax(x2, g), fmt, g, margin, power_of_two)
    else:
        # a copy, not the caller's tensor: the payload's scale is saved for backward, and torch.compile
        # cannot save a tensor that aliases one made outside the autograd.Function's forward
        scale = scale.clone()
    y = divide_by_scale(x2, scale, g)
    if fmt.torch_dtype is not None:
        # NaN kept as is: Inductor's CPU clamp turns NaN into the all-ones pattern (a negative NaN), which
        # would cast to 0xFF where eager gives 0x7F. `y != y` rather than isnan: it stays vector code in
        # Inductor's CPU kernel (isnan made the whole quantize ~1.5x slower, measured at 4096x4096)
        saturated = torch.where(y != y, y, y.clamp(-fmt.max, fmt.max))
        return saturated.to(fmt.torch_dtype), scale, None
    return saturating_codes(y, fmt), scale, torch.isnan(y).any()


__all__ = ["divide_by_scale", "finite_block_amax", "quantize_traceable"]
