"""Finding the quantized Linears among a checkpoint's tensors (headers only), in the layout table's
terms: what inspect and convert walk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.inference.checkpoint.configs import LayoutConfig
from mixprec.inference.checkpoint.layout import (
    K_SCALE,
    PAYLOAD_NAMES,
    QUANTIZED_SUFFIXES,
    V_SCALE,
    WEIGHT,
    WEIGHT_PACKED,
    StoredScheme,
)
from mixprec.inference.checkpoint.safetensors_io import Checkpoint, TensorInfo
from mixprec.select import REGEX_PREFIX, matches


@dataclass
class StoredModule:
    name: str
    scheme: StoredScheme | None  # None: stored quantized although the config does not quantize it
    dims: tuple[int, int] | None  # (out, in) of the Linear, from its payload
    tensors: dict[str, TensorInfo]  # suffix -> tensor, every tensor "<name>.<suffix>" of the module


def quantized_modules(ckpt: Checkpoint, cfg: LayoutConfig) -> dict[str, StoredModule]:
    """Every module whose tensors are stored quantized (an FP8/packed payload or a weight scale), in
    file order, with the scheme its config gives it."""
    found: dict[str, StoredModule] = {}
    for name, info in ckpt.tensors.items():
        module, _, suffix = name.rpartition(".")
        quantized = suffix in QUANTIZED_SUFFIXES or (suffix == WEIGHT and info.dtype.itemsize == 1)
        if quantized and module not in found:
            found[module] = StoredModule(module, cfg.scheme_for(module), None, {})
    for name, info in ckpt.tensors.items():
        module, _, suffix = name.rpartition(".")
        if module in found and suffix not in (K_SCALE, V_SCALE):  # ModelOpt's KV scales sit on k/v_proj
            found[module].tensors[suffix] = info
    for m in found.values():
        payload = m.tensors.get(WEIGHT_PACKED) or m.tensors.get(WEIGHT)
        if payload is not None and len(payload.shape) == 2:
            out_f, cols = payload.shape
            m.dims = (out_f, cols * 2) if payload.dtype == torch.uint8 else (out_f, cols)
    return found


def module_names(ckpt: Checkpoint) -> list[str]:
    """Every module that stores a weight (quantized or not), in file order."""
    names = [n.rpartition(".")[0] for n in ckpt.tensors if n.rpartition(".")[2] in PAYLOAD_NAMES]
    return list(dict.fromkeys(names))


def expand_ignore(cfg: LayoutConfig, modules: list[str], quantized: set[str]) -> list[str]:
    """The config's ignore list as exact module names, which every layout's readers take alike
    (compressed-tensors' regexes, ModelOpt's globs and Hugging Face's names differ): each unquantized
    module an entry matches, plus plain-name entries that match no stored module (a tied lm_head)."""
    out = {m for m in modules if m not in quantized and cfg.ignores(m)}
    for p in cfg.ignore:
        plain = not p.startswith(REGEX_PREFIX) and not any(c in p for c in "*?[")
        if plain and not any(matches(m, p) for m in modules):
            out.add(p)
    return sorted(out)
