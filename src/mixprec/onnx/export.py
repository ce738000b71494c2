"""`mixprec export-onnx`: a Hugging Face model directory to an ONNX graph with torch's exporter.

Causal LMs export `input_ids -> logits`, encoders `input_ids -> last_hidden_state`, with the batch and
sequence dimensions dynamic, and no KV cache (a full-sequence forward: what the FP8 check compares).
torch's default exporter (torch.export + onnxscript) is used; the graph is written at opset >= 19 so
the FP8 types are available to quantize-onnx.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.files import staged_files
from mixprec.hf import load_model, model_kind, read_config
from mixprec.onnx.common import MIN_OPSET, check_output, need_onnx, need_ort
from mixprec.onnx.common import load_model as load_onnx_model


@dataclass
class ExportReport:
    output: str
    kind: str
    opset: int
    inputs: list[str]
    outputs: list[str]
    max_abs_diff: float | None  # onnxruntime vs torch on the example input
    bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


# Protobuf files cannot exceed 2 GB: bigger graphs keep their weights in a side file.
EXTERNAL_DATA_BYTES = 1_800_000_000
# Node metadata the exporter writes; only the module path is kept (quantize-onnx matches --exclude on it).
_KEEP_METADATA = ("pkg.torch.onnx.name_scopes",)


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class _Wrapper(nn.Module):
    """input_ids -> one tensor, so the graph has a plain signature whatever the model returns."""

    def __init__(self, model: nn.Module, kind: str):
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.kind == "causal-lm":
            return self.model(input_ids=input_ids, use_cache=False).logits
        return self.model(input_ids=input_ids).last_hidden_state


def export_onnx(
    model_dir: str | os.PathLike,
    output: str | os.PathLike,
    *,
    opset: int = MIN_OPSET,
    seq_len: int = 16,
    batch: int = 2,
    force: bool = False,
    verify: bool = True,
) -> ExportReport:
    """Export a local model directory (plain high-precision weights) to `output` (.onnx)."""
    need_onnx()
    try:
        import onnxscript  # noqa: F401  torch's exporter needs it
    except ImportError:
        raise MixprecError(
            "export-onnx needs onnxscript (torch's ONNX exporter): pip install 'mixprec[onnx]'"
        ) from None
    if opset < MIN_OPSET:
        raise MixprecError(f"--opset {opset}: FP8 Q/DQ needs opset {MIN_OPSET} or later")
    out = Path(output)
    check_output(out, force)
    config = read_config(model_dir)
    if config.get("quantization_config"):
        raise MixprecError(
            f"{model_dir} is a quantized checkpoint: export the high-precision model, then run quantize-onnx"
        )
    kind = model_kind(config)
    model = load_model(model_dir, head=kind).float().eval()
    vocab = int(model.get_input_embeddings().weight.shape[0])
    max_pos = int(getattr(model.config, "max_position_embeddings", 512) or 512)
    seq_len = max(2, min(seq_len, max_pos))
    example = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    wrapper = _Wrapper(model, kind).eval()
    out_name = "logits" if kind == "causal-lm" else "last_hidden_state"
    dims = {
        "input_ids": {0: torch.export.Dim("batch", max=4096), 1: torch.export.Dim("sequence", max=max_pos)}
    }
    with staged_files(out.parent) as tmpdir:
        tmp = tmpdir / out.name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                torch.onnx.export(
                    wrapper, (example,), str(tmp), dynamo=True, opset_version=opset, input_names=["input_ids"],
                    output_names=[out_name], dynamic_shapes=dims, verbose=False,
                    external_data=_param_bytes(model) > EXTERNAL_DATA_BYTES,
                )  # fmt: skip
            except Exception as exc:
                raise MixprecError(
                    f"torch.onnx.export failed for {model_dir}: {type(exc).__name__}: {exc}"
                ) from None
        onnx_model = load_onnx_model(tmp, "exported model")
        diff = _verify(tmp, wrapper, example) if verify else None
        _stamp(tmp, onnx_model, model_dir, kind)
    size = sum(f.stat().st_size for f in out.parent.glob(out.name + "*") if f.is_file())
    return ExportReport(str(out), kind, opset, ["input_ids"], [out_name], diff, size)


def _stamp(path: Path, model, source: str | os.PathLike, kind: str) -> None:
    """Record where the graph came from, so quantize-onnx finds the tokenizer for text calibration."""
    onnx = need_onnx()
    model = onnx.load(str(path), load_external_data=False)  # external weights stay where they are
    for node in model.graph.node:  # stack traces and fx dumps would be most of a small graph's bytes
        keep = [(p.key, p.value) for p in node.metadata_props if p.key in _KEEP_METADATA]
        del node.metadata_props[:]
        for key, value in keep:
            entry = node.metadata_props.add()
            entry.key, entry.value = key, value
    for key, value in (("mixprec.source_model", str(Path(source).resolve())), ("mixprec.kind", kind)):
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save_model(model, str(path))


def _verify(path: Path, wrapper: nn.Module, example: torch.Tensor) -> float:
    ort = need_ort()
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input_ids": example.numpy()})[0]
    with torch.inference_mode():
        want = wrapper(example).float().numpy()
    return float(abs(got - want).max())


__all__ = ["ExportReport", "export_onnx"]
