"""Per-layer sensitivity scores of the inference schemes: how much the model's loss would notice each
quantizable Linear running in each candidate scheme.

    names = scorable_linears(model)                                  # Linears a scheme may take
    scores = gradient_scores(model, batches, names, candidates)      # one forward + backward per batch

Two scores, both from actual quantizations by the inference schemes' own layers (`QuantizedLinear`
built by `QuantizedLinear.from_linear`: the weight quantized by `quantize_weight`, the input as the
scheme quantizes it, the GEMM through the one seam), never from a second quantizer:

- "gradient" (default): for every calibration batch, one forward and one backward of the model's
  next-token loss in high precision; each Linear's output hook, when the output's gradient g arrives,
  runs every candidate on the Linear's saved input X and adds sum((g * (Y_q - Y))^2), Y = the Linear's
  own output. This is the diagonal-Fisher estimate of the loss change the candidate causes (the score
  ModelOpt's auto_quantize uses), for all layers and candidates in one pass: the cost is one backward
  plus one quantized GEMM per candidate per Linear and batch.
- "kl": the mean next-token KL divergence of the model's logits when that one layer group (a fused
  group chooses together) runs in the candidate and everything else stays in high precision: one
  forward per batch, group and candidate. Exact where the gradient score is a local approximation,
  and groups x candidates times slower.

The high-precision candidate ("bf16": the layer kept as the checkpoint stores it) scores 0 by
definition: it is the reference every score is measured against.

Scores are per Linear; a fused group (mixprec.select.fused_groups: q/k/v, gate/up, one MoE block's
experts) takes one scheme, so its score is the sum over its members (`group_scores`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.formats import E4M3
from mixprec.inference.calibration.run import NEVER_STOP_EARLY, calibrate
from mixprec.inference.checkpoint.block_tensors import fused_global_scales, input_global_scale
from mixprec.inference.runtime.linear import quantized_linear
from mixprec.inference.schemes import (
    SCHEMES,
    InferenceScheme,
    quantize_weight,
    resolve_ignore,
    serving_reasons,
    skip_reason,
)
from mixprec.models import lm_loss
from mixprec.scaling import QuantizedTensor, compute_scale
from mixprec.select import fused_groups

KEPT = "bf16"  # the candidate "kept in high precision as stored"
METHODS = ("gradient", "kl")
SCORES_SCHEMA_VERSION = 1


def candidate_schemes(names: Sequence[str] | None = None) -> list[InferenceScheme]:
    """The quantizing candidates: the given scheme names, else every scheme of `SCHEMES` (schemes
    added there join without a change here)."""
    chosen = list(SCHEMES) if names is None else [n for n in names if n != KEPT]
    return [InferenceScheme.from_name(n) for n in dict.fromkeys(chosen)]


def scorable_linears(model: nn.Module, ignore: Sequence[str] | None = None, *, default_ignore: bool = True) -> dict[str, tuple[int, int]]:  # fmt: skip
    """{name: (out_features, in_features)} of the Linears a scheme may take: not ignored (the default
    ignore list: lm_head, embeddings, norms, routers) and of dims FP8 kernels take."""
    patterns = resolve_ignore(ignore, defaults=default_ignore)
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and skip_reason(name, m.out_features, m.in_features, patterns) is None:
            out[name] = (int(m.out_features), int(m.in_features))
    return out


def allowed_schemes(
    linears: Mapping[str, tuple[int, int]],
    candidates: Sequence[InferenceScheme],
    layout: str = "compressed-tensors",
) -> dict[str, list[str]]:
    """{fused group: the candidate names (KEPT first) that the serving engines take for all its
    members}: a candidate whose shape rules (schemes.serving_reasons, e.g. vLLM's fp8-block rule for
    fused shards; skip_reason, e.g. a block format whose block does not divide in_features) would
    send the group back to high precision is not offered to it."""
    groups = fused_groups(linears)
    allowed = {g: [KEPT] for g in groups}
    for sch in candidates:
        refused = serving_reasons(sch, layout, linears, {})
        refused.update({n: "dims" for n, (o, i) in linears.items() if skip_reason(n, o, i, (), sch)})
        for g, members in groups.items():
            if not any(m in refused for m in members):
                allowed[g].append(sch.name)
    return allowed


def static_input_amax(
    model: nn.Module, batches: Sequence[Any], names: Sequence[str], candidates: Sequence[InferenceScheme]
) -> dict[str, float]:
    """The input amax of every Linear, for the candidates with calibrated input scales (fp8-static,
    nvfp4's input global scale), from THE calibration (mixprec.inference.calibration.run.calibrate, max
    observer, every batch): what `mixprec quantize` derives its static scales from."""
    if not any(s.needs_calibration for s in candidates):
        return {}
    return dict(calibrate(model, batches, list(names), stop=NEVER_STOP_EARLY).input_amax)


class CandidateLayers(Mapping[str, dict[str, nn.Module]]):
    """{Linear name: {scheme: the inference layer that scheme makes of it}}, built by the inference wing
    itself (quantize_weight + quantized_linear) as the checkpoint will hold it: the weight quantized in
    `weight_dtype` (the checkpoint's; default the model's), NVFP4 weights with the global scale their
    fused GEMM shares (checkpoint.block_tensors.fused_global_scales), static input scales from
    `input_amax` (fp8-static: amax / 448; nvfp4: its input global scale).

    Built on demand, one Linear at a time, and not kept: every candidate of every Linear at once (with
    each layer's decoded weight) held several times the model (7.5 GiB peak on SmolLM2-135M, 8
    candidates). A scorer asks for a Linear's layers when it needs them; asking again quantizes again
    (the same bytes: quantization is deterministic)."""

    def __init__(self, model: nn.Module, names: Sequence[str], candidates: Sequence[InferenceScheme],
                 input_amax: Mapping[str, float] | None = None, *, weight_dtype: torch.dtype | None = None,
                 rounded: Mapping[str, Mapping[str, QuantizedTensor]] | None = None):  # fmt: skip
        self.modules = dict(model.named_modules())
        self.rounded = rounded or {}  # {scheme: {Linear: its weight as an algorithm rounded it}}
        self.names = list(names)
        self.candidates = {s.name: s for s in candidates}
        self.input_amax = dict(input_amax or {})
        self.dtype = weight_dtype or next(model.parameters()).dtype
        self.globals: dict[str, torch.Tensor] = {}
        if any(s.weight_granularity.scale_format == "e4m3" for s in candidates):
            amax = {n: float(self.modules[n].weight.detach().abs().max()) for n in self.names}
            self.globals = fused_global_scales(amax, self.dtype)

    @property
    def schemes(self) -> list[str]:
        return list(self.candidates)

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, name: str) -> dict[str, nn.Module]:
        if name not in self.names:
            raise KeyError(name)
        return {c: self.layer(name, c) for c in self.candidates}

    def layer(self, name: str, scheme: str) -> nn.Module:
        """`name`'s layer in candidate `scheme` (its decoded-weight cache off: it is used once)."""
        sch, lin = self.candidates[scheme], self.modules[name]
        scale = None
        if sch.needs_calibration:
            if name not in self.input_amax:
                raise MixprecError(f"scheme {sch.name} needs a calibrated input amax for {name}")
            a = float(self.input_amax[name])
            scale = (
                input_global_scale(a, self.dtype) if sch.input_global else compute_scale(a, E4M3).reshape(1)
            )
        g = self.globals.get(name) if sch.weight_granularity.scale_format == "e4m3" else None
        q = self.rounded.get(scheme, {}).get(name)
        if q is None:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # elementwise work on one weight: per-op thread regions only cost
            try:
                q, _ = quantize_weight(
                    lin.weight.detach().to(self.dtype), sch, name=f"{name}.weight", global_scale=g
                )
            finally:
                torch.set_num_threads(threads)
        layer = quantized_linear(q, lin.bias, sch, input_scale=scale, out_dtype=torch.float32).eval()
        layer.decoded_cache = False
        return layer


def candidate_layers(model: nn.Module, names: Sequence[str], candidates: Sequence[InferenceScheme],
                     input_amax: Mapping[str, float] | None = None, *, weight_dtype: torch.dtype | None = None,
                     rounded: Mapping[str, Mapping[str, QuantizedTensor]] | None = None) -> CandidateLayers:  # fmt: skip
    """The CandidateLayers of `names` (built on demand; rounded: the weights an algorithm gave each
    candidate, used instead of round to nearest's where given)."""
    for sch in candidates:  # a missing amax is refused before any scoring
        missing = [n for n in names if sch.needs_calibration and n not in (input_amax or {})]
        if missing:
            raise MixprecError(f"scheme {sch.name} needs a calibrated input amax for {missing[0]}")
    return CandidateLayers(model, names, candidates, input_amax, weight_dtype=weight_dtype, rounded=rounded)


@dataclass
class Scores:
    """Scores of every (Linear, candidate); KEPT scores 0. `to_dict`/`from_dict`: the cached JSON."""

    method: str
    candidates: list[str]  # KEPT first
    layers: dict[str, dict[str, float]]  # Linear -> candidate -> score
    shapes: dict[str, tuple[int, int]]
    allowed: dict[str, list[str]]  # fused group -> candidates offered to it
    batches: int = 0
    tokens: int = 0
    seconds: float = 0.0
    fingerprint: dict[str, str] = field(default_factory=dict)

    def groups(self) -> dict[str, list[str]]:
        return fused_groups(self.layers)

    def group_scores(self) -> dict[str, dict[str, float]]:
        """{fused group: {allowed candidate: the sum of its members' scores}}."""
        return {
            g: {c: sum(self.layers[m][c] for m in members) for c in self.allowed[g]}
            for g, members in self.groups().items()
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCORES_SCHEMA_VERSION,
            "method": self.method,
            "candidates": list(self.candidates),
            "fingerprint": dict(self.fingerprint),
            "batches": self.batches,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "shapes": {n: list(s) for n, s in self.shapes.items()},
            "allowed": {g: list(c) for g, c in self.allowed.items()},
            "layers": self.layers,
        }

    @classmethod
    def from_dict(cls, doc: Any, where: str) -> Scores:
        if not isinstance(doc, dict) or doc.get("schema_version") != SCORES_SCHEMA_VERSION:
            raise MixprecError(
                f"{where}: not a scores file of schema_version {SCORES_SCHEMA_VERSION} (docs/schemas/auto.md)"
            )
        try:
            layers = {str(n): {str(c): float(v) for c, v in e.items()} for n, e in doc["layers"].items()}
            shapes = {str(n): (int(s[0]), int(s[1])) for n, s in doc["shapes"].items()}
            allowed = {str(g): [str(c) for c in cs] for g, cs in doc["allowed"].items()}
            candidates = [str(c) for c in doc["candidates"]]
            method = str(doc["method"])
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise MixprecError(f"{where}: malformed scores file ({type(e).__name__}: {e})") from None
        for n, e in layers.items():
            missing = [c for c in candidates if c not in e]
            bad = [c for c, v in e.items() if not (math.isfinite(v) and v >= 0)]
            if missing or bad or n not in shapes:
                raise MixprecError(
                    f"{where}: layers[{n!r}] lacks {missing or 'its shape'} or has bad scores {bad}"
                )
        return cls(method, candidates, layers, shapes, allowed, int(doc.get("batches", 0)),
                   int(doc.get("tokens", 0)), float(doc.get("seconds", 0.0)), dict(doc.get("fingerprint", {})))  # fmt: skip


def _require_input_grad(model: nn.Module) -> Callable[[], None]:
    """Make the activations carry gradients without any parameter doing so (no weight gradients are
    computed): the input embeddings' output is made a leaf that requires grad. Returns the undo."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None:
        raise MixprecError(
            f"{type(model).__name__} has no input embeddings: the gradient score needs a causal LM"
        )
    handle = emb.register_forward_hook(lambda m, a, out: out.detach().requires_grad_(True))
    return handle.remove


def _batch_tokens(batch: torch.Tensor) -> int:
    return int(batch.numel())


class GradientScoreHooks:
    """The gradient score's per-Linear work, shared by the whole-model scorer (gradient_scores) and the
    block-by-block one (layerwise_scores): a forward hook saves the Linear's input X; when the gradient
    g of its output arrives, every candidate runs on X and sum((g * (Y_q - Y))^2) is added to
    `totals[name][candidate]`."""

    def __init__(self, layers: Mapping[str, dict[str, nn.Module]], totals: dict[str, dict[str, float]]):
        self.layers = layers
        self.totals = totals
        self.saved: dict[str, torch.Tensor] = {}

    def attach(self, modules: Mapping[str, nn.Module], names: Iterable[str]) -> list[Any]:
        """Forward hooks on the Linears `names`; returns their handles (remove them when done)."""
        return [modules[n].register_forward_hook(self._forward_hook(n)) for n in names]

    def _forward_hook(self, name: str):
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            if not out.requires_grad:
                return
            self.saved[name] = args[0].detach()
            out.register_hook(lambda g: self._score(name, module, g))

        return hook

    def _score(self, name: str, module: nn.Module, g: torch.Tensor) -> None:
        x_saved = self.saved.pop(name)
        with torch.no_grad():
            y = module(x_saved).float()
            g32 = g.float()
            for cand, qlin in self.layers[name].items():
                diff = qlin(x_saved).float().sub_(y).mul_(g32)
                self.totals[name][cand] += float(diff.reshape(-1).double().square().sum())


def gradient_scores(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    layers: CandidateLayers,
    *,
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lm_loss,
    progress: Callable[[], None] | None = None,
) -> dict[str, dict[str, float]]:
    """{Linear: {candidate: sum over batches of sum((g * (Y_q - Y))^2)}} (see the module docstring).
    `layers`: candidate_layers(...), one Linear's built at a time. The model is left as it was (hooks
    removed, grads cleared)."""
    modules = dict(model.named_modules())
    totals = {n: dict.fromkeys(layers.schemes, 0.0) for n in layers}
    hooks = GradientScoreHooks(layers, totals)
    requires = {p: p.requires_grad for p in model.parameters()}
    was_training = model.training
    handles = hooks.attach(modules, list(layers))
    undo = _require_input_grad(model)
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        model.eval()
        for batch in batches:
            # one sequence at a time: the backward's activations, the logits and the saved inputs scale
            # with the rows (a batch of 4 x 512 tokens held 6 GiB on SmolLM2-135M). Each row's mean loss is
            # weighted by its share of the batch's rows, so its gradients are the batch's (windows of one
            # length: the batch's mean is the mean of its rows' means), and the scores sum the same terms
            for row in split_rows(batch):
                loss = loss_fn(model, row) * row_weight(row, batch)
                loss.backward()
                hooks.saved.clear()
            if progress is not None:
                progress()
    finally:
        undo()
        for h in handles:
            h.remove()
        for p, r in requires.items():
            p.requires_grad_(r)
        model.train(was_training)
    return totals


def split_rows(batch: Any) -> list[Any]:
    """The batch's sequences, each a batch of one (a 1-D batch, or anything but token ids, is one)."""
    return list(batch.split(1)) if isinstance(batch, torch.Tensor) and batch.dim() > 1 else [batch]


def _row_count(batch: Any) -> int:
    return len(batch) if isinstance(batch, torch.Tensor) and batch.dim() > 1 else 1


def row_weight(row: Any, batch: Any) -> float:
    """A sequence's share of its batch: its loss's weight, so that the rows' gradients sum to the batch's."""
    return _row_count(row) / _row_count(batch)


def _next_token_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Sum over positions of KL(ref || candidate) of the next-token distributions (nats)."""
    ref = torch.log_softmax(ref_logits.float(), dim=-1)
    cand = torch.log_softmax(logits.float(), dim=-1)
    return float((ref.exp() * (ref - cand)).sum())


@torch.no_grad()
def run_instead(module: nn.Module, layer: nn.Module):
    """A forward hook on `module` that returns `layer`'s output instead (its handle)."""
    return module.register_forward_hook(lambda mod, a, out: layer(a[0]).to(out.dtype))


def kl_scores(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    layers: CandidateLayers,
    *,
    progress: Callable[[], None] | None = None,
) -> dict[str, dict[str, float]]:
    """{Linear: {candidate: mean next-token KL (nats per token) of the logits when that Linear's fused
    group runs in the candidate}}: one group at a time, every other Linear in high precision. The
    group's KL is shared among its members in proportion to their weights' sizes, so that the
    members' sum (the group's score, `Scores.group_scores`) is the group's KL."""
    modules = dict(model.named_modules())
    groups = fused_groups(layers)
    was_training = model.training
    model.eval()
    try:
        refs = [model(input_ids=b).logits.float() for b in batches]
        tokens = sum(r.shape[0] * r.shape[1] for r in refs)
        totals = {n: dict.fromkeys(layers.schemes, 0.0) for n in layers}
        for members in groups.values():
            sizes = [modules[m].weight.numel() for m in members]
            for cand in layers.schemes:
                swap = [run_instead(modules[m], layers.layer(m, cand)) for m in members]
                try:
                    kl = sum(_next_token_kl(r, model(input_ids=b).logits) for r, b in zip(refs, batches))
                finally:
                    for h in swap:
                        h.remove()
                for m, size in zip(members, sizes):
                    totals[m][cand] = max(kl, 0.0) / tokens * size / sum(sizes)  # rounding: never below 0
                if progress is not None:
                    progress()
    finally:
        model.train(was_training)
    return totals


def score_model(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    candidates: Sequence[InferenceScheme],
    *,
    method: str = "gradient",
    ignore: Sequence[str] | None = None,
    default_ignore: bool = True,
    weight_dtype: torch.dtype | None = None,
    progress: Callable[[str, int], Callable[[], None]] | None = None,
    rounded: Mapping[str, Mapping[str, QuantizedTensor]] | None = None,
) -> Scores:
    """Scores of every scorable Linear of `model` (a causal LM, fp32 recommended on a CPU) for every
    candidate, from `batches` of token ids; `progress(label, total)` -> advance (optional).
    weight_dtype: the dtype the checkpoint stores the weights in (they are quantized from it).
    rounded: {candidate: {Linear: its weight as an algorithm rounded it}} (algorithm_candidates.py),
    scored instead of round to nearest's."""
    if method not in METHODS:
        raise MixprecError(f"unknown --score {method!r}; known: {', '.join(METHODS)}")
    batches = list(batches)
    if not batches:
        raise MixprecError("no calibration batches to score with")
    started = time.perf_counter()
    linears = scorable_linears(model, ignore, default_ignore=default_ignore)
    if not linears:
        raise MixprecError(
            f"{type(model).__name__} has no Linear a scheme may take (all ignored or of odd dims)"
        )
    amax = static_input_amax(model, batches, list(linears), candidates)
    layers = candidate_layers(
        model, list(linears), candidates, amax, weight_dtype=weight_dtype, rounded=rounded
    )
    if method == "gradient":
        advance = progress("scoring (forward + backward per batch)", len(batches)) if progress else None
        raw = gradient_scores(model, batches, layers, progress=advance)
    else:
        total = len(fused_groups(linears)) * len(candidates)
        advance = progress("scoring (one group and candidate at a time)", total) if progress else None
        raw = kl_scores(model, batches, layers, progress=advance)
    return scores_of(method, linears, candidates, raw, batches, time.perf_counter() - started)


def scores_of(method: str, linears: Mapping[str, tuple[int, int]], candidates: Sequence[InferenceScheme],
              raw: Mapping[str, Mapping[str, float]], batches: Sequence[torch.Tensor], seconds: float) -> Scores:  # fmt: skip
    """The Scores of a scorer's raw {Linear: {candidate: score}} (KEPT added, scoring 0)."""
    names = [KEPT, *(s.name for s in candidates)]
    per_layer = {n: {KEPT: 0.0, **raw[n]} for n in linears}
    return Scores(
        method=method, candidates=names, layers=per_layer, shapes=dict(linears),
        allowed=allowed_schemes(linears, candidates), batches=len(batches),
        tokens=sum(_batch_tokens(b) for b in batches), seconds=seconds,
    )  # fmt: skip


__all__ = [
    "KEPT",
    "METHODS",
    "SCORES_SCHEMA_VERSION",
    "CandidateLayers",
    "GradientScoreHooks",
    "Scores",
    "allowed_schemes",
    "candidate_layers",
    "candidate_schemes",
    "gradient_scores",
    "kl_scores",
    "row_weight",
    "run_instead",
    "scorable_linears",
    "score_model",
    "scores_of",
    "split_rows",
    "static_input_amax",
]
