"""AdamW with FP32 master weights, BF16 moments and FP32 gradient accumulation, for BF16 parameters.

Plain PyTorch keeps AdamW's state in the parameters' dtype and accumulates gradients in it too, so a
bf16 model gets bf16 updates (small updates vanish against a bf16 weight) and bf16 gradient sums.
This optimizer keeps, per low-precision parameter:

- an fp32 **gradient buffer**: a post-accumulate-grad hook adds each micro-batch's gradient into it and
  frees ``p.grad`` — so gradient accumulation over micro-batches sums in fp32. ``step()`` consumes the
  buffers; so does ``zero_grad()``. They stay allocated: the first micro-batch after a step overwrites
  its buffer, the next ones add to it. While buffers are in use ``p.grad`` is None: clip with
  :meth:`AdamW.clip_grad_norm_` (the Trainer callback does this for you);
- an fp32 **master copy** of the parameter (the parameter is its rounding, refreshed after each step);
- the **moments** ``exp_avg`` / ``exp_avg_sq`` in ``moment_dtype`` (bf16 by default for bf16 params), updated in fp32
  and stored with stochastic rounding (with round-to-nearest a bf16 ``exp_avg_sq`` cannot decay by
  0.1 % a step: ``0.999 * v`` rounds back to ``v``). The rounding noise is counter-based
  (mixprec.rounding: a hash of each element's index and a per-step key, one key per
  parameter for both moments); its counter is saved in ``state_dict`` so that a resumed run continues
  identically.

For fp32 parameters nothing is duplicated: the parameter is the master, gradients are fp32 already and
the moments default to fp32: the update is the same arithmetic, in the same order, as
``torch.optim.AdamW`` (single-tensor and foreach paths give the same bits), so the numbers agree.

Speed: each operation of the update runs once over a list of tensors (``torch._foreach_*``), not
once per parameter from Python. Parameters with an fp32 master are taken in packs whose moments are
widened into reused flat fp32 scratch buffers (sized to the largest parameter, at least 2**20
elements; kept up to 2**24 elements — 4 buffers of 64 MiB — larger ones are allocated per step);
the stochastic rounding adds the noise into the scratch's bits and copies the high halves out (see
mixprec.rounding.stochastic_round_pair_into).

Bytes per parameter (gradients included), see :func:`bytes_per_parameter`:
fp32 AdamW 4+4+4+4 = 16 B; bf16 param + fp32 grad buffer + fp32 master + bf16 moments 2+4+4+2+2 = 14 B.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from mixprec.errors import MixprecError
from mixprec.ranks import world_size
from mixprec.rounding import CHUNK, NoiseStream, stochastic_round, stochastic_round_pair_into
from mixprec.training.convert import conversion_state

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def _dtype(x: torch.dtype | str, what: str) -> torch.dtype:
    if isinstance(x, torch.dtype):
        if not x.is_floating_point:
            raise MixprecError(f"{what} must be a floating dtype, got {x}")
        return x
    if isinstance(x, str) and x.lower() in _DTYPES:
        return _DTYPES[x.lower()]
    raise MixprecError(f"{what} must be a torch dtype or one of {sorted(_DTYPES)}, got {x!r}")


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def bytes_per_parameter(
    param_dtype: torch.dtype | str = torch.bfloat16,
    *,
    master_dtype: torch.dtype | str | None = torch.float32,
    moment_dtype: torch.dtype | str = torch.bfloat16,
    grad_dtype: torch.dtype | str | None = None,
) -> dict[str, int]:
    """Bytes per parameter of an AdamW setup, gradients included.

    grad_dtype: the dtype gradients accumulate in (default: fp32 buffer when the parameter is low
    precision, else the parameter's dtype). master_dtype None or equal to the parameter's dtype: the
    parameter is its own master (no copy). Returns the parts and "total".
    """
    p = _dtype(param_dtype, "param_dtype")
    mom = _dtype(moment_dtype, "moment_dtype")
    master = p if master_dtype is None else _dtype(master_dtype, "master_dtype")
    g = _dtype(grad_dtype, "grad_dtype") if grad_dtype is not None else (torch.float32 if p != master else p)
    parts = {
        "param": _nbytes(p),
        "grad": _nbytes(g),
        "master": 0 if master == p else _nbytes(master),
        "exp_avg": _nbytes(mom),
        "exp_avg_sq": _nbytes(mom),
    }
    parts["total"] = sum(parts.values())
    return parts


def memory_table() -> list[dict[str, Any]]:
    """The usual setups and their bytes per parameter (rows for docs and reports)."""
    setups = [
        ("fp32 params, torch AdamW", torch.float32, None, torch.float32),
        ("bf16 params, plain torch AdamW (bf16 state, bf16 grads)", torch.bfloat16, None, torch.bfloat16),
        (
            "bf16 params, mixprec AdamW (fp32 master + grads, bf16 moments)",
            torch.bfloat16,
            torch.float32,
            torch.bfloat16,
        ),
        (
            "bf16 params, mixprec AdamW (fp32 master + grads, fp32 moments)",
            torch.bfloat16,
            torch.float32,
            torch.float32,
        ),
    ]
    rows = []
    for name, p, master, mom in setups:
        grad = p if master is None else None
        rows.append(
            {"setup": name, **bytes_per_parameter(p, master_dtype=master, moment_dtype=mom, grad_dtype=grad)}
        )
    return rows


# step() scratch: packs of parameters share flat fp32 buffers of at least _SCRATCH_MIN elements; buffers
# up to _SCRATCH_KEEP elements (64 MiB each in fp32) are kept across steps, larger ones are transient.
_SCRATCH_MIN = 1 << 20
_SCRATCH_KEEP = 1 << 24


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


class AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with fp32 master weights and low-precision moments.

    Args:
        params: parameters or parameter groups, as for torch.optim.AdamW.
        lr, betas, eps, weight_decay: as torch.optim.AdamW (weight_decay default 0.01).
        master_dtype: dtype of the master copy kept for parameters of a narrower dtype (fp32).
        moment_dtype: dtype of exp_avg and exp_avg_sq. None (default): bf16 for low-precision parameters,
            the master dtype (fp32) for fp32 parameters — so an fp32 baseline stays plain fp32 AdamW.
            A dtype: that dtype for every parameter.
        accumulate_grads_fp32: keep fp32 gradient buffers for low-precision parameters (post-accumulate
            hooks); False leaves p.grad alone (then gradient accumulation sums in the parameter dtype).
        stochastic_rounding: store bf16 moments with stochastic rounding (True) or round-to-nearest.
        seed: seed of the generator for stochastic rounding.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        master_dtype: torch.dtype | str = torch.float32,
        moment_dtype: torch.dtype | str | None = None,
        accumulate_grads_fp32: bool = True,
        stochastic_rounding: bool = True,
        seed: int = 0,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise MixprecError(
                f"AdamW: lr, eps and weight_decay must be >= 0 (lr={lr}, eps={eps}, wd={weight_decay})"
            )
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise MixprecError(f"AdamW: betas must lie in [0, 1), got {betas}")
        self.master_dtype = _dtype(master_dtype, "master_dtype")
        self.moment_dtype = None if moment_dtype is None else _dtype(moment_dtype, "moment_dtype")
        self.stochastic_rounding = stochastic_rounding
        self.accumulate_grads_fp32 = accumulate_grads_fp32
        # Set by mixprec's DDP communication hook: the fp32 buffers are reduced across ranks.
        self.distributed_grads_reduced = False
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self._seed = seed
        self._noise = NoiseStream(seed)  # stochastic-rounding noise: counter-based, one draw per parameter
        self._grad_buffers: dict[torch.Tensor, torch.Tensor] = {}  # fp32 buffers, kept across steps
        self._active: set[torch.Tensor] = set()  # params whose buffer holds this step's gradient
        self._scratch: dict[tuple, torch.Tensor] = {}  # reused fp32/int32 work space of step()
        self._hooks = []
        for group in self.param_groups:
            for p in group["params"]:
                if not p.is_floating_point():
                    raise MixprecError(f"AdamW: parameter of dtype {p.dtype} is not floating point")
                if accumulate_grads_fp32 and p.requires_grad and self._is_low(p):
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate))

    @classmethod
    def for_model(cls, model: torch.nn.Module, lr: float = 1e-3, **kwargs: Any) -> AdamW:
        """AdamW over ``model.parameters()`` set up as the model's mixprec recipe says.

        For a model converted with ``bf16:moments=fp32`` the moments are fp32; with ``bf16:master=false``
        there is no fp32 master copy (plain bf16 updates, as torch would do). Keyword arguments win.
        """

        st = conversion_state(model)
        recipe = st.recipe if st is not None else None
        moments = getattr(recipe, "moments_dtype", None)
        if moments is not None:
            kwargs.setdefault("moment_dtype", moments)
        if getattr(recipe, "master_weights", True) is False:
            kwargs.setdefault("master_dtype", torch.bfloat16)
        return cls(model.parameters(), lr=lr, **kwargs)

    # ---- gradients -----------------------------------------------------------------------------
    def _is_low(self, p: torch.Tensor) -> bool:
        return _nbytes(p.dtype) < _nbytes(self.master_dtype)

    def moment_dtype_for(self, p: torch.Tensor) -> torch.dtype:
        """The dtype Adam's moments of `p` are stored in (an override point: mixprec.distributed.fsdp
        gives an FSDP2 fp32 master shard of a bf16 parameter the moments a bf16 parameter gets)."""
        if self.moment_dtype is not None:
            return self.moment_dtype
        return torch.bfloat16 if self._is_low(p) else self.master_dtype

    def _accumulate(self, p: torch.Tensor) -> None:
        # Runs right after autograd has written this micro-batch's gradient into p.grad (p.grad was
        # None before, since the previous call freed it): sum it into fp32 and free the bf16 copy.
        # The fp32 buffer is kept across steps (no allocation per step); the first micro-batch of a
        # step overwrites it, the next ones add to it.
        if p.grad is None:
            return
        buf = self._grad_buffers.get(p)
        if p in self._active:
            buf.add_(p.grad)
        elif buf is not None and buf.shape == p.grad.shape and buf.device == p.grad.device:
            buf.copy_(p.grad)
            self._active.add(p)
        else:
            self._grad_buffers[p] = p.grad.to(self.master_dtype, memory_format=torch.contiguous_format)
            self._active.add(p)
        p.grad = None

    def grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The accumulated gradient of `p` (fp32 buffer for low-precision params, else p.grad)."""
        if p in self._active:
            return self._grad_buffers[p]
        return p.grad

    def grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(param, accumulated gradient) for every parameter that has one."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                g = self.grad(p)
                if g is not None:
                    out.append((p, g))
        return out

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the accumulated gradients (fp32 buffers and plain .grad) to a total norm; return the norm."""
        gs = [g for _, g in self.grads()]
        if not gs:
            return torch.zeros(())
        norms = torch.stack([g.float().norm(norm_type) for g in gs])
        total = norms.max() if math.isinf(norm_type) else norms.norm(norm_type)
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in gs:
            g.mul_(coef.to(g.dtype))
        return total

    @torch.no_grad()
    def unscale_(self, inv_scale: float | torch.Tensor) -> None:
        """Multiply the accumulated gradients by `inv_scale` (loss-scaling helpers)."""
        for _, g in self.grads():
            g.mul_(inv_scale)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._active.clear()  # the buffers stay allocated; the next micro-batch overwrites them

    # ---- step ----------------------------------------------------------------------------------
    def _check_gradients_reduced(self) -> None:
        """Under data parallelism, fp32 buffers must be what the ranks reduce.

        The post-accumulate hook moves each bf16 gradient into its fp32 buffer and frees p.grad before
        DistributedDataParallel's reducer sees it, so plain DDP would all-reduce zeros and every rank
        would silently step with its own local gradient. mixprec's DDP hook (wrap_ddp /
        register_fp32_grad_hook) reduces the buffers instead; FSDP2 (DTensor parameters) reduce-scatters
        before the hook runs.
        """
        if self.distributed_grads_reduced or not self._active:
            return
        if world_size() < 2 or any(_is_dtensor(p) for p in self._active):
            return
        raise MixprecError(
            "AdamW keeps fp32 gradient buffers that plain DistributedDataParallel does not reduce, so the "
            "ranks would train apart: wrap with mixprec.distributed.wrap_ddp(model, optimizer) (or call "
            "register_fp32_grad_hook(ddp_model, optimizer)), or build AdamW(..., accumulate_grads_fp32=False); "
            "if you reduce opt.grads() yourself, set optimizer.distributed_grads_reduced = True"
        )

    @torch.no_grad()
    def step(self, closure=None):
        self._check_gradients_reduced()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            plain: list[tuple[torch.Tensor, torch.Tensor, dict]] = []  # the parameter is its own master
            mixed: list[tuple[torch.Tensor, torch.Tensor, dict]] = []  # fp32 master and/or other moments
            for p in group["params"]:
                g = self.grad(p)
                if g is None:
                    continue
                if g.is_sparse:
                    raise MixprecError("AdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    if self._is_low(p):
                        state["master"] = p.detach().to(self.master_dtype)
                    mdt = self.moment_dtype_for(p)
                    state["exp_avg"] = torch.zeros_like(p, dtype=mdt, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=mdt, memory_format=torch.preserve_format)
                state["step"] += 1
                master = state.get("master", p)
                simple = (
                    master is p
                    and g.dtype == p.dtype
                    and state["exp_avg"].dtype == p.dtype
                    and state["exp_avg_sq"].dtype == p.dtype
                    and not _is_dtensor(p)
                )
                (plain if simple else mixed).append((p, g, state))
            if plain:
                self._step_plain(group, plain)
            if mixed:
                self._step_mixed(group, mixed)
        self._active.clear()  # the step consumed the accumulated gradients
        return loss

    @staticmethod
    def _hyper(group: dict, state: dict) -> tuple[float, float]:
        """(step size, sqrt of the second bias correction) of a parameter at its step count."""
        beta1, beta2 = group["betas"]
        step = state["step"]
        return group["lr"] / (1 - beta1**step), (1 - beta2**step) ** 0.5

    def _step_plain(self, group: dict, items: list) -> None:
        """Parameters that are their own master with same-dtype moments (fp32 AdamW): torch's
        arithmetic, operation by operation, over the whole list at once (torch._foreach_*)."""
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        params = [p for p, _, _ in items]
        grads = [g for _, g, _ in items]
        ms = [st["exp_avg"] for _, _, st in items]
        vs = [st["exp_avg_sq"] for _, _, st in items]
        hyper = [self._hyper(group, st) for _, _, st in items]
        torch._foreach_mul_(params, 1 - lr * wd)
        torch._foreach_lerp_(ms, grads, 1 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, grads, grads, value=1 - beta2)
        denom = torch._foreach_sqrt(vs)
        torch._foreach_div_(denom, [bc2 for _, bc2 in hyper])
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, ms, denom, [-step_size for step_size, _ in hyper])

    def _work(self, name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat scratch tensor of at least n elements, reused across steps (up to _SCRATCH_KEEP)."""
        key = (name, dtype, str(device))
        buf = self._scratch.get(key)
        if buf is not None and buf.numel() >= n:
            return buf[:n]
        buf = torch.empty(n, dtype=dtype, device=device)
        if n <= _SCRATCH_KEEP:
            self._scratch[key] = buf
        return buf

    def _step_mixed(self, group: dict, items: list) -> None:
        """fp32 master and/or moments stored narrower: the same arithmetic, in fp32 scratch space.

        Parameters are taken in packs that fit the scratch buffers; within a pack the moments are
        widened into disjoint slices of the scratch and each operation runs once over the pack
        (torch._foreach_*), then the moments are stored back (stochastic rounding) parameter by
        parameter, exp_avg before exp_avg_sq, in parameter order, as the noise stream requires.
        """
        cap = max(_SCRATCH_MIN, max(min(p.numel(), _SCRATCH_KEEP) for p, _, _ in items))
        pack: list = []
        used = 0
        for item in items:
            n = item[0].numel()
            if pack and (used + n > cap or item[0].device != pack[0][0].device):
                self._step_pack(group, pack, used)
                pack, used = [], 0
            pack.append(item)
            used += n
        if pack:
            self._step_pack(group, pack, used)

    def _step_pack(self, group: dict, items: list, total: int) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        device = items[0][0].device
        if any(_is_dtensor(p) for p, _, _ in items):
            for p, g, st in items:
                self._step_one_generic(group, p, g, st)
            return
        masters, grads, ms, vs, dens, stores = [], [], [], [], [], []
        wm = self._work("m", total, self.master_dtype, device)
        wv = self._work("v", total, self.master_dtype, device)
        wd_ = self._work("denom", total, self.master_dtype, device)
        off = 0
        for p, g, st in items:
            n = p.numel()
            master = st.get("master", p)
            work = master.dtype
            m_st, v_st = st["exp_avg"], st["exp_avg_sq"]
            sl = slice(off, off + n)
            off += n
            m = m_st if m_st.dtype == work else wm[sl].view(p.shape).copy_(m_st)
            v = v_st if v_st.dtype == work else wv[sl].view(p.shape).copy_(v_st)
            masters.append(master)
            grads.append(g if g.dtype == work else g.to(work))
            ms.append(m)
            vs.append(v)
            dens.append(wd_[sl].view(p.shape))
            stores.append((p, master, m, m_st, v, v_st))
        hyper = [self._hyper(group, st) for _, _, st in items]
        # same operations, same order as torch's AdamW (see _step_plain)
        torch._foreach_mul_(masters, 1 - lr * wd)
        torch._foreach_lerp_(ms, grads, 1 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, grads, grads, value=1 - beta2)
        for v, d in zip(vs, dens):
            torch.sqrt(v, out=d)
        torch._foreach_div_(dens, [bc2 for _, bc2 in hyper])
        torch._foreach_add_(dens, eps)
        torch._foreach_addcdiv_(masters, ms, dens, [-step_size for step_size, _ in hyper])
        for p, master, m, m_st, v, v_st in stores:
            self._store_moments((m, v), (m_st, v_st))
            if master is not p:
                p.copy_(master)  # round-to-nearest into the parameter's dtype

    def _store_moments(self, xs: tuple, outs: tuple) -> None:
        """Round the fp32 scratch moments xs (destroyed) into the stored moments `outs`: one noise
        draw for both (lanes 0 and 1), as _step_one_generic does."""
        if self.stochastic_rounding and all(o.dtype == torch.bfloat16 for o in outs):
            key = self._noise.next_key()
            if all(x.dtype == torch.float32 and x is not o and x.is_contiguous() for x, o in zip(xs, outs)):
                n = min(xs[0].numel(), CHUNK)
                noise = self._work("noise", n, torch.int32, xs[0].device)
                tmp = self._work("noise_tmp", n, torch.int32, xs[0].device)
                stochastic_round_pair_into(xs, outs, key, noise, tmp)
                return
            for lane, (x, out) in enumerate(zip(xs, outs)):
                if x is not out:
                    out.copy_(self.round_to_storage(x, out.dtype, key, lane))
            return
        for x, out in zip(xs, outs):
            if x is not out:
                out.copy_(x)

    def _step_one_generic(self, group: dict, p: torch.Tensor, g: torch.Tensor, state: dict) -> None:
        """One parameter, plain tensor ops (DTensor shards: rounding goes through self.round_to_storage, which
        mixprec.distributed.fsdp adapts)."""
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        step_size, bc2_sqrt = self._hyper(group, state)
        master = state.get("master", p)
        work_dtype = master.dtype
        grad = g.to(work_dtype)
        m_stored, v_stored = state["exp_avg"], state["exp_avg_sq"]
        m = m_stored if m_stored.dtype == work_dtype else m_stored.to(work_dtype)
        v = v_stored if v_stored.dtype == work_dtype else v_stored.to(work_dtype)
        master.mul_(1 - lr * wd)
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (v.sqrt() / bc2_sqrt).add_(eps)
        master.addcdiv_(m, denom, value=-step_size)
        # one noise draw per parameter, as in _store_moments: lane 0 for exp_avg, lane 1 for exp_avg_sq
        sr = self.stochastic_rounding and m_stored.dtype == v_stored.dtype == torch.bfloat16
        key = self._noise.next_key() if sr else None
        if m is not m_stored:
            m_stored.copy_(self.round_to_storage(m, m_stored.dtype, key, 0))
        if v is not v_stored:
            v_stored.copy_(self.round_to_storage(v, v_stored.dtype, key, 1))
        if master is not p:
            p.copy_(master)

    def round_to_storage(
        self, x: torch.Tensor, dtype: torch.dtype, key: int | None, lane: int
    ) -> torch.Tensor:
        """x in `dtype`: stochastic rounding with the noise of (key, lane) when key is given (bf16),
        else round-to-nearest. An override point: mixprec.distributed.fsdp adapts it for DTensor shards."""
        if key is not None and dtype == torch.bfloat16:
            return stochastic_round(x, key, lane)
        return x.to(dtype)

    # ---- accounting ----------------------------------------------------------------------------
    def bytes_per_parameter(self) -> dict[str, float]:
        """Measured bytes per parameter of this optimizer's parameters (param, grad, master, moments).

        Gradients count at the dtype they accumulate in (fp32 buffers for low-precision parameters),
        whether or not a gradient currently exists. Call after the first step (state is created lazily).
        """
        n = 0
        parts = {"param": 0.0, "grad": 0.0, "master": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
        for group in self.param_groups:
            for p in group["params"]:
                n += p.numel()
                parts["param"] += p.numel() * p.element_size()
                low = self.accumulate_grads_fp32 and self._is_low(p)
                parts["grad"] += p.numel() * (_nbytes(self.master_dtype) if low else p.element_size())
                st = self.state.get(p, {})
                for key in ("master", "exp_avg", "exp_avg_sq"):
                    t = st.get(key)
                    if t is not None:
                        parts[key] += t.numel() * t.element_size()
        out = {k: v / max(n, 1) for k, v in parts.items()}
        out["total"] = sum(out.values())
        return out

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["mixprec"] = {
            "noise": self._noise.state(),
            "master_dtype": str(self.master_dtype),
            "moment_dtype": str(self.moment_dtype) if self.moment_dtype is not None else "auto",
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("mixprec", None)
        super().load_state_dict(state_dict)
        # torch casts every floating state tensor to the parameter's dtype on load, which would turn the
        # fp32 master into bf16: put back the saved dtypes.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            saved = state_dict["state"].get(pid)
            if saved is None:
                continue
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, dtype=value.dtype, copy=True)
        if extra is not None and "noise" in extra:
            self._noise.load(extra["noise"])
        elif extra is not None and "rng_states" in extra:
            warnings.warn(
                "AdamW.load_state_dict: this checkpoint is from a mixprec version whose stochastic rounding "
                "drew its noise from a torch.Generator; the counter-based noise restarts from its seed, so "
                "the moments' rounding after resuming differs from the original run",
                stacklevel=2,
            )
