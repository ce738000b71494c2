"""Layer-by-layer calibration: observe Linear inputs (and KV states) of a decoder model one
transformer block at a time, so a model larger than RAM calibrates.

The model is built with its parameters on the meta device. Of what lies outside the block list only
what the forward runs before the first block is read (outside.py): the input embedding's rows for the
calibration tokens, as a compact table behind the model's own embedding module, and any other module
there (position embeddings) when it runs; the final norm and the head are never read. The first
block's inputs are captured for every batch (a pre-hook records them and stops the forward), then
each block is loaded from the shards, run on the captured inputs with the observers' hooks on, its
outputs kept as the next block's inputs (replacing them batch by batch), and its weights dropped
again.

Peak memory (RSS), nothing of it growing with the number of blocks:
    R0                              interpreter, torch, transformers, the skeleton's buffers (~0.4 GiB)
  + one block's weights             in the checkpoint's dtype (Llama-3.1-8B: 0.41 GiB in bf16)
  + the hidden states, one copy     samples x seq_len x hidden x dtype bytes, plus the rotary tables
  + one batch's forward transients  the MLP's intermediates (a few x batch x seq_len x intermediate) and
                                    the attention's scores (batch x heads x seq_len^2 in fp32)
  + the compact embedding           distinct calibration tokens x hidden x dtype bytes
  + statistics                      observers: a float per Linear. GPTQ: the block's Hessians (4 K^2
                                    bytes per input group, K its input width), each freed once its
                                    group is rounded; a group's solve factor is made in its Hessian's
                                    memory (gptq.solve_factor), beside it a few fp32 copies of the
                                    weight being rounded (4 N x K each) and its groups' multipliers
                                    and clip limits (8 N x K / group width: N K / 2 at NVFP4's 16)
  + GPTQ results of the block       its rounded Linears (1 byte a weight for the codes, plus scales);
                                    on a checkpoint they go to disk at the end of each block, beside
                                    the output, until the writer stores them (checkpoint/spill.py)
Llama-3.1-8B shapes, GPTQ: down_proj's K = 14336 makes the statistics term ~1.6 GiB (0.77 + 4 x 0.22).

The same walk carries the algorithms that work block by block (a BlockPass: GPTQ), on a checkpoint
(calibrate_layerwise) or on a model already in memory (calibrate_blockwise).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.hf import build_model
from mixprec.inference.calibration.across_ranks import max_across_ranks, sum_across_ranks
from mixprec.inference.calibration.observers import MaxObserver, Observer, make_observer
from mixprec.inference.calibration.outside import OutsideLoader, check_captured, load_into, whole_model_advice
from mixprec.inference.calibration.run import (
    CalibrationResult,
    CalibrationRun,
    check_observed,
    kv_attention_patch,
)
from mixprec.inference.checkpoint.linear_weights import model_keys
from mixprec.inference.checkpoint.safetensors_io import Checkpoint, ShardReader
from mixprec.kernels.allocator import release_free_memory
from mixprec.kernels.bf16_cpu import gemms_in_fp32

# The arguments a block receives, one (args, kwargs) per calibration batch.
Captured = list[tuple[tuple, dict]]


class _CaptureDone(Exception):
    """Raised by the capture hook to stop the forward once the first block's inputs are recorded."""


def _block_list(model: nn.Module, num_layers: int | None) -> tuple[str, nn.ModuleList]:
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0 and (num_layers is None or len(m) == num_layers):
            return name, m
    raise MixprecError("layer-by-layer calibration needs a model with a list of transformer blocks")


class BlockPass(Protocol):
    """Work done inside each transformer block of a block-by-block run (algorithms/ builds these: GPTQ
    accumulates Hessians and rounds the block's weights). `hooks` runs before the block's observing
    forward and returns the hook handles to remove after it; `after` gets the block's outputs of that
    forward and returns what the next block receives (the same outputs, or the block run again on
    `captured` through `rerun` once its weights changed). A pass may set `needs_outputs = False`: the
    observing forward's outputs are then not kept (`after` gets None), which saves one copy of the
    hidden states when it runs the block again anyway."""

    def hooks(self, own: str, modules: dict[str, nn.Module]) -> list[Any]: ...

    def after(self, own: str, block: nn.Module, captured: Captured, outputs: Captured,
              rerun: Callable[[nn.Module, Captured], Captured]) -> Captured: ...  # fmt: skip


def calibrate_layerwise(
    model_dir: Path,
    config: dict[str, Any],
    ckpt: Checkpoint,
    batches: Sequence[torch.Tensor],
    linear_names: Sequence[str],
    *,
    observer: str = "max",
    kv_cache: bool = False,
    progress: Any = None,
    block_pass: BlockPass | None = None,
    across_ranks: bool = False,
    unfuse: Callable[[nn.Module], dict[str, str]] | None = None,
) -> tuple[CalibrationResult, nn.Module]:
    """The results `calibrate` gives on the whole model with every batch run (no early stop: the
    stop rule needs every layer's amax after each batch, and here block i sees batch k long after
    block 0 did); returns (the result, the skeleton). block_pass: more work inside each block.
    across_ranks: `batches` are this rank's share (across_ranks.share) and every rank of the process
    group calls this; the amaxes are MAX-reduced and the run's counts summed, so every rank gets the
    result of one process running all the batches (the pass reduces its own statistics).
    unfuse: for an MoE checkpoint, replaces the skeleton's fused experts by one Linear per checkpoint
    expert weight (runtime/experts.py: unfuse_skeleton) and returns {checkpoint module: module path};
    the per-expert tensors then load into those Linears, the others renamed as transformers renames
    them, and the observers and the pass find each expert Linear by its checkpoint name."""
    model, prefix, blocks, keys, aliases = skeleton(model_dir, config, ckpt, linear_names, unfuse)
    with ShardReader() as reader:
        outside = OutsideLoader(model, ckpt, reader, prefix, batches)

        def load(i: int) -> None:
            own = f"{prefix}.{i}."
            load_into(model, ckpt, [n for n in ckpt.tensors if keys.get(n, n).startswith(own)], reader, keys)

        result = _walk(model, prefix, blocks, batches, linear_names, observer=observer, kv_cache=kv_cache,
                       progress=progress, block_pass=block_pass, load=load, drop=lambda b: b.to("meta"),
                       outside=outside, across_ranks=across_ranks, aliases=aliases)  # fmt: skip
    return result, model


def calibrate_blockwise(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    linear_names: Sequence[str],
    *,
    observer: str = "max",
    kv_cache: bool = False,
    progress: Any = None,
    block_pass: BlockPass | None = None,
    may_be_unseen: Collection[str] = (),
) -> CalibrationResult:
    """calibrate_layerwise on a model already in memory (nothing loaded or dropped): the run a
    BlockPass needs on a live model (mixprec.quantize_model_ with an algorithm). may_be_unseen: Linears
    whose amax may stay 0 (MoE experts the router never picked)."""
    prefix, blocks = _block_list(model, getattr(getattr(model, "config", None), "num_hidden_layers", None))
    stray = [n for n in linear_names if not n.startswith(prefix + ".")]
    if stray:
        raise MixprecError(
            f"block-by-block calibration observes Linears inside {prefix} only; also asked: {stray[:3]}"
        )
    was_training = model.training
    model.eval()
    try:
        return _walk(model, prefix, list(blocks), batches, linear_names, observer=observer, kv_cache=kv_cache,
                     progress=progress, block_pass=block_pass, may_be_unseen=may_be_unseen)  # fmt: skip
    finally:
        model.train(was_training)


def _walk(model: nn.Module, prefix: str, blocks: Sequence[nn.Module], batches: Sequence[torch.Tensor],
          linear_names: Sequence[str], *, observer: str, kv_cache: bool, progress: Any,
          block_pass: BlockPass | None, load: Callable[[int], None] | None = None,
          drop: Callable[[nn.Module], Any] | None = None,
          outside: OutsideLoader | None = None, across_ranks: bool = False,
          aliases: dict[str, str] | None = None, may_be_unseen: Collection[str] = ()) -> CalibrationResult:  # fmt: skip
    """Capture the first block's inputs, then per block: load it, run it with the observers' (and
    the pass's) hooks on, let the pass work on it, drop it; the outputs feed the next block.
    outside: what loads the parts outside the blocks during the capture (calibrate_layerwise).
    aliases: {checkpoint module: module path} of the Linears the model names differently (unfused
    experts), under which the observers and the pass also find them; they, and may_be_unseen, may end
    with amax 0 (experts the router never picked)."""
    aliases = aliases or {}
    may_be_unseen = {*aliases, *may_be_unseen}
    started = time.perf_counter()
    observers: dict[str, Observer] = {n: make_observer(observer) for n in linear_names}
    kv_obs: dict[int, tuple[Observer, Observer]] = {}
    undo = kv_attention_patch(model, kv_obs) if kv_cache else None
    if kv_cache and undo is None:
        raise MixprecError(
            "--kv-cache fp8 needs a transformers attention model (key/value states to observe)"
        )
    try:
        with torch.no_grad(), contextlib.ExitStack() as fp32_gemms:
            # GEMMs in fp32 rounded to the model dtype on CPUs without fast bf16, as in `calibrate` (decided
            # on a module whose weights are loaded: the compact embedding, or the model once loaded)
            probe = outside.embedding if outside is not None and outside.embedding is not None else model
            fp32_gemms.enter_context(gemms_in_fp32(probe))
            captured = block_inputs(model, blocks[0], batches)
            if outside is not None:
                outside.remove()
                check_captured(captured)
            modules = dict(model.named_modules())
            modules.update({n: modules[p] for n, p in aliases.items() if p in modules})
            for i, block in enumerate(blocks):
                own = f"{prefix}.{i}."
                if load is not None:
                    load(i)
                handles = [
                    modules[n].register_forward_pre_hook(observing(observers[n]))
                    for n in linear_names
                    if aliases.get(n, n).startswith(own)
                ]
                if block_pass is not None:
                    handles += block_pass.hooks(own, modules)
                # without a pass each block's outputs replace its inputs batch by batch (one copy of the
                # hidden states); a pass that reruns the block keeps none of this forward's
                keep = block_pass is None or getattr(block_pass, "needs_outputs", True)
                outputs = run_block(block, captured, in_place=block_pass is None, keep=keep)
                for h in handles:
                    h.remove()
                if block_pass is not None:
                    outputs = block_pass.after(own, block, captured, outputs, run_block)
                captured = outputs
                if drop is not None:
                    drop(block)  # this block's weights
                release_free_memory()
                if progress is not None:
                    progress()
    finally:
        if undo is not None:
            undo()
    if across_ranks:
        return _result(*_reduced(observers, kv_obs, batches, len(blocks)), started, may_be_unseen)
    amax = {n: o.amax() for n, o in observers.items()}
    kv = {i: (k.amax(), v.amax()) for i, (k, v) in sorted(kv_obs.items())}
    return _result(amax, kv, _counts(batches), started, may_be_unseen)


def _counts(batches: Sequence[torch.Tensor]) -> tuple[int, int, int]:
    """(samples, tokens, batches) of a run over `batches`."""
    return sum(len(b) for b in batches), sum(b.numel() for b in batches), len(batches)


def _reduced(observers: dict[str, Observer], kv_obs: dict[int, tuple[Observer, Observer]],
             batches: Sequence[torch.Tensor], n_layers: int):  # fmt: skip
    """(amax, kv amax, counts) over every rank's batches: three collectives, every rank calling them
    (a rank without batches too: its observers hold 0, it has seen no KV state). KV layers appear
    lazily, so each is sent as a slot of n_layers with -1 for "not seen here" (an amax is >= 0)."""
    names = list(observers)
    amax = dict(zip(names, max_across_ranks([observers[n].amax() for n in names])))
    if any(not 0 <= i < n_layers for i in kv_obs):
        raise MixprecError(f"KV-cache layer indices {sorted(kv_obs)} do not fit the {n_layers} blocks")
    slots = [-1.0] * (2 * n_layers)
    for i, (k, v) in kv_obs.items():
        slots[2 * i], slots[2 * i + 1] = k.amax(), v.amax()
    slots = max_across_ranks(slots)
    kv = {i: (slots[2 * i], slots[2 * i + 1]) for i in range(n_layers) if slots[2 * i] >= 0}
    counts = tuple(sum_across_ranks(_counts(batches)))
    return amax, kv, counts


def _result(amax: dict[str, float], kv: dict[int, tuple[float, float]], counts: tuple[int, int, int],
            started: float, may_be_unseen: Collection[str]) -> CalibrationResult:  # fmt: skip
    """The result, once the amaxes are final (after the reduction across ranks: a rank may have seen
    nothing of an input that another rank saw). may_be_unseen: the unfused experts, whose amax stays 0
    when the router never picked them (the caller decides what they get)."""
    check_observed(amax, may_be_unseen)
    samples, tokens, n_batches = counts
    run = CalibrationRun(
        samples=samples, tokens=tokens, batches=n_batches, samples_available=samples, stopped="cap",
        reason=f"cap: layer-by-layer calibration runs every available sample ({samples}); it does not stop early",
        clipped=None, max_change=None, seconds=round(time.perf_counter() - started, 3),
    )  # fmt: skip
    return CalibrationResult(amax, kv, run)


def skeleton(model_dir: Path, config: dict[str, Any], ckpt: Checkpoint, linear_names: Sequence[str],
              unfuse: Callable[[nn.Module], dict[str, str]] | None = None):  # fmt: skip
    """(the model built on the meta device, the name of its block list, its blocks, {checkpoint key:
    model key} of the tensors it names differently, {checkpoint module: module path} of those Linears),
    refused when the checkpoint names tensors differently than `unfuse` and transformers' renamings
    account for, or a Linear to observe lies outside the blocks."""
    model = build_model(config, source=model_dir).eval()
    keys: dict[str, str] = {}
    if unfuse is not None:
        keys, _ = model_keys(model, ckpt.tensors, unfuse(model))  # keys transformers converts stay unknown
    known = set(model.state_dict())
    # blocks are filled by checkpoint name (or the model's, for a tensor renamed inside the blocks): tensors
    # the model names differently would stay empty; outside the blocks they load by checkpoint name only
    _check_known(model, [n for n in ckpt.tensors if keys.get(n, n) not in known])
    prefix, blocks = _block_list(model, config.get("num_hidden_layers"))
    _check_known(model, [n for n, k in keys.items() if not k.startswith(prefix + ".")])
    aliases = {k[: -len(".weight")]: v[: -len(".weight")] for k, v in keys.items() if k.endswith(".weight")}
    stray = [n for n in linear_names if not aliases.get(n, n).startswith(prefix + ".")]
    if stray:
        raise MixprecError(
            f"layer-by-layer calibration observes Linears inside {prefix} only; also asked: {stray[:3]}"
        )
    return model, prefix, blocks, keys, aliases


def _check_known(model: nn.Module, unknown: list[str]) -> None:
    if unknown:
        raise MixprecError(
            f"layer-by-layer calibration loads tensors by their checkpoint names, and {type(model).__name__} "
            f"names {len(unknown)} of them differently (e.g. {unknown[0]!r}); {whole_model_advice()}"
        )


def block_inputs(model: nn.Module, first: nn.Module, batches: Sequence[torch.Tensor]) -> Captured:
    """The arguments the first block receives for each batch (the forward stops there)."""
    captured: list[tuple[tuple, dict]] = []

    def capture(_mod, args, kwargs):
        captured.append((args, kwargs))
        raise _CaptureDone

    hook = first.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        for b in batches:
            with contextlib.suppress(_CaptureDone):
                model(input_ids=b, use_cache=False)
    finally:
        hook.remove()
    return captured


def observing(observer: Observer):
    """A forward pre-hook handing a Linear's input to its observer."""

    def hook_fn(_m, args):
        observer.update(args[0])

    return hook_fn


def run_block(
    block: nn.Module, captured: Captured, *, in_place: bool = False, keep: bool = True
) -> Captured | None:
    """Run `block` on each captured input: the next block's inputs (its hidden states, the rest as given).
    in_place: each output replaces its input in `captured` as soon as it exists (returns `captured`);
    keep=False: the outputs are dropped (returns None: the forward only feeds the hooks)."""
    nxt = captured if in_place else []
    for j, (args, kwargs) in enumerate(captured):
        out = block(*args, **kwargs)
        if not keep:
            continue
        hidden = out[0] if isinstance(out, tuple) else out
        if in_place:
            captured[j] = ((hidden, *args[1:]), kwargs)
        else:
            nxt.append(((hidden, *args[1:]), kwargs))
    return nxt if keep else None


__all__ = [
    "BlockPass",
    "Captured",
    "MaxObserver",
    "block_inputs",
    "calibrate_blockwise",
    "calibrate_layerwise",
    "observing",
    "run_block",
    "skeleton",
]
