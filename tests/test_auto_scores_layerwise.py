"""`--scheme auto` scored one transformer block at a time (sensitivity/layerwise_scores.py): the same
scores as the whole-model scorer, one block in memory at a time, the head in slices, nothing left on
disk, and the cases it does not take refused or sent to the whole-model scorer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mixprec.sensitivity.layerwise_scores as layerwise_scores
from mixprec.errors import MixprecError
from mixprec.hf import load_model, read_config
from mixprec.inference.checkpoint.safetensors_io import open_checkpoint
from mixprec.sensitivity.automatic import auto_quantize_checkpoint
from mixprec.sensitivity.layerwise_scores import (
    head_cross_entropy_grad,
    layerwise_gradient_scores,
    scoring_skeleton,
)
from mixprec.sensitivity.scores import candidate_schemes, score_model, static_input_amax

transformers = pytest.importorskip("transformers")

VOCAB = 320
CANDIDATES = ["fp8-dynamic", "fp8-static", "nvfp4a16", "nvfp4"]


def _save_llama(directory: Path, *, tied: bool, layers: int = 3, **extra) -> Path:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=64, tie_word_embeddings=tied, **extra,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).eval().to(torch.bfloat16).save_pretrained(directory)
    return directory


def _batches():
    # batches of unequal rows: each sequence's loss weighs 1 / its batch's rows, as in gradient_scores
    return [
        torch.randint(0, VOCAB, (rows, 24), generator=torch.Generator().manual_seed(rows)) for rows in (2, 1)
    ]


def _block_by_block(directory: Path, batches, candidates):
    config, ckpt = read_config(directory), open_checkpoint(directory)
    skel, why = scoring_skeleton(directory, config, ckpt, None, True)
    assert why is None
    return layerwise_gradient_scores(skel, ckpt, batches, candidates, weight_dtype=torch.bfloat16)


@pytest.mark.parametrize("tied", [False, True])
def test_block_by_block_scores_equal_the_whole_models(tmp_path, monkeypatch, tied):
    directory = _save_llama(tmp_path / "llama", tied=tied)
    batches, candidates = _batches(), candidate_schemes(CANDIDATES)
    whole = load_model(directory, dtype=torch.float32).eval()
    want = score_model(whole, batches, candidates, weight_dtype=torch.bfloat16)
    want_amax = static_input_amax(whole, batches, list(want.shapes), candidates)
    monkeypatch.setattr(layerwise_scores, "HEAD_SLICE_BYTES", 4 * 24 * 128 * 3)  # the head in several slices
    loaded: list[int] = []
    load = layerwise_scores._Walk._load

    def one_block_at_a_time(self, i):  # every other block's weights are on the meta device
        loaded.append(i)
        for j, block in enumerate(self.blocks):
            assert j == i or all(p.is_meta for p in block.parameters()), (i, j)
        return load(self, i)

    monkeypatch.setattr(layerwise_scores._Walk, "_load", one_block_at_a_time)
    amax, got = _block_by_block(directory, batches, candidates)
    assert loaded == [0, 1, 2, 2, 1, 0]  # forward, then backward
    assert set(got) == set(want.shapes)
    for name, scores in got.items():
        for cand, value in scores.items():
            assert value == pytest.approx(want.layers[name][cand], rel=1e-5), (name, cand)
            assert value > 0, (name, cand)
    assert amax == pytest.approx(want_amax, rel=1e-6)


def test_the_head_in_slices_gives_cross_entropys_gradient():
    torch.manual_seed(1)
    hidden, weight = torch.randn(37, 16), torch.randn(101, 16)
    targets = torch.randint(0, 101, (37,))
    targets[:3] = torch.tensor([0, 100, 50])  # the first and last rows of the vocabulary
    scale = torch.rand(37)
    h = hidden.clone().requires_grad_(True)
    loss = (torch.nn.functional.cross_entropy(h @ weight.T, targets, reduction="none") * scale).sum()
    loss.backward()
    for slice_bytes in (1, 4 * 37 * 7, 4 * 37 * 101, 1 << 30):  # one row a slice ... the whole head
        got = head_cross_entropy_grad(hidden, targets, scale, lambda a, b: weight[a:b], 101, slice_bytes)
        torch.testing.assert_close(got, h.grad, rtol=1e-5, atol=1e-6)


def test_nothing_is_left_in_the_spill_directory(tmp_path):
    directory = _save_llama(tmp_path / "llama", tied=False, layers=2)
    config, ckpt = read_config(directory), open_checkpoint(directory)
    skel, _ = scoring_skeleton(directory, config, ckpt, None, True)
    spill = tmp_path / "spill"
    spill.mkdir()
    layerwise_gradient_scores(skel, ckpt, _batches(), candidate_schemes(["fp8-dynamic"]),
                              weight_dtype=torch.bfloat16, spill_dir=spill)  # fmt: skip
    assert list(spill.iterdir()) == []


def test_models_it_does_not_take_are_refused_or_scored_whole(tmp_path, monkeypatch):
    capped = _save_llama(tmp_path / "capped", tied=False, layers=2)
    cfg = json.loads((capped / "config.json").read_text())
    (capped / "config.json").write_text(json.dumps({**cfg, "final_logit_softcapping": 30.0}))
    _, why = scoring_skeleton(capped, read_config(capped), open_checkpoint(capped), None, True)
    assert "final_logit_softcapping" in why
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(f"word{i}" for i in range(400)))
    (capped / "tokenizer.json").write_text(_tokenizer_json())
    kw = dict(budget="12", calib_data=calib, calib_samples=2, calib_seq_len=16, candidates=["fp8-dynamic"],
              progress=False)  # fmt: skip
    with pytest.raises(MixprecError, match=r"final_logit_softcapping.*--no-layer-by-layer"):
        auto_quantize_checkpoint(capped, tmp_path / "out", layer_by_layer=True, **kw)
    with pytest.raises(MixprecError, match="kl score runs on the whole model"):
        auto_quantize_checkpoint(capped, tmp_path / "out", layer_by_layer=True, score="kl", **kw)
    # by default, even where the memory rule asks for the walk, such a model is scored whole, as before
    import mixprec.sensitivity.automatic as automatic

    walks: list = []
    walk = automatic.layerwise_gradient_scores
    monkeypatch.setattr(automatic, "_whole_model_fits", lambda model_dir: False)
    monkeypatch.setattr(
        automatic, "layerwise_gradient_scores", lambda *a, **k: walks.append(1) or walk(*a, **k)
    )
    result = auto_quantize_checkpoint(capped, tmp_path / "out", **kw)
    assert result.allocation.bits_per_weight <= 12 and walks == []
    # and a model it takes is scored block by block by that rule, without --layer-by-layer
    plain = _save_llama(tmp_path / "plain", tied=False, layers=2)
    (plain / "tokenizer.json").write_text(_tokenizer_json())
    auto_quantize_checkpoint(plain, tmp_path / "out-plain", **kw)
    assert walks == [1]


def _tokenizer_json() -> str:
    from mixprec.data import train_bpe_tokenizer

    return train_bpe_tokenizer([" ".join(f"word{i}" for i in range(400))] * 4, vocab_size=VOCAB).to_str()


def test_the_cli_scores_block_by_block_and_writes_the_whole_model_runs_checkpoint(tmp_path, capsys):
    from mixprec.cli import main

    directory = _save_llama(tmp_path / "llama", tied=False, layers=2)
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(f"word{i}" for i in range(400)))
    (directory / "tokenizer.json").write_text(_tokenizer_json())
    whole = auto_quantize_checkpoint(directory, tmp_path / "whole", budget="9", calib_data=calib, calib_samples=3,
                                     calib_seq_len=16, candidates=["fp8-dynamic", "nvfp4a16"], progress=False,
                                     layer_by_layer=False)  # fmt: skip
    args = ["quantize", "--model", str(directory), "--output", str(tmp_path / "blocks"), "--scheme", "auto",
            "--budget", "9", "--calib-data", str(calib), "--calib-samples", "3", "--calib-seq-len", "16",
            "--candidates", "fp8-dynamic", "nvfp4a16", "--layer-by-layer", "--json"]  # fmt: skip
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {n: e["chosen"] for n, e in doc["layers"].items()} == whole.allocation.layers
    for name, entry in doc["layers"].items():
        for cand, value in entry["scores"].items():
            assert value == pytest.approx(whole.scores.layers[name][cand], rel=1e-5), (name, cand)
    same = (tmp_path / "whole" / "model.safetensors").read_bytes() == (
        tmp_path / "blocks" / "model.safetensors"
    ).read_bytes()
    assert same


def test_gptq_candidates_block_by_block_equal_the_whole_models(tmp_path):
    directory = _save_llama(tmp_path / "llama", tied=False, layers=2)
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(f"word{i}" for i in range(400)))
    (directory / "tokenizer.json").write_text(_tokenizer_json())
    kw = dict(budget="7", calib_data=calib, calib_samples=4, calib_seq_len=32, candidates=["fp8-dynamic", "nvfp4a16"],
              progress=False, algorithm="gptq")  # fmt: skip
    with pytest.warns(UserWarning, match="fewer calibration tokens"):
        whole = auto_quantize_checkpoint(directory, tmp_path / "whole", layer_by_layer=False, **kw)
        blocks = auto_quantize_checkpoint(directory, tmp_path / "blocks", layer_by_layer=True, **kw)
    assert blocks.allocation.layers == whole.allocation.layers
    for name, scores in blocks.scores.layers.items():
        for cand, value in scores.items():
            assert value == pytest.approx(whole.scores.layers[name][cand], rel=1e-5), (name, cand)
    same = (tmp_path / "whole" / "model.safetensors").read_bytes() == (
        tmp_path / "blocks" / "model.safetensors"
    ).read_bytes()
    assert same
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "blocks",
        "calib.txt",
        "llama",
        "whole",
    ]  # no spill left
