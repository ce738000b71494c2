"""PrecisionMonitor: planted outliers, small values and NaNs are found at the right layer, tensor and step.

The layers here are a test-only stand-in that speaks the observer protocol (the monitor knows no layer
class), with scales fixed by the test so every expected figure is exact.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from mixprec.formats import E4M3, E5M2
from mixprec.monitor import PrecisionMonitor, tensor_stats
from mixprec.scaling import Granularity


class ObservedLinear(nn.Linear):
    """nn.Linear that reports its input, weight and grad_output to an observer with fixed scales."""

    def __init__(self, n: int, scales: dict[str, float]):
        super().__init__(n, n, bias=False)
        self.scales = scales
        self._observer = None

    def set_precision_observer(self, observer) -> None:
        self._observer = observer

    def precision_layout(self) -> dict:
        return {role: Granularity.tensor() for role in ("input", "weight", "grad_output")}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        obs = self._observer
        if obs is not None:
            obs(None, "input", x.detach(), torch.tensor([[self.scales["input"]]]), E4M3)
            obs(None, "weight", self.weight.detach(), torch.tensor([[self.scales["weight"]]]), E4M3)
        y = super().forward(x)
        if obs is not None and y.requires_grad:
            y.register_hook(
                lambda g: obs(None, "grad_output", g, torch.tensor([[self.scales["grad_output"]]]), E5M2)
            )
        return y


class Net(nn.Module):
    def __init__(self, n: int = 32, layers: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(
            ObservedLinear(n, {"input": 1.0, "weight": 1.0, "grad_output": 1.0}) for _ in range(layers)
        )
        self.head = nn.Linear(n, 1)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x).mean()


def _run(model, monitor, steps, plant=None, grads=True):
    healths = []
    for step in range(steps):
        monitor.begin_step(step)
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
        if plant:
            x = plant(step, x) if plant(step, x) is not None else x
        loss = model(x)
        if grads:
            loss.backward()
        healths.append(monitor.check_step(loss))
        model.zero_grad()
        monitor.end_step()
    return healths


def test_saturation_of_a_planted_outlier_names_layer_role_and_step(tmp_path):
    torch.manual_seed(0)
    model = Net()
    monitor = PrecisionMonitor(model, every=2, jsonl_path=tmp_path / "p.jsonl")
    target = model.blocks[1]

    def plant(step, x):
        # at step 4 (a statistics step) three outliers far beyond E4M3's 448 reach block 1's input
        if step == 4:
            target.register_forward_pre_hook(_once_outliers, with_kwargs=False)
        return None

    _run(model, monitor, 6, plant)
    monitor.close()
    rows = [r for r in monitor.records if r["role"] == "input"]
    assert {r["step"] for r in rows} == {0, 2, 4}  # every=2
    hot = [r for r in rows if r["saturation"] > 0]
    assert [(r["step"], r["layer"]) for r in hot] == [(4, "blocks.1")]
    assert hot[0]["saturated"] == 3 and hot[0]["saturation"] == pytest.approx(3 / (8 * 32))
    assert hot[0]["amax"] == pytest.approx(1e4)
    # the histogram holds every non-zero element, the outliers in the bins above log2(448)
    lo, _hi = hot[0]["hist_edges_log2"]
    assert sum(hot[0]["hist"]) == hot[0]["nonzero"]
    above_max = sum(c for i, c in enumerate(hot[0]["hist"]) if i >= 1 and lo + (i - 1) >= math.log2(E4M3.max))
    assert above_max == 3
    lines = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert all(line["schema_version"] == 2 for line in lines)
    assert len(lines) == len(monitor.records)
    peaks = monitor.summary()
    assert peaks["input"]["max_saturation_at"] == [4, "blocks.1"]


def _once_outliers(module, args):
    (x,) = args
    x = x.clone()
    x[0, :3] = 1e4
    module._forward_pre_hooks.clear()
    return (x,)


def test_underflow_of_known_small_values():
    x = torch.zeros(4, 64)
    x[:, :32] = 1e-4  # below half E4M3's smallest subnormal (2^-9 / 2 ~ 9.8e-4): rounds to zero
    x[:, 32:48] = 0.25  # representable
    st = tensor_stats(x, torch.tensor([[1.0]]), E4M3, Granularity.tensor(), 7, "layer", "weight")
    assert st.nonzero == 4 * 48
    assert st.underflowed == 4 * 32
    assert st.underflow == pytest.approx(32 / 48)
    assert st.saturation == 0
    # with a scale that brings them into range nothing underflows (what scaling is for)
    st2 = tensor_stats(x, torch.tensor([[0.25 / 448]]), E4M3, Granularity.tensor(), 7, "layer", "weight")
    assert st2.underflowed == 0 and st2.saturated == 0


def test_underflow_is_measured_per_block_with_block_scales():
    x = torch.ones(2, 256)
    x[:, 128:] = 1e-6
    g = Granularity.blocks(1, 128)
    per_tile = torch.tensor([[1.0 / 448, 1e-6 / 448]] * 2)
    assert tensor_stats(x, per_tile, E4M3, g, 0, "l", "input").underflowed == 0
    one = torch.full((2, 2), 1.0 / 448)
    assert tensor_stats(x, one, E4M3, g, 0, "l", "input").underflowed == 256


def test_nan_in_an_activation_names_first_layer_and_step():
    torch.manual_seed(0)
    model = Net()
    monitor = PrecisionMonitor(model, every=100, watch_activations=True)

    def corrupt_weight(module, args):
        # a NaN weight element of block 1 at step 3 only
        module.weight.data[0, 0] = float("nan") if monitor.step == 3 else 0.1

    model.blocks[1].register_forward_pre_hook(corrupt_weight)
    healths = _run(model, monitor, 5)
    monitor.close()
    assert [h.ok for h in healths] == [True, True, True, False, True]
    bad = healths[3].first_bad
    assert (bad.step, bad.layer, bad.tensor, bad.kind) == (3, "blocks.1", "output", "nan")
    assert monitor.nan_events == [bad]


def test_nan_in_loss_without_activation_watch_and_in_a_gradient():
    torch.manual_seed(0)
    model = Net()
    monitor = PrecisionMonitor(model, every=100)
    model.blocks[2].register_forward_hook(lambda m, a, out: out * float("nan") if monitor.step == 1 else out)
    # a gradient that turns inf only in block 0's weight at step 2 (the loss stays finite)
    model.blocks[0].weight.register_hook(lambda g: g * float("inf") if monitor.step == 2 else g)
    healths = _run(model, monitor, 3)
    assert healths[0].ok
    assert healths[1].first_bad.tensor == "loss" and healths[1].first_bad.step == 1
    bad = healths[2].first_bad
    assert (bad.step, bad.layer, bad.tensor) == (2, "blocks.0", "weight.grad")


def test_a_given_gradient_norm_replaces_the_guards_own_pass():
    """check_step(grad_norm=...): a finite total norm says every gradient is finite, so the guard reads no
    gradient; a non-finite one runs the per-tensor scan, which names the bad gradient."""
    torch.manual_seed(0)
    model = Net()
    monitor = PrecisionMonitor(model, every=100)
    monitor.begin_step(0)
    model(torch.randn(4, 32)).backward()
    reads = []
    monitor._gradients = lambda: reads.append(1) or []  # the guard must not read gradients given a norm
    assert monitor.check_step(torch.tensor(1.0), grad_norm=torch.tensor(3.0)).ok and reads == []
    model.blocks[1].weight.grad[0, 0] = float("nan")
    health = monitor.check_step(torch.tensor(1.0), grad_norm=torch.tensor(float("nan")))
    assert not health.ok and (health.first_bad.layer, health.first_bad.tensor) == ("blocks.1", "weight.grad")
    # a norm whose square overflowed while every gradient is finite is not a bad step
    model.blocks[1].weight.grad[0, 0] = 0.0
    assert monitor.check_step(torch.tensor(1.0), grad_norm=float("inf")).ok
    monitor.close()


def test_observers_installed_only_on_statistics_steps():
    model = Net()
    monitor = PrecisionMonitor(model, every=3)
    seen = []
    for step in range(7):
        monitor.begin_step(step)
        seen.append(model.blocks[0]._observer is not None)
        monitor.end_step()
    monitor.close()
    assert seen == [True, False, False, True, False, False, True]
    assert model.blocks[0]._observer is None


def test_tensorboard_writer(tmp_path):
    pytest.importorskip("tensorboard")
    model = Net()
    with PrecisionMonitor(model, every=1, tensorboard_dir=tmp_path / "tb") as monitor:
        _run(model, monitor, 2)
    assert any((tmp_path / "tb").iterdir())
