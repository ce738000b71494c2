"""Distributed checkpoints: every rank saves and restores its own shard, in safetensors.

Why not torch.distributed.checkpoint (DCP): its FileSystemReader reads the checkpoint's `.metadata`
with `pickle.load`, and mixprec never unpickles a file it reads. DCP's HuggingFace (safetensors)
storage keeps tensors only, not the optimizer's scalars and hyper-parameters. So mixprec writes one
safetensors file per rank (model tensors — the LOCAL shard of FSDP2 DTensor parameters, every buffer,
the delayed-scaling amax histories and scales included — optimizer state tensors, the RNG state) plus a
JSON file per rank (optimizer hyper-parameters and scalar state) and a `manifest.json`. Resume needs the
same world size and the same wrapping (DDP or fully_shard with the same mesh); that is checked.

Layout of DIR (schema_version 1, documented in docs/distributed.md):
    manifest.json             {"schema_version", "kind", "world_size", "wrapping", "extra", "files"}
    rank00000.safetensors     "model/<fqn>", "optim/<param index>/<key>", "rng/cpu", "rng/cuda"
    rank00000.json            {"param_groups": [...], "scalar_state": {...}, "tensor_keys": {...}}

The directory appears atomically: ranks write into DIR.tmp-<id>, rank 0 writes the manifest last and
renames the folder after a barrier. DIR must be on a filesystem every rank sees (shared storage on
multi-node jobs).
"""

from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.distributed.world import barrier, broadcast_object, rank, world_size
from mixprec.errors import MixprecError
from mixprec.files import check_new_output, replace_dir

SCHEMA_VERSION = 1
KIND = "mixprec-distributed-checkpoint"


def _is_dtensor(t: Any) -> bool:
    return callable(getattr(t, "to_local", None)) and hasattr(t, "placements")


def _to_cpu_local(t: torch.Tensor) -> torch.Tensor:
    if _is_dtensor(t):
        t = t.to_local()
    # a private contiguous copy: safetensors refuses shared storage and views of padded shards
    return t.detach().to("cpu", copy=True).contiguous()


def _like(saved: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    """`saved` (a local shard) placed like `target`: a DTensor with target's mesh and placements."""
    if target is not None and _is_dtensor(target) and tuple(saved.shape) == tuple(target.to_local().shape):
        from torch.distributed.tensor import DTensor

        local = saved.to(target.to_local().device)
        return DTensor.from_local(
            local,
            target.device_mesh,
            target.placements,
            run_check=False,
            shape=target.shape,
            stride=target.stride(),
        )
    if target is not None:
        return saved.to(target.device)
    return saved


def _local_device(t: torch.Tensor) -> torch.device:
    return t.to_local().device if _is_dtensor(t) else t.device


def _json_value(value: Any, where: str) -> Any:
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"float": repr(value)}
    if isinstance(value, list | tuple):
        return [_json_value(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v, where) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return {"tensor_item": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    raise MixprecError(f"checkpoint: {where} holds a {type(value).__name__}, which cannot be stored as JSON")


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"float"}:
            return float(value["float"])
        if set(value) == {"tensor_item", "dtype"}:
            return torch.tensor(value["tensor_item"], dtype=getattr(torch, value["dtype"]))
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def _flatten_extra(value: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Nested dicts/lists with tensors -> JSON with {"tensor": key} markers; tensors go to `tensors`."""
    if isinstance(value, torch.Tensor):
        tensors[prefix] = _to_cpu_local(value)
        return {"tensor": prefix}
    if isinstance(value, dict):
        return {str(k): _flatten_extra(v, f"{prefix}/{k}", tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_flatten_extra(v, f"{prefix}/{i}", tensors) for i, v in enumerate(value)]
    return _json_value(value, prefix)


def _unflatten_extra(value: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict) and set(value) == {"tensor"}:
        return tensors[value["tensor"]]
    if isinstance(value, dict) and not (set(value) <= {"float", "tensor_item", "dtype"} and value):
        return {k: _unflatten_extra(v, f"{prefix}/{k}", tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_unflatten_extra(v, f"{prefix}/{i}", tensors) for i, v in enumerate(value)]
    return _from_json(value)


def _wrapping(model: nn.Module) -> str:
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "ddp"
    if any(_is_dtensor(p) for p in model.parameters()):
        return "fsdp2"
    return "none"


def _rank_name(r: int) -> str:
    return f"rank{r:05d}"


def save_checkpoint(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict | None = None,
    overwrite: bool = False,
) -> Path:
    """Save this rank's model and optimizer state (collective: every rank of the job must call it).

    `extra` (JSON values, e.g. {"step": 120}) is stored in the manifest from rank 0 and returned by
    load_checkpoint. An existing DIR is refused unless overwrite=True.
    """
    from safetensors.torch import save_file

    target = Path(directory)
    check_new_output(target, overwrite, label="checkpoint directory", flag="overwrite=True")
    tmp_name = broadcast_object(f"{target.name}.tmp-{uuid.uuid4().hex[:8]}" if rank() == 0 else None)
    tmp = target.parent / tmp_name
    if rank() == 0:
        tmp.mkdir(parents=True)
    barrier()

    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        if isinstance(value, torch.Tensor):
            tensors[f"model/{key}"] = _to_cpu_local(value)
        else:
            scalars[f"model/{key}"] = _json_value(value, f"model state {key!r}")
    dtensor_keys: list[str] = []  # optimizer tensors that were DTensors (FSDP2 shards) when saved
    meta: dict[str, Any] = {"param_groups": [], "scalar_state": scalars, "dtensor_keys": dtensor_keys}
    if optimizer is not None:
        osd = optimizer.state_dict()
        for idx, state in osd["state"].items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and (value.dim() > 0 or _is_dtensor(value)):
                    tensors[f"optim/{idx}/{key}"] = _to_cpu_local(value)
                    if _is_dtensor(value):
                        dtensor_keys.append(f"optim/{idx}/{key}")
                elif isinstance(value, torch.Tensor):  # 0-d tensors ("step") keep their dtype
                    tensors[f"optim/{idx}/{key}"] = value.detach().to("cpu", copy=True).reshape(())
                else:
                    scalars[f"optim/{idx}/{key}"] = _json_value(value, f"optimizer state {idx}/{key}")
        meta["param_groups"] = _json_value(osd["param_groups"], "optimizer param_groups")
        # optimizer-specific top-level entries (mixprec AdamW: its stochastic-rounding generator state)
        extra_osd = {k: v for k, v in osd.items() if k not in ("state", "param_groups")}
        meta["optimizer_extra"] = _flatten_extra(extra_osd, "optim_extra", tensors)
    tensors["rng/cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()

    name = _rank_name(rank())
    save_file(tensors, str(tmp / f"{name}.safetensors"), metadata={"schema_version": str(SCHEMA_VERSION)})
    (tmp / f"{name}.json").write_text(json.dumps(meta, indent=1))
    barrier()
    if rank() == 0:
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "kind": KIND,
            "world_size": world_size(),
            "wrapping": _wrapping(model),
            "extra": _json_value(extra or {}, "extra"),
            "files": sorted(p.name for p in tmp.iterdir()),
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        replace_dir(tmp, target)
    barrier()
    return target


def read_manifest(directory: str | os.PathLike) -> dict:
    path = Path(directory) / "manifest.json"
    if not path.is_file():
        raise MixprecError(f"{directory} is not a mixprec distributed checkpoint (no manifest.json)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise MixprecError(f"{path} is not valid JSON: {exc}") from None
    if manifest.get("kind") != KIND or manifest.get("schema_version") != SCHEMA_VERSION:
        raise MixprecError(f"{path}: not a mixprec distributed checkpoint of schema_version {SCHEMA_VERSION}")
    return manifest


def load_checkpoint(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
) -> dict:
    """Restore what save_checkpoint wrote into an identically built and wrapped model (and optimizer);
    returns the `extra` dict. Collective only in the sense that every rank reads its own file."""
    from safetensors.torch import load_file

    d = Path(directory)
    manifest = read_manifest(d)
    if manifest["world_size"] != world_size():
        raise MixprecError(
            f"{d} was saved by {manifest['world_size']} ranks; this job has {world_size()} "
            "(resume with the same --nproc-per-node x --nnodes)"
        )
    if manifest["wrapping"] != _wrapping(model):
        raise MixprecError(
            f"{d} was saved from a {manifest['wrapping']} model; this model is wrapped as {_wrapping(model)}"
        )
    name = _rank_name(rank())
    try:
        tensors = load_file(str(d / f"{name}.safetensors"))
        meta = json.loads((d / f"{name}.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise MixprecError(f"cannot read {name} of checkpoint {d}: {exc}") from None
    scalars = meta["scalar_state"]

    current = model.state_dict()
    state: dict[str, Any] = {}
    missing = []
    for key, target in current.items():
        if f"model/{key}" in tensors:
            saved = tensors[f"model/{key}"]
            local_shape = tuple(target.to_local().shape) if _is_dtensor(target) else tuple(target.shape)
            if tuple(saved.shape) != local_shape:
                raise MixprecError(
                    f"{d}: {key} has local shape {tuple(saved.shape)} there, {local_shape} here"
                )
            state[key] = _like(saved, target)
        elif f"model/{key}" in scalars:
            state[key] = _from_json(scalars[f"model/{key}"])
        else:
            missing.append(key)
    if missing:
        raise MixprecError(f"{d} lacks {len(missing)} model entries, e.g. {missing[:3]}")
    model.load_state_dict(state, strict=True)

    if optimizer is not None:
        _load_optimizer(
            d,
            optimizer,
            tensors,
            scalars,
            meta["param_groups"],
            set(meta.get("dtensor_keys", [])),
            meta.get("optimizer_extra", {}),
        )
    if restore_rng:
        torch.set_rng_state(tensors["rng/cpu"])
        if "rng/cuda" in tensors and torch.cuda.is_available():
            torch.cuda.set_rng_state(tensors["rng/cuda"])
    return _from_json(manifest.get("extra", {}))


def _load_optimizer(
    d: Path, optimizer, tensors: dict, scalars: dict, param_groups: list, dtensor_keys: set[str], extra: Any
) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            _, idx, name = key.split("/", 2)
            state.setdefault(int(idx), {})[name] = value
    for key, value in scalars.items():
        if key.startswith("optim/"):
            _, idx, name = key.split("/", 2)
            state.setdefault(int(idx), {})[name] = _from_json(value)
    if any(i >= len(params) for i in state):
        raise MixprecError(f"{d}: the optimizer state covers more parameters than this optimizer has")
    placed = {
        i: {
            k: (_like(v, params[i]) if f"optim/{i}/{k}" in dtensor_keys else v.to(_local_device(params[i])))
            if isinstance(v, torch.Tensor)
            else v
            for k, v in s.items()
        }
        for i, s in state.items()
    }
    groups = _from_json(param_groups)
    full = {"state": placed, "param_groups": groups}
    full.update(_unflatten_extra(extra, "optim_extra", tensors))
    optimizer.load_state_dict(full)
    # torch's Optimizer.load_state_dict casts floating state to the parameter's dtype (an fp32 master
    # copy of a bf16 parameter would come back bf16): put the saved tensors back exactly as saved.
    for i, s in placed.items():
        slot = optimizer.state[params[i]]
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                slot[k] = v


__all__ = ["SCHEMA_VERSION", "load_checkpoint", "read_manifest", "save_checkpoint"]
