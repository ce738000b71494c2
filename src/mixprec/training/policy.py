"""Precision policy: which module of a model gets FP8, which stays in high precision, and why.

The default policy follows the guide: normalization layers, softmax, embeddings, the output head (also
when it is tied to the embedding), MoE routers and any Linear whose features are not multiples of 16
stay in high precision; every other Linear takes the recipe. Rules (by module type and by
fully-qualified-name pattern, in the vocabulary of mixprec.select) are checked first, in order, and the
first one that matches the module or one of its ancestors decides.

Roles are found by structure, not by names alone:
- a *norm* is a torch norm class, a class whose name contains "Norm" (LlamaRMSNorm, T5LayerNorm...), or a
  leaf whose parameters are all 1-D and that has an epsilon attribute;
- the *head* is the Linear whose weight IS an embedding's weight (tying, by parameter identity), the
  module transformers calls the output embeddings, a Linear named ``lm_head``, or the model's last
  Linear when its out_features equals an embedding's vocabulary size;
- a *router* is the module that scores experts: inside a module that holds experts (a ModuleList of
  identical expert blocks, or fused 3-D expert parameters [E, ...]), a direct child whose weight has E
  output rows. A dense MLP's ``gate_proj`` is therefore not a router.
- *fused experts* are leaves with 3-D parameters [E, out, in] (transformers' MixtralExperts,
  Qwen2MoeExperts): converted to per-expert FP8 GEMMs (GroupedFp8Experts) when the recipe allows it, else reported skipped.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from torch import nn

from mixprec.errors import MixprecError
from mixprec.gemm import FP8_DIM_MULTIPLE
from mixprec.select import check_pattern, fp8_dims_reason, lineage, matches

ACTIONS = ("convert", "keep", "fp32")
"""convert: take the recipe (FP8 GEMMs for an FP8 recipe); keep: stay in the recipe's high precision
(bf16 parameters for bf16/fp8 recipes, fp32 for fp32/amp); fp32: fp32 parameters and fp32 compute
(an island: inputs cast to fp32, outputs cast back, autocast off inside)."""

_NORM_TYPES: tuple[type, ...] = tuple(
    t
    for t in (
        nn.LayerNorm,
        nn.GroupNorm,
        nn.LocalResponseNorm,
        getattr(nn, "RMSNorm", None),
        nn.modules.batchnorm._BatchNorm,
        nn.modules.instancenorm._InstanceNorm,
    )
    if t is not None
)
_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")


@dataclass(frozen=True)
class Rule:
    """Overrides the default policy for modules matching ``name`` and/or ``module_type``.

    name: a module-name pattern of mixprec.select: dotted name parts the name ends with (``"lm_head"``,
    ``"model.layers.0"``), a glob over the whole name (``"model.layers.0.*"``, ``"*.q_proj"``), or a
    regular expression after ``"re:"`` matched from the start of the name, as compressed-tensors and
    vLLM do (``"re:.*layers\\.[01]\\."``). module_type: a class (isinstance) or a class name (exact, or
    fnmatch pattern such as ``"*Attention"``). Both given: both must match. A rule matching a module
    also decides for everything below it (see `decide`).
    """

    action: str
    name: str | None = None
    module_type: type | str | None = None
    reason: str | None = None  # why the rule exists (the automatic policy's evidence); shown in reports

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise MixprecError(f"policy rule action must be one of {ACTIONS}, got {self.action!r}")
        if self.name is None and self.module_type is None:
            raise MixprecError("a policy rule needs a name pattern, a module type, or both")
        if self.name is not None:
            check_pattern(self.name, "policy rule name")

    def matches(self, name: str, module: nn.Module) -> bool:
        if self.name is not None and not matches(name, self.name):
            return False
        if self.module_type is not None:
            if isinstance(self.module_type, str):
                if not fnmatch.fnmatchcase(type(module).__name__, self.module_type):
                    return False
            elif not isinstance(module, self.module_type):
                return False
        return True

    def describe(self) -> str:
        parts = []
        if self.name is not None:
            parts.append(f"name {self.name!r}")
        if self.module_type is not None:
            t = self.module_type if isinstance(self.module_type, str) else self.module_type.__name__
            parts.append(f"type {t}")
        return f"rule {' and '.join(parts)} -> {self.action}" + (f" ({self.reason})" if self.reason else "")


@dataclass(frozen=True)
class Policy:
    """Rules first (first match wins), then the default roles below."""

    rules: tuple[Rule, ...] = ()
    keep_norms: bool = True
    keep_embeddings: bool = True
    keep_head: bool = True
    keep_routers: bool = True
    min_multiple: int = FP8_DIM_MULTIPLE  # FP8 GEMM kernels need K and N multiples of 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))
        for r in self.rules:
            if not isinstance(r, Rule):
                raise MixprecError(f"Policy.rules takes Rule objects, got {type(r).__name__}")

    @classmethod
    def from_rules(cls, rules: Mapping[str, str] | Iterable[Rule], **kwargs) -> Policy:
        """``Policy.from_rules({"*.q_proj": "keep", "lm_head": "convert"})``: name pattern -> action."""
        if isinstance(rules, Mapping):
            rules = [Rule(action, name=pattern) for pattern, action in rules.items()]
        return cls(rules=tuple(rules), **kwargs)


@dataclass
class Decision:
    """What the policy decided for one module (before conversion)."""

    name: str
    type_name: str
    role: str  # linear, head, router, norm, embedding, softmax, experts, container, stateless, other
    action: str  # convert, keep, fp32, none (nothing to do: containers, parameter-free leaves)
    reason: str
    num_params: int = 0
    extra: dict = field(default_factory=dict)


def is_norm(module: nn.Module) -> bool:
    if isinstance(module, _NORM_TYPES):
        return True
    if "norm" in type(module).__name__.lower() and not isinstance(module, nn.Linear):
        return True
    params = list(module.parameters(recurse=False))
    return (
        not list(module.children())
        and bool(params)
        and all(p.dim() == 1 for p in params)
        and any(hasattr(module, a) for a in _EPS_ATTRS)
    )


def is_embedding(module: nn.Module) -> bool:
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return True
    w = getattr(module, "weight", None)
    return (
        "embedding" in type(module).__name__.lower()
        and isinstance(w, nn.Parameter)
        and w.dim() == 2
        and not isinstance(module, nn.Linear)
    )


def fused_expert_params(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """3-D parameters [E, out, in] held directly by a module (transformers' fused experts)."""
    return {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False) if p.dim() == 3}


def _num_experts(module: nn.Module) -> int | None:
    """If `module` holds experts, how many: fused 3-D params, a ModuleList of like blocks, or an attribute."""
    for child_name, child in module.named_children():
        fused = fused_expert_params(child)
        if fused:
            return next(iter(fused.values()))[0]
        is_list = isinstance(child, nn.ModuleList) and len(child) > 1
        if is_list and "expert" in child_name.lower() and len({type(c) for c in child}) == 1:
            return len(child)
    for attr in ("num_experts", "num_local_experts", "n_routed_experts"):
        n = getattr(module, attr, None)
        if isinstance(n, int) and n > 1 and any("expert" in c for c, _ in module.named_children()):
            return n
    return None


def _out_rows(module: nn.Module) -> int | None:
    if isinstance(module, nn.Linear):
        return module.out_features
    w = getattr(module, "weight", None)
    if isinstance(w, nn.Parameter) and w.dim() == 2 and not list(module.children()):
        return w.shape[0]
    return None


def find_routers(model: nn.Module) -> dict[str, str]:
    """Qualified name -> reason, for modules that score experts (by role, not by a 'gate' substring)."""
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        n_exp = _num_experts(module)
        if n_exp is None:
            continue
        for child_name, child in module.named_children():
            if _out_rows(child) == n_exp and not fused_expert_params(child):
                q = f"{name}.{child_name}" if name else child_name
                found[q] = f"MoE router: scores the {n_exp} experts of {type(module).__name__}"
    return found


def find_heads(model: nn.Module) -> dict[str, str]:
    """Qualified name -> reason, for output heads (tied or untied)."""
    embeddings = [m for m in model.modules() if is_embedding(m)]
    emb_weights = {id(m.weight) for m in embeddings}
    vocab_sizes = {m.weight.shape[0] for m in embeddings}
    output_emb = None
    get_out = getattr(model, "get_output_embeddings", None)
    if callable(get_out):
        try:
            output_emb = get_out()
        except (NotImplementedError, AttributeError):  # not every transformers model has a head
            output_emb = None
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    last = linears[-1][0] if linears else None
    found: dict[str, str] = {}
    for name, module in linears:
        if id(module.weight) in emb_weights:
            found[name] = "output head tied to the embedding (same parameter)"
        elif module is output_emb:
            found[name] = "output head (the model's output embeddings)"
        elif name.split(".")[-1] == "lm_head":
            found[name] = "output head (lm_head)"
        elif name == last and module.out_features in vocab_sizes:
            found[name] = f"output head: the last Linear, projects to the vocabulary ({module.out_features})"
    return found


def _first_rule(policy: Policy, chain: list[tuple[str, nn.Module]]) -> tuple[Rule, str] | None:
    """The first rule (in order) matching the module or one of its ancestors; with the name it matched."""
    for rule in policy.rules:
        for name, module in chain:
            if rule.matches(name, module):
                return rule, name
    return None


def block_stack(model: nn.Module) -> tuple[str, int] | None:
    """(qualified name, length) of the model's stack of blocks: the longest nn.ModuleList whose
    children are all of one class that holds a Linear (a transformer's layers), or None."""
    best: tuple[str, int] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        children = list(module)
        if len({type(c) for c in children}) != 1:
            continue
        if not any(isinstance(m, nn.Linear) for m in children[0].modules()):
            continue
        if best is None or len(children) > best[1]:
            best = (name, len(children))
    return best


def keep_last_blocks(model: nn.Module, policy: Policy, n: int, why: str) -> Policy:
    """`policy` plus one rule per block keeping the last n blocks of the model's stack in high precision
    (after the policy's own rules: a rule of the user's still decides first). NVFP4 pretraining keeps
    its final layers in bf16 (arXiv 2509.25149). MixprecError when the model has no block stack or
    fewer than n blocks."""
    stack = block_stack(model)
    if stack is None:
        raise MixprecError(
            f"{why}: keep_last={n} needs a stack of blocks (an nn.ModuleList of like layers holding Linears); "
            f"{type(model).__name__} has none"
        )
    name, length = stack
    if n > length:
        raise MixprecError(f"{why}: keep_last={n}, but {name or '(root)'} has only {length} blocks")
    prefix = f"{name}." if name else ""
    rules = tuple(
        Rule("keep", name=f"{prefix}{i}", reason=f"{why}: one of the last {n} blocks, kept in bf16")
        for i in range(length - n, length)
    )
    return Policy(
        rules=(*policy.rules, *rules), keep_norms=policy.keep_norms, keep_embeddings=policy.keep_embeddings,
        keep_head=policy.keep_head, keep_routers=policy.keep_routers, min_multiple=policy.min_multiple,
    )  # fmt: skip


def decide(model: nn.Module, policy: Policy) -> list[Decision]:
    """One Decision per module of `model`, in named_modules() order (the root is named "").

    A rule matching a module also applies to everything below it (``Rule("keep", name="model.layers.0")``
    keeps the whole layer; ``Rule("fp32", module_type="LlamaAttention")`` makes each attention block an
    fp32 island). The first rule in order that matches the module or an ancestor decides.
    """
    heads = find_heads(model)
    routers = find_routers(model)
    modules = dict(model.named_modules())
    out: list[Decision] = []
    for name, module in modules.items():
        n_params = sum(p.numel() for p in module.parameters(recurse=False))
        d = _default(name, module, policy, heads, routers)
        d.num_params = n_params
        hit = _first_rule(policy, [(n, modules[n]) for n in lineage(name)])
        if hit is not None:
            rule, matched = hit
            why = rule.describe() if matched == name else f"{rule.describe()} (matched {matched or '(root)'})"
            if d.role in ("container", "stateless"):
                if rule.action == "fp32" and (d.role == "container" or matched == name):
                    d.action, d.reason = "fp32", why  # an fp32 island around the whole subtree
            elif rule.action == "convert" and d.role not in ("linear", "head", "router", "experts"):
                d.action, d.reason = "keep", f"{why}, but {d.role} has no FP8 path"
            elif rule.action == "convert" and d.extra.get("no_fp8_kernel"):
                d.reason = f"{why} ignored: {d.reason}"  # no kernel can run it
            else:
                d.action, d.reason = rule.action, why
        out.append(d)
    return out


def _default(name: str, module: nn.Module, policy: Policy, heads: dict, routers: dict) -> Decision:
    t = type(module).__name__
    has_children = bool(list(module.children()))
    own_params = list(module.parameters(recurse=False))
    if isinstance(module, nn.Linear):
        if name in heads:
            return Decision(name, t, "head", "keep" if policy.keep_head else "convert", heads[name])
        if name in routers:
            return Decision(name, t, "router", "keep" if policy.keep_routers else "convert", routers[name])
        why = fp8_dims_reason(module.out_features, module.in_features, policy.min_multiple)
        if why:
            return Decision(name, t, "linear", "keep", why, extra={"no_fp8_kernel": True})
        return Decision(name, t, "linear", "convert", "Linear: takes the recipe")
    if name in routers:
        return Decision(name, t, "router", "keep", routers[name])
    if is_norm(module):
        return Decision(name, t, "norm", "keep" if policy.keep_norms else "convert", "normalization layer")
    if is_embedding(module):
        return Decision(name, t, "embedding", "keep" if policy.keep_embeddings else "convert", "embedding")
    if isinstance(module, (nn.Softmax, nn.LogSoftmax)):
        return Decision(name, t, "softmax", "keep", "softmax")
    fused = fused_expert_params(module)
    if fused:  # [E, out, in] per parameter
        bad = {n: fp8_dims_reason(s[1], s[2], policy.min_multiple) for n, s in fused.items()}
        bad = {n: why for n, why in bad.items() if why}
        if bad:
            why = "; ".join(f"fused experts {n} {fused[n]}: {w}" for n, w in bad.items())
            return Decision(name, t, "experts", "keep", why, extra={"no_fp8_kernel": True})
        return Decision(name, t, "experts", "convert", f"fused 3-D experts {fused}", extra={"fused": fused})
    if has_children:
        why = "container (own parameters stay in high precision)" if own_params else "container"
        return Decision(name, t, "container", "keep" if own_params else "none", why)
    if not own_params:
        return Decision(name, t, "stateless", "none", "no parameters")
    return Decision(name, t, "other", "keep", f"{t} has no FP8 path (only Linear GEMMs take FP8)")
