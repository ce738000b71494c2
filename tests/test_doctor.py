"""`mixprec doctor` says what runs, because it asks the code that decides: the GEMM seam per scaling kind
(mixprec.gemm.will_emulate), the bf16 CPU path (kernels.bf16_cpu.should_install); and it recommends what
fits the machine. GPUs are faked: capabilities replaced, operands built as fake CUDA tensors."""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mixprec import gemm
from mixprec.commands import doctor
from mixprec.kernels import hardware, native

AVX2_ONLY = "model name\t: AMD EPYC\nflags\t\t: fpu sse sse2 avx avx2 fma bmi2\n"
AVX512_BF16 = "model name\t: AMD EPYC 9R14\nflags\t\t: avx2 avx512f avx512bw avx512_bf16\n"
SAPPHIRE_RAPIDS = (
    "model name\t: Intel Xeon Platinum 8480+\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
)


def fake_capabilities(monkeypatch, **changes) -> hardware.Capabilities:
    """Replace detect()'s answer everywhere mixprec asks it (every module holding hardware.detect, and
    the GEMM seam's memo); forget the kernel choices made with the real one."""
    caps = dataclasses.replace(hardware.detect(), **changes)
    real = hardware.detect

    def fake() -> hardware.Capabilities:
        return caps

    for name, module in list(sys.modules.items()):
        if name.startswith("mixprec") and getattr(module, "detect", None) is real:
            monkeypatch.setattr(module, "detect", fake)
    monkeypatch.setattr(gemm, "_CAPABILITIES", [caps])
    monkeypatch.setattr(native, "_SELECTED", {})
    return caps


def hopper(**changes) -> dict:
    """An SM 9.0 GPU's capabilities, with `changes` applied."""
    gpu = dict(
        cuda_available=True, cuda_device="fake GPU", cuda_capability=(9, 0), bf16_tensor_cores=True,
        fp8_native=True, mxfp8_native=False, scaled_mm_cuda=True,
    )  # fmt: skip
    return {**gpu, **changes}


def _probe_found_f_scaled_mm(device_str: str, b_rows: int) -> dict:
    return {
        "backend": "F.scaled_mm", "layout_a": "grid_outer_major", "layout_b": "padded_k4_transposed",
        "fp32_out": True, "tried": ["fake probe"], "error": "",
    }  # fmt: skip


def test_cpuinfo_flags_name_the_bf16_units():
    assert hardware.parse_cpuinfo(AVX2_ONLY) == (
        "AMD EPYC",
        {"fpu", "sse", "sse2", "avx", "avx2", "fma", "bmi2"},
    )
    assert "avx512_bf16" in hardware.parse_cpuinfo(AVX512_BF16)[1]
    model, flags = hardware.parse_cpuinfo(SAPPHIRE_RAPIDS)
    assert model == "Intel Xeon Platinum 8480+" and {"amx_bf16", "amx_tile"} <= flags
    assert hardware.parse_cpuinfo("") == (None, set())
    graviton3 = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm\nCPU part\t: 0xd40\n"
    assert "bf16" in hardware.parse_cpuinfo(graviton3)[1]


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads /proc/cpuinfo (Linux)")
def test_this_cpu_is_detected_from_proc_cpuinfo():
    _, flags = hardware.parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    caps = hardware.detect()
    arm = platform.machine() in ("aarch64", "arm64")
    assert caps.cpu_flags_bf16 == ("avx512_bf16" in flags or (arm and "bf16" in flags))
    assert caps.cpu_flags_amx == bool({"amx_bf16", "amx_tile"} & flags)


@pytest.mark.parametrize(
    "bf16_flags, path",
    [
        (dict(cpu_flags_bf16=False, cpu_flags_amx=False), "fp32-compute"),
        (dict(cpu_flags_bf16=True, cpu_flags_amx=False), "native"),
        (dict(cpu_flags_bf16=False, cpu_flags_amx=True), "native"),
    ],
)
def test_on_a_cpu_doctor_names_the_bf16_path_and_recommends_bf16(monkeypatch, bf16_flags, path):
    caps = fake_capabilities(
        monkeypatch, cuda_available=False, cuda_device=None, cuda_capability=None, bf16_tensor_cores=False,
        fp8_native=False, mxfp8_native=False, scaled_mm_cuda=False, **bf16_flags,
    )  # fmt: skip
    report = doctor.doctor_report("cpu")
    assert report["schema_version"] == 2 and report["capabilities"] == caps.to_dict()
    assert report["bf16_gemm"]["path"] == path
    assert all(
        not entry["native"] and entry["backend"] == "emulated" for entry in report["kernels"]["gemm"].values()
    )
    rec = report["recommendation"]
    # no FP8 units: bf16 fits; FP8 numerics are checked with the cheapest robust emulated recipe
    assert rec["recipe"] == "bf16" and rec["fp8_recipe"] == "fp8-current"
    assert ("3x faster than fp32" in rec["reason"]) == (path == "native")
    assert ("does not speed them up" in rec["reason"]) == (path == "fp32-compute")
    if caps.scaled_mm_cpu:  # torch's CPU kernel runs, but the seam emulates: said, not hidden
        assert "reference loop" in report["kernels"]["gemm"]["tensorwise"]["note"]


def test_this_machine(capsys):
    report = doctor.doctor_report()
    caps = hardware.detect()
    if not caps.cuda_available:
        fast_bf16 = caps.cpu_flags_bf16 or caps.cpu_flags_amx
        assert report["bf16_gemm"]["path"] == ("native" if fast_bf16 else "fp32-compute")
        assert report["recommendation"]["recipe"] == "bf16"
    assert doctor.run(argparse.Namespace(json=True)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema_version"] == 2 and out["kernels"]["schema_version"] == 1
    assert set(out["kernels"]["gemm"]) == set(doctor.GEMM_KINDS) and "mxfp8" in out["kernels"]["gemm"]
    assert doctor.run(argparse.Namespace(json=False)) == 0
    text = capsys.readouterr().out
    assert "kernels:" in text and "FP8 GEMM mxfp8" in text and "recommended recipe" in text


def _operands(kind: str, device: str):
    ga, gb = doctor.GEMM_KINDS[kind]
    fmt = "e2m1" if kind in doctor.FP4_KINDS else "e4m3"
    return doctor.sample_operand(ga, device, fmt), doctor.sample_operand(gb, device, fmt)


@pytest.mark.parametrize(
    "gpu, recipe",
    [
        (hopper(), "fp8-delayed"),
        # SM 10.0 has MXFP8 tensor cores, but mixprec.gemm emulates MX: neither "native" nor fp8-mxfp8
        (hopper(cuda_capability=(10, 0), mxfp8_native=True), "fp8-delayed"),
    ],
    ids=["sm90", "sm100"],
)
def test_on_fake_gpus_doctor_shows_what_the_gemm_seam_runs(monkeypatch, gpu, recipe):
    caps = fake_capabilities(monkeypatch, **gpu)
    monkeypatch.setattr(native, "probe_blockwise", _probe_found_f_scaled_mm)
    with FakeTensorMode():  # CUDA tensors without a GPU: the seam reads devices, shapes and dtypes only
        report = doctor.doctor_report("cuda:0")
        seam = {
            kind: not gemm.will_emulate(*_operands(kind, "cuda:0"), "auto", torch.bfloat16)
            for kind in doctor.GEMM_KINDS
        }
        kernels = native.native_kernel_report("cuda:0")
    shown = report["kernels"]["gemm"]
    assert {kind: entry["native"] for kind, entry in shown.items()} == seam
    # the FP8 backends agree (they offer no FP4 kernel: the seam emulates FP4, fp4_native_reason)
    assert {kind: entry["native"] for kind, entry in kernels["gemm"].items()} == {
        kind: seam[kind] for kind in kernels["gemm"]
    }
    assert seam == {
        "tensorwise": True,
        "rowwise": True,
        "blockwise_1x128_128x128": True,
        "blockwise_1x128_1x128": True,
        "mxfp8": False,
        "nvfp4": False,
        "mxfp4": False,
    }
    assert set(kernels["gemm"]) == set(seam) - set(doctor.FP4_KINDS)
    assert shown["nvfp4"]["note"] == gemm.fp4_native_reason(torch.device("cuda:0"))
    assert shown["tensorwise"]["backend"] == shown["rowwise"]["backend"] == "torch._scaled_mm"
    assert shown["blockwise_1x128_128x128"]["backend"] == "F.scaled_mm"
    assert shown["mxfp8"]["backend"] == "emulated" and "not wired up" in shown["mxfp8"]["note"]
    assert ("not wired up" in kernels["gemm"]["mxfp8"]["note"]) == caps.mxfp8_native
    rec = report["recommendation"]
    assert rec["recipe"] == rec["fp8_recipe"] == recipe
    assert ("MXFP8 tensor cores stay unused" in rec["reason"]) == caps.mxfp8_native
    assert report["bf16_gemm"] == {"path": "native", "note": "bf16 tensor cores"}


def test_a_gpu_without_fp8_gets_bf16_and_an_old_one_fp16(monkeypatch):
    fake_capabilities(monkeypatch, **hopper(cuda_capability=(8, 0), fp8_native=False, scaled_mm_cuda=False))
    with FakeTensorMode():
        report = doctor.doctor_report("cuda:0")
    assert not any(entry["native"] for entry in report["kernels"]["gemm"].values())
    assert "no FP8 tensor cores" in report["kernels"]["gemm"]["tensorwise"]["note"]
    assert report["recommendation"]["recipe"] == "bf16"
    assert report["recommendation"]["fp8_recipe"] == "fp8-current"
    fake_capabilities(
        monkeypatch,
        **hopper(cuda_capability=(7, 0), fp8_native=False, scaled_mm_cuda=False, bf16_tensor_cores=False),
    )
    with FakeTensorMode():
        report = doctor.doctor_report("cuda:0")
    assert report["recommendation"]["recipe"] == "fp16-amp"
    assert report["bf16_gemm"]["note"].startswith("no bf16 tensor cores")
