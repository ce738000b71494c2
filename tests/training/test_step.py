"""TrainingStep's two halves (accumulate, then step), a skipped step, and a step without an optimizer:
the loop the comparison run and the sensitivity profile are written around."""

from __future__ import annotations

import torch
from torch import nn

from mixprec.training import TrainingStep, convert_for_training
from mixprec.training.optim import AdamW


def _model(recipe: str = "fp8-delayed:history=4") -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    convert_for_training(model, recipe)
    return model


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return model(x).float().pow(2).mean()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_accumulate_says_when_a_step_is_due():
    model = _model()
    step = TrainingStep(model, AdamW(model.parameters(), lr=1e-3), grad_accumulation_steps=3)
    assert [step.accumulate(_loss(model, i)) for i in range(6)] == [False, False, True] * 2
    assert step.steps == 0  # accumulate never steps by itself


def test_a_skipped_step_moves_nothing_and_still_advances_the_scaling_state():
    model = _model()
    step = TrainingStep(model, AdamW(model.parameters(), lr=1e-2), max_grad_norm=1.0)
    before = _params(model)
    assert step.accumulate(_loss(model, 0))
    assert step.step(skip=True) == {"skipped": True}
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert int(model[0].scaling_step) == 1  # once per step, skipped or not
    step.accumulate(_loss(model, 1))
    info = step.step()
    assert set(info) == {"grad_norm"} and int(model[0].scaling_step) == 2
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_without_an_optimizer_the_step_only_zeroes_the_gradients():
    """What the sensitivity profile runs at lr 0: passes that measure and move nothing."""
    model = _model("bf16")
    before = _params(model)
    step = TrainingStep(model, None)
    for i in range(2):
        assert step.backward(_loss(model, i)) == {}
        assert all(p.grad is None for p in model.parameters())
    assert step.steps == 2
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
