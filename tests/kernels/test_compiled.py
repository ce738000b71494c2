"""kernels.compiled's cast_to_format: formats.cast_to_format bit for bit, compiled where it applies and
eager elsewhere. (Its quantize backend: tests/test_quantization_backends.py.)"""

from __future__ import annotations

import math

import pytest
import torch

import reference as ref
from mixprec.formats import E2M1, cast_to_format
from mixprec.kernels import compiled


@pytest.mark.slow
def test_compiled_cast_is_bit_identical():
    x = torch.randn(32, 96, generator=torch.Generator().manual_seed(8)) * 3
    x[0, :5] = torch.tensor([math.inf, -math.inf, -0.0, 1e-44, math.nan])
    assert ref.bits_equal(
        compiled.cast_to_format(x[:, :7], E2M1), cast_to_format(x[:, :7], E2M1)
    )  # eager path
    if not compiled.available():
        pytest.skip("torch.compile cannot build CPU code on this machine")
    assert ref.bits_equal(compiled.cast_to_format(x, E2M1), cast_to_format(x, E2M1))
