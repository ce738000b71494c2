"""The FP8 weight-cast cache: reused while the weight is unchanged, recomputed after any update."""

from __future__ import annotations

import torch
from torch import nn

from mixprec.quantization import quantize
from mixprec.scaling import Granularity
from mixprec.training.weight_cache import cache_of, install_step_hook, invalidate_all


def _layer_quantized_weight(layer: nn.Linear, step: int | None = None):
    w = layer.weight
    return cache_of(layer).get(
        "weight",
        w,
        lambda: quantize(w.detach(), "e4m3", Granularity.rows()),
        step=step,
        extra=("e4m3", "row"),
    )


def test_reused_across_micro_batches_and_recomputed_after_update():
    layer = nn.Linear(32, 16)
    q1 = _layer_quantized_weight(layer)
    q2 = _layer_quantized_weight(layer)  # second micro-batch: same object, no new cast
    assert q2 is q1
    cache = cache_of(layer)
    assert (cache.hits, cache.misses) == (1, 1)
    with torch.no_grad():
        layer.weight.add_(1.0)  # an in-place update bumps _version
    q3 = _layer_quantized_weight(layer)
    assert q3 is not q1
    assert torch.equal(
        q3.data.float(), quantize(layer.weight.detach(), "e4m3", Granularity.rows()).data.float()
    )


def test_step_counter_and_invalidation_cover_writes_that_skip_the_version():
    layer = nn.Linear(32, 16)
    q1 = _layer_quantized_weight(layer, step=0)
    layer.weight.data.copy_(torch.randn(16, 32))  # .data writes do not bump _version
    assert _layer_quantized_weight(layer, step=1) is not q1  # the step counter catches it
    q2 = _layer_quantized_weight(layer, step=1)
    layer.weight.data.mul_(2)
    assert invalidate_all(layer) == 1
    assert _layer_quantized_weight(layer, step=1) is not q2


def test_optimizer_hook_invalidates_even_for_fused_adamw():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    install_step_hook(opt, model)
    q = [_layer_quantized_weight(m) for m in model]
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    q_after = [_layer_quantized_weight(m) for m in model]
    assert all(a is not b for a, b in zip(q, q_after))


def test_inference_tensors_are_not_cached():
    with torch.inference_mode():
        layer = nn.Linear(32, 16)
        a = _layer_quantized_weight(layer)
        b = _layer_quantized_weight(layer)
    assert a is not b and cache_of(layer).hits == 0


def test_a_given_scale_updated_in_place_invalidates():
    layer = nn.Linear(32, 16)
    scales = torch.ones(3)
    w = layer.weight

    def get():
        s = scales[1:2].reshape(1, 1)  # a fresh view each call, as delayed scaling makes
        return cache_of(layer).get("weight", w, lambda: quantize(w.detach(), "e4m3", scale=s), scale=s)

    q1 = get()
    assert get() is q1
    with torch.no_grad():
        scales.mul_(2)  # advance of the delayed-scaling state
    q2 = get()
    assert q2 is not q1 and float(q2.scale) == 2.0
