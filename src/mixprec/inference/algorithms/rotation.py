"""Rotation (SpinQuant's R1 and R2, offline): orthogonal matrices fused into the weights of an RMSNorm
decoder model, so that the model computes the same function while its weights (and the activations
the Linears read) lose their outlier channels — what block-scaled FP4/FP8 rounding suffers from.

    record = rotate_model_(model, seed=0)         # in place; the model's logits are unchanged
    record["r1_size"], record["untied_lm_head"]   # what was done (record["matrices"]: the fp64 matrices)

The invariance: an RMSNorm with its weight folded away commutes with an orthogonal R (rms(xR) =
rms(x)), so the residual stream can be carried rotated, x -> x R1:
1. every RMSNorm's weight is folded into the Linears that read its output (input_layernorm -> q/k/v,
   post_attention_layernorm -> gate/up, the final norm -> lm_head) and set to 1;
2. a head tied to the embeddings is untied (a copy; config.tie_word_embeddings = False): R1 acts on the
   embedding's columns from the right and on the head after the final norm's weight is folded in, so
   the two can no longer share one tensor (SmolLM2-135M: +57 MB in bf16);
3. R1: embed_tokens.weight <- E R1; the Linears that read the stream (q/k/v, gate/up, lm_head)
   W <- W R1; the Linears that write it (o_proj, down_proj) W <- R1^T W, a bias b <- R1^T b;
4. R2 (per attention head, head_dim x head_dim): each value head's output is rotated (v_proj's rows per
   head block, W_v <- R2^T W_v, b_v <- R2^T b_v) and o_proj's input per head block W_o <- W_o R2.
   Attention mixes value rows with softmax weights, so each query head's output is rotated by the same
   R2; under grouped-query attention v_proj has num_key_value_heads blocks, o_proj's input
   num_attention_heads blocks, one R2 for all of them.
Every weight is computed once in fp64 (fold, R1 and R2 together) and cast back to its own dtype: one
rounding per weight.

Not rotated: the input of down_proj (the SwiGLU product). Rotating it needs an online Hadamard transform
of the activation inside the MLP (SpinQuant's R4, QuaRot's online Hadamard), which the serving engines
(vLLM, SGLang, TensorRT-LLM) do not run on an ordinary checkpoint; so down_proj's input channels keep
their outliers and the gain is mostly where R1 and R2 reach. Neither is the query/key path (R3): it sits
after RoPE and would also need an online transform.

Measured (bench/rotation_perplexity.py, SmolLM2-135M, RTN): rotation made every FP4 scheme worse there,
weight-only included. The inputs of q/k/v and gate/up carry one massive channel (a third to a half of
their energy); before rotation its weights are small and FP4 rounds them with small errors, after R1
that energy meets every weight's full rounding error. Rotation is for activation outliers and pairs
with GPTQ (SpinQuant, QuaRot); alone on a weight-only scheme it is not a win by default.

Refused, with a MixprecError before anything is changed: a model whose norms are not RMSNorm (a
LayerNorm subtracts the mean and adds a bias: no rotation commutes with it), an RMSNorm with a bias or
with a weight offset (Gemma's 1 + w: its forward is probed, not its class name), and any block structure
other than the recognised one (the message names what is missing or extra).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError

READERS_ATTN = ("q_proj", "k_proj", "v_proj")
READERS_MLP = ("gate_proj", "up_proj")
# children of a layer's attention that may hold parameters besides q/k/v/o: per-head norms of q and k
# (Qwen3), which act on q_proj's / k_proj's output, which no rotation here changes
ATTN_EXTRA_OK = ("q_norm", "k_norm")
LAYER_CHILDREN = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
# rows (or columns) of a weight rotated at once: bounds the fp64 working copy of a large embedding
CHUNK_ROWS = 8192


def hadamard(n: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix of order n (a power of two), normalised: orthogonal, fp64."""
    if n < 1 or n & (n - 1):
        raise MixprecError(f"a Sylvester Hadamard matrix needs a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def random_orthogonal(m: int, generator: torch.Generator) -> torch.Tensor:
    """A random m x m orthogonal matrix (Haar: QR of a Gaussian with R's diagonal signs moved into Q), fp64."""
    q, r = torch.linalg.qr(torch.randn(m, m, dtype=torch.float64, generator=generator))
    signs = torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(torch.float64)
    return (q * signs).contiguous()


def odd_factor(n: int) -> tuple[int, int]:
    """(2^k, m) with n = 2^k * m and m odd."""
    power = n & -n
    return power, n // power


def orthogonal_matrix(n: int, seed: int = 0) -> torch.Tensor:
    """An n x n orthogonal matrix in fp64, deterministic from the seed: diag(random signs) @ H (Sylvester
    Hadamard) when n is a power of two; otherwise n = 2^k * m with m odd and the matrix is the Kronecker
    product of such a signed 2^k Hadamard with a random orthogonal m x m (SmolLM2's 576 = 64 * 9), so every
    entry still has magnitude about 1/sqrt(n) on average and an outlier channel is spread over all n."""
    if not isinstance(n, int) or n < 1:
        raise MixprecError(f"an orthogonal matrix needs a positive size, got {n!r}")
    generator = torch.Generator().manual_seed(seed)
    power, odd = odd_factor(n)
    signs = torch.randint(0, 2, (power,), generator=generator, dtype=torch.int64).double() * 2 - 1
    signed = signs[:, None] * hadamard(power)
    if odd == 1:
        return signed
    return torch.kron(signed, random_orthogonal(odd, generator))


@dataclass
class RotatedLayer:
    """One decoder layer's modules that the rotation touches."""

    index: int
    input_norm: nn.Module
    post_norm: nn.Module
    q: nn.Linear
    k: nn.Linear
    v: nn.Linear
    o: nn.Linear
    gate: nn.Linear
    up: nn.Linear
    down: nn.Linear


@dataclass
class RotationPlan:
    """Everything rotate_model_ changes, found and checked before the first change."""

    embed: nn.Embedding
    head: nn.Linear
    final_norm: nn.Module
    layers: list[RotatedLayer]
    hidden: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    tied: bool


def _param_children(module: nn.Module) -> list[str]:
    return [name for name, child in module.named_children() if any(True for _ in child.parameters())]


def _linear(parent: nn.Module, name: str, where: str, loaded: bool = True) -> nn.Linear:
    child = getattr(parent, name, None)
    if not isinstance(child, nn.Linear):
        found = "missing" if child is None else f"a {type(child).__name__}, not an nn.Linear"
        raise MixprecError(f"rotate: {where}.{name} is {found}: block structure not recognised")
    if not child.weight.is_floating_point() or (loaded and child.weight.is_meta):
        raise MixprecError(
            f"rotate: {where}.{name} has no floating-point weight in memory ({child.weight.dtype})"
        )
    return child


def check_rms_norm(norm: Any, where: str, hidden: int, loaded: bool = True) -> nn.Module:
    """The norm must compute weight * x / rms(x) (probed on an input with a large mean, which tells it
    from a LayerNorm, and with the norm's own weight, which tells it from Gemma's (1 + w)); loaded=False
    (its weight still on the meta device): everything but the probe, which check_rms_norm runs once the
    weight is read."""
    if norm is None:
        raise MixprecError(f"rotate: {where} is missing: block structure not recognised")
    if isinstance(norm, nn.LayerNorm):
        raise MixprecError(
            f"rotate: {where} is a LayerNorm (mean subtraction, bias): no rotation commutes with it; "
            "rotation needs RMSNorm models (Llama, Qwen2/3, Mistral)"
        )
    if getattr(norm, "bias", None) is not None:
        raise MixprecError(
            f"rotate: {where} ({type(norm).__name__}) has a bias: it does not commute with a rotation"
        )
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (hidden,):
        raise MixprecError(f"rotate: {where} ({type(norm).__name__}) has no weight of shape ({hidden},)")
    if not loaded:
        return norm
    gen = torch.Generator().manual_seed(1234)
    x = (torch.randn(4, hidden, generator=gen, dtype=torch.float32) + 3.0).to(weight.device, weight.dtype)
    with torch.no_grad():
        got = norm(x).float()
        xf = x.float()
        expected = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()
    tolerance = 2e-2 if weight.dtype in (torch.bfloat16, torch.float16) else 1e-4
    if (
        got.shape != expected.shape
        or float((got - expected).norm() / expected.norm().clamp_min(1e-30)) > tolerance
    ):
        raise MixprecError(
            f"rotate: {where} ({type(norm).__name__}) does not compute weight * x / rms(x) (a LayerNorm, "
            "or an RMSNorm with a weight offset): no rotation commutes with it"
        )
    return norm


def check_layer(index: int, layer: nn.Module, hidden: int, loaded: bool = True) -> RotatedLayer:
    where = f"model.layers.{index}"
    missing = [c for c in LAYER_CHILDREN if getattr(layer, c, None) is None]
    if missing:
        raise MixprecError(f"rotate: {where} has no {', '.join(missing)}: block structure not recognised")
    extra = [c for c in _param_children(layer) if c not in LAYER_CHILDREN]
    if extra:
        raise MixprecError(
            f"rotate: {where} has modules with weights the rotation does not know: {', '.join(extra)} "
            "(e.g. extra norms on the residual stream): block structure not recognised"
        )
    attn, mlp = layer.self_attn, layer.mlp
    linears = {n: _linear(attn, n, f"{where}.self_attn", loaded) for n in (*READERS_ATTN, "o_proj")}
    linears.update({n: _linear(mlp, n, f"{where}.mlp", loaded) for n in (*READERS_MLP, "down_proj")})
    for module, allowed, name in ((attn, (*READERS_ATTN, "o_proj", *ATTN_EXTRA_OK), "self_attn"),
                                  (mlp, (*READERS_MLP, "down_proj"), "mlp")):  # fmt: skip
        extra = [c for c in _param_children(module) if c not in allowed]
        if extra:
            raise MixprecError(
                f"rotate: {where}.{name} has modules the rotation does not know: {', '.join(extra)}"
            )
    for n in (*READERS_ATTN, *READERS_MLP):
        if linears[n].in_features != hidden:
            raise MixprecError(
                f"rotate: {where}.{n} reads {linears[n].in_features} features, not the hidden {hidden}"
            )
    for n in ("o_proj", "down_proj"):
        if linears[n].out_features != hidden:
            raise MixprecError(
                f"rotate: {where}.{n} writes {linears[n].out_features} features, not the hidden {hidden}"
            )
    return RotatedLayer(
        index,
        check_rms_norm(layer.input_layernorm, f"{where}.input_layernorm", hidden, loaded),
        check_rms_norm(layer.post_attention_layernorm, f"{where}.post_attention_layernorm", hidden, loaded),
        linears["q_proj"], linears["k_proj"], linears["v_proj"], linears["o_proj"],
        linears["gate_proj"], linears["up_proj"], linears["down_proj"],
    )  # fmt: skip


def plan_rotation(model: nn.Module, loaded: bool = True) -> RotationPlan:
    """Find and check every module rotate_model_ touches; MixprecError naming what is missing.
    loaded=False: a skeleton whose weights are still on the meta device (rotation_checkpoint.py): the
    structure is checked, the norms' probes wait for their weights."""
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if decoder is None or not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise MixprecError(
            f"rotate: {type(model).__name__} has no model.layers (a Llama-style decoder: model.embed_tokens, "
            "model.layers, model.norm, lm_head): block structure not recognised"
        )
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    num_heads = getattr(config, "num_attention_heads", None)
    if not isinstance(hidden, int) or not isinstance(num_heads, int):
        raise MixprecError("rotate: the model's config has no hidden_size / num_attention_heads")
    num_kv = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or hidden // num_heads
    embed = getattr(decoder, "embed_tokens", None)
    if not isinstance(embed, nn.Embedding) or embed.embedding_dim != hidden:
        raise MixprecError(f"rotate: model.embed_tokens is not an nn.Embedding of width {hidden}")
    head = _linear(model, "lm_head", type(model).__name__, loaded)
    if head.in_features != hidden:
        raise MixprecError(f"rotate: lm_head reads {head.in_features} features, not the hidden {hidden}")
    extra = [c for c in _param_children(decoder) if c not in ("embed_tokens", "layers", "norm")]
    if extra:
        raise MixprecError(
            f"rotate: model has modules with weights the rotation does not know: {', '.join(extra)}"
        )
    final_norm = check_rms_norm(getattr(decoder, "norm", None), "model.norm", hidden, loaded)
    checked = [check_layer(i, layer, hidden, loaded) for i, layer in enumerate(layers)]
    for layer in checked:
        if layer.v.out_features != num_kv * head_dim or layer.o.in_features != num_heads * head_dim:
            raise MixprecError(
                f"rotate: model.layers.{layer.index}: v_proj writes {layer.v.out_features} and o_proj reads "
                f"{layer.o.in_features} features, not {num_kv} and {num_heads} heads of {head_dim}"
            )
    # on the meta device every data pointer is 0: there only the shared Parameter says tied
    tied = head.weight is embed.weight or (loaded and head.weight.data_ptr() == embed.weight.data_ptr())
    return RotationPlan(embed, head, final_norm, checked, hidden, head_dim, num_heads, num_kv, tied)


@torch.no_grad()
def _set_(param: torch.Tensor, value: torch.Tensor) -> None:
    param.copy_(value.to(param.dtype))


def _rotate_row_blocks(w: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    """R2^T applied to each head_dim block of rows (v_proj's output heads): [heads*hd, ...] fp64."""
    hd = r2.shape[0]
    blocks = w.reshape(w.shape[0] // hd, hd, -1)
    return torch.matmul(r2.t(), blocks).reshape(w.shape)


@torch.no_grad()
def rotate_reader_(
    linear: nn.Linear, scale: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor | None = None
) -> None:
    """W <- (W diag(scale)) R1, in fp64 in row chunks; with r2 (v_proj) each head's rows are rotated
    too, W <- R2^T W per head block, and so is its bias."""
    weight = linear.weight
    r = r1.to(weight.device)
    s = scale.double().to(weight.device)
    if r2 is not None:  # v_proj: kv heads x head_dim rows, done whole
        r2 = r2.to(weight.device)
        _set_(weight, _rotate_row_blocks((weight.double() * s) @ r, r2))
        if linear.bias is not None:
            _set_(linear.bias, _rotate_row_blocks(linear.bias.double()[:, None], r2)[:, 0])
        return
    for start in range(0, weight.shape[0], CHUNK_ROWS):
        rows = weight[start : start + CHUNK_ROWS]
        _set_(rows, (rows.double() * s) @ r)


@torch.no_grad()
def rotate_writer_(linear: nn.Linear, r1: torch.Tensor, r2: torch.Tensor | None = None) -> None:
    """W <- R1^T W, b <- R1^T b; with r2 (o_proj) each head block of its input columns W <- W R2."""
    w = linear.weight.double()
    r = r1.to(w.device)
    rotated = r.t() @ w
    if r2 is not None:
        hd = r2.shape[0]
        rotated = (rotated.reshape(w.shape[0], -1, hd) @ r2.to(w.device)).reshape(w.shape)
    _set_(linear.weight, rotated)
    if linear.bias is not None:
        _set_(linear.bias, r.t() @ linear.bias.double())


@torch.no_grad()
def rotate_layer_(layer: RotatedLayer, r1: torch.Tensor, r2: torch.Tensor | None) -> None:
    """One decoder layer: its norms folded into the Linears that read them (then set to 1), R1 on the
    readers' inputs and the writers' outputs, R2 (when given) on v_proj's heads and o_proj's input."""
    g_attn, g_mlp = layer.input_norm.weight.detach().clone(), layer.post_norm.weight.detach().clone()
    rotate_reader_(layer.q, g_attn, r1)
    rotate_reader_(layer.k, g_attn, r1)
    rotate_reader_(layer.v, g_attn, r1, r2)
    rotate_writer_(layer.o, r1, r2)
    rotate_reader_(layer.gate, g_mlp, r1)
    rotate_reader_(layer.up, g_mlp, r1)
    rotate_writer_(layer.down, r1)
    layer.input_norm.weight.fill_(1.0)
    layer.post_norm.weight.fill_(1.0)


@torch.no_grad()
def _untie_(model: nn.Module, plan: RotationPlan) -> None:
    """A head sharing the embedding's tensor gets a copy; the config says untied in any case (an engine
    that follows a config saying tied, as vLLM does, would serve the rotated embedding as the head)."""
    if plan.tied:
        plan.head.weight = nn.Parameter(
            plan.embed.weight.detach().clone(), requires_grad=plan.embed.weight.requires_grad
        )
    config = getattr(model, "config", None)
    if config is not None:
        config.tie_word_embeddings = False
        text = config.get_text_config() if hasattr(config, "get_text_config") else None
        if text is not None and text is not config:
            text.tie_word_embeddings = False


@torch.no_grad()
def rotate_model_(model: nn.Module, seed: int = 0, r2: bool = True) -> dict[str, Any]:
    """Rotate a loaded Hugging Face RMSNorm decoder model in place (the module docstring says what and
    why); its logits stay the same up to the rounding of each weight to its dtype. Returns the record:
    seed, sizes, what was done, and the fp64 matrices (`matrices`: r1, r2 or None). MixprecError, before
    any change, for a model without the invariance."""
    plan = plan_rotation(model)
    r1 = orthogonal_matrix(plan.hidden, seed)
    r2_matrix = orthogonal_matrix(plan.head_dim, seed + 1) if r2 else None
    _untie_(model, plan)
    embed = plan.embed.weight
    for start in range(0, embed.shape[0], CHUNK_ROWS):
        _set_(
            embed[start : start + CHUNK_ROWS],
            embed[start : start + CHUNK_ROWS].double() @ r1.to(embed.device),
        )
    for layer in plan.layers:
        rotate_layer_(layer, r1, r2_matrix)
    rotate_reader_(plan.head, plan.final_norm.weight.detach().clone(), r1)
    plan.final_norm.weight.fill_(1.0)
    return {**rotation_record(plan, seed, r2), "matrices": {"r1": r1, "r2": r2_matrix}}


def rotation_record(plan: RotationPlan, seed: int, r2: bool) -> dict[str, Any]:
    """What a rotation did, JSON-ready (the matrices aside: the seed rebuilds them)."""
    return {
        "algorithm": "rotate",
        "seed": seed,
        "r1_size": plan.hidden,
        "r1_kind": _kind(plan.hidden),
        "r2_size": plan.head_dim if r2 else None,
        "r2_kind": _kind(plan.head_dim) if r2 else None,
        "layers": len(plan.layers),
        "norms_folded": 2 * len(plan.layers) + 1,
        "untied_lm_head": plan.tied,
        "down_proj_input": "not rotated (needs an online Hadamard the serving engines do not run)",
    }


def _kind(n: int) -> str:
    power, odd = odd_factor(n)
    return "signed Hadamard" if odd == 1 else f"signed Hadamard {power} (x) random orthogonal {odd}"
