"""The parts of a model outside its transformer blocks, for the layer-by-layer walk (layerwise.py):
read only what the forward runs before the first block, and of the input embedding only the rows the
calibration tokens use.

- The input embedding (an nn.Embedding, the model's own module: a scaled embedding such as Gemma's keeps
  its multiplier) gets a compact weight holding the rows of the tokens in the batches, sorted, read
  from the checkpoint by row (ShardReader.get_rows); a pre-hook maps each token id to its row in the
  compact table. The gathered rows are the same values, so the first block's inputs are bit-identical
  to those of the whole embedding.
- Every other module outside the blocks loads its own tensors from the checkpoint the first time it is
  called. The capture forward stops at the first block, so what runs after the blocks (the final norm,
  the output head) is never read; what runs before them (position embeddings, an embedding norm) is
  read whole, when it runs. Rotary tables are buffers the skeleton computes itself.
- A model whose input embedding is not an nn.Embedding found in the checkpoint loads everything outside
  its blocks whole, as the walk did before.

Memory outside the blocks: distinct tokens x hidden x the embedding's dtype, plus what runs before the
first block (nothing else for Llama-style models), instead of the embeddings and head whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.inference.checkpoint.safetensors_io import Checkpoint, ShardReader
from mixprec.ranks import world_size


def load_into(model: nn.Module, ckpt: Checkpoint, names: list[str], reader: ShardReader,
              renamed: Mapping[str, str] | None = None) -> None:  # fmt: skip
    """Load the checkpoint tensors `names` into `model` (by state-dict name, taking their storage);
    renamed: {checkpoint key: state-dict key} where the model names a tensor differently."""
    renamed = renamed or {}
    sd = {renamed.get(n, n): reader.get(ckpt.tensors[n]) for n in names}
    model.load_state_dict(sd, strict=False, assign=True)


def token_rows(batches: Sequence[torch.Tensor]) -> torch.Tensor:
    """The distinct token ids of the batches, sorted (int64); none for no batch (a rank whose share of
    a run split across ranks is empty still walks the blocks)."""
    if not batches:
        return torch.empty(0, dtype=torch.int64)
    return torch.unique(torch.cat([b.reshape(-1) for b in batches]).to(torch.int64), sorted=True)


def input_embedding(model: nn.Module, ckpt: Checkpoint) -> tuple[nn.Embedding, str] | None:
    """(the model's input embedding, its weight's checkpoint name), or None when it is not an
    nn.Embedding whose [vocabulary, hidden] weight the checkpoint holds (under its name or a tied alias)."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
    if not isinstance(emb, nn.Embedding):
        return None
    names = [f"{n}.weight" for n, m in model.named_modules(remove_duplicate=False) if m is emb]
    names += [n for n, p in model.named_parameters(remove_duplicate=False) if p is emb.weight]
    for name in names:
        info = ckpt.tensors.get(name)
        if info is not None and info.shape == tuple(emb.weight.shape):
            return emb, name
    return None


class OutsideLoader:
    """Installs the compact input embedding (at construction) and the load-on-call hooks of the other
    modules outside the blocks; `remove()` takes the hooks off (the capture is done). `embedding` is
    the compact embedding module (None: the model has none this class can shrink; everything outside
    the blocks is then loaded whole at construction, as before)."""

    def __init__(self, model: nn.Module, ckpt: Checkpoint, reader: ShardReader, prefix: str,
                 batches: Sequence[torch.Tensor]) -> None:  # fmt: skip
        self._handles: list[Any] = []
        found = input_embedding(model, ckpt)
        self.embedding = found[0] if found is not None else None
        if found is None:  # loaded whole, before the walk, as the GEMM-precision choice reads a weight
            load_into(model, ckpt, [n for n in ckpt.tensors if not n.startswith(prefix + ".")], reader)
            return
        self._shrink(*found, ckpt, reader, token_rows(batches))
        for name, module in model.named_modules():
            if name == prefix or name.startswith(prefix + ".") or module is self.embedding:
                continue
            own = _own_tensors(name, module, ckpt)
            if own:
                self._handles.append(
                    module.register_forward_pre_hook(_load_on_call(model, ckpt, own, reader))
                )

    def _shrink(self, emb: nn.Embedding, name: str, ckpt: Checkpoint, reader: ShardReader,
                rows: torch.Tensor) -> None:  # fmt: skip
        info = ckpt.tensors[name]
        if len(rows) and (int(rows[0]) < 0 or int(rows[-1]) >= info.shape[0]):
            bad = int(rows[0]) if int(rows[0]) < 0 else int(rows[-1])
            raise MixprecError(
                f"calibration token id {bad} lies outside the embedding's {info.shape[0]} rows ({name}): "
                "the tokenizer does not match the model"
            )
        emb.weight = nn.Parameter(reader.get_rows(info, rows), requires_grad=False)
        # padding_idx only shapes the gradient; F.embedding checks it against the (now compact) row count
        emb.padding_idx = None

        def remap(_m, args, kwargs):
            if args:
                return (torch.searchsorted(rows, args[0]), *args[1:]), kwargs
            return args, {**kwargs, "input": torch.searchsorted(rows, kwargs["input"])}

        self._handles.append(emb.register_forward_pre_hook(remap, with_kwargs=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _own_tensors(name: str, module: nn.Module, ckpt: Checkpoint) -> list[str]:
    """The checkpoint names of the module's own parameters and buffers (not its children's)."""
    own = [k for k, _ in module.named_parameters(recurse=False)] + [
        k for k, _ in module.named_buffers(recurse=False)
    ]
    full = [f"{name}.{k}" if name else k for k in own]
    return [n for n in full if n in ckpt.tensors]


def _load_on_call(model: nn.Module, ckpt: Checkpoint, names: list[str], reader: ShardReader):
    """A forward pre-hook that loads `names` the first time its module runs."""
    pending = [names]

    def hook(_m, _args):
        if pending:
            load_into(model, ckpt, pending.pop(), reader)

    return hook


def check_captured(captured: list[tuple[tuple, dict]]) -> None:
    """MixprecError when a captured block input is still on the meta device: the forward read a weight
    outside the blocks without calling its module (so it was never loaded)."""
    for args, kwargs in captured:
        for value in (*args, *kwargs.values()):
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and t.is_meta:
                    raise MixprecError(
                        "layer-by-layer calibration: this model's forward reads a weight outside its "
                        "transformer blocks without running that weight's module, so the first block's "
                        f"inputs could not be computed; {whole_model_advice()}"
                    )


def whole_model_advice() -> str:
    """How to calibrate the whole model at once instead: --no-layer-by-layer in one process; a run
    split across ranks always calibrates layer by layer, so there the advice is to leave torchrun."""
    if world_size() > 1:
        return ("run it in one process (not under torchrun: a split calibration always runs layer by layer) "
                "with --no-layer-by-layer")  # fmt: skip
    return "pass --no-layer-by-layer"


__all__ = [
    "OutsideLoader",
    "check_captured",
    "input_embedding",
    "load_into",
    "token_rows",
    "whole_model_advice",
]
