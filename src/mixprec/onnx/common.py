"""Shared helpers of the ONNX package: optional imports, loading a model file safely, atomic saving."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from mixprec.errors import MixprecError
from mixprec.files import check_new_output, staged_files

MIN_OPSET = 19  # FP8 types in QuantizeLinear / DequantizeLinear arrived in opset 19
# graph metadata export-onnx writes: the positions of the model it came from (longer inputs fail in ORT)
MAX_POSITIONS_KEY = "mixprec.max_positions"


def need_onnx():
    try:
        import onnx
    except ImportError:
        raise MixprecError("ONNX support needs the 'onnx' extra: pip install 'mixprec[onnx]'") from None
    return onnx


def need_ort():
    try:
        import onnxruntime
    except ImportError:
        raise MixprecError("checking ONNX graphs needs onnxruntime: pip install 'mixprec[onnx]'") from None
    return onnxruntime


def load_model(path: str | os.PathLike, what: str = "ONNX model"):
    """onnx.load with a clear error for a missing file or one that is not an ONNX model."""
    onnx = need_onnx()
    p = Path(path)
    if p.is_dir():
        raise MixprecError(f"{what} {p} is a directory; an .onnx file is expected")
    if not p.is_file():
        raise MixprecError(f"{what} {p} does not exist")
    try:
        model = onnx.load(str(p))
    except Exception as exc:  # protobuf raises DecodeError, RuntimeWarning-like and OSError variants
        raise MixprecError(f"{what} {p} is not an ONNX model ({type(exc).__name__}: {exc})") from None
    if not model.graph.node or not model.graph.output:
        raise MixprecError(f"{what} {p} is not an ONNX model (no graph nodes or outputs)")
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise MixprecError(f"{what} {p} is not a valid ONNX model: {str(exc).splitlines()[0]}") from None
    return model


def run_session(sess, feed: dict, what: str) -> list:
    """sess.run with onnxruntime's failures (shapes, ids out of range) as one-line errors."""
    try:
        return sess.run(None, feed)
    except Exception as exc:  # onnxruntime raises its own pybind exception types
        shapes = {k: list(v.shape) for k, v in feed.items()}
        raise MixprecError(f"onnxruntime failed on {what} {shapes}: {str(exc).splitlines()[0]}") from None


def default_opset(model) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return 0


def check_output(output: Path, force: bool, inputs: tuple[Path, ...] = ()) -> None:
    for i in inputs:
        if i.exists() and output.exists() and output.resolve() == i.resolve():
            raise MixprecError(f"output {output} is the input: inputs are never modified")
    if output.is_dir():
        raise MixprecError(f"output {output} is a directory; give the .onnx file to write")
    check_new_output(output, force)
    if output.suffix != ".onnx":
        raise MixprecError(f"output {output} must end in .onnx")
    parent = next((p for p in output.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise MixprecError(f"output {output}: {parent} is a file, not a directory")


def save_model_atomic(model, output: Path, vet: Callable[[Path], None] | None = None) -> Path:
    """Write beside the target, then rename; graphs over 2 GB keep their weights in `<name>.data`.

    vet(staged_path) runs on the complete staged copy before it is renamed into place: if it raises,
    nothing is published (a graph that fails its check never appears under `output`)."""
    onnx = need_onnx()
    big = model.ByteSize() > 1_900_000_000 if hasattr(model, "ByteSize") else False
    with staged_files(output.parent) as tmpdir:
        tmp = tmpdir / output.name
        if big:
            onnx.save_model(model, str(tmp), save_as_external_data=True, location=output.name + ".data")
        else:
            onnx.save_model(model, str(tmp))
        if vet is not None:
            vet(tmp)
    return output
