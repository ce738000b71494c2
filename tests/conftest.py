"""Shared fixtures. Keep this small: helpers that several test files need, nothing else."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

# tests/reference.py is imported as a plain module (`import reference`) by the numerics tests.
sys.path.insert(0, str(Path(__file__).parent))

# Without CUDA the Triton kernel tests (tests/kernels) run in Triton's interpreter. TRITON_INTERPRET is
# read when a function is decorated with @triton.jit, and triton.language's own helpers (tl.zeros...) are
# decorated when triton is first imported — which other tests (torch.compile, torchao) may do long before
# tests/kernels is reached. So it is set here, in the first conftest pytest loads.
if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The emulated GEMMs run on the CPU's bf16 units where it has them (mixprec.kernels.emulation), which
# changes the order of fp32 sums: the suite's bit-exact goldens and tight tolerances hold for the fp32
# backend on every machine kind, so it is pinned here (subprocesses inherit it); tests/test_gemm_emulation.py
# forces the bf16 backend on every CPU. MIXPREC_GEMM_EMULATION=auto pytest ... runs the suite as users do.
os.environ.setdefault("MIXPREC_GEMM_EMULATION", "fp32")


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded CPU generator: the same data in every run, independent of the global RNG."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture(scope="module")
def single_thread():
    """Run a module's many small tensor ops on one thread (use: pytestmark = usefixtures("single_thread")).

    On a shared 2-core machine every parallel op waits for the second thread to be scheduled; small
    tensors gain nothing from it. The previous thread count is restored afterwards.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
