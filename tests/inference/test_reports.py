"""Inference reports say the real kind: the family of each quantized layer's scheme ("fp8:" / "fp4:"
in its precision), and for the report "fp8", "fp4", or "mixed" when a checkpoint holds both; their
warnings point at the caller's line."""

from __future__ import annotations

import pytest
from torch import nn

import mixprec
import mixprec.inference
from mixprec.conversion import SCHEMA_VERSION, ConversionReport
from mixprec.inference.producers.quantize import quantize_checkpoint
from mixprec.inference.runtime.online import apply_scheme_


@pytest.mark.parametrize(
    ("scheme", "kind"), [("fp8-dynamic", "fp8"), ("mxfp8", "fp8"), ("nvfp4a16", "fp4"), ("mxfp4a16", "fp4")]
)
def test_an_online_report_says_the_schemes_family(scheme, kind):
    report = apply_scheme_(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 64)), scheme)
    doc = report.to_dict()
    assert doc["schema_version"] == SCHEMA_VERSION == 6
    assert doc["kind"] == kind and report.reported_kind == kind
    assert report["0"].precision == f"{kind}:{scheme}" and report.converted == ["0", "2"]


def test_a_report_of_both_families_is_mixed_and_says_each_layers_kind():
    report = ConversionReport(recipe="auto", kind="fp8", device="cpu", param_dtype="bfloat16", scheme="auto")
    assert report.reported_kind == "fp8"  # nothing quantized yet: the kind it was built with
    report.add_quantized_linear("a", "Linear", 16, {}, "QuantizedLinear", "fp8")
    report.add_quantized_linear("b", "Linear", 16, {}, "BlockQuantizedLinear", "fp4")
    assert report.to_dict()["kind"] == "mixed"
    assert [report[n].precision for n in "ab"] == ["fp8:auto", "fp4:auto"]
    with pytest.raises(ValueError, match="bf16"):
        report.add_quantized_linear("c", "Linear", 16, {}, "Linear", "bf16")


def test_a_training_report_keeps_its_recipes_kind():
    report = ConversionReport(recipe="bf16", kind="bf16-amp", device="cpu", param_dtype="float32")
    assert report.to_dict()["kind"] == "bf16-amp"


def test_quantize_warnings_point_at_the_callers_line(llama_dir, tmp_path):
    """Warnings raised by the pipeline's steps are attributed to the line that called
    quantize_checkpoint, as before the pipeline was cut into steps."""
    with pytest.warns(UserWarning, match="no Linear weight") as record:
        quantize_checkpoint(llama_dir, tmp_path / "q", "fp8-dynamic", ignore=["re:.*"], progress=False)
    assert {w.filename for w in record if "no Linear weight" in str(w.message)} == {__file__}


def test_one_quantize_model_():
    """The package root's quantize_model_ is the one public entry; the inference wing's own is
    apply_scheme_, which mixprec.inference does not export."""
    assert mixprec.quantize_model_.__module__ == "mixprec.sensitivity.automatic"
    assert "quantize_model_" not in mixprec.inference.__all__
    with pytest.raises(AttributeError):
        mixprec.inference.quantize_model_  # noqa: B018
    report = mixprec.quantize_model_(nn.Sequential(nn.Linear(64, 32)), "nvfp4a16")
    assert report.to_dict()["kind"] == "fp4"


def test_an_offline_report_times_each_stage_with_its_peak_memory(llama_dir, calib_file, tmp_path):
    """quantize_checkpoint's report: the stages in order, each with its wall time and peak resident memory
    (a whole-run measurement keeps working: the process's own peak is never reset)."""
    from mixprec.progress import peak_rss

    before = peak_rss()
    report = quantize_checkpoint(llama_dir, tmp_path / "q", "fp8-static", calib_data=calib_file, calib_samples=4,
                                 calib_seq_len=16, progress=False)  # fmt: skip
    stages = report.to_dict()["stages"]
    assert [s["stage"] for s in stages] == ["prepare", "select", "calibration", "write"]
    assert all(s["seconds"] >= 0 and s["peak_rss_bytes"] > 0 for s in stages)
    assert peak_rss() >= before


def test_a_stage_meter_sees_each_stages_own_peak():
    import time

    import torch

    from mixprec.progress import StageMeter

    meter = StageMeter()
    meter.next("big")
    block = torch.ones(256 << 20, dtype=torch.uint8)  # 256 MiB, touched
    time.sleep(0.2)
    del block
    meter.next("small")
    time.sleep(0.2)
    meter.finish()
    big, small = meter.stages
    assert (big["stage"], small["stage"]) == ("big", "small")
    assert big["peak_rss_bytes"] - small["peak_rss_bytes"] >= 200 << 20
    assert not small["peak_rss_exact"]  # a stage below an earlier peak: sampled
    meter.finish()  # a second finish records nothing
    assert len(meter.stages) == 2
