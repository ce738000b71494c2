"""Every check of an evaluation's arguments that can be made before a model is loaded.

The model directories are read as configs only (mixprec.hf.read_config): their kind, their architecture
facts, their position limit. A bad argument is a MixprecError (one line, exit 2) before any work.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from mixprec.errors import MixprecError
from mixprec.evaluation.clip import is_image_text
from mixprec.hf import model_kind, read_config

# Architecture facts that must agree between reference and candidate.
ARCH_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
# Where configs keep their position limit (the first found is taken).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def check_counts(**counts: int | None) -> None:
    """Every count given must be at least 1 (None: not given)."""
    for name, value in counts.items():
        if value is not None and int(value) < 1:
            raise MixprecError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def model_config(obj: str | os.PathLike | nn.Module, role: str) -> tuple[Path | None, dict]:
    """(directory or None, config dict) of a model given as a directory or a module."""
    if isinstance(obj, nn.Module):
        cfg = getattr(obj, "config", None)
        return None, (cfg.to_dict() if hasattr(cfg, "to_dict") else {})
    if not isinstance(obj, (str, os.PathLike)):
        raise MixprecError(f"{role} must be a model directory or a torch.nn.Module, got {type(obj).__name__}")
    p = Path(obj)
    if p.exists() and not p.is_dir():
        raise MixprecError(
            f"--{role} {p} is a file, not a model directory (give the directory that holds config.json)"
        )
    return p, read_config(p, role=f"{role} model")


def config_kind(config: dict, module: nn.Module | None = None) -> str:
    """ "image-text" (CLIP and look-alikes), "causal-lm" or "encoder"."""
    if is_image_text(config):
        return "image-text"
    if model_kind(config) == "causal-lm":
        return "causal-lm"
    if module is not None and type(module).__name__.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal-lm"
    return "encoder"


def max_positions(config: dict) -> int | None:
    """The longest token sequence the (text) model takes, or None when its config does not say."""
    text = config.get("text_config") if is_image_text(config) else config
    for key in POSITION_KEYS:
        value = (text or {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_seq_len(seq_len: int, config: dict, source: str) -> None:
    limit = max_positions(config)
    if limit is not None and seq_len > limit:
        raise MixprecError(
            f"--seq-len {seq_len} is longer than the {limit} positions of {source} (use --seq-len {limit} or less)"
        )


def check_same_architecture(reference: dict, candidate: dict, ref_source: str, cand_source: str) -> None:
    """Refuse a comparison of two different architectures, from their configs."""
    for key in ARCH_KEYS:
        if key in reference and key in candidate and reference[key] != candidate[key]:
            raise MixprecError(
                f"architecture mismatch: reference {ref_source} has {key}={reference[key]!r}, "
                f"candidate {cand_source} has {key}={candidate[key]!r}"
            )
    ref_kind, cand_kind = config_kind(reference), config_kind(candidate)
    if reference and candidate and ref_kind != cand_kind:
        raise MixprecError(
            f"architecture mismatch: reference {ref_source} is a {ref_kind}, candidate is a {cand_kind}"
        )


__all__ = [
    "ARCH_KEYS",
    "check_counts",
    "check_same_architecture",
    "check_seq_len",
    "config_kind",
    "max_positions",
    "model_config",
]
