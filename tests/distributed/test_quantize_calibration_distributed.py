"""`quantize_checkpoint`'s calibration split across two gloo ranks (calibrate_job under a process group):
every rank ends with the amaxes, KV amaxes and run record of one process calibrating layer by layer on
every batch, exactly; GPTQ's rounded weights are bit-identical on the ranks and agree with one process's
up to the order of the Hessians' fp32 sums. One spawn for the module: every scenario runs inside it."""

from __future__ import annotations

import warnings

import pytest
import torch

from distributed.harness import run_distributed
from inference.inference_helpers import CALIB_TEXTS, save_with_tokenizer, tiny_llama
from mixprec.conversion import ConversionReport
from mixprec.errors import MixprecError
from mixprec.inference.producers.quantize import select
from mixprec.inference.producers.quantize_calibration import calibrate_job
from mixprec.inference.producers.quantize_job import QuantizeJob, resolve

pytest.importorskip("transformers")

SAMPLES = 12  # 3 batches of 4 sequences: rank 0 runs batches 0 and 2, rank 1 batch 1
# (name, scheme, options): calibrate_job's scenarios, each on every rank and in one process
SCENARIOS = {
    "static": ("fp8-static", dict(kv_cache="fp8")),
    "one-batch": ("fp8-static", dict(kv_cache="fp8", calib_samples=4)),  # rank 1 runs no batch
    "gptq-nvfp4": ("nvfp4a16", dict(algorithm="gptq")),
    "gptq-fp8": ("fp8-dynamic", dict(algorithm="gptq")),
    "gptq-one-batch": ("fp8-dynamic", dict(algorithm="gptq", calib_samples=4)),
}
# GPTQ against one process: the Hessians differ by the order of their fp32 sums (rank 0's batches, then
# rank 1's, against batch after batch), so some codes round the other way. Block 0 reads the same inputs
# on both sides, so only that sum order separates them; block 1 reads block 0's outputs, which carry block
# 0's flipped codes, and GPTQ's error feedback spreads such differences chaotically. Measured (tiny fp32
# Llama, 2 blocks, 14 Linears, 3 batches of 4 x 32 tokens, one thread per process), as the worst Linear of:
#                           block 0                      block 1
#                           codes   weights  GPTQ err    codes   weights  GPTQ err  RTN err, damp
#   AVX-512-BF16 EPYC       0.1 %   < 1.1 %  < 0.3 %     1.5 %   1.1 %    0.3 %     7e-6
#   AMX Xeon (2026-12-06)   0.34 %  0.41 %   0.15 %      6.2 %   1.6 %    2.8 %     3.1e-5
# (codes: share of a Linear's codes that differ; weights: ||dequantized - one process's|| / ||one
# process's||; GPTQ err and RTN err: relative difference of the records' output errors; damp: of the
# dampening, computed from the Hessian alone.) With one batch (one rank has none) the summed Hessian is
# the one process's bit for bit: so is all. The bounds, with headroom; block 0's RTN error and dampening
# bounds are what catch a Hessian that lost a rank's batches (that moves them by tens of per cent):
BOUNDS = {  # block: (codes, weights, {record key: rtol})
    0: (0.03, 0.02, {"output_error": 0.01, "output_error_rtn": 1e-4, "damp": 1e-4}),
    1: (0.12, 0.04, {"output_error": 0.06, "output_error_rtn": 1e-3, "damp": 1e-3}),
}


def _calibrate(model_dir, text, out, scheme: str, *, layer_by_layer=True, observer="max", kv_cache=None,
               algorithm=None, calib_samples=SAMPLES) -> tuple[dict, ConversionReport]:  # fmt: skip
    """calibrate_job as quantize_checkpoint runs it, as plain values (what a rank sends back)."""
    job = QuantizeJob.build(
        model_dir, out, scheme, ignore=None, default_ignore=True, kv_cache=kv_cache, max_shard_size="5GB",
        calib_data=text, calib_samples=calib_samples, calib_seq_len=32, observer=observer, calib_stop=None,
        format="compressed-tensors", force=False, layer_by_layer=layer_by_layer, progress=False, strict=False,
        algorithm=algorithm,
    )  # fmt: skip
    source = resolve(job)
    report = ConversionReport(recipe=scheme, kind="", device="cpu", param_dtype="")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibration = calibrate_job(job, source, select(job, source, report), report)
    try:
        info = {k: v for k, v in (calibration.info or {}).items() if k != "seconds"}
        rounded = {
            n: {
                "data": q.data,
                "scale": q.scale,
                "global_scale": q.global_scale,
                "dequantized": q.dequantize(),
            }
            for n, q in calibration.prequantized.items()
        }
        spill = str(getattr(calibration.prequantized, "root", ""))
        algorithm_record = report.algorithm or {}
        layers = {
            n: {k: v for k, v in r.items() if k != "seconds"}
            for n, r in algorithm_record.get("layers", {}).items()
        }
        out = dict(input_amax=calibration.input_amax, kv_amax={str(i): list(kv) for i, kv in calibration.kv_amax.items()},
                   kv_names={str(i): n for i, n in calibration.kv_names.items()}, info=info, rounded=rounded,
                   layers=layers, tokens=algorithm_record.get("tokens"), spill=spill,
                   warnings=[w for w in report.warnings if "GPTQ" in w])  # fmt: skip
    finally:
        calibration.close()
    return out, report


def _every_scenario(rank: int, world: int, model_dir: str, text: str, out: str) -> dict:
    from pathlib import Path

    results = {}
    for name, (scheme, kw) in SCENARIOS.items():
        # layer_by_layer=False: a split run is layer by layer whatever the job asks
        results[name], report = _calibrate(Path(model_dir), Path(text), Path(out) / name, scheme,
                                           layer_by_layer=False, **kw)  # fmt: skip
        results[name]["notes"] = [n for n in report.notes if "processes" in n]
    try:
        _calibrate(Path(model_dir), Path(text), Path(out) / "refused", "fp8-static", observer="percentile")
        results["refused"] = ""
    except MixprecError as e:
        results["refused"] = str(e)
    return results


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("calib-dp")
    model_dir = save_with_tokenizer(tiny_llama(seed=3), root / "model")
    text = root / "calib.txt"
    text.write_text("\n\n".join(CALIB_TEXTS))
    return model_dir, text, root


@pytest.fixture(scope="module")
def two_ranks(files):
    model_dir, text, root = files
    return run_distributed(_every_scenario, 2, root / "ranks", str(model_dir), str(text), str(root / "dp"))


@pytest.fixture(scope="module")
def one_process(files):
    model_dir, text, root = files
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs (harness): GEMM results depend on the thread count
    try:
        return {name: _calibrate(model_dir, text, root / "one" / name, scheme, **kw)[0]
                for name, (scheme, kw) in SCENARIOS.items()}  # fmt: skip
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("scenario", ["static", "one-batch"])
def test_amaxes_and_run_equal_one_process_layer_by_layer_exactly(two_ranks, one_process, scenario):
    one = one_process[scenario]
    assert one["input_amax"] and len(one["kv_amax"]) == 2
    assert all(a > 0 for a in one["input_amax"].values())
    for r in two_ranks:
        got = r[scenario]
        assert got["input_amax"] == one["input_amax"]  # max is exact: ==, not close
        assert got["kv_amax"] == one["kv_amax"] and got["kv_names"] == one["kv_names"]
        assert got["info"] == one["info"]  # samples, tokens, batches, samples_available, reason, ...
        assert got["info"]["layer_by_layer"] is True
        assert got["notes"] == [
            "calibration split across 2 processes: layer by layer, every batch run (no early stop)"
        ]
    expected = {"static": (SAMPLES, SAMPLES * 32, 3), "one-batch": (4, 4 * 32, 1)}[scenario]
    assert (one["info"]["samples"], one["info"]["tokens"], one["info"]["batches"]) == expected


@pytest.mark.parametrize("scenario", ["gptq-nvfp4", "gptq-fp8", "gptq-one-batch"])
def test_gptq_rounds_the_same_on_every_rank_and_as_one_process_up_to_sum_order(
    two_ranks, one_process, scenario
):
    a, b = (r[scenario] for r in two_ranks)
    one = one_process[scenario]
    assert len(one["rounded"]) == 14 and a["rounded"].keys() == one["rounded"].keys()
    for n in one["rounded"]:  # bit-identical on the ranks: each rank writes some of them
        for part in ("data", "scale", "global_scale"):
            x, y = a["rounded"][n][part], b["rounded"][n][part]
            assert (x is None and y is None) or torch.equal(x.view(torch.uint8), y.view(torch.uint8)), (
                n,
                part,
            )
    assert a["layers"] == b["layers"] and a["warnings"] == b["warnings"] and a["info"] == b["info"]
    assert a["spill"] != b["spill"]  # each rank its own spill directory
    assert a["tokens"] == one["tokens"] and a["warnings"] == one["warnings"] and a["info"] == one["info"]
    for n, q in one["rounded"].items():
        mine = a["rounded"][n]
        codes = float((mine["data"].view(torch.uint8) != q["data"].view(torch.uint8)).float().mean())
        diff = float((mine["dequantized"] - q["dequantized"]).norm() / q["dequantized"].norm())
        max_codes, max_diff, record_rtol = BOUNDS[int(n.split(".")[2])]
        assert codes <= max_codes and diff <= max_diff, (n, codes, diff)
        if scenario == "gptq-one-batch":  # the same Hessians: the same rounding
            assert codes == 0 and a["layers"][n] == one["layers"][n], n
        rec, ref = a["layers"][n], one["layers"][n]
        assert rec["tokens"] == ref["tokens"] and rec["dead_inputs"] == ref["dead_inputs"], n
        for key, rtol in record_rtol.items():
            assert rec[key] == pytest.approx(ref[key], rel=rtol), (n, key)


def test_one_batch_leaves_a_rank_without_data_and_still_warns_from_the_global_count(two_ranks, one_process):
    """4 sequences of 32 tokens = 128 rows for Hessians of up to 256 inputs: the warning counts every rank's."""
    assert "128 tokens" in one_process["gptq-one-batch"]["warnings"][0]
    assert two_ranks[1]["gptq-one-batch"]["warnings"] == one_process["gptq-one-batch"]["warnings"]


def test_an_observer_that_does_not_combine_across_ranks_is_refused(two_ranks):
    for r in two_ranks:
        assert "--observer percentile cannot be split across 2 processes" in r["refused"]
        assert "use --observer max" in r["refused"]
