"""Which tensors of a Hugging Face checkpoint are Linear weights, found without loading the model.

A Linear weight is a 2-D floating `<module>.weight` tensor that the model uses as an nn.Linear weight:
confirmed against the model built on the meta device from config.json (no memory), or, for the model
types of LINEAR_BY_NAME_MODEL_TYPES, every such tensor but the embeddings. Two cases need more than
the tensor names:

- Tied weights: a Linear whose weight is another tensor (an output head tied to the input embeddings)
  is not stored, yet readers of the checkpoint see the module; it is listed so that the checkpoint's
  ignore list names it.
- MoE experts: transformers 5 holds the experts of a layer as fused 3-D parameters ([experts, out, in])
  while checkpoints store one 2-D weight per expert (`experts.0.w1.weight`). A per-expert tensor counts
  as a Linear weight when transformers' own checkpoint conversion mapping stacks it (MergeModulelist
  on dim 0, then at most a Concatenate on dim 1) into a 3-D parameter of the meta model whose last
  dimension is the tensor's input dimension: the model then applies it as `F.linear(x, W[expert])`.
  That is also the layout vLLM reads (per-expert `weight` + `weight_scale`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mixprec.errors import MixprecError
from mixprec.hf import build_model
from mixprec.inference.checkpoint.safetensors_io import Checkpoint

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# Model types whose every 2-D floating `.weight` belongs to an nn.Linear, except the embeddings (named
# as below): checked on transformers 5.24 meta models (CausalLM, base, MaskedLM, SequenceClassification
# classes; tests/inference/test_quantize_weight.py re-checks a few). For them the model need not
# be built unless weights are tied: importing transformers' modelling code takes seconds, longer than
# quantizing 1 GB.
LINEAR_BY_NAME_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo", "olmo2", "granite", "starcoder2",
     "phi", "stablelm", "cohere", "bert", "roberta", "xlm-roberta", "distilbert", "electra"}
)  # fmt: skip
_EMBEDDING = re.compile(
    r"(^|\.)(embed_tokens|embed_in|embed_out|wte|wpe|word_embeddings|position_embeddings"
    r"|token_type_embeddings|embeddings)(\.|$)"
)


@dataclass(frozen=True)
class ExpertSlot:
    """Where a per-expert checkpoint weight lands in the model's fused 3-D expert parameter: rows
    [part * rows, (part + 1) * rows) of `param[expert]` (`parts` weights are concatenated there)."""

    param: str  # e.g. "model.layers.0.mlp.experts.gate_up_proj"
    expert: int
    part: int
    parts: int
    rows: int

    @property
    def module(self) -> str:
        return self.param.rpartition(".")[0]

    @property
    def attr(self) -> str:
        return self.param.rpartition(".")[2]


@dataclass
class LinearWeights:
    """Checkpoint tensors sorted by role (names are checkpoint module names, without `.weight`)."""

    linears: dict[str, tuple[int, int]] = field(default_factory=dict)  # stored Linear weights: (out, in)
    experts: dict[str, ExpertSlot] = field(default_factory=dict)  # the per-expert ones among them
    unstored: dict[str, str] = field(default_factory=dict)  # Linear modules without a stored weight: why
    not_linear: dict[str, str] = field(default_factory=dict)  # other 2-D floating weights: what they are
    fused_experts: list[str] = field(default_factory=list)  # 3-D expert tensors stored fused
    embeddings: set[str] = field(default_factory=set)  # 2-D weights known to be embeddings
    warning: str | None = None


def build_meta_model(model_dir: Path, config: dict[str, Any]) -> tuple[Any, str]:
    """The model of config.json built on the meta device (mixprec.hf.build_model), or (None, why not)."""
    try:
        return build_model(config, source=model_dir, meta="all"), ""
    except MixprecError as e:  # any failure only means we fall back on names and shapes
        return None, f"could not build the model on the meta device ({e})"


def _with_prefix_variants(model: Any, names: dict[str, Any]) -> dict[str, Any]:
    """Add the names without the base-model prefix (checkpoints of the bare base model lack it) and, when
    the model built is the bare base model, with it (checkpoints of head models have it)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if prefix:
        items = list(names.items())
        names.update({n[len(prefix) + 1 :]: v for n, v in items if n.startswith(prefix + ".")})
        if getattr(model, prefix, None) is None:  # the base model itself: no `model.` attribute
            names.update({f"{prefix}.{n}": v for n, v in items if n and f"{prefix}.{n}" not in names})
    return names


def _weight_candidates(ckpt: Checkpoint) -> dict[str, tuple[int, int]]:
    return {
        n[: -len(".weight")]: tuple(t.shape)
        for n, t in ckpt.tensors.items()
        if n.endswith(".weight") and len(t.shape) == 2 and t.dtype in FLOAT_DTYPES
    }


def find_linear_weights(ckpt: Checkpoint, model_dir: Path, config: dict[str, Any]) -> LinearWeights:
    """Sort the checkpoint's 2-D floating weights into Linear weights (stored or tied) and the rest."""
    from torch import nn

    found = LinearWeights()
    candidates = _weight_candidates(ckpt)
    found.fused_experts = [
        n for n, t in ckpt.tensors.items()
        if len(t.shape) == 3 and t.dtype in FLOAT_DTYPES and re.search(r"(^|\.)experts(\.|$)", n)
    ]  # fmt: skip
    tied = config.get("tie_word_embeddings", True) is not False  # absent: the class default decides
    if config.get("model_type") in LINEAR_BY_NAME_MODEL_TYPES and not tied:
        for n, s in candidates.items():
            if _EMBEDDING.search(n):
                found.embeddings.add(n)
                found.not_linear[n] = "embedding"
            else:
                found.linears[n] = s
        return found
    model, why = build_meta_model(model_dir, config)
    if model is None:
        found.warning = f"recognising Linear weights by name and 2-D shape only: {why}"
        found.linears = dict(candidates)  # embeddings etc. are excluded by the default ignore patterns
        found.embeddings = {n for n in candidates if _EMBEDDING.search(n)}
        if tied and "lm_head" not in candidates and config.get("tie_word_embeddings"):
            found.unstored["lm_head"] = "weight tied to the input embeddings (config tie_word_embeddings)"
        return found
    modules = _with_prefix_variants(model, dict(model.named_modules()))
    for n, s in candidates.items():
        m = modules.get(n)
        if isinstance(m, nn.Linear) and (m.out_features, m.in_features) == s:
            found.linears[n] = s
        elif isinstance(m, nn.Embedding) or (m is None and _EMBEDDING.search(n)):
            found.embeddings.add(n)
            found.not_linear[n] = "embedding"
        elif m is not None:
            found.not_linear[n] = f"not an nn.Linear weight ({type(m).__name__})"
        else:
            found.not_linear[n] = "no module of the model has this name"
    slots = expert_slots(model, [n for n in found.not_linear if n not in found.embeddings], candidates)
    for n, slot in slots.items():
        del found.not_linear[n]
        found.linears[n] = candidates[n]
        found.experts[n] = slot
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        name = target[: -len(".weight")] if target.endswith(".weight") else None
        if name and isinstance(modules.get(name), nn.Linear) and name not in candidates:
            found.unstored[name] = f"weight tied to {source} (not stored)"
    return found


def conversion_transforms(model: Any) -> tuple[list, list]:
    """transformers' checkpoint conversion mapping for `model`: (renamings, converters), or ([], [])
    when this transformers has none (it is internal API: any failure means no conversion)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter

        transforms = get_model_conversion_mapping(model)
    except Exception:
        return [], []
    return (
        [t for t in transforms if not isinstance(t, WeightConverter)],
        [t for t in transforms if isinstance(t, WeightConverter)],
    )


def rename_key(key: str, renamings: list, converters: list, model: Any, params: dict) -> tuple[str, Any, str | None]:  # fmt: skip
    """A checkpoint key as the model names it: (new key, the converter that matched or None, its source
    pattern), applying transformers' renamings and at most one converter as from_pretrained does.
    transformers' internal API: if it fails, the key is taken as it is."""
    try:
        from transformers.core_model_loading import apply_renamings, rename_source_key

        renamed = apply_renamings(key, renamings)
        for conv in converters:
            _, pattern = conv.rename_source_key(renamed)
            if pattern is not None:
                new, _ = rename_source_key(key, renamings, [conv], model.base_model_prefix, params)
                return new, conv, pattern
        new, _ = rename_source_key(key, renamings, [], model.base_model_prefix, params)
    except Exception:
        return key, None, None
    return new, None, None


def model_keys(model: Any, keys: Iterable[str], part_of: dict[str, str]) -> tuple[dict[str, str], list[str]]:  # fmt: skip
    """({checkpoint key: model key} for the keys the model names differently, [keys transformers would
    convert in ways mixprec does not]): per-expert tensors go to their part in the model once its
    experts are unfused (`part_of`: {checkpoint module: module path}, runtime/experts.py), other keys
    through transformers' checkpoint renamings (e.g. Mixtral's block_sparse_moe -> mlp)."""
    renamings, converters = conversion_transforms(model)
    params = dict(model.named_parameters())
    out: dict[str, str] = {}
    unmapped: list[str] = []
    for k in keys:
        module, _, leaf = k.rpartition(".")
        if module in part_of:
            out[k] = f"{part_of[module]}.{leaf}"
        elif renamings or converters:
            new, conv, _ = rename_key(k, renamings, converters, model, params)
            if conv is not None:
                unmapped.append(f"{k} -> {new}")
            elif new != k:
                out[k] = new
    return out, unmapped


def expert_slots(model: Any, names: list[str], shapes: dict[str, tuple[int, int]]) -> dict[str, ExpertSlot]:
    """Per-expert Linear weights among `names` (checkpoint module names; see the module docstring)."""
    try:
        from transformers.core_model_loading import Concatenate, MergeModulelist, apply_renamings
    except ImportError:
        return {}
    renamings, converters = conversion_transforms(model)
    if not converters:
        return {}
    params = dict(model.named_parameters())
    slots: dict[str, ExpertSlot] = {}
    for n in names:
        target, conv, pattern = rename_key(f"{n}.weight", renamings, converters, model, params)
        if conv is None:
            continue
        ops = conv.operations
        stacked = bool(ops) and type(ops[0]) is MergeModulelist and ops[0].dim == 0
        rest_ok = all(type(op) is Concatenate and op.dim == 1 for op in ops[1:]) and len(ops) <= 2
        parts = len(conv.source_patterns)
        p = params.get(target)
        out_f, in_f = shapes[n]
        if not (stacked and rest_ok and p is not None and p.dim() == 3 and p.shape[2] == in_f):
            continue
        if p.shape[1] != parts * out_f or (parts > 1 and len(ops) != 2) or "*" not in pattern:
            continue
        # the expert index is what the pattern's `*` matched
        m = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), apply_renamings(f"{n}.weight", renamings))
        if m is None or int(m.group(1)) >= p.shape[0]:
            continue
        slots[n] = ExpertSlot(target, int(m.group(1)), conv.source_patterns.index(pattern), parts, out_f)
    return slots
