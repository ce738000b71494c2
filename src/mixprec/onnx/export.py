"""`mixprec export-onnx`: a Hugging Face model directory to an ONNX graph with torch's exporter.

The graph takes what a padded batch needs: `input_ids` and `attention_mask` (int64, [batch, sequence],
both dims dynamic). Causal LMs give `logits`, encoders `last_hidden_state`; no KV cache (a full-sequence
forward: what the FP8 check compares). A causal LM's positions are counted from the mask
(cumsum(mask) - 1, as transformers' generate does), so a left- or right-padded sequence gets the
positions it has alone; an encoder keeps its own position rule (BERT-style: right padding, as their
tokenizers pad).

Before the graph is published it runs in onnxruntime on a padded batch and is compared with torch on
the real (unmasked) tokens; a disagreement beyond VERIFY_RELATIVE_ERROR means nothing is written.

An FP8 checkpoint (a `quantization_config` mixprec loads) is loaded with `load_quantized` and its FP8
Linears dequantized (payload x scale, in fp32): the graph computes exactly what those dequantized
weights compute; the FP8 rounding of activations is not in it (quantize-onnx adds FP8 Q/DQ).
torch's default exporter (torch.export + onnxscript) is used at opset >= 19 so the FP8 types are
available to quantize-onnx.
"""

from __future__ import annotations

import inspect
import math
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from mixprec.conversion import replace_submodule
from mixprec.errors import MixprecError
from mixprec.files import staged_files
from mixprec.hf import check_model_dir, load_model, model_kind
from mixprec.inference.checkpoint.safetensors_io import open_checkpoint
from mixprec.inference.readers.load import load_quantized
from mixprec.inference.runtime.linear import QuantizedLinear
from mixprec.onnx.common import MAX_POSITIONS_KEY, MIN_OPSET, check_output, need_onnx, need_ort
from mixprec.onnx.common import load_model as load_onnx_model

INPUT_NAMES = ["input_ids", "attention_mask"]
# fp32 against fp32: summation order alone moves outputs by ~1e-6 relative; a mask or position bug by
# tens of percent (a padded sentence's pooled vector at cosine 0.83 was the bug this guards against).
VERIFY_RELATIVE_ERROR = 1e-3
VERIFY_BATCH = 3  # a full row, a right-padded row, and a left-padded (LM) or one-token (encoder) row


@dataclass
class ExportReport:
    output: str
    kind: str
    opset: int
    inputs: list[str]
    outputs: list[str]
    max_abs_diff: float | None  # onnxruntime vs torch on the real tokens of the padded check batch
    relative_error: float | None  # ||ort - torch|| / ||torch|| over those tokens
    check_batch: str | None  # what the check ran on, in words
    bytes: int
    dequantized_linears: int = 0  # FP8 Linears of a quantized checkpoint exported dequantized
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


# Protobuf files cannot exceed 2 GB: bigger graphs keep their weights in a side file.
EXTERNAL_DATA_BYTES = 1_800_000_000
# Node metadata the exporter writes; only the module path is kept (quantize-onnx matches --exclude on it).
_KEEP_METADATA = ("pkg.torch.onnx.name_scopes",)


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class _Wrapper(nn.Module):
    """(input_ids, attention_mask) -> one tensor, so the graph has a plain signature whatever the model
    returns."""

    def __init__(self, model: nn.Module, kind: str):
        super().__init__()
        self.model, self.kind = model, kind
        self.positions_from_mask = (
            kind == "causal-lm" and "position_ids" in inspect.signature(model.forward).parameters
        )

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.kind == "causal-lm":
            extra = {}
            if self.positions_from_mask:  # left padding must not shift the real tokens' positions
                extra["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
            return out.logits
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def check_export_inputs(
    model_dir: str | os.PathLike,
    output: str | os.PathLike,
    *,
    opset: int = MIN_OPSET,
    seq_len: int = 16,
    force: bool = False,
) -> dict:
    """Every check that needs no model: paths, opset, lengths. Returns the model's config.json."""
    onnx = need_onnx()
    try:
        import onnxscript  # noqa: F401  torch's exporter needs it
    except ImportError:
        raise MixprecError(
            "export-onnx needs onnxscript (torch's ONNX exporter): pip install 'mixprec[onnx]'"
        ) from None
    newest = newest_opset(onnx)
    if not MIN_OPSET <= opset <= newest:
        raise MixprecError(
            f"--opset {opset}: FP8 Q/DQ needs opset {MIN_OPSET} or later, and torch's exporter goes up to {newest}"
        )
    d = Path(model_dir)
    if d.exists() and not d.is_dir():
        raise MixprecError(
            f"--model {d} is a file; a model directory (config.json + safetensors) is expected"
        )
    config = check_model_dir(d)
    check_output(Path(output), force)
    max_pos = _max_positions(config)
    if seq_len < 2 or (max_pos is not None and seq_len > max_pos):
        limit = f" and at most the model's {max_pos} positions" if max_pos is not None else ""
        raise MixprecError(f"--seq-len {seq_len}: the example sequence needs at least 2 tokens{limit}")
    return config


def export_onnx(
    model_dir: str | os.PathLike,
    output: str | os.PathLike,
    *,
    opset: int = MIN_OPSET,
    seq_len: int = 16,
    force: bool = False,
    verify: bool = True,
) -> ExportReport:
    """Export a local model directory (high-precision or an FP8 checkpoint, dequantized) to `output`
    (.onnx), checked in onnxruntime against torch on a padded batch before it is written."""
    config = check_export_inputs(model_dir, output, opset=opset, seq_len=seq_len, force=force)
    out = Path(output)
    kind = model_kind(config)
    model, dequantized, notes = load_for_export(Path(model_dir), config, kind)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    max_pos = _max_positions(config) or 4096
    gen = torch.Generator().manual_seed(0)
    example_ids = torch.randint(0, vocab, (2, seq_len), generator=gen)
    example_mask = torch.ones(2, seq_len, dtype=torch.long)
    example_mask[1, seq_len // 2 + 1 :] = 0  # trace with padding present, so nothing assumes a full mask
    wrapper = _Wrapper(model, kind).eval()
    out_name = "logits" if kind == "causal-lm" else "last_hidden_state"
    batch, sequence = torch.export.Dim("batch", max=4096), torch.export.Dim("sequence", max=max_pos)
    dims = {name: {0: batch, 1: sequence} for name in INPUT_NAMES}
    with staged_files(out.parent) as tmpdir:
        tmp = tmpdir / out.name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                torch.onnx.export(
                    wrapper, (example_ids, example_mask), str(tmp), dynamo=True, opset_version=opset,
                    input_names=INPUT_NAMES, output_names=[out_name], dynamic_shapes=dims, verbose=False,
                    external_data=_param_bytes(model) > EXTERNAL_DATA_BYTES,
                )  # fmt: skip
            except Exception as exc:
                raise MixprecError(
                    f"torch.onnx.export failed for {model_dir}: {type(exc).__name__}: {str(exc).splitlines()[0]}"
                ) from None
        load_onnx_model(tmp, "exported model")
        diff = rel = where = None
        if verify:
            ids, mask, where = padded_check_batch(kind, vocab, min(max_pos, seq_len + 5))
            diff, rel = _verify(tmp, wrapper, ids, mask)
            if not (rel <= VERIFY_RELATIVE_ERROR):  # NaN fails too
                raise MixprecError(
                    f"onnxruntime disagrees with torch on a padded batch ({where}): relative error {rel:.3g} "
                    f"> {VERIFY_RELATIVE_ERROR:g} on the real tokens; {out} was not written"
                )
        _stamp(tmp, model_dir, kind, _max_positions(config))
    size = sum(f.stat().st_size for f in out.parent.glob(out.name + "*") if f.is_file())
    return ExportReport(str(out), kind, opset, list(INPUT_NAMES), [out_name], diff, rel, where, size,
                        dequantized, notes)  # fmt: skip


def newest_opset(onnx) -> int:
    """The newest opset both torch's exporter declares and the installed onnx knows (asking for a newer
    one makes the exporter print tracebacks while it falls back, then fail)."""
    newest = int(onnx.defs.onnx_opset_version())
    try:
        from torch.onnx import _constants  # where torch declares it; absent in some versions
    except ImportError:
        return newest
    return min(newest, int(getattr(_constants, "ONNX_MAX_OPSET", newest)))


def _max_positions(config: dict) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def load_for_export(
    model_dir: str | os.PathLike, config: dict, kind: str
) -> tuple[nn.Module, int, list[str]]:
    """The model in fp32 eval mode, the number of FP8 Linears dequantized, and notes for the user."""
    model_dir = Path(model_dir)
    # ModelOpt keeps its quantization config beside config.json; load_quantized reads both
    if not config.get("quantization_config") and not (model_dir / "hf_quant_config.json").is_file():
        fp8 = [
            n
            for n, i in open_checkpoint(model_dir).tensors.items()
            if i.dtype.is_floating_point and i.dtype.itemsize == 1
        ]
        if fp8:
            raise MixprecError(
                f"{model_dir} holds FP8 tensors (e.g. {fp8[0]}) but its config.json has no quantization_config "
                "saying how to scale them; export the high-precision model"
            )
        return load_model(model_dir, head=kind).float().eval(), 0, []
    model = load_quantized(model_dir)
    count = 0
    for name, mod in list(model.named_modules()):
        if isinstance(mod, QuantizedLinear):
            plain = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
            plain.weight = nn.Parameter(mod.dequantized_weight(torch.float32), requires_grad=False)
            if mod.bias is not None:
                plain.bias = nn.Parameter(mod.bias.detach().float(), requires_grad=False)
            replace_submodule(model, name, plain)
            count += 1
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.dtype.itemsize == 1 and t.dtype.is_floating_point]  # fmt: skip
    if left:  # a quantized module this export does not know how to dequantize: refuse, never upcast codes
        raise MixprecError(
            f"{model_dir}: {len(left)} FP8 tensors (e.g. {left[0]}) are outside the Linears export-onnx dequantizes; "
            "export the high-precision model"
        )
    scheme = getattr(getattr(model, "mixprec_report", None), "scheme", None) or "fp8"
    if kind == "encoder":  # the base model (hidden states), as load_model(head="encoder") gives
        model = getattr(model, "base_model", model)
    notes = [
        f"{model_dir} is an FP8 checkpoint ({scheme}): its {count} FP8 Linears were dequantized (payload x "
        "scale, fp32); the graph computes with those weights, without the FP8 rounding of activations; "
        "run quantize-onnx on it for FP8 Q/DQ"
    ]
    return model.float().eval(), count, notes


def padded_check_batch(kind: str, vocab: int, length: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, str]:  # fmt: skip
    """(input_ids, attention_mask, description): a full row, a right-padded row, and for causal LMs a
    left-padded row (encoders: a one-token row, since their tokenizers pad on the right)."""
    ids = torch.randint(0, vocab, (VERIFY_BATCH, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(VERIFY_BATCH, length, dtype=torch.long)
    mask[1, max(1, length // 2) :] = 0
    if kind == "causal-lm":
        mask[2, : length // 3] = 0
        rows = "full, right-padded, left-padded rows"
    else:
        mask[2, 1:] = 0
        rows = "full, right-padded, one-token rows"
    return ids, mask, f"{VERIFY_BATCH} x {length}: {rows}"


def _verify(path: Path, wrapper: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(max |diff|, relative L2 error) between onnxruntime and torch over the real tokens."""
    ort = need_ort()
    try:
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:  # e.g. an opset newer than this onnxruntime runs
        raise MixprecError(
            f"onnxruntime {ort.__version__} cannot load the exported graph: {str(exc).splitlines()[0]}"
        ) from None
    got = sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0].astype(np.float64)
    with torch.inference_mode():
        want = wrapper(ids, mask).double().numpy()
    real = mask.numpy().astype(bool)  # what a padded position computes is nobody's output
    diff = got[real] - want[real]
    norm = float(np.linalg.norm(want[real]))
    rel = float(np.linalg.norm(diff)) / norm if norm > 0 else (0.0 if not diff.any() else math.inf)
    return float(np.abs(diff).max()), rel


def _stamp(path: Path, source: str | os.PathLike, kind: str, max_positions: int | None) -> None:
    """Record where the graph came from, so quantize-onnx finds the tokenizer for text calibration,
    and how many positions the model has, so it refuses longer calibration sequences up front."""
    onnx = need_onnx()
    model = onnx.load(str(path), load_external_data=False)  # external weights stay where they are
    for node in model.graph.node:  # stack traces and fx dumps would be most of a small graph's bytes
        keep = [(p.key, p.value) for p in node.metadata_props if p.key in _KEEP_METADATA]
        del node.metadata_props[:]
        for key, value in keep:
            entry = node.metadata_props.add()
            entry.key, entry.value = key, value
    stamps = [("mixprec.source_model", str(Path(source).resolve())), ("mixprec.kind", kind)]
    if max_positions is not None:
        stamps.append((MAX_POSITIONS_KEY, str(max_positions)))
    for key, value in stamps:
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save_model(model, str(path))


__all__ = [
    "INPUT_NAMES",
    "ExportReport",
    "check_export_inputs",
    "export_onnx",
    "load_for_export",
    "newest_opset",
    "padded_check_batch",
]
