"""GPTQ (Frantar et al., 2022): round a Linear's weight column by column, each column's rounding error
pushed onto the columns not yet rounded, weighted by the inverse Hessian of the layer's inputs.

    hessian = HessianAccumulator(in_features); hessian.add(inputs)     # calibration inputs [.., K]
    result = gptq_quantize(weight, hessian.finish(), "e2m1", Granularity.nvfp4())
    q = result.quantized          # a QuantizedTensor with the scales GPTQ chose: what the checkpoint holds

Every group's scales come from the one quantize entry (mixprec.quantization.quantize) with the scheme's
own granularity and scale rule, and each column is rounded against them by quantization.round_scaled
(that entry's division, rounding and product without its encode and decode): so with an identity Hessian
GPTQ is RTN bit for bit (tested), and the result is re-encoded by quantize with the same scales exactly.
- Groups are the K-blocks of the granularity (NVFP4: 16 columns, MX: 32, 1x128 / 128x128: 128; per
  row and per tensor: all of K). Without activation order a group's scales are chosen from the
  current (already updated) weight when its first column is reached; with activation order the columns
  are visited by decreasing Hessian diagonal, groups stay contiguous (the layouts have no g_idx) and
  every group's scales are fixed up front from the original weight (llm-compressor's actorder="static").
- NVFP4's global scale comes from the whole original weight (or is given: fused q/k/v share one);
  a per-tensor scale (fp8-static) is fixed up front, or given (fused groups share the max).
- Updates can push a value past its group's scale times the format's maximum: the quantizer saturates
  it (clamps); the count of such elements beyond what the scale rule's own rounding clips
  (Granularity.clip_headroom) is reported as `clipped`.
- Dead input columns (zero Hessian diagonal: an input that was always 0) get weight 0 and diagonal 1.
- Dampening: `damp` times the mean of the diagonal is added to it (default 1 %); a Hessian that is still
  not positive definite raises a MixprecError naming the layer.
The solve is in fp32 with lazy block updates of `block` columns. Its K x K factor (SolveFactor) is made
once per input group, in the Hessian's own memory when the caller hands it over (solve_factor(consume=
True): the whole solve then holds one K x K), and the per-layer output errors are computed from it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from mixprec.errors import MixprecError
from mixprec.formats import get_format
from mixprec.inference.algorithms.scale_search import search_global_scale, search_scales
from mixprec.kernels import emulation
from mixprec.quantization import quantize, round_scaled
from mixprec.scaling import Granularity, QuantizedTensor, as_2d, check_scale

DEFAULT_DAMP = 0.01
DEFAULT_BLOCK = 128


# Row blocks of the Hessian's lower triangle accumulated by one GEMM each (HessianAccumulator.add)
HESSIAN_ROW_BLOCKS = 4


class HessianAccumulator:
    """H = 2/n * sum of x x^T over the n calibration rows a Linear reads (fp32 accumulation).

    H is symmetric: add() accumulates its lower triangle only, a row block at a time against the
    columns up to the block's end (4 blocks: 5/8 of the full product's flops; 35 % less time at K =
    5632, AVX-512 EPYC), and finish() mirrors it into the upper triangle. Until then `sum` holds the
    lower triangle and the diagonal blocks (what a SUM across ranks adds, element by element).

    arithmetic: the GEMM emulation backend (mixprec.kernels.emulation; default: the one chosen for the
    device). Under "bf16", inputs that arrive in bf16 are multiplied on the CPU's bf16 units: each of
    their values is bf16-exact, so every product x_i x_j is the same exact fp32 value as in an fp32
    GEMM and only the order of the fp32 sums differs (1.8-2x faster on an AVX-512-BF16 EPYC). Other
    dtypes are always multiplied in fp32. `arithmetic_used` says what ran: {"bf16"} or {"fp32"}."""

    def __init__(
        self, in_features: int, device: torch.device | str = "cpu", arithmetic: str | None = None
    ) -> None:
        self.in_features = in_features
        self.sum = torch.zeros(in_features, in_features, device=device)
        self.rows = 0
        self.finished = False
        self.arithmetic = emulation.backend_for(torch.device(device)) if arithmetic is None else arithmetic
        self.arithmetic_used: set[str] = set()
        k = in_features
        self._blocks = [
            (i * k // HESSIAN_ROW_BLOCKS, (i + 1) * k // HESSIAN_ROW_BLOCKS)
            for i in range(HESSIAN_ROW_BLOCKS)
        ]
        self._blocks = [(r0, r1) for r0, r1 in self._blocks if r1 > r0]

    def add(self, inputs: torch.Tensor) -> None:
        if self.finished:
            raise RuntimeError("HessianAccumulator.add() after finish()")
        x = as_2d(inputs.detach())
        if x.shape[1] != self.in_features:
            raise MixprecError(f"Hessian of {self.in_features} inputs got rows of {x.shape[1]}")
        arithmetic = self.arithmetic if x.dtype == torch.bfloat16 else "fp32"
        x = x.float()
        with emulation.gemm_context(arithmetic):
            for r0, r1 in self._blocks:
                self.sum[r0:r1, :r1].addmm_(x[:, r0:r1].t(), x[:, :r1])
        self.rows += x.shape[0]
        self.arithmetic_used.add("bf16" if emulation.on_bf16_units(arithmetic) else "fp32")  # what ran

    def finish(self) -> torch.Tensor:
        """H, scaled in place of the sum (no second K x K copy): the accumulator is spent."""
        if self.rows == 0:
            raise MixprecError("no calibration rows reached this layer: its Hessian is empty")
        if self.finished:
            raise RuntimeError("HessianAccumulator.finish() called twice")
        self.finished = True
        for r0, r1 in self._blocks:  # the upper triangle from the lower (a GEMM need not give a
            # diagonal block exactly symmetric: it is made so here, as LAPACK reads one triangle)
            self.sum[r0:r1, r1:] = self.sum[r1:, r0:r1].t()
            block = self.sum[r0:r1, r0:r1]
            block.copy_(block.tril() + block.tril(-1).t())
        return self.sum.mul_(2.0 / self.rows)


@dataclass(frozen=True)
class GptqResult:
    quantized: QuantizedTensor  # payload and the scales GPTQ chose (global scale included)
    clipped: int  # elements the updates pushed past their group's range (saturated)
    dead_columns: int  # inputs with a zero Hessian diagonal
    damp: float  # the dampening added to the diagonal (absolute)
    clipped_rows: torch.Tensor  # int64 [N]: `clipped` per output row (a stacked solve splits it by Linear)
    # float64 [N]: per output row, the sum of the squared scaled errors of the solve, = tr(E Hd E^T) of
    # that row (SolveFactor.output_errors(solved=) turns it into the output error without a solve)
    energy_rows: torch.Tensor
    # fp32 [N, K]: the rounded weight as the solve left it, = quantized.dequantize() bit for bit (each
    # column went through round_scaled against the scales `quantized` holds): no decode needed
    rounded: torch.Tensor


@dataclass(frozen=True)
class SolveFactor:
    """What the column loop needs of a Hessian H [K, K], made once and shared by the Linears that read
    the same input (a fused q/k/v or gate/up): the upper Cholesky factor U of the dampened H^-1 in
    solve order (row i: the update weights of column i; U^T U = (P Hd P^T)^-1, Hd = H with a dead
    input's diagonal set to 1 and `damp` added to every diagonal element, P the activation order),
    the dead inputs, the absolute dampening, the order (None: natural), and H's own diagonal."""

    upper: torch.Tensor
    dead: torch.Tensor
    damp: float
    order: torch.Tensor | None
    diagonal: torch.Tensor

    def output_errors(
        self,
        weight: torch.Tensor,
        *rounded: torch.Tensor,
        solved: tuple[torch.Tensor, float] | None = None,
        den: float | None = None,
    ) -> list[float]:
        """||X (W - Q)^T||^2 / ||X W^T||^2 over the calibration inputs X (tr(E H E^T) / tr(W H W^T)) for
        each rounding Q of `weight`, from the factor alone, so that H itself need not outlive the solve:
        tr(E Hd E^T) = ||E_p U^-1||^2 (a triangular solve, N K^2 flops against 2 N K^2 for E H), less
        what Hd adds to H (the dampening, and 1 on a dead input's diagonal).
        solved: (Q, energy) of GPTQ's own rounding, last in the list, without a solve of its own: the
        solve's scaled errors Err (column i's (w_i - q_i) / U_ii) satisfy W - Q = Err U (each column's
        update is its row of U times that error), so E_p U^-1 = Err, and ||E_p U^-1||^2 is `energy`,
        their sum of squares (GptqResult.energy_rows over the weight's rows). The solve zeroed the dead
        inputs' weights, so E counts as zero there. den: tr(W H W^T) when the caller has it (from the
        layer's outputs), else it is solved for too."""
        w = weight.detach().float()
        den = self._energy(w) if den is None else den
        errors = [self._energy(w - q.float()) for q in rounded]
        if solved is not None:
            e = w - solved[0].float()
            e[:, self.dead] = 0.0
            errors.append(max(0.0, solved[1] - self.damp * float(e.square().sum())))
        return [x / den if den > 0 else 0.0 for x in errors]

    def _energy(self, e: torch.Tensor) -> float:
        ep = e if self.order is None else e[:, self.order]
        x = torch.linalg.solve_triangular(self.upper, ep, upper=True, left=False)
        total = float(x.square().sum()) - self.damp * float(e.square().sum())
        return max(0.0, total - float(e[:, self.dead].square().sum()))


def solve_factor(hessian: torch.Tensor, damp: float = DEFAULT_DAMP, act_order: bool = False,
                 name: str = "weight", *, consume: bool = False) -> SolveFactor:  # fmt: skip
    """The SolveFactor of `hessian`; MixprecError when it holds inf/NaN or is not positive definite
    after the dampening. consume=True: `hessian` (fp32, contiguous) becomes the factor in place — every
    step (the activation order's permutation, the Cholesky factor, its inverse, the inverse's factor) runs
    in its memory, so the solve holds one K x K; else it is left as it is, and the work runs in a copy."""
    if not _all_finite(hessian):
        raise MixprecError(f"{name}: the Hessian holds inf or NaN (calibration inputs overflowed)")
    diagonal = torch.diagonal(hessian).detach().float().clone()
    own = consume and hessian.dtype == torch.float32 and hessian.is_contiguous()
    h = hessian.detach() if own else hessian.detach().float().clone()
    dead = diagonal == 0
    h[dead, dead] = 1.0
    damp_abs = damp * float(torch.diagonal(h).mean())
    torch.diagonal(h).add_(damp_abs)
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else None
    if order is not None:
        _permute_in_place(h, order)
    # U from one Cholesky factor and a triangular inverse, in h's memory: with J the reversal,
    # J Hd J = L L^T gives Hd^-1 = (J L^-T J)(J L^-1 J), and J L^-1 J is upper triangular with a
    # positive diagonal: the upper Cholesky factor of Hd^-1. Half the flops of the factor of the
    # inverse (Cholesky, inverse from it, Cholesky again: 4/3 K^3 against 2/3 K^3)
    _reverse_in_place(h)  # J h J: h's elements in reverse order
    # LAPACK works in place on a column-major matrix: h.mT is one (h is symmetric), so no copy is made
    hv = h.mT
    info = torch.empty((), dtype=torch.int32)
    torch.linalg.cholesky_ex(hv, out=(hv, info))
    if int(info) != 0:
        column = h.shape[0] - int(info)  # info counts along the reversed order
        raise MixprecError(
            f"{name}: the dampened Hessian is not positive definite (column {column}): "
            "raise the dampening or give more calibration tokens"
        )
    _invert_lower_in_place(hv, _rows_per_chunk(h))
    _reverse_in_place(h)
    if not _all_finite(hv):
        raise MixprecError(f"{name}: the inverse Hessian is ill-conditioned: raise the dampening")
    return SolveFactor(hv, dead, damp_abs, order, diagonal)


# The diagonal block of the triangular inverse (_invert_lower_in_place)
LEAF = 256


def _invert_lower_in_place(lower: torch.Tensor, rows_per_chunk: int) -> None:
    """lower^-1 written over `lower` (lower triangular, its upper part zero), a block column of LEAF
    at a time from the last: X_jj = L_jj^-1, X[j+1:, j] = -X[j+1:, j+1:] L[j+1:, j] X_jj, the product
    with the already inverted (lower triangular) X[j+1:, j+1:] taken block row by block row over its
    nonzero columns only (K^3 / 3 flops, as LAPACK's trtri). GEMMs on views of `lower`: torch's
    triangular solve would copy a sub-block of it (a quarter of K x K at the top of a recursion);
    the temporaries are one block column (`rows_per_chunk` rows at a time)."""
    n = lower.shape[0]
    for j0 in reversed(range(0, n, LEAF)):
        j1 = min(j0 + LEAF, n)
        inverse = torch.linalg.solve_triangular(lower[j0:j1, j0:j1], torch.eye(j1 - j0), upper=False)
        if j1 < n:
            panel = lower[j1:, j0:j1]  # L below the diagonal block: overwritten once its product is made
            product = torch.empty(n - j1, j1 - j0)
            for r0 in range(j1, n, LEAF):
                r1 = min(r0 + LEAF, n)
                torch.mm(lower[r0:r1, j1:r1], panel[: r1 - j1], out=product[r0 - j1 : r1 - j1])
            inverse_neg = inverse.neg()
            for r0 in range(0, n - j1, rows_per_chunk):
                panel[r0 : r0 + rows_per_chunk] = product[r0 : r0 + rows_per_chunk] @ inverse_neg
            del product
        lower[j0:j1, j0:j1] = inverse


def _reverse_in_place(h: torch.Tensor) -> None:
    """h's elements in reverse order (for a square matrix: J h J), swapping chunks from both ends."""
    flat = h.view(-1)
    total, step = flat.numel(), max(1, CHUNK_BYTES // h.element_size())
    for i0 in range(0, total // 2, step):
        i1 = min(i0 + step, total // 2)
        front = flat[i0:i1].flip(0)
        flat[i0:i1] = flat[total - i1 : total - i0].flip(0)
        flat[total - i1 : total - i0] = front
    # an odd count leaves the middle element where it is


# Rows of a K x K matrix handled at a time where a step needs a copy (a finite check, a permutation)
CHUNK_BYTES = 16 << 20


def _rows_per_chunk(h: torch.Tensor) -> int:
    return max(1, CHUNK_BYTES // max(1, h.shape[-1] * h.element_size()))


def _all_finite(h: torch.Tensor) -> bool:
    """No inf/NaN in h, checked a chunk of rows at a time (a whole K x K mask would be a quarter of h)."""
    step = _rows_per_chunk(h)
    return all(bool(torch.isfinite(h[r0 : r0 + step]).all()) for r0 in range(0, h.shape[0], step))


def _permute_in_place(h: torch.Tensor, order: torch.Tensor, rows_per_chunk: int | None = None) -> None:
    """h[order][:, order], written into h: the columns a chunk of rows at a time (a chunk-sized copy),
    then the rows along the permutation's cycles (one row's copy)."""
    rows_per_chunk = rows_per_chunk or _rows_per_chunk(h)
    for r0 in range(0, h.shape[0], rows_per_chunk):
        h[r0 : r0 + rows_per_chunk] = h[r0 : r0 + rows_per_chunk].index_select(1, order)
    src = order.tolist()
    seen = [False] * len(src)
    for start in range(len(src)):
        if seen[start] or src[start] == start:
            continue
        first = h[start].clone()
        i = start
        while src[i] != start:  # row i takes row src[i]
            h[i].copy_(h[src[i]])
            seen[i] = True
            i = src[i]
        h[i].copy_(first)
        seen[i] = True


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor | SolveFactor,
    fmt: str,
    granularity: Granularity,
    *,
    damp: float = DEFAULT_DAMP,
    block: int = DEFAULT_BLOCK,
    act_order: bool = False,
    scale: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    name: str = "weight",
    search: bool = False,
) -> GptqResult:
    """GPTQ-round `weight` [N, K] for the layer inputs' Hessian [K, K] (or its SolveFactor, made once
    for several Linears: damp and act_order are then the factor's); see the module docstring.
    scale: a fixed per-tensor scale (fp8-static's fused groups); global_scale: NVFP4's, shared by a
    fused group. search: each group's block scales from the scale search (scale_search.py) instead of
    round to nearest's (NVFP4: global_scale is then the search's, with its headroom). Inputs are not
    modified."""
    fmt_ = get_format(fmt)
    k = weight.shape[-1]
    if isinstance(hessian, torch.Tensor) and tuple(hessian.shape) != (k, k):
        raise MixprecError(f"{name}: Hessian of shape {tuple(hessian.shape)} for a weight with {k} inputs")
    factor = hessian if isinstance(hessian, SolveFactor) else solve_factor(hessian, damp, act_order, name)
    w = _check(weight, factor, granularity, name)
    n, k = w.shape
    dead = factor.dead
    w[:, dead] = 0.0
    if global_scale is None and granularity.scale_format == "e4m3":
        global_scale = quantize(weight.detach().float(), fmt_, granularity).global_scale
        global_scale = search_global_scale(global_scale) if search else global_scale
    width = k if granularity.block_cols is None else min(granularity.block_cols, k)
    # scales fixed up front: with activation order, a given scale, or one group over all of K (chosen
    # at column 0, before any update: the same as up front); else chosen as each group is reached
    up_front = factor.order is not None or scale is not None or width == k
    # in the weight's own dtype: "input" scale math (compressed-tensors') rounds amax / max to it
    source = weight.detach().clone()
    source[:, dead] = 0
    # the search weighs each input column by its Hessian diagonal (the mean square of that input)
    importance = factor.diagonal if search else None
    fixed = (
        _group_scales(source, fmt_, granularity, width, scale, global_scale, importance) if up_front else {}
    )
    del source
    solver = _Solver(w, fmt_, granularity, width, fixed, global_scale, importance)
    del w  # the solver's transposed copy is the one it updates (memory: one N x K fp32 less)
    solver.run(factor.upper, factor.order, block if width == k else max(width, block - block % width))
    # back to [N, K] rows: quantize reads a transposed view 40x slower (3.0 s against 0.07 s for 6144 x 2048)
    rounded = solver.rounded_t.t().contiguous()
    solver.rounded_t = None
    q = quantize(rounded, fmt_, granularity, scale=solver.scale_grid(n), global_scale=global_scale)
    return GptqResult(
        q,
        int(solver.clipped.sum()),
        int(dead.sum()),
        factor.damp,
        solver.clipped,
        solver.energy.double(),
        rounded,
    )


def _check(weight: torch.Tensor, factor: SolveFactor, g: Granularity, name: str) -> torch.Tensor:
    if weight.dim() != 2:
        raise MixprecError(f"{name}: GPTQ takes a 2-D [out, in] weight, got shape {tuple(weight.shape)}")
    k = weight.shape[1]
    if tuple(factor.upper.shape) != (k, k):
        raise MixprecError(
            f"{name}: Hessian of shape {tuple(factor.upper.shape)} for a weight with {k} inputs"
        )
    if g.block_rows is not None and g.block_rows > 1 and g.block_cols is None:
        raise MixprecError(f"{name}: {g.name} scales vary along the input dimension column by column")
    return weight.detach().float().clone()


def _group_scales(w, fmt, g, width, scale, global_scale, importance) -> dict[int, torch.Tensor]:
    """{first column of a group: its scale column} fixed from w (or the given per-tensor scale)."""
    if scale is not None:
        return {0: check_scale(scale, (1, 1), g)}  # checked here: the column loop does not check it again
    if importance is None:  # round to nearest's scales are each block's own: one call makes them all
        grid = quantize(w, fmt, g, global_scale=global_scale).scale  # (a call per group: 2 % of a run)
        return {c0: grid[:, j : j + 1] for j, c0 in enumerate(range(0, w.shape[1], width))}
    return {
        c0: _scales_of(w[:, c0 : c0 + width], fmt, g, global_scale, importance, c0)
        for c0 in range(0, w.shape[1], width)
    }


def _scales_of(group, fmt, g, global_scale, importance, c0) -> torch.Tensor:
    """A group's block scales: round to nearest's, or (importance: the Hessian diagonal) the scale
    search's, each column weighted by its diagonal."""
    if importance is not None:
        weights = importance[c0 : c0 + group.shape[1]]
        return search_scales(group, fmt, g, global_scale=global_scale, column_weights=weights).scale
    return quantize(group, fmt, g, global_scale=global_scale).scale


class _Solver:
    """The column loop: each column rounded with its group's scales, the error spread by H^-1."""

    def __init__(self, w, fmt, g, width, fixed, global_scale, importance) -> None:
        self.w, self.fmt, self.g, self.width = w, fmt, g, width
        self.scales = dict(fixed)  # {first column of a group: [row blocks, 1] scales}
        self.global_scale = global_scale
        self.importance = importance  # the scale search's column weights (None: round to nearest's scales)
        # transposed, as the loop's weight: a column is a contiguous row (writing a column of an [N, K]
        # weight touched N cache lines: 40 % of a stacked gate/up solve's time, AVX-512 EPYC)
        self.rounded_t = torch.empty(w.shape[1], w.shape[0], dtype=w.dtype)
        self.clipped = torch.zeros(w.shape[0], dtype=torch.int64)  # per output row
        # per output row: the sum of the squared scaled errors (GptqResult.energy_rows; fp32 here)
        self.energy = torch.zeros(w.shape[0])
        # {first column of a group: (its multiplier per row, its clip limit per row)}, kept for the whole
        # solve: with activation order the columns visit the groups in any order (2 N floats a group)
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _group_rows(self, c0: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's dequantization multiplier per row and the |value| past which a value counts as
        clipped, made once per group: its scales came from quantize itself (which checked the global
        scale) or from check_scale (_group_scales), so the columns are not checked again."""
        if c0 not in self._rows:
            scale = self.scales[c0]
            effective = (
                scale if self.global_scale is None else scale / self.global_scale.float().reshape(1, 1)
            )
            multiplier = _expand_rows(effective, rows, self.g)
            self._rows[c0] = (multiplier, self.fmt.max * self.g.clip_headroom(self.fmt) * multiplier)
        return self._rows[c0]

    def run(self, hinv: torch.Tensor, order: torch.Tensor | None, block: int) -> None:
        """Blocks of `block` columns (a multiple of the group width, so no group straddles two): within
        a block the updates go to its columns at once, to the later columns lazily at its end. The
        weight is held transposed (a column is a contiguous row: the per-column update touches
        contiguous memory), and the column loop runs on one thread (its small ops only pay for the
        synchronisation of more; measured 14 ms against 0.01 ms per update on a loaded 2-core CPU)."""
        wt = (self.w if order is None else self.w[:, order]).t().contiguous()  # [K, N]
        self.w = None  # updated in wt from here on
        columns = list(range(wt.shape[0])) if order is None else order.tolist()
        k = wt.shape[0]
        # inference mode: no autograd bookkeeping on the loop's thousands of small ops (a 960 x 576
        # NVFP4 weight, SmolLM2's stacked q/k/v shape, when each column still went through quantize:
        # 300 ms against 387 ms a solve, AMX Xeon); what leaves the loop is written into tensors made
        # before it (rounded, clipped) or copied out of it (scale_grid's cat)
        with torch.inference_mode():
            for b0 in range(0, k, block):
                b1 = min(b0 + block, k)
                with _one_thread():
                    errors = self._round_block(wt[b0:b1], hinv[b0:b1, b0:b1], columns[b0:b1])
                wt[b1:].addmm_(hinv[b0:b1, b1:].t(), errors, alpha=-1.0)

    def _round_block(self, rows: torch.Tensor, h_block: torch.Tensor, columns: list[int]) -> torch.Tensor:
        """Round the columns of one block (`rows`: their transposed values, updated in place); returns
        the scaled errors [block, N] the later columns are updated with."""
        errors = torch.empty_like(rows)
        limits = []
        for i, column in enumerate(columns):
            if column not in self.scales and column % self.width == 0:
                # a group's scales come from its columns as updated so far (all in this block)
                group = rows[i : i + self.width].t()
                self.scales[column] = _scales_of(
                    group, self.fmt, self.g, self.global_scale, self.importance, column
                )
            multiplier, limit = self._group_rows(column - column % self.width, rows.shape[1])
            limits.append(limit)
            values = rows[i]
            rounded = self.rounded_t[column]
            rounded.copy_(round_scaled(values, self.fmt, multiplier))
            err = errors[i]
            torch.sub(values, rounded, out=err).div_(h_block[i, i])
            # the later columns only: rows[i] keeps the value column i had when it was rounded
            rows[i + 1 :].addr_(h_block[i, i + 1 :], err, alpha=-1.0)
        # once per block, not per column: beyond what the scale rule's own rounding clips
        # (Granularity.clip_headroom), what the updates pushed; and the squared scaled errors
        self.clipped += (rows.abs() > torch.stack(limits)).sum(0)
        self.energy.add_(errors.square().sum(0))
        return errors

    def scale_grid(self, n: int) -> torch.Tensor:
        """The scales of all groups as the granularity's grid for the whole weight."""
        return torch.cat([self.scales[c0] for c0 in sorted(self.scales)], dim=1)


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _expand_rows(scale: torch.Tensor, rows: int, g: Granularity) -> torch.Tensor:
    """A [row blocks, 1] scale column as one value per row (the last row block may be partial)."""
    if scale.shape[0] == rows:
        return scale[:, 0].contiguous()
    return scale[:, 0].repeat_interleave(g.block_shape(rows, 1)[0])[:rows]


__all__ = [
    "DEFAULT_BLOCK",
    "DEFAULT_DAMP",
    "GptqResult",
    "HessianAccumulator",
    "SolveFactor",
    "gptq_quantize",
    "solve_factor",
]
