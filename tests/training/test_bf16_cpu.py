"""CPU bf16 path: each GEMM equals the fp32 product of the bf16 operands rounded once to bf16."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec.training
from mixprec.kernels import bf16_cpu
from mixprec.kernels.bf16_cpu import fp32_compute


def _bf(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


CASES = {
    "linear": (lambda a, b, c: F.linear(a, b, c), ((4, 5, 32), (16, 32), (16,))),
    "matmul": (lambda a, b, c: torch.matmul(a, b), ((3, 8, 32), (32, 16), None)),
    "operator": (lambda a, b, c: a @ b, ((3, 8, 32), (3, 32, 16), None)),
    "bmm": (lambda a, b, c: torch.bmm(a, b), ((3, 8, 32), (3, 32, 16), None)),
    "method_bmm": (lambda a, b, c: a.bmm(b), ((3, 8, 32), (3, 32, 16), None)),
    "baddbmm": (
        lambda a, b, c: torch.baddbmm(c, a, b, beta=0.5, alpha=2.0),
        ((3, 8, 32), (3, 32, 16), (3, 8, 16)),
    ),
    "addmm": (lambda a, b, c: torch.addmm(c, a, b), ((8, 32), (32, 16), (16,))),
    "einsum": (lambda a, b, c: torch.einsum("bik,bkj->bij", a, b), ((3, 8, 32), (3, 32, 16), None)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_equals_fp32_product_rounded_once(case):
    fn, shapes = CASES[case]
    args = [_bf(*s, seed=i) if s is not None else None for i, s in enumerate(shapes)]
    with fp32_compute():
        got = fn(*args)
    ref = fn(*[a.float() if a is not None else None for a in args]).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, ref)


def test_sdpa_computes_in_fp32():
    q, k, v = (_bf(2, 4, 16, 32, seed=s) for s in range(3))
    with fp32_compute():
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).bfloat16()
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref)


def test_backward_is_fp32_compute_rounded():
    a = _bf(8, 32).requires_grad_()
    w = _bf(16, 32, seed=1).requires_grad_()
    gy = _bf(8, 16, seed=2)
    with fp32_compute():
        y = F.linear(a, w)
    y.backward(gy)
    assert a.grad.dtype == torch.bfloat16
    assert torch.equal(a.grad, (gy.float() @ w.float()).bfloat16())
    assert torch.equal(w.grad, (gy.float().t() @ a.float()).bfloat16())


def test_autocast_inputs_rounded_once_and_not_recast():
    x = torch.randn(8, 32)
    w = torch.randn(16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16), fp32_compute():
        got = F.linear(x, w)
        inside_other = x + 1  # non-GEMM ops untouched
    ref = (x.bfloat16().float() @ w.bfloat16().float().t()).bfloat16()
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref)
    assert inside_other.dtype == torch.float32


def test_fp32_and_mixed_inputs_left_alone():
    a, b = torch.randn(4, 8), torch.randn(8, 4)
    with fp32_compute():
        assert torch.equal(a @ b, torch.matmul(a, b))
        with pytest.raises(RuntimeError):  # native error for mixed dtypes stays
            _ = a @ b.bfloat16()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_install_on_model_and_checkpoint_recompute():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block()).bfloat16()
    handle = bf16_cpu.install(model)
    x = _bf(4, 32)

    def run(checkpointed):
        model.zero_grad()
        h = x
        for blk in model:
            if checkpointed:
                h = torch.utils.checkpoint.checkpoint(blk, h, use_reentrant=False)
            else:
                h = blk(h)
        h.float().sum().backward()
        return h, [p.grad.clone() for p in model.parameters()]

    y0, g0 = run(False)
    y1, g1 = run(True)  # recomputed forward runs under the fp32 mode too, so metadata and values agree
    assert torch.equal(y0, y1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    with fp32_compute():
        ref = model[1].fc2(torch.relu(model[1].fc1(model[0](x))))
    assert torch.equal(y0, ref)
    handle.remove()
    assert not model[0]._forward_pre_hooks


def test_installed_only_where_native_bf16_is_slow(monkeypatch):
    model = nn.Linear(16, 16)
    monkeypatch.setattr(bf16_cpu, "cpu_has_fast_bf16", lambda: False)
    assert bf16_cpu.should_install(model) and bf16_cpu.should_install(model, "fp32")
    assert not bf16_cpu.should_install(model, "native")
    monkeypatch.setattr(bf16_cpu, "cpu_has_fast_bf16", lambda: True)  # AVX-512-BF16 / AMX
    assert not bf16_cpu.should_install(model) and bf16_cpu.should_install(model, "fp32")
    from mixprec.errors import MixprecError

    with pytest.raises(MixprecError):
        bf16_cpu.should_install(model, "fast")


def test_training_uses_the_kernels_layer_path():
    """One home: the CPU bf16 path lives in the kernels layer only (inference calibration uses it too);
    training has no module of its own for it, and its public fp32_compute is the kernels layer's."""
    assert importlib.util.find_spec("mixprec.training.bf16_cpu") is None
    assert mixprec.training.fp32_compute is bf16_cpu.fp32_compute
