"""Blockwise FP8 GEMM in Triton (DeepSeek-V3): out = a_deq @ b_deq.T with FP32 promotion every 128 of K.

a: [M, K] FP8 with scales per 1x128 tile (M, ceil(K/128)) or per 128x128 block (ceil(M/128), ceil(K/128));
b: [N, K] FP8 (nn.Linear weight layout) with scales per 128x128 block or per 1x128 tile.
For each 128-wide slice of K the tensor cores form the partial product of the FP8 payloads; it is
then scaled by that slice's scales and added into an FP32 accumulator held in registers. The FP8
MMA's own accumulator is therefore never trusted over more than 128 products — the fix DeepSeek-V3
describes for Hopper's limited-precision FP8 accumulation.

Results equal the emulation (dequantize, fp32 matmul) up to fp32 accumulation order. Imports triton
at import time: import it only where triton is installed (mixprec.kernels.native does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mixprec.errors import MixprecError
from mixprec.scaling import Granularity, QuantizedTensor

K_BLOCK = 128


@triton.jit
def _blockwise_mm_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, c_ptr,
    M, N, K,
    sam, sak, sbn, sbk, ssam, ssak, ssbn, ssbk, scm, scn,
    A_TILE_ROWS: tl.constexpr, B_TILE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # scale rows: per row of a (1x128 tiles) or per 128-row block (128x128 blocks)
    sa_rows = rm // A_TILE_ROWS
    sb_rows = rn // B_TILE_ROWS
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + rk
        a = tl.load(
            a_ptr + rm[:, None] * sam + k[None, :] * sak, mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0
        )
        b = tl.load(
            b_ptr + rn[:, None] * sbn + k[None, :] * sbk, mask=(rn[:, None] < N) & (k[None, :] < K), other=0.0
        )
        partial = tl.dot(a, tl.trans(b), out_dtype=tl.float32)
        sa = tl.load(sa_ptr + sa_rows * ssam + kb * ssak, mask=rm < M, other=0.0)
        sb = tl.load(sb_ptr + sb_rows * ssbn + kb * ssbk, mask=rn < N, other=0.0)
        acc += partial * sa[:, None] * sb[None, :]  # promotion to the fp32 accumulator, every 128 of K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    c_mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _tile_rows(q: QuantizedTensor, which: str) -> int:
    g = q.granularity
    if g.scale_format != "fp32" or g.block_cols != K_BLOCK or g.block_rows not in (1, K_BLOCK):
        raise MixprecError(
            f"blockwise GEMM needs {which} scaled per 1x128 tile or 128x128 block, got {g.name}"
        )
    return g.block_rows


def supports(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    """Whether this kernel takes the pair (1x128 / 128x128 scales along K, FP8 torch payloads)."""
    try:
        _tile_rows(a, "a")
        _tile_rows(b, "b")
    except MixprecError:
        return False
    return a.data.dtype.itemsize == 1 and b.data.dtype.itemsize == 1 and a.data.shape[1] == b.data.shape[1]


def blockwise_mm(
    a: QuantizedTensor,
    b: QuantizedTensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    block_m: int = 128,
    block_n: int = 128,
) -> torch.Tensor:
    """a_deq @ b_deq.T for blockwise-scaled FP8 operands (see module doc), as [M, N] in out_dtype."""
    ra, rb = _tile_rows(a, "a"), _tile_rows(b, "b")
    a2, b2 = a.data, b.data
    if a2.dim() != 2 or b2.dim() != 2 or a2.shape[1] != b2.shape[1]:
        raise MixprecError(
            f"blockwise GEMM: a [M, K] and b [N, K] must share K, got {tuple(a2.shape)} and {tuple(b2.shape)}"
        )
    m, k = a2.shape
    n = b2.shape[0]
    sa, sb = a.scale, b.scale
    c = torch.empty((m, n), dtype=out_dtype, device=a2.device)
    has_bias = bias is not None
    bias_arg = bias.contiguous() if has_bias else sa  # any pointer; not read without bias
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _blockwise_mm_kernel[grid](
        a2, b2, sa, sb, bias_arg, c, m, n, k,
        a2.stride(0), a2.stride(1), b2.stride(0), b2.stride(1),
        sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1), c.stride(0), c.stride(1),
        A_TILE_ROWS=ra, B_TILE_ROWS=rb, HAS_BIAS=has_bias,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=K_BLOCK,
        num_warps=8 if block_m * block_n >= 128 * 128 else 4, num_stages=3,
    )  # fmt: skip
    return c


__all__ = ["K_BLOCK", "Granularity", "blockwise_mm", "supports"]
