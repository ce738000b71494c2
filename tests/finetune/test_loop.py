"""The fine-tuning loop: a killed run resumed from its state gives the uninterrupted run's numbers; the
distillation loss is KL(teacher ‖ student); refusals come before any step."""

from __future__ import annotations

import pytest
import torch

from inference.inference_helpers import tiny_llama
from mixprec.errors import MixprecError
from mixprec.finetune.loop import LoopSettings, train
from mixprec.finetune.qat import distillation_loss
from mixprec.inference.runtime.online import apply_scheme_

WINDOWS = torch.randint(0, 320, (40, 16), generator=torch.Generator().manual_seed(0))


def _model(scheme: str = "fp8-dynamic"):
    """A quantized tiny llama whose norms train (stand-ins for adapters or QAT masters)."""
    model = tiny_llama(seed=1)
    apply_scheme_(model, scheme)
    for name, p in model.named_parameters():
        p.requires_grad_("norm" in name)
    return model


def _trained(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


class _Killed(Exception):
    pass


def test_resumed_run_equals_the_uninterrupted_one(tmp_path):
    settings = LoopSettings(steps=6, batch_size=2, lr=1e-2, warmup_steps=2, save_every=2)
    whole = _model()
    done = train(whole, WINDOWS, settings, progress=False)
    assert len(done.losses) == 6 and done.resumed_from is None

    state = tmp_path / "state"

    def kill_at_4(k, loss):
        if k == 3:
            raise _Killed

    with pytest.raises(_Killed):
        train(_model(), WINDOWS, settings, state_dir=state, progress=False, on_step=kill_at_4)
    resumed_model = _model()
    resumed = train(resumed_model, WINDOWS, settings, state_dir=state, resume=True, progress=False)
    assert resumed.resumed_from == 2
    assert resumed.losses == done.losses
    after, want = _trained(resumed_model), _trained(whole)
    assert after.keys() == want.keys() and all(torch.equal(after[k], want[k]) for k in want)
    assert any(not torch.equal(want[k], _trained(_model())[k]) for k in want)  # it did train


def test_resume_with_other_settings_is_refused(tmp_path):
    state = tmp_path / "state"
    train(
        _model(), WINDOWS, LoopSettings(steps=2, batch_size=2, save_every=1), state_dir=state, progress=False
    )
    with pytest.raises(MixprecError, match=r"other settings \(lr\)"):
        train(_model(), WINDOWS, LoopSettings(steps=2, batch_size=2, save_every=1, lr=5e-4), state_dir=state,
              resume=True, progress=False)  # fmt: skip


def test_too_little_text_and_nothing_to_train_are_refused():
    with pytest.raises(MixprecError, match=r"40 windows of 16 tokens; 30 steps x batch 2 need 60"):
        train(_model(), WINDOWS, LoopSettings(steps=30, batch_size=2), progress=False)
    frozen = tiny_llama()
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(MixprecError, match="no trainable parameters"):
        train(frozen, WINDOWS, LoopSettings(steps=2, batch_size=2), progress=False)


def test_distillation_with_the_original_as_teacher_lowers_the_kl():
    teacher = tiny_llama(seed=1)
    student = _model("mxfp4a16")  # a gap large enough to close part of
    ids = WINDOWS[:4]
    with torch.no_grad():
        before = float(distillation_loss(student(ids).logits, teacher(ids).logits))
    train(student, WINDOWS, LoopSettings(steps=8, batch_size=4, lr=3e-3, warmup_steps=0), teacher=teacher,
          progress=False)  # fmt: skip
    with torch.no_grad():
        after = float(distillation_loss(student(ids).logits, teacher(ids).logits))
    assert after < before


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    s = LoopSettings(steps=10, lr=1.0, warmup_steps=2)
    assert [s.lr_at(0), s.lr_at(1), s.lr_at(2)] == [0.5, 1.0, 1.0]
    assert s.lr_at(10) == pytest.approx(0.1) and s.lr_at(6) < s.lr_at(3)
