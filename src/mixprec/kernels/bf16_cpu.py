"""CPU path for bf16 / fp16 GEMMs: compute in fp32, round the result to the low-precision dtype.

On CPUs without AVX-512-BF16 / AMX a native bf16 matmul is 4-25x slower than fp32. A GPU bf16 GEMM
multiplies bf16 operands with fp32 accumulation and rounds the result once to bf16; computing the
product of the (exactly representable) bf16 operands in fp32 and rounding once gives the same value
up to fp32 accumulation order. So on CPU every GEMM of the model whose operands are bf16/fp16 —
Linear, matmul / @ / mm / bmm / baddbmm / addmm / einsum, scaled_dot_product_attention — is computed
as ``op(a.float(), b.float()).to(bf16)``. Autograd records the fp32 op between two casts, so the
backward GEMMs also run in fp32 and their results are rounded to bf16 by the casts' backward.

Under autocast (bf16-amp / fp16-amp) the inputs are first rounded to the autocast dtype — exactly what
autocast would do — and the fp32 op runs with autocast disabled, so autocast does not re-cast inside.

SDPA: a GPU flash kernel also rounds the softmax probabilities to bf16 before P·V; here they stay fp32,
which is slightly more accurate than the GPU result (documented, not hidden).

The mode is a TorchFunctionMode, pushed by forward pre-hooks on every module of the converted model
and popped by the matching forward hooks (always_call), so a forward recomputed under activation
checkpointing (inside backward) runs with it too. On CUDA nothing is installed: GPU bf16 GEMMs are native.
Nor on CPUs with AVX-512-BF16 / AMX (detected by mixprec.kernels.hardware): there native bf16 GEMMs are the
fast path (see should_install); ``convert_for_training(..., cpu_bf16_gemm="fp32")`` forces this path.

It lives in the kernels layer so that both wings use the one decision: training
(``convert_for_training``; ``mixprec.training.fp32_compute`` is this module's) and inference calibration
(``gemms_in_fp32``, around the calibration forward of fp8-static / FP4 input scales and KV scales).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from mixprec.errors import MixprecError
from mixprec.kernels.hardware import detect

_LOW = (torch.bfloat16, torch.float16)

# Functions (and Tensor methods) that form GEMM sums. einsum is listed because its bmm is hidden from
# the torch-function layer once einsum has been entered.
GEMM_FUNCTIONS = frozenset(
    f
    for f in (
        F.linear,
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.Tensor.__rmatmul__,
        torch.mm,
        torch.Tensor.mm,
        torch.bmm,
        torch.Tensor.bmm,
        torch.baddbmm,
        torch.Tensor.baddbmm,
        torch.addmm,
        torch.Tensor.addmm,
        torch.addbmm,
        torch.Tensor.addbmm,
        torch.mv,
        torch.Tensor.mv,
        torch.einsum,
        F.scaled_dot_product_attention,
    )
)


def _tensors(args, kwargs) -> list[torch.Tensor]:
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


def _target_dtype(func, args, kwargs) -> torch.dtype | None:
    """The dtype the native op would compute in, if it is a low-precision CPU GEMM; else None."""
    if "out" in kwargs:
        return None
    tensors = [t for t in _tensors(args, kwargs) if t.dtype != torch.bool]
    if not tensors or any(t.device.type != "cpu" or not t.is_floating_point() for t in tensors):
        return None
    if torch.is_autocast_enabled("cpu"):
        dt = torch.get_autocast_dtype("cpu")
        if dt in _LOW:
            return dt
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) == 1 and next(iter(dtypes)) in _LOW:
        return next(iter(dtypes))
    return None  # fp32, or mixed dtypes: leave the native op (and its error messages) alone


def _up(x, dtype: torch.dtype):
    """Round to the GEMM dtype (a no-op when already there), then widen to fp32 for the computation."""
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype).float()
    if isinstance(x, (list, tuple)):
        return type(x)(_up(t, dtype) for t in x)
    return x


class Fp32ComputeMode(TorchFunctionMode):
    """Runs bf16/fp16 CPU GEMMs in fp32 and rounds the result (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GEMM_FUNCTIONS:
            dtype = _target_dtype(func, args, kwargs)
            if dtype is not None:
                new_args = tuple(_up(a, dtype) for a in args)
                new_kwargs = {k: _up(v, dtype) for k, v in kwargs.items()}
                with torch.autocast("cpu", enabled=False):
                    out = func(*new_args, **new_kwargs)
                return out.to(dtype)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fp32_compute() -> Iterator[None]:
    """Context manager: bf16/fp16 CPU GEMMs inside compute in fp32 (for code outside a converted model)."""
    with Fp32ComputeMode():
        yield


class _Depth(threading.local):
    def __init__(self) -> None:
        self.n = 0
        self.mode: Fp32ComputeMode | None = None


_DEPTH = _Depth()


def _pre_hook(module, args):
    if _DEPTH.n == 0:
        _DEPTH.mode = Fp32ComputeMode()
        _DEPTH.mode.__enter__()
    _DEPTH.n += 1


def _post_hook(module, args, output):
    _DEPTH.n -= 1
    if _DEPTH.n == 0 and _DEPTH.mode is not None:
        mode, _DEPTH.mode = _DEPTH.mode, None
        mode.__exit__(None, None, None)


class Installed:
    """Handle of the hooks :func:`install` registered; ``remove()`` takes them off."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def install(model: nn.Module) -> Installed:
    """Register the fp32-compute hooks on every module of `model` (CPU models only; see module doc).

    Every module gets them (not only the root) so that a forward recomputed by activation checkpointing,
    which calls an inner module from inside backward, runs under the mode as well.
    """
    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(_pre_hook))
        handles.append(m.register_forward_hook(_post_hook, always_call=True))
    return Installed(handles)


@contextlib.contextmanager
def gemms_in_fp32(model: nn.Module, mode: str = "auto") -> Iterator[bool]:
    """Inside the block, `model`'s bf16/fp16 CPU GEMMs compute in fp32 and round once, when
    should_install(model, mode) says so (a CPU without AVX-512-BF16 / AMX, by default). Yields whether
    it did. The activations stay in the model's dtype: every value a hook sees is what a bf16 GEMM
    (fp32 accumulation, one rounding) gives, up to the order of the fp32 sums."""
    if not should_install(model, mode):
        yield False
        return
    with Fp32ComputeMode():
        yield True


def cpu_has_fast_bf16() -> bool:
    """AVX-512-BF16 or AMX: native bf16 GEMMs are fast on this CPU (mixprec.kernels.hardware.detect())."""

    return detect().cpu_bf16_native


def should_install(model: nn.Module, mode: str = "auto") -> bool:
    """Whether the fp32-compute path should run for `model`.

    mode "auto": on a CPU model when the CPU lacks AVX-512-BF16 / AMX (with them, oneDNN's native bf16
    GEMMs — fp32 accumulation as well — are several times faster than fp32; measured here: 8-10x on
    1024-wide GEMMs); "fp32": on any CPU model; "native": never. GPU models: never.
    """
    if mode not in ("auto", "fp32", "native"):
        raise MixprecError(f"cpu_bf16_gemm must be 'auto', 'fp32' or 'native', got {mode!r}")
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu" or mode == "native":
        return False
    return mode == "fp32" or not cpu_has_fast_bf16()
