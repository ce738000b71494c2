"""The training scenarios the distributed tests run: one tiny model, a few steps, every piece of
mixprec.distributed. Each `scenario_*` runs on every rank and returns plain data (floats, tensors).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

GLOBAL_BATCH = 16
FEATURES = 128


class TinyNet(nn.Module):
    """Two FP8-convertible Linears (dims multiples of 128: blockwise takes them) around a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, 256)
        self.norm = nn.LayerNorm(256)
        self.out = nn.Linear(256, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.norm(self.inp(x))))


def build(recipe: str, seed: int = 0) -> nn.Module:
    from mixprec.training import convert_for_training

    torch.manual_seed(seed)
    model = TinyNet()
    convert_for_training(model, recipe)
    return model


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch for a step on every rank and in the single-process reference."""
    g = torch.Generator().manual_seed(1000 + step)
    teacher = torch.Generator().manual_seed(7)
    a = torch.randn(FEATURES, FEATURES, generator=teacher) / FEATURES**0.5
    x = torch.randn(GLOBAL_BATCH, FEATURES, generator=g) * 3
    return x, torch.tanh(x @ a)


def train(model, optimizer, steps, dp, *, start: int = 0, hooks=None, dtype=torch.bfloat16) -> dict:
    """Plain loop: shard the global batch, backward, agree on skipping, step, reduce amax, advance."""
    from mixprec.distributed import unwrap
    from mixprec.training import scaling_state

    hooks = hooks or {}
    losses, skipped = [], []
    for step in range(start, start + steps):
        x, y = global_batch(step)
        x, y = dp.shard(x), dp.shard(y)
        if "input" in hooks:
            x = hooks["input"](step, x)
        loss = F.mse_loss(model(x.to(dtype)).float(), y)
        loss.backward()
        seen = hooks["seen_loss"](step, loss) if "seen_loss" in hooks else loss
        skip = dp.skip(seen, optimizer)
        if not skip:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # reduces the amax rows over the ranks first (one all_reduce: the DataParallel's reduction),
        # unless a hook names another reduction or none (False)
        scaling_state.advance(unwrap(model), reduce=hooks.get("reduce", dp.reduce_amax))
        losses.append(dp.mean(loss) if not skip else float("nan"))
        skipped.append(skip)
        if "after_step" in hooks:
            hooks["after_step"](step)
    return {"losses": losses, "skipped": skipped}


def setup(recipe: str, strategy: str, lr: float = 2e-3, **options):
    from mixprec.distributed import DataParallel
    from mixprec.training.optim import AdamW

    dp = DataParallel(strategy, fsdp_options=options) if strategy == "fsdp2" else DataParallel(strategy)
    model = dp.wrap(build(recipe))
    optimizer = dp.attach(model, AdamW(model.parameters(), lr=lr, weight_decay=0.0))
    return dp, model, optimizer


def _flat_params(model) -> torch.Tensor:
    out = []
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        out.append(t.detach().float().reshape(-1))
    return torch.cat(out)


def replicas_identical(model) -> bool:
    """Every rank holds bit-identical parameters (DDP replicas)."""
    flat = _flat_params(model)
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return bool(torch.equal(hi, lo))


def scale_buffers(model) -> torch.Tensor:
    return torch.cat(
        [b.detach().reshape(-1).float() for n, b in model.named_buffers() if n.endswith("fp8_scale")]
    )


# ---- scenarios ---------------------------------------------------------------------------------------

STEPS = 6


def scenario_ddp_delayed(rank, world, tmp):
    from mixprec.distributed import scales_agree, unwrap

    dp, model, opt = setup("fp8-delayed:history=16", "ddp")
    agree = []

    out = train(
        model, opt, STEPS, dp, hooks={"after_step": lambda step: agree.append(scales_agree(unwrap(model)))}
    )
    out["agree"] = agree
    out["scales"] = scale_buffers(unwrap(model))
    out["replicas_identical"] = replicas_identical(model)
    out["amax_collectives"] = _count_amax_collectives(dp, model, opt)
    return out


def _count_amax_collectives(dp, model, opt) -> list[int]:
    """One more step; the sizes of the all_reduce calls made by amax reduction + scaling advance."""
    from mixprec.distributed import unwrap
    from mixprec.training import advance_scaling_state

    x, y = global_batch(STEPS)
    F.mse_loss(model(dp.shard(x).to(torch.bfloat16)).float(), dp.shard(y)).backward()
    opt.step()
    opt.zero_grad()
    calls = []
    real = dist.all_reduce

    def count(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = count
    try:
        advance_scaling_state(unwrap(model), reduce=dp.reduce_amax)
    finally:
        dist.all_reduce = real
    return calls


def scenario_ddp_delayed_without_reduction(rank, world, tmp):
    from mixprec.distributed import scales_agree, unwrap

    dp, model, opt = setup("fp8-delayed:history=16", "ddp")
    out = train(model, opt, 2, dp, hooks={"reduce": False})
    out["agree"] = scales_agree(unwrap(model))
    return out


def scenario_fsdp_delayed(rank, world, tmp):
    from mixprec.distributed import scales_agree

    dp, model, opt = setup("fp8-delayed:history=16", "fsdp2")
    out = train(model, opt, STEPS, dp)
    out["agree"] = scales_agree(model)
    p = next(model.parameters())
    out["param_dtype"] = str(p.dtype)
    out["moments"] = str(opt.state[p]["exp_avg"].dtype)
    out["has_master_copy"] = "master" in opt.state[p]
    return out


def scenario_fsdp_delayed_optimizer_masters(rank, world, tmp):
    dp, model, opt = setup("fp8-delayed:history=16", "fsdp2", master_weights="optimizer")
    out = train(model, opt, STEPS, dp)
    st = opt.state[next(iter(model.parameters()))]
    out["master"] = f"{type(st['master']).__name__}:{st['master'].dtype}:{st['exp_avg'].dtype}"
    return out


def scenario_checkpoint(rank, world, tmp):
    from mixprec.distributed import load_checkpoint, save_checkpoint

    out = {}
    for strategy in ("fsdp2", "ddp"):
        ckpt = Path(tmp) / f"ckpt-{strategy}"
        dp, model, opt = setup("fp8-delayed:history=16", strategy)
        train(model, opt, 3, dp)
        save_checkpoint(ckpt, model, opt, extra={"step": 3})
        uninterrupted = train(model, opt, 3, dp, start=3)["losses"]
        dp, model2, opt2 = setup("fp8-delayed:history=16", strategy)
        extra = load_checkpoint(ckpt, model2, opt2)
        resumed = train(model2, opt2, 3, dp, start=extra["step"])["losses"]
        out[strategy] = {"uninterrupted": uninterrupted, "resumed": resumed}
    return out


def scenario_nan(rank, world, tmp):
    from mixprec.distributed import scales_agree, unwrap

    dp, model, opt = setup("fp8-delayed:history=16", "ddp")
    snapshots = {}

    def seen(step, loss):
        # step 1: only rank 1 SEES a NaN (e.g. in its logged loss); its gradients are finite
        snapshots.setdefault(step, _flat_params(model).clone())
        return loss * float("nan") if step == 1 and rank == 1 else loss

    def bad_input(step, x):
        # step 3: rank 1 gets a NaN input: NaN activations, amax and gradients on that rank
        if step == 3 and rank == 1:
            x = x.clone()
            x[0, 0] = float("nan")
        return x

    out = train(model, opt, 5, dp, hooks={"seen_loss": seen, "input": bad_input})
    after = _flat_params(model)
    out["unchanged_by_skip"] = [
        bool(
            torch.equal(snapshots[1], snapshots[2])
        ),  # step 1 skipped: params before step 2 == before step 1
        bool(torch.equal(snapshots[3], snapshots[4])),
    ]
    out["changed_by_step"] = not bool(torch.equal(snapshots[0], snapshots[1]))
    out["replicas_identical"] = replicas_identical(model)
    out["scales_finite"] = bool(torch.isfinite(scale_buffers(unwrap(model))).all())
    out["agree"] = scales_agree(unwrap(model))
    out["final_finite"] = bool(torch.isfinite(after).all())
    return out


RECIPES = (
    "fp8-current",
    "fp8-rowwise",
    "fp8-blockwise",
    "fp8-mxfp8",
    "fp4-nvfp4",
    "fp4-mxfp4",
    "bf16",
    "fp32",
)


def scenario_recipes(rank, world, tmp):
    out = {}
    for recipe in RECIPES:
        dtype = torch.float32 if recipe == "fp32" else torch.bfloat16
        dp, model, opt = setup(recipe, "ddp")
        ddp = train(model, opt, 3, dp, dtype=dtype)
        ddp["replicas_identical"] = replicas_identical(model)
        dp, model, opt = setup(recipe, "fsdp2")
        fsdp = train(model, opt, 3, dp, dtype=dtype)
        out[recipe] = {"ddp": ddp, "fsdp2": fsdp}
    return out


def scenario_fp8_all_gather(rank, world, tmp):
    import mixprec.distributed.fp8_all_gather as ag

    gathered = []
    # the collective FSDP2 all-gathers with (all_gather_single from torch 2.13 on)
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    real = getattr(dist, name)

    def spy(output, input, *args, **kwargs):
        gathered.append((str(input.dtype), input.numel() * input.element_size()))
        return real(output, input, *args, **kwargs)

    dp, model, opt = setup("fp8-current", "fsdp2")
    plain = train(model, opt, 3, dp)["losses"]
    setattr(dist, name, spy)
    try:
        dp, model, opt = setup("fp8-current", "fsdp2")
        gathered.clear()
        x, _ = global_batch(0)
        model(dp.shard(x).to(torch.bfloat16))
        plain_bytes = sum(n for _, n in gathered)
        dp, model, opt = setup("fp8-current", "fsdp2", fp8_all_gather=True)
        gathered.clear()
        model(dp.shard(x).to(torch.bfloat16))
        fp8_bytes = sum(n for _, n in gathered)
        fp8_dtypes = sorted({d for d, _ in gathered})
    finally:
        setattr(dist, name, real)
    dp, model, opt = setup("fp8-current", "fsdp2", fp8_all_gather=True)
    fp8 = train(model, opt, 3, dp)["losses"]
    local = next(iter(model.parameters())).to_local()
    # precompute_scales after each step: one all_reduce for all weights, none inside the all-gathers
    dp, model, opt = setup("fp8-current", "fsdp2", fp8_all_gather=True)
    ag.precompute_scales(model)
    fp8_pre = train(model, opt, 3, dp, hooks={"after_step": lambda step: ag.precompute_scales(model)})[
        "losses"
    ]
    calls = {"n": 0}
    real_reduce = dist.all_reduce

    def count(*args, **kwargs):
        calls["n"] += 1
        return real_reduce(*args, **kwargs)

    dist.all_reduce = count
    try:
        model(dp.shard(x).to(torch.bfloat16))
        reduces_with_precompute = calls["n"]
        with torch.no_grad():  # an in-place update of the shards: the precomputed scales no longer apply
            for p in model.parameters():
                p.mul_(1.0)
        calls["n"] = 0
        model(dp.shard(x).to(torch.bfloat16))
        reduces_stale = calls["n"]
    finally:
        dist.all_reduce = real_reduce
    return {
        "plain": plain,
        "fp8": fp8,
        "fp8_precomputed": fp8_pre,
        "reduces_with_precompute": reduces_with_precompute,
        "reduces_stale": reduces_stale,
        "plain_bytes": plain_bytes,
        "fp8_bytes": fp8_bytes,
        "fp8_dtypes": fp8_dtypes,
        "weight_type": type(local).__name__
        if not isinstance(local, ag.Fp8AllGatherWeight)
        else "Fp8AllGatherWeight",
    }


def scenario_ddp_accumulation(rank, world, tmp):
    """Gradient accumulation under DDP: micro-batches under no_sync() sum in mixprec AdamW's fp32
    buffers, the last one reduces the sums once (fp32)."""
    from mixprec.distributed import unwrap
    from mixprec.training import advance_scaling_state

    dp, model, opt = setup("fp8-delayed:history=16", "ddp")
    losses = []
    for step in range(3):
        x, y = global_batch(step)
        x, y = dp.shard(x), dp.shard(y)
        total = 0.0
        for i, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2))):
            ctx = model.no_sync() if i == 0 else contextlib.nullcontext()
            with ctx:
                loss = F.mse_loss(model(xs.to(torch.bfloat16)).float(), ys)
                (loss / 2).backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        advance_scaling_state(unwrap(model), reduce=dp.reduce_amax)
        losses.append(dp.mean(total / 2))
    return {"losses": losses, "replicas_identical": replicas_identical(model)}


def scenario_plain_ddp(rank, world, tmp):
    """A DDP built without mixprec (as transformers.Trainer does) with AdamW(accumulate_grads_fp32=False)."""
    from torch.nn.parallel import DistributedDataParallel

    from mixprec.distributed import DataParallel, reduce_amax
    from mixprec.training.optim import AdamW

    model = DistributedDataParallel(build("fp8-delayed:history=16"))
    opt = AdamW(model.parameters(), lr=2e-3, weight_decay=0.0, accumulate_grads_fp32=False)
    # a DDP mixprec did not build: the loop passes the amax reduction itself
    out = train(model, opt, 3, DataParallel("ddp"), hooks={"reduce": reduce_amax})
    out["replicas_identical"] = replicas_identical(model)
    return out


def scenario_plain_ddp_default_adamw(rank, world, tmp):
    """Plain DDP with AdamW's fp32 gradient buffers would reduce zeros: the first step refuses."""
    from torch.nn.parallel import DistributedDataParallel

    from mixprec.distributed import DataParallel
    from mixprec.errors import MixprecError
    from mixprec.training.optim import AdamW

    model = DistributedDataParallel(build("fp8-delayed:history=16"))
    opt = AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    before = _flat_params(model).clone()
    try:
        train(model, opt, 1, DataParallel("ddp"))
        return {"error": None}
    except MixprecError as exc:
        return {"error": str(exc), "unchanged": bool(torch.equal(before, _flat_params(model)))}


def scenario_wrong_order(rank, world, tmp):
    """Converting after wrapping, and an optimizer built before FSDP2 sharding: clear errors."""
    from mixprec.distributed import DataParallel
    from mixprec.errors import MixprecError
    from mixprec.training import convert_for_training
    from mixprec.training.optim import AdamW

    out = {}
    torch.manual_seed(0)
    dp = DataParallel("ddp")
    wrapped = dp.wrap(TinyNet())
    convert_for_training(wrapped.module, "fp8-delayed:history=16")
    try:
        dp.attach(wrapped, AdamW(wrapped.parameters()))
        out["ddp_convert_after_wrap"] = "accepted"
    except MixprecError as exc:
        out["ddp_convert_after_wrap"] = str(exc)
    model = build("fp8-delayed:history=16")
    AdamW(model.parameters())  # built before sharding: its parameters are about to be replaced
    try:
        DataParallel("fsdp2").wrap(model)
        out["fsdp_optimizer_before_wrap"] = "accepted"
    except MixprecError as exc:
        out["fsdp_optimizer_before_wrap"] = str(exc)
    return out


SCENARIOS = {
    name.removeprefix("scenario_"): fn for name, fn in list(globals().items()) if name.startswith("scenario_")
}


def run_all(rank: int, world: int, tmp: str, names: list[str]) -> dict:
    return {name: SCENARIOS[name](rank, world, tmp) for name in names}


def single_process(recipe: str, steps: int, micro_batches: int = 1) -> list[float]:
    """The reference: one process, the same model, optimizer and loop, on the combined batch.

    micro_batches=k: the combined batch as k micro-batches of gradient accumulation (the rank shards of
    a k-rank run, in rank order), the loss of each divided by k, one optimizer step per global batch.
    """
    from mixprec.training import advance_scaling_state
    from mixprec.training.optim import AdamW

    model = build(recipe)
    opt = AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        total = 0.0
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            loss = F.mse_loss(model(xs.to(torch.bfloat16)).float(), ys)
            (loss / micro_batches).backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        advance_scaling_state(model)
        losses.append(total / micro_batches)
    return losses
