"""QAT and LoRA over quantized layers under transformers.Trainer (with MixprecTrainerCallback and mixprec's
AdamW): the Trainer's own loop trains them, and what it trained is what is served."""

from __future__ import annotations

import warnings

import pytest
import torch

from inference.inference_helpers import VOCAB, tiny_llama
from mixprec.finetune.qat import convert_qat_, prepare_qat_
from mixprec.inference.producers.save import save_quantized
from mixprec.inference.readers.load import load_quantized
from mixprec.inference.runtime.linear import QuantizedLinear
from mixprec.inference.runtime.online import apply_scheme_
from mixprec.training import MixprecTrainerCallback
from mixprec.training.optim import AdamW

transformers = pytest.importorskip("transformers")

CALIB = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(2))
IDS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


class Windows(torch.utils.data.Dataset):
    """Repeating token patterns: learnable in a few steps."""

    def __init__(self, n: int = 32, length: int = 16) -> None:
        starts = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(0))
        self.rows = (starts + torch.arange(length)) % VOCAB

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _train(model, tmp_path, steps: int = 4):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=4, max_steps=steps, learning_rate=3e-3,
        max_grad_norm=1.0, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    trainable = [p for p in model.parameters() if p.requires_grad]
    callback = MixprecTrainerCallback()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Windows(),
                                   optimizers=(AdamW(trainable, lr=3e-3), None), callbacks=[callback])  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == steps and callback.last_grad_norm is not None
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("scheme", ["nvfp4a16", "fp8-static"])
def test_qat_under_the_trainer_serves_what_it_trained(scheme, tmp_path):
    model = tiny_llama()
    prepare_qat_(model, scheme, calib_data=CALIB)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    losses = _train(model, tmp_path)
    assert losses[-1] < losses[0]
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)
    model.eval()
    with torch.no_grad():
        trained = model(IDS).logits
    convert_qat_(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_quantized(model, tmp_path / "q")
    with torch.no_grad():
        assert torch.equal(load_quantized(tmp_path / "q")(IDS).logits, trained)


def test_lora_over_a_quantized_model_under_the_trainer(tmp_path):
    pytest.importorskip("peft")
    from mixprec.finetune.lora import add_lora

    model = tiny_llama()
    apply_scheme_(model, "fp8-dynamic")
    for p in model.parameters():
        p.requires_grad_(False)
    payloads = [b.clone() for b in model.buffers() if b.dtype == torch.float8_e4m3fn]  # peft renames them
    torch.manual_seed(0)
    lora = add_lora(model, r=4, lora_alpha=8, target_modules="all-linear")
    adapters = {n: p.detach().clone() for n, p in lora.named_parameters() if p.requires_grad}
    assert adapters and any(isinstance(m, QuantizedLinear) for m in lora.modules())
    losses = _train(lora, tmp_path)
    assert losses[-1] < losses[0]
    moved = [n for n, p in lora.named_parameters() if n in adapters and not torch.equal(p, adapters[n])]
    assert moved  # the adapters trained (lora_B starts at zero: it moves first)
    after = [b for b in model.buffers() if b.dtype == torch.float8_e4m3fn]
    assert len(after) == len(payloads) > 0 and all(map(torch.equal, payloads, after))  # frozen payloads
