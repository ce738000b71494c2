"""Kernel tests: on a machine without CUDA the Triton kernels run in Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported (it decorates triton.language's helpers
then), so tests/conftest.py sets it, only when there is no CUDA device (on a GPU the same tests compile
the kernels for real).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="session")
def kernel_device() -> str:
    """Where Triton kernels run in these tests: the GPU, else CPU tensors through the interpreter."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed (pip install triton; CPU runs use TRITON_INTERPRET=1)")
    if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")
    return "cuda" if HAS_CUDA else "cpu"
