"""FP4 training (fp4-nvfp4, fp4-mxfp4): stochastic rounding onto E2M1, the recipes' operand layouts, and
the three GEMMs of an FP4 LowPrecisionLinear against references built from THE quantizer's dequantized operands
(bit-exact: the emulated GEMM is one fp32 matmul of the same dequantized values)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec import ranks
from mixprec.errors import MixprecError
from mixprec.formats import E2M1
from mixprec.gemm import native_available, scaled_mm
from mixprec.hadamard import rht_matrix, transform_rows
from mixprec.kernels.hardware import detect
from mixprec.quantization import quantize
from mixprec.recipes import MXFP4Training, NVFP4Training, from_name
from mixprec.rounding import flat_indices, stochastic_round_to_grid, stream_key, uniform24
from mixprec.scaling import Granularity
from mixprec.training.low_precision_linear import LowPrecisionLinear
from mixprec.training.quantizer_state import rounding_key

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # E2M1 magnitudes
E2M1_ARGS = {"mantissa_bits": 1, "emin": 0, "max_value": 6.0}


# ---------------------------------------------------------------------------------------------------
# Stochastic rounding onto the E2M1 grid


def _grid_reference(v, key, *, mantissa_bits, emin, max_value, index=None):
    """stochastic_round_to_grid's definition written out whole-tensor (the code before it went chunked,
    from the bits): the reference its fast form must match bit for bit."""
    x = v.float()
    a = x.abs()
    _, exp = torch.frexp(a)
    e = torch.clamp(exp - 1, min=emin)
    step = torch.ldexp(torch.ones_like(a), e - mantissa_bits)
    t = a / step
    lower = torch.floor(t)
    frac = t - lower
    idx = flat_indices(tuple(x.shape)) if index is None else index.reshape(x.shape)
    u = uniform24(idx, key).to(torch.float32) * 2.0**-24
    r = torch.clamp((lower + (u < frac).to(torch.float32)) * step, max=max_value)
    r = torch.where(a >= max_value, torch.full_like(a, max_value), r)
    return torch.where(torch.isnan(x), x, torch.copysign(r, x))


@pytest.mark.parametrize(
    "args",
    [
        E2M1_ARGS,
        {"mantissa_bits": 2, "emin": -2, "max_value": 28.0},
        {"mantissa_bits": 3, "emin": -6, "max_value": 448.0},
    ],
    ids=["e2m1", "e3m2", "e4m3"],
)
def test_stochastic_rounding_is_its_written_out_definition_bit_for_bit(monkeypatch, args):
    """Chunked (several chunks: CHUNK made small), from the bits: the same values as the reference on
    random values over 10 decades, grid values and midpoints, +-0, fp32 subnormals, max, beyond max,
    +-inf, NaN, a sweep of bit patterns, a transposed view, bf16 input and given indices."""
    import math

    from mixprec import rounding

    monkeypatch.setattr(rounding, "CHUNK", 1000)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 500, generator=g) * torch.logspace(-8, 2, 500)
    x[0, :12] = torch.tensor(
        [0.0, -0.0, math.inf, -math.inf, math.nan, 6.0, -6.0, 7.0, 1e-45, -1e-40, 0.25, 5.0]
    )
    x[1] = torch.arange(500) * 0.125 - 30
    sweep = (
        torch.arange(-(2**31), 2**31 - 1, 2**16 + 1, dtype=torch.int64).to(torch.int32).view(torch.float32)
    )
    index = torch.randint(0, 2**31 - 1, x.shape, generator=g, dtype=torch.int64).to(torch.int32)
    for key in (0, 7, -123456789):
        for v, idx in ((x, None), (x.t(), None), (sweep, None), (x.bfloat16(), None), (x, index)):
            want = _grid_reference(v, key, index=idx, **args)
            got = stochastic_round_to_grid(v, key, index=idx, **args)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (key, tuple(v.shape))


def test_stochastic_rounding_picks_a_neighbour_with_the_right_probability_rule():
    """Against a slow reference: the two grid neighbours of |v| from the value list, up iff u < p."""
    torch.manual_seed(0)
    v = torch.cat([torch.randn(500) * 3, torch.tensor(GRID), -torch.tensor(GRID), torch.tensor([7.0, -9.0])])
    key = 12345
    got = stochastic_round_to_grid(v, key, **E2M1_ARGS)
    u = uniform24(flat_indices(tuple(v.shape)), key).double() / 2**24
    for i, x in enumerate(v.tolist()):
        a = abs(x)
        if a >= 6.0:
            want = 6.0
        else:
            lo = max(g for g in GRID if g <= a)
            hi = min(g for g in GRID if g > a)
            p = (a - lo) / (hi - lo)
            want = hi if u[i] < p else lo
        assert float(got[i]) == (want if x >= 0 else -want), (x, float(got[i]), want)


def test_stochastic_rounding_is_unbiased():
    """Mean error over 20000 independent draws within 4 standard errors, for values between grid points
    (normal and subnormal spacing) — while round-to-nearest is biased by up to a quarter step."""
    values = torch.tensor([0.1, 0.3, 0.7, 1.2, 1.9, 2.6, 3.3, 4.5, 5.9, -2.2, -0.05])
    draws = values.repeat(20000, 1)
    rounded = stochastic_round_to_grid(draws, stream_key(0, 0, 0, 1), **E2M1_ARGS)
    err = (rounded - draws).double()
    mean, se = err.mean(0), err.std(0) / len(draws) ** 0.5
    assert (mean.abs() <= 4 * se + 1e-12).all(), (mean, se)
    assert set(rounded.abs().unique().tolist()) <= set(GRID)


def test_stochastic_rounding_reproduces_from_its_key_and_differs_between_ranks():
    x = torch.randn(64, 64) * 2
    keys = [stream_key(seed=3, step=10, rank=r, tensor=99) for r in range(8)]
    assert len(set(keys)) == 8  # the rank enters through a bijection: never two ranks on one key
    a = stochastic_round_to_grid(x, keys[0], **E2M1_ARGS)
    assert torch.equal(a, stochastic_round_to_grid(x, keys[0], **E2M1_ARGS))
    assert not torch.equal(a, stochastic_round_to_grid(x, keys[1], **E2M1_ARGS))
    assert stream_key(3, 11, 0, 99) != keys[0] and stream_key(4, 10, 0, 99) != keys[0]


def test_quantize_with_a_rounding_key_puts_the_stochastic_values_in_the_payload():
    torch.manual_seed(1)
    x = torch.randn(32, 64)
    g = Granularity.nvfp4(1, 16)
    q_rne = quantize(x, E2M1, g)
    q_sr = quantize(x, E2M1, g, rounding_key=7)
    assert torch.equal(q_sr.scale, q_rne.scale) and torch.equal(q_sr.global_scale, q_rne.global_scale)
    scaled = x / q_rne.effective_scale().repeat_interleave(16, dim=1)  # the quantizer's own division
    want = stochastic_round_to_grid(scaled, 7, **E2M1_ARGS)
    assert torch.equal(q_sr.dequantize(), want * q_rne.effective_scale().repeat_interleave(16, dim=1))
    assert not torch.equal(q_sr.data, q_rne.data)
    with pytest.raises(MixprecError, match="eager"):
        quantize(x, E2M1, Granularity.mx(32), rounding_key=7, backend="tiled")


# ---------------------------------------------------------------------------------------------------
# Recipes


def test_recipe_options_round_trip_and_layouts():
    r = from_name("fp4-nvfp4:rht=false,sr=false,2d=false,keep_last=2,seed=5")
    assert r == NVFP4Training(rht=False, stochastic_rounding=False, two_d=False, keep_last=2, seed=5)
    assert from_name(r.spec()) == r and r.kind == "fp4"
    d = from_name("fp4-nvfp4")
    out, gi, gw = (d.gemm_layout(g) for g in ("output", "grad_input", "grad_weight"))
    assert out.a.granularity == Granularity.nvfp4(1, 16) and out.b.granularity == Granularity.nvfp4(16, 16)
    assert gi.b.granularity == Granularity.nvfp4(16, 16)  # Wᵀ: the same 16x16 blocks
    # stochastic rounding on the gradient only, the Hadamard transform on the wgrad operands only
    assert [gi.a.stochastic, gw.a.stochastic, out.a.stochastic, gw.b.stochastic] == [True, True, False, False]
    assert [gw.a.hadamard, gw.b.hadamard, gi.a.hadamard, out.a.hadamard, gi.b.hadamard] == [
        True, True, False, False, False,
    ]  # fmt: skip
    assert "+RHT+SR" in d.describe()
    m = from_name("fp4-mxfp4:even")
    assert m == MXFP4Training(rounding="even")
    assert m.gemm_layout("output").b.granularity == Granularity.mx(32, rounding="even")
    assert from_name("fp4-mxfp4:2d=true").gemm_layout("output").b.granularity == Granularity(32, 32, "e8m0")
    for bad, what in (("fp4-nvfp4:keep_last=-1", "keep_last"), ("fp4-nvfp4:rht=maybe", "boolean"),
                      ("fp4-mxfp4:rounding=up", "rounding"), ("fp4-nvfp4:bogus=1", "unknown option")):  # fmt: skip
        with pytest.raises(MixprecError, match=what):
            from_name(bad)


# ---------------------------------------------------------------------------------------------------
# The three GEMMs


def _layer(recipe: str, name: str = "blk.proj", seed: int = 0) -> LowPrecisionLinear:
    torch.manual_seed(seed)
    return LowPrecisionLinear.from_linear(nn.Linear(64, 48), recipe, name=name)


@pytest.mark.parametrize("recipe", ["fp4-nvfp4", "fp4-nvfp4:2d=false", "fp4-mxfp4", "fp4-mxfp4:2d=true,even"])
def test_forward_equals_the_dequantized_operand_reference_bit_exactly(recipe):
    layer = _layer(recipe)
    x = torch.randn(3, 32, 64, generator=torch.Generator().manual_seed(2))
    lay = from_name(recipe).gemm_layout("output")
    qx = quantize(x.reshape(-1, 64), E2M1, lay.a.granularity)
    qw = quantize(layer.weight.detach(), E2M1, lay.b.granularity)
    ref = qx.dequantize() @ qw.dequantize().t() + layer.bias.detach()
    assert torch.equal(layer(x).reshape(-1, 48), ref)


def test_nvfp4_backward_gemms_equal_their_references_bit_exactly():
    """grad_input: SR(dY) · W (the forward's 16x16 payload, transposed); grad_weight: SR(H dY)ᵀ · (H X),
    H the seeded RHT over every 16 tokens, with the noise keys of (seed, step, rank, tensor)."""
    layer = _layer("fp4-nvfp4")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(96, 64, generator=gen).requires_grad_(True)
    dy = torch.randn(96, 48, generator=gen)
    layer(x).backward(dy)
    w = layer.weight.detach()
    qw = quantize(w, E2M1, Granularity.nvfp4(16, 16))
    key_gi = rounding_key(0, 0, 0, "blk.proj", "grad_input", "grad_output", 1)
    qdy = quantize(dy, E2M1, Granularity.nvfp4(1, 16), rounding_key=key_gi)
    assert torch.equal(x.grad, qdy.dequantize() @ qw.dequantize())
    m = rht_matrix(0)
    key_gw = rounding_key(0, 0, 0, "blk.proj", "grad_weight", "grad_output", 1)
    # the transposed operands, quantized along the tokens (16x1 blocks of the token-major layouts)
    qdyt = quantize(transform_rows(dy, m), E2M1, Granularity.nvfp4(16, 1), rounding_key=key_gw)
    qxt = quantize(transform_rows(x.detach(), m), E2M1, Granularity.nvfp4(16, 1))
    assert torch.equal(layer.weight.grad, qdyt.dequantize().t() @ qxt.dequantize())
    # and the transform is what makes the difference to the plain (unrotated) quantized product
    plain = (
        quantize(dy, E2M1, Granularity.nvfp4(16, 1), rounding_key=key_gw).dequantize().t()
        @ quantize(x.detach(), E2M1, Granularity.nvfp4(16, 1)).dequantize()
    )
    assert not torch.equal(layer.weight.grad, plain)


def test_switches_turn_the_transform_and_the_rounding_off():
    layer = _layer("fp4-nvfp4:rht=false,sr=false,2d=false")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 64, generator=gen).requires_grad_(True)
    dy = torch.randn(64, 48, generator=gen)
    layer(x).backward(dy)
    g16, g16t = Granularity.nvfp4(1, 16), Granularity.nvfp4(16, 1)
    qwt = quantize(layer.weight.detach().t(), E2M1, g16)  # Wᵀ re-quantized along the output channels
    assert torch.equal(x.grad, quantize(dy, E2M1, g16).dequantize() @ qwt.dequantize().t())
    want = quantize(dy, E2M1, g16t).dequantize().t() @ quantize(x.detach(), E2M1, g16t).dequantize()
    assert torch.equal(layer.weight.grad, want)


def _step(layer: LowPrecisionLinear, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    layer.weight.grad = None
    layer(x).backward(dy)
    layer.advance_scaling()
    return layer.weight.grad.clone()


def test_stochastic_rounding_resumes_bit_identically_and_differs_by_rank(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(64, 64, generator=gen), torch.randn(64, 48, generator=gen)) for _ in range(3)]
    first = _layer("fp4-nvfp4:seed=9")
    for x, dy in batches[:2]:
        _step(first, x, dy)
    assert first.fp4_state.tolist() == [9, 2]  # [seed, step]: in the state_dict, so in every checkpoint
    saved = {k: v.clone() for k, v in first.state_dict().items()}
    uninterrupted = _step(first, *batches[2])
    resumed = _layer("fp4-nvfp4:seed=9", seed=1)  # other initial weights: all of it comes from the checkpoint
    resumed.load_state_dict(saved)
    assert torch.equal(_step(resumed, *batches[2]), uninterrupted)
    other = _layer("fp4-nvfp4:seed=9", seed=1)
    other.load_state_dict(saved)
    monkeypatch.setattr(ranks, "rank", lambda group=None: 1)
    assert not torch.equal(_step(other, *batches[2]), uninterrupted)  # rank 1 draws other noise


def test_each_backward_of_a_step_draws_new_noise():
    layer = _layer("fp4-nvfp4:rht=false")
    x, dy = torch.randn(32, 64), torch.randn(32, 48)
    layer(x).backward(dy)
    g1 = layer.weight.grad.clone()
    layer.weight.grad = None
    layer(x).backward(dy)  # a second micro-batch of the same step (same data: only the noise differs)
    assert not torch.equal(layer.weight.grad, g1)


def test_fp4_gemms_are_emulated_and_native_says_why():
    qa = quantize(torch.randn(16, 64), E2M1, Granularity.nvfp4(1, 16))
    qb = quantize(torch.randn(32, 64), E2M1, Granularity.nvfp4(16, 16))
    ok, why = native_available(qa, qb)
    assert not ok and "FP4" in why
    with pytest.raises(MixprecError, match="native backend unavailable"):
        scaled_mm(qa, qb, backend="native")
    assert not detect().fp4_native or torch.cuda.is_available()


@pytest.mark.skipif(not detect().fp4_native, reason="needs FP4 tensor cores (SM 10.0+)")
def test_on_fp4_hardware_the_gemm_says_it_still_emulates():  # pragma: no cover (Blackwell only)
    qa = quantize(torch.randn(16, 64, device="cuda"), E2M1, Granularity.nvfp4(1, 16))
    qb = quantize(torch.randn(32, 64, device="cuda"), E2M1, Granularity.nvfp4(16, 16))
    ok, why = native_available(qa, qb)
    assert not ok and "not wired up" in why
    ref = qa.dequantize() @ qb.dequantize().t()
    assert torch.equal(scaled_mm(qa, qb), ref)
