"""FP8 inference schemes, the default ignore list, and weight quantization shared by every path.

One function, `quantize_weight`, turns a high-precision Linear weight into FP8 + scales for a scheme.
The offline (streaming) path, the online path (`quantize_model_`) and the loader all call it, so the
same weight gives bit-identical payloads and scales whichever way it was quantized.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from mixprec import formats as _formats  # _formats._torch_cast_saturates: looked up at call time
from mixprec.errors import MixprecError
from mixprec.formats import E4M3, check_float_tensor, decode_e4m3_unscaled_into
from mixprec.scaling import Granularity, QuantizedTensor, _check_scale, block_amax, compute_scale, quantize

# FP8 GEMM kernels want both GEMM dims to be multiples of 16; other Linears stay in high precision.
DIM_MULTIPLE = 16

# Elements per tile (1 MB of fp32): big enough that the ~35 torch calls per tile cost little next to the
# ~10 passes over it, small enough that its buffers (~11 bytes per element) stay in L2/L3 between passes.
_TILE_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class InferenceScheme:
    """How weights and activations of a Linear are quantized to FP8 E4M3 for inference."""

    name: str
    weight_granularity: Granularity
    input_granularity: Granularity
    input_dynamic: bool  # False: one static per-tensor input scale from calibration
    description: str = ""

    @property
    def needs_calibration(self) -> bool:
        return not self.input_dynamic

    @property
    def fmt(self):
        return E4M3

    @classmethod
    def from_name(cls, name: str | InferenceScheme) -> InferenceScheme:
        if isinstance(name, InferenceScheme):
            return name
        if not isinstance(name, str):
            raise MixprecError(f"a scheme must be a name, got {type(name).__name__}")
        key = name.strip().lower().replace("_", "-")
        key = _ALIASES.get(key, key)
        if key not in SCHEMES:
            raise MixprecError(f"unknown inference scheme {name!r}; known: {', '.join(SCHEMES)}")
        return SCHEMES[key]

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        """Shape of the weight scale as stored in a compressed-tensors checkpoint."""
        grid = self.weight_granularity.scale_shape(out_features, in_features)
        return (1,) if grid == (1, 1) and self.weight_granularity.name == "tensor" else grid


SCHEMES: dict[str, InferenceScheme] = {
    s.name: s
    for s in (
        InferenceScheme(
            "fp8-dynamic",
            Granularity.rows(),
            Granularity.rows(),
            True,
            "per-output-channel weight scales, per-token dynamic activation scales",
        ),
        InferenceScheme(
            "fp8-static",
            Granularity.tensor(),
            Granularity.tensor(),
            False,
            "per-tensor weight scales, per-tensor static activation scales from calibration",
        ),
        InferenceScheme(
            "fp8-block",
            Granularity.blocks(128, 128),
            Granularity.blocks(1, 128),
            True,
            "128x128 weight blocks, dynamic 1x128 activation groups (DeepSeek-V3)",
        ),
    )
}
_ALIASES = {"fp8": "fp8-static", "fp8-dynamic-per-token": "fp8-dynamic", "fp8-blockwise": "fp8-block"}


# ---------------------------------------------------------------------------------------------------
# Which modules stay in high precision

# Defaults as in training: output head, embeddings, norms, MoE routers/gates. Matched against
# dotted module names by `matches_any`; "re:" patterns are regular expressions searched in the name.
DEFAULT_IGNORE: tuple[str, ...] = (
    "lm_head",
    "re:(^|\\.)(embed_tokens|embed_in|embed_out|wte|wpe|word_embeddings|position_embeddings|token_type_embeddings|embeddings)(\\.|$)",
    "re:(^|\\.)[^.]*norm[^.]*(\\.|$)",
    "re:(^|\\.)(gate|router|shared_expert_gate)$",
)


def matches(name: str, pattern: str) -> bool:
    """Does module `name` match `pattern`?

    "re:<regex>": regex searched in the name. A pattern with * ? [ : a glob over the whole name.
    Otherwise: the pattern's dotted components appear as consecutive components of the name
    ("lm_head" matches "lm_head", "down_proj" matches "model.layers.0.mlp.down_proj").
    """
    if pattern.startswith("re:"):
        return re.search(pattern[3:], name) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    parts, want = name.split("."), pattern.split(".")
    return any(parts[i : i + len(want)] == want for i in range(len(parts) - len(want) + 1))


def matches_any(name: str, patterns: Iterable[str]) -> bool:
    return any(matches(name, p) for p in patterns)


def resolve_ignore(ignore: Sequence[str] | None, *, defaults: bool = True) -> tuple[str, ...]:
    """User patterns added to the defaults (pass defaults=False to replace them)."""
    user = tuple(ignore or ())
    for p in user:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise MixprecError(f"bad --ignore regular expression {p!r}: {e}") from None
    return (*DEFAULT_IGNORE, *user) if defaults else user


def skip_reason(name: str, out_features: int, in_features: int, ignore: Sequence[str]) -> str | None:
    """Why this Linear stays in high precision, or None when it is quantized."""
    if matches_any(name, ignore):
        return "ignored by pattern"
    if out_features % DIM_MULTIPLE or in_features % DIM_MULTIPLE:
        return f"dims {out_features}x{in_features} not multiples of {DIM_MULTIPLE} (FP8 GEMM kernels)"
    return None


# ---------------------------------------------------------------------------------------------------
# Weight quantization


@dataclass(frozen=True)
class WeightStats:
    amax: float
    relative_error: float  # ||W - deq(Q(W))||_F / ||W||_F


def check_finite(w: torch.Tensor, name: str) -> None:
    """MixprecError naming the tensor if it holds NaN or inf (one pass, no tensor-sized temporaries)."""
    if w.numel() == 0 or not w.is_floating_point():
        return
    lo, hi = torch.aminmax(w)  # NaN propagates; an inf shows in lo or hi
    if math.isfinite(float(lo)) and math.isfinite(float(hi)):
        return
    if not bool(torch.isfinite(w).all()):
        bad = int((~torch.isfinite(w)).sum())
        raise MixprecError(f"tensor {name!r} has {bad} NaN/inf values; refusing to quantize it")


def _tile_shape(rows: int, cols: int, g: Granularity) -> tuple[int, int]:
    """Tile (height, width) aligned to the scale grid, about _TILE_ELEMENTS elements.

    Per-row and per-tensor scales: whole rows. Blocks: one block row high, whole blocks wide, so a
    tile's scale grid is one row of blocks and every block of the weight lies in exactly one tile.
    """
    br, bc = g.block_rows, g.block_cols
    if br is not None and br > 1:
        height = min(rows, br)
        width = cols if bc is None else min(cols, max(bc, _TILE_ELEMENTS // height // bc * bc))
        return height, width
    return min(rows, max(1, _TILE_ELEMENTS // max(cols, 1))), cols


def _expand_scale(s: torch.Tensor, height: int, width: int, g: Granularity) -> torch.Tensor:
    """A tile's scale grid broadcastable against the tile: [height or 1, width or 1]."""
    if s.shape[0] > 1 and g.block_rows not in (None, 1):
        s = s.repeat_interleave(g.block_rows, dim=0)[:height]
    if s.shape[1] > 1 and g.block_cols not in (None, 1):
        s = s.repeat_interleave(g.block_cols, dim=1)[:, :width]
    return s


def quantize_weight(
    w: torch.Tensor,
    scheme: InferenceScheme,
    name: str = "weight",
    scale: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> tuple[QuantizedTensor, WeightStats]:
    """FP8 weight + scales for `scheme`, with statistics. Bit-identical to
    `mixprec.scaling.quantize(w, E4M3, scheme.weight_granularity)` (or with `scale=` given).

    Works tile by tile (see _tile_shape): scales of per-row and block granularities depend only on
    their own rows and blocks, so a tile quantizes exactly as the whole tensor would; per-tensor scales
    come from a first pass for the global amax. Each tile is converted to fp32 once into a reused
    buffer, and all passes over it (amax, divide, cast, decode, error) stay in cache. The relative
    error ||W - deq(Q(W))|| / ||W|| is computed from the decoded payload of the same tile (fp32 sums
    per tile, accumulated in float64). `out`: a contiguous E4M3 tensor of w's shape to hold the payload
    (a buffer the caller reuses; default a new tensor).
    """
    if w.dim() != 2:
        raise MixprecError(f"{name!r}: a Linear weight must be 2-D, got shape {tuple(w.shape)}")
    check_float_tensor(w, name)
    g = scheme.weight_granularity
    rows, cols = w.shape
    if out is not None and (
        out.dtype != E4M3.torch_dtype or tuple(out.shape) != (rows, cols) or not out.is_contiguous()
    ):
        raise RuntimeError(f"out must be a contiguous {E4M3.torch_dtype} tensor of shape {(rows, cols)}")
    if (
        w.device.type != "cpu"
        or w.numel() == 0
        or g.scale_format != "fp32"
        or (g.block_rows is None and g.block_cols is not None)
        or E4M3.torch_dtype is None
    ):
        return _quantize_weight_whole(w, g, name, scale, out)
    grid = g.scale_shape(rows, cols)
    height, width = _tile_shape(rows, cols, g)
    x_buf = torch.empty(height * width, dtype=torch.float32)
    y_buf = torch.empty(height * width, dtype=torch.float32)
    i16_buf = torch.empty(height * width, dtype=torch.int16)
    q_buf = torch.empty(height * width, dtype=E4M3.torch_dtype)
    per_tensor = g.block_rows is None
    amax = 0.0
    if scale is not None:
        scale = _check_scale(scale, grid, g)
    if per_tensor:  # the global amax first (also reported when the scale is given)
        for r0 in range(0, rows, height):
            x = x_buf[: min(height, rows - r0) * cols].view(-1, cols)
            x.copy_(w[r0 : r0 + height])
            a = float(block_amax(x, g))
            if not math.isfinite(a):
                check_finite(w, name)
            amax = max(amax, a)
        if scale is None:
            scale = compute_scale(torch.tensor(amax), E4M3).reshape(1, 1)
    full_scale = scale if scale is not None else torch.empty(grid, dtype=torch.float32)
    saturates = _formats._torch_cast_saturates(E4M3.torch_dtype)
    data = out if out is not None else torch.empty((rows, cols), dtype=E4M3.torch_dtype)
    err2 = ref2 = 0.0
    for r0 in range(0, rows, height):
        h = min(height, rows - r0)
        for c0 in range(0, cols, width):
            wd = min(width, cols - c0)
            x = x_buf[: h * wd].view(h, wd)
            x.copy_(w[r0 : r0 + h, c0 : c0 + wd])  # the one conversion to fp32, into the reused buffer
            gi, gj = (0, 0) if per_tensor else (r0 // (g.block_rows or rows), c0 // (g.block_cols or cols))
            gh = 1 if per_tensor else -(-h // (g.block_rows or rows))
            gw = 1 if per_tensor else -(-wd // (g.block_cols or cols))
            if scale is None:
                tile_amax = block_amax(x, g)
                full_scale[gi : gi + gh, gj : gj + gw] = compute_scale(tile_amax, E4M3)
                amax = max(amax, float(tile_amax.max()))
            elif not per_tensor:  # given scales: the amax is still reported
                lo, hi = torch.aminmax(x)
                amax = max(amax, -float(lo), float(hi))
            s = _expand_scale(full_scale[gi : gi + gh, gj : gj + gw], h, wd, g)
            y = y_buf[: h * wd].view(h, wd)
            torch.div(x, s, out=y)  # division, as scaling.quantize does: bit-identical payloads
            if not saturates:
                y.clamp_(-E4M3.max, E4M3.max)
            whole_rows = wd == cols
            q = data[r0 : r0 + h] if whole_rows else q_buf[: h * wd].view(h, wd)
            q.copy_(y)
            if not whole_rows:
                data[r0 : r0 + h, c0 : c0 + wd].copy_(q)
            decode_e4m3_unscaled_into(q, i16_buf[: h * wd].view(h, wd), y)  # y = values * 2^-8
            torch.addcmul(x, y, s * 256.0, value=-1.0, out=y)  # W - deq(Q(W)) for this tile
            xv, yv = x.view(-1), y.view(-1)
            t_ref, t_err = float(torch.dot(xv, xv)), float(torch.dot(yv, yv))  # BLAS: 2x vector_norm
            if not (math.isfinite(t_ref) and math.isfinite(t_err)):
                check_finite(w, name)  # NaN/inf raise here; huge finite values overflowed fp32 squares
                t_ref = float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2
                t_err = float(torch.linalg.vector_norm(y, dtype=torch.float64)) ** 2
            ref2 += t_ref
            err2 += t_err
    rel = math.sqrt(err2 / ref2) if ref2 > 0 else 0.0
    return QuantizedTensor(data, full_scale.float(), E4M3, g, w.shape), WeightStats(amax, rel)


def _quantize_weight_whole(
    w: torch.Tensor, g: Granularity, name: str, scale: torch.Tensor | None, out: torch.Tensor | None
) -> tuple[QuantizedTensor, WeightStats]:
    """Granularities and devices the tiled path does not cover: the whole tensor at once."""
    check_finite(w, name)
    x = w.float()
    q = quantize(x, E4M3, g, scale=scale)
    if out is not None:
        out.copy_(q.data)
        q = QuantizedTensor(out, q.scale, q.fmt, q.granularity, q.shape)
    amax = float(x.abs().max()) if x.numel() else 0.0
    ref = float(torch.linalg.vector_norm(x.double()))
    err = float(torch.linalg.vector_norm(q.dequantize().double() - x.double()))
    return q, WeightStats(amax, err / ref if ref > 0 else 0.0)
