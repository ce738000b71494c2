"""Fixtures for the FP8 inference tests (helpers live in inference_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from inference_helpers import CALIB_TEXTS, VOCAB, save_with_tokenizer, tiny_llama


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    """A tiny LlamaForCausalLM (fp32) saved with save_pretrained, plus a BPE tokenizer."""
    return save_with_tokenizer(tiny_llama(), tmp_path_factory.mktemp("llama") / "model")


@pytest.fixture(scope="session")
def calib_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("calib") / "calib.txt"
    p.write_text("\n\n".join(CALIB_TEXTS))
    return p


@pytest.fixture(scope="session")
def input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(7))
