"""The gradient score of `--scheme auto`, one transformer block at a time: what scores.gradient_scores
computes on the whole model in fp32, with memory for one block instead of the model and its backward.

    amax, totals = layerwise_gradient_scores(model_dir, config, ckpt, batches, names, candidates)

Three walks over the checkpoint, on a skeleton whose parameters stay on the meta device until their block
is at hand (the calibration walk's pieces, inference/calibration/layerwise.py):

1. **Forward, first block first.** The first block's inputs come from the embedding rows the calibration
   tokens use (calibration/outside.py). Each block is read, cast to fp32, and run on every sequence
   (one at a time, as the whole-model scorer runs them); its input hidden states go to a spill file on
   disk, and the inputs of its Linears feed max observers (the calibrated candidates' input amax, over
   every batch). Its weights are then dropped.
2. **The loss.** The final norm is read whole; the output head (or the tied input embedding) is read in
   slices of its rows. The next-token cross-entropy is formed slice by slice (a running logsumexp; the
   head is read twice), and with it the loss's gradient at the last block's outputs, each sequence's
   loss weighted by its share of its batch as in gradient_scores.
3. **Backward, last block first.** Each block is read again, its forward rerun from its spilled inputs
   with autograd on, and the gradient of its outputs pushed through it: the Linears' hooks
   (scores.GradientScoreHooks) score every candidate as on the whole model; the gradient at the block's
   inputs is the previous block's output gradient.

The scores equal the whole-model scorer's up to the rounding of sums taken in another order (the
slice-wise softmax; tested to a relative 1e-4). The input amax are observed on each sequence's forward
(the whole-model calibration runs whole batches: a GEMM of other rows may round its last bit apart).

Peak memory (nothing of it grows with the number of blocks):
    R0                          interpreter, torch, transformers, the skeleton (~0.4 GiB)
  + one block's weights         in fp32 (twice the bf16 checkpoint's block)
  + one sequence's autograd     the block's activations on seq_len tokens, and the candidates' outputs
  + hidden states, gradients    two copies of samples x seq_len x hidden x 4 bytes
  + the compact embedding       distinct calibration tokens x hidden x 4 bytes
  + one slice of the head       <= 64 MiB of its rows in fp32, and the logits of that slice
On disk, beside the output: blocks x samples x seq_len x hidden x 4 bytes of spilled hidden states,
removed at the end.

Where it does not apply (`unsupported_reason`): a model whose logits are not the final norm's output
times the head (logit soft-capping or scaling in the config, a head with a bias), or whose final norm is
not found under the block list's parent; the whole-model scorer serves those.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from mixprec.errors import MixprecError
from mixprec.inference.calibration.layerwise import block_inputs, observing, run_block, skeleton
from mixprec.inference.calibration.observers import MaxObserver
from mixprec.inference.calibration.outside import OutsideLoader, check_captured, input_embedding, load_into
from mixprec.inference.checkpoint.safetensors_io import Checkpoint, ShardReader, read_tensor_infos
from mixprec.inference.schemes import InferenceScheme
from mixprec.kernels.allocator import release_free_memory
from mixprec.scaling import QuantizedTensor
from mixprec.sensitivity.scores import (
    CandidateLayers,
    GradientScoreHooks,
    row_weight,
    scorable_linears,
    split_rows,
)

FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm")
# config keys of models whose logits are more than norm -> head (soft-capping, scaling)
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
HEAD_SLICE_BYTES = 64 << 20  # one slice of the head's rows, in fp32, and the logits formed from it

Progress = Callable[[str, int], Callable[[], None]]


def unsupported_reason(
    model: nn.Module, config: Mapping[str, Any], ckpt: Checkpoint, prefix: str
) -> str | None:
    """Why the block-by-block gradient score cannot run on this model (None: it can)."""
    transforms = [k for k in LOGIT_TRANSFORMS if config.get(k) not in (None, 1, 1.0)]
    if transforms:
        return f"its logits are transformed after the head ({', '.join(transforms)} in config.json)"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return "its output head is not a Linear without bias"
    if _head_tensor(model, ckpt) is None:
        return "the checkpoint holds no output head weight (lm_head.weight, or an embedding tied to it)"
    if _final_norm(model, prefix) is None:
        return f"no final norm ({', '.join(FINAL_NORM_NAMES)}) beside {prefix}"
    return None


def _final_norm(model: nn.Module, prefix: str) -> tuple[str, nn.Module] | None:
    parent = prefix.rpartition(".")[0]
    base = model.get_submodule(parent) if parent else model
    for attr in FINAL_NORM_NAMES:
        m = getattr(base, attr, None)
        if isinstance(m, nn.Module):
            return (f"{parent}.{attr}" if parent else attr), m
    return None


def _head_tensor(model: nn.Module, ckpt: Checkpoint) -> str | None:
    """The checkpoint name of the output head's weight: its own, else the input embedding's when tied."""
    head = model.get_output_embeddings()
    own = [f"{n}.weight" for n, m in model.named_modules() if m is head]
    for name in own:
        if name in ckpt.tensors and ckpt.tensors[name].shape == tuple(head.weight.shape):
            return name
    if getattr(model.config, "tie_word_embeddings", False):
        found = input_embedding(model, ckpt)
        if found is not None and ckpt.tensors[found[1]].shape == tuple(head.weight.shape):
            return found[1]
    return None


def sequences(batches: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[float]]:
    """(each batch's sequences as batches of one, each one's loss weight), the split and the weights
    gradient_scores uses (scores.split_rows, scores.row_weight)."""
    rows, weights = [], []
    for b in batches:
        for row in split_rows(b):
            rows.append(row if row.dim() > 1 else row.reshape(1, -1))
            weights.append(row_weight(row, b))
    return rows, weights


@dataclass
class ScoringSkeleton:
    """The model built on the meta device for a block-by-block scoring, with what the walks need."""

    model: nn.Module
    prefix: str  # the block list's name
    blocks: list[nn.Module]
    names: dict[str, tuple[int, int]]  # the scorable Linears: {name: (out_features, in_features)}
    head: str  # the checkpoint name of the output head's weight (the input embedding's, when tied)
    norm: str  # the final norm's module name


def scoring_skeleton(model_dir: Path, config: dict[str, Any], ckpt: Checkpoint, ignore: Sequence[str] | None,
                     default_ignore: bool) -> tuple[ScoringSkeleton | None, str | None]:  # fmt: skip
    """(the skeleton, None), or (None, why the block-by-block score does not apply to this model)."""
    try:
        model, prefix, blocks, renamed, _ = skeleton(model_dir, config, ckpt, [])
    except MixprecError as e:
        return None, str(e)
    if renamed:
        return None, "the checkpoint names some tensors differently than the model"
    names = scorable_linears(model, ignore, default_ignore=default_ignore)
    stray = [n for n in names if not n.startswith(prefix + ".")]
    if stray:
        return (
            None,
            f"Linears outside {prefix} are scored (e.g. {stray[0]}); the walk scores those inside only",
        )
    reason = unsupported_reason(model, config, ckpt, prefix)
    if reason is not None:
        return None, reason
    head = _head_tensor(model, ckpt)
    norm = _final_norm(model, prefix)
    assert head is not None and norm is not None  # unsupported_reason checked both
    return ScoringSkeleton(model, prefix, list(blocks), names, head, norm[0]), None


def layerwise_gradient_scores(
    skel: ScoringSkeleton,
    ckpt: Checkpoint,
    batches: Sequence[torch.Tensor],
    candidates: Sequence[InferenceScheme],
    *,
    weight_dtype: torch.dtype,
    spill_dir: Path | None = None,
    progress: Progress | None = None,
    rounded: Mapping[str, Mapping[str, QuantizedTensor]] | None = None,
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """({Linear: input amax} (empty when no candidate is calibrated), {Linear: {candidate: score}}) of
    the skeleton's scorable Linears, from `batches` of token ids (see the module docstring).
    weight_dtype: the checkpoint's, which the candidates quantize from. spill_dir: where the hidden
    states' temporary directory goes (None: the system's). rounded: {candidate: {Linear: its weight as
    an algorithm rounded it}} (algorithm_candidates.py), scored instead of round to nearest's."""
    rows, weights = sequences(batches)
    names = list(skel.names)
    observe = any(s.needs_calibration for s in candidates)
    with (
        ShardReader() as reader,
        tempfile.TemporaryDirectory(prefix=".mixprec-scores-", dir=spill_dir) as tmp,
    ):
        walk = _Walk(skel, ckpt, reader, Path(tmp), progress)
        amax = walk.forward(rows, names, observe)
        grads = walk.loss_gradients(rows, weights)
        totals = walk.backward(grads, names, candidates, amax, weight_dtype, rounded)
    return amax, totals


class _Walk:
    """The three walks of layerwise_gradient_scores over one skeleton (see the module docstring)."""

    def __init__(self, skel: ScoringSkeleton, ckpt: Checkpoint, reader: ShardReader, spill: Path,
                 progress: Progress | None) -> None:  # fmt: skip
        self.model, self.prefix, self.blocks = skel.model, skel.prefix, skel.blocks
        self.head, self.norm = ckpt.tensors[skel.head], skel.norm
        self.ckpt, self.reader, self.spill = ckpt, reader, spill
        self.progress = progress
        self.modules = dict(self.model.named_modules())
        # each sequence's other block arguments (masks, rotary tables)
        self.rest: list[tuple[tuple, dict]] = []
        self.finals: list[torch.Tensor] = []  # the last block's outputs

    def _advance(self, label: str) -> Callable[[], None]:
        return self.progress(label, len(self.blocks)) if self.progress is not None else (lambda: None)

    def _load(self, i: int) -> nn.Module:
        """Block i read from the checkpoint, in fp32 (the whole-model scorer's precision)."""
        own = f"{self.prefix}.{i}."
        load_into(self.model, self.ckpt, [n for n in self.ckpt.tensors if n.startswith(own)], self.reader)
        block = self.blocks[i].float()
        for p in block.parameters():
            p.requires_grad_(False)
        return block

    def _drop(self, i: int) -> None:
        self.blocks[i].to("meta")
        release_free_memory()

    def forward(self, rows: list[torch.Tensor], names: Sequence[str], observe: bool) -> dict[str, float]:
        """Walk 1: spill each block's inputs; the Linears' input amax when `observe`."""
        outside = OutsideLoader(self.model, self.ckpt, self.reader, self.prefix, rows)
        self.model.float()  # the compact embedding and what was read whole: fp32, as the whole-model scorer
        observers = {n: MaxObserver() for n in names} if observe else {}
        advance = self._advance("scoring: forward, block by block")
        with torch.no_grad():
            captured = block_inputs(self.model, self.blocks[0], rows)
            outside.remove()
            check_captured(captured)
            for i in range(len(self.blocks)):
                own = f"{self.prefix}.{i}."
                block = self._load(i)
                save_file({f"row{j}": args[0].float().contiguous() for j, (args, _) in enumerate(captured)},
                          str(self._spill_path(i)))  # fmt: skip
                hooks = [self.modules[n].register_forward_pre_hook(observing(o))
                         for n, o in observers.items() if n.startswith(own)]  # fmt: skip
                run_block(block, captured, in_place=True)
                for h in hooks:
                    h.remove()
                self._drop(i)
                advance()
        self.rest = [(args[1:], kwargs) for args, kwargs in captured]
        self.finals = [args[0] for args, _ in captured]
        return {n: o.amax() for n, o in observers.items()}

    def _spill_path(self, i: int) -> Path:
        return self.spill / f"block-{i:05d}.safetensors"

    def loss_gradients(self, rows: list[torch.Tensor], weights: list[float]) -> list[torch.Tensor]:
        """Walk 2: the gradient of the weighted next-token loss at the last block's outputs, per sequence."""
        norm = self.modules[self.norm]
        load_into(
            self.model,
            self.ckpt,
            [n for n in self.ckpt.tensors if n.startswith(self.norm + ".")],
            self.reader,
        )
        norm.float()
        finals = [f.detach().float().requires_grad_(True) for f in self.finals]
        normed = [norm(f)[0, :-1] for f in finals]  # the positions that predict a next token
        hidden = torch.cat([n.detach() for n in normed])
        targets = torch.cat([r[0, 1:] for r in rows]).to(torch.int64)
        scale = torch.cat(
            [torch.full((r.shape[1] - 1,), w / (r.shape[1] - 1)) for r, w in zip(rows, weights)]
        )
        grad = head_cross_entropy_grad(hidden, targets, scale, self._head_rows, self.head.shape[0])
        torch.autograd.backward(normed, list(grad.split([n.shape[0] for n in normed])))
        self.finals = []
        norm.to("meta")
        return [f.grad for f in finals]

    def _head_rows(self, start: int, end: int) -> torch.Tensor:
        return self.reader.get_rows(self.head, torch.arange(start, end)).float()

    def backward(self, grads: list[torch.Tensor], names: Sequence[str], candidates: Sequence[InferenceScheme],
                 amax: Mapping[str, float], weight_dtype: torch.dtype,
                 rounded: Mapping[str, Mapping[str, QuantizedTensor]] | None) -> dict[str, dict[str, float]]:  # fmt: skip
        """Walk 3: every block's Linears scored, last block first."""
        totals: dict[str, dict[str, float]] = {}
        advance = self._advance("scoring: backward, block by block")
        for i in reversed(range(len(self.blocks))):
            own = f"{self.prefix}.{i}."
            mine = [n for n in names if n.startswith(own)]
            block = self._load(i)
            layers = CandidateLayers(self.model, mine, candidates, {n: amax[n] for n in mine if n in amax},
                                     weight_dtype=weight_dtype, rounded=rounded)  # fmt: skip
            block_totals = {n: dict.fromkeys(layers.schemes, 0.0) for n in mine}
            hooks = GradientScoreHooks(layers, block_totals)
            handles = hooks.attach(self.modules, mine)
            try:
                grads = self._block_backward(i, block, grads, hooks)
            finally:
                for h in handles:
                    h.remove()
            totals.update(block_totals)
            self._drop(i)
            advance()
        return totals

    def _block_backward(self, i: int, block: nn.Module, grads: list[torch.Tensor],
                        hooks: GradientScoreHooks) -> list[torch.Tensor]:  # fmt: skip
        """Block i's forward rerun on each sequence's spilled inputs and its output gradient pushed
        through it: the gradients at its inputs."""
        infos = read_tensor_infos(self._spill_path(i))
        out = []
        with ShardReader() as spilled:
            for j, ((rest, kwargs), g) in enumerate(zip(self.rest, grads)):
                x = spilled.get(infos[f"row{j}"]).requires_grad_(True)
                y = block(x, *rest, **kwargs)
                (y[0] if isinstance(y, tuple) else y).backward(g)
                hooks.saved.clear()
                out.append(x.grad)
        self._spill_path(i).unlink()
        return out


def head_cross_entropy_grad(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    scale: torch.Tensor,
    head_rows: Callable[[int, int], torch.Tensor],
    vocab: int,
    slice_bytes: int = HEAD_SLICE_BYTES,
) -> torch.Tensor:
    """d/d hidden of sum_t scale[t] * CE(hidden[t] @ W.T, targets[t]), W [vocab, H] read by
    `head_rows(start, end)` (fp32 rows) in slices of at most `slice_bytes`: the softmax's normaliser is
    a running logsumexp over the slices, then a second pass forms (softmax - onehot) * scale @ W."""
    n, width = hidden.shape
    step = max(1, min(vocab, slice_bytes // (4 * max(n, width))))
    top = torch.full((n,), float("-inf"))
    total = torch.zeros(n)
    for start in range(0, vocab, step):
        logits = hidden @ head_rows(start, min(vocab, start + step)).T
        new_top = torch.maximum(top, logits.max(dim=1).values)
        total = total * torch.exp(top - new_top) + torch.exp(logits - new_top[:, None]).sum(dim=1)
        top = new_top
    lse = top + torch.log(total)
    grad = torch.zeros_like(hidden)
    for start in range(0, vocab, step):
        w = head_rows(start, min(vocab, start + step))
        p = torch.exp(hidden @ w.T - lse[:, None])
        inside = (targets >= start) & (targets < start + w.shape[0])
        p[inside.nonzero().squeeze(1), targets[inside] - start] -= 1.0
        grad.addmm_(p.mul_(scale[:, None]), w)
    return grad


__all__ = [
    "FINAL_NORM_NAMES",
    "HEAD_SLICE_BYTES",
    "ScoringSkeleton",
    "head_cross_entropy_grad",
    "layerwise_gradient_scores",
    "scoring_skeleton",
    "sequences",
    "unsupported_reason",
]
