"""model.fp8_scales.json: a readable record of every quantized layer and its scales.

Written beside the weights by `quantize_checkpoint` and `save_quantized`; read back by `load_quantized`
(which finds it by itself, also under the name fp8_scales.json) to fill in scales a checkpoint lacks, or
to quantize a high-precision checkpoint it lies beside (online, with the file's scales), or given by
hand through `scales=`. Schema: docs/schemas/fp8_scales.md. Scales are dequantization multipliers
(value ≈ fp8 * scale) stored as the float32 values themselves (JSON floats round-trip them exactly).

A file that is wrong in any way is refused before any work, naming the file and where in it: the line
and column of bad JSON, or the key path (`layers['model.layers.0.mlp.up_proj'].weight.scale[3]`) of a
bad value, a scale count that does not fit the layer's shape, or a layer the checkpoint does not have.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import torch

from mixprec.errors import MixprecError
from mixprec.files import write_text_atomic
from mixprec.inference.checkpoint.layout import INPUT_SCALE, K_SCALE, V_SCALE, WEIGHT_SCALE
from mixprec.inference.schemes import InferenceScheme

SCHEMA_VERSION = (
    3  # 3: the stop rule watches the clipped share (clipped, clipped_by_batch); 2: calibration records
)
# samples used and why it stopped; relative_error may be null
SCALES_NAMES = ("model.fp8_scales.json", "fp8_scales.json")


def find_scales_file(model_dir: Path) -> Path | None:
    for name in SCALES_NAMES:
        p = model_dir / name
        if p.exists():
            return p
    return None


def layer_entry(
    *,
    scheme: str,
    weight_granularity: str,
    weight_scale: torch.Tensor,
    weight_amax: float,
    relative_weight_error: float | None,
    shape: tuple[int, int],
    input_scale: torch.Tensor | None = None,
    input_amax: float | None = None,
    input_dynamic: bool = True,
    input_granularity: str = "row",
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "scheme": scheme,
        "shape": [int(shape[0]), int(shape[1])],
        "weight": {
            "granularity": weight_granularity,
            "scale_shape": list(weight_scale.shape),
            "scale": weight_scale.float().flatten().tolist(),
            "amax": float(weight_amax),
            # None where the original weights are not at hand (a model saved after loading)
            "relative_error": _finite_or_none(relative_weight_error),
        },
        "input": {"dynamic": bool(input_dynamic), "granularity": input_granularity},
    }
    if input_scale is not None:
        entry["input"]["scale"] = float(input_scale.reshape(-1)[0])
    if input_amax is not None:
        entry["input"]["amax"] = float(input_amax)
    return entry


def compact_entry(q, sch: InferenceScheme, stats, shape, in_global: torch.Tensor | None, in_amax) -> dict[str, Any]:  # fmt: skip
    """The report entry of a block-format layer: its global scale (NVFP4) instead of the millions of
    block scales the checkpoint itself holds."""
    scale = q.global_scale.reshape(1) if q.global_scale is not None else torch.empty(0)
    return layer_entry(
        scheme=sch.name, weight_granularity=f"{sch.weight_granularity.name} (global scale)", weight_scale=scale,
        weight_amax=stats.amax if stats is not None else float("nan"),
        relative_weight_error=stats.relative_error if stats is not None else float("nan"), shape=tuple(shape),
        input_scale=in_global, input_amax=in_amax, input_dynamic=True, input_granularity=sch.input_granularity.name,
    )  # fmt: skip


def _finite_or_none(x: float | None) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def build_document(
    *,
    scheme: str,
    layout: str,
    layers: dict[str, dict[str, Any]],
    kv_cache: dict[str, dict[str, float]] | None,
    ignored: dict[str, str],
    calibration: dict[str, Any] | None,
    producer: str,
) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "producer": producer,
        "scheme": scheme,
        "checkpoint_format": layout,
        "element_format": "float8_e4m3fn",
        "scale_convention": "dequantization multiplier: value = fp8 * scale; scale = amax / 448",
        "calibration": calibration,
        "layers": layers,
        "kv_cache": kv_cache or {},
        "not_quantized": ignored,
    }


def write_scales_file(path: Path, doc: dict[str, Any]) -> None:
    """The document with one line per layer: readable, and fast to write. (json.dumps with indent= runs
    the pure-Python encoder: 0.6 s for a 2 GB Llama's 387k per-channel scales, on the critical path;
    the C encoder, used for each layer's entry, takes a tenth of that.)"""
    write_text_atomic(path, scales_text(doc))


def scales_text(doc: dict[str, Any]) -> str:
    """The scales file's text as write_scales_file writes it."""
    return _dumps_one_layer_per_line(doc) + "\n"


def _dumps_one_layer_per_line(doc: dict[str, Any]) -> str:
    def dump(v: Any) -> str:
        return json.dumps(v, allow_nan=False)

    parts = []
    for key, value in doc.items():
        if key == "layers" and isinstance(value, dict) and value:
            body = ",\n".join(f"  {dump(name)}: {dump(entry)}" for name, entry in value.items())
            parts.append(f" {dump(key)}: {{\n{body}\n }}")
        else:
            parts.append(f" {dump(key)}: {dump(value)}")
    return "{\n" + ",\n".join(parts) + "\n}"


def _bad(path: str, what: str) -> MixprecError:
    return MixprecError(f"malformed scales file {path}: {what}")


def _positive_finite(x: Any, path: str, where: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
        raise _bad(path, f"{where} must be a positive finite number, got {x!r}")
    return float(x)


def validate_document(doc: Any, path: str = "<scales>") -> dict[str, Any]:
    """Check structure and values; returns the document. Every problem names the field."""
    if not isinstance(doc, dict):
        raise _bad(path, "top level must be a JSON object")
    version = doc.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise _bad(path, "missing integer 'schema_version'")
    if version > SCHEMA_VERSION:
        raise _bad(path, f"schema_version {version} is newer than this mixprec reads ({SCHEMA_VERSION})")
    layers = doc.get("layers")
    if not isinstance(layers, dict):
        raise _bad(path, "'layers' must be an object of layer name -> entry")
    for name, e in layers.items():
        where = f"layers[{name!r}]"
        if not isinstance(e, dict):
            raise _bad(path, f"{where} must be an object")
        w = e.get("weight")
        if w is not None:
            if not isinstance(w, dict) or not isinstance(w.get("scale"), list):
                raise _bad(path, f"{where}.weight.scale must be a list of numbers")
            for i, s in enumerate(w["scale"]):
                _positive_finite(s, path, f"{where}.weight.scale[{i}]")
            shape = w.get("scale_shape")
            if shape is not None:
                if not (isinstance(shape, list) and all(isinstance(s, int) and s > 0 for s in shape)):
                    raise _bad(path, f"{where}.weight.scale_shape must be a list of positive integers")
                if math.prod(shape) != len(w["scale"]):
                    raise _bad(
                        path, f"{where}.weight.scale has {len(w['scale'])} values, scale_shape {shape}"
                    )
        inp = e.get("input")
        if inp is not None:
            if not isinstance(inp, dict):
                raise _bad(path, f"{where}.input must be an object")
            if "scale" in inp:
                _positive_finite(inp["scale"], path, f"{where}.input.scale")
    kv = doc.get("kv_cache", {})
    if not isinstance(kv, dict):
        raise _bad(path, "'kv_cache' must be an object")
    for name, e in kv.items():
        if not isinstance(e, dict):
            raise _bad(path, f"kv_cache[{name!r}] must be an object")
        for k in (K_SCALE, V_SCALE):
            if k in e:
                _positive_finite(e[k], path, f"kv_cache[{name!r}].{k}")
    return doc


def read_scales_file(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise MixprecError(f"scales file {p} does not exist")
    text = None
    try:
        text = p.read_text()
        doc = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise _bad(str(p), f"not valid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except _NonStandardConstant as e:
        at = text.find(str(e))
        line, col = text.count("\n", 0, at) + 1, at - text.rfind("\n", 0, at)
        raise _bad(
            str(p),
            f"not valid JSON at line {line} column {col}: {e} is not a JSON number "
            "(scales must be positive finite numbers)",
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(str(p), f"not valid JSON ({e})") from None
    return validate_document(doc, str(p))


class _NonStandardConstant(ValueError):
    """NaN / Infinity / -Infinity: Python's json reads them, JSON has no such numbers."""


def _reject_constant(name: str) -> Any:
    raise _NonStandardConstant(name)


def _expected_scales(granularity: Any, shape: tuple[int, int]) -> int | None:
    """How many weight scales a layer of `shape` has under a granularity name (tensor, row,
    block<R>x<C>); None for a name this reader does not know (the count is then not checked)."""
    if granularity in (None, "tensor"):
        return 1 if granularity == "tensor" else None
    if granularity == "row":
        return shape[0]
    m = re.fullmatch(r"block(\d+)x(\d+)", str(granularity))
    if m is None:
        return None
    br, bc = int(m.group(1)), int(m.group(2))
    return math.ceil(shape[0] / br) * math.ceil(shape[1] / bc)


def check_against_checkpoint(doc: dict[str, Any], path: str, weights: dict[str, tuple[int, ...]]) -> None:
    """The document's layers are the checkpoint's: every layer name has a stored 2-D weight
    (`weights`: checkpoint module name -> weight shape), its `shape` is that weight's, and its weight
    scales are as many as its granularity needs for that shape. Each failure names the key path."""
    for name, e in doc.get("layers", {}).items():
        where = f"layers[{name!r}]"
        shape = weights.get(name)
        if shape is None:
            close = [n for n in weights if n.endswith(name.rpartition(".")[2])][:2]
            hint = f" (e.g. {', '.join(close)})" if close else ""
            raise _bad(path, f"{where}: the checkpoint has no Linear weight {name}.weight{hint}")
        if len(shape) != 2:
            raise _bad(path, f"{where}: {name}.weight has shape {list(shape)}, not a 2-D Linear weight")
        if "shape" in e and e["shape"] != list(shape):
            raise _bad(
                path, f"{where}.shape is {e['shape']}, the checkpoint's {name}.weight is {list(shape)}"
            )
        w = e.get("weight")
        if w and "scale" in w:
            need = _expected_scales(
                w.get("granularity") or ("tensor" if len(w["scale"]) == 1 else None), shape
            )
            if need is not None and need != len(w["scale"]):
                raise _bad(
                    path,
                    f"{where}.weight.scale has {len(w['scale'])} values, a {w.get('granularity', 'tensor')} "
                    f"scale of a {list(shape)} weight has {need}",
                )
    for name in doc.get("kv_cache", {}):
        if not any(n.startswith(name + ".") for n in weights):
            raise _bad(path, f"kv_cache[{name!r}]: the checkpoint has no module {name}")


def weight_scale_tensor(entry: dict[str, Any]) -> torch.Tensor | None:
    w = entry.get("weight")
    if not w or "scale" not in w:
        return None
    t = torch.tensor(w["scale"], dtype=torch.float32)
    shape = w.get("scale_shape")
    return t.reshape(shape) if shape else t


def input_scale_tensor(entry: dict[str, Any]) -> torch.Tensor | None:
    inp = entry.get("input") or {}
    return torch.tensor([inp["scale"]], dtype=torch.float32) if "scale" in inp else None


def normalize_hand_scales(scales: Any) -> dict[str, Any]:
    """`scales=` given by hand: a path to a scales file, a full document, or a plain mapping
    {layer: {"weight_scale": tensor|list|float, "input_scale": float}} (also {layer: float}
    meaning a per-tensor input scale is NOT assumed: a bare number is the weight scale)."""
    if isinstance(scales, (str, os.PathLike)):
        return read_scales_file(scales)
    if not isinstance(scales, dict):
        raise MixprecError(f"scales= must be a path or a dict, got {type(scales).__name__}")
    if "schema_version" in scales:
        return validate_document(scales, "scales=")
    layers: dict[str, Any] = {}
    for name, v in scales.items():
        if isinstance(v, (int, float, torch.Tensor, list)):
            v = {WEIGHT_SCALE: v}
        if not isinstance(v, dict):
            raise MixprecError(f"scales[{name!r}] must be a number, tensor or dict, got {type(v).__name__}")
        entry: dict[str, Any] = {}
        if WEIGHT_SCALE in v:
            ws = torch.as_tensor(v[WEIGHT_SCALE], dtype=torch.float32)
            entry["weight"] = {"scale": ws.flatten().tolist(), "scale_shape": list(ws.shape) or [1]}
        if INPUT_SCALE in v:
            entry["input"] = {
                "dynamic": False,
                "scale": float(torch.as_tensor(v[INPUT_SCALE]).reshape(-1)[0]),
            }
        layers[name] = entry
    return validate_document({"schema_version": SCHEMA_VERSION, "layers": layers}, "scales=")
