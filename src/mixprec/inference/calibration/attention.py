"""Routing a transformers model's attention through a wrapper: the one place mixprec sees keys and
values as the attention does (after RoPE, the cache's contents included), which is what an FP8 KV cache
stores. Calibration observes them there (calibration.kv_attention_patch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

Attention = Callable[..., Any]


def route_attention(model: nn.Module, name: str, wrap: Callable[[Attention], Attention]) -> Callable[[], None] | None:  # fmt: skip
    """Register `wrap(inner)` as attention implementation `name` (inner: the model's current one) and
    point every config of the model at it. The attention-mask function of the inner implementation is
    registered under the same name: transformers builds no mask at all for a name it does not know.
    Returns the undo, or None when the model has no transformers attention to route."""
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return None
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if config is None or impl is None:
        return None
    inner = ALL_ATTENTION_FUNCTIONS.get_interface(impl, None)
    if inner is None:
        return None
    ALL_ATTENTION_FUNCTIONS.register(name, wrap(inner))
    if impl in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    configs = {id(m.config): m.config for m in model.modules() if getattr(m, "config", None) is not None}
    previous = [(c, c._attn_implementation) for c in configs.values()]
    for c, _ in previous:
        c._attn_implementation = name

    def undo() -> None:
        for c, v in previous:
            c._attn_implementation = v

    return undo


__all__ = ["route_attention"]
