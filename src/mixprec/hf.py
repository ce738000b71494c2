"""A Hugging Face model directory: its config.json, the model it describes, and its tokenizer.

    config = read_config(directory)                      # validated; MixprecError names the path
    model = load_model(directory, head="causal-lm")      # weights from safetensors only, never a pickle
    skeleton = build_model(config, source=directory)     # parameters on the meta device, to load into
    tok = load_tokenizer(directory)                      # the directory's transformers tokenizer
    tok = text_tokenizer(directory, model_vocab)         # ... or raw UTF-8 bytes when it has none

transformers (the 'hf' extra) is imported inside the functions that need it, so importing this module
stays cheap and a base install can still read configs.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "tokenizer.model", "vocab.json")
PICKLE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth")
HEADS = ("config", "causal-lm", "encoder")


def transformers_module(needed_for: str):
    """The transformers package, or a MixprecError saying what needs it and how to install it."""
    try:
        import transformers
    except ImportError:
        raise MixprecError(f"{needed_for} needs the 'hf' extra: pip install 'mixprec[hf]'") from None
    return transformers


@contextlib.contextmanager
def transformers_progress(enabled: bool) -> Iterator[None]:
    """transformers' own progress bars (loading weights, checkpoint shards) on or off inside the block,
    restored afterwards; `--no-progress` means every bar, not only mixprec's."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # no transformers: no bars of its own
        yield
        return
    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


# ---------------------------------------------------------------------------------------------------
# config.json


def read_config(directory: str | os.PathLike, *, role: str = "model") -> dict[str, Any]:
    """The directory's config.json as a dict; `role` names the directory in error messages."""
    d = Path(directory)
    if not d.is_dir():
        raise MixprecError(f"{role} directory {d} does not exist")
    path = d / "config.json"
    if not path.is_file():
        raise MixprecError(
            f"{role} directory {d} has no config.json (expected a Hugging Face model directory)"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise MixprecError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise MixprecError(f"{path} must hold a JSON object")
    return config


def check_model_dir(directory: str | os.PathLike, *, role: str = "model") -> dict[str, Any]:
    """read_config, and refuse a directory without .safetensors weights; returns the config."""
    config = read_config(directory, role=role)
    d = Path(directory)
    if not any(d.glob("*.safetensors")):
        found = sorted(p.name for p in d.iterdir() if p.suffix in PICKLE_WEIGHT_SUFFIXES)
        extra = f" (found {', '.join(found)}: pickled weights are not read)" if found else ""
        raise MixprecError(f"{role} directory {d} has no .safetensors weights{extra}")
    return config


def model_kind(config: dict[str, Any]) -> str:
    """The kind of model: "causal-lm" for a decoder with a language-model head, else "encoder"."""
    archs = config.get("architectures") or []
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs) or config.get("is_decoder"):
        return "causal-lm"
    return "encoder"


def config_dtype(config: dict[str, Any]) -> torch.dtype:
    """The dtype config.json gives the weights (`dtype`, or the older `torch_dtype`); fp32 when none."""
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32").replace("torch.", "")
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


# ---------------------------------------------------------------------------------------------------
# Models


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Create parameters on the meta device (no memory, no init work) but buffers for real:
    non-persistent buffers (rotary tables) are not in checkpoints and must be computed."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_model(config: dict[str, Any], *, source: str | os.PathLike, meta: str = "parameters") -> nn.Module:
    """The model `config` (a config.json dict) describes, without weights: the class its `architectures`
    names (transformers.AutoModel when none). `source` names the directory in error messages.

    meta: "parameters" — parameters on the meta device, buffers real (a skeleton to load weights into);
    "all" — everything on the meta device (names and shapes only); "none" — a real, initialized model.
    """
    if meta not in ("parameters", "all", "none"):
        raise ValueError(f"meta must be 'parameters', 'all' or 'none', got {meta!r}")
    transformers = transformers_module("building a Hugging Face model")
    cfg_dict = {k: v for k, v in config.items() if k != "quantization_config"}
    model_type = cfg_dict.get("model_type")
    if not model_type:
        raise MixprecError(f"{source}/config.json has no model_type")
    try:
        cfg = transformers.AutoConfig.for_model(**cfg_dict)
    except Exception as e:
        raise MixprecError(f"{source}/config.json: transformers cannot read it ({e})") from None
    archs = cfg_dict.get("architectures") or []
    cls = getattr(transformers, archs[0], None) if archs else None
    placement = {"parameters": _parameters_on_meta(), "all": torch.device("meta")}.get(meta)
    with placement or contextlib.nullcontext():
        try:
            return cls(cfg) if cls is not None else transformers.AutoModel.from_config(cfg)
        except Exception as e:
            raise MixprecError(f"{source}: transformers cannot build {archs or model_type} ({e})") from None


def load_model(
    directory: str | os.PathLike,
    *,
    head: str = "config",
    dtype: torch.dtype | str | None = None,
    role: str = "model",
) -> nn.Module:
    """A model with its weights, read from the directory's safetensors files only (never a pickle).

    head: "config" — the class config.json's `architectures` names (AutoModel when none); "causal-lm" —
    AutoModelForCausalLM; "encoder" — AutoModel (the base model: hidden states, no head).
    dtype: passed to from_pretrained (None: transformers' default). `role` names it in error messages.
    """
    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    config = check_model_dir(directory, role=role)
    transformers = transformers_module(f"loading the {role}")
    d = Path(directory)
    if head == "causal-lm":
        cls = transformers.AutoModelForCausalLM
    elif head == "encoder":
        cls = transformers.AutoModel
    else:
        archs = config.get("architectures") or []
        cls = (getattr(transformers, archs[0], None) if archs else None) or transformers.AutoModel
    kwargs: dict[str, Any] = {"use_safetensors": True, "local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:
        return cls.from_pretrained(str(d), **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise MixprecError(f"cannot load the {role} from {d}: {exc}") from None


def vocab_size(model: nn.Module) -> int | None:
    """Rows of the input embedding, else the config's vocab_size (its text tower's), else None."""
    try:
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    except NotImplementedError:  # two-tower models (CLIPModel) have no single input embedding
        emb = None
    w = getattr(emb, "weight", None)
    if isinstance(w, torch.Tensor):
        return int(w.shape[0])
    cfg = getattr(model, "config", None)
    config = cfg.to_dict() if hasattr(cfg, "to_dict") else {}
    text = config.get("text_config")
    return config.get("vocab_size") or (text.get("vocab_size") if isinstance(text, dict) else None)


# ---------------------------------------------------------------------------------------------------
# Tokenizers


def has_tokenizer(directory: str | os.PathLike) -> bool:
    return any((Path(directory) / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(directory: str | os.PathLike):
    """The directory's transformers tokenizer (local files only)."""
    p = Path(directory)
    if not p.is_dir():
        raise MixprecError(f"tokenizer directory {p} does not exist")
    transformers = transformers_module("a Hugging Face tokenizer")
    try:
        return transformers.AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise MixprecError(f"cannot load a tokenizer from {p}: {exc}") from None


@dataclass
class Tokenizer:
    """The small surface evaluation and ONNX calibration need, over a transformers tokenizer or raw bytes."""

    hf: Any  # a transformers tokenizer, or None for bytes
    name: str

    @property
    def vocab_size(self) -> int:
        return len(self.hf) if self.hf is not None else 256

    @property
    def pad_id(self) -> int:
        if self.hf is None:
            return 0
        for tid in (self.hf.pad_token_id, self.hf.eos_token_id, self.hf.sep_token_id):
            if tid is not None:
                return int(tid)
        return 0

    @property
    def separator_id(self) -> int | None:
        """Joins documents in a token stream (end-of-text where the tokenizer has one)."""
        if self.hf is None:
            return ord("\n")
        tid = self.hf.eos_token_id if self.hf.eos_token_id is not None else self.hf.sep_token_id
        return None if tid is None else int(tid)

    def encode(self, text: str, special: bool = False) -> list[int]:
        if self.hf is None:
            return list(text.encode("utf-8"))
        return list(self.hf(text, add_special_tokens=special)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        if self.hf is None:
            return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
        return self.hf.decode(ids, skip_special_tokens=True)

    def vocab(self) -> dict[str, int] | None:
        return None if self.hf is None else dict(self.hf.get_vocab())


def text_tokenizer(directory: str | os.PathLike | None, model_vocab: int, tokenizer: Any = None) -> Tokenizer:
    """The tokenizer given, else the one in `directory`, else bytes (when the vocabulary has >= 256 ids)."""
    if tokenizer is not None:
        return (
            tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer, type(tokenizer).__name__)
        )
    if directory is not None and has_tokenizer(directory):
        return Tokenizer(load_tokenizer(directory), str(directory))
    if model_vocab < 256:
        where = f"model directory {directory}" if directory is not None else "the reference model"
        raise MixprecError(
            f"{where} has no tokenizer and its vocabulary ({model_vocab}) is too small for raw bytes: "
            "save a tokenizer beside the weights (tokenizer.save_pretrained(dir))"
        )
    return Tokenizer(None, "utf-8 bytes (no tokenizer in the model directory)")


def lm_blocks(docs: list[str], tok: Tokenizer, seq_len: int, samples: int) -> torch.Tensor:
    """Up to `samples` blocks [N, seq_len] of the documents' tokens joined by end-of-text.

    Tokenizes only as much text as the blocks need. A corpus shorter than one block gives one shorter
    block (at least 2 tokens, so one next-token prediction is scored).
    """
    need = samples * seq_len
    ids: list[int] = []
    for doc in docs:
        ids.extend(tok.encode(doc))
        if tok.separator_id is not None:
            ids.append(tok.separator_id)
        if len(ids) >= need:
            break
    n = min(samples, len(ids) // seq_len)
    if n == 0:
        if len(ids) < 2:
            raise MixprecError("the data has fewer than 2 tokens: nothing to score")
        return torch.tensor([ids], dtype=torch.int64)
    return torch.tensor(ids[: n * seq_len], dtype=torch.int64).reshape(n, seq_len)


__all__ = [
    "HEADS",
    "TOKENIZER_FILES",
    "Tokenizer",
    "build_model",
    "check_model_dir",
    "config_dtype",
    "has_tokenizer",
    "lm_blocks",
    "load_model",
    "load_tokenizer",
    "model_kind",
    "read_config",
    "text_tokenizer",
    "transformers_module",
    "transformers_progress",
    "vocab_size",
]
