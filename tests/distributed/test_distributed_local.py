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


def test_the_amax_reduction_is_passed_in_never_registered():
    """training does not import distributed: advance() runs the reduction it is given, and only that one
    (nothing is registered on the model); TrainingStep takes it from the data-parallel object."""
    from mixprec.training import TrainingStep, advance_scaling_state, scaling_state

    model = scenarios.build("fp8-delayed:history=16")
    calls = []
    assert scaling_state.advance(model, reduce=calls.append) == 2 and calls == [model]
    advance_scaling_state(model)
    advance_scaling_state(model, reduce=False)
    assert calls == [model]
    assert not hasattr(scaling_state, "use_amax_reduction")
    dp = DataParallel("none")
    step = TrainingStep(model, AdamW(model.parameters()), parallel=dp)
    assert step.reduce == dp.reduce_amax  # bound into the step
    assert TrainingStep(model, AdamW(model.parameters()), parallel=dp, reduce=False).reduce is False


class FakeParallel:
    """A data-parallel double: says what the other ranks would say, and records what the step asks."""

    def __init__(self, others_skip: bool) -> None:
        self.others_skip = others_skip
        self.asked: list[tuple] = []

    def shard(self, batch):
        return batch[: len(batch) // 2]

    def skip(self, loss=None, optimizer=None, *, local_flag=False):
        self.asked.append(("skip", local_flag))
        return local_flag or self.others_skip

    def reduce_amax(self, model):
        self.asked.append(("reduce", model))

    def clip(self, model, optimizer, max_norm):
        self.asked.append(("clip", max_norm))
        return torch.tensor(0.5)


@pytest.mark.parametrize("others_skip", [False, True])
def test_the_training_step_takes_sharding_skips_clipping_and_reduction_from_the_parallel_object(
    others_skip,
):
    from mixprec.training import TrainingStep

    model = scenarios.build("fp8-delayed:history=16")
    before = [p.detach().clone() for p in model.parameters()]
    parallel = FakeParallel(others_skip)
    step = TrainingStep(model, AdamW(model.parameters(), lr=1e-2), max_grad_norm=1.0, parallel=parallel)
    x, y = scenarios.global_batch(0)
    assert step.shard(x).shape[0] == x.shape[0] // 2
    loss = torch.nn.functional.mse_loss(model(step.shard(x).to(torch.bfloat16)).float(), step.shard(y))
    info = step.backward(loss)
    moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert int(model.inp.scaling_step) == 1  # the scaling state advances, skipped or not
    if others_skip:  # another rank saw a NaN: this one skips too, though its own step was fine
        assert info == {"skipped": True} and not moved
        assert parallel.asked == [("skip", False), ("reduce", model)]
    else:
        assert info == {"grad_norm": 0.5} and moved
        assert parallel.asked == [("skip", False), ("clip", 1.0), ("reduce", model)]
    assert all(p.grad is None for p in model.parameters())


def test_the_training_step_refuses_what_is_no_parallel_object():
    from mixprec.training import TrainingStep

    model = scenarios.build("bf16")
    with pytest.raises(MixprecError, match="shard, skip, reduce_amax and clip"):
        TrainingStep(model, AdamW(model.parameters()), parallel=object())


def test_one_sharding_rule_contiguous_slices(monkeypatch):
    """shard_batch is the rule every loop uses (DataParallel.shard, TrainingStep.shard, the comparison):
    rank r of N takes rows r*B/N .. (r+1)*B/N; in one process the batch itself."""
    from mixprec.distributed import world

    batch = torch.arange(8)
    assert DataParallel("none").shard(batch) is batch
    monkeypatch.setattr(world, "world_size", lambda group=None: 4)
    monkeypatch.setattr(world, "rank", lambda group=None: 1)
    assert DataParallel("none").shard(batch).tolist() == [2, 3]
    with pytest.raises(MixprecError, match="multiple of 4"):
        shard_batch(torch.arange(6))


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
