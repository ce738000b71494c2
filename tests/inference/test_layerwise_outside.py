"""The layer-by-layer walk reads of the parts outside the transformer blocks only what the forward runs
before the first block, and of the input embedding only the rows of the calibration tokens
(calibration/outside.py): the first block's inputs equal, bit for bit, those the whole model (loaded by
transformers) gives it; the head and the final norm are never read (a spy on the reader)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from inference_helpers import VOCAB, tiny_llama

from mixprec.errors import MixprecError
from mixprec.inference.calibration import layerwise
from mixprec.inference.calibration.outside import OutsideLoader
from mixprec.inference.checkpoint.safetensors_io import ShardReader, open_checkpoint

transformers = pytest.importorskip("transformers")


def _tiny_gemma3():
    """Gemma 3 text: tied embeddings scaled by sqrt(hidden) inside the embedding module."""
    torch.manual_seed(1)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=128, sliding_window=16,
    )  # fmt: skip
    return transformers.Gemma3ForCausalLM(cfg).eval()


MODELS = {
    "llama": lambda: tiny_llama(seed=5),
    "llama-tied": lambda: tiny_llama(seed=6, tie_word_embeddings=True),
    "llama-bf16": lambda: tiny_llama(seed=7).to(torch.bfloat16),
    "gemma3-scaled": _tiny_gemma3,
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def saved(request, tmp_path_factory) -> tuple[str, Path]:
    d = tmp_path_factory.mktemp(request.param) / "model"
    MODELS[request.param]().save_pretrained(d)
    return request.param, d


def _batches(seed: int = 3) -> list[torch.Tensor]:
    """Two batches using a scattered subset of the vocabulary (runs of consecutive ids and gaps)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.cat(
        [torch.arange(5, 12), torch.randperm(VOCAB, generator=g)[:20], torch.tensor([VOCAB - 1])]
    )
    return [pool[torch.randint(0, len(pool), (2, 12), generator=g)] for _ in range(2)]


def _reference_inputs(directory: Path, batches: list[torch.Tensor]) -> list[tuple[tuple, dict]]:
    """The first block's (args, kwargs) per batch from the whole model loaded by transformers."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    captured = []

    def hook(_m, args, kwargs):
        captured.append((args, kwargs))
        raise StopIteration

    model.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        for b in batches:
            with contextlib.suppress(StopIteration):
                model(input_ids=b, use_cache=False)
    return captured


def _walk_inputs(directory: Path, batches: list[torch.Tensor]):
    config = json.loads((directory / "config.json").read_text())
    ckpt = open_checkpoint(directory)
    model, prefix, blocks, _, _ = layerwise.skeleton(directory, config, ckpt, [])
    with ShardReader() as reader, torch.no_grad():
        outside = OutsideLoader(model, ckpt, reader, prefix, batches)
        captured = layerwise.block_inputs(model, blocks[0], batches)
        outside.remove()
    return captured, outside


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def test_first_block_inputs_equal_the_whole_models_bit_for_bit(saved):
    name, directory = saved
    batches = _batches()
    got, outside = _walk_inputs(directory, batches)
    ref = _reference_inputs(directory, batches)
    assert outside.embedding is not None  # the compact path ran, not the whole-load fallback
    assert outside.embedding.weight.shape[0] == len(torch.unique(torch.cat([b.flatten() for b in batches])))
    assert len(got) == len(ref) == len(batches)
    for (a_args, a_kw), (r_args, r_kw) in zip(got, ref, strict=True):
        assert a_kw.keys() == r_kw.keys()
        pairs = [(a_args, r_args)] + [(a_kw[k], r_kw[k]) for k in r_kw]
        for a, r in pairs:
            ta, tr = _tensors(a), _tensors(r)
            assert len(ta) == len(tr)
            for x, y in zip(ta, tr, strict=True):
                assert x.dtype == y.dtype and torch.equal(x, y), name
    hidden = got[0][0][0]
    assert hidden.abs().sum() > 0


def test_head_and_final_norm_never_read_and_only_the_tokens_embedding_rows(saved, monkeypatch):
    name, directory = saved
    reads: list[tuple[str, int, int]] = []
    real = ShardReader.read_range

    def spy(self, info, start, out):
        reads.append((info.name, start, len(out)))
        return real(self, info, start, out)

    monkeypatch.setattr(ShardReader, "read_range", spy)
    ckpt = open_checkpoint(directory)
    config = json.loads((directory / "config.json").read_text())
    batches = _batches(seed=4)
    layerwise.calibrate_layerwise(directory, config, ckpt, batches, ["model.layers.1.mlp.down_proj"])
    names = {n for n, _, _ in reads}
    assert "model.norm.weight" in ckpt.tensors and "model.norm.weight" not in names
    assert "lm_head.weight" not in names  # untied: stored, never read; tied: not stored
    assert ("lm_head.weight" in ckpt.tensors) == (name in ("llama", "llama-bf16"))
    emb = ckpt.tensors["model.embed_tokens.weight"]
    row = emb.nbytes // emb.shape[0]
    rows = set()
    for n, start, size in reads:
        if n == emb.name:
            assert start % row == 0 and size % row == 0
            rows.update(range(start // row, (start + size) // row))
    assert rows == set(torch.cat([b.flatten() for b in batches]).tolist())
    # every block tensor is read, whole
    for info in ckpt.tensors.values():
        if info.name.startswith("model.layers."):
            assert sum(s for n, _, s in reads if n == info.name) == info.nbytes


def test_get_rows_reads_the_rows_asked(tmp_path):
    from safetensors.torch import save_file

    t = torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6)
    save_file({"t": t}, str(tmp_path / "x.safetensors"))
    ckpt = open_checkpoint(tmp_path)
    rows = torch.tensor([0, 1, 2, 7, 9, 10, 39])
    with ShardReader() as reader:
        got = reader.get_rows(ckpt.tensors["t"], rows)
    assert torch.equal(got, t[rows])


def test_token_outside_the_vocabulary_refused_before_any_block(saved):
    _name, directory = saved
    with pytest.raises(MixprecError, match=f"token id {VOCAB + 3} lies outside"):
        _walk_inputs(directory, [torch.tensor([[1, 2, VOCAB + 3]])])
