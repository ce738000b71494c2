"""A converted tiny Llama trains under transformers.Trainer with MixprecTrainerCallback (CPU, no download)."""

from __future__ import annotations

import pytest
import torch

import mixprec
from mixprec.training import MixprecTrainerCallback
from mixprec.training.optim import AdamW

transformers = pytest.importorskip("transformers")


class TokenStream(torch.utils.data.Dataset):
    """A tiny in-memory dataset of repeating token patterns (learnable in a few steps)."""

    def __init__(self, n=32, length=16, vocab=64):
        g = torch.Generator().manual_seed(0)
        starts = torch.randint(0, vocab, (n, 1), generator=g)
        self.rows = (starts + torch.arange(length)) % vocab

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def tiny_llama():
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("recipe", ["fp8-delayed"])  # bf16 runs the same path without scaling state
def test_trainer_trains_and_advances_once_per_optimizer_step(tmp_path, recipe):
    model = tiny_llama()
    mixprec.convert_for_training(model, recipe)
    calls = []
    if recipe.startswith("fp8"):
        import mixprec.training.scaling_state as ss

        real = ss.advance
        ss_patch = pytest.MonkeyPatch()
        ss_patch.setattr(ss, "advance", lambda m, **kw: (calls.append(1), real(m, **kw)))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=6,
        learning_rate=3e-3,
        max_grad_norm=1.0,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    callback = MixprecTrainerCallback()
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=TokenStream(),
        optimizers=(AdamW(model.parameters(), lr=3e-3), None),
        callbacks=[callback],
    )
    result = trainer.train()
    if recipe.startswith("fp8"):
        ss_patch.undo()
        assert len(calls) == 6
    assert trainer.state.global_step == 6
    assert callback.advances == 6  # once per optimizer step, not per micro-batch (12 micro-batches)
    assert callback.last_grad_norm is not None and callback.last_grad_norm > 0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]
    assert result.training_loss == result.training_loss  # not NaN
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
