"""The random Hadamard transform of NVFP4 training (mixprec.hadamard): exact orthogonality, seeded signs,
and a weight gradient that the transform leaves unchanged up to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from mixprec.errors import MixprecError
from mixprec.hadamard import (
    RHT_SIZE,
    hadamard_matrix,
    random_signs,
    rht_matrix,
    transform_columns,
    transform_rows,
)


def test_hadamard_times_its_transpose_is_exactly_the_identity():
    h = hadamard_matrix(16)
    assert h.dtype == torch.float32 and h.shape == (16, 16)
    assert set(h.flatten().tolist()) == {0.25, -0.25}
    assert torch.equal(h @ h.t(), torch.eye(16))  # every entry a sum of 16 products +-1/16: exact
    # Sylvester's construction, entry (i, j) = (-1)^popcount(i & j) / 4: an independent reference
    ref = torch.tensor([[(-1.0) ** bin(i & j).count("1") / 4 for j in range(16)] for i in range(16)])
    assert torch.equal(h, ref)


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_rht_matrix_is_exactly_orthogonal_with_seeded_signs(seed):
    m = rht_matrix(seed)
    assert set(m.abs().flatten().tolist()) == {0.25}
    assert torch.equal(m @ m.t(), torch.eye(RHT_SIZE)) and torch.equal(m.t() @ m, torch.eye(RHT_SIZE))
    assert torch.equal(m, random_signs(seed)[:, None] * hadamard_matrix())  # S·H, as TransformerEngine
    assert torch.equal(rht_matrix(seed), m)  # the same on every call, rank and process: from the seed alone


def test_signs_depend_on_the_seed_and_are_not_all_equal():
    signs = {tuple(random_signs(s).tolist()) for s in range(8)}
    assert len(signs) == 8
    assert all(set(s) == {-1.0, 1.0} for s in signs)


def test_rows_and_columns_transform_alike_and_leave_the_tail_alone():
    torch.manual_seed(0)
    x = torch.randn(37, 5)  # 2 whole blocks of 16 rows and a tail of 5
    m = rht_matrix(3)
    y = transform_rows(x, m)
    # the same transform (sums of 16 products, possibly in another order): equal to fp32 rounding
    torch.testing.assert_close(y, transform_columns(x.t().contiguous(), m).t(), rtol=0, atol=1e-6)
    assert torch.equal(y[32:], x[32:])
    block = (m.t().double() @ x[:16].double()).float()
    torch.testing.assert_close(y[:16], block, rtol=0, atol=1e-6)


def test_rht_weight_gradient_equals_the_plain_one_to_fp32_rounding():
    """grad_weight = dYᵀ X summed over 64 tokens: mixing every 16 tokens of both operands by the same
    orthogonal matrix leaves the product unchanged; in fp32 the two differ by rounding only."""
    torch.manual_seed(1)
    dy, x = torch.randn(64, 24), torch.randn(64, 40)
    x[5] *= 50  # an outlier token: the transform spreads it over its block
    m = rht_matrix(7)
    plain = dy.t() @ x
    rht = transform_rows(dy, m).t() @ transform_rows(x, m)
    exact = dy.double().t() @ x.double()
    # fp32 rounding of sums of 64 (and 16-term transforms): bounded by a few ulps of sum |dy||x|
    bound = 64 * 2.0**-23 * (dy.abs().double().t() @ x.abs().double())
    assert ((plain.double() - exact).abs() <= bound).all()
    assert ((rht.double() - exact).abs() <= bound).all()
    # the transform does something: the transformed outlier block has no single large token left
    assert transform_rows(x, m)[:16].abs().max() < x[:16].abs().max()


def test_bad_sizes_are_refused():
    with pytest.raises(MixprecError, match="power of two"):
        hadamard_matrix(12)
