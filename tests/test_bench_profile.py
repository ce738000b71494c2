"""bench/profile_workflows.py's bookkeeping: the op classifier, the Amdahl bound, the ranges it wraps
around mixprec's entry points (and takes off again), and the buckets of a tiny real profile."""

from __future__ import annotations

import importlib.util
import math
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import mixprec.gemm
import mixprec.quantization
import mixprec.rounding
import mixprec.training.optim
from mixprec.gemm import scaled_mm
from mixprec.quantization import quantize
from mixprec.scaling import Granularity, QuantizedTensor

BENCH = Path(__file__).resolve().parents[1] / "bench" / "profile_workflows.py"


@pytest.fixture(scope="module")
def pw():
    spec = importlib.util.spec_from_file_location("profile_workflows", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["profile_workflows"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("profile_workflows", None)


def test_classifier(pw):
    assert pw.classify("aten::mm", "mixprec.emulated_gemm") == "gemm_emu"
    assert pw.classify("aten::mul_", "mixprec.emulated_gemm") == "decode"
    assert pw.classify("aten::mm", None) == "gemm_native"
    assert pw.classify("aten::addmm", "mixprec.linear") == "gemm_emu"  # a weight-only Linear's fp32 GEMM
    assert pw.classify("aten::div", "mixprec.quantize") == "quantizer"
    assert pw.classify("aten::floor", "mixprec.sr") == "sr"
    assert pw.classify("aten::mm", "mixprec.rht") == "rht"
    assert pw.classify("aten::add_", None) == "other"
    assert pw.classify("aten::_scaled_dot_product_flash_attention_for_cpu_backward", None) == "gemm_native"
    assert pw.classify("aten::lerp_", pw.OPTIMIZER) == "optim"
    assert pw.is_op("aten::mm") and pw.is_op("mkldnn::something")
    assert not pw.is_op("autograd::engine::evaluate_function: MmBackward0")
    assert not pw.is_op("mixprec.quantize") and not pw.is_op("phase:step|bf16")


def test_amdahl(pw):
    b = dict.fromkeys(pw.BUCKETS, 0.0) | {"gemm_emu": 0.5, "quantizer": 0.25, "other": 0.25}
    assert pw.amdahl(b, 1.0, 1.0) == pytest.approx(1.0)
    assert pw.amdahl(b, 5.0, 1.0) == pytest.approx(1 / (0.1 + 0.5))
    assert pw.amdahl(b, math.inf, math.inf) == pytest.approx(4.0)


def test_ranges_are_taken_off_again(pw):
    originals = (
        mixprec.quantization._quantize,
        mixprec.gemm._emulated,
        mixprec.rounding.stochastic_round_pair_into,
        mixprec.training.optim.stochastic_round_pair_into,
        QuantizedTensor.__dict__["dequantize"],
    )
    with pw.wrapped_entries(pw.Recorder()):
        assert mixprec.quantization._quantize is not originals[0]
        assert mixprec.training.optim.stochastic_round_pair_into is not originals[3]  # a from-import
    after = (
        mixprec.quantization._quantize,
        mixprec.gemm._emulated,
        mixprec.rounding.stochastic_round_pair_into,
        mixprec.training.optim.stochastic_round_pair_into,
        QuantizedTensor.__dict__["dequantize"],
    )
    assert after == originals


def test_buckets_of_a_real_profile(pw):
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 128, generator=gen), torch.randn(32, 128, generator=gen)

    def work():
        with torch.profiler.record_function("phase:step|fp8"):
            qa, qb = quantize(a, "e4m3"), quantize(b, "e4m3", Granularity.rows())
            scaled_mm(qa, qb)
        torch.mm(a, b.t())  # outside the phase, not emulated

    prof = pw.profiled_run(work, plain=math.nan)
    step, rest = prof.buckets[("step", "fp8")], prof.buckets[pw.FIXED]
    assert step["quantizer"] > 0 and step["gemm_emu"] > 0 and step["gemm_native"] == 0
    assert rest["gemm_native"] > 0 and rest["quantizer"] == 0
    assert prof.shapes == Counter({(64, 128, 32): 1})
    assert mixprec.quantization._quantize.__name__ == "_quantize" and not hasattr(
        mixprec.quantization._quantize, "__wrapped__"
    )
