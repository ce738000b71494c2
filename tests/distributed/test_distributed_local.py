"""mixprec.distributed in ONE process (no process group): the helpers degrade to single-process answers,
checkpoints round-trip, guards and refusals are clear. Fast: nothing is spawned."""

from __future__ import annotations

import json

import pytest
import torch

from distributed import scenarios
from mixprec.distributed import (
    DataParallel,
    amax_tensors,
    load_checkpoint,
    mean_across_ranks,
    rank,
    reduce_amax,
    register_amax_reduction,
    save_checkpoint,
    shard_batch,
    should_skip_step,
    world_size,
)
from mixprec.errors import MixprecError
from mixprec.training.optim import AdamW


def test_helpers_without_a_process_group():
    assert (rank(), world_size()) == (0, 1)
    batch = torch.arange(6)
    assert shard_batch(batch) is batch
    assert mean_across_ranks(0.1) == 0.1
    with pytest.raises(MixprecError, match="torchrun"):
        DataParallel("ddp")
    assert DataParallel("none").wrap(model := torch.nn.Linear(2, 2)) is model


def test_nan_guard_sees_loss_and_fp32_gradient_buffers():
    model = scenarios.build("bf16")
    opt = AdamW(model.parameters())
    model(torch.randn(2, scenarios.FEATURES, dtype=torch.bfloat16)).float().sum().backward()
    assert next(model.parameters()).grad is None  # the gradients live in AdamW's fp32 buffers
    assert not should_skip_step(torch.tensor(1.0), opt)
    assert should_skip_step(torch.tensor(float("nan")), opt)
    assert should_skip_step(None, opt, local_flag=True)
    _, g = opt.grads()[0]
    g[0, 0] = float("inf")
    assert should_skip_step(torch.tensor(1.0), opt)


def test_amax_tensors_are_the_current_rows_of_delayed_layers():
    model = scenarios.build("fp8-delayed:history=16")
    rows = amax_tensors(model)
    assert [tuple(t.shape) for t in rows] == [
        (3,),
        (3,),
    ]  # one row (input, weight, grad) per LowPrecisionLinear
    assert rows[0].data_ptr() == model.inp.amax_history[0].data_ptr()
    assert amax_tensors(scenarios.build("fp8-current")) == []
    assert reduce_amax(model) == 0  # one process: nothing to reduce


def test_the_amax_reduction_is_passed_in_or_registered_by_the_wrapping():
    """training does not import distributed: advance() runs the reduction it is given, else the one the
    data-parallel wrapping registered on the model (or on the module a DDP wraps); False runs none."""
    from mixprec.training import advance_scaling_state, scaling_state

    model = scenarios.build("fp8-delayed:history=16")
    calls = []
    assert scaling_state.advance(model, reduce=calls.append) == 2 and calls == [model]
    assert scaling_state.amax_reduction(model) is None
    register_amax_reduction(model)
    assert scaling_state.amax_reduction(model).func is reduce_amax  # all_reduce(MAX), default group
    scaling_state.use_amax_reduction(model, calls.append)
    advance_scaling_state(model)
    assert calls == [model, model]
    advance_scaling_state(model, reduce=False)
    assert calls == [model, model]
    wrapper = torch.nn.Module()
    wrapper.module = model  # how DistributedDataParallel holds the model
    assert scaling_state.amax_reduction(wrapper) is scaling_state.amax_reduction(model)
    scaling_state.use_amax_reduction(model, None)
    assert scaling_state.amax_reduction(model) is None


def _steps(model, opt, start, n):
    from mixprec.training import advance_scaling_state

    losses = []
    for step in range(start, start + n):
        x, y = scenarios.global_batch(step)
        loss = torch.nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        advance_scaling_state(model)
        losses.append(float(loss))
    return losses


def test_checkpoint_round_trip_and_refusals(tmp_path):
    recipe = "fp8-delayed:history=16"
    model = scenarios.build(recipe)
    opt = AdamW(model.parameters(), lr=2e-3)
    _steps(model, opt, 0, 2)
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, model, opt, extra={"step": 2})
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "manifest.json",
        "rank00000.json",
        "rank00000.safetensors",
    ]
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert (manifest["schema_version"], manifest["world_size"], manifest["wrapping"]) == (1, 1, "none")
    expected = _steps(model, opt, 2, 2)

    model2 = scenarios.build(recipe)
    opt2 = AdamW(model2.parameters(), lr=2e-3)
    assert load_checkpoint(ckpt, model2, opt2) == {"step": 2}
    assert opt2.state[model2.inp.weight]["master"].dtype == torch.float32
    assert opt2.state[model2.inp.weight]["exp_avg"].dtype == torch.bfloat16
    assert _steps(model2, opt2, 2, 2) == expected  # bit-identical continuation

    with pytest.raises(MixprecError, match="already exists"):
        save_checkpoint(ckpt, model, opt)
    save_checkpoint(ckpt, model, opt, overwrite=True)
    manifest["world_size"] = 2
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(MixprecError, match="saved by 2 ranks"):
        load_checkpoint(ckpt, model2, opt2)
    with pytest.raises(MixprecError, match=r"no manifest\.json"):
        load_checkpoint(tmp_path, model2, opt2)


def test_fp8_all_gather_refuses_recipes_it_cannot_serve():
    from mixprec.distributed.fp8_all_gather import enable_fp8_all_gather

    for recipe in ("fp8-delayed", "fp8-rowwise", "fp8-blockwise"):
        with pytest.raises(MixprecError, match="fp8-current"):
            enable_fp8_all_gather(scenarios.build(recipe))
    with pytest.raises(MixprecError, match="no LowPrecisionLinear"):
        enable_fp8_all_gather(scenarios.build("bf16"))
    assert enable_fp8_all_gather(scenarios.build("fp8-current")) == 2


def test_batch_must_split_over_ranks():
    from mixprec.commands.torchrun import check_batch

    check_batch(8, 2)
    with pytest.raises(MixprecError, match="multiple of 2"):
        check_batch(5, 2)
