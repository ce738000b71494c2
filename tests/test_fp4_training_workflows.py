"""FP4 training recipes in the workflows: conversion and the keep_last policy, a training step of a tiny
Llama, the precision monitor's per-role FP4 statistics, the what-if profile's counts and compare's
baselines."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from mixprec.comparison.config import CompareConfig
from mixprec.errors import MixprecError
from mixprec.formats import E2M1
from mixprec.models import lm_loss
from mixprec.monitor import PrecisionMonitor
from mixprec.quantization import quantize
from mixprec.scaling import Granularity, apply_blockwise
from mixprec.sensitivity.profile import profile_model, quantizing_recipes
from mixprec.sensitivity.statistics import quantization_counts
from mixprec.training import TrainingStep, convert_for_training
from mixprec.training.low_precision_linear import LowPrecisionLinear
from mixprec.training.optim import AdamW
from mixprec.training.quantizer_state import rounding_key
from training.tiny_models import IDS, tiny_llama


@pytest.mark.parametrize("recipe", ["fp4-nvfp4", "fp4-mxfp4"])
def test_a_training_step_of_a_tiny_llama(recipe):
    model = tiny_llama()
    report = convert_for_training(model, recipe)
    assert len(report.converted) == 14 and all(e.startswith("model.layers.") for e in report.converted)
    assert {e.precision for e in report.entries if e.name in report.converted} == {f"fp4:{recipe}"}
    step = TrainingStep(model, AdamW(model.parameters(), lr=1e-3))
    losses = []
    for _ in range(2):
        loss = lm_loss(model, IDS)
        step.backward(loss)
        losses.append(float(loss.detach()))
    assert all(math.isfinite(v) for v in losses)
    layer = model.get_submodule("model.layers.0.mlp.up_proj")
    assert isinstance(layer, LowPrecisionLinear) and layer.fp4_state.tolist() == [0, 2]
    assert "model.layers.0.mlp.up_proj.fp4_state" in model.state_dict()


def test_keep_last_keeps_the_last_blocks_in_bf16():
    model = tiny_llama(layers=3)
    report = convert_for_training(model, "fp4-nvfp4:keep_last=2")
    assert report.converted and all(n.startswith("model.layers.0.") for n in report.converted)
    kept = {e.name: e for e in report.entries}["model.layers.2.mlp.down_proj"]
    assert kept.precision == "bf16" and "last 2 blocks" in kept.reason
    with pytest.raises(MixprecError, match="only 3 blocks"):
        convert_for_training(tiny_llama(layers=3), "fp4-nvfp4:keep_last=4")


@pytest.mark.parametrize(
    ("recipe", "grans"),
    [("fp4-nvfp4", ("nv16", "nv16x16", "nv16")), ("fp4-mxfp4", ("mx32", "mx32", "mx32"))],
)
def test_the_monitor_reports_fp4_saturation_and_underflow_per_role(recipe, grans):
    torch.manual_seed(0)
    layer = LowPrecisionLinear.from_linear(torch.nn.Linear(64, 48), recipe, name="l")
    model = torch.nn.Sequential(layer)
    monitor = PrecisionMonitor(model, every=1)
    monitor.begin_step(0)
    x = torch.randn(32, 64) * 3
    model(x).square().sum().backward()
    records = {r["role"]: r for r in monitor.end_step()}
    assert [records[role]["granularity"] for role in ("input", "weight", "grad_output")] == list(grans)
    assert {r["fmt"] for r in records.values()} == {"e2m1"}
    # the input's figures are those of the quantization the layer made (block scale / global scale)
    q = quantize(x, E2M1, layer.recipe.granularity("input", False))
    scaled = apply_blockwise(x.abs(), q.effective_scale(), q.granularity, torch.div)
    # saturated: beyond what the block scales' own rounding clips; a scale that rounded down clips
    # the block maximum a little (to at most 6.4), which is the recipe's design, not a range problem
    headroom = q.granularity.clip_headroom(E2M1)
    assert records["input"]["saturated"] == int((scaled > 6 * headroom).sum()) == 0
    assert int((scaled > 6).sum()) > 0
    assert records["input"]["underflowed"] == int(((x != 0) & (scaled <= 0.25)).sum())


def test_the_profile_scores_fp4_recipes_with_the_training_noise():
    """The profile's counts are those of THE quantizer on the same tensors, grad_output with the
    stochastic-rounding key the FP4 run would use at that step."""
    assert {"fp4-nvfp4", "fp4-mxfp4"} <= set(quantizing_recipes())
    model = tiny_llama()
    profile = profile_model(model, [IDS], recipes=["fp4-nvfp4", "fp4-mxfp4"])
    name = "model.layers.1.mlp.down_proj"
    captured = {}
    work = copy.deepcopy(model)
    convert_for_training(work, "bf16")
    target = work.get_submodule(name)

    def hook(module, args, output):
        captured["input"] = args[0].detach()
        output.register_hook(lambda g: captured.__setitem__("grad_output", g.detach()))

    target.register_forward_hook(hook)
    lm_loss(work, IDS).backward()
    for role in ("input", "grad_output"):
        t2 = captured[role].reshape(-1, captured[role].shape[-1])
        key = rounding_key(0, 0, 0, name, "grad_input", role) if role == "grad_output" else None
        want, _ = quantization_counts(t2, E2M1, Granularity.nvfp4(1, 16), rounding_key=key)
        got = profile.cell(name, role, "fp4-nvfp4").passes[0]
        assert (got.saturated, got.underflowed, got.nonzero) == (
            want.saturated,
            want.underflowed,
            want.nonzero,
        )
    assert profile.cell(name, "weight", "fp4-mxfp4").granularity == "mx32"


def test_compare_judges_fp4_against_bf16_with_the_low_precision_margin():
    config = CompareConfig(recipes=("fp32", "bf16", "fp4-nvfp4", "fp4-mxfp4:2d=true"))
    config.validate()
    assert config.baselines()["fp4-nvfp4"] == "bf16" and config.baselines()["fp4-mxfp4:2d=true"] == "bf16"
    assert config.threshold_for("fp4-nvfp4") == config.thresholds["fp4"] == 0.01
    assert config.threshold_for("fp8-delayed") == config.thresholds["fp8"] == 0.0025
    assert config.limits_for("fp4-mxfp4").underflow == config.thresholds["underflow_fp4"] == 0.5
    assert config.limits_for("fp8-delayed").underflow == config.thresholds["underflow"] == 0.05
