"""THE module-selection vocabulary: which modules a name pattern names, which Linear dims FP8 kernels
take, and which sibling modules a serving engine fuses into one GEMM.

Used alike by the training policy (``Rule(name=...)``), the inference ignore lists (``--ignore``,
``quantize_model_(ignore=...)``), the loader reading a checkpoint's compressed-tensors targets and
ignore list, and ``quantize-onnx --exclude``.

Patterns, one meaning everywhere:

- ``"re:<regex>"``: Python ``re.match`` on the fully-qualified module name: anchored at the start of
  the name, open at its end. This is what compressed-tensors (``compressed_tensors.utils.match.
  match_name``, 0.20) and vLLM (``_is_equal_or_regex_match``) do with the ``re:`` targets and ignore
  entries of a checkpoint, so a pattern means the same in mixprec and in the engines that read its
  checkpoints. ``"re:.*\\.gate"`` therefore also matches ``mlp.gate_proj``; end it with ``$``
  (``"re:.*\\.gate$"``) to name the module alone; start it with ``.*`` to find a part anywhere.
- a glob (the pattern holds ``*``, ``?`` or ``[``): ``fnmatch`` over the whole name, case-sensitive
  (``*`` crosses dots: ``"model.layers.0.*"``, ``"*.q_proj"``).
- anything else is dotted name parts: the name ends with them (``"lm_head"``, ``"mlp.down_proj"``,
  ``"model.layers.0"``); the exact name is the case of all its parts.

A pattern *matches* a name (`matches`). It *selects* a module when it matches the module's name or the
name of one of the module's ancestors (`selects`): a pattern names a module and everything below it,
so ``"model.layers.0"`` selects every Linear of the first layer. Training rules and inference ignore
lists select; reading a checkpoint's own targets and ignore list only matches, as its readers do.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

from mixprec.errors import MixprecError
from mixprec.gemm import FP8_DIM_MULTIPLE, fp8_gemm_dims_ok

REGEX_PREFIX = "re:"
_GLOB_CHARS = "*?["


def check_pattern(pattern: str, what: str = "module pattern") -> str:
    """`pattern` unchanged, or MixprecError naming `what` when it is empty, not text or a bad regex."""
    if not isinstance(pattern, str) or not pattern.strip():
        raise MixprecError(f"{what} must be a non-empty string, got {pattern!r}")
    if pattern.startswith(REGEX_PREFIX):
        try:
            re.compile(pattern[len(REGEX_PREFIX) :])
        except re.error as exc:
            raise MixprecError(f"{what} {pattern!r} is not a valid regular expression: {exc}") from None
    return pattern


def matches(name: str, pattern: str) -> bool:
    """Does the module name `name` itself match `pattern` (see the module docstring)?"""
    if pattern.startswith(REGEX_PREFIX):
        return re.match(pattern[len(REGEX_PREFIX) :], name) is not None
    if any(c in pattern for c in _GLOB_CHARS):
        return fnmatch.fnmatchcase(name, pattern)
    parts, want = name.split("."), pattern.split(".")
    return len(want) <= len(parts) and parts[len(parts) - len(want) :] == want


def lineage(name: str) -> list[str]:
    """`name`, then the names of its ancestors, nearest first, ending with the root ("")."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def selects(name: str, pattern: str) -> bool:
    """Does `pattern` match `name` or one of its ancestors (a pattern names a subtree)?"""
    return any(matches(n, pattern) for n in lineage(name))


def selects_any(name: str, patterns: Iterable[str]) -> bool:
    return any(selects(name, p) for p in patterns)


# ---------------------------------------------------------------------------------------------------
# Which Linear dims FP8 kernels take


def fp8_dims_reason(out_features: int, in_features: int, multiple: int = FP8_DIM_MULTIPLE) -> str | None:
    """Why a Linear [out, in] stays in high precision for its dims (None: FP8 kernels take them).

    The forward GEMM reduces over in_features (K) into out_features (N), the input-gradient GEMM the
    other way round: both must be multiples of `multiple` (the FP8 kernels' rule, mixprec.gemm).
    """
    if fp8_gemm_dims_ok(in_features, out_features, multiple):
        return None
    return (
        f"in/out features ({in_features}, {out_features}) not multiples of {multiple}: "
        "no FP8 GEMM kernel takes them"
    )


# ---------------------------------------------------------------------------------------------------
# Fused groups: sibling modules that serving engines run as one GEMM

# (fused module, its shards): a checkpoint stores the shards as sibling modules, vLLM loads them into
# one fused layer (its models' packed_modules_mapping) and refuses a checkpoint whose shards are not
# quantized alike; FP4 formats share one global scale across them.
FUSED_SHARDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qkv_proj", ("q_proj", "k_proj", "v_proj")),  # Llama, Mistral, Qwen, Gemma...
    ("qkv_proj", ("query", "key", "value")),  # BERT-style attention.self
    ("gate_up_proj", ("gate_proj", "up_proj")),  # gated MLPs, also one expert's MLP (Qwen-MoE)
    ("w13", ("w1", "w3")),  # Mixtral experts: gate (w1) and up (w3)
)
_FUSED_NAME = {shard: fused for fused, shards in FUSED_SHARDS for shard in shards}
# every projection of every expert of one MoE block: engines build one fused-experts layer from them
# (checkpoint names `experts.<e>.w1`; an unfused live model's `experts.projections.<attr>.<e>.<part>`)
_EXPERT = re.compile(r"((?:.*\.)?experts)\.(?:projections\.\w+\.)?\d+(?:\.|$)")
# one expert's gate and up parts in a live model whose experts were unfused (runtime/experts.py): the
# engines' w13 of that expert, as `experts.<e>.w1` / `.w3` are in a checkpoint
_UNFUSED_GATE_UP = re.compile(r"(.*\.projections\.gate_up_proj\.\d+)\.\d+$")


def fused_shard_group(name: str) -> str | None:
    """The fused GEMM that module `name` is a shard of ("a.self_attn.q_proj" -> "a.self_attn.qkv_proj";
    "a.experts.3.w1" -> "a.experts.3.w13"; an unfused live expert's "a.experts.projections.gate_up_proj.3.0"
    -> "a.experts.projections.gate_up_proj.3"), or None. Its shards share a scheme and one global scale."""
    unfused = _UNFUSED_GATE_UP.match(name)
    if unfused is not None:
        return unfused.group(1)
    parent, _, leaf = name.rpartition(".")
    fused = _FUSED_NAME.get(leaf)
    if fused is None:
        return None
    return f"{parent}.{fused}" if parent else fused


def _position(name: str, position: dict[str, int]) -> int:
    """A shard's place along the fused output dim: its name's (q, k, v...), or an unfused part's index."""
    leaf = name.rpartition(".")[2]
    return int(leaf) if leaf.isdigit() else position[leaf]


def fused_group_of(name: str) -> str:
    """The key of the group of modules that must share one quantization decision with `name`.

    Every module of a block's experts ("...mlp.experts.<i>.<proj>") -> the experts module
    ("...mlp.experts"); a shard of a fused GEMM -> that GEMM (`fused_shard_group`); any other module
    is a group of its own (its name).
    """
    expert = _EXPERT.match(name)
    if expert is not None:
        return expert.group(1)
    return fused_shard_group(name) or name


def fused_groups(names: Iterable[str]) -> dict[str, list[str]]:
    """{group key: member names in the given order}; see `fused_group_of`."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(fused_group_of(name), []).append(name)
    return groups


def fused_shards(names: Iterable[str]) -> dict[str, list[str]]:
    """{fused GEMM (`fused_shard_group`): its shards among `names`, in the order the engine stacks them
    along the output dim (the order of FUSED_SHARDS: q, k, v; gate, up; w1, w3)}. Names that are no
    shard are left out."""
    position = {shard: i for _, shards in FUSED_SHARDS for i, shard in enumerate(shards)}
    out: dict[str, list[str]] = {}
    for name in names:
        fused = fused_shard_group(name)
        if fused is not None:
            out.setdefault(fused, []).append(name)
    for members in out.values():
        members.sort(key=lambda n: _position(n, position))
    return out


__all__ = [
    "FUSED_SHARDS",
    "REGEX_PREFIX",
    "check_pattern",
    "fp8_dims_reason",
    "fused_group_of",
    "fused_groups",
    "fused_shard_group",
    "fused_shards",
    "lineage",
    "matches",
    "selects",
    "selects_any",
]
