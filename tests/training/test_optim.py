"""mixprec.training.optim.AdamW: torch's numbers on fp32, fp32 master/grad accumulation on bf16, state round-trip."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.rounding import (
    NoiseStream,
    flat_indices,
    hash32,
    noise16_,
    stochastic_round,
    stochastic_round_pair_into,
)
from mixprec.training.optim import AdamW, bytes_per_parameter, memory_table


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)).to(dtype)


def _loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 16, generator=g).to(next(model.parameters()).dtype)
    return model(x).float().pow(2).mean()


def test_fp32_moments_match_torch_adamw_exactly():
    a, b = _model(), _model()
    opt_a = AdamW(a.parameters(), lr=1e-2, weight_decay=0.1)  # fp32 params: fp32 moments by default
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(5):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            _loss(model, step).backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


def test_bf16_params_keep_fp32_master_and_bf16_moments():
    m = _model(torch.bfloat16)
    opt = AdamW(m.parameters(), lr=1e-3)
    _loss(m, 0).backward()
    opt.step()
    p = next(m.parameters())
    st = opt.state[p]
    assert st["master"].dtype == torch.float32 and p.dtype == torch.bfloat16
    assert st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg_sq"].dtype == torch.bfloat16
    assert torch.equal(st["master"].to(torch.bfloat16), p.detach())


def test_updates_below_bf16_resolution_accumulate_in_master():
    m, plain = _model(torch.bfloat16), _model(torch.bfloat16)
    opt = AdamW(m.parameters(), lr=1e-5, weight_decay=0.0)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-5, weight_decay=0.0)
    w0 = m[0].weight.detach().clone()
    for k in range(20):
        for model, o in ((m, opt), (plain, opt_plain)):
            o.zero_grad()
            _loss(model, k).backward()
            o.step()
    moved = (opt.state[m[0].weight]["master"] - w0.float()).abs()
    assert (moved > 0).float().mean() > 0.9  # every master weight moved by ~20 * 1e-5
    # plain bf16 AdamW loses most of these updates to rounding (|w| ~ 0.1: bf16 spacing ~ 5e-4)
    assert (plain[0].weight != w0).float().mean() < 0.5


def test_gradient_accumulation_sums_in_fp32():
    m = _model(torch.bfloat16)
    opt = AdamW(m.parameters())
    ref = _model(torch.float32)
    with torch.no_grad():
        for pr, p in zip(ref.parameters(), m.parameters()):
            pr.copy_(p.float())
    exact = None
    for k in range(8):
        _loss(m, k).backward()
        # the bf16 micro-batch gradient is summed into fp32 and p.grad freed
        assert all(p.grad is None for p in m.parameters())
    p0 = next(m.parameters())
    acc = opt.grad(p0)
    assert acc.dtype == torch.float32
    # reference: each micro-batch's bf16 gradient summed in fp64
    m2 = _model(torch.bfloat16)
    with torch.no_grad():
        for a, b in zip(m2.parameters(), m.parameters()):
            a.copy_(b)
    exact = torch.zeros_like(acc, dtype=torch.float64)
    for k in range(8):
        m2.zero_grad()
        _loss(m2, k).backward()
        exact += next(m2.parameters()).grad.double()
    assert torch.allclose(acc.double(), exact, rtol=1e-6, atol=1e-9)
    opt.step()
    assert opt.grad(p0) is None  # the step consumed the accumulated gradients


def test_state_dict_round_trip_continues_identically():
    m1 = _model(torch.bfloat16)
    opt1 = AdamW(m1.parameters(), lr=1e-2)
    for k in range(3):
        _loss(m1, k).backward()
        opt1.step()
    sd = opt1.state_dict()
    m2 = _model(torch.bfloat16, seed=1)
    with torch.no_grad():
        for a, b in zip(m2.parameters(), m1.parameters()):
            a.copy_(b)
    opt2 = AdamW(m2.parameters(), lr=1e-2)
    opt2.load_state_dict(sd)
    p2 = next(m2.parameters())
    assert opt2.state[p2]["master"].dtype == torch.float32
    assert opt2.state[p2]["exp_avg"].dtype == torch.bfloat16
    for k in range(3, 6):
        for m, o in ((m1, opt1), (m2, opt2)):
            _loss(m, k).backward()
            o.step()
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_clip_grad_norm_acts_on_fp32_buffers():
    m = _model(torch.bfloat16)
    opt = AdamW(m.parameters())
    _loss(m, 0).backward()
    norm = opt.clip_grad_norm_(1e-3)
    assert norm > 1e-3
    total = torch.stack([g.norm() for _, g in opt.grads()]).norm()
    assert total == pytest.approx(1e-3, rel=1e-3)


def test_bytes_per_parameter():
    assert bytes_per_parameter(torch.float32, master_dtype=None, moment_dtype=torch.float32)["total"] == 16
    parts = bytes_per_parameter(torch.bfloat16, master_dtype=torch.float32, moment_dtype=torch.bfloat16)
    assert parts == {"param": 2, "grad": 4, "master": 4, "exp_avg": 2, "exp_avg_sq": 2, "total": 14}
    rows = {r["setup"]: r["total"] for r in memory_table()}
    assert sorted(rows.values()) == [8, 14, 16, 18]
    # measured on a real optimizer after one step
    m = _model(torch.bfloat16)
    opt = AdamW(m.parameters())
    _loss(m, 0).backward()
    opt.step()
    assert opt.bytes_per_parameter()["total"] == pytest.approx(14)
    f = _model()
    opt = AdamW(f.parameters())  # fp32 params: fp32 moments by default
    _loss(f, 0).backward()
    opt.step()
    assert opt.bytes_per_parameter()["total"] == pytest.approx(16)


def test_bad_arguments():
    with pytest.raises(MixprecError):
        AdamW(_model().parameters(), moment_dtype="int8")
    with pytest.raises(MixprecError):
        AdamW(_model().parameters(), lr=-1)


def test_for_model_follows_the_recipe():
    import mixprec

    m = _model()
    mixprec.convert_for_training(m, "bf16:moments=fp32")
    opt = AdamW.for_model(m, lr=1e-3)
    _loss(m, 0).backward()
    opt.step()
    st = opt.state[m[0].weight]
    assert st["exp_avg"].dtype == torch.float32 and st["master"].dtype == torch.float32
    m = _model()
    mixprec.convert_for_training(m, "bf16:master=false")
    opt = AdamW.for_model(m)
    _loss(m, 0).backward()
    assert m[0].weight.grad is not None  # no fp32 buffers without master weights
    opt.step()
    assert "master" not in opt.state[m[0].weight]


def test_stochastic_rounding_is_unbiased_and_exact_on_representable_values():
    stream = NoiseStream(0)
    x = torch.full((20000,), 1.0 + 2**-9)  # a quarter of the way from 1 to the next bf16 (1 + 2**-7)
    for lane in (0, 1):
        r = stochastic_round(x, stream.next_key(), lane).float()
        assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
        assert abs(r.mean().item() - (1.0 + 2**-9)) < 2e-4
        neg = stochastic_round(-x, stream.next_key(), lane).float()
        assert abs(neg.mean().item() + (1.0 + 2**-9)) < 2e-4
    exact = torch.tensor([0.0, -2.5, 3.0, 1e-30]).bfloat16().float()
    assert torch.equal(stochastic_round(exact, stream.next_key()).float(), exact)


def test_noise_is_the_reference_hash_and_uniform():
    # the int32 tensor hash (wrapping multiplications, logical shifts from arithmetic ones) against
    # lowbias32 on Python integers, for both halves, at indices spread over the int32 range
    idx = torch.cat([torch.arange(0, 5000), torch.tensor([2**31 - 1, 2**30 + 7, 123456789])]).to(torch.int32)
    key = hash32(17)
    for lane in (0, 1):
        got = noise16_(idx.clone(), key, lane)
        want = [(hash32((int(i) * 0x9E3779B1 + key) & 0xFFFFFFFF) >> (16 * lane)) & 0xFFFF for i in idx]
        assert got.tolist() == want
    n = noise16_(torch.arange(1 << 18, dtype=torch.int32), key, 0).float() / 2**16
    assert abs(n.mean().item() - 0.5) < 2e-3 and abs(n.std().item() - (1 / 12) ** 0.5) < 2e-3
    counts = torch.bincount(noise16_(torch.arange(1 << 18, dtype=torch.int32), key, 1) >> 8, minlength=256)
    assert counts.min() > 0.8 * counts.float().mean()  # every high byte occurs about equally often


def test_a_slice_rounds_with_its_part_of_the_whole_tensors_noise():
    x = torch.randn(64, 48)
    key = NoiseStream(3).next_key()
    whole = stochastic_round(x, key, 1)
    sl = (slice(16, 40), slice(8, 30))
    part = stochastic_round(x[sl], key, 1, index=flat_indices((64, 48), sl))
    assert torch.equal(part.view(torch.int16), whole[sl].view(torch.int16))


def test_fp32_matches_torch_foreach_adamw_exactly_with_uneven_steps():
    # several parameters, one of which misses a gradient in some steps (its own step count)
    a, b = _model(), _model()
    opt_a = AdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    for step in range(4):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            _loss(model, step).backward()
            if step % 2:
                model[2].bias.grad = None
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_stochastic_round_pair_into_gives_the_reference_bits(monkeypatch):
    monkeypatch.setattr("mixprec.rounding.CHUNK", 700)  # several chunks, a ragged last one
    x = torch.randn(3, 1000) * torch.logspace(-30, 30, 1000)
    y = torch.randn(3, 1000)
    x[0, :4] = torch.tensor([float("inf"), float("nan"), 3.3e38, 0.0])  # rare path: RNE there
    for a, b in ((x[1:], y[1:]), (x, y)):  # the fast path, then the guarded one
        key = hash32(5)
        outs = (torch.empty_like(a, dtype=torch.bfloat16), torch.empty_like(b, dtype=torch.bfloat16))
        scratch = torch.empty(a.numel(), dtype=torch.int32), torch.empty(a.numel(), dtype=torch.int32)
        stochastic_round_pair_into((a.clone(), b.clone()), outs, key, *scratch)
        for lane, (src, out) in enumerate(zip((a, b), outs)):
            assert torch.equal(out.view(torch.int16), stochastic_round(src, key, lane).view(torch.int16))


def test_noise_counter_round_trips_through_the_state_dict():
    m, opt = _bf16_run(0, steps=2)
    state = opt.state_dict()
    assert state["mixprec"]["noise"]["counter"] == 2 * len(list(m.parameters()))
    m2 = _model(torch.bfloat16)
    with torch.no_grad():
        for a, b in zip(m2.parameters(), m.parameters()):
            a.copy_(b)
    opt2 = AdamW(m2.parameters(), lr=1e-2, seed=0)
    opt2.load_state_dict(state)
    for model, o in ((m, opt), (m2, opt2)):
        _loss(model, 2).backward()
        o.step()
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg_sq"], opt2.state[b]["exp_avg_sq"])


def _bf16_run(seed, steps=3, **kw):
    m = _model(torch.bfloat16)
    opt = AdamW(m.parameters(), lr=1e-2, seed=seed, **kw)
    for k in range(steps):
        _loss(m, k).backward()
        opt.step()
    return m, opt


@pytest.mark.parametrize("kw", [{}, {"moment_dtype": "fp32"}, {"stochastic_rounding": False}])
def test_fused_step_equals_the_per_parameter_reference(monkeypatch, kw):
    # the per-parameter path (used for DTensor shards) is the plain, op-by-op form of the update
    m1, opt1 = _bf16_run(0, **kw)
    monkeypatch.setattr("mixprec.training.optim._is_dtensor", lambda t: True)
    m2, opt2 = _bf16_run(0, **kw)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt1.state[a][key], opt2.state[b][key])


def test_stochastic_rounding_is_deterministic_from_the_seed():
    (m1, o1), (m2, o2), (m3, o3) = _bf16_run(0), _bf16_run(0), _bf16_run(1)
    p1, p2, p3 = (next(m.parameters()) for m in (m1, m2, m3))
    assert torch.equal(o1.state[p1]["exp_avg_sq"], o2.state[p2]["exp_avg_sq"])
    assert not torch.equal(o1.state[p1]["exp_avg_sq"], o3.state[p3]["exp_avg_sq"])


def test_gradient_buffers_are_reused_and_restart_each_step():
    m = _model(torch.bfloat16)
    opt = AdamW(m.parameters())
    p0 = next(m.parameters())
    _loss(m, 0).backward()
    buf = opt.grad(p0)
    opt.step()
    assert opt.grad(p0) is None
    _loss(m, 1).backward()  # new step: the buffer is overwritten, not added to
    assert opt.grad(p0).data_ptr() == buf.data_ptr()
    ref = _model(torch.bfloat16)
    with torch.no_grad():
        for a, b in zip(ref.parameters(), m.parameters()):
            a.copy_(b)
    _loss(ref, 1).backward()
    assert torch.equal(opt.grad(p0), next(ref.parameters()).grad.float())
    opt.zero_grad()
    assert opt.grad(p0) is None
