"""GPTQ (mixprec.inference.algorithms.gptq) against RTN and a plain column-by-column reference."""

from __future__ import annotations

import pytest
import torch

from mixprec.errors import MixprecError
from mixprec.formats import get_format
from mixprec.inference.algorithms.gptq import HessianAccumulator, _group_scales, gptq_quantize
from mixprec.kernels import emulation
from mixprec.quantization import quantize
from mixprec.scaling import Granularity

pytestmark = pytest.mark.usefixtures("single_thread")

SCHEMES = {  # the weight granularities of mixprec's schemes
    "fp8 per-channel": ("e4m3", Granularity.rows()),
    "fp8 per-tensor": ("e4m3", Granularity.tensor()),
    "fp8 128x128": ("e4m3", Granularity.blocks(128, 128)),
    "nvfp4": ("e2m1", Granularity.nvfp4()),
    "mxfp4": ("e2m1", Granularity.mx()),
    "mxfp8": ("e4m3", Granularity.mx()),
}


def _layer(gen, n=48, k=256, tokens=512):
    w = torch.randn(n, k, generator=gen) / 16
    # correlated inputs with a few large channels, as transformer activations have
    x = torch.randn(tokens, k, generator=gen) @ (
        torch.eye(k) + 0.3 * torch.randn(k, k, generator=gen) / k**0.5
    )
    x[:, :4] *= 8
    h = HessianAccumulator(k)
    h.add(x[: tokens // 2])
    h.add(x[tokens // 2 :])
    return w, x, h.finish()


@pytest.mark.parametrize("k", [1, 3, 7, 300])
def test_the_hessian_is_symmetric_and_the_inputs_product(k, gen):
    """Accumulated by row blocks of its lower triangle, mirrored at finish: 2/n X^T X."""
    x = torch.randn(50, k, generator=gen)
    acc = HessianAccumulator(k)
    acc.add(x[:20])
    acc.add(x[20:].reshape(3, 10, k))  # any leading dimensions
    h = acc.finish()
    assert torch.equal(h, h.T)
    torch.testing.assert_close(h.double(), x.double().T @ x.double() * (2 / 50), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [5, 300])
def test_bf16_inputs_take_the_bf16_units_and_other_inputs_stay_in_fp32(k, gen):
    """Forced "bf16" (on any CPU: one without native bf16 runs the same call in fp32): bf16 inputs give
    the same exact products as fp32, summed in another order; fp32 inputs are never rounded to bf16 —
    their Hessian is the fp32 accumulator's bit for bit. `arithmetic_used` says what ran."""
    x = (torch.randn(64, k, generator=gen) * 3).bfloat16()
    fp32, bf16 = HessianAccumulator(k, arithmetic="fp32"), HessianAccumulator(k, arithmetic="bf16")
    for acc in (fp32, bf16):
        acc.add(x[:40])
        acc.add(x[40:])
    exact = x.double().T @ x.double() * (2 / 64)
    h32, h16 = fp32.finish(), bf16.finish()
    assert torch.equal(h16, h16.T)
    for h in (h32, h16):  # fp32 sums of 64 exact products: within a few ulps of the float64 result
        torch.testing.assert_close(h.double(), exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))
    assert fp32.arithmetic_used == {"fp32"}
    assert bf16.arithmetic_used == ({"bf16"} if emulation.native_bf16() else {"fp32"})

    wide = torch.randn(64, k, generator=gen)  # not bf16-exact: never multiplied on the bf16 units
    a, b = HessianAccumulator(k, arithmetic="fp32"), HessianAccumulator(k, arithmetic="bf16")
    a.add(wide)
    b.add(wide)
    assert torch.equal(a.finish(), b.finish()) and b.arithmetic_used == {"fp32"}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_identity_hessian_is_rtn_bit_for_bit(scheme, gen):
    fmt, g = SCHEMES[scheme]
    w = torch.randn(256, 256, generator=gen) / 16
    result = gptq_quantize(w, torch.eye(256), fmt, g)
    rtn = quantize(w, fmt, g)
    assert torch.equal(result.rounded, result.quantized.dequantize())
    assert torch.equal(result.quantized.data, rtn.data)
    assert torch.equal(result.quantized.scale, rtn.scale)
    if rtn.global_scale is not None:
        assert torch.equal(result.quantized.global_scale, rtn.global_scale)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("act_order", [False, True])
def test_output_error_is_below_rtn(scheme, act_order, gen):
    fmt, g = SCHEMES[scheme]
    w, x, h = _layer(gen)
    result = gptq_quantize(w, h, fmt, g, act_order=act_order)
    ref = x @ w.t()
    gptq_err = (x @ result.quantized.dequantize().t() - ref).square().mean()
    rtn_err = (x @ quantize(w, fmt, g).dequantize().t() - ref).square().mean()
    assert gptq_err < rtn_err


def _reference_gptq(w, h, fmt, g, damp=0.01):
    """Column by column, no lazy blocks, scales from the current weight at each group's first column."""
    w = w.clone()
    k = w.shape[1]
    h = h.clone()
    torch.diagonal(h).add_(damp * float(torch.diagonal(h).mean()))
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    width = k if g.block_cols is None else g.block_cols
    out = torch.empty_like(w)
    gs = quantize(w, fmt, g).global_scale
    scale = None
    for i in range(k):
        if i % width == 0:
            scale = quantize(w[:, i : i + width], fmt, g, global_scale=gs).scale
        q = quantize(w[:, i : i + 1], fmt, g, scale=scale, global_scale=gs).dequantize()[:, 0]
        out[:, i] = q
        w[:, i:] -= ((w[:, i] - q) / hinv[i, i])[:, None] * hinv[i, i:][None, :]
    return out


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_scales_fixed_up_front_are_each_groups_own(scheme, gen):
    """Round to nearest's scales, made by one quantize call over the whole weight, are those of each
    group quantized alone (K = 300: a partial last group for every block width)."""
    fmt, g = SCHEMES[scheme]
    w = torch.randn(256, 300, generator=gen)
    w[:, 7] *= 40  # one group with a far larger amax
    global_scale = quantize(w, fmt, g).global_scale
    width = 300 if g.block_cols is None else min(g.block_cols, 300)
    fixed = _group_scales(w, get_format(fmt), g, width, None, global_scale, None)
    assert sorted(fixed) == list(range(0, 300, width))
    for c0, scale in fixed.items():
        alone = quantize(w[:, c0 : c0 + width], fmt, g, global_scale=global_scale).scale
        assert torch.equal(scale, alone), c0


@pytest.mark.parametrize("scheme", ["nvfp4", "fp8 per-channel", "mxfp4"])
def test_lazy_blocks_match_the_column_by_column_reference(scheme, gen):
    fmt, g = SCHEMES[scheme]
    w, _, h = _layer(gen, n=16, k=96)
    got = gptq_quantize(w.double().float(), h, fmt, g, block=32).quantized.dequantize()
    ref = _reference_gptq(w, h, fmt, g)
    # the same roundings; fp32 update order differs, so an element may land on the neighbouring point
    assert (got != ref).float().mean() < 0.02


def test_dead_columns_and_given_scales(gen):
    w, _, h = _layer(gen, k=64)
    h[:, 5] = 0
    h[5, :] = 0
    fits = gptq_quantize(w, h, "e4m3", Granularity.tensor(), scale=torch.tensor(0.01))  # range 4.48
    assert fits.dead_columns == 1 and fits.clipped == 0
    assert float(fits.quantized.scale) == pytest.approx(0.01)
    assert bool((fits.quantized.dequantize()[:, 5] == 0).all())
    tight = gptq_quantize(w, h, "e4m3", Granularity.tensor(), scale=torch.tensor(1e-4))  # range 0.0448
    expected = int((w.abs() > 0.0448).sum())  # at least the values beyond it before any update
    assert tight.clipped >= expected > 0
    w_before = w.clone()
    gptq_quantize(w, h, "e2m1", Granularity.nvfp4())
    assert torch.equal(w, w_before)  # inputs are not modified


def test_nothing_is_clipped_without_updates_where_the_last_row_block_is_partial(gen):
    """Identity Hessian: no updates, so no value passes its group's range. 200 rows of 128-row blocks
    (the last holds 72): each row is held to its own block's scale (rows 100-127, in the first block, of
    large values, would count as clipped against the second block's small one)."""
    w = (torch.randn(200, 256, generator=gen) / 16).clamp(-0.4, 0.4)
    w[128:] /= 1024
    # each block's largest value 448 * 2^k: its scale 2^k exactly, so none lands a rounding past 448
    w[0, ::128] = 448 * 2.0**-10
    w[128, ::128] = 448 * 2.0**-20
    result = gptq_quantize(w, torch.eye(256), "e4m3", Granularity.blocks(128, 128))
    assert result.clipped == 0
    assert torch.equal(result.quantized.data, quantize(w, "e4m3", Granularity.blocks(128, 128)).data)


def test_bad_inputs_are_named(gen):
    w = torch.randn(8, 32, generator=gen)
    with pytest.raises(MixprecError, match="q_proj: Hessian of shape"):
        gptq_quantize(w, torch.eye(16), "e4m3", Granularity.rows(), name="q_proj")
    bad = torch.eye(32)
    bad[0, 0] = float("nan")
    with pytest.raises(MixprecError, match="inf or NaN"):
        gptq_quantize(w, bad, "e4m3", Granularity.rows())
    with pytest.raises(MixprecError, match="not positive definite"):
        gptq_quantize(w, -torch.eye(32), "e4m3", Granularity.rows(), damp=0.0)
    with pytest.raises(MixprecError, match="no calibration rows"):
        HessianAccumulator(4).finish()
    with pytest.raises(MixprecError, match="scales must be finite and positive"):
        gptq_quantize(w, torch.eye(32), "e4m3", Granularity.tensor(), scale=torch.tensor([[0.0]]))
    with pytest.raises(MixprecError, match="a global scale must be finite and positive"):
        gptq_quantize(
            w, torch.eye(32), "e2m1", Granularity.nvfp4(), global_scale=torch.tensor([float("inf")])
        )


def _old_chain(h: torch.Tensor, damp: float, order: torch.Tensor | None) -> torch.Tensor:
    """The upper Cholesky factor of the dampened inverse, the plain way: copies at every step."""
    h = h.clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    torch.diagonal(h).add_(damp * float(torch.diagonal(h).mean()))
    if order is not None:
        h = h[order][:, order]
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


@pytest.mark.parametrize("act_order", [False, True])
def test_the_factor_made_in_the_hessians_memory_is_the_copied_one_bit_for_bit(act_order, gen):
    from mixprec.inference.algorithms.gptq import solve_factor

    _, _, h = _layer(gen, k=300)
    h[:, 7] = h[7, :] = 0  # a dead input
    kept = h.clone()
    copied = solve_factor(h, 0.01, act_order)
    assert torch.equal(h, kept)  # not consumed: left as it was
    ptr = h.data_ptr()
    owned = solve_factor(h, 0.01, act_order, consume=True)
    assert owned.upper.data_ptr() == ptr  # the Hessian's own memory
    order = copied.order
    assert torch.equal(copied.upper, owned.upper)
    # the factor of the inverse as the solve made it before (three factorisations, copies at each step):
    # the same matrix, in other roundings
    torch.testing.assert_close(owned.upper, _old_chain(kept, 0.01, order), rtol=1e-4, atol=1e-5)
    assert torch.equal(owned.diagonal, torch.diagonal(kept)) and int(owned.dead.sum()) == 1


@pytest.mark.parametrize("n", [5, 256, 300, 700])
def test_the_in_place_triangular_inverse_is_the_inverse(n, gen, monkeypatch):
    from mixprec.inference.algorithms import gptq
    from mixprec.inference.algorithms.gptq import _invert_lower_in_place, _reverse_in_place

    monkeypatch.setattr(gptq, "CHUNK_BYTES", 64)  # the reversal swaps 16 elements at a time

    a = torch.randn(n, n, generator=gen)
    lower = torch.linalg.cholesky(a @ a.T / n + torch.eye(n))
    expected = torch.linalg.inv(lower.double())
    got = lower.mT.contiguous().mT  # column-major, as the solve holds it
    _invert_lower_in_place(got, rows_per_chunk=7)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    flat = torch.arange(n * n + 0.0).reshape(n, n)
    _reverse_in_place(flat)
    assert torch.equal(flat, torch.arange(n * n + 0.0).flip(0).reshape(n, n))


def test_the_in_place_permutation_is_indexing(gen):
    from mixprec.inference.algorithms.gptq import _permute_in_place

    h = torch.randn(37, 37, generator=gen)
    order = torch.randperm(37, generator=gen)
    expected = h[order][:, order]
    _permute_in_place(h, order, rows_per_chunk=5)
    assert torch.equal(h, expected)


@pytest.mark.parametrize("act_order", [False, True])
def test_the_output_error_from_the_factor_is_the_hessians(act_order, gen):
    """tr(E H E^T) / tr(W H W^T), computed from the factor (H spent), against H itself."""
    from mixprec.inference.algorithms.gptq import solve_factor

    w, _, h = _layer(gen)
    h[:, 3] = h[3, :] = 0
    w[:, 3] = 1.0  # a dead input's weight counts nowhere
    rounded = quantize(w, "e2m1", Granularity.nvfp4()).dequantize()
    e = (w - rounded).double()
    hd = h.double()
    expected = float(((e @ hd) * e).sum() / ((w.double() @ hd) * w.double()).sum())
    factor = solve_factor(h, 0.01, act_order, consume=True)
    assert factor.output_errors(w, rounded, w) == pytest.approx([expected, 0.0], rel=1e-4, abs=1e-9)


@pytest.mark.parametrize("scheme", ["nvfp4", "fp8 per-channel", "mxfp4"])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptqs_own_output_error_needs_no_solve(scheme, act_order, gen):
    """The output error of GPTQ's rounding from the solve's scaled errors equals the triangular solve's."""
    from mixprec.inference.algorithms.gptq import solve_factor

    fmt, g = SCHEMES[scheme]
    w, _, h = _layer(gen)
    h[:, 3] = h[3, :] = 0  # a dead input: its weight is zeroed in the solve
    factor = solve_factor(h, 0.01, act_order, consume=True)
    result = gptq_quantize(w, factor, fmt, g)
    q = result.quantized.dequantize()
    (by_solve,) = factor.output_errors(w, q)
    (free,) = factor.output_errors(w, solved=(q, float(result.energy_rows.sum())))
    assert by_solve > 0 and free == pytest.approx(by_solve, rel=1e-4)


def test_the_solve_holds_one_hessian(tmp_path):
    """solve_factor(consume=True) with activation order: no K x K beside the Hessian (peak RSS of a child)."""
    import subprocess
    import sys

    code = """
import torch
from mixprec.inference.algorithms import gptq
gptq.CHUNK_BYTES = 1 << 20  # the chunk of rows a step copies: small beside this K x K (at K = 28672: 0.5 %)
def hwm():
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')) * 1024
k = 3072
h = torch.rand(k, k).mul_(1e-3)
h.add_(h.t().contiguous()).diagonal().add_(k * 2e-3)
torch.diagonal(h)[::2].mul_(3)  # an activation order that moves rows
base = hwm()
gptq.solve_factor(h, 0.01, True, consume=True)
print((hwm() - base) / (k * k * 4))
"""
    if not __import__("os").path.exists("/proc/self/status"):
        pytest.skip("peak RSS from /proc (Linux)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout) < 0.25  # measured 0.0; with copies at each step: 2 K x K and more


STACKED = {  # scheme name: the rows of three Linears that read one input (q/k/v-like)
    "fp8 per-channel": (96, 32, 32),
    "fp8 per-tensor": (96, 32, 32),  # with the shared scale fixed up front, as fp8-static's fused shards
    "fp8 128x128": (256, 128, 128),
    "nvfp4": (96, 32, 32),  # with the shared global scale
    "mxfp4": (96, 32, 32),
}


@pytest.mark.parametrize("scheme", sorted(STACKED))
def test_a_stacked_solve_rounds_each_linear_as_its_own_solve_bit_for_bit(scheme, gen):
    """GptqPass solves Linears that share a Hessian as one stacked weight: GPTQ works row by row, so
    each Linear's rows (payload, scales, clipped count) come out as its own solve's. (Measured
    bit-identical on the AMX Xeon: the lazy update's GEMM sums each output in the same order whatever
    the number of rows.)"""
    from mixprec.inference.algorithms.gptq_pass import split_rows

    fmt, g = SCHEMES[scheme]
    _, _, h = _layer(gen, k=256)
    weights = [torch.randn(n, 256, generator=gen) / 16 for n in STACKED[scheme]]
    weights[0][:, :3] *= 6  # an outlier-heavy member, so that the members' scales differ
    scale = quantize(torch.cat(weights), fmt, g).scale if g.block_rows is None else None
    global_scale = quantize(torch.cat(weights), fmt, g).global_scale
    stacked = gptq_quantize(torch.cat(weights), h, fmt, g, scale=scale, global_scale=global_scale)
    assert torch.equal(stacked.rounded, stacked.quantized.dequantize())  # what the records' errors use
    assert stacked.clipped_rows.shape == (sum(STACKED[scheme]),)
    for w, (q, clipped) in zip(weights, split_rows(stacked, [w.shape[0] for w in weights]), strict=True):
        alone = gptq_quantize(w, h, fmt, g, scale=scale, global_scale=global_scale)
        assert q.shape == w.shape and clipped == alone.clipped
        assert torch.equal(q.data.view(torch.uint8), alone.quantized.data.view(torch.uint8))
        assert torch.equal(q.scale, alone.quantized.scale)
        assert torch.equal(q.dequantize(), alone.quantized.dequantize())


def test_which_linears_stack():
    """Only what rounds the same together: not members with their own per-tensor or global scale, nor
    row blocks that would span two members."""
    from mixprec.inference.algorithms.gptq_pass import stacks
    from mixprec.inference.schemes import SCHEMES as INFERENCE_SCHEMES

    names = ("q", "k", "v")
    weights = {"q": torch.zeros(256, 64), "k": torch.zeros(128, 64), "v": torch.zeros(128, 64)}
    one = torch.tensor(1.0)

    def plan(scheme, shared, w=weights):
        return stacks(names, dict.fromkeys(names, INFERENCE_SCHEMES[scheme]), shared, w)

    assert plan("nvfp4a16", dict.fromkeys(names, (None, one))) == [names]
    assert plan("nvfp4a16", {}) == [("q",), ("k",), ("v",)]  # each its own global scale
    assert plan("nvfp4a16", {"q": (None, one), "k": (None, one), "v": (None, 2 * one)}) == [
        ("q", "k"),
        ("v",),
    ]
    assert plan("fp8-dynamic", {}) == [names]  # per-channel scales
    assert plan("fp8-static", dict.fromkeys(names, (one, None))) == [names]  # the shared fixed scale
    assert plan("fp8-static", {}) == [("q",), ("k",), ("v",)]
    assert plan("fp8-block", {}) == [names]  # 128-row blocks divide 256 and 128
    odd = {**weights, "k": torch.zeros(96, 64)}
    assert plan("fp8-block", {}, odd) == [("q", "v"), ("k",)]
