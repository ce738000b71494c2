"""The fold stage on a loaded model: an AlgorithmSpec's folds (rotate -> smoothquant -> awq, the spec's
run order) applied in place, one record per fold. The one loop both entries run: the offline
quantization (producers/quantize_folds.py, which saves the folded model and quantizes from it) and a
live model's (runtime/online.py, `quantize_model_` and `evaluate --candidate-scheme`), so that the two
fold the same model the same way and round the same weights (tested bit for bit)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.inference.algorithms.awq import awq_model_
from mixprec.inference.algorithms.rotation import rotate_model_
from mixprec.inference.algorithms.smoothquant import smoothquant_model_
from mixprec.inference.algorithms.spec import FOLDS, ROTATE, SMOOTHQUANT, AlgorithmSpec
from mixprec.inference.calibration.data import tokens_sha256
from mixprec.inference.schemes import InferenceScheme


def fold_names(spec: AlgorithmSpec) -> list[str]:
    """The spec's folds, in run order."""
    return [n for n in spec.names if n in FOLDS]


def folds_need_data(spec: AlgorithmSpec) -> bool:
    """Whether a fold of the spec observes calibration activations (all but the rotation)."""
    return any(n != ROTATE for n in fold_names(spec))


def fold_model_(model: nn.Module, spec: AlgorithmSpec, batches: Sequence[torch.Tensor] | None,
                schemes: Mapping[str, InferenceScheme]) -> dict[str, Any]:  # fmt: skip
    """Fold `spec`'s folds into `model` in place, in run order; {fold: its JSON-ready record}.
    batches: token-id tensors [batch, seq] (SmoothQuant and AWQ observe them; the rotation needs none).
    schemes: {Linear name: its scheme} of the Linears that will be quantized (AWQ searches each with
    its own rounding). The rotation's fp64 matrices are left out of its record: the seed rebuilds them."""
    params = spec.folds
    if folds_need_data(spec) and not batches:
        raise MixprecError(
            f"--algorithm {spec.label}: the folds {', '.join(fold_names(spec))} need calibration data"
        )
    record: dict[str, Any] = {}
    for name in fold_names(spec):
        if name == ROTATE:
            rec = rotate_model_(model, seed=params.seed, r2=params.r2)
            rec = {k: v for k, v in rec.items() if k != "matrices"}
        elif name == SMOOTHQUANT:
            rec = smoothquant_model_(model, batches, alpha=params.alpha)
        else:  # AWQ: its search rounds with each target's own scheme
            rec = awq_model_(model, batches, dict(schemes), n_grid=params.n_grid, scales=params.awq_scales)
        if name != ROTATE:  # the data folds name their tokens, as GPTQ's record does
            rec["data_sha256"] = tokens_sha256(batches)
        record[name] = rec
    return record


__all__ = ["fold_model_", "fold_names", "folds_need_data"]
