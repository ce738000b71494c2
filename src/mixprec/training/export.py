"""export_for_inference: a converted, trained model written back as a plain checkpoint.

Transformers models: ``save_pretrained`` (safetensors + config.json) with the model's original tensor
names, so ``AutoModelForCausalLM.from_pretrained(DIR)`` and ``mixprec quantize --model DIR`` read it as
any Hugging Face checkpoint. Plain nn.Modules: ``model.safetensors`` with the state_dict names.
Only parameters and the model's own buffers are written, in the chosen dtype; the FP8 scaling state
(amax histories, scales) that conversion added is not. ``mixprec_export.json`` records what was done.

Parameters trained in bf16 with ``mixprec.AdamW`` have their true values in the optimizer's fp32
master copies (the bf16 parameter is their rounding). Pass ``optimizer=`` and an fp32 export writes
the masters, not the bf16 parameters widened to fp32 (for a bf16 export both give the same bits).

The directory is written beside its final place and renamed into it (atomic); an existing DIR is
refused unless force=True.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.files import atomic_output_dir, check_new_output
from mixprec.training.convert import conversion_state

SCHEMA_VERSION = 1
_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


def master_weights(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """{parameter name: fp32 master copy} for the parameters the optimizer keeps a master of (mixprec
    AdamW's state["master"]); empty without an optimizer or for parameters that are their own master."""
    if optimizer is None:
        return {}
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise MixprecError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        master = optimizer.state.get(p, {}).get("master")
        if master is not None:
            out[name] = master.full_tensor() if hasattr(master, "full_tensor") else master  # FSDP2 shard
    return out


def plain_state_dict(
    model: nn.Module, dtype: torch.dtype, masters: dict[str, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The model's tensors under their original names, floating ones cast to `dtype`; FP8 state dropped.

    masters: {name: tensor} written instead of the parameter of that name (see master_weights).
    Returns (state_dict, dropped keys). Modules replaced by conversion keep only their parameters.
    """
    masters = masters or {}
    st = conversion_state(model)
    converted = set(st.converted) if st is not None else set()
    keep_only_params: dict[str, set[str]] = {}
    for name in converted:
        module = model.get_submodule(name) if name else model
        keep_only_params[name] = {n for n, _ in module.named_parameters(recurse=False)}
    out: dict[str, torch.Tensor] = {}
    dropped: list[str] = []
    for key, t in model.state_dict(keep_vars=False).items():
        owner = _converted_owner(key, keep_only_params)
        if owner is not None and key[len(owner) + 1 if owner else 0 :] not in keep_only_params[owner]:
            dropped.append(key)  # scaling state of an FP8 module (amax history, scales, per-expert shells)
            continue
        if t.is_floating_point() and t.dtype.itemsize == 1:
            dropped.append(key)  # fp8 payloads cached by a layer: not part of the model
            continue
        t = masters.get(key, t).detach()
        if t.is_floating_point():
            t = t.to(dtype)
        out[key] = t.to("cpu").contiguous()
    return out, dropped


def _converted_owner(key: str, converted: dict[str, set[str]]) -> str | None:
    """The converted module whose subtree holds `key` (the innermost one), or None."""
    parts = key.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:cut])
        if prefix in converted:
            return prefix
    return None


def export_for_inference(
    model: nn.Module,
    directory: str | os.PathLike,
    dtype: str = "bf16",
    *,
    optimizer: torch.optim.Optimizer | None = None,
    force: bool = False,
) -> Path:
    """Write `model` to `directory` as a plain checkpoint (safetensors) in `dtype` ("bf16" or "fp32").

    optimizer: the training optimizer; parameters it keeps fp32 master copies of (mixprec.AdamW
    for bf16 parameters) are written from those masters.
    """
    if not isinstance(model, nn.Module):
        raise MixprecError(f"export_for_inference needs a torch.nn.Module, got {type(model).__name__}")
    if dtype not in _DTYPES:
        raise MixprecError(f"export dtype must be 'bf16' or 'fp32', got {dtype!r}")
    torch_dtype = _DTYPES[dtype]
    target = Path(directory)
    check_new_output(target, force, label="export directory", flag="force=True (CLI: --force)")
    if target.exists() and not target.is_dir():
        raise MixprecError(f"{target} exists and is not a directory")

    masters = master_weights(model, optimizer)
    sd, dropped = plain_state_dict(model, torch_dtype, masters)
    written_from_masters = sorted(k for k in masters if k in sd)  # before saving: save_pretrained edits sd
    with atomic_output_dir(target, force) as tmp:
        if hasattr(model, "save_pretrained") and getattr(model, "config", None) is not None:
            _save_hf(model, tmp, sd, torch_dtype)
            layout = "huggingface"
        else:
            from safetensors.torch import save_file

            # safetensors refuses tensors sharing memory (tied weights): write independent copies
            seen: set[int] = set()
            for k, v in sd.items():
                if v.untyped_storage().data_ptr() in seen:
                    sd[k] = v.clone()
                seen.add(sd[k].untyped_storage().data_ptr())
            save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            layout = "safetensors"
        st = conversion_state(model)
        record = {
            "schema_version": SCHEMA_VERSION,
            "layout": layout,
            "dtype": dtype,
            "trained_with": st.recipe_name if st is not None else None,
            "fp8_modules": sorted(st.converted) if st is not None else [],
            "dropped_keys": dropped,
            "from_master_weights": written_from_masters,
        }
        (tmp / "mixprec_export.json").write_text(json.dumps(record, indent=2) + "\n")
    return target


def _save_hf(model: nn.Module, tmp: Path, sd: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    config = model.config
    old = getattr(config, "dtype", None)
    config.dtype = dtype
    try:
        model.save_pretrained(str(tmp), state_dict=sd)
    finally:
        config.dtype = old
