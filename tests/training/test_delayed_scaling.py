"""Delayed scaling: amax history in buffers, advanced once per optimizer step; max vs most_recent;
guards for amax 0 / inf; activation checkpointing reuses the step's scales; resume is bit-identical."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mixprec.formats import E4M3, E5M2
from mixprec.quantization import quantize
from mixprec.training import scaling_state
from mixprec.training.low_precision_linear import LowPrecisionLinear

IN, OUT = 64, 32


def _layer(recipe="fp8-delayed:growing=false,history=4", seed=0) -> LowPrecisionLinear:
    torch.manual_seed(seed)
    return LowPrecisionLinear.from_linear(nn.Linear(IN, OUT), recipe, name="l")


def _micro_batch(layer, amp_x=1.0, amp_dy=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(16, IN, generator=gen)
    x = x / x.abs().max() * amp_x  # amax exactly amp_x
    dy = torch.randn(16, OUT, generator=gen)
    dy = dy / dy.abs().max() * amp_dy
    x.requires_grad_(True)
    layer(x).backward(dy)
    return x


def test_history_records_max_over_micro_batches_and_advances_once_per_step():
    layer = _layer()
    w_amax = layer.weight.detach().abs().max()
    _micro_batch(layer, 2.0, 0.5, seed=1)
    _micro_batch(layer, 3.0, 0.25, seed=2)  # gradient accumulation: a second micro-batch
    assert layer.amax_history[0].tolist() == [3.0, w_amax.item(), 0.5]
    assert layer.amax_history[1:].abs().sum() == 0 and layer.scaling_step.item() == 0
    assert scaling_state.advance(nn.Sequential(layer, nn.ReLU())) == 1
    assert layer.scaling_step.item() == 1
    assert (
        layer.amax_history[1].tolist() == [3.0, w_amax.item(), 0.5] and layer.amax_history[0].abs().sum() == 0
    )
    want = torch.tensor([3.0 / E4M3.max, w_amax.item() / E4M3.max, 0.5 / E5M2.max])
    assert torch.equal(layer.fp8_scale, want)
    # during the next step the layer quantizes with these scales, not this step's amax
    seen = {}
    layer.set_precision_observer(lambda n, role, t, scale, fmt: seen.__setitem__(role, scale.item()))
    _micro_batch(layer, 100.0, 100.0, seed=3)
    assert seen == {"input": want[0].item(), "weight": want[1].item(), "grad_output": want[2].item()}


def test_first_step_scales_from_the_current_amax():
    layer = _layer()
    seen = {}
    layer.set_precision_observer(lambda n, role, t, scale, fmt: seen.__setitem__(role, scale.item()))
    _micro_batch(layer, 7.0, 0.125)
    assert seen["input"] == pytest.approx(7.0 / E4M3.max, rel=1e-7)
    assert seen["grad_output"] == pytest.approx(0.125 / E5M2.max, rel=1e-7)


def _drive(recipe, amaxes):
    layer = _layer(recipe)
    for i, a in enumerate(amaxes):
        _micro_batch(layer, a, 1.0, seed=i)
        layer.advance_scaling()
    return layer


def test_max_and_most_recent_differ_as_defined():
    amaxes = [8.0, 1.0, 2.0]
    by_max = _drive("fp8-delayed:growing=false,history=4,algo=max", amaxes)
    recent = _drive("fp8-delayed:growing=false,history=4,algo=most_recent", amaxes)
    assert by_max.fp8_scale[0].item() == pytest.approx(8.0 / 448, rel=1e-7)
    assert recent.fp8_scale[0].item() == pytest.approx(2.0 / 448, rel=1e-7)
    # a window of 2 forgets the 8.0 after two more steps
    short = _drive("fp8-delayed:growing=false,history=2,algo=max", amaxes)
    assert short.fp8_scale[0].item() == pytest.approx(2.0 / 448, rel=1e-7)
    margin = _drive("fp8-delayed:growing=false,history=4,margin=2", amaxes)
    assert margin.fp8_scale[0].item() == pytest.approx(8.0 / (448 * 4), rel=1e-7)


@pytest.mark.parametrize("bad", [0.0, math.inf, math.nan])
def test_a_step_with_amax_zero_or_inf_keeps_the_previous_scale(bad):
    layer = _drive("fp8-delayed:growing=false,history=4,algo=most_recent", [4.0])
    before = layer.fp8_scale.clone()
    x = torch.zeros(16, IN) if bad == 0.0 else torch.randn(16, IN)
    if bad != 0.0:
        x[0, 0] = bad
    layer(x).sum().backward()
    layer.advance_scaling()
    assert layer.fp8_scale[0] == before[0]  # input kept
    assert torch.isfinite(layer.amax_history).all()  # the bad step does not poison the window
    _micro_batch(layer, 2.0, 1.0)  # a good step afterwards updates again
    layer.advance_scaling()
    assert layer.fp8_scale[0].item() == pytest.approx(2.0 / 448, rel=1e-7)


def test_activation_checkpointing_reuses_the_steps_scales():
    plain, ckpt = _layer(seed=3), _layer(seed=3)
    for layer in (plain, ckpt):
        _micro_batch(layer, 5.0, 1.0, seed=9)
        layer.advance_scaling()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(16, IN, generator=gen) * 9
    outs = []
    for layer, use_ckpt in ((plain, False), (ckpt, True)):
        xi = x.clone().requires_grad_(True)
        h = checkpoint(layer, xi, use_reentrant=False) if use_ckpt else layer(xi)
        h.square().sum().backward()
        outs.append((h.detach(), xi.grad, layer.weight.grad))
    for a, b in zip(*outs):  # x (9 x Gaussian) saturates under the history's scale (amax 5): the recomputed
        assert torch.equal(a, b)  # forward must use that scale too, not one from its own amax


def _model(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, IN), nn.GELU(), nn.Linear(IN, OUT))
    model[0] = LowPrecisionLinear.from_linear(model[0], "fp8-delayed:growing=false,history=3")
    model[2] = LowPrecisionLinear.from_linear(model[2], "fp8-delayed:growing=false,history=3")
    return model


def _train(model, opt, steps, start):
    for s in range(start, start + steps):
        gen = torch.Generator().manual_seed(s)
        for _ in range(2):  # two micro-batches per optimizer step
            x = (torch.randn(8, IN, generator=gen) * (1 + s)).to(model[0].weight.dtype)
            model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        scaling_state.advance(model)


def _optimizer(model, kind):
    if kind == "torch":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    from mixprec.training.optim import AdamW  # fp32 masters, bf16 moments with stochastic rounding

    return AdamW(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("params", ["fp32 + torch AdamW", "bf16 + mixprec AdamW"])
def test_save_and_load_mid_run_continues_bit_identically(params):
    dtype, kind = (torch.float32, "torch") if params.startswith("fp32") else (torch.bfloat16, "mixprec")
    model = _model().to(dtype)
    opt = _optimizer(model, kind)
    _train(model, opt, 3, 0)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))  # as torch.save would freeze them
    _train(model, opt, 3, 3)

    resumed = _model(seed=1).to(dtype)  # different init: everything must come from the checkpoint
    opt2 = _optimizer(resumed, kind)
    resumed.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    assert resumed[0].scaling_step.item() == 3
    _train(resumed, opt2, 3, 3)
    for (k, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), k


def test_amax_rows_for_data_parallel_reduction():
    layer = _layer()
    (row,) = layer.amax_tensors_for_reduction()
    assert row.data_ptr() == layer.amax_history.data_ptr() and row.shape == (3,)
    row.copy_(torch.tensor([1.0, 2.0, 4.0]))  # what an all_reduce(MAX) writes back
    layer.advance_scaling()
    assert layer.fp8_scale.tolist() == pytest.approx([1 / 448, 2 / 448, 4 / 57344])
    assert _layer("fp8-current").amax_tensors_for_reduction() == []
    assert _layer("fp8-current").advance_scaling() is False


def test_forwards_without_grad_leave_the_history_alone():
    layer = _layer()
    with torch.no_grad():  # evaluation during training
        y = layer(torch.randn(16, IN) * 50)
    assert y.shape == (16, OUT) and layer.amax_history.abs().sum() == 0


def test_a_role_without_a_usable_amax_yet_scales_from_its_current_amax():
    """A layer that got no data in its first step (an MoE expert without tokens, a skipped branch) has
    no scale for its roles after the advance; it must not quantize with a placeholder scale (1.0 would
    flush a 1e-6 gradient to zero) but from the current amax, as current scaling does, until a step
    records a usable amax."""
    idle, fresh = _layer(seed=4), _layer("fp8-current", seed=4)
    idle.advance_scaling()  # a step in which this layer saw nothing
    assert idle.scaling_step.item() == 1 and idle.fp8_scale.tolist() == [0.0, 0.0, 0.0]
    grads = []
    for layer in (idle, fresh):
        x = _micro_batch(layer, amp_x=1.0, amp_dy=1e-6, seed=6)
        grads.append((x.grad, layer.weight.grad))
    (gx, gw), (gx_cur, gw_cur) = grads
    assert gw.abs().max() > 0 and gx.abs().max() > 0  # with scale 1 both were exactly 0
    assert torch.equal(gx, gx_cur) and torch.equal(gw, gw_cur)  # what current scaling gives
    idle.advance_scaling()  # now the history holds this step's amax: delayed scaling takes over
    assert idle.fp8_scale[2].item() == pytest.approx(1e-6 / E5M2.max, rel=1e-6)


def test_gemms_after_an_advance_use_the_history_scales_and_saturate_like_the_reference():
    """Step 2 quantizes with the scales of step 1's amax (delayed), not its own: an input twice as large
    as before saturates at E4M3's max. All three GEMMs against an fp64 GEMM of the operands quantized by
    the foundation's quantize() with exactly those scales."""
    layer = _layer("fp8-delayed:growing=false,history=4", seed=5)
    _micro_batch(layer, amp_x=2.0, amp_dy=0.5, seed=7)
    layer.advance_scaling()
    s_x, s_w, s_dy = (layer.fp8_scale[i].reshape(1, 1).clone() for i in range(3))
    layer.weight.grad = None
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(16, IN, generator=gen)
    x = (x / x.abs().max() * 4.0).requires_grad_(True)  # amax 4: twice the history's -> saturates
    dy = torch.randn(16, OUT, generator=gen) * 0.1
    y = layer(x)
    y.backward(dy)

    def deq(t, fmt, scale):
        return quantize(t.detach().float(), fmt, scale=scale).dequantize(torch.float64)

    qx, qw, qdy = deq(x, E4M3, s_x), deq(layer.weight, E4M3, s_w), deq(dy, E5M2, s_dy)
    assert qx.abs().max().item() == pytest.approx(E4M3.max * s_x.item(), rel=1e-7)  # saturated
    assert (x.detach().abs() > E4M3.max * s_x).sum() > 0
    bias = layer.bias.detach().double()
    for got, a, b, add in (
        (y, qx, qw, bias),  # output = X · Wᵀ + b
        (x.grad, qdy, qw.t(), 0.0),  # grad_input = dY · W
        (layer.weight.grad, qdy.t(), qx.t(), 0.0),  # grad_weight = dYᵀ · X
    ):
        want, mag = a @ b.t() + add, a.abs() @ b.abs().t() + abs(add)
        assert ((got.detach().double() - want).abs() <= 2e-6 * mag + 1e-30).all()


def test_a_checkpoint_saved_before_the_first_advance_loads_without_a_scale():
    """Checkpoints from before 0 meant "no scale yet" hold fp8_scale = 1 at scaling_step 0: loading one
    must not turn that placeholder into a scale (it would flush a 1e-6 gradient to zero)."""
    old = _layer(seed=4).state_dict()
    old["fp8_scale"] = torch.ones(3)
    layer, fresh = _layer(seed=4), _layer("fp8-current", seed=4)
    layer.load_state_dict(old)
    assert layer.fp8_scale.tolist() == [0.0, 0.0, 0.0]
    x, x_cur = _micro_batch(layer, amp_dy=1e-6, seed=6), _micro_batch(fresh, amp_dy=1e-6, seed=6)
    assert layer.weight.grad.abs().max() > 0
    assert torch.equal(x.grad, x_cur.grad) and torch.equal(layer.weight.grad, fresh.weight.grad)


def test_a_role_whose_amax_sets_a_record_scales_from_its_own_amax_until_the_history_bounds_it():
    """fp8-delayed's default (current_while_growing): early in training the amax grows step after step
    and a scale from the history would saturate the new largest values; a role whose amax set a record
    scales from its own amax on the next step, and returns to the history's scale once a step stays
    within it. TransformerEngine's rule (growing=false) keeps the history's scale."""
    layer, te = _layer("fp8-delayed:history=8"), _layer("fp8-delayed:history=8,growing=false")
    seen = []
    for layer_ in (layer, te):
        layer_.set_precision_observer(lambda n, role, t, scale, fmt: seen.append((role, scale.item())))
        for i, amax in enumerate([1.0, 2.0, 4.0, 3.0, 3.5]):
            seen.clear()
            _micro_batch(layer_, amax, 1.0, seed=i)
            used = dict(seen)["input"]
            if layer_ is layer:
                # steps 0-3: no history or a record the step before -> the step's own amax;
                # step 4: step 3 (3.0) stayed below the record 4.0 -> the history's scale
                want = amax / E4M3.max if i < 4 else 4.0 / E4M3.max
            else:
                want = amax / E4M3.max if i == 0 else max([1.0, 2.0, 4.0, 3.0][:i]) / E4M3.max
            assert used == pytest.approx(want, rel=1e-7), (layer_ is layer, i)
            layer_.advance_scaling()
    assert layer.fp8_scale[0].item() == pytest.approx(4.0 / E4M3.max, rel=1e-7)  # 3.5 < 4.0: delayed
    _micro_batch(layer, 9.0, 1.0, seed=9)  # a new record: saturates this step (delayed scale 4/448) ...
    layer.advance_scaling()
    assert layer.fp8_scale[0].item() == 0.0  # ... and the next step scales from its own amax


def test_advance_buffers_record_rule_in_isolation():
    formats = {"input": E4M3, "weight": E4M3, "grad_output": E5M2}
    history = torch.tensor([[5.0, 1.0, 0.0], [4.0, 2.0, 1.0], [3.0, 2.0, 1.0]])
    scale, step = torch.full((3,), 0.5), torch.zeros((), dtype=torch.int64)
    scaling_state.advance_buffers(history, scale, step, formats)
    # input 5 > 4, 3: a record -> 0; weight 1 <= 2: delayed from the history max 2; grad 0: kept
    assert scale.tolist() == [0.0, pytest.approx(2.0 / E4M3.max), 0.5]
    assert history[1].tolist() == [5.0, 1.0, 0.0] and history[0].abs().sum() == 0
