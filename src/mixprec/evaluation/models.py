"""The two models of an evaluation: loading, deriving an online candidate, checking they are comparable."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.evaluation.inputs import ARCH_KEYS
from mixprec.evaluation.memory import tensor_bytes_by_dtype, weight_bytes_in_memory, weight_bytes_on_disk
from mixprec.hf import load_model, model_kind, read_config, vocab_size
from mixprec.inference.algorithms.spec import AlgorithmSpec
from mixprec.inference.checkpoint.configs import parse_quantization_config
from mixprec.inference.checkpoint.scales_file import find_scales_file
from mixprec.inference.readers.load import load_quantized
from mixprec.inference.runtime.linear import decoded_cache_bytes
from mixprec.inference.runtime.online import apply_scheme_
from mixprec.inference.schemes import SCHEMES
from mixprec.kernels import bf16_cpu
from mixprec.kernels.hardware import detect

# every scheme `mixprec quantize` writes, derived online from the reference, and the bf16 cast
CANDIDATE_SCHEMES = (*SCHEMES, "bf16")


@dataclass
class Side:
    """One model of the comparison and what is known about where it came from."""

    model: nn.Module
    source: str
    kind: str  # "causal-lm", "encoder" or "image-text"
    directory: Path | None = None
    scheme: str | None = None
    info: dict = field(default_factory=dict)
    hooks: Any = None  # bf16 CPU compute hooks, kept alive with the model

    def describe(self) -> dict:
        cfg = getattr(self.model, "config", None)
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in self.model.parameters()})
        return {
            "source": self.source,
            "scheme": self.scheme,
            "kind": self.kind,
            "class": type(self.model).__name__,
            "model_type": getattr(cfg, "model_type", None),
            "parameter_dtypes": dtypes,
            # every tensor the model holds (FP8 payloads and scales are buffers or attributes, not parameters)
            "tensor_bytes_by_dtype": tensor_bytes_by_dtype(self.model),
            "weight_bytes_disk": weight_bytes_on_disk(self.directory),
            "weight_bytes_memory": weight_bytes_in_memory(self.model),
            # of which the bf16 copies of quantized weights (the decoded-weight cache), when held
            "decoded_weight_cache_bytes": decoded_cache_bytes(self.model),
            **self.info,
        }


def kind_of_model(model: nn.Module) -> str:
    cfg = getattr(model, "config", None)
    if cfg is not None and model_kind(cfg.to_dict() if hasattr(cfg, "to_dict") else {}) == "causal-lm":
        return "causal-lm"
    name = type(model).__name__
    return "causal-lm" if name.endswith(("ForCausalLM", "LMHeadModel")) else "encoder"


def load_dir(directory: str | os.PathLike, role: str) -> Side:
    """A model directory: quantized checkpoints through mixprec.load_quantized, others through transformers
    (a causal LM with its head, an encoder as its base model)."""
    d = Path(directory)
    cfg = read_config(d, role=f"{role} model")
    kind = model_kind(cfg)
    scheme, info = None, {}
    if cfg.get("quantization_config"):
        scheme, info["checkpoint_layout"] = checkpoint_scheme(cfg["quantization_config"], d / "config.json")
        model = load_quantized(d)
    elif role == "candidate" and find_scales_file(d) is not None:
        # high-precision weights with model.fp8_scales.json beside them: quantized with those scales
        # (load_quantized checks the file first; a corrupt one is an error naming it and where)
        model = load_quantized(d)
        scheme = next((e["scheme"] for e in model.mixprec_report.layers.values()), None)
        info["checkpoint_layout"] = "scales-file"
    else:
        model = load_model(d, head=kind, role=f"{role} model")
    model.eval()
    return Side(model, str(d), kind, directory=d, scheme=scheme, info=info)


def checkpoint_scheme(quantization_config: dict, where: str | os.PathLike) -> tuple[str, str]:
    """(scheme, layout) a checkpoint's quantization_config describes: "fp8-dynamic" and
    "compressed-tensors", say; several groups of different schemes are joined with "+"."""
    spec = parse_quantization_config(quantization_config, str(where))
    names = dict.fromkeys(layout.as_scheme().name for _, layout in spec.groups)
    return "+".join(names), spec.layout


def as_side(obj: str | os.PathLike | nn.Module, role: str) -> Side:
    if isinstance(obj, nn.Module):
        obj.eval()
        return Side(obj, f"<{type(obj).__name__} object>", kind_of_model(obj))
    if isinstance(obj, (str, os.PathLike)):
        return load_dir(obj, role)
    raise MixprecError(f"{role} must be a model directory or a torch.nn.Module, got {type(obj).__name__}")


def derive_candidate(reference: Side, scheme: str, calib_batches: list[torch.Tensor] | None,
                     algorithm: AlgorithmSpec | None = None) -> Side:  # fmt: skip
    """A copy of the reference, quantized online (any scheme, rounded by `algorithm` when given) or
    cast to bf16."""
    scheme = scheme.strip().lower()
    if scheme not in CANDIDATE_SCHEMES:
        raise MixprecError(f"unknown --candidate-scheme {scheme!r}; known: {', '.join(CANDIDATE_SCHEMES)}")
    model = copy.deepcopy(reference.model)
    info: dict = {}
    if scheme == "bf16":
        model = model.to(torch.bfloat16)  # the CPU compute hooks are installed by install_low_precision_hooks
    else:
        report = apply_scheme_(model, scheme, calib_data=calib_batches, algorithm=algorithm)
        info["quantization_report"] = _summarize_report(report)
        if report.algorithm is not None:
            info["algorithm"] = algorithm_summary(report.algorithm)
    model.eval()
    label = scheme if algorithm is None or not algorithm.names else f"{scheme}+{algorithm.label}"
    return Side(model, f"online:{label} of {reference.source}", reference.kind, scheme=scheme, info=info)


def algorithm_summary(record: dict) -> dict:
    """What an evaluation records of the algorithm that rounded its candidate: the record without its
    per-layer table, and the median over layers of the calibration output error against round to
    nearest's (None for data-free algorithms, which record no layers)."""
    errors = sorted(
        r["output_error"] / r["output_error_rtn"]
        for r in record.get("layers", {}).values()
        if r["output_error_rtn"] > 0
    )
    summary = {k: v for k, v in record.items() if k != "layers"}
    summary["layers"] = len(record.get("layers", {}))
    summary["median_output_error_vs_rtn"] = errors[len(errors) // 2] if errors else None
    return summary


def install_low_precision_hooks(side: Side) -> None:
    """bf16/fp16 models on a CPU without fast bf16: compute GEMMs in fp32 and round the results
    (mixprec.kernels.bf16_cpu), which is also what a GPU bf16 GEMM gives. Call after moving the model."""
    if side.hooks is not None or not any(
        p.dtype in (torch.bfloat16, torch.float16) for p in side.model.parameters()
    ):
        return
    side.info["bf16_compute"] = "native bf16 kernels"
    if bf16_cpu.should_install(side.model) and not detect().cpu_bf16_native:
        side.hooks = bf16_cpu.install(side.model)
        side.info["bf16_compute"] = "fp32 GEMMs rounded to bf16 (mixprec.kernels.bf16_cpu)"


def _summarize_report(report: Any) -> Any:
    if report is None:
        return None
    if hasattr(report, "to_dict"):
        report = report.to_dict()
    if isinstance(report, dict):
        return {k: v for k, v in report.items() if isinstance(v, (str, int, float, bool, type(None)))} or str(
            report
        )[:500]
    return str(report)[:500]


def _config_dict(model: nn.Module) -> dict:
    cfg = getattr(model, "config", None)
    return cfg.to_dict() if hasattr(cfg, "to_dict") else {}


def check_compatible(
    reference: Side, candidate: Side, ref_vocab: dict | None, cand_vocab: dict | None
) -> None:
    """Refuse comparisons that make no sense: different architectures or vocabularies."""
    a, b = _config_dict(reference.model), _config_dict(candidate.model)
    for key in ARCH_KEYS:
        if key in a and key in b and a[key] != b[key]:
            raise MixprecError(
                f"architecture mismatch: reference {reference.source} has {key}={a[key]!r}, "
                f"candidate {candidate.source} has {key}={b[key]!r}"
            )
    if reference.kind != candidate.kind:
        raise MixprecError(
            f"architecture mismatch: reference {reference.source} is a {reference.kind}, candidate is a {candidate.kind}"
        )
    va, vb = vocab_size(reference.model), vocab_size(candidate.model)
    if va is not None and vb is not None and va != vb:
        raise MixprecError(
            f"vocabulary mismatch: reference {reference.source} has {va} tokens, candidate {candidate.source} has {vb}"
        )
    if ref_vocab is not None and cand_vocab is not None and ref_vocab != cand_vocab:
        differ = len(set(ref_vocab.items()) ^ set(cand_vocab.items()))
        raise MixprecError(
            f"vocabulary mismatch: the tokenizers of {reference.source} and {candidate.source} differ "
            f"({differ} token/id pairs differ)"
        )


__all__ = [
    "CANDIDATE_SCHEMES",
    "Side",
    "as_side",
    "check_compatible",
    "checkpoint_scheme",
    "derive_candidate",
    "load_dir",
]
