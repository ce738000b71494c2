"""enable_fast_paths(): the guide's set-up lines as one explicit, opt-in, undoable call.

The guide turns on TF32 for fp32 matmuls and the flash / memory-efficient SDPA kernels. These are
process-wide torch settings, so mixprec never changes them behind the user's back: this call does,
returns what it changed on this machine, and can be undone (``handle.undo()`` or ``with
enable_fast_paths(): ...``). An fp32 run converted by mixprec (recipe "fp32") stays true fp32 anyway:
its forward and backward run inside :func:`true_fp32` (TF32 off, fp32 matmul precision "highest").
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


def _settings() -> dict[str, tuple[Callable[[], Any], Callable[[Any], None], str]]:
    """name -> (getter, setter, where it matters)."""
    cuda_b = torch.backends.cuda
    return {
        "float32_matmul_precision": (
            torch.get_float32_matmul_precision,
            torch.set_float32_matmul_precision,
            "fp32 matmuls on CUDA (TF32) and on CPUs whose oneDNN has reduced-precision fp32 kernels",
        ),
        "cuda.matmul.allow_tf32": (
            lambda: cuda_b.matmul.allow_tf32,
            lambda v: setattr(cuda_b.matmul, "allow_tf32", v),
            "CUDA fp32 matmuls",
        ),
        "cudnn.allow_tf32": (
            lambda: torch.backends.cudnn.allow_tf32,
            lambda v: setattr(torch.backends.cudnn, "allow_tf32", v),
            "cuDNN fp32 convolutions",
        ),
        "cuda.flash_sdp": (cuda_b.flash_sdp_enabled, cuda_b.enable_flash_sdp, "CUDA SDPA flash kernel"),
        "cuda.mem_efficient_sdp": (
            cuda_b.mem_efficient_sdp_enabled,
            cuda_b.enable_mem_efficient_sdp,
            "CUDA SDPA memory-efficient kernel",
        ),
    }


_FAST = {
    "float32_matmul_precision": "high",
    "cuda.matmul.allow_tf32": True,
    "cudnn.allow_tf32": True,
    "cuda.flash_sdp": True,
    "cuda.mem_efficient_sdp": True,
}
_TRUE_FP32 = {
    "float32_matmul_precision": "highest",
    "cuda.matmul.allow_tf32": False,
    "cudnn.allow_tf32": False,
}


def _read(names) -> dict[str, Any]:
    s = _settings()
    return {n: s[n][0]() for n in names}


def _write(values: dict[str, Any]) -> None:
    s = _settings()
    for n, v in values.items():  # dict order: float32_matmul_precision first, then the flags it touches
        s[n][1](v)


@dataclass
class FastPaths:
    """What enable_fast_paths() changed: ``changes[name] = {"before", "after", "affects", "effective_here"}``."""

    changes: dict[str, dict[str, Any]] = field(default_factory=dict)
    device: str = "cpu"
    _before: dict[str, Any] = field(default_factory=dict, repr=False)
    _undone: bool = field(default=False, repr=False)

    @property
    def changed(self) -> list[str]:
        return [n for n, c in self.changes.items() if c["before"] != c["after"]]

    def undo(self) -> None:
        """Restore every setting to its value before enable_fast_paths() (idempotent)."""
        if not self._undone:
            _write(self._before)
            self._undone = True

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "changed": self.changed, "settings": self.changes}

    def __enter__(self) -> FastPaths:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def enable_fast_paths() -> FastPaths:
    """Turn on TF32 for fp32 matmuls and the flash / memory-efficient SDPA kernels, process-wide.

    Returns a :class:`FastPaths` saying, per setting, the value before and after, what it affects and
    whether it has an effect on this machine (without CUDA, the CUDA settings change nothing here).
    Undo with ``.undo()`` or use it as a context manager.
    """
    before = _read(_FAST)
    _write(_FAST)
    after = _read(_FAST)
    has_cuda = torch.cuda.is_available()
    info = _settings()
    changes = {}
    for n in _FAST:
        cuda_only = n.startswith("cuda") or n.startswith("cudnn")
        changes[n] = {
            "before": before[n],
            "after": after[n],
            "affects": info[n][2],
            "effective_here": (has_cuda or not cuda_only) and before[n] != after[n],
        }
    return FastPaths(changes=changes, device="cuda" if has_cuda else "cpu", _before=before)


@contextlib.contextmanager
def true_fp32() -> Iterator[None]:
    """fp32 matmuls in full fp32 inside (TF32 and reduced-precision fp32 kernels off), restored after."""
    before = _read(_TRUE_FP32)
    _write(_TRUE_FP32)
    try:
        yield
    finally:
        _write(before)


def true_fp32_hooks(model: nn.Module) -> list:
    """Make the forward AND backward of `model` run under :func:`true_fp32`.

    Forward: pre/post hooks on the root. Backward: a hook on each output tensor enters the context when
    backward reaches the model and queues its exit at the end of the backward pass.
    """
    local = threading.local()

    def pre(module, args):
        ctx = true_fp32()
        ctx.__enter__()
        local.__dict__.setdefault("stack", []).append(ctx)

    def on_grad(grad):
        if getattr(local, "backward_ctx", None) is None:
            ctx = true_fp32()
            ctx.__enter__()
            local.backward_ctx = ctx

            def leave():
                local.backward_ctx, c = None, local.backward_ctx
                c.__exit__(None, None, None)

            torch.autograd.Variable._execution_engine.queue_callback(leave)
        return grad

    def post(module, args, output):
        local.stack.pop().__exit__(None, None, None)
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(on_grad)

    return [model.register_forward_pre_hook(pre), model.register_forward_hook(post, always_call=True)]


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []
