"""GPTQ's rounded weights wait on disk between the block walk and the writer (checkpoint/spill.py): what
comes back is bit-identical, memory keeps none of a flushed block's tensors, and the directory is gone
after the quantize."""

from __future__ import annotations

import warnings

import torch

from mixprec.formats import get_format
from mixprec.inference.checkpoint.spill import SpilledResults
from mixprec.inference.producers.quantize import quantize_checkpoint
from mixprec.quantization import quantize
from mixprec.scaling import Granularity


def _rounded(seed: int):
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed))
    return {
        "nvfp4": quantize(w, get_format("e2m1"), Granularity.nvfp4()),
        "fp8": quantize(w, get_format("e4m3"), Granularity.tensor()),
    }


def _same(a, b) -> bool:
    g = (a.global_scale is None and b.global_scale is None) or torch.equal(a.global_scale, b.global_scale)
    return (a.data.dtype == b.data.dtype and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
            and torch.equal(a.scale, b.scale) and g and a.fmt == b.fmt and a.granularity == b.granularity
            and a.shape == b.shape)  # fmt: skip


def test_spilled_results_come_back_bit_identical_and_leave_memory(tmp_path):
    store = SpilledResults(tmp_path)
    expected = {}
    for block in range(2):
        for kind, q in _rounded(block).items():
            store[f"b{block}.{kind}"] = expected[f"b{block}.{kind}"] = q
        store.flush()
        assert not store._pending  # the block's tensors are on disk only
    store["pending"] = expected["pending"] = _rounded(9)["nvfp4"]
    assert len(store) == 5 and set(store) == set(expected) and "b1.fp8" in store and "x" not in store
    for name, q in expected.items():
        assert _same(store[name], q), name
    assert len(list(store.root.glob("*.safetensors"))) == 2
    store.close()
    assert not store.root.exists()


def test_gptq_quantize_leaves_no_spill_directory(llama_dir, calib_file, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_checkpoint(llama_dir, tmp_path / "q", "nvfp4a16", calib_data=calib_file, algorithm="gptq",
                            progress=False, calib_samples=4, calib_seq_len=32)  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]
