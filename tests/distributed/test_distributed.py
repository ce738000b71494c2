"""mixprec under torch.distributed: 2 CPU processes, gloo backend, one spawn for the whole module.

Tolerances (measured on this tiny model, 6 steps, lr 2e-3):
- DDP vs one process on the combined batch: relative 5e-3 per step loss (measured: at most 1.9e-3 for
  fp8-delayed, 2.5e-3 for fp8-current, 1.1e-4 for bf16 over 6 steps). The runs differ where they must:
  the first step of delayed scaling has no history and scales from each rank's own amax (the
  combined batch's amax in one process); bf16 gradients are rounded per rank before the fp32 average.
- DDP vs one process accumulating the same shards as micro-batches: bit-identical.
- FSDP2 (fp32 masters in FSDP, the default for bf16 models) vs DDP: bit-identical losses, every recipe.
- FSDP2 with the optimizer's DTensor masters vs DDP: relative 2e-3 (gradient shards come back in bf16).
- save on 2 ranks + resume vs uninterrupted: bit-identical.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from distributed import scenarios
from distributed.harness import run_distributed

NAMES = [
    "ddp_delayed",
    "ddp_delayed_without_reduction",
    "fsdp_delayed",
    "fsdp_delayed_optimizer_masters",
    "checkpoint",
    "nan",
    "recipes",
    "fp8_all_gather",
    "wrong_order",
    "ddp_accumulation",
    "plain_ddp",
    "plain_ddp_default_adamw",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    per_rank = run_distributed(scenarios.run_all, 2, tmp / "out", str(tmp), NAMES)
    return per_rank


@contextlib.contextmanager
def one_thread():
    """The workers compute with 1 thread each; CPU reductions (LayerNorm backward) sum in an order that
    depends on the thread count, so the single-process references run with 1 thread too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _close(a, b, rel):
    return all(math.isclose(x, y, rel_tol=rel) for x, y in zip(a, b, strict=True))


def test_ddp_matches_single_process_on_combined_batch(results):
    ddp = results[0]["ddp_delayed"]["losses"]
    with one_thread():
        single = scenarios.single_process("fp8-delayed:history=16", scenarios.STEPS)
        accumulated = scenarios.single_process("fp8-delayed:history=16", scenarios.STEPS, micro_batches=2)
    assert _close(ddp, single, 5e-3), (ddp, single)
    # the combined batch taken as the ranks' shards, accumulated in one process: bit-identical, so the
    # gap above is the micro-batch split itself (the GEMM's M, first-step scales, bf16 gradient rounding)
    assert ddp == accumulated
    assert results[0]["ddp_delayed"]["replicas_identical"]
    assert results[0]["ddp_delayed"]["losses"] == results[1]["ddp_delayed"]["losses"]


def test_amax_reduction_gives_identical_scales_on_every_rank(results):
    assert all(results[0]["ddp_delayed"]["agree"])
    assert results[0]["ddp_delayed"]["scales"].equal(results[1]["ddp_delayed"]["scales"])
    # one all_reduce per step for all layers: 2 LowPrecisionLinear x (input, weight, grad_output)
    assert results[0]["ddp_delayed"]["amax_collectives"] == [6]
    # without the reduction the ranks' histories and scales drift apart (the test can fail)
    assert not results[0]["ddp_delayed_without_reduction"]["agree"]


def test_fsdp2_matches_ddp(results):
    ddp = results[0]["ddp_delayed"]["losses"]
    fsdp = results[0]["fsdp_delayed"]
    assert fsdp["param_dtype"] == "torch.float32"  # sharded fp32 masters, bf16 compute
    assert fsdp["moments"] == "torch.bfloat16" and not fsdp["has_master_copy"]
    assert fsdp["losses"] == ddp
    assert fsdp["agree"]
    masters = results[0]["fsdp_delayed_optimizer_masters"]
    assert masters["master"] == "DTensor:torch.float32:torch.bfloat16"
    assert _close(masters["losses"], ddp, 2e-3)


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_resume_from_distributed_checkpoint_is_bit_identical(results, strategy):
    for r in (0, 1):
        got = results[r]["checkpoint"][strategy]
        assert got["resumed"] == got["uninterrupted"]


def test_one_rank_seeing_nan_makes_every_rank_skip(results):
    r0, r1 = results[0]["nan"], results[1]["nan"]
    assert r0["skipped"] == r1["skipped"] == [False, True, False, True, False]
    assert r0["unchanged_by_skip"] == [True, True] and r0["changed_by_step"]
    assert r0["replicas_identical"] and r0["agree"] and r0["scales_finite"] and r0["final_finite"]


@pytest.mark.parametrize("recipe", scenarios.RECIPES)
def test_every_recipe_under_ddp_and_fsdp2(results, recipe):
    got = results[0]["recipes"][recipe]
    assert got["ddp"]["replicas_identical"]
    assert all(math.isfinite(x) for x in got["ddp"]["losses"] + got["fsdp2"]["losses"])
    assert got["fsdp2"]["losses"] == got["ddp"]["losses"]  # measured: bit-identical for every recipe


def test_fp8_all_gather_halves_bytes_and_changes_no_bit(results):
    r = results[0]["fp8_all_gather"]
    assert r["weight_type"] == "Fp8AllGatherWeight"
    # the LowPrecisionLinear units gather E4M3 payloads as bytes; the root unit (LayerNorm) gathers bf16
    assert r["fp8_dtypes"] == ["torch.bfloat16", "torch.uint8"]
    assert r["fp8_bytes"] < 0.6 * r["plain_bytes"]
    # same payloads, and the scale recomputed from the gathered bf16 weight is the same (see module doc)
    assert r["fp8"] == r["plain"] == r["fp8_precomputed"]
    assert r["reduces_with_precompute"] == 0  # precompute_scales: no per-weight amax all_reduce
    assert r["reduces_stale"] == 2  # shards changed since: one amax all_reduce per LowPrecisionLinear weight


def test_wrong_order_is_a_clear_error(results):
    r = results[0]["wrong_order"]
    assert "convert first, then wrap" in r["ddp_convert_after_wrap"]
    assert "build the optimizer AFTER wrapping" in r["fsdp_optimizer_before_wrap"]


def test_ddp_gradient_accumulation_sums_in_fp32_then_reduces_once(results):
    got = results[0]["ddp_accumulation"]
    assert got["replicas_identical"]
    with one_thread():  # 2 ranks x 2 micro-batches == 4 micro-batches in one process, bit for bit
        accumulated = scenarios.single_process("fp8-delayed:history=16", 3, micro_batches=4)
    assert got["losses"] == accumulated


def test_foreign_ddp_with_adamw_reducing_plain_grads(results):
    got = results[0]["plain_ddp"]
    assert got["replicas_identical"] and all(math.isfinite(x) for x in got["losses"])
    assert _close(got["losses"], results[0]["ddp_delayed"]["losses"][:3], 5e-3)


def test_plain_ddp_with_fp32_grad_buffers_is_refused_not_silently_wrong(results):
    for rank_results in results:
        got = rank_results["plain_ddp_default_adamw"]
        assert got["error"] is not None and "wrap_ddp" in got["error"]
        assert got["unchanged"]  # refused before any parameter moved
