"""Inputs for calibrating and checking an ONNX graph: .npz arrays, text through a tokenizer, or synthetic.

- `.npz`: one array per graph input name; the first axis is split into batches.
- text (.txt, folder of .txt/.md, .jsonl with "text"): for a graph whose inputs are `input_ids` and
  optionally `attention_mask` (what export-onnx writes), or one integer input of any name; tokenized
  with --tokenizer DIR, or the tokenizer of the model the graph was exported from (export-onnx records
  that directory in the graph's metadata), into full blocks of seq_len tokens (mask all ones).
- synthetic (no data given, for the check only): `attention_mask` all ones, other integer inputs drawn
  uniformly from the vocabulary of the embedding table they index (or 0..1), float inputs standard
  normal; batch 2, sequence 16.

A .npz without an `attention_mask` array, for a graph that takes one, gets a mask of ones (no padding).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from mixprec.errors import MixprecError
from mixprec.hf import lm_blocks, text_tokenizer
from mixprec.onnx.common import MAX_POSITIONS_KEY
from mixprec.texts import read_texts

_INT_TYPES = {6: np.int32, 7: np.int64}  # onnx.TensorProto.INT32 / INT64
_FLOAT_TYPES = {1: np.float32, 10: np.float16, 11: np.float64}
MASK = "attention_mask"  # 1 = a real token, 0 = padding; all ones when the data has no padding


def _graph_inputs(model) -> list:
    inits = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def _metadata(model, key: str) -> str | None:
    return next((p.value for p in model.metadata_props if p.key == key), None)


def load_calib_inputs(
    spec: str | os.PathLike,
    model,
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    samples: int = 32,
    seq_len: int = 64,
    batch_size: int = 4,
) -> list[dict[str, np.ndarray]]:
    """Feeds (input name -> array) for a graph from a .npz file or a text corpus."""
    p = Path(spec)
    if not p.exists():
        raise MixprecError(f"calibration data {p} does not exist")
    check_counts(samples, seq_len, batch_size)
    inputs = _graph_inputs(model)
    mask_input = next((i for i in inputs if i.name == MASK), None)
    positions = _metadata(model, MAX_POSITIONS_KEY)
    if positions is not None and positions.isdigit() and p.suffix != ".npz" and seq_len > int(positions):
        raise MixprecError(
            f"--calib-seq-len {seq_len} is longer than the {positions} positions of the model this graph "
            "was exported from"
        )
    if p.suffix == ".npz":
        try:
            arrays = dict(np.load(p, allow_pickle=False))
        except Exception as exc:
            raise MixprecError(f"calibration data {p} is not a readable .npz file: {exc}") from None
        if mask_input is not None and MASK not in arrays:
            first = next((arrays[i.name] for i in inputs if i.name in arrays and i is not mask_input), None)
            if first is not None and first.ndim == 2:
                arrays[MASK] = np.ones(first.shape, dtype=_INT_TYPES.get(_elem_type(mask_input), np.int64))
        missing = [i.name for i in inputs if i.name not in arrays]
        if missing:
            raise MixprecError(
                f"calibration data {p} lacks arrays for graph inputs {missing} (has {sorted(arrays)})"
            )
        n = min(len(arrays[i.name]) for i in inputs)
        n = min(n, samples)
        if n == 0:
            raise MixprecError(f"calibration data {p} holds no samples")
        return [{i.name: arrays[i.name][s : s + batch_size] for i in inputs} for s in range(0, n, batch_size)]
    ids_inputs = [i for i in inputs if i is not mask_input]
    if len(ids_inputs) != 1 or any(_elem_type(i) not in _INT_TYPES for i in inputs):
        raise MixprecError(
            f"text calibration data needs a graph whose inputs are input_ids (and {MASK}); this one has "
            f"{[i.name for i in inputs]}: give a .npz file with one array per input instead"
        )
    ids_input = ids_inputs[0]
    source = tokenizer_dir or _metadata(model, "mixprec.source_model")
    if source is None:
        raise MixprecError(
            "text calibration data needs --tokenizer DIR (the graph does not say which model it came from)"
        )
    docs = list(read_texts(p, what="calibration data").documents)
    tok = text_tokenizer(Path(source), model_vocab=256)
    blocks = lm_blocks(docs, tok, seq_len, samples).numpy().astype(_INT_TYPES[_elem_type(ids_input)])
    feeds = []
    for s in range(0, blocks.shape[0], batch_size):
        feed = {ids_input.name: blocks[s : s + batch_size]}
        if mask_input is not None:  # full blocks of text: no padding
            feed[MASK] = np.ones(feed[ids_input.name].shape, dtype=_INT_TYPES[_elem_type(mask_input)])
        feeds.append(feed)
    return feeds


def check_counts(samples: int, seq_len: int, batch_size: int = 1) -> None:
    """The calibration counts, checked before anything is loaded."""
    if samples < 1:
        raise MixprecError(f"--calib-samples {samples}: at least 1 sample is needed")
    if seq_len < 2:
        raise MixprecError(f"--calib-seq-len {seq_len}: at least 2 tokens are needed")
    if batch_size < 1:
        raise MixprecError(f"batch size {batch_size}: at least 1 is needed")


def _elem_type(inp) -> int:
    return inp.type.tensor_type.elem_type


def _vocab_for(model, input_name: str) -> int:
    """Rows of the embedding table a Gather indexes with this input (the valid id range)."""
    inits = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if (
            node.op_type == "Gather"
            and len(node.input) > 1
            and node.input[1] == input_name
            and node.input[0] in inits
        ):
            return int(inits[node.input[0]].dims[0])
    return 2


def synthetic_inputs(
    model, batch: int = 2, seq_len: int = 16, count: int = 2, seed: int = 0
) -> list[dict[str, np.ndarray]]:
    """Random feeds matching the graph's inputs (symbolic dims -> batch, then seq_len)."""
    rng = np.random.default_rng(seed)
    feeds = []
    for _ in range(count):
        feed = {}
        for inp in _graph_inputs(model):
            tt = inp.type.tensor_type
            dims = []
            for k, d in enumerate(tt.shape.dim):
                dims.append(d.dim_value if d.dim_value > 0 else (batch if k == 0 else seq_len))
            if tt.elem_type in _INT_TYPES and inp.name == MASK:
                feed[inp.name] = np.ones(dims, dtype=_INT_TYPES[tt.elem_type])
            elif tt.elem_type in _INT_TYPES:
                feed[inp.name] = rng.integers(0, _vocab_for(model, inp.name), size=dims).astype(
                    _INT_TYPES[tt.elem_type]
                )
            elif tt.elem_type in _FLOAT_TYPES:
                feed[inp.name] = rng.standard_normal(dims).astype(_FLOAT_TYPES[tt.elem_type])
            else:
                raise MixprecError(
                    f"cannot make synthetic data for input {inp.name} (type {tt.elem_type}): give inputs"
                )
        feeds.append(feed)
    return feeds


__all__ = ["MASK", "check_counts", "load_calib_inputs", "synthetic_inputs"]
