"""Shared fixtures. Keep this small: helpers that several test files need, nothing else."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# tests/reference.py is imported as a plain module (`import reference`) by the numerics tests.
sys.path.insert(0, str(Path(__file__).parent))


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
