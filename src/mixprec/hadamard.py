"""The random Hadamard transform (RHT) of NVFP4 training's weight-gradient GEMM (pure tensor functions).

    m = rht_matrix(seed=0)                        # 16x16, diag(signs)·H: m @ m.T == I exactly
    a_h = transform_columns(a, m)                 # a [rows, K]: every 16 consecutive K elements times m
    x_h = transform_rows(x, m)                    # x [K, cols]: the same, along the rows (= (x.T @ m).T)

grad_weight = dYᵀ·X is a sum over the tokens. Multiplying every 16 consecutive tokens of both operands
by the same orthogonal m leaves the product unchanged, (dYᵀ M)(Xᵀ M)ᵀ = dYᵀ M Mᵀ X = dYᵀ X, while the
mixing spreads an outlier token over 16, so 1x16 blocks along the tokens quantize with less error
(TransformerEngine's NVFP4BlockScaling, arXiv 2509.25149: the RHT applies only to the wgrad GEMM's
operands, 16x16). m = S·H, as TransformerEngine builds it: H the Sylvester Hadamard matrix scaled by
1/4 (entries +-1/4, exact in any binary format), S a diagonal of random signs. TransformerEngine
hard-codes its 16 signs; here they are drawn from a seed by the counter-based hash of mixprec.rounding,
so every rank of a data-parallel job computes the same m from the recipe's seed with no communication,
and a resumed run the same m as the original. H·Hᵀ = I holds exactly in fp32: each entry is a sum of
16 products +-1/16.

A K that is not a multiple of 16 leaves its last K % 16 elements untransformed (the identity on the
tail block keeps the transform orthogonal, so the product is still unchanged).
"""

from __future__ import annotations

import torch

from mixprec.errors import MixprecError
from mixprec.rounding import hash32

RHT_SIZE = 16  # TransformerEngine's (and the NVFP4 paper's) transform size: one NVFP4 block


def hadamard_matrix(n: int = RHT_SIZE, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix divided by sqrt(n) (orthonormal; n a power of two)."""
    if not isinstance(n, int) or n < 1 or n & (n - 1):
        raise MixprecError(f"a Sylvester Hadamard matrix needs n a power of two, got {n!r}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(dtype)  # +-1/sqrt(n): a power of two for n = 4^k, exact in every format


def random_signs(seed: int, n: int = RHT_SIZE) -> torch.Tensor:
    """n signs +-1 (fp32) from the seed: sign i is the top bit of hash32(hash32(seed) + i)."""
    base = hash32(int(seed))
    return torch.tensor([-1.0 if hash32(base + i) < 0 else 1.0 for i in range(n)], dtype=torch.float32)


def rht_matrix(seed: int, n: int = RHT_SIZE) -> torch.Tensor:
    """diag(signs(seed))·H (fp32, n x n): orthogonal, entries +-1/sqrt(n)."""
    return random_signs(seed, n)[:, None] * hadamard_matrix(n)


def transform_columns(a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """a [rows, K] (fp32 out) with each whole block of m.shape[0] consecutive columns multiplied by m."""
    n = m.shape[0]
    rows, k = a.shape
    whole = k - k % n
    out = a.float().clone()
    if whole:
        blocks = out[:, :whole].reshape(rows, whole // n, n)
        out[:, :whole] = (blocks @ m.to(out.device)).reshape(rows, whole)
    return out


def transform_rows(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [K, cols] (fp32 out) with each whole block of m.shape[0] consecutive rows mixed by mᵀ:
    transform_columns(x.T, m).T, computed on x's own layout (no transposed copy)."""
    n = m.shape[0]
    k, cols = x.shape
    whole = k - k % n
    out = x.float().clone()
    if whole:
        blocks = out[:whole].reshape(whole // n, n, cols)
        out[:whole] = torch.matmul(m.t().to(out.device), blocks).reshape(whole, cols)
    return out


__all__ = ["RHT_SIZE", "hadamard_matrix", "random_signs", "rht_matrix", "transform_columns", "transform_rows"]
