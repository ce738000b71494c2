"""The folds streamed over a checkpoint: the rotation (algorithms/rotation_checkpoint.py) and AWQ
(algorithms/fold_checkpoint.py), bit for bit what rotate_model_ / awq_model_ give the loaded model, one
block in memory at a time, refused before anything is written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import mixprec.inference.algorithms.block_rewrite as block_rewrite
import mixprec.inference.algorithms.rotation as rotation
import mixprec.inference.algorithms.rotation_checkpoint as rotation_checkpoint
from mixprec.errors import MixprecError
from mixprec.inference.algorithms.awq import awq_model_
from mixprec.inference.algorithms.fold_checkpoint import awq_checkpoint
from mixprec.inference.algorithms.rotation import rotate_model_
from mixprec.inference.algorithms.rotation_checkpoint import rotate_checkpoint

transformers = pytest.importorskip("transformers")


def _save_llama(directory, *, tied: bool, hidden: int, heads: int):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=320, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3,
        num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=64,
        tie_word_embeddings=tied,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms that are not all ones, so that folding them matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.to(torch.bfloat16).save_pretrained(directory)
    return directory


def _tensors(directory):
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize(("tied", "hidden", "heads"), [(False, 128, 4), (True, 96, 6)])
def test_streamed_rotation_equals_rotate_model_bit_for_bit(tmp_path, monkeypatch, tied, hidden, heads):
    src = _save_llama(tmp_path / "src", tied=tied, hidden=hidden, heads=heads)
    monkeypatch.setattr(rotation, "CHUNK_ROWS", 100)  # the embedding and head in four chunks, both ways
    monkeypatch.setattr(rotation_checkpoint, "CHUNK_ROWS", 100)
    loaded_blocks: list[set[str]] = []
    load = rotation_checkpoint.load_into

    def one_block_at_a_time(model, ckpt, names, reader, renamed=None):
        blocks = {n.split(".")[2] for n in names if n.startswith("model.layers.")}
        resident = {
            n.split(".")[2]
            for n, p in model.named_parameters()
            if n.startswith("model.layers.") and not p.is_meta
        }
        assert len(blocks | resident) <= 1, (blocks, resident)
        loaded_blocks.append(blocks)
        return load(model, ckpt, names, reader, renamed)

    monkeypatch.setattr(rotation_checkpoint, "load_into", one_block_at_a_time)  # the final norm
    monkeypatch.setattr(block_rewrite, "load_into", one_block_at_a_time)  # each block
    out = tmp_path / "rotated"
    out.mkdir()
    record = rotate_checkpoint(src, out, seed=3)
    assert [b for b in loaded_blocks if b] == [{"0"}, {"1"}, {"2"}]

    model = transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    want = rotate_model_(model, seed=3)
    want.pop("matrices")
    assert record == want and record["untied_lm_head"] is tied
    got = _tensors(out)
    expected = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    assert set(got) == set(expected)
    for name, tensor in got.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name]), name
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert (out / "generation_config.json").exists()


def test_a_tensor_the_rotation_does_not_know_is_refused_before_anything_is_written(tmp_path):
    src = _save_llama(tmp_path / "src", tied=False, hidden=128, heads=4)
    tensors = load_file(str(src / "model.safetensors"))
    save_file(
        {**tensors, "model.extra_scale": torch.ones(4)},
        str(src / "model.safetensors"),
        metadata={"format": "pt"},
    )
    out = tmp_path / "rotated"
    out.mkdir()
    with pytest.raises(MixprecError, match=r"does not know: model\.extra_scale"):
        rotate_checkpoint(src, out)
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("scheme", ["nvfp4a16", "fp8-dynamic"])
def test_streamed_awq_equals_awq_model_bit_for_bit(tmp_path, scheme):
    src = _save_llama(tmp_path / "src", tied=True, hidden=128, heads=4)
    batches = [torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    model = transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    schemes = {
        n: scheme for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
    }
    out = tmp_path / "folded"
    out.mkdir()
    record = awq_checkpoint(src, out, batches, schemes, n_grid=4)
    want = awq_model_(model, batches, schemes, n_grid=4)
    assert record["mappings"] == want["mappings"] and record["skipped"] == want["skipped"]
    assert record["folded"] > 0
    got = _tensors(out)
    expected = {n: p.detach() for n, p in model.named_parameters()}
    assert set(got) == set(expected)
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name


def test_streamed_awq_refuses_before_writing(tmp_path):
    src = _save_llama(tmp_path / "src", tied=False, hidden=128, heads=4)
    out = tmp_path / "folded"
    out.mkdir()
    batches = [torch.randint(0, 320, (2, 32))]
    with pytest.raises(MixprecError, match="none of them is among"):
        awq_checkpoint(src, out, batches, {"lm_head": "nvfp4a16"})
    with pytest.raises(MixprecError, match="n_grid"):
        awq_checkpoint(src, out, batches, {"model.layers.0.mlp.up_proj": "nvfp4a16"}, n_grid=0)
    assert list(out.iterdir()) == []


def test_streamed_smoothquant_equals_smoothquant_model_bit_for_bit(tmp_path):
    from mixprec.inference.algorithms.fold_checkpoint import smoothquant_checkpoint
    from mixprec.inference.algorithms.smoothquant import smoothquant_model_

    src = _save_llama(tmp_path / "src", tied=False, hidden=128, heads=4)
    batches = [torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    out = tmp_path / "folded"
    out.mkdir()
    record = smoothquant_checkpoint(src, out, batches, alpha=0.6)
    model = transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    want = smoothquant_model_(model, batches, alpha=0.6)
    assert record["mappings"] == want["mappings"] and record["skipped"] == want["skipped"]
    got = _tensors(out)
    expected = {n: p.detach() for n, p in model.named_parameters()}
    assert set(got) == set(expected)
    changed = 0
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name
        changed += not torch.equal(tensor, _tensors(src)[name])
    assert changed > 0  # it did smooth something
